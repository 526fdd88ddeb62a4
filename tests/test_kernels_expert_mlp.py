"""The routed experts' MLP dispatcher (pallas_kernels/expert_mlp.py): every form it runs (the
grouped matmul on `lax.ragged_dot` and on the Pallas gmm in interpret mode, blocked, tiled,
capacity) equals the dense one-hot reference, values and the gradients of input, weights and
gates, with skewed routing and empty experts; what "auto" picks on each platform and under a
mesh; bad inputs named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcjax.model.moe import clamped_swiglu_act, swiglu_act
from hcjax.sharding import MeshConfig, make_mesh
from pallas_kernels import _dispatch
from pallas_kernels.expert_mlp import (
    expert_mlp,
    expert_mlp_impl,
    expert_mlp_reference,
    gather_rows,
    inverse_permutation,
)
from tests.test_kernels_expert_mlp_tiled import problem


@pytest.mark.parametrize("impl", ["ragged", "pallas", "blocked", "tiled", "capacity"])
@pytest.mark.parametrize("biases, act", [(False, swiglu_act),
                                         (True, clamped_swiglu_act(7.0, 1.702))])
def test_every_impl_equals_the_reference_values_and_grads(impl, biases, act):
    # Experts 1 and 4 get nothing, expert 0 every token.
    x, w, expert_nk, gates = problem(biases=biases, skew=True)
    probe = jax.random.normal(jax.random.key(1), (x.shape[0], w["out"].shape[-1]))

    def loss(fn):
        return lambda x, w, gates: jnp.sum(fn(x, w, expert_nk, gates, act) * probe)

    def form(x, w, ex, g, act):
        return expert_mlp(x, w, ex, g, act, impl=impl)

    np.testing.assert_allclose(jax.jit(form, static_argnums=4)(x, w, expert_nk, gates, act),
                               expert_mlp_reference(x, w, expert_nk, gates, act),
                               rtol=1e-5, atol=1e-4)
    got = jax.jit(jax.grad(loss(form), (0, 1, 2)))(x, w, gates)
    want = jax.jit(jax.grad(loss(expert_mlp_reference), (0, 1, 2)))(x, w, gates)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert float(jnp.abs(got[1]["gate"][1]).max()) == 0.0  # an empty expert gets no gradient
    assert float(jnp.abs(got[1]["gate"][0]).max()) > 0.0


@pytest.mark.parametrize("platform, auto", [("cpu", "capacity"), ("gpu", "pallas"),
                                            ("tpu", "pallas")])
def test_auto_by_platform(monkeypatch, platform, auto):
    monkeypatch.setattr(_dispatch, "backend", lambda: platform)
    assert expert_mlp_impl("auto") == auto
    for impl in ("dense", "ragged", "blocked", "tiled", "capacity", "pallas"):
        assert expert_mlp_impl(impl) == impl


def test_auto_is_capacity_on_one_device_and_blocked_under_a_mesh():
    assert expert_mlp_impl("auto") == "capacity"
    mesh = make_mesh(MeshConfig(fsdp=2, num_devices=2))
    with jax.set_mesh(mesh):
        assert expert_mlp_impl("auto") == "blocked"  # XLA partitions it
        assert expert_mlp_impl("capacity") == "capacity"  # a named form stays


def test_bad_inputs_are_named():
    x, w, expert_nk, gates = problem(skew=False)
    with pytest.raises(ValueError, match="impl='megablox' is not one of"):
        expert_mlp(x, w, expert_nk, gates, swiglu_act, impl="megablox")
    with pytest.raises(ValueError, match=r"gates.shape=\(37, 2\) differs"):
        expert_mlp(x, w, expert_nk, gates[:, :2], swiglu_act)
    with pytest.raises(ValueError, match="expert weights have no 'out'"):
        expert_mlp(x, {"gate": w["gate"], "up": w["up"]}, expert_nk, gates, swiglu_act)
    with pytest.raises(ValueError, match=r"not \[E, r=5, f\]"):
        expert_mlp(x[:, :5], w, expert_nk, gates, swiglu_act)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("k", [1, 3])
def test_gather_rows_is_indexing_values_and_gradient(dtype, k):
    """gather_rows(x, order, inverse, k) == x[order // k], values and gradient (the scatter-add
    of plain indexing)."""
    rng = np.random.default_rng(0)
    n, r = 5, 6
    x = jnp.asarray(rng.normal(size=(n, r)), dtype)
    order = jnp.asarray(rng.permutation(n * k), jnp.int32)
    inverse = inverse_permutation(order)
    np.testing.assert_array_equal(np.asarray(order)[np.asarray(inverse)], np.arange(n * k))
    np.testing.assert_array_equal(gather_rows(x, order, inverse, k), x[order // k])
    ct = jnp.asarray(rng.normal(size=(n * k, r)), dtype)
    got = jax.vjp(lambda a: gather_rows(a, order, inverse, k), x)[1](ct)[0]
    want = jax.vjp(lambda a: a[order // k], x)[1](ct)[0]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6)
