"""Hand-computed values, finite-difference gradients and additivity of the RL losses."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcjax.rl.losses import (
    CORRECTIONS,
    LOSSES,
    LossConfig,
    grpo_loss,
    gspo_loss,
    kimi_loss,
    rollout_correction,
)
from hcjax.train.step import combine_metrics

# GRPO hand case: eps=0.5 -> lo=0.5; k=0.5 -> hi=1/(1-0.5)+0.5=2.5; r_max=4.
RATIOS = [1.2, 3.0, 0.25, 0.25, 3.0, 6.0, 6.0, 1.7]
ADV = [1.0, 1.0, 1.0, -2.0, -2.0, -2.0, 1.0, 5.0]
MASK = [1, 1, 1, 1, 1, 1, 1, 0]
OLD = -2.0


def _grpo_inputs():
    logp = jnp.array([[OLD + math.log(r) for r in RATIOS]], jnp.float32)
    old = jnp.full_like(logp, OLD)
    return logp, old, jnp.array([ADV], jnp.float32), jnp.array([MASK], bool)


def _grpo(logp, old, adv, mask, num_tokens=10.0):
    return grpo_loss(logp, old, adv, mask, eps=0.5, k=0.5, r_min=0.0, r_max=4.0,
                     num_tokens=num_tokens)


def test_grpo_hand_values_every_branch():
    logp, old, adv, mask = _grpo_inputs()
    loss, m = _grpo(logp, old, adv, mask)
    # inside: 1.2 | clip high: 2.5 | below lo, A>0 unclipped: 0.25 | clip low: -1.0 |
    # above hi, A<0 unclipped: -6 | outer r=6->4, A<0: -8 | outer and clip high: 2.5 | masked.
    expected = -(1.2 + 2.5 + 0.25 - 1.0 - 6.0 - 8.0 + 2.5) / 10.0
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    np.testing.assert_allclose(m["clip_low_frac"], 1 / 10)
    np.testing.assert_allclose(m["clip_high_frac"], 2 / 10)
    np.testing.assert_allclose(m["clip_outer_frac"], 2 / 10)
    np.testing.assert_allclose(m["ratio_mean"], (1.2 + 3 + 0.25 + 0.25 + 3 + 6 + 6) / 10, rtol=1e-6)
    np.testing.assert_allclose(m["ratio_max"], 6.0, rtol=1e-6)
    h = sum(-(OLD + math.log(r)) * r for r, mk in zip(RATIOS, MASK) if mk) / 10.0
    np.testing.assert_allclose(m["entropy"], h, rtol=1e-6)
    np.testing.assert_allclose(m["num_loss_tokens"], 7.0)


def test_grpo_hand_gradient():
    logp, old, adv, mask = _grpo_inputs()
    g = jax.grad(lambda lp: _grpo(lp, old, adv, mask)[0])(logp)
    # d(-obj/N)/dlogp = -A·r/N on unclipped branches, 0 where a clip is active or masked.
    expected = [-1.2 / 10, 0.0, -0.25 / 10, 0.0, 6.0 / 10, 0.0, 0.0, 0.0]
    np.testing.assert_allclose(g[0], expected, rtol=1e-5, atol=1e-8)


def test_grpo_per_response_advantages_and_k_zero_symmetry():
    # advantages [B] broadcast over tokens equal the [B, T] form.
    logp = jnp.log(jnp.array([[0.5, 0.2], [0.3, 0.9]]))
    old = jnp.log(jnp.array([[0.4, 0.4], [0.3, 0.1]]))
    mask = jnp.ones((2, 2), bool)
    a = grpo_loss(logp, old, jnp.array([1.0, -1.0]), mask, eps=0.6, k=0.0, r_min=0.0,
                  r_max=50.0, num_tokens=4)[0]
    b = grpo_loss(logp, old, jnp.array([[1.0, 1.0], [-1.0, -1.0]]), mask, eps=0.6, k=0.0,
                  r_min=0.0, r_max=50.0, num_tokens=4)[0]
    np.testing.assert_allclose(a, b)
    # ratios 1.25, 0.5, 1, 9; lo=0.4, hi=2.5: 1.25 - 0.5*... -> 1.25 + 0.5 - 1 - 9 (A<0 unclipped)
    np.testing.assert_allclose(a, -(1.25 + 0.5 - 1.0 - 9.0) / 4, rtol=1e-6)
    with pytest.raises(ValueError, match="advantages shape"):
        grpo_loss(logp, old, jnp.ones(3), mask, eps=0.6, k=0.0, r_min=0.0, r_max=50.0,
                  num_tokens=4)


def test_grpo_extreme_ratio_has_finite_gradient():
    logp = jnp.array([[0.0, -1.0]])
    old = jnp.array([[-200.0, -1.0]])  # ratio e^200 overflows fp32
    g = jax.grad(lambda lp: grpo_loss(lp, old, jnp.array([-1.0]), jnp.ones((1, 2), bool), eps=0.6,
                                      k=0.0, r_min=0.0, r_max=50.0, num_tokens=2)[0])(logp)
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g[0, 0], 0.0)  # outer clip: no gradient above r_max


def _fd_check(f, x, eps=1e-3, rtol=2e-2, atol=2e-4):
    f = jax.jit(f)
    g = np.asarray(jax.jit(jax.grad(f))(x))
    x = np.asarray(x)
    fd = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[idx] = eps
        fd[idx] = (f(jnp.asarray(x + e)) - f(jnp.asarray(x - e))) / (2 * eps)
    np.testing.assert_allclose(g, fd, rtol=rtol, atol=atol)


def _random_case(seed):
    rng = np.random.default_rng(seed)
    # Log ratios drawn away from every clip kink (|log r - log bound| > 0.05) so FD is smooth.
    bounds = np.log([0.4, 2.5, 50.0])
    lr = rng.uniform(-1.5, 1.5, size=(3, 5))
    lr = np.where(np.min(np.abs(lr[..., None] - bounds), -1) < 0.05, 0.0, lr)
    old = rng.uniform(-3.0, -0.1, size=(3, 5))
    logp = (old + lr).astype(np.float32)
    adv = rng.normal(size=(3,)).astype(np.float32)
    mask = rng.uniform(size=(3, 5)) < 0.8
    seg = np.array([[1, 1, 2, 2, 2], [1, 1, 1, 1, 0], [1, 2, 2, 3, 3]], np.int32)
    return jnp.asarray(logp), jnp.asarray(old, jnp.float32), jnp.asarray(adv), jnp.asarray(mask), seg


@pytest.mark.parametrize("seed", [0, 1])
def test_gradients_match_finite_differences(seed):
    logp, old, adv, mask, seg = _random_case(seed)
    _fd_check(lambda lp: grpo_loss(lp, old, adv, mask, eps=0.6, k=0.3, r_min=0.0, r_max=50.0,
                                   num_tokens=12.0)[0], logp)
    _fd_check(lambda lp: gspo_loss(lp, old, adv, mask, eps_low=0.9, eps_high=5.0, k=0.0, r_min=0.0,
                                   r_max=50.0, num_tokens=12.0, num_sequences=6.0,
                                   segment_ids=jnp.asarray(seg))[0], logp)
    _fd_check(lambda lp: kimi_loss(lp, old, adv, mask, tau=0.3, num_tokens=12.0, num_sequences=6.0,
                                   segment_ids=jnp.asarray(seg))[0], logp)


def _two_sequences():
    # One packed row: sequence 1 = tokens 0-1, sequence 2 = tokens 2-4 (token 4 masked), padding.
    lr = np.array([[0.1, 0.3, -0.5, -0.5, -0.8, 0.0]], np.float32)
    old = np.full_like(lr, -1.0)
    seg = jnp.array([[1, 1, 2, 2, 2, 0]])
    mask = jnp.array([[1, 1, 1, 1, 0, 0]], bool)
    return jnp.asarray(old + lr), jnp.asarray(old), seg, mask


def test_gspo_hand_values():
    logp, old, seg, mask = _two_sequences()
    adv = jnp.array([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])

    def f(lp):
        return gspo_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.1, k=0.1, r_min=0.0,
                         r_max=50.0, num_tokens=4.0, num_sequences=2.0, segment_ids=seg)

    loss, m = f(logp)
    # s1 = e^0.2 = 1.2214 > hi = 1.2 -> 1.2 (clipped); s2 = e^-0.5 = 0.6065 < lo, A>0 -> unclipped.
    s2 = math.exp(-0.5)
    np.testing.assert_allclose(loss, -(1.2 + s2) / 2, rtol=1e-6)
    np.testing.assert_allclose(m["clip_high_frac"], 2 / 4)
    g = jax.grad(lambda lp: f(lp)[0])(logp)
    # ds2/dlogp_t = s2/|y2| for each of its 2 loss tokens; loss = -(...)/2.
    np.testing.assert_allclose(g[0], [0, 0, -s2 / 4, -s2 / 4, 0, 0], rtol=1e-5, atol=1e-8)
    # Negative advantage below lo is clipped.
    adv2 = jnp.array([[1.0, 1.0, -1.0, -1.0, -1.0, 0.0]])
    loss2 = gspo_loss(logp, old, adv2, mask, eps_low=0.2, eps_high=0.1, k=0.1, r_min=0.0,
                      r_max=50.0, num_tokens=4.0, num_sequences=2.0, segment_ids=seg)[0]
    np.testing.assert_allclose(loss2, -(1.2 - 0.8) / 2, rtol=1e-6)


def test_kimi_hand_values():
    logp, old, seg, mask = _two_sequences()
    adv = jnp.array([[1.0, 1.0, -1.0, -1.0, -1.0, 0.0]])

    def f(lp):
        return kimi_loss(lp, old, adv, mask, tau=0.5, num_tokens=4.0, num_sequences=2.0,
                         segment_ids=seg)

    loss, m = f(logp)
    # seq log-ratios 0.4 and -1.0: (1 - 0.5*0.4)^2 = 0.64, (-1 + 0.5)^2 = 0.25; mean over 2.
    np.testing.assert_allclose(loss, (0.64 + 0.25) / 2, rtol=1e-6)
    np.testing.assert_allclose(m["kl_prev"], (-0.4 + 1.0) / 2, rtol=1e-6)
    g = jax.grad(lambda lp: f(lp)[0])(logp)
    # d/dlogp_t (A - τρ)^2 = -2τ(A - τρ): -0.8 for seq 1, +0.5 for seq 2; divided by 2 sequences.
    np.testing.assert_allclose(g[0], [-0.4, -0.4, 0.25, 0.25, 0, 0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_loss_is_additive_over_batch_parts(name):
    # The global loss equals the sum of the losses of any split of the rows given global totals;
    # metrics combine the same way (max for *_max).
    logp, old, adv, mask, seg = _random_case(3)
    fn = LossConfig(name=name, gspo_eps_low=0.2, gspo_eps_high=0.2).make()
    totals = dict(k=0.2, num_tokens=float(mask.sum()), num_sequences=7.0)
    whole, mw = fn(logp, old, adv, mask, segment_ids=jnp.asarray(seg), **totals)
    parts = [fn(logp[s], old[s], adv[s], mask[s], segment_ids=jnp.asarray(seg[s]), **totals)
             for s in (slice(0, 1), slice(1, 3))]
    np.testing.assert_allclose(sum(p[0] for p in parts), whole, rtol=1e-6)
    mc = combine_metrics({key: jnp.stack([p[1][key] for p in parts]) for key in mw})
    for key in mw:
        np.testing.assert_allclose(mc[key], mw[key], rtol=1e-6, err_msg=key)


# Rollout corrections: one packed row, sequence 1 = tokens 0-2, sequence 2 = tokens 3-5 (token 5
# masked), padding at 6. ρ_t = π_prox/π_samp per token.
RHO = [1.5, 3.0, 0.4, 1.2, 0.9, 7.0, 1.0]
IS_MASK = [1, 1, 1, 1, 1, 0, 0]
IS_SEG = [1, 1, 1, 2, 2, 2, 0]


def _is_case():
    samp = jnp.full((1, 7), -1.0, jnp.float32)
    prox = samp + jnp.log(jnp.array([RHO], jnp.float32))
    return prox, samp, jnp.array([IS_MASK], bool), jnp.array([IS_SEG], jnp.int32)


def _weights(kind, seq_form="product"):
    prox, samp, mask, seg = _is_case()
    return rollout_correction(prox, samp, mask, kind=kind, cap=2.0, low=0.5, high=2.0,
                              num_tokens=10.0, segment_ids=seg, seq_form=seq_form)


@pytest.mark.parametrize("kind,seq_form,expected,clipped", [
    ("none", "product", [1, 1, 1, 1, 1, 0, 0], 0),
    ("tis", "product", [1.5, 2.0, 0.4, 1.2, 0.9, 0, 0], 1),  # 3.0 truncated at C=2
    # ρ_1 = 1.5·3·0.4 = 1.8 (< C), ρ_2 = 1.2·0.9 = 1.08 (the masked 7.0 does not count).
    ("seq_tis", "product", [1.8, 1.8, 1.8, 1.08, 1.08, 0, 0], 0),
    # geometric: 1.8^(1/3), 1.08^(1/2).
    ("seq_tis", "geometric", [1.8 ** (1 / 3)] * 3 + [1.08 ** 0.5] * 2 + [0, 0], 0),
    ("mis", "product", [1, 0, 0, 1, 1, 0, 0], 2),  # 3.0 and 0.4 leave [0.5, 2]
    ("seq_mis", "product", [1, 1, 1, 1, 1, 0, 0], 0),  # 1.8 and 1.08 are inside
    ("icepop", "product", [1.5, 0, 0, 1.2, 0.9, 0, 0], 2),
])
def test_rollout_correction_hand_weights(kind, seq_form, expected, clipped):
    w, m = _weights(kind, seq_form)
    np.testing.assert_allclose(w[0], expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(m["is_clip_frac"], clipped / 10)
    np.testing.assert_allclose(m["is_weight_mean"], sum(expected) / 10, rtol=1e-6)
    kept = [r for r, mk in zip(RHO, IS_MASK) if mk]
    np.testing.assert_allclose(m["is_ratio_mean"], sum(kept) / 10, rtol=1e-6)
    np.testing.assert_allclose(m["is_ratio_max"], 3.0, rtol=1e-6)
    np.testing.assert_allclose(m["is_kl"], sum(r - 1 - math.log(r) for r in kept) / 10, rtol=1e-5)


def test_seq_mis_drops_whole_sequence_and_product_tis_cannot_overflow():
    prox, samp, mask, seg = _is_case()
    prox = prox.at[0, 4].add(1.0)  # ρ_2 = 1.08·e > 2: sequence 2 leaves the band
    w, m = rollout_correction(prox, samp, mask, kind="seq_mis", cap=2.0, low=0.5, high=2.0,
                              num_tokens=10.0, segment_ids=seg)
    np.testing.assert_allclose(w[0], [1, 1, 1, 0, 0, 0, 0])
    np.testing.assert_allclose(m["is_clip_frac"], 2 / 10)
    big = jnp.where(mask, samp + 60.0, samp)  # Π ρ = e^300 overflows fp32; the weight is C
    w, m = rollout_correction(big, samp, mask, kind="seq_tis", cap=2.0, low=0.5, high=2.0,
                              num_tokens=10.0, segment_ids=seg)
    np.testing.assert_allclose(w[0], [2, 2, 2, 2, 2, 0, 0])
    assert all(np.isfinite(float(v)) for v in m.values())


@pytest.mark.parametrize("kind", ["tis", "seq_tis", "icepop"])
def test_corrected_grpo_hand_loss_and_gradient(kind):
    # With a correction the PPO ratio is against π_prox = π_θ (detached): value 1, so the loss is
    # -1/N Σ w_t·A_t and its gradient -w_t·A_t/N; the weights themselves carry no gradient.
    prox, samp, mask, seg = _is_case()
    adv = jnp.array([[1.0, 1.0, 1.0, -2.0, -2.0, -2.0, 0.0]])
    w, _ = _weights(kind)
    fn = LossConfig(correction=kind, is_cap=2.0, is_low=0.5, is_high=2.0).make()

    def f(lp):
        return fn(lp, samp, adv, mask, k=0.0, num_tokens=10.0, num_sequences=2.0,
                  segment_ids=seg)

    loss, m = f(prox)
    np.testing.assert_allclose(loss, -float(jnp.sum(w * adv)) / 10, rtol=1e-6)
    g = jax.grad(lambda lp: f(lp)[0])(prox)
    np.testing.assert_allclose(g, -w * adv / 10, rtol=1e-5, atol=1e-8)
    # Ĥ stays RECIPE §3's estimate against the sampler: Σ -log π_θ · π_θ/π_samp.
    h = sum(-(-1.0 + math.log(r)) * r for r, mk in zip(RHO, IS_MASK) if mk) / 10
    np.testing.assert_allclose(m["entropy"], h, rtol=1e-5)
    np.testing.assert_allclose(m["ratio_mean"], 5 / 10, rtol=1e-6)  # r' = 1 on the 5 tokens
    assert {"is_clip_frac", "is_ratio_max", "is_kl", "is_weight_mean"} <= set(m)


def test_corrected_gspo_sequence_weight():
    prox, samp, mask, seg = _is_case()
    adv = jnp.array([[1.0, 1.0, 1.0, -2.0, -2.0, -2.0, 0.0]])
    fn = LossConfig(name="gspo", correction="seq_tis", is_cap=2.0).make()

    def f(lp):
        return fn(lp, samp, adv, mask, k=0.0, num_tokens=10.0, num_sequences=2.0,
                  segment_ids=seg)

    # s'_i = 1: J = 1/2 (1.8·1 + 1.08·(-2)); ∂/∂logp_t = w_i·A_i/|y_i|.
    np.testing.assert_allclose(f(prox)[0], -(1.8 - 2.16) / 2, rtol=1e-6)
    g = jax.grad(lambda lp: f(lp)[0])(prox)
    expected = [-1.8 / 3 / 2] * 3 + [2.16 / 2 / 2] * 2 + [0, 0]
    np.testing.assert_allclose(g[0], expected, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("kind", [c for c in CORRECTIONS if c != "none"])
def test_corrected_loss_is_additive_over_batch_parts(kind):
    logp, old, adv, mask, seg = _random_case(4)
    fn = LossConfig(correction=kind, is_seq_form="geometric").make()
    totals = dict(k=0.2, num_tokens=float(mask.sum()), num_sequences=7.0)
    whole, mw = fn(logp, old, adv, mask, segment_ids=jnp.asarray(seg), **totals)
    parts = [fn(logp[s], old[s], adv[s], mask[s], segment_ids=jnp.asarray(seg[s]), **totals)
             for s in (slice(0, 1), slice(1, 3))]
    np.testing.assert_allclose(sum(p[0] for p in parts), whole, rtol=1e-6)
    mc = combine_metrics({key: jnp.stack([p[1][key] for p in parts]) for key in mw})
    for key in mw:
        np.testing.assert_allclose(mc[key], mw[key], rtol=1e-5, err_msg=key)


def test_loss_config_validation():
    with pytest.raises(ValueError, match="correction='tls'"):
        LossConfig(correction="tls")
    with pytest.raises(ValueError, match="name='kimi'"):
        LossConfig(name="kimi", correction="tis")
    with pytest.raises(ValueError, match="is_low=1.5"):
        LossConfig(is_low=1.5)
    with pytest.raises(ValueError, match="is_seq_form='mean'"):
        LossConfig(is_seq_form="mean")
    with pytest.raises(ValueError, match="name='ppo'"):
        LossConfig(name="ppo")
    with pytest.raises(ValueError, match="eps=1.5"):
        LossConfig(eps=1.5)
    with pytest.raises(ValueError, match="r_max=0.0"):
        LossConfig(r_min=0.0, r_max=0.0)
