"""The capacity form of the expert MLP (pallas_kernels/expert_mlp_capacity.py: each expert's first
C rows as one batched matmul over experts, the rows past C in overflow tiles, hand-written
backward) against the dense one-hot reference: outputs and the gradients of every input, weight
and gate, with biases, GPT-OSS's clamped activation, skewed and empty experts, every row
overflowing, ids of experts held elsewhere; its index layout on its own; its capacity rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcjax.model.moe import clamped_swiglu_act, swiglu_act
from pallas_kernels.expert_mlp_capacity import (
    capacity_layout,
    default_capacity,
    expert_mlp_capacity,
)
from pallas_kernels.expert_mlp_tiled import expert_mlp_tiled
from tests.test_kernels_expert_mlp_tiled import dense, problem, problem_held_elsewhere


def _check_against_dense(x, w, expert_nk, gates, act, **kw):
    probe = jax.random.normal(jax.random.key(1), (x.shape[0], w["out"].shape[-1]))
    cap = lambda x, w, ex, g, act: expert_mlp_capacity(x, w, ex, g, act, **kw)  # noqa: E731
    np.testing.assert_allclose(jax.jit(cap, static_argnums=4)(x, w, expert_nk, gates, act),
                               dense(x, w, expert_nk, gates, act), rtol=1e-5, atol=1e-4)

    def loss(fn):
        return lambda x, w, gates: jnp.sum(fn(x, w, expert_nk, gates, act) * probe)

    got = jax.jit(jax.grad(loss(cap), (0, 1, 2)))(x, w, gates)
    want = jax.jit(jax.grad(loss(dense), (0, 1, 2)))(x, w, gates)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    return got


# capacity 4 with the skewed routing puts 33 of expert 0's 37 rows into overflow tiles; 100 holds
# every row in the batched part (no overflow tile runs); None is the default rule. Each
# capacity/tile runs with both routings, and each routing with both activations.
_PLAIN, _CLAMPED = (False, swiglu_act), (True, clamped_swiglu_act(7.0, 1.702))


@pytest.mark.parametrize("capacity, tile, biases, act, skew", [
    (None, 16, *_PLAIN, True), (None, 16, *_CLAMPED, False), (4, 4, *_CLAMPED, True),
    (4, 4, *_PLAIN, False), (4, 16, *_PLAIN, True), (12, 8, *_CLAMPED, True),
    (12, 8, *_PLAIN, False), (100, 16, *_CLAMPED, False), (100, 16, *_PLAIN, True)])
def test_capacity_equals_dense_values_and_grads(capacity, tile, biases, act, skew):
    x, w, expert_nk, gates = problem(biases=biases, skew=skew)
    got = _check_against_dense(x, w, expert_nk, gates, act, capacity=capacity, tile=tile)
    if skew:  # an empty expert gets no gradient
        assert float(jnp.abs(got[1]["gate"][1]).max()) == 0.0


def test_every_row_of_one_expert_overflowing():
    # k = 1, every token on expert 2: the overflow's static worst case (A - C rows, padded).
    x, w, _, _ = problem(n=50, k=1)
    expert_nk = jnp.full((50, 1), 2, jnp.int32)
    gates = jnp.linspace(0.1, 1.0, 50)[:, None]
    _check_against_dense(x, w, expert_nk, gates, swiglu_act, capacity=8, tile=4)


def test_layout_places_every_assignment_once():
    n, k, e, capacity, tile = 37, 3, 6, 4, 4
    _, _, expert_nk, _ = problem(n=n, k=k, e=e)
    expert_nk = expert_nk.at[::5, 1].set(e)  # held elsewhere: in no expert's rows
    slot_assign, slot_of, row_assign, tile_expert, used = capacity_layout(
        expert_nk, e, capacity, tile)
    a = n * k
    slot_assign, slot_of = np.asarray(slot_assign), np.asarray(slot_of)
    row_assign, tile_expert = np.asarray(row_assign), np.asarray(tile_expert)
    flat = np.asarray(expert_nk).reshape(-1)
    batched = slot_assign[slot_assign < a]
    overflow = row_assign[row_assign < a]
    placed = np.concatenate([batched, overflow])
    assert len(placed) == len(set(placed.tolist()))  # nothing twice
    assert sorted(placed.tolist()) == [i for i in range(a) if flat[i] < e]  # all local, once
    for ex in range(e):  # each expert's batch rows and overflow tiles hold only its assignments
        assert np.all(flat[slot_assign[ex][slot_assign[ex] < a]] == ex)
    for t in range(int(used)):
        rows = row_assign[t * tile:(t + 1) * tile]
        assert np.all(flat[rows[rows < a]] == tile_expert[t])
    assert np.all(row_assign[int(used) * tile:] == a)  # nothing past the used tiles
    # slot_of is the inverse of slot_assign for batched assignments, E·C for the others.
    for i in range(a):
        if i in set(batched.tolist()):
            assert slot_assign.reshape(-1)[slot_of[i]] == i
        else:
            assert slot_of[i] == e * capacity
    # Stable: each expert's rows are its assignments in order, batch first, then overflow.
    for ex in range(e):
        mine = [i for i in range(a) if flat[i] == ex]
        got = [int(i) for i in slot_assign[ex] if i < a]
        got += [int(r) for t in range(int(used)) if tile_expert[t] == ex
                for r in row_assign[t * tile:(t + 1) * tile] if r < a]
        assert got == mine


def test_ids_of_experts_held_elsewhere_count_nothing():
    x, w, elsewhere, gates, want = problem_held_elsewhere()
    for capacity in (None, 3):
        np.testing.assert_allclose(
            expert_mlp_capacity(x, w, elsewhere, gates, swiglu_act, capacity=capacity), want,
            rtol=1e-5, atol=1e-4)
    # Their gates get no gradient: no expert here computed anything for them.
    d_gates = jax.grad(lambda g: jnp.sum(expert_mlp_capacity(x, w, elsewhere, g, swiglu_act)))(
        gates)
    assert float(jnp.abs(d_gates[::3, 1]).max()) == 0.0
    assert float(jnp.abs(d_gates[1::3, 1]).min()) > 0.0


def test_bf16_matches_the_tiled_form():
    x, w, expert_nk, gates = problem(skew=False)
    x = x.astype(jnp.bfloat16)
    w = {name: v.astype(jnp.bfloat16) for name, v in w.items()}

    def grads(fn):
        return jax.grad(lambda x, w, g: jnp.sum(fn(x, w, expert_nk, g, swiglu_act)
                                                .astype(jnp.float32)), (0, 1, 2))(x, w, gates)

    got, want = grads(expert_mlp_capacity), grads(expert_mlp_tiled)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=0.05, atol=0.05)


def test_default_capacity_is_the_mean_plus_its_square_root_in_eights():
    assert default_capacity(2048 * 8, 64) == 272  # 256 + 16
    assert default_capacity(2048 * 2, 8) == 536  # 512 + 22.6 -> 534.6 -> 536
    assert default_capacity(2048 * 8, 8) == 2096  # 2048 + 45.3
    assert default_capacity(3, 8) == 8  # never below 8 rows
