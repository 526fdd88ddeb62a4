"""Whether an engine's decode state fits the memory it will be placed in, asked before anything is
allocated: the KV cache's bytes from the model's config alone (no weights), what the state's
arrays take on each memory (host RAM for CPU devices, each accelerator its own), what is free
there, and a refusal that names both. Arithmetic and memory queries only: it allocates nothing.
"""

from __future__ import annotations

import collections
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hcjax.model.attention import attention_cache_entries
from hcjax.model.config import ModelConfig

__all__ = ["MARGIN", "KVCacheTooLarge", "check_decode_state", "host_available_bytes",
           "kv_cache_bytes", "memory_available", "placed_bytes"]

# Share of the free memory the decode state may not take: what the engine and server allocate
# after it (a prompt's wide prefill cache is one more slot's worth of KV per prompt in flight,
# bulk prefill several), the step's activations and logits, XLA's temporaries, weight pushes'
# copies, and the rest of the process. Weights already placed are not free memory to begin with.
MARGIN = 0.25


class KVCacheTooLarge(ValueError):
    """An engine's decode state would not fit in the memory it is placed in."""


def kv_cache_bytes(cfg: ModelConfig, slots: int, max_len: int, *, kv_layout: str = "slot",
                   page_size: int = 16, num_pages: int | None = None,
                   batch_shards: int = 1) -> int:
    """Bytes of an engine's KV cache for `slots` sequences of up to `max_len` positions (what
    `init_cache` / `init_paged_cache` of `cfg` allocate).

    Per layer, one position holds every cache entry (K and V per KV head; MLA's compressed latent
    and RoPE key) in the compute dtype. A local (sliding-window) layer holds min(window, max_len)
    positions a slot, a global one max_len (kv_layout="slot"), each with an int32 position; with
    kv_layout="paged" a global layer holds its pool instead, num_pages x page_size positions
    (None: the engine's default, every slot at max_len plus a scratch page per batch shard) and
    an int32 page table [slots, ceil(max_len / page_size)]. In exact mode
    (`ModelConfig.batch_invariant`) local layers are sized as global ones.
    """
    if kv_layout not in ("slot", "paged"):
        raise ValueError(f"kv_layout={kv_layout!r} is not 'slot' or 'paged'")
    item = np.dtype(cfg.compute_dtype).itemsize
    position = sum(math.prod(shape) for shape in attention_cache_entries(cfg).values()) * item
    max_pages = -(-max_len // page_size)
    if num_pages is None:
        num_pages = slots * max_pages + batch_shards
    total = 0
    for layer in range(cfg.num_layers):
        if cfg.attention_kind(layer) == "local" and not cfg.batch_invariant:
            total += slots * min(cfg.window, max_len) * (position + 4)
        elif kv_layout == "slot":
            total += slots * max_len * (position + 4)
        else:
            total += num_pages * page_size * position + slots * max_pages * 4
    return total


def placed_bytes(shapes: Any, shardings: Any = None,
                 device: jax.Device | None = None) -> dict[jax.Device, int]:
    """Bytes each device holds of the abstract arrays `shapes` placed with `shardings` (a tree
    of shardings like it; a replicated array counts on every device that holds a copy), or all
    on `device` (default: the first device) when None."""
    nbytes = [math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes)]
    if shardings is None:
        return {device or jax.devices()[0]: sum(nbytes)}
    out: dict[jax.Device, int] = collections.Counter()
    for x, n, sharding in zip(jax.tree.leaves(shapes), nbytes, jax.tree.leaves(shardings),
                              strict=True):
        shard = n // math.prod(x.shape) * math.prod(sharding.shard_shape(x.shape)) if n else 0
        for d in sharding.device_set:
            out[d] += shard
    return dict(out)


def _memory_of(device: jax.Device) -> str:
    return "host RAM" if device.platform == "cpu" else f"the memory of {device}"


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def host_available_bytes() -> int | None:
    """Host RAM a new allocation can take without swapping or the OOM killer: /proc/meminfo's
    MemAvailable (else free pages from sysconf), and no more than the cgroup's limit minus its
    usage where the process runs under one (a container's limit is what its OOM killer
    enforces). None when neither can be read."""
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except OSError:
        pass
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            free = None
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        cap, used = _read_int(limit), _read_int(usage)
        if cap is not None and used is not None and cap < 1 << 60:  # v1's "no limit" is ~2**63
            free = cap - used if free is None else min(free, cap - used)
    return free


