"""The dense SwiGLU MLP (pallas_kernels/swiglu.py): the flat form's hand-written backward equals
automatic differentiation of the three matmuls, value and every gradient, on batched and flat
tokens; the caller's hidden constraint is applied in the forward and to the hidden's gradient;
"auto" by platform; bad shapes named."""

import jax
import pytest

from pallas_kernels import _dispatch
from pallas_kernels.swiglu import swiglu, swiglu_reference
from tests.test_kernels_projection import assert_same_value_and_grads


def weights(d=8, f=12, seed=3):
    keys = jax.random.split(jax.random.key(seed), 4)
    wg, wu = (jax.random.normal(k, (d, f)) * 0.3 for k in keys[1:3])
    wd = jax.random.normal(keys[3], (f, d)) * 0.3
    return jax.random.normal(keys[0], (2, 5, d)), wg, wu, wd


def test_flat_backward_matches_autodiff_of_the_matmuls():
    x, wg, wu, wd = weights()

    def by_hand(x, wg, wu, wd):
        return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd

    for xs in (x, x[0]):
        assert_same_value_and_grads(lambda *a: swiglu(*a, impl="flat"), by_hand, xs, wg, wu, wd)
        assert_same_value_and_grads(swiglu_reference, by_hand, xs, wg, wu, wd)


@pytest.mark.parametrize("impl", ["flat", "reference"])
def test_the_hidden_constraint_is_applied(impl):
    x, wg, wu, wd = weights()
    seen = []

    def constrain(h):  # a sharding constraint is the identity in value
        seen.append(h.shape)
        return h

    def by_hand(x, wg, wu, wd):
        return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd

    assert_same_value_and_grads(
        lambda *a: swiglu(*a, constrain_hidden=constrain, impl=impl), by_hand, x, wg, wu, wd)
    assert (2, 5, 12) in seen  # the forward's hidden
    if impl == "flat":
        assert (10, 12) in seen  # the hidden's gradient, tokens flattened


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_auto_is_the_flat_form_on_every_platform(monkeypatch, platform):
    monkeypatch.setattr(_dispatch, "backend", lambda: platform)
    x, wg, wu, wd = weights()
    assert "_swiglu_flat_bwd" in str(jax.make_jaxpr(lambda x: swiglu(x, wg, wu, wd))(x))


def test_bad_shapes_are_named():
    x, wg, wu, wd = weights()
    with pytest.raises(ValueError, match=r"w_gate.shape=\(8, 12\) and w_up.shape=\(8, 11\)"):
        swiglu(x, wg, wu[:, :11], wd)
    with pytest.raises(ValueError, match=r"w_down.shape=\(12, 7\) is not \[f=12, d=8\]"):
        swiglu(x, wg, wu, wd[:, :7])
