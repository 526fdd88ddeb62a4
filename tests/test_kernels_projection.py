"""The projection (pallas_kernels/projection.py): the flat form's hand-written backward equals
automatic differentiation of the einsum, value and every gradient, on batched and flat inputs and
over two contracted axes; "auto" by platform; bad shapes named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _dispatch
from pallas_kernels.projection import project, project_reference


def value_and_grads(fn, *args):
    loss = lambda *a: jnp.sum(jnp.sin(fn(*a)))  # noqa: E731
    return jax.value_and_grad(loss, argnums=tuple(range(len(args))))(*args)


def assert_same_value_and_grads(fn, ref, *args):
    (value, grads), (value_ref, grads_ref) = value_and_grads(fn, *args), value_and_grads(ref, *args)
    np.testing.assert_allclose(value, value_ref, rtol=1e-5)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert g.shape == g_ref.shape
        np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5)


def test_flat_backward_matches_autodiff_of_the_einsums():
    keys = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(keys[0], (2, 5, 8))
    w_in = jax.random.normal(keys[1], (8, 3, 4))
    h = jax.random.normal(keys[2], (2, 5, 3, 4))
    w_out = jnp.transpose(w_in, (1, 2, 0))
    cases = [
        (lambda x, w: project(x, w, impl="flat"),
         lambda x, w: jnp.einsum("btd,dhk->bthk", x, w), (x, w_in)),
        (lambda h, w: project(h, w, 2, impl="flat"),
         lambda h, w: jnp.einsum("bthk,hkd->btd", h, w), (h, w_out)),
        (lambda x, w: project(x, w, impl="flat"), lambda x, w: x @ w, (x[0], w_in[:, 0])),
    ]
    for fn, ref, args in cases:
        assert_same_value_and_grads(fn, ref, *args)
    # The reference is the einsum too.
    assert_same_value_and_grads(lambda h, w: project_reference(h, w, 2),
                                lambda h, w: jnp.einsum("bthk,hkd->btd", h, w), h, w_out)


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_auto_is_the_flat_form_on_every_platform(monkeypatch, platform):
    monkeypatch.setattr(_dispatch, "backend", lambda: platform)
    assert _dispatch.choose("auto", "project", ("auto", "flat", "reference")) == "flat"
    x, w = jnp.ones((2, 3, 4)), jnp.ones((4, 5))
    assert "_project_flat_bwd" in str(jax.make_jaxpr(lambda x: project(x, w))(x))
    assert "custom_vjp" not in str(jax.make_jaxpr(lambda x: project(x, w, impl="reference"))(x))


def test_bad_shapes_and_impls_are_named():
    with pytest.raises(ValueError, match=r"x.shape=\(2, 3\) does not end with w's first 1 axes"):
        project(jnp.ones((2, 3)), jnp.ones((4, 5)))
    with pytest.raises(ValueError, match="n_in=3 is not in"):
        project(jnp.ones((2, 3)), jnp.ones((3, 5)), 3)
    with pytest.raises(ValueError, match="project: impl='fast' is not one of"):
        project(jnp.ones((2, 3)), jnp.ones((3, 5)), impl="fast")
