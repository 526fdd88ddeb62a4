"""Benchmark of the Pallas kernels against their XLA references: time and achieved GFLOP/s.

On CPU only the references are timed (interpret-mode Pallas says nothing about speed); on GPU/TPU
both, side by side. Prints one JSON object as its last line and never asserts timings.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from hcjax.display import Phases

FLOP_NOTE = (
    "attention counts only unmasked (query, key) pairs: forward 4*D*pairs per query head "
    "(QK^T and PV), backward 2.5x forward (dQ, dK, dV, dP plus recomputed QK^T), "
    "pairs = sum_i min(i+1, window) for a causal window; gmm counts 2*sum(group_sizes)*K*N; "
    "decode counts 4*D*Hq*sum(valid slots)"
)


def _time(fn: Callable, *args, repeats: int) -> float:
    """Median wall seconds of a jitted call, after one warm-up call that compiles it."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _entry(name, shape, flops, timings: dict[str, float]) -> dict:
    entry = {"kernel": name, "shape": shape, "gflop": round(flops / 1e9, 3)}
    for impl, seconds in timings.items():
        entry[f"{impl}_ms"] = round(seconds * 1e3, 3)
        entry[f"{impl}_gflops"] = round(flops / seconds / 1e9, 1)
    if "pallas" in timings and "reference" in timings:
        entry["speedup_vs_reference"] = round(timings["reference"] / timings["pallas"], 2)
    return entry


def _visible_pairs(t: int, window: int | None) -> int:
    i = np.arange(t)
    return int(np.minimum(i + 1, t if window is None else window).sum())


def bench_attention(b, t, hq, hkv, d, window, impls, repeats) -> list[dict]:
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (b, t, hq, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, hkv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, hkv, d), jnp.bfloat16)
    fwd_flops = 4 * d * _visible_pairs(t, window) * b * hq
    shape = dict(B=b, T=t, Hq=hq, Hkv=hkv, D=d, window=window, dtype="bfloat16")
    fwd, train = {}, {}
    for impl in impls:

        def attn(q, k, v, impl=impl):
            return pk.flash_attention(q, k, v, window=window, impl=impl)

        def loss(q, k, v, attn=attn):
            return attn(q, k, v).astype(jnp.float32).sum()

        fwd[impl] = _time(jax.jit(attn), q, k, v, repeats=repeats)
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        train[impl] = _time(grad, q, k, v, repeats=repeats)
    return [
        _entry("flash_attention_fwd", shape, fwd_flops, fwd),
        _entry("flash_attention_fwd_bwd", shape, 3.5 * fwd_flops, train),
    ]


