"""The tile forms of the expert MLP (pallas_kernels/expert_mlp_tiled.py): "tiled" (a loop over the
tiles that hold assignments, hand-written backward) and "blocked" (batched matmuls over every
tile) against the dense one-hot reference: outputs and the gradients of every input and weight,
with biases, GPT-OSS's clamped activation, skewed and empty experts, ids of experts held
elsewhere, several tile sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcjax.model.moe import clamped_swiglu_act, swiglu_act
from pallas_kernels.expert_mlp import expert_mlp_reference
from pallas_kernels.expert_mlp_tiled import (
    blocked_tile,
    default_tile,
    expert_mlp_blocked,
    expert_mlp_tiled,
)


def problem(n=37, k=3, e=6, r=8, f=12, biases=False, seed=7, skew=True):
    keys = jax.random.split(jax.random.key(seed), 8)
    w = {"gate": jax.random.normal(keys[0], (e, r, f)), "up": jax.random.normal(keys[1], (e, r, f)),
         "out": jax.random.normal(keys[2], (e, f, r)) * f**-0.5}
    if biases:
        w.update(b_gate=jax.random.normal(keys[3], (e, f)), b_up=jax.random.normal(keys[4], (e, f)),
                 b_out=jax.random.normal(keys[5], (e, r)))
    x = jax.random.normal(keys[6], (n, r))
    if skew:  # experts 1 and 4 get nothing, expert 0 every token
        expert_nk = jnp.stack([jnp.zeros(n, jnp.int32), 2 + jnp.arange(n) % 2, jnp.full(n, 5)], 1)
    else:
        expert_nk = jax.lax.top_k(jax.random.normal(keys[7], (n, e)), k)[1]
    gates = jax.nn.softmax(jax.random.normal(keys[7], (n, k)), -1)
    return x, w, expert_nk, gates


dense = expert_mlp_reference


_PLAIN, _CLAMPED = (False, swiglu_act), (True, clamped_swiglu_act(7.0, 1.702))


# Each tile with both routings, each routing with both activations.
@pytest.mark.parametrize("tile, biases, act, skew", [
    (None, *_PLAIN, True), (None, *_CLAMPED, False), (4, *_CLAMPED, True), (4, *_PLAIN, False),
    (16, *_PLAIN, True), (16, *_CLAMPED, False), (64, *_CLAMPED, True), (64, *_PLAIN, False)])
def test_tiled_equals_dense_values_and_grads(tile, biases, act, skew):
    x, w, expert_nk, gates = problem(biases=biases, skew=skew)
    probe = jax.random.normal(jax.random.key(1), (x.shape[0], w["out"].shape[-1]))

    def loss(fn):
        return lambda x, w, gates: jnp.sum(fn(x, w, expert_nk, gates, act) * probe)

    tiled = lambda x, w, ex, g, act: expert_mlp_tiled(x, w, ex, g, act, tile=tile)  # noqa: E731
    np.testing.assert_allclose(jax.jit(tiled, static_argnums=4)(x, w, expert_nk, gates, act),
                               dense(x, w, expert_nk, gates, act), rtol=1e-5, atol=1e-4)
    got = jax.jit(jax.grad(loss(tiled), (0, 1, 2)))(x, w, gates)
    want = jax.jit(jax.grad(loss(dense), (0, 1, 2)))(x, w, gates)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    if skew:  # an empty expert gets no gradient
        assert float(jnp.abs(got[1]["gate"][1]).max()) == 0.0


def problem_held_elsewhere():
    """Expert parallelism marks assignments of non-local experts with id == E and gate 0: a third
    of the second slots here. Returns the problem and the dense reference's output."""
    x, w, expert_nk, gates = problem(skew=False)
    e = w["gate"].shape[0]
    elsewhere = expert_nk.at[::3, 1].set(e)
    gates = gates.at[::3, 1].set(0.0)
    want = dense(x, w, jnp.where(elsewhere == e, 0, elsewhere), gates, swiglu_act)
    return x, w, elsewhere, gates, want


def test_ids_of_experts_held_elsewhere_count_nothing():
    x, w, elsewhere, gates, want = problem_held_elsewhere()
    np.testing.assert_allclose(expert_mlp_tiled(x, w, elsewhere, gates, swiglu_act), want,
                               rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(expert_mlp_blocked(x, w, elsewhere, gates, swiglu_act), want,
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tile, biases, act, skew", [
    (None, *_PLAIN, True), (None, *_CLAMPED, False), (4, *_CLAMPED, True), (16, *_PLAIN, False)])
def test_blocked_equals_dense_values_and_grads(tile, biases, act, skew):
    x, w, expert_nk, gates = problem(biases=biases, skew=skew)
    probe = jax.random.normal(jax.random.key(1), (x.shape[0], w["out"].shape[-1]))

    def loss(fn):
        return lambda x, w, gates: jnp.sum(fn(x, w, expert_nk, gates, act) * probe)

    blocked = lambda x, w, ex, g, act: expert_mlp_blocked(x, w, ex, g, act, tile=tile)  # noqa: E731
    np.testing.assert_allclose(jax.jit(blocked, static_argnums=4)(x, w, expert_nk, gates, act),
                               dense(x, w, expert_nk, gates, act), rtol=1e-5, atol=1e-4)
    got = jax.jit(jax.grad(loss(blocked), (0, 1, 2)))(x, w, gates)
    want = jax.jit(jax.grad(loss(dense), (0, 1, 2)))(x, w, gates)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    if skew:  # an empty expert gets no gradient
        assert float(jnp.abs(got[1]["gate"][1]).max()) == 0.0


def test_tile_rules():
    # tiled: a quarter of the mean rows per expert, a power of two in [16, 128].
    assert default_tile(2048 * 8, 64) == 64  # mean 256
    assert default_tile(2048 * 2, 64) == 16  # mean 64
    assert default_tile(2048 * 2, 8) == 128  # mean 512, capped
    # blocked: the mean rounded up to a power of two in [8, 128].
    assert blocked_tile(2048 * 2, 64) == 64
    assert blocked_tile(100, 64) == 8
    assert blocked_tile(2048 * 8, 8) == 128
