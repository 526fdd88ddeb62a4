"""`python -m hcjax.bench.moe`: dropless grouped MoE vs the dense one-hot reference, forward+backward.

For E in {8, 64} and k in {2, 8} on this machine's default backend, times the expert computation of
LatentMoE (SwiGLU in the latent space) in each form (ragged_dot, blocked, tiled, capacity, dense),
plus, in the same run, a large plain matmul as the roofline and one expert's SwiGLU MLP on all N·k
rows (the same useful FLOPs as plain matmuls, the ceiling a dispatch could reach at these shapes).
`--tiles 16,32,64,128` also times the tiled form at each tile size (the measurement behind
`pallas_kernels.expert_mlp_tiled.default_tile`); `--capacities 1.0,1.0625,1.125` the capacity form
at those multiples of the mean rows per expert (behind `default_capacity`). Useful FLOPs count only the
chosen experts (N·k assignments); the dense path computes all E experts for every token. Prints
one JSON object as its last line. Timings are not asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp

from hcjax import host_memory
from hcjax.display import Phases
from hcjax.model.moe import swiglu_act
from pallas_kernels.expert_mlp import dense_expert_mlp, expert_mlp_grouped
from pallas_kernels.expert_mlp_capacity import default_capacity, expert_mlp_capacity
from pallas_kernels.expert_mlp_tiled import default_tile, expert_mlp_blocked, expert_mlp_tiled


def _time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_roofline(n: int = 1024, repeats: int = 5) -> float:
    """Achieved GFLOP/s of an fp32 n×n×n matmul: the practical ceiling for the runs below."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    t = _time(jax.jit(jnp.matmul), a, b, repeats=repeats)
    return 2 * n**3 / t / 1e9