def _device_free(device: jax.Device) -> int | None:
    """An accelerator's bytes_limit minus bytes_in_use (XLA's allocator), None where the device
    does not say (an abstract TPU topology's devices, some plugins)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - any backend that cannot report: the check is skipped
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def memory_available(devices: Sequence[jax.Device]) -> dict[str, int | None]:
    """Free bytes of each memory the devices use, by name: "host RAM" for CPU devices (they share
    it), each accelerator its own; None where it cannot be measured."""
    out: dict[str, int | None] = {}
    for d in devices:
        name = _memory_of(d)
        if name not in out:
            out[name] = host_available_bytes() if d.platform == "cpu" else _device_free(d)
    return out


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB ({int(n):,} bytes)"


def check_decode_state(need: Mapping[jax.Device, int], cache: Mapping[jax.Device, int],
                       free: Mapping[str, int | None], *, cfg: ModelConfig | None, slots: int,
                       max_len: int, kv_layout: str, page_size: int, num_pages: int | None,
                       batch_shards: int) -> None:
    """Raise KVCacheTooLarge, naming the bytes needed and available, when the decode state
    (`need` bytes per device, `cache` of them its KV cache, of an engine with these sizes) takes
    more than 1 - MARGIN of the free memory of any memory it lands in (`free`, from
    `memory_available`); a memory that cannot be measured is not checked. The message suggests
    what would fit: fewer slots (slot layout), and with a model config the largest pool of the
    paged layout that would."""
    per_memory: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for d, n in need.items():
        per_memory[_memory_of(d)][0] += n
        per_memory[_memory_of(d)][1] += cache.get(d, 0)
    for memory, (total, kv) in per_memory.items():
        avail = free.get(memory)
        if avail is None or total <= (1 - MARGIN) * avail:
            continue
        budget = (1 - MARGIN) * max(avail, 0)
        fits = int(budget // (total / slots)) if kv_layout == "slot" else 0
        paged = None
        if cfg is not None:
            # The placement's copies of the cache (replicas over mesh axes it is not split on)
            # scale any layout alike: what lands here over the config's own figure.
            scale = kv / max(1, kv_cache_bytes(cfg, slots, max_len, kv_layout=kv_layout,
                                               page_size=page_size, num_pages=num_pages,
                                               batch_shards=batch_shards))
            paged = _paged_hint(cfg, budget, total - kv, scale, slots, max_len, page_size,
                                batch_shards)
        hints = [f"max_concurrent_decodes={fits}" if fits else None, paged]
        hint = " or ".join(h for h in hints if h)
        raise KVCacheTooLarge(
            f"the engine's decode state needs {_gib(total)} of {memory} (KV cache {_gib(kv)}: "
            f"{slots} slots x {max_len} positions, kv_layout={kv_layout!r}), but {_gib(avail)} "
            f"is available and {MARGIN:.0%} of it is kept for prefill caches, activations and "
            f"the rest of the process; size the engine to the requests' prompt + response "
            f"tokens (max_target_length)" + (f", or use {hint}" if hint else ""))


def _paged_hint(cfg: ModelConfig, budget: float, rest: int, scale: float, slots: int,
                max_len: int, page_size: int, ways: int) -> str | None:
    """kv_layout='paged' with the largest pool of pages whose cache (times `scale`) and the
    state's `rest` fit `budget`, or None when no pool holding one max_len sequence per batch
    shard does."""
    fixed = kv_cache_bytes(cfg, slots, max_len, kv_layout="paged", page_size=page_size,
                           num_pages=0)
    per_page = kv_cache_bytes(cfg, slots, max_len, kv_layout="paged", page_size=page_size,
                              num_pages=1) - fixed
    room = (budget - rest) / scale - fixed
    if per_page <= 0 or room <= 0:
        return None
    pages = int(room // per_page) // ways * ways
    if pages < ways * (-(-max_len // page_size) + 1):
        return None
    paged = rest + scale * (fixed + pages * per_page)
    return (f"kv_layout='paged' with num_pages={pages} ({_gib(paged)}: on average "
            f"{(pages - ways) * page_size // slots} positions a slot, taken as sequences grow)")