def bench_gmm(m, k, n, groups, impls, repeats) -> list[dict]:
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    lhs = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    rhs = jax.random.normal(keys[1], (groups, k, n), jnp.bfloat16)
    # Uneven routing, one empty expert, every row assigned.
    weights = np.asarray(jax.random.uniform(keys[2], (groups,))) + 0.2
    weights[groups // 2] = 0.0
    sizes = np.floor(weights / weights.sum() * m).astype(np.int32)
    sizes[0] += m - sizes.sum()
    group_sizes = jnp.asarray(sizes)
    flops = 2 * m * k * n
    timings = {
        impl: _time(
            jax.jit(lambda a, b, impl=impl: pk.gmm(a, b, group_sizes, impl=impl)),
            lhs,
            rhs,
            repeats=repeats,
        )
        for impl in impls
    }
    # The target: a grouped matmul close to one dense matmul of the same FLOPs.
    timings["dense_matmul"] = _time(jax.jit(jnp.matmul), lhs, rhs[0], repeats=repeats)
    entry = _entry("gmm", dict(M=m, K=k, N=n, G=groups, dtype="bfloat16"), flops, timings)
    for impl in impls:
        entry[f"{impl}_vs_dense_time_ratio"] = round(timings[impl] / timings["dense_matmul"], 2)
    return [entry]


def bench_decode(b, s, hq, hkv, d, window, impls, repeats) -> list[dict]:
    keys = jax.random.split(jax.random.PRNGKey(2), 4)
    q = jax.random.normal(keys[0], (b, hq, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, hkv, d), jnp.bfloat16)
    lengths = jax.random.randint(keys[3], (b,), 1, s + 1, jnp.int32)  # ragged slots
    valid = np.minimum(np.asarray(lengths), s if window is None else window)
    flops = 4 * d * hq * int(valid.sum())
    timings = {
        impl: _time(
            jax.jit(
                lambda q, k, v, n, impl=impl: pk.decode_attention(
                    q, k, v, n, window=window, impl=impl
                )
            ),
            q,
            k,
            v,
            lengths,
            repeats=repeats,
        )
        for impl in impls
    }
    shape = dict(B=b, S=s, Hq=hq, Hkv=hkv, D=d, window=window, dtype="bfloat16")
    return [_entry("decode_attention", shape, flops, timings)]


def bench_paged_decode(b, s, hq, hkv, d, page_size, impls, repeats) -> list[dict]:
    """Paged decode over a shuffled pool holding the same ragged keys as `bench_decode`'s full
    caches, beside the full-cache reference ("slot_reference"); on CPU also the interpreted
    Pallas kernel's largest error against the paged reference."""
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    q = jax.random.normal(keys[0], (b, hq, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, hkv, d), jnp.bfloat16)
    lengths = jax.random.randint(keys[3], (b,), 1, s + 1, jnp.int32)
    pages = s // page_size
    order = np.random.default_rng(0).permutation(b * pages)
    table = jnp.asarray(order.reshape(b, pages), jnp.int32)
    inverse = jnp.asarray(np.argsort(order))

    def to_pool(x):  # pool[order[i]] = i-th page of the full caches
        return x.reshape(b * pages, page_size, hkv, d)[inverse]

    k_pool, v_pool = to_pool(k), to_pool(v)
    flops = 4 * d * hq * int(np.asarray(lengths).sum())
    timings = {
        impl: _time(jax.jit(lambda q, kp, vp, t, n, impl=impl: pk.paged_decode_attention(
            q, kp, vp, t, n, impl=impl)), q, k_pool, v_pool, table, lengths, repeats=repeats)
        for impl in impls
    }
    timings["slot_reference"] = _time(
        jax.jit(lambda q, k, v, n: pk.decode_attention(q, k, v, n, impl="reference")),
        q, k, v, lengths, repeats=repeats)
    shape = dict(B=b, S=s, Hq=hq, Hkv=hkv, D=d, page_size=page_size, dtype="bfloat16")
    entry = _entry("paged_decode_attention", shape, flops, timings)
    want = np.asarray(pk.paged_decode_attention(q, k_pool, v_pool, table, lengths,
                                                impl="reference"), np.float32)
    slot = np.asarray(pk.decode_attention(q, k, v, lengths, impl="reference"), np.float32)
    entry["paged_vs_slot_reference_max_abs_diff"] = float(np.abs(want - slot).max())
    if "pallas" not in impls:  # CPU: the kernels' numbers in interpret mode
        for lowering in ("gpu", "tpu"):
            got = np.asarray(pk.paged_decode_attention(
                q, k_pool, v_pool, table, lengths, impl="pallas", interpret=True,
                lowering=lowering), np.float32)
            entry[f"{lowering}_kernel_interpret_max_abs_error"] = float(np.abs(got - want).max())
    return [entry]


def main(argv=None) -> None:
    backend = jax.default_backend()
    accelerated = backend in ("gpu", "tpu")
    impls = ["reference", "pallas"] if accelerated else ["reference"]
    # (what the phase line shows, the benchmark and its arguments), timed in this order.
    if accelerated:
        repeats = 10
        cases = [
            *((f"attention T={t} window 512", bench_attention, (1, t, 32, 8, 128, 512))
              for t in (4096, 8192)),
            ("attention T=8192 global", bench_attention, (1, 8192, 32, 8, 128, None)),
            ("gmm M=16384 G=64", bench_gmm, (16384, 2048, 1024, 64)),
            ("decode S=8192 global", bench_decode, (64, 8192, 32, 8, 128, None)),
            ("decode S=512 window 512", bench_decode, (64, 512, 32, 8, 128, 512)),
            ("paged decode S=8192 pages of 16", bench_paged_decode, (64, 8192, 32, 8, 128, 16)),
        ]
    else:  # shapes small enough for the references on a few CPU cores
        repeats = 3
        cases = [
            ("attention T=1024 window 128", bench_attention, (1, 1024, 8, 2, 64, 128)),
            ("gmm M=2048 G=8", bench_gmm, (2048, 256, 512, 8)),
            ("decode S=1024 global", bench_decode, (8, 1024, 8, 2, 64, None)),
            ("paged decode S=1024 pages of 16", bench_paged_decode, (8, 1024, 8, 2, 64, 16)),
        ]
    results = []
    with Phases("hcjax.bench.kernels").phase("timing kernels", total=len(cases)) as phase:
        for label, bench, shape in cases:
            phase.now(label)
            results += bench(*shape, impls, repeats)
            phase.advance()
    summary = {
        "benchmark": "kernels",
        "backend": backend,
        "device": str(jax.devices()[0].device_kind),
        "pallas_timed": accelerated,
        "note": (
            "Pallas kernels timed against XLA references in the same run"
            if accelerated
            else "CPU: only the XLA references are timed; Pallas runs here only in interpret "
            "mode, whose speed means nothing"
        ),
        "flop_counting": FLOP_NOTE,
        "results": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)