def bench_case(num_tokens: int, latent: int, hidden: int, experts: int, k: int, repeats: int,
               tiles: tuple[int, ...] = (), capacities: tuple[float, ...] = ()):
    keys = jax.random.split(jax.random.key(experts * 100 + k), 6)
    x = jax.random.normal(keys[0], (num_tokens, latent), jnp.float32)
    w_gate = jax.random.normal(keys[1], (experts, latent, hidden)) * latent**-0.5
    w_up = jax.random.normal(keys[2], (experts, latent, hidden)) * latent**-0.5
    w_out = jax.random.normal(keys[3], (experts, hidden, latent)) * hidden**-0.5
    logits = jax.random.normal(keys[4], (num_tokens, experts))
    _, expert_nk = jax.lax.top_k(logits, k)
    gates = jax.nn.softmax(jnp.take_along_axis(logits, expert_nk, -1), -1)
    combine = jnp.sum(jax.nn.one_hot(expert_nk, experts) * gates[..., None], 1)

    # Routing arrives as arguments (as in the model), not as compile-time constants.
    def grouped_loss(x, wg, wu, wo, expert_nk, gates):
        return jnp.sum(expert_mlp_grouped(x, {"gate": wg, "up": wu, "out": wo}, expert_nk, gates,
                                          swiglu_act, gmm_impl="reference") ** 2)

    def dense_loss(x, wg, wu, wo, combine):
        return jnp.sum(dense_expert_mlp(x, {"gate": wg, "up": wu, "out": wo}, combine,
                                        swiglu_act) ** 2)

    def blocked_loss(x, wg, wu, wo, expert_nk, gates):
        return jnp.sum(expert_mlp_blocked(x, {"gate": wg, "up": wu, "out": wo}, expert_nk, gates,
                                          swiglu_act) ** 2)

    def form_at(mlp, **options):  # fwd+bwd of a dispatch form at given tile / capacity options
        def loss(x, wg, wu, wo, expert_nk, gates):
            return jnp.sum(mlp(x, {"gate": wg, "up": wu, "out": wo}, expert_nk, gates, swiglu_act,
                               **options) ** 2)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))

    def tiled_at(tile):
        return form_at(expert_mlp_tiled, tile=tile)

    def capacity_at(capacity):
        return form_at(expert_mlp_capacity, capacity=capacity)

    def plain_loss(xs, wg, wu, wo):  # one expert on every assignment's row: no dispatch at all
        return jnp.sum(((jax.nn.silu(xs @ wg) * (xs @ wu)) @ wo) ** 2)

    grouped = jax.jit(jax.value_and_grad(grouped_loss, argnums=(0, 1, 2, 3)))
    tiled = tiled_at(None)
    capacity = capacity_at(None)
    plain = jax.jit(jax.value_and_grad(plain_loss, argnums=(0, 1, 2, 3)))
    plain_args = (jnp.repeat(x, k, axis=0), w_gate[0], w_up[0], w_out[0])
    blocked = jax.jit(jax.value_and_grad(blocked_loss, argnums=(0, 1, 2, 3)))
    dense = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1, 2, 3)))
    args = (x, w_gate, w_up, w_out)
    g_args, d_args = args + (expert_nk, gates), args + (combine,)
    # Same function both ways: check before timing so a fast wrong answer cannot win.
    (lg, gg), (ld, gd) = grouped(*g_args), dense(*d_args)
    lb, gb = blocked(*g_args)
    lt, gt = tiled(*g_args)
    lc, gc = capacity(*g_args)
    max_grad_diff = max(float(jnp.max(jnp.abs(a - b)))
                        for a, b in zip(gg + gb + gt + gc, gd + gd + gd + gd))
    t_grouped = _time(grouped, *g_args, repeats=repeats)
    t_dense = _time(dense, *d_args, repeats=repeats)
    t_blocked = _time(blocked, *g_args, repeats=repeats)
    t_tiled = _time(tiled, *g_args, repeats=repeats)
    t_capacity = _time(capacity, *g_args, repeats=repeats)
    t_plain = _time(plain, *plain_args, repeats=repeats)
    sweep = {str(t): round(_time(tiled_at(t), *g_args, repeats=repeats) * 1e3, 2) for t in tiles}
    mean_rows = num_tokens * k / experts
    capacity_sweep = {}
    for factor in capacities:
        rows = max(8, math.ceil(factor * mean_rows / 8) * 8)
        capacity_sweep[str(rows)] = round(_time(capacity_at(rows), *g_args, repeats=repeats) * 1e3,
                                          2)
    # Forward = 3 matmuls of 2·r·f FLOPs per (token, expert); backward ≈ 2× forward.
    per_assignment = 3 * 2 * latent * hidden * 3
    useful = num_tokens * k * per_assignment
    dense_flops = num_tokens * experts * per_assignment
    return {
        "experts": experts,
        "k": k,
        "tokens": num_tokens,
        "grouped_ragged_dot_s": t_grouped,
        "grouped_blocked_s": t_blocked,
        "grouped_tiled_s": t_tiled,
        "grouped_capacity_s": t_capacity,
        "plain_matmuls_same_flops_s": t_plain,
        "default_tile": default_tile(num_tokens * k, experts),
        "default_capacity": default_capacity(num_tokens * k, experts),
        "tiled_ms_by_tile": sweep,
        "capacity_ms_by_rows": capacity_sweep,
        "capacity_over_plain_matmuls": t_capacity / t_plain,
        "dense_s": t_dense,
        "blocked_over_tiled": t_blocked / t_tiled,
        "dense_over_ragged_dot": t_dense / t_grouped,
        "dense_over_blocked": t_dense / t_blocked,
        "ragged_dot_useful_gflops": useful / t_grouped / 1e9,
        "blocked_useful_gflops": useful / t_blocked / 1e9,
        "tiled_useful_gflops": useful / t_tiled / 1e9,
        "capacity_useful_gflops": useful / t_capacity / 1e9,
        "plain_matmuls_gflops": useful / t_plain / 1e9,
        "dense_useful_gflops": useful / t_dense / 1e9,
        "dense_executed_gflops": dense_flops / t_dense / 1e9,
        "loss_rel_diff": float(max(abs(lg - ld), abs(lb - ld), abs(lt - ld), abs(lc - ld))
                               / abs(ld)),
        "max_grad_abs_diff": max_grad_diff,
    }


