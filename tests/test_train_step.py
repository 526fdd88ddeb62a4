"""The one train step (hcjax.train.step) that SFT, DPO and RL share, against what the three steps
it replaced computed from the same inputs: tests/data/train_step_reference.json holds, for two
steps of each case, every metric and a fingerprint of every parameter's change, written by
hcjax.train.sft.make_train_step, hcjax.distill.dpo.make_dpo_step and hcjax.rl.learner's step
before they became one (`tests/data/make_train_step_reference.py` at commit 51c8e00; the inputs
below are that script's). Also: the optimiser config both job configs derive, and micro-batched
DPO equal to one pass, and scanned layers adding their gradients into the running sum inside
the backward."""

import contextlib
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from hcjax.distill.dpo import (
    DPOConfig,
    PreferenceObjective,
    preference_inputs,
    reference_logprobs,
)
from hcjax.model import ModelConfig, Transformer
from hcjax.model.transformer import shard_state
from hcjax.rl.advantages import assign_advantages
from hcjax.rl.batch import pack_rollouts, to_device
from hcjax.rl.entropy import EntropyController
from hcjax.rl.learner import Learner, LearnerConfig
from hcjax.rl.losses import LossConfig
from hcjax.rollout.records import Rollout
from hcjax.sharding import MeshConfig, make_mesh
from hcjax.train.loop import AdamWConfig, TrainerConfig, make_run_step
from hcjax.train.sft import NextTokenObjective, make_sft_step
from hcjax.train.step import (
    OptimizerConfig,
    expert_counts_from_record,
    make_loss_and_grad,
    make_optimizer,
    model_forward,
)

REFERENCE = Path(__file__).resolve().parent / "data" / "train_step_reference.json"

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
    # (model dropout, TrainerConfig and AdamWConfig fields)
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
REF = json.loads(REFERENCE.read_text())


def loop_configs(fields: dict) -> tuple[TrainerConfig, AdamWConfig]:
    """The fields of the one SFTConfig the reference was written with, split between the loop's
    two configs."""
    names = {f.name for f in dataclasses.fields(TrainerConfig)}
    return (TrainerConfig(**{k: v for k, v in fields.items() if k in names}),
            AdamWConfig(**{k: v for k, v in fields.items() if k not in names}))


