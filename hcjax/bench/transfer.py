"""`python -m hcjax.bench.transfer`: weight transfer learner layout (fsdp x tensor, fp32, devices
0-3) -> inference layout (tensor only, bf16, devices 4-7), our plan executor vs whole-tree
`jax.device_put` vs gather-to-host-then-scatter, for a tiny and a mid-size transformer pytree.

Reports plan-build time, execution times (and their ratios; `ours_over_device_put` at most 1.0
is the goal), bytes moved vs ideal, device copies and peak extra resident memory. Runs on 8 forced
host devices when no accelerator is set up. Prints one JSON object as its last line; timings are
not asserted.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hcjax.display import Phases
from hcjax.transfer import Cast, LocalTransfer, make_plan
from hcjax.transfer.local import CHUNK_BYTES, PACK_BELOW


@dataclasses.dataclass(frozen=True)
class Shape:
    vocab: int
    d_model: int
    layers: int  # even layers dense SwiGLU, odd layers MoE (RECIPE §2 alternates them)
    heads: int
    kv_heads: int
    head_dim: int
    d_ff: int
    experts: int
    expert_ff: int


# Synthetic trees; `--sizes model` uses hcjax.model's default Transformer (~6.6M parameters).
SIZES = {
    "tiny": Shape(2048, 128, 4, 4, 2, 32, 512, 8, 128),  # ~1.4M parameters
    "mid": Shape(32000, 1024, 8, 16, 8, 64, 4096, 16, 768),  # ~208M parameters
}

# (shape, learner spec on fsdp x tensor, inference spec on tensor) for each kind of leaf.
LAYOUTS = {
    "embed": (P("tensor", "fsdp"), P("tensor", None)),
    "q": (P("fsdp", "tensor"), P(None, "tensor")),
    "kv": (P("fsdp", "tensor"), P(None, "tensor")),
    "o": (P("tensor", "fsdp"), P("tensor", None)),
    "up": (P("fsdp", "tensor"), P(None, "tensor")),
    "down": (P("tensor", "fsdp"), P("tensor", None)),
    "router": (P("fsdp", None), P()),
    "experts_in": (P(None, "fsdp", "tensor"), P(None, None, "tensor")),
    "experts_out": (P(None, "tensor", "fsdp"), P(None, "tensor", None)),
    "norm": (P(), P()),
}


def param_shapes(s: Shape) -> dict[str, Any]:
    """A transformer-shaped tree of (shape, layout kind): embedding, per-layer attention q/k/v/o,
    dense SwiGLU and stacked MoE experts, norms."""
    layers = {}
    for i in range(s.layers):
        layer = {
            "attn": {
                "q": ((s.d_model, s.heads * s.head_dim), "q"),
                "k": ((s.d_model, s.kv_heads * s.head_dim), "kv"),
                "v": ((s.d_model, s.kv_heads * s.head_dim), "kv"),
                "o": ((s.heads * s.head_dim, s.d_model), "o"),
            },
            "attn_norm": ((s.d_model,), "norm"),
            "ffn_norm": ((s.d_model,), "norm"),
        }
        if i % 2 == 0:
            layer["mlp"] = {
                "gate": ((s.d_model, s.d_ff), "up"),
                "up": ((s.d_model, s.d_ff), "up"),
                "down": ((s.d_ff, s.d_model), "down"),
            }
        else:
            layer["moe"] = {
                "router": ((s.d_model, s.experts), "router"),
                "w_in": ((s.experts, s.d_model, s.expert_ff), "experts_in"),
                "w_out": ((s.experts, s.expert_ff, s.d_model), "experts_out"),
            }
        layers[str(i)] = layer
    return {
        "embed": ((s.vocab, s.d_model), "embed"),
        "layers": layers,
        "final_norm": ((s.d_model,), "norm"),
    }


def _is_spec(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], str)


def build_trees(size: Shape, learner: Mesh, inference: Mesh):
    """Source ShapeDtypeStructs (fp32 on the learner) and inference shardings (bf16 by cast)."""
    shapes = param_shapes(size)
    source = jax.tree.map(
        lambda spec: jax.ShapeDtypeStruct(
            spec[0], jnp.float32, sharding=NamedSharding(learner, LAYOUTS[spec[1]][0])
        ),
        shapes,
        is_leaf=_is_spec,
    )
    destination = jax.tree.map(
        lambda spec: NamedSharding(inference, LAYOUTS[spec[1]][1]), shapes, is_leaf=_is_spec
    )
    return source, destination


def materialise(source: Any, seed: int = 0) -> Any:
    """Random fp32 parameters, generated directly in their learner sharding."""
    leaves, treedef = jax.tree.flatten(source)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    arrays = [
        jax.jit(
            lambda k, s=leaf: jax.random.normal(k, s.shape, s.dtype) * 0.02,
            out_shardings=leaf.sharding,
        )(key)
        for key, leaf in zip(keys, leaves, strict=True)
    ]
    return jax.block_until_ready(jax.tree.unflatten(treedef, arrays))


_LIBC = ctypes.CDLL("libc.so.6")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise ValueError(f"field={field!r} is not in /proc/self/status")


def run_once(fn: Callable[[], Any]) -> dict[str, float]:
    """Time one call, with the resident-memory high-water mark reset just before it.

    On CPU the 'devices' share host memory, so RSS is where every buffer shows; the peak above
    the level at entry includes the destination tree the call returns.
    """
    gc.collect()
    _LIBC.malloc_trim(0)  # hand freed heap pages back, so that earlier runs do not hide growth
    base = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    del out
    return {"s": seconds, "peak_extra": (peak - base) * 1024}


def measure(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, dict[str, float]]:
    """First call of each (compiles included), then `repeats` rounds interleaving the methods,
    so that load from other processes on this machine hits them alike; medians are reported."""
    first = {name: run_once(fn)["s"] for name, fn in fns.items()}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            runs[name].append(run_once(fn))
    return {
        name: {
            "first_s": first[name],
            "median_s": statistics.median(r["s"] for r in rs),
            "peak_extra_rss_bytes": int(statistics.median(r["peak_extra"] for r in rs)),
        }
        for name, rs in runs.items()
    }


def model_trees(learner: Mesh, inference: Mesh):
    """The same two layouts for hcjax.model's default `Transformer`, from its logical axes
    (learner: the project's rules; inference: the same with `embed` unsharded, so tensor only)."""
    # after the flags: --help stays fast (flax and hcjax.model add 0.3 s to JAX)
    from flax import nnx

    from hcjax import sharding as shd
    from hcjax.model.config import ModelConfig
    from hcjax.model.transformer import abstract_model, param_shardings

    _, abstract = abstract_model(ModelConfig())
    # The meshes must carry the project's axis names; same devices, unit axes added.
    learner_mesh = shd.make_mesh(shd.MeshConfig(fsdp=2, tensor=2), list(learner.devices.flat))
    inference_mesh = shd.make_mesh(shd.MeshConfig(fsdp=1, tensor=4), list(inference.devices.flat))
    learner_sh = nnx.to_pure_dict(param_shardings(abstract, learner_mesh))
    rules = dict(shd.LOGICAL_RULES, embed=None)
    destination = nnx.to_pure_dict(param_shardings(abstract, inference_mesh, rules))
    source = jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
        nnx.to_pure_dict(abstract),
        learner_sh,
    )
    return source, destination