EXAMPLES = """examples:
  python -m hcjax.bench.moe                            # blocked vs dense dispatch, E x k grid
  python -m hcjax.bench.moe --tokens 4096 --repeats 5
  python -m hcjax.bench.moe --tiles 16,32,64,128       # the tiled form at each tile size
  python -m hcjax.bench.moe --capacities 1,1.0625,1.125  # the capacity form at those capacities

The last line on stdout is one JSON object; progress goes to stderr.
"""


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--latent", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiles", default="",
                        help="comma-separated tile sizes to time the tiled form at (e.g. 16,32,64)")
    parser.add_argument("--capacities", default="",
                        help="comma-separated multiples of the mean rows per expert to time the "
                        "capacity form at (e.g. 1,1.0625,1.125)")
    args = parser.parse_args(argv)
    try:
        tiles = tuple(int(t) for t in args.tiles.split(",") if t)
        capacities = tuple(float(c) for c in args.capacities.split(",") if c)
    except ValueError as e:
        parser.error(f"--tiles / --capacities: {e}")
    if any(t < 1 for t in tiles) or any(c <= 0 for c in capacities):
        parser.error(f"--tiles {args.tiles!r} and --capacities {args.capacities!r} must be positive")
    phases = Phases("hcjax.bench.moe")
    with phases.phase("measuring the matmul roofline"):
        roofline = matmul_roofline()
    cases = []
    shapes = [(experts, k) for experts in (8, 64) for k in (2, 8)]
    with phases.phase("timing E x k cases", total=len(shapes)) as phase:
        for experts, k in shapes:
            phase.now(f"E={experts} k={k}")
            case = bench_case(args.tokens, args.latent, args.hidden, experts, k, args.repeats,
                              tiles, capacities)
            case["blocked_fraction_of_roofline"] = case["blocked_useful_gflops"] / roofline
            case["tiled_fraction_of_roofline"] = case["tiled_useful_gflops"] / roofline
            case["capacity_fraction_of_roofline"] = case["capacity_useful_gflops"] / roofline
            case["plain_matmuls_fraction_of_roofline"] = case["plain_matmuls_gflops"] / roofline
            case["ragged_dot_fraction_of_roofline"] = case["ragged_dot_useful_gflops"] / roofline
            cases.append(case)
            print(
                f"E={experts:3d} k={k}: ragged_dot {case['grouped_ragged_dot_s'] * 1e3:8.1f} ms  "
                f"blocked {case['grouped_blocked_s'] * 1e3:8.1f} ms  "
                f"tiled {case['grouped_tiled_s'] * 1e3:8.1f} ms  "
                f"capacity {case['grouped_capacity_s'] * 1e3:8.1f} ms  "
                f"(plain {case['plain_matmuls_same_flops_s'] * 1e3:6.1f} ms)  dense "
                f"{case['dense_s'] * 1e3:8.1f} ms  (dense/blocked {case['dense_over_blocked']:.2f}x)",
                flush=True,
            )
            phase.advance()
    with phases.phase("measuring the matmul roofline again"):
        again = matmul_roofline()
    if again > roofline:  # best of before and after: the fractions are against the true ceiling
        for case in cases:
            for key in [key for key in case if key.endswith("_fraction_of_roofline")]:
                case[key] *= roofline / again
        roofline = again
    result = {
        "benchmark": "moe",
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "matmul_roofline_gflops": roofline,
        "host_malloc_kept": host_memory.kept(),
        "shape": {"tokens": args.tokens, "latent": args.latent, "hidden": args.hidden},
        "cases": cases,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    from hcjax.config import run_main

    # A process that only trains: freed heap pages stay with it (hcjax/host_memory.py).
    run_main(main, keep_freed_memory=True)
