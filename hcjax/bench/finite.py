"""`python -m hcjax.bench.finite`: what the finite-weight checks (hcjax.finite) cost beside the
pass over the bytes each path already makes. Host: reading a safetensors tensor from disk (page
cache) vs checking it. Device: checking a parameter tree vs copying it once on the device (the
cheapest thing a weight push or restore does with every byte). Ratios side by side in one run;
the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence

import numpy as np


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def host(mb: int, repeats: int) -> dict:
    # after the flags: --help stays fast (this loads JAX)
    from hcjax.finite import check_finite_array
    from hcjax.model.safetensors_io import SafetensorsCheckpoint, array_specs, write_safetensors

    x = np.random.default_rng(0).standard_normal(mb * (1 << 20) // 4, dtype=np.float32)
    with tempfile.TemporaryDirectory() as folder:
        write_safetensors(folder, array_specs({"w": x}))
        ckpt = SafetensorsCheckpoint.open(folder)
        ckpt.read("w")  # into the page cache
        read = _best(lambda: ckpt.read("w"), repeats)
        w = ckpt.read("w")
        check = _best(lambda: check_finite_array("w", w, "bench"), repeats)
    return {"megabytes": mb, "read_s": round(read, 4), "check_s": round(check, 4),
            "check_over_read": round(check / read, 3)}


def device(size: str, repeats: int) -> dict:
    # after the flags: --help stays fast (this loads JAX)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hcjax.finite import check_finite
    from hcjax.model import ModelConfig, create_sharded
    from hcjax.sharding import MeshConfig, make_mesh

    configs = {"tiny": ModelConfig(vocab_size=272, d_model=64, num_layers=6, num_heads=4,
                                   num_kv_heads=2, head_dim=16, d_ff=128, num_experts=8,
                                   moe_latent_dim=32, moe_d_ff=64, max_seq_len=256),
               "209M": ModelConfig(vocab_size=32000, d_model=1024, num_layers=8, num_heads=8,
                                   num_kv_heads=4, head_dim=128, d_ff=2816, num_experts=16,
                                   moe_latent_dim=512, moe_d_ff=1024, max_seq_len=1024)}
    mesh = make_mesh(MeshConfig(fsdp=1, num_devices=1))
    params = nnx.state(create_sharded(configs[size], mesh, seed=0), nnx.Param)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))
    jax.block_until_ready(copy(params))
    check_finite(params, "bench")  # compile
    copy_s = _best(lambda: jax.block_until_ready(copy(params)), repeats)
    check_s = _best(lambda: check_finite(params, "bench"), repeats)
    return {"model": size, "megabytes": round(nbytes / 2**20, 1), "copy_s": round(copy_s, 4),
            "check_s": round(check_s, 4), "check_over_copy": round(check_s / copy_s, 3)}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host_mb", type=int, default=256)
    parser.add_argument("--models", default="tiny,209M")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    out = {"bench": "finite", "host": host(args.host_mb, args.repeats),
           "device": [device(m, args.repeats) for m in args.models.split(",") if m]}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)
