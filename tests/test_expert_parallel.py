"""Expert parallelism: the MoE under `shard_map` over the mesh's expert axis equals one device.

On 8 CPU devices, for the MAI latent MoE, a Qwen3-MoE-like, a DeepSeek-V3-like and a GPT-OSS-like
layer, the expert-parallel forward (outputs, chosen experts, load-balance statistics) and the
gradients of a scalar loss w.r.t. every parameter and the input equal the single-device result,
with padding tokens, skewed routing (routing replay) and batches that do not divide the mesh.
"""

import dataclasses
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hcjax.model.config import ModelConfig
from hcjax.model.moe import MoE
from hcjax.model.transformer import Transformer, param_shardings, shard_state
from hcjax.sharding import MeshConfig, make_mesh

SMALL = dict(
    d_model=32, num_experts=8, experts_per_token=2, moe_latent_dim=16, moe_d_ff=24,
    dtype="float32", moe_impl="ragged",
)
FAMILIES = {
    "mai": ModelConfig(**SMALL),
    "qwen3_moe": ModelConfig(**SMALL, moe_type="plain", router_renormalize=True),
    "deepseek_v3": ModelConfig(
        **SMALL, moe_type="plain", router_type="sigmoid", router_correction_bias=True,
        router_groups=2, router_topk_groups=1, routed_scaling=2.5, num_shared_experts=1,
    ),
    # Expert biases: b_out must be added once, not once per tensor shard.
    "gpt_oss": ModelConfig(
        **SMALL, moe_type="plain", router_bias=True, expert_bias=True,
        expert_activation="clamped_swiglu", router_renormalize=True,
    ),
}
MESHES = {
    "e8": MeshConfig(expert=8, fsdp=1),
    "e4f2": MeshConfig(expert=4, fsdp=2),
    "e2t2f2": MeshConfig(expert=2, tensor=2, fsdp=2),
}
COLLECTIVE = {"all_to_all": "all_to_all", "all_gather": "all_gather"}


def _perturbed_state(cfg, seed=0):
    """The layer's parameters with noise added, so zero-initialised biases are exercised too."""
    state = nnx.state(MoE(cfg, rngs=nnx.Rngs(seed)))
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    noisy = [p + 0.1 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)]
    return jax.tree.unflatten(tree, noisy)


def _inputs(b, t, d, seed=2):
    x = jax.random.normal(jax.random.key(seed), (b, t, d))
    valid = jnp.arange(t)[None, :] < jnp.array([t, t - 2, t, 1] * b)[:b, None]  # padding tokens
    return x, valid


def _moe_value_and_grad(cfg, state, x, valid, routing=None):
    graphdef = nnx.graphdef(MoE(cfg, rngs=nnx.Rngs(0)))

    def loss(state, x):
        y, chosen, (counts, probs, n) = nnx.merge(graphdef, state)(x, valid, routing)
        weights = jnp.arange(cfg.num_experts, dtype=jnp.float32)
        value = jnp.sum(jnp.sin(y) * valid[..., None]) + jnp.sum(probs * weights)
        return value, (y, chosen, counts, probs, n)

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)


def _close(got, want, err_msg="", tol=1e-5):
    """Equal to `tol` relative to the array's largest entry (fp32 sums in a different order)."""
    scale = max(1.0, float(np.max(np.abs(want))) if np.size(want) else 1.0)
    np.testing.assert_allclose(got, want, atol=tol * scale, rtol=tol, err_msg=err_msg)


def _assert_same(got, want, atol=1e-5, rtol=1e-5):
    (value, aux), grads = got
    (value_ref, aux_ref), grads_ref = want
    np.testing.assert_allclose(value, value_ref, rtol=rtol)
    y, chosen, counts, probs, n = aux
    y_ref, chosen_ref, counts_ref, probs_ref, n_ref = aux_ref
    np.testing.assert_allclose(y, y_ref, atol=atol, rtol=rtol)
    np.testing.assert_array_equal(chosen, chosen_ref)
    np.testing.assert_array_equal(counts, counts_ref)
    np.testing.assert_allclose(probs, probs_ref, atol=atol, rtol=rtol)
    assert float(n) == float(n_ref)
    flat, _ = jax.tree_util.tree_flatten_with_path(grads)
    flat_ref = jax.tree.leaves(grads_ref)
    assert len(flat) == len(flat_ref)
    for (path, g), g_ref in zip(flat, flat_ref):
        _close(g, g_ref, jax.tree_util.keystr(path))


