"""Writes tests/data/train_step_reference.json: what the three train steps as they stood before
they became one (hcjax.distill.sft.make_train_step, hcjax.distill.dpo.make_dpo_step and
hcjax.rl.learner.Learner.step) compute from fixed inputs, two steps each: every metric, and a
fingerprint of each parameter's change. tests/test_train_step.py checks the single train step
against it. Run from the repository root at the commit that adds it:
`.venv/bin/python tests/data/make_train_step_reference.py`."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from hcjax.model import ModelConfig, Transformer  # noqa: E402
from hcjax.rl.advantages import assign_advantages  # noqa: E402
from hcjax.rollout.records import Rollout  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_step_reference.json")

# Two MoE layers (the load-balance loss is a mean over layers), local and global attention.
CFG = ModelConfig(
    vocab_size=40, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, window=4,
    attention_pattern=("local", "global"), ffn_pattern=("moe",), d_ff=32, num_experts=4,
    experts_per_token=2, moe_latent_dim=8, moe_d_ff=16, max_seq_len=32, dtype="float32",
)
T = 16  # row length


def initial_model(cfg: ModelConfig = CFG) -> nnx.Module:
    """The model with every parameter perturbed (at init the attention output gains are 0)."""
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def lm_batch(seed: int, rows: int = 4) -> dict[str, np.ndarray]:
    """Packed LM rows: two documents per row then padding, loss on most tokens."""
    rng = np.random.default_rng(seed)
    out = {k: np.zeros((rows, T), np.int32) for k in ("tokens", "positions", "segment_ids",
                                                      "loss_mask")}
    for r in range(rows):
        start = 0
        for seg in (1, 2):
            n = int(rng.integers(3, 8))
            sl = slice(start, start + n)
            out["tokens"][r, sl] = rng.integers(1, CFG.vocab_size, n)
            out["positions"][r, sl] = np.arange(n)
            out["segment_ids"][r, sl] = seg
            out["loss_mask"][r, sl] = rng.uniform(size=n) < 0.8
            start += n
    return out


def dpo_batch(seed: int, pairs: int = 2) -> dict[str, np.ndarray]:
    """Rows [0, P) the chosen conversations, [P, 2P) the rejected ones (as encode_pairs lays
    them out): one document each, the loss on its response tokens."""
    rng = np.random.default_rng(seed)
    rows = 2 * pairs
    out = {k: np.zeros((rows, T), np.int32) for k in ("tokens", "positions", "segment_ids",
                                                      "loss_mask")}
    for r in range(rows):
        prompt, response = int(rng.integers(2, 5)), int(rng.integers(3, 10))
        n = prompt + response
        out["tokens"][r, :n] = rng.integers(1, CFG.vocab_size, n)
        out["positions"][r, :n] = np.arange(n)
        out["segment_ids"][r, :n] = 1
        out["loss_mask"][r, prompt:n] = 1
    return out


def rollouts(seed: int, n: int = 8) -> list[Rollout]:
    """Graded rollouts with a routing record, varied temperatures and top-p records."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = int(rng.integers(2, 6)), int(rng.integers(2, 8))
        out.append(Rollout(
            prompt_ids=rng.integers(1, CFG.vocab_size, p),
            response_ids=rng.integers(1, CFG.vocab_size, r),
            logprobs=-rng.uniform(0.5, 4.0, r), n_kept=rng.integers(0, CFG.vocab_size, r),
            threshold_logit=np.zeros(r), loss_mask=rng.uniform(size=r) < 0.85,
            versions=np.zeros(r), finish_reason="stop",
            routing=np.stack([np.stack([rng.permutation(CFG.num_experts)[:2]
                                        for _ in range(p + r - 1)]) for _ in range(2)]),
            temperature=float(rng.choice([0.7, 1.0])), group_id=i // 4,
            reward=float(rng.integers(0, 2)),
        ))
    return assign_advantages(out)


def fingerprint(before, after) -> dict[str, list[float]]:
    """Per parameter (by path): Σd, Σd·r (r a fixed random normal vector) and |d|, d the
    change; three numbers that move with any change of the update."""
    flat_b = jax.tree_util.tree_flatten_with_path(before)[0]
    flat_a = dict((jax.tree_util.keystr(k), np.asarray(v, np.float64))
                  for k, v in jax.tree_util.tree_flatten_with_path(after)[0])
    out = {}
    for i, (k, v) in enumerate(flat_b):
        name = jax.tree_util.keystr(k)
        d = flat_a[name] - np.asarray(v, np.float64)
        r = np.random.default_rng(i).standard_normal(d.shape)
        out[name] = [float(d.sum()), float((d * r).sum()), float(np.sqrt((d * d).sum()))]
    return out


def pure(params):
    """Parameters as a pure dict of numpy arrays keyed like nnx.to_pure_dict."""
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    return jax.tree.map(np.asarray, params)


