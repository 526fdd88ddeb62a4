"""Self-attention of packed rows (pallas_kernels/self_attention.py): the blocked form (query blocks
that skip invisible keys, hand-written backward) against dense masked attention, the same outputs
and gradients for every query that sees a key, on packed rows with windows, GQA and sinks, and the
same logits through the whole model; the dispatcher's every impl against the reference, and what
"auto" picks on each platform."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hcjax.model import Transformer
from hcjax.model.attention import mla_softmax_scale
from pallas_kernels import _dispatch
from pallas_kernels.self_attention import (
    attention_mask,
    blocked_attention,
    gqa_attention,
    self_attention,
    self_attention_impl,
    self_attention_reference,
)
from tests.test_model import BASE, make_model
from tests.test_model_scale import DEEPSEEK


def packed_row(lengths, pad):
    """Positions restarting per segment, segment ids 1.., then `pad` padding tokens (segment 0)."""
    pos = np.concatenate([np.arange(n) for n in lengths] + [np.full(pad, -1)])
    seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(pad)])
    return jnp.asarray(pos, jnp.int32), jnp.asarray(seg, jnp.int32)


def qkv(b, t, hq=4, hkv=2, d=8, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (b, t, hq, d)), jax.random.normal(ks[1], (b, t, hkv, d)),
            jax.random.normal(ks[2], (b, t, hkv, d)))


@pytest.mark.parametrize("window", [None, 7, 50])
@pytest.mark.parametrize("sinks", [False, True])
def test_blocked_equals_dense_on_packed_rows(window, sinks):
    rows = [packed_row([40, 70, 30], 10), packed_row([150], 0)]
    pos = jnp.stack([r[0] for r in rows])
    seg = jnp.stack([r[1] for r in rows])
    q, k, v = qkv(2, 150)
    sinks_h = jnp.linspace(-1.0, 1.0, 4) if sinks else None
    w = jax.random.normal(jax.random.key(7), q.shape)
    valid = (seg > 0)[:, :, None, None]

    def dense(q, k, v, sinks_h):
        mask = attention_mask(pos, pos, seg, seg, window)
        return gqa_attention(q, k, v, mask, sinks_h=sinks_h)

    def blocked(q, k, v, sinks_h):
        return blocked_attention(q, k, v, pos, seg, window, block=32, sinks_h=sinks_h)

    ref, got = jax.jit(dense)(q, k, v, sinks_h), jax.jit(blocked)(q, k, v, sinks_h)
    np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, ref, 0),
                               rtol=1e-5, atol=1e-5)

    def loss(f):
        return lambda *a: jnp.sum(jnp.where(valid, f(*a) * w, 0.0))

    argnums = (0, 1, 2, 3) if sinks else (0, 1, 2)  # the sinks' own gradient too
    for g_ref, g_got in zip(jax.jit(jax.grad(loss(dense), argnums))(q, k, v, sinks_h),
                            jax.jit(jax.grad(loss(blocked), argnums))(q, k, v, sinks_h),
                            strict=True):
        np.testing.assert_allclose(g_got, g_ref, rtol=1e-4, atol=1e-5)


def test_blocked_bf16_follows_the_dense_path():
    # bf16 q/k/v (the learner's bf16 compute): fp32 scores inside, outputs and gradients in
    # bf16, close to the dense path in the same precision.
    pos, seg = packed_row([100, 60], 20)
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv(1, 180))
    pos, seg = pos[None], seg[None]
    valid = (seg > 0)[:, :, None, None]

    def loss(f):
        return lambda q, k, v: jnp.sum(jnp.where(valid, f(q, k, v), 0).astype(jnp.float32) ** 2)

    dense = lambda q, k, v: gqa_attention(q, k, v, attention_mask(pos, pos, seg, seg, 31))  # noqa: E731
    blocked = lambda q, k, v: blocked_attention(q, k, v, pos, seg, 31, block=64)  # noqa: E731
    assert blocked(q, k, v).dtype == jnp.bfloat16
    for g_ref, g_got in zip(jax.grad(loss(dense), (0, 1, 2))(q, k, v),
                            jax.grad(loss(blocked), (0, 1, 2))(q, k, v), strict=True):
        assert g_got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(g_got, np.float32), np.asarray(g_ref, np.float32),
                                   rtol=0.05, atol=0.05)


def test_short_rows_are_one_block():
    pos, seg = packed_row([20], 0)
    q, k, v = qkv(1, 20)
    got = blocked_attention(q, k, v, pos[None], seg[None], None, block=64)
    ref = gqa_attention(q, k, v, attention_mask(pos[None], pos[None], seg[None], seg[None], None))
    np.testing.assert_array_equal(got, ref)


def test_model_logits_and_grads_equal_reference():
    ref_cfg = dataclasses.replace(BASE, max_seq_len=160)
    ref_model = make_model(ref_cfg)
    model = make_model(dataclasses.replace(ref_cfg, attention_impl="blocked"))
    nnx.update(model, nnx.state(ref_model))
    pos, seg = packed_row([50, 60, 30], 20)
    toks = jax.random.randint(jax.random.key(3), (1, 160), 0, BASE.vocab_size)
    valid = np.asarray(seg > 0)[None]

    def loss(m):
        out = m(toks, positions=pos[None], segment_ids=seg[None])
        lp = jax.nn.log_softmax(out.logits)
        return jnp.sum(jnp.where(valid[..., None], lp * jnp.cos(jnp.arange(BASE.vocab_size)), 0))

    step = nnx.jit(nnx.value_and_grad(loss))
    (l_ref, g_ref), (l_got, g_got) = step(ref_model), step(model)
    np.testing.assert_allclose(l_got, l_ref, rtol=1e-5)
    flat_ref, flat_got = jax.tree.leaves(g_ref), jax.tree.leaves(g_got)
    assert len(flat_ref) == len(flat_got)
    for a, b in zip(flat_ref, flat_got, strict=True):
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("impl, window", [("blocked", 9), ("pallas", None), ("pallas", 9)])
def test_dispatched_impls_equal_the_reference_values_and_grads(impl, window):
    # The flash kernel (interpret mode) masks by index within segments: packed rows whose
    # positions restart per segment, padding (segment 0) at the end.
    rows = [packed_row([30, 20], 6), packed_row([56], 0)]
    pos, seg = (jnp.stack([r[i] for r in rows]) for i in (0, 1))
    q, k, v = qkv(2, 56, seed=3)
    probe = jax.random.normal(jax.random.key(5), q.shape)
    valid = (seg > 0)[:, :, None, None]

    def loss(f):
        return lambda q, k, v: jnp.sum(jnp.where(valid, f(q, k, v) * probe, 0.0))

    ref = lambda q, k, v: self_attention_reference(q, k, v, pos, seg, window)  # noqa: E731
    got = lambda q, k, v: self_attention(q, k, v, pos, seg, window=window, impl=impl,  # noqa: E731
                                         block=16)
    np.testing.assert_allclose(np.where(valid, jax.jit(got)(q, k, v), 0),
                               np.where(valid, jax.jit(ref)(q, k, v), 0), rtol=1e-5, atol=1e-5)
    for g_ref, g_got in zip(jax.jit(jax.grad(loss(ref), (0, 1, 2)))(q, k, v),
                            jax.jit(jax.grad(loss(got), (0, 1, 2)))(q, k, v), strict=True):
        np.testing.assert_allclose(g_got, g_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("platform, auto, with_sinks", [
    ("cpu", "blocked", "blocked"), ("gpu", "pallas", "blocked"), ("tpu", "pallas", "blocked")])
def test_auto_by_platform(monkeypatch, platform, auto, with_sinks):
    monkeypatch.setattr(_dispatch, "backend", lambda: platform)
    assert self_attention_impl("auto") == auto
    assert self_attention_impl("auto", sinks=True) == with_sinks  # the flash kernel has no sinks
    for impl in ("reference", "blocked", "pallas"):
        assert self_attention_impl(impl) == impl


def test_bad_choices_are_named():
    with pytest.raises(ValueError, match="impl='flash' is not one of"):
        self_attention_impl("flash")
    with pytest.raises(ValueError, match="impl='pallas'.*has no attention sinks"):
        self_attention_impl("pallas", sinks=True)
    q, k, v = qkv(1, 8)
    with pytest.raises(ValueError, match="positions_bt is None"):
        self_attention(q, k, v, None, None, impl="blocked")
    with pytest.raises(ValueError, match="block=0"):
        blocked_attention(q, k, v, jnp.arange(8)[None], None, None, block=0)


@pytest.mark.parametrize("impl", ["blocked", "pallas"])
def test_mla_shapes_and_scale_equal_the_reference_values_and_grads(impl):
    # MLA's shape: queries and keys wider than values (Dqk = nope + rope, Dv = v_head_dim), one
    # key head per query head, and a softmax scale that is not Dqk**-0.5 (YaRN's mscale²).
    rows = [packed_row([30, 20], 6), packed_row([56], 0)]
    pos, seg = (jnp.stack([r[i] for r in rows]) for i in (0, 1))
    ks = jax.random.split(jax.random.key(11), 4)
    q = jax.random.normal(ks[0], (2, 56, 4, 12))
    k = jax.random.normal(ks[1], (2, 56, 4, 12))
    v = jax.random.normal(ks[2], (2, 56, 4, 8))
    probe = jax.random.normal(ks[3], (2, 56, 4, 8))
    scale = 0.37  # not 12**-0.5 = 0.289
    valid = (seg > 0)[:, :, None, None]

    def loss(f):
        return lambda q, k, v: jnp.sum(jnp.where(valid, f(q, k, v) * probe, 0.0))

    mask = attention_mask(pos, pos, seg, seg, None)
    ref = lambda q, k, v: gqa_attention(q, k, v, mask, scale=scale)  # noqa: E731
    got = lambda q, k, v: self_attention(q, k, v, pos, seg, scale=scale, impl=impl,  # noqa: E731
                                         block=16)
    out = jax.jit(got)(q, k, v)
    assert out.shape == (2, 56, 4, 8)
    np.testing.assert_allclose(np.where(valid, out, 0), np.where(valid, jax.jit(ref)(q, k, v), 0),
                               rtol=1e-5, atol=1e-5)
    # The default scale is a different answer: the scale reaches the kernel.
    default = self_attention(q, k, v, pos, seg, impl=impl, block=16)
    assert np.abs(np.where(valid, default - out, 0)).max() > 1e-2
    for g_ref, g_got in zip(jax.jit(jax.grad(loss(ref), (0, 1, 2)))(q, k, v),
                            jax.jit(jax.grad(loss(got), (0, 1, 2)))(q, k, v), strict=True):
        np.testing.assert_allclose(g_got, g_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["blocked", "pallas"])
def test_mla_model_logits_and_grads_equal_reference(impl):
    # A DeepSeek-like model (MLA, YaRN so the softmax scale carries mscale²) on packed rows: its
    # full forward through `self_attention` (no T x T scores) equals the dense masked reference.
    ref_cfg = dataclasses.replace(
        DEEPSEEK, max_seq_len=160, rope_scaling="yarn", rope_factor=4.0,
        rope_original_max_len=32, rope_mscale=1.0, rope_mscale_all_dim=1.0)
    assert mla_softmax_scale(ref_cfg) != (ref_cfg.qk_nope_head_dim
                                          + ref_cfg.qk_rope_head_dim) ** -0.5
    ref_model = Transformer(ref_cfg, rngs=nnx.Rngs(0))
    model = Transformer(dataclasses.replace(ref_cfg, attention_impl=impl), rngs=nnx.Rngs(1))
    nnx.update(model, nnx.state(ref_model))
    t = 160 if impl == "blocked" else 72  # the interpreted kernel is slow; blocked needs T > 64
    lengths = [50, 60, 30] if impl == "blocked" else [30, 34]
    pos, seg = packed_row(lengths, t - sum(lengths))
    toks = jax.random.randint(jax.random.key(3), (1, t), 0, ref_cfg.vocab_size)
    valid = np.asarray(seg > 0)[None]

    def loss(m):
        out = m(toks, positions=pos[None], segment_ids=seg[None])
        lp = jax.nn.log_softmax(out.logits)
        return jnp.sum(jnp.where(valid[..., None], lp * jnp.cos(jnp.arange(ref_cfg.vocab_size)),
                                 0))

    step = nnx.jit(nnx.value_and_grad(loss))
    (l_ref, g_ref), (l_got, g_got) = step(ref_model), step(model)
    np.testing.assert_allclose(l_got, l_ref, rtol=1e-5)
    flat_ref, flat_got = jax.tree.leaves(g_ref), jax.tree.leaves(g_got)
    assert len(flat_ref) == len(flat_got)
    for a, b in zip(flat_ref, flat_got, strict=True):
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-5)