# The single-device results by (config, b, t, routing): several meshes and modes compare with
# one reference, computed (traced and compiled) once.
_REFERENCES = {}


def _single_device(cfg, state, x, valid, routing):
    key = (cfg, x.shape, None if routing is None else (routing.shape, np.asarray(routing).tobytes()))
    if key not in _REFERENCES:
        _REFERENCES[key] = jax.device_get(
            jax.jit(lambda s, x: _moe_value_and_grad(cfg, s, x, valid, routing))(state, x))
    return _REFERENCES[key]


@pytest.fixture(scope="module", autouse=True)
def _release_references():
    yield
    _REFERENCES.clear()


def _check_layer(family, mesh_name, mode, *, b=4, t=8, routing=None):
    cfg = FAMILIES[family]
    ep_cfg = dataclasses.replace(cfg, expert_parallel=mode)
    state = _perturbed_state(cfg)
    x, valid = _inputs(b, t, cfg.d_model)
    want = _single_device(cfg, state, x, valid, routing)

    mesh = make_mesh(MESHES[mesh_name])
    sharded = shard_state(state, mesh)
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    spec = PartitionSpec(("data", "fsdp")) if b % batch_shards == 0 else PartitionSpec()
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    step = jax.jit(lambda s, x: _moe_value_and_grad(ep_cfg, s, x, valid, routing))
    with jax.set_mesh(mesh):
        lowered = step.lower(sharded, xs)  # lowered once: checked, then compiled and run
        got = lowered.compile()(sharded, xs)
    assert COLLECTIVE[mode] in lowered.as_text(), "the expert-parallel shard_map did not run"
    _assert_same(got, want)


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_all_to_all_layer_equals_single_device(family, mesh_name):
    _check_layer(family, mesh_name, "all_to_all")


@pytest.mark.parametrize(
    "family,mesh_name", [("mai", "e8"), ("deepseek_v3", "e4f2"), ("gpt_oss", "e2t2f2")]
)
def test_all_gather_layer_equals_single_device(family, mesh_name):
    _check_layer(family, mesh_name, "all_gather")


@pytest.mark.parametrize("mode", ["all_to_all", "all_gather"])
@pytest.mark.parametrize("mesh_name", ["e8", "e4f2"])
def test_skewed_routing_every_token_to_one_device(mode, mesh_name):
    # Experts 4 and 5: one device holds both on expert=4, two devices on expert=8; every other
    # device receives nothing. Dropless: nothing may be lost.
    routing = jnp.broadcast_to(jnp.array([5, 4], jnp.int32), (4, 8, 2))
    _check_layer("qwen3_moe", mesh_name, mode, routing=routing)
    one_expert = jnp.full((4, 8, 2), 3, jnp.int32)  # both choices on one expert
    _check_layer("deepseek_v3", mesh_name, mode, routing=one_expert)


@pytest.mark.parametrize("mode", ["all_to_all", "all_gather"])
def test_batch_not_dividing_the_mesh_is_padded(mode):
    # 3 x 1 tokens (a decode step) on 8 token shards, and 3 x 5 on 4.
    _check_layer("mai", "e8", mode, b=3, t=1)
    _check_layer("gpt_oss", "e2t2f2", mode, b=3, t=5)


@pytest.mark.parametrize("impl", ["blocked", "dense"])
def test_other_dispatch_impls_under_expert_parallelism(impl):
    family = f"deepseek_v3_{impl}"
    FAMILIES[family] = dataclasses.replace(FAMILIES["deepseek_v3"], moe_impl=impl)
    try:
        _check_layer(family, "e2t2f2", "all_to_all")
    finally:
        del FAMILIES[family]


def test_no_mesh_or_expert_axis_of_one_runs_the_global_dispatch():
    cfg = dataclasses.replace(FAMILIES["mai"], expert_parallel="all_to_all")
    state = _perturbed_state(cfg)
    x, valid = _inputs(4, 8, cfg.d_model)
    step = jax.jit(lambda s, x: _moe_value_and_grad(cfg, s, x, valid))
    assert "all_to_all" not in step.lower(state, x).as_text()  # no mesh
    mesh = make_mesh(MeshConfig(expert=1, fsdp=8))
    with jax.set_mesh(mesh):
        assert "all_to_all" not in step.lower(shard_state(state, mesh), x).as_text()