def _run_sft(name: str):
    dropout, fields = SFT_CASES[name]
    cfg_m = dataclasses.replace(CFG, dropout_rate=dropout)
    graphdef, params, rest = nnx.split(initial_model(cfg_m), nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    cfg, optim = loop_configs(fields)
    tx = make_optimizer(optim.optimizer(cfg.num_steps))
    step = jax.jit(make_sft_step(graphdef, rest, tx, cfg, cfg_m))
    state = {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    metrics = []
    for seed in (0, 1):
        state, m = step(state, {k: jnp.asarray(v) for k, v in lm_batch(seed).items()})
        metrics.append(floats(m))
    return metrics, fingerprint(pure(params), pure(state["params"]))


def _run_dpo():
    graphdef, params, rest = nnx.split(initial_model(), nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    ref_params = jax.tree.map(jnp.copy, params)
    loop, optim = loop_configs(DPO_OPTIM)
    tx = make_optimizer(optim.optimizer(loop.num_steps))
    # The loop's DPO step: the reference's log-probs computed inside it (`preference_inputs`).
    run = make_run_step(graphdef, rest, tx, CFG, PreferenceObjective(DPOConfig(**DPO_CASE)),
                        load_balance_coef=loop.load_balance_coef)
    prepare = preference_inputs(graphdef, rest)
    step = jax.jit(lambda state, ref, batch: run(state, prepare(ref, batch)))
    state = {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    metrics = []
    for seed in (0, 1):
        batch = {k: jnp.asarray(v) for k, v in dpo_batch(seed).items()}
        state, m = step(state, ref_params, batch)
        metrics.append(floats(m))
    return metrics, fingerprint(pure(params), pure(state["params"]))


def _run_grpo(name: str):
    mesh = make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1])
    fields = dict(GRPO_CASES[name])
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
    return metrics, fingerprint(before, pure(jax.device_get(learner.state.params)))


def _assert_matches_reference(name: str, metrics: list[dict], params: dict) -> None:
    """Every metric the replaced step reported, and every parameter's change fingerprint. On the
    machine that wrote the reference they agree to the bit; the tolerance leaves room for numerics
    of the model itself (kernels, XLA), not for a different step."""
    want = REF[name]
    for step, (got, exp) in enumerate(zip(metrics, want["metrics"], strict=True)):
        assert set(exp) <= set(got), f"{name}: metrics {sorted(set(exp) - set(got))} missing"
        for key, value in exp.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-7,
                                       err_msg=f"{name} step {step + 1} {key}")
    assert sorted(params) == sorted(want["params"])
    for path, fp in want["params"].items():
        # Σd and Σd·r cancel: their rounding is relative to the size of the change, |d| (fp[2]),
        # not to their own value. Tests compile at LLVM -O0, whose roundings differ in the 7th
        # digit from the -O2 build that wrote the reference, and two Adam steps (g/√v) magnify
        # that to about 3e-5 |d|; a different step moves them by O(|d|).
        np.testing.assert_allclose(params[path], fp, rtol=1e-5, atol=1e-4 * fp[2] + 1e-8,
                                   err_msg=f"{name} {path}")


@pytest.mark.parametrize("name", [*SFT_CASES, "dpo", *GRPO_CASES])
def test_the_step_computes_what_the_three_steps_did(name):
    if name in SFT_CASES:
        out = _run_sft(name)
    elif name == "dpo":
        out = _run_dpo()
    else:
        out = _run_grpo(name)
    _assert_matches_reference(name, *out)
    # DPO's first step starts at the reference: every margin is 0 and no pair counts as won.
    if name == "dpo":
        assert out[0][0]["reward_margin"] == 0.0 and out[0][0]["reward_accuracy"] == 0.0


def test_dpo_micro_batches_add_up_to_one_pass():
    """Pairs split over micro-batches (chosen and rejected rows of a pair together): the loss,
    metrics and gradient of the whole batch, as for SFT and RL."""
    graphdef, params, rest = nnx.split(initial_model(), nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    # The reference: the parameters moved a little, so the margins are not all zero.
    ref_params = jax.tree.map(lambda x: x * 0.9, params)
    batch = {k: jnp.asarray(v) for k, v in dpo_batch(2, pairs=4).items()}
    batch["ref_logp"] = reference_logprobs(graphdef, rest, ref_params, batch)
    cfg = DPOConfig(**DPO_CASE)
    out = {}
    for m in (1, 4):
        fn = make_loss_and_grad(model_forward(graphdef, rest), PreferenceObjective(cfg, m),
                                model_cfg=CFG, load_balance_coef=0.5)
        out[m] = jax.device_get(jax.jit(fn)(params, batch))
    loss, grads, metrics = out[1]
    assert metrics["reward_margin"] != 0 and 0 < metrics["reward_accuracy"] < 1
    np.testing.assert_allclose(out[4][0], loss, rtol=1e-6)
    for name, value in metrics.items():
        np.testing.assert_allclose(out[4][2][name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    # fp32 sums in another order: equal to a few 1e-5 of each parameter's largest gradient.
    for a, b in zip(jax.tree.leaves(out[4][1]), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()))


def test_optimizer_configs_of_the_jobs():
    # SFT: linear warm-up over warmup_fraction of the steps, then cosine from peak to end LR.
    sched = AdamWConfig(peak_lr=1.0, end_lr=0.1, warmup_fraction=0.1).optimizer(100)
    assert sched.warmup_steps == 10 and sched.total_steps == 100
    assert sched.learning_rate_at(0) == 0.0
    assert sched.learning_rate_at(5) == pytest.approx(0.5)
    assert sched.learning_rate_at(10) == pytest.approx(1.0)
    assert sched.learning_rate_at(55) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-5)  # half-way
    assert sched.learning_rate_at(100) == pytest.approx(0.1)
    # No warm-up: the schedule starts at the peak.
    assert AdamWConfig(peak_lr=0.5, warmup_fraction=0.0).optimizer(10) \
        .learning_rate_at(0) == pytest.approx(0.5)
    # RL: RECIPE §3's AdamW at a constant LR; a bare AdamW unless clipping is asked for.
    rl = LearnerConfig().optimizer()
    assert (rl.learning_rate, rl.b1, rl.b2, rl.eps, rl.weight_decay) == (1e-6, 0.95, 0.95,
                                                                         1e-15, 0.0)
    assert rl.schedule() == 1e-6 and rl.learning_rate_at(1000) == 1e-6

    # Weight decay only on matrices when asked, and clipping before AdamW: with zero gradients
    # (no Adam step) and lr 1, a parameter decays by weight_decay·itself.
    params = {"w": jnp.ones((2, 2)), "g": jnp.ones((2,))}
    zero = jax.tree.map(jnp.zeros_like, params)
    for only, want_g in ((True, 1.0), (False, 0.5)):
        tx = make_optimizer(OptimizerConfig(learning_rate=1.0, weight_decay=0.5,
                                            decay_matrices_only=only, max_grad_norm=1.0))
        updates, _ = tx.update(zero, tx.init(params), params)
        new = optax.apply_updates(params, updates)
        np.testing.assert_allclose(new["w"], 0.5)
        np.testing.assert_allclose(new["g"], want_g)
    # Clipping: a gradient of norm 10 arrives at AdamW with norm 1 (SGD would move by it).
    clipped = optax.clip_by_global_norm(1.0)
    g = {"w": jnp.full((2, 2), 5.0)}
    assert float(optax.global_norm(clipped.update(g, clipped.init(g))[0])) == pytest.approx(1.0)
    # The state layouts the checkpoints hold: AdamW's own without clipping, a chain with it.
    bare = make_optimizer(rl).init(params)
    chained = make_optimizer(LearnerConfig(max_grad_norm=1.0).optimizer()).init(params)
    assert isinstance(bare[0], optax.ScaleByAdamState)
    assert isinstance(chained[1][0], optax.ScaleByAdamState)
    with pytest.raises(ValueError, match="max_grad_norm=0"):
        OptimizerConfig(learning_rate=1.0, max_grad_norm=0)
    with pytest.raises(ValueError, match="learning_rate=-1"):
        OptimizerConfig(learning_rate=-1)


def test_expert_counts_from_record_by_hand():
    """[L, E] assignment counts over the valid tokens of every micro-batch, per layer."""
    rng = np.random.default_rng(0)
    m, layers, b, t, k, e = 2, 3, 2, 5, 2, 4
    routing = rng.integers(0, e, (m, layers, b, t, k)).astype(np.int32)
    segment_ids = rng.integers(0, 3, (m, b, t)).astype(np.int32)
    want = np.zeros((layers, e))
    for i, layer, row, pos, j in np.ndindex(m, layers, b, t, k):
        want[layer, routing[i, layer, row, pos, j]] += segment_ids[i, row, pos] > 0
    got = jax.jit(expert_counts_from_record, static_argnums=2)(routing, segment_ids, e)
    np.testing.assert_array_equal(got, want)


class _ReplayingNextToken(NextTokenObjective):
    """SFT's loss with a routing record [M, L, b, T, k] replayed (as the RL objective does)."""

    def split(self, batch):
        inputs, data = super().split(batch)
        m = self.num_microbatches
        routing = batch["routing"]  # [L, B, T, k]
        inputs["routing"] = jnp.moveaxis(
            routing.reshape(routing.shape[0], m, -1, *routing.shape[2:]), 1, 0)
        return inputs, data


@pytest.mark.parametrize("policy,dtype", [("full", "float32"), ("full_compute", "bfloat16")])
def test_scanned_layers_add_their_gradients_into_the_sum_inside_the_backward(policy, dtype):
    """ModelConfig.accumulate_in_scan: over micro-batches, the scanned layers' gradients are
    added into the running sum in place, period by period, in the backward
    (transformer.accumulating_scan). The same loss, metrics and gradients as the plain form
    (each micro-batch's gradients a new buffer added after its backward), with routing replay
    and dropout keys reaching the recomputed layers, and one gradient-sized buffer less."""
    batch = {k: jnp.asarray(v) for k, v in lm_batch(0, rows=6).items()}
    out, temp = {}, {}
    # fp32: also sharded (fsdp x expert on 4 CPU devices): the in-place adds into a sharded sum,
    # under the model's sharding constraints.
    mesh = make_mesh(MeshConfig(fsdp=2, expert=2, num_devices=4)) if dtype == "float32" else None
    for accumulate in (True, False, "mesh") if mesh else (True, False):
        cfg = dataclasses.replace(CFG, num_layers=4, scan_layers=True, remat_policy=policy,
                                  dtype=dtype, dropout_rate=0.2,
                                  accumulate_in_scan=bool(accumulate))
        graphdef, params, rest = nnx.split(initial_model(cfg), nnx.Param, ...)
        if accumulate == "mesh":
            params = shard_state(params, mesh)
        params = nnx.to_pure_dict(params)
        if "routing" not in batch:  # the record of the model's own routing, replayed
            model = nnx.merge(graphdef, params, rest)
            batch["routing"] = jnp.stack(nnx.jit(lambda model, b: model(
                b["tokens"], positions=b["positions"], segment_ids=b["segment_ids"]).routing)(
                    model, batch))
        fn = jax.jit(make_loss_and_grad(
            model_forward(graphdef, rest), _ReplayingNextToken(num_microbatches=3),
            model_cfg=cfg, load_balance_coef=0.5, dropout_seed=7))
        with jax.set_mesh(mesh) if accumulate == "mesh" else contextlib.nullcontext():
            fn = fn.lower(params, batch).compile()
            out[accumulate] = jax.device_get(fn(params, batch))
        if accumulate == "mesh":
            assert params["scan_blocks"][0]["ffn"]["w_up"].sharding.spec == PartitionSpec(
                None, "expert", "fsdp", "tensor")
            # Sharded reductions add in another order.
            for a, b in zip(jax.tree.leaves(out["mesh"]), jax.tree.leaves(out[True])):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))
            continue
        temp[accumulate] = fn.memory_analysis().temp_size_in_bytes
    (loss, grads, metrics), (ref_loss, ref_grads, ref_metrics) = out[True], out[False]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for name, value in ref_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-6, err_msg=name)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert np.abs(b).max() > 0
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.abs(b).max()))
    # Less temporary memory. At these sizes the activations dominate and XLA:CPU reuses buffers
    # differently in the two programs, so a third to two thirds of the scanned layers' gradient
    # bytes is saved here; at scale it is the whole buffer (docs/measurements.md).
    scanned_bytes = sum(x.nbytes for x in jax.tree.leaves(params["scan_blocks"]))
    assert temp[False] - temp[True] >= scanned_bytes // 4, (temp, scanned_bytes)


def test_an_accumulator_needs_full_remat_and_no_cache():
    cfg = dataclasses.replace(CFG, num_layers=4, scan_layers=True, remat_policy="dots")
    graphdef, params = nnx.split(initial_model(cfg))
    acc = jax.tree.map(jnp.zeros_like, nnx.to_pure_dict(params))["scan_blocks"]
    with pytest.raises(ValueError, match="remat_policy 'full' or 'full_compute', not 'dots'"):
        nnx.merge(graphdef, params)(jnp.ones((2, 4), jnp.int32), grad_accumulator=acc)