def bench_size(
    name: str,
    repeats: int,
    max_in_flight: int,
    pack_below: int = PACK_BELOW,
    chunk_bytes: int = CHUNK_BYTES,
) -> dict[str, Any]:
    devices = np.array(jax.devices())
    learner = Mesh(devices[:4].reshape(2, 2), ("fsdp", "tensor"))
    inference = Mesh(devices[4:8], ("tensor",))
    if name == "model":
        source_specs, destination = model_trees(learner, inference)
    else:
        source_specs, destination = build_trees(SIZES[name], learner, inference)

    t0 = time.perf_counter()
    plan = make_plan(source_specs, destination, {"*": Cast(jnp.bfloat16)})
    plan_s = time.perf_counter() - t0

    params = materialise(source_specs)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    fp32_bytes = 4 * n_params
    dst_flat = jax.tree.leaves(destination)

    transfer = LocalTransfer(
        plan, max_bytes_in_flight=max_in_flight, pack_below=pack_below, chunk_bytes=chunk_bytes
    )

    def ours():
        result = transfer.run(params)
        ours.peak_in_flight = result.peak_bytes_in_flight
        ours.copies = result.copies
        return plan.unflatten(result.leaves)

    def whole_tree_device_put():
        # Cast where the data is (learner layout), then one device_put of the whole tree.
        cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
        return jax.device_put(cast, destination)

    def gather_then_scatter():
        host = [np.asarray(x).astype(jnp.bfloat16) for x in jax.tree.leaves(params)]
        out = [jax.device_put(h, s) for h, s in zip(host, dst_flat, strict=True)]
        return jax.tree.unflatten(jax.tree.structure(params), out)

    results = measure(
        {"ours": ours, "device_put": whole_tree_device_put, "gather_scatter": gather_then_scatter},
        repeats,
    )
    results["ours"]["peak_bytes_in_flight"] = ours.peak_in_flight
    results["ours"]["device_copies"] = ours.copies
    for r in results.values():  # what each method needs beyond the destination tree itself
        r["peak_extra_over_output_bytes"] = r["peak_extra_rss_bytes"] - plan.ideal_bytes

    mine, theirs = ours(), whole_tree_device_put()
    equal = all(
        bool(np.array_equal(np.asarray(a), np.asarray(b)))
        and a.sharding.is_equivalent_to(b.sharding, a.ndim)
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs), strict=True)
    )
    del mine, theirs

    ours_s = results["ours"]["median_s"]
    record = {
        "params": n_params,
        "fp32_bytes": fp32_bytes,
        "plan_build_s": plan_s,
        "entries": len(plan.entries),
        "bytes_moved": plan.bytes_moved,
        "ideal_bytes": plan.ideal_bytes,
        "bytes_across_devices": plan.bytes_across_devices,
        # The baselines' traffic, counted by construction: gather reads every fp32 element once,
        # then scatters every destination shard in bf16.
        "gather_scatter_bytes": fp32_bytes + plan.ideal_bytes,
        "max_bytes_in_flight": max_in_flight,
        "pack_below": pack_below,
        "chunk_bytes": chunk_bytes,
        "outputs_equal_device_put": equal,
        "ours_over_device_put": ours_s / results["device_put"]["median_s"],
        "device_put_over_ours": results["device_put"]["median_s"] / ours_s,
        "gather_scatter_over_ours": results["gather_scatter"]["median_s"] / ours_s,
        **{f"{k}_{m}": v for k, r in results.items() for m, v in r.items()},
    }
    print(f"[{name}] {plan}".splitlines()[0], flush=True)
    print(
        f"[{name}] "
        + ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()
        ),
        flush=True,
    )
    return record


