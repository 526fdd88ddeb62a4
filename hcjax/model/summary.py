"""`python -m hcjax.model.summary --gin_file F`: total and active parameter counts, from shapes only.

Counts come from `nnx.eval_shape` (nothing is allocated), so the flagship's 1T parameters can be
summarised on a laptop. Active = parameters touched per token: everything except the experts not
chosen (experts_per_token of num_experts per MoE layer). The last line is JSON.
"""

from __future__ import annotations

import json
from collections import defaultdict

import jax
import numpy as np
from flax import nnx

from hcjax import config as hcfg
from hcjax.model.config import ModelConfig
from hcjax.model.transformer import abstract_model


def _component(path: tuple, is_expert: bool) -> str:
    keys = [str(p) for p in path]
    if keys[0] == "embed":
        return "embedding"
    if keys[0] == "lm_head":
        return "output head"
    if keys[0] == "final_norm" or "norm" in keys[2]:
        return "norms"
    if keys[2] == "attn":
        return "attention"
    if is_expert:
        return "moe experts"
    if keys[-1] in ("router", "router_bias", "correction_bias"):
        return "moe router"
    if "shared" in keys:
        return "moe shared experts"
    if keys[-1] in ("w_down", "w_up_proj"):
        return "moe latent projections"
    return "dense mlp"


def summarize(cfg: ModelConfig) -> dict:
    _, abstract = abstract_model(cfg)
    total = 0
    active = 0.0
    by_component: dict[str, dict[str, float]] = defaultdict(lambda: {"total": 0, "active": 0})
    frac_active = cfg.experts_per_token / cfg.num_experts
    for path, var in nnx_flat(abstract):
        n = int(np.prod(var.shape))
        # Expert weights are the ones with an experts axis (after "layers" when scanned).
        is_expert = "experts" in (var.get_metadata().get("logical_axes") or ())
        comp = _component(path, is_expert)
        act = n * frac_active if is_expert else n
        total += n
        active += act
        by_component[comp]["total"] += n
        by_component[comp]["active"] += act
    embedding = by_component["embedding"]["total"]
    return {
        "total_params": total,
        "active_params": int(round(active)),
        # Some model cards (e.g. OpenAI's for gpt-oss) count active parameters without the input
        # embedding table, which is read, not multiplied.
        "active_params_without_embedding": int(round(active)) - embedding,
        "components": {k: {"total": v["total"], "active": int(v["active"])}
                       for k, v in sorted(by_component.items())},
        "config": {
            "d_model": cfg.d_model,
            "num_layers": cfg.num_layers,
            "num_moe_layers": cfg.num_moe_layers,
            "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "num_experts": cfg.num_experts,
            "experts_per_token": cfg.experts_per_token,
            "moe_latent_dim": cfg.moe_latent_dim,
            "moe_d_ff": cfg.moe_d_ff,
            "d_ff": cfg.d_ff,
            "vocab_size": cfg.vocab_size,
            "tie_embeddings": cfg.tie_embeddings,
            "attention_type": cfg.attention_type,
            "moe_type": cfg.moe_type,
            "num_shared_experts": cfg.num_shared_experts,
        },
    }


def nnx_flat(state):
    leaves = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda v: isinstance(v, nnx.Variable)
    )[0]
    for path, var in leaves:
        yield tuple(getattr(p, "key", getattr(p, "idx", p)) for p in path), var


def format_summary(s: dict) -> str:
    def h(n: float) -> str:
        for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if n >= div:
                return f"{n / div:.2f}{unit}"
        return str(int(n))

    lines = [f"{'component':<26}{'total':>12}{'active/token':>14}"]
    for name, v in s["components"].items():
        lines.append(f"{name:<26}{h(v['total']):>12}{h(v['active']):>14}")
    lines.append(f"{'TOTAL':<26}{h(s['total_params']):>12}{h(s['active_params']):>14}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    flags = hcfg.parse_flags(
        argv, description=__doc__.splitlines()[0], default_gin_files=["tiny_cpu.gin"]
    )
    hcfg.bind(flags.gin_files, flags.gin_params)
    cfg = ModelConfig()
    s = summarize(cfg)
    if flags.output_dir:
        hcfg.write_config(flags.output_dir, flags)
    print(format_summary(s))
    print(json.dumps(s))
    return s


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)
