"""The LM trainer: loss weights, next-token loss, its optimiser settings, gradient accumulation
equal to one big batch (load-balance loss included), and dropout per step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from hcjax.model import ModelConfig, Transformer
from hcjax.train.loop import AdamWConfig, TrainerConfig
from hcjax.train.sft import make_sft_step, target_weights, token_nll

# One MoE layer keeps compile times small on 2 shared CPU cores.
TINY = ModelConfig(
    vocab_size=272, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
    attention_pattern=("global",), window=16, ffn_pattern=("moe",), d_ff=64,
    num_experts=4, experts_per_token=2, moe_latent_dim=16, moe_d_ff=32, dtype="float32",
    max_seq_len=64,
)


def test_target_weights_hand_computed():
    batch = {
        # two documents [a b c] [d e] then padding; loss mask on b, c, e
        "segment_ids": jnp.array([[1, 1, 1, 2, 2, 0]]),
        "loss_mask": jnp.array([[0, 1, 1, 0, 1, 0]]),
    }
    # position t predicts t+1: t=0->b (1), t=1->c (1), t=2->d (other doc: 0), t=3->e (1),
    # t=4->pad (0), t=5 has no target.
    np.testing.assert_array_equal(target_weights(batch), [[1, 1, 0, 1, 0, 0]])


def test_token_nll_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    tokens = rng.integers(0, 7, (2, 5)).astype(np.int32)
    nll, hit = token_nll(jnp.asarray(logits), jnp.asarray(tokens))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    for b in range(2):
        for t in range(4):
            assert float(nll[b, t]) == pytest.approx(-logp[b, t, tokens[b, t + 1]], rel=1e-5)
            assert float(hit[b, t]) == float(np.argmax(logits[b, t]) == tokens[b, t + 1])


def test_recipe_self_distillation_defaults():
    # RECIPE §3 self-distillation defaults (the schedule itself: tests/test_train_step.py).
    d, loop = AdamWConfig(), TrainerConfig()
    assert (d.peak_lr, d.end_lr, d.warmup_fraction, d.weight_decay, loop.load_balance_coef) == (
        1.7e-5, 5.2e-6, 0.02, 0.001, 1e-2
    )
    opt = d.optimizer(loop.num_steps)
    assert (opt.learning_rate, opt.end_learning_rate, opt.warmup_steps, opt.total_steps) == (
        1.7e-5, 5.2e-6, 20, 1000
    )
    assert opt.decay_matrices_only and opt.max_grad_norm == d.grad_clip


def test_bad_loop_configs():
    with pytest.raises(ValueError, match="batch_size=6 is not a multiple of num_microbatches=4"):
        TrainerConfig(batch_size=6, num_microbatches=4)
    with pytest.raises(ValueError, match="TrainerConfig.num_steps=0"):
        TrainerConfig(num_steps=0)
    with pytest.raises(ValueError, match="TrainerConfig.load_balance_coef=-1"):
        TrainerConfig(load_balance_coef=-1)
    with pytest.raises(ValueError, match="AdamWConfig.grad_clip=0"):
        AdamWConfig(grad_clip=0)
    with pytest.raises(ValueError, match="AdamWConfig.warmup_fraction=1.0"):
        AdamWConfig(warmup_fraction=1.0)


def _batch(b=8, t=32, seed=0):
    from hcjax.train.pipeline import DataConfig, make_batch_iterator

    it = make_batch_iterator(DataConfig(row_len=t, shuffle_seed=seed), batch_size=b)
    return {k: jnp.asarray(v) for k, v in next(it).items()}


def test_accumulation_equals_one_big_batch():
    """SGD with lr 1 makes the update minus the gradient, so the accumulated gradient of 4
    micro-batches is compared with the full batch's directly. The load-balance coefficient is large so that its
    global-batch statistics matter."""
    model = Transformer(TINY, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    batch = _batch()
    tx = optax.sgd(1.0)
    results = {}
    for m in (1, 4):
        cfg = TrainerConfig(batch_size=8, num_microbatches=m, load_balance_coef=0.5)
        step = jax.jit(make_sft_step(graphdef, rest, tx, cfg, TINY))
        state = {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}
        new, metrics = step(state, batch)
        results[m] = (jax.tree.map(lambda a, b: a - b, params, new["params"]), metrics)
    g1, m1 = results[1]
    assert float(m1["load_balance_loss"]) > 0
    for m in (4,):
        g, mm = results[m]
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g), strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-7)
        for k in ("loss", "load_balance_loss", "grad_norm", "token_accuracy"):
            assert float(mm[k]) == pytest.approx(float(m1[k]), rel=1e-5), k
    # The router gradient comes only from the load-balance term: it must be non-zero and, with
    # per-micro-batch statistics instead of global ones, it would differ.
    router = g1["blocks"][0]["ffn"]["router"]
    assert float(jnp.abs(router).max()) > 0


def test_dropout_is_active_and_deterministic_per_step():
    """Dropout masks come from (seed, step): the same step gives the same loss, the next step
    (same parameters: SGD with lr 0) a different one, and rate 0 would give the same for both."""
    cfg_m = dataclasses.replace(TINY, dropout_rate=0.5)
    model = Transformer(cfg_m, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    batch = _batch()
    tx = optax.sgd(0.0)
    state = {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    step = jax.jit(make_sft_step(graphdef, rest, tx, TrainerConfig(batch_size=8), cfg_m))
    s1, a = step(state, batch)
    _, b = step(state, batch)
    _, c = step(s1, batch)
    assert int(s1["step"]) == 1
    assert float(a["loss"]) == float(b["loss"])
    assert float(a["loss"]) != pytest.approx(float(c["loss"]), rel=1e-4)