EXAMPLES = """examples:
  python -m hcjax.bench.transfer                       # plan executor vs device_put, all sizes
  python -m hcjax.bench.transfer --sizes tiny --repeats 5

The last line on stdout is one JSON object; progress goes to stderr.
"""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES)
    parser.add_argument(
        "--sizes",
        default="tiny,mid,model",
        help=f"comma-separated of {','.join(SIZES)} and model (hcjax.model's default config)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max_bytes_in_flight", type=int, default=64 << 20)
    parser.add_argument(
        "--pack_below", type=int, default=PACK_BELOW,
        help="pieces smaller than this many bytes are batched into a few device copies")
    parser.add_argument("--chunk_bytes", type=int, default=CHUNK_BYTES)
    args = parser.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES and s != "model"]
    if unknown:
        raise ValueError(f"--sizes has {unknown}, expected some of {sorted(SIZES)} or model")
    if len(jax.devices()) < 8:
        raise ValueError(f"{len(jax.devices())} devices: this benchmark needs 8 (4 + 4)")
    measured = {}
    with Phases("hcjax.bench.transfer").phase("measuring", total=len(sizes)) as phase:
        for s in sizes:
            phase.now(s)
            measured[s] = bench_size(
                s, args.repeats, args.max_bytes_in_flight, args.pack_below, args.chunk_bytes
            )
            phase.advance()
    out = {
        "benchmark": "transfer",
        "backend": jax.default_backend(),
        "devices": len(jax.devices()),
        "cpu_count": os.cpu_count(),
        "sizes": measured,
        # Executor time over whole-tree jax.device_put (medians; at most 1.0 is the goal).
        "ours_over_device_put": {s: r["ours_over_device_put"] for s, r in measured.items()},
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    from hcjax.config import run_main

    # 8 host devices when no accelerator is set up: learner and inference meshes are disjoint.
    run_main(main, cpu_devices=8)