def floats(metrics) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(metrics).items()}


# Cases ------------------------------------------------------------------------------------------
SFT_CASES = {
    # (model dropout, SFTConfig fields)
    "sft_one_micro_batch": (0.0, dict(num_steps=20, batch_size=4, num_microbatches=1,
                                      peak_lr=1e-2, end_lr=1e-3, warmup_fraction=0.0,
                                      weight_decay=0.01, eps=1e-6, grad_clip=1.0,
                                      load_balance_coef=0.5, seed=3)),
    "sft_two_micro_batches_dropout": (0.1, dict(num_steps=20, batch_size=4, num_microbatches=2,
                                                peak_lr=1e-2, end_lr=1e-3, warmup_fraction=0.1,
                                                weight_decay=0.01, eps=1e-6, grad_clip=0.5,
                                                load_balance_coef=0.5, seed=3)),
}
DPO_CASE = dict(beta=0.5, label_smoothing=0.1, nll_weight=0.3)
DPO_OPTIM = dict(num_steps=20, batch_size=2, peak_lr=1e-2, end_lr=1e-2, warmup_fraction=0.0,
                 weight_decay=0.0, eps=1e-6, grad_clip=1.0, load_balance_coef=0.5)
GRPO_CASES = {
    # LearnerConfig fields besides the shared ones
    "grpo_one_micro_batch": dict(micro_batches=1),
    "grpo_two_micro_batches_routing_record": dict(micro_batches=2),
    "grpo_two_micro_batches_no_routing_record": dict(micro_batches=2, replay_routing=False),
    "gspo_two_micro_batches": dict(micro_batches=2, loss="gspo"),
}
GRPO_SHARED = dict(seq_len=T, learning_rate=1e-2, adam_eps=1e-6, max_grad_norm=1.0,
                   load_balance_coef=0.5)
GRPO_ENTROPY = dict(target=5.0, delta=0.25, k_max=0.5)


def main() -> None:
    from hcjax.distill.dpo import DPOConfig, make_dpo_step
    from hcjax.distill.sft import SFTConfig, make_optimizer, make_train_step
    from hcjax.rl.batch import pack_rollouts, to_device
    from hcjax.rl.entropy import EntropyController
    from hcjax.rl.learner import Learner, LearnerConfig
    from hcjax.rl.losses import LossConfig
    from hcjax.sharding import MeshConfig, make_mesh

    result: dict = {"model": dataclasses.asdict(CFG)}
    for name, (dropout, fields) in SFT_CASES.items():
        cfg_m = dataclasses.replace(CFG, dropout_rate=dropout)
        graphdef, params, rest = nnx.split(initial_model(cfg_m), nnx.Param, ...)
        params = nnx.to_pure_dict(params)
        cfg = SFTConfig(**fields)
        tx = make_optimizer(cfg)
        step = jax.jit(make_train_step(graphdef, rest, tx, cfg, cfg_m))
        state = {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}
        metrics = []
        for seed in (0, 1):
            state, m = step(state, {k: jnp.asarray(v) for k, v in lm_batch(seed).items()})
            metrics.append(floats(m))
        result[name] = {"metrics": metrics, "params": fingerprint(pure(params),
                                                                  pure(state["params"]))}

    graphdef, params, rest = nnx.split(initial_model(), nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    ref_params = jax.tree.map(jnp.copy, params)
    optim = SFTConfig(**DPO_OPTIM)
    tx = make_optimizer(optim)
    step = jax.jit(make_dpo_step(graphdef, rest, tx, DPOConfig(**DPO_CASE, optim=optim),
                                 optim.load_balance_coef))
    state = {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    metrics = []
    for seed in (0, 1):
        state, m = step(state, ref_params, {k: jnp.asarray(v) for k, v in dpo_batch(seed).items()})
        metrics.append(floats(m))
    result["dpo"] = {"metrics": metrics, "params": fingerprint(pure(params), pure(state["params"]))}

    mesh = make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1])
    for name, fields in GRPO_CASES.items():
        fields = dict(fields)
        loss = LossConfig(name=fields.pop("loss", "grpo"))
        cfg = LearnerConfig(**GRPO_SHARED, **fields, loss=loss,
                            entropy=EntropyController(**GRPO_ENTROPY))
        learner = Learner(initial_model(), cfg, mesh)
        before = pure(jax.device_get(learner.state.params))
        metrics = []
        for seed in (0, 1):
            packed = pack_rollouts(rollouts(seed), seq_len=T, micro_batches=cfg.micro_batches,
                                   num_rows=6, with_routing=cfg.replay_routing)
            metrics.append(learner.step(to_device(packed, mesh)))
        result[name] = {"metrics": metrics,
                        "params": fingerprint(before, pure(jax.device_get(learner.state.params)))}
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
