"""Benchmark of the SFT trainer on the tiny model: train-step tokens/s with the full batch in one
pass vs 4 accumulated micro-batches (which add a routing-count forward pass), and packing speed.
`python -m hcjax.bench.sft [--steps N]`; prints one JSON object last; asserts nothing."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from hcjax import config
from hcjax.display import Phases
from hcjax.model import ModelConfig, Transformer
from hcjax.train.loop import AdamWConfig, TrainerConfig
from hcjax.train.pipeline import DataConfig, make_batch_iterator
from hcjax.train.sft import make_sft_step
from hcjax.train.step import make_optimizer


def _step_rate(model_cfg: ModelConfig, cfg: TrainerConfig, batches: list, steps: int) -> float:
    graphdef, params, rest = nnx.split(Transformer(model_cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    tx: optax.GradientTransformation = make_optimizer(AdamWConfig().optimizer(cfg.num_steps))
    step = jax.jit(make_sft_step(graphdef, rest, tx, cfg, model_cfg))
    state = {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    state, _ = step(state, batches[0])  # compile
    jax.block_until_ready(state)
    t = time.perf_counter()
    for i in range(steps):
        state, _ = step(state, batches[i % len(batches)])
    jax.block_until_ready(state)
    tokens = steps * batches[0]["tokens"].size
    return tokens / (time.perf_counter() - t)


EXAMPLES = """examples:
  python -m hcjax.bench.sft                            # SFT step time and tokens/s
  python -m hcjax.bench.sft --steps 30 | tail -1

The last line on stdout is one JSON object; progress goes to stderr.
"""


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    config.bind(["tiny_cpu.gin"], [])
    model_cfg, data_cfg = ModelConfig(), DataConfig()
    base = TrainerConfig()

    phases = Phases("hcjax.bench.sft")
    with phases.phase("packing 20 batches"):
        t = time.perf_counter()
        it = make_batch_iterator(data_cfg, base.batch_size)
        host = [next(it) for _ in range(20)]
        pack_s = time.perf_counter() - t
    docs = sum(int(b["segment_ids"].max(axis=1).sum()) for b in host)
    fill = sum(int((b["segment_ids"] > 0).sum()) for b in host) / sum(
        b["tokens"].size for b in host
    )
    batches = [{k: jnp.asarray(v) for k, v in b.items()} for b in host]

    with phases.phase("timing train steps", total=2) as phase:
        phase.now("1 micro-batch")
        one = _step_rate(model_cfg, base, batches, args.steps)
        phase.advance(item="4 micro-batches")
        acc = _step_rate(model_cfg, dataclasses.replace(base, num_microbatches=4), batches,
                         args.steps)
        phase.advance()
    print(
        json.dumps(
            {
                "bench": "sft",
                "batch_rows": base.batch_size,
                "row_len": data_cfg.row_len,
                "pack_docs_per_s": docs / pack_s,
                "pack_fill_fraction": fill,
                "train_tokens_per_s_1_microbatch": one,
                "train_tokens_per_s_4_microbatches": acc,
                "accumulation_slowdown": one / acc,
            }
        )
    )


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)