def test_config_rejects_unknown_mode_and_indivisible_experts():
    with pytest.raises(ValueError, match="expert_parallel"):
        ModelConfig(expert_parallel="ragged")
    cfg = dataclasses.replace(FAMILIES["mai"], num_experts=6, expert_parallel="all_to_all")
    x, valid = _inputs(4, 8, cfg.d_model)
    mesh = make_mesh(MeshConfig(expert=4, fsdp=2))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="num_experts=6"):
        _moe_value_and_grad(cfg, nnx.state(MoE(cfg, rngs=nnx.Rngs(0))), x, valid)


@pytest.mark.parametrize("family", ["deepseek_v3", "mai"])
def test_transformer_forward_backward_equals_single_device(family):
    cfg = dataclasses.replace(
        FAMILIES[family], vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        d_ff=48, window=8, max_seq_len=64,
    )
    ep_cfg = dataclasses.replace(cfg, expert_parallel="all_to_all")
    state = nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(3), (4, 8), 0, cfg.vocab_size)
    segments = jnp.where(jnp.arange(8)[None] < jnp.array([[8], [5], [8], [3]]), 1, 0)

    def value_and_grad(c, state, tokens):
        graphdef = nnx.graphdef(Transformer(c, rngs=nnx.Rngs(0)))

        def loss(state):
            out = nnx.merge(graphdef, state)(tokens, segment_ids=segments)
            logp = jax.nn.log_softmax(out.logits)[..., 0] * segments
            return jnp.sum(logp) / jnp.sum(segments) + out.load_balance_loss, out.routing

        return jax.value_and_grad(loss, has_aux=True)(state)

    (want, routing_ref), grads_ref = jax.jit(lambda s: value_and_grad(cfg, s, tokens))(state)
    mesh = make_mesh(MeshConfig(expert=2, tensor=2, fsdp=2))
    sharded = shard_state(state, mesh)
    with jax.set_mesh(mesh):
        lowered = jax.jit(lambda s, t: value_and_grad(ep_cfg, s, t)).lower(sharded, tokens)
        assert "all_to_all" in lowered.as_text()
        (got, routing), grads = lowered.compile()(sharded, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for r, r_ref in zip(routing, routing_ref):
        np.testing.assert_array_equal(r, r_ref)
    flat, _ = jax.tree_util.tree_flatten_with_path(grads)
    for (path, g), g_ref in zip(flat, jax.tree.leaves(grads_ref)):
        _close(g, g_ref, jax.tree_util.keystr(path))


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed: cannot compile for a TPU topology on this host",
)
@pytest.mark.parametrize("mode", ["all_to_all", "all_gather"])
def test_expert_parallel_compiles_for_a_tpu_topology(mode):
    from jax.experimental import topologies

    # Compiling only: other test processes may hold libtpu's one-process lock at the same time.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    topology = topologies.get_topology_desc("v5p:2x2x1", platform="tpu")
    devices = topology.devices
    mesh = make_mesh(MeshConfig(expert=len(devices), fsdp=1), devices=devices)
    cfg = dataclasses.replace(FAMILIES["deepseek_v3"], dtype="bfloat16", expert_parallel=mode)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: MoE(cfg, rngs=nnx.Rngs(0))))
    leaves, tree = jax.tree.flatten(abstract)
    shardings = jax.tree.leaves(param_shardings(abstract, mesh))
    abstract = jax.tree.unflatten(tree, [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(leaves, shardings)
    ])
    batch = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    x = jax.ShapeDtypeStruct((8, 16, cfg.d_model), jnp.float32, sharding=batch)

    def loss(state, x):
        y, _, _ = nnx.merge(graphdef, state)(x, jnp.ones(x.shape[:2], bool))
        return jnp.sum(y.astype(jnp.float32))

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(abstract, x).compile()
    text = compiled.as_text()
    assert ("ragged-all-to-all" if mode == "all_to_all" else "all-gather") in text


@pytest.mark.parametrize("family,mesh_name,b,t", [("mai", "e8", 4, 8), ("qwen3_moe", "e4f2", 3, 5)])
def test_chunked_all_to_all_equals_single_device(family, mesh_name, b, t):
    """expert_parallel_chunks = 3: each device exchanges its tokens in three rounds (padded to
    a multiple); values, routing, statistics and gradients are unchanged."""
    name = f"{family}_chunked"
    FAMILIES[name] = dataclasses.replace(FAMILIES[family], expert_parallel_chunks=3)
    try:
        _check_layer(name, mesh_name, "all_to_all", b=b, t=t)
    finally:
        del FAMILIES[name]
    with pytest.raises(ValueError, match="expert_parallel_chunks=0 must be a positive integer"):
        dataclasses.replace(FAMILIES[family], expert_parallel_chunks=0)
