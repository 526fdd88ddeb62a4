"""The model at scale: layers under a scan over the layer-pattern period, rematerialisation
policies, and logical sharding constraints on activations. Scanned and unrolled models with the
same (converted) weights agree on logits, routing, load balance, gradients and cached decoding, for
the MAI pattern and DeepSeek-like and GPT-OSS-like families."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hcjax import sharding as shd
from hcjax.model import ModelConfig, Transformer, create_sharded, init_cache
from hcjax.model.summary import summarize
from hcjax.model.transformer import (
    abstract_model,
    shard_state,
    stack_cache,
    stack_layers,
    unstack_cache,
    unstack_layers,
)

SMALL = dict(
    vocab_size=64, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, window=5, d_ff=48,
    num_experts=4, experts_per_token=2, moe_latent_dim=16, moe_d_ff=24, dtype="float32",
    max_seq_len=64,
)
# MAI's default pattern: 5 local : 1 global attention, MoE / dense alternating (period 6).
MAI = ModelConfig(num_layers=12, **SMALL)
# DeepSeek-like: one leading dense layer, then MLA + sigmoid-routed plain MoE with a shared expert.
DEEPSEEK = ModelConfig(
    **{**SMALL, "num_kv_heads": 4}, num_layers=3, attention_type="mla", first_dense_layers=1,
    attention_pattern=("global",), ffn_pattern=("moe",), rope_global=True,
    attention_output_norm=False, tie_embeddings=False, scale_logits=False, q_lora_rank=12,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, moe_type="plain",
    router_type="sigmoid", router_correction_bias=True, num_shared_experts=1, routed_scaling=2.5,
)
# GPT-OSS-like: local/global alternating with sinks and biases, plain MoE on every layer.
GPT_OSS = ModelConfig(
    **SMALL, num_layers=4, attention_pattern=("local", "global"), ffn_pattern=("moe",),
    attention_sinks=True, attention_bias=True, rope_global=True, attention_output_norm=False,
    tie_embeddings=False, scale_logits=False, moe_type="plain", router_bias=True,
    expert_bias=True, expert_activation="clamped_swiglu",
)
FAMILIES = {"mai": MAI, "deepseek": DEEPSEEK, "gpt_oss": GPT_OSS}


def scanned(cfg, **kw):
    return dataclasses.replace(cfg, scan_layers=True, **kw)


@functools.cache
def unrolled_state(cfg: ModelConfig):
    """An unrolled model's state with every parameter perturbed (zero-initialised gains, biases
    and sinks become non-zero), so every branch matters in the comparisons."""
    state = nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)))
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    noisy = [x + 0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, noisy)


def state_of(cfg: ModelConfig):
    """The perturbed weights of `unrolled_state` in the layout of `cfg` (scanned or not)."""
    base = dataclasses.replace(cfg, scan_layers=False, remat_policy="none")
    state = unrolled_state(base)
    return stack_layers(state, cfg) if cfg.scan_layers else state


def model_of(cfg: ModelConfig):
    return nnx.merge(abstract_model(cfg)[0], state_of(cfg))


@functools.cache
def jitted(cfg: ModelConfig):
    """(forward, value-and-grad) of the model of `cfg` as functions of its state, compiled once
    per config and shared by the tests."""
    graphdef = abstract_model(cfg)[0]

    def forward(state, x, kw):
        return nnx.merge(graphdef, state)(x, **kw)

    def loss(state, x, kw):
        out = forward(state, x, kw)
        return jnp.mean(jax.nn.log_softmax(out.logits)[..., 0]) + 0.1 * out.load_balance_loss, out

    return jax.jit(forward), jax.jit(jax.value_and_grad(loss, has_aux=True))


def tokens(b, t, seed=0):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, SMALL["vocab_size"])


def assert_trees_close(a, b, **tol):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


def grads_unrolled(cfg, grads):
    return unstack_layers(grads, cfg) if cfg.scan_layers else grads


# Layouts ---------------------------------------------------------------------------------------


def test_scanned_init_is_the_stacked_unrolled_init_and_conversions_round_trip():
    cfg = dataclasses.replace(DEEPSEEK, num_layers=5)  # 1 unrolled + 4 periods of 1
    scfg = scanned(cfg)
    u = nnx.state(Transformer(cfg, rngs=nnx.Rngs(3)))
    s = nnx.state(Transformer(scfg, rngs=nnx.Rngs(3)))
    assert list(s["blocks"].keys()) == [0] and list(s["scan_blocks"].keys()) == [0]
    wq = s["scan_blocks"][0]["attn"]["wq_a"]
    assert wq.shape == (4, 32, 12)
    assert wq.get_metadata()["logical_axes"] == ("layers", "embed", "q_lora")
    assert_trees_close(stack_layers(u, scfg), s, rtol=0, atol=0)
    assert_trees_close(unstack_layers(s, scfg), u, rtol=0, atol=0)
    # Abstract states convert too (for checkpoint and Hugging Face layouts).
    abstract = stack_layers(abstract_model(cfg)[1], scfg)
    assert jax.tree.map(lambda v: v.shape, abstract) == jax.tree.map(lambda v: v.shape, s)
    # Parameter counts do not depend on the layout.
    for big in (MAI, DEEPSEEK, GPT_OSS):
        assert summarize(scanned(big)) == summarize(big)


def test_mai_scan_groups_layers_by_position_in_the_period():
    scfg = scanned(MAI)  # period 6: positions 0-4 local, 5 global; even positions MoE
    assert scfg.layer_period == 6
    s = abstract_model(scfg)[1]
    assert "blocks" not in s and sorted(s["scan_blocks"].keys()) == list(range(6))
    assert s["scan_blocks"][0]["ffn"]["w_gate"].shape == (2, 4, 16, 24)  # [n, E, latent, f]
    assert s["scan_blocks"][1]["ffn"]["w_gate"].shape == (2, 32, 48)  # dense: [n, d, d_ff]
    cache = init_cache(scfg, batch_size=2, max_len=9)
    assert len(cache) == 6
    assert cache[0]["k"].shape == (2, 2, 5, 2, 8) and cache[5]["k"].shape == (2, 2, 9, 2, 8)
    flat = init_cache(MAI, batch_size=2, max_len=9)
    assert_trees_close(stack_cache(flat, scfg), cache, rtol=0, atol=0)
    assert_trees_close(unstack_cache(cache, scfg), flat, rtol=0, atol=0)


def test_layers_after_the_last_whole_period_run_unrolled():
    cfg = dataclasses.replace(MAI, num_layers=9)  # one period of 6, then 3 tail layers
    scfg = scanned(cfg)
    u = nnx.state(Transformer(cfg, rngs=nnx.Rngs(5)))
    s = nnx.state(Transformer(scfg, rngs=nnx.Rngs(5)))
    assert sorted(s["tail_blocks"].keys()) == [0, 1, 2]
    assert s["scan_blocks"][0]["ffn"]["w_gate"].shape[0] == 1
    assert_trees_close(stack_layers(u, scfg), s, rtol=0, atol=0)
    assert_trees_close(unstack_layers(s, scfg), u, rtol=0, atol=0)
    cache = init_cache(scfg, batch_size=2, max_len=9)
    assert len(cache) == 6 + 3 and cache[6]["k"].shape == (2, 5, 2, 8)  # tail layer 6: local
    flat = init_cache(cfg, batch_size=2, max_len=9)
    assert_trees_close(stack_cache(flat, scfg), cache, rtol=0, atol=0)
    assert_trees_close(unstack_cache(cache, scfg), flat, rtol=0, atol=0)
    (la, a), ga = jitted(cfg)[1](state_of(cfg), X, PACKED)
    (lb, b), gb = jitted(scfg)[1](state_of(scfg), X, PACKED)
    np.testing.assert_allclose(a.logits, b.logits, rtol=1e-5, atol=1e-5)
    assert len(b.routing) == cfg.num_moe_layers == 5
    for ra, rb in zip(a.routing, b.routing):
        np.testing.assert_array_equal(ra, rb)
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    assert_trees_close(ga, unstack_layers(gb, scfg), rtol=1e-4, atol=1e-5)


# Scanned == unrolled ---------------------------------------------------------------------------

# Two packed documents and padding in row 0, a plain row 1.
X = tokens(2, 12, seed=2)
PACKED = dict(
    positions=jnp.array([list(range(5)) * 2 + [0, 0], list(range(12))]),
    segment_ids=jnp.array([[1] * 5 + [2] * 5 + [0] * 2, [1] * 12]),
)


@pytest.mark.parametrize(
    "family", ["mai", pytest.param("deepseek", marks=pytest.mark.slow),
               pytest.param("gpt_oss", marks=pytest.mark.slow)],
)
def test_scanned_forward_and_gradients_equal_unrolled(family):
    cfg = FAMILIES[family]
    scfg = scanned(cfg)
    (la, a), ga = jitted(cfg)[1](state_of(cfg), X, PACKED)
    (lb, b), gb = jitted(scfg)[1](state_of(scfg), X, PACKED)
    np.testing.assert_allclose(a.logits, b.logits, rtol=1e-5, atol=1e-5)
    assert len(b.routing) == cfg.num_moe_layers
    for ra, rb in zip(a.routing, b.routing):
        np.testing.assert_array_equal(ra, rb)
    assert_trees_close(a.moe_stats, b.moe_stats, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a.load_balance_loss, b.load_balance_loss, rtol=1e-5)
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    assert_trees_close(ga, unstack_layers(gb, scfg), rtol=1e-4, atol=1e-5)
    # Routing replay reaches each layer in order: replaying the recorded routing (layer order)
    # reproduces the outputs; a shuffled layer order would change which experts run.
    replayed = jitted(scfg)[0](state_of(scfg), X, dict(PACKED, routing=a.routing))
    np.testing.assert_allclose(replayed.logits, a.logits, rtol=1e-5, atol=1e-5)
    for ra, rb in zip(a.routing, replayed.routing):
        np.testing.assert_array_equal(ra, rb)


@pytest.mark.slow
def test_dropout_keys_follow_layers_in_scanned_mode():
    cfg = dataclasses.replace(GPT_OSS, dropout_rate=0.3)
    x, kw = tokens(2, 6), dict(dropout_rng=jax.random.key(4))
    a = jitted(cfg)[0](state_of(cfg), x, kw).logits
    b = jitted(scanned(cfg))[0](state_of(scanned(cfg)), x, kw).logits
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert not np.allclose(a, jitted(cfg)[0](state_of(cfg), x, {}).logits)


@pytest.mark.parametrize(
    "policy,scan",
    [("full", True), pytest.param("full", False, marks=pytest.mark.slow),
     pytest.param("dots", True, marks=pytest.mark.slow),
     pytest.param("minimal", True, marks=pytest.mark.slow)],
)
def test_remat_policies_give_the_same_gradients(policy, scan):
    cfg = dataclasses.replace(MAI, scan_layers=scan, remat_policy=policy)
    graphdef, state = abstract_model(cfg)[0], state_of(cfg)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda s: nnx.merge(graphdef, s)(X).logits.sum()))(state))
    assert "remat" in jaxpr or "checkpoint" in jaxpr
    (loss, _), grads = jitted(cfg)[1](state, X, PACKED)
    (ref_loss, _), ref = jitted(MAI)[1](state_of(MAI), X, PACKED)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_trees_close(grads_unrolled(cfg, grads), ref, rtol=1e-4, atol=1e-6)


def greedy_decode(cfg, prompt, steps):
    """Prefill a batch of prompts into a fresh cache, then `steps` greedy tokens one at a time."""
    forward, state = jitted(cfg)[0], state_of(cfg)
    b, p = prompt.shape
    out = forward(state, prompt, dict(cache=init_cache(cfg, batch_size=b, max_len=p + steps)))
    logits = [out.logits[:, -1]]
    for i in range(steps):
        nxt = jnp.argmax(logits[-1], axis=-1)[:, None]
        out = forward(state, nxt, dict(positions=jnp.full((b, 1), p + i), cache=out.cache))
        logits.append(out.logits[:, -1])
    return jnp.stack(logits, 1), out.cache


@pytest.mark.parametrize("family", ["deepseek", "mai_tail",
                                    pytest.param("mai", marks=pytest.mark.slow)])
def test_cached_greedy_decoding_is_the_same_scanned(family):
    # mai_tail: one scanned period of 6 and two unrolled tail layers (their cache entries last).
    cfg = dataclasses.replace(MAI, num_layers=8) if family == "mai_tail" else FAMILIES[family]
    prompt = tokens(2, 4, seed=7)
    steps = 6  # past the window of 5: the local layers' ring buffers wrap
    la, cache_a = greedy_decode(cfg, prompt, steps)
    lb, cache_b = greedy_decode(scanned(cfg), prompt, steps)
    np.testing.assert_array_equal(jnp.argmax(la, -1), jnp.argmax(lb, -1))
    np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-5)
    assert_trees_close(unstack_cache(cache_b, scanned(cfg)), cache_a, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_rollout_engine_serves_the_scanned_model(sort_only_sampler):
    """The engine finds the batch axis of the stacked cache ([n, B, S, ...]) by itself (its
    sampler's sort-only setting: bit-identical, compiles faster)."""
    from hcjax.rollout import Engine, GenerateRequest, RolloutServer

    cfg = FAMILIES["mai"]
    results = []
    for c in (cfg, scanned(cfg)):
        engine = Engine(model_of(c), max_concurrent_decodes=2, max_prefill_length=8,
                        max_target_length=24)
        with RolloutServer(engine).start() as srv:
            handles = [srv.submit(GenerateRequest(prompt=p, max_tokens=8, temperature=0.0))
                       for p in ([1, 5, 9, 3, 7, 2, 11], [3, 1, 4])]
            results.append([h.result(timeout=300)[0] for h in handles])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_array_equal(a.routing, b.routing)


# Sharding constraints on a mesh ------------------------------------------------------------------


def test_constrain_is_a_no_op_without_a_mesh_and_skips_indivisible_axes():
    axes = ("activation_batch", "activation_length", "activation_embed")
    jaxpr = str(jax.make_jaxpr(lambda v: shd.constrain(v, axes))(jnp.ones((3, 4, 6))))
    assert "sharding_constraint" not in jaxpr
    mesh = shd.make_mesh(shd.MeshConfig(data=1, fsdp=2, tensor=2, expert=2))
    with jax.set_mesh(mesh):
        y = jax.jit(lambda v: shd.constrain(v, axes))(jnp.ones((4, 4, 6)))
        want = NamedSharding(mesh, PartitionSpec(("fsdp", "expert"), None, "tensor"))
        assert y.sharding.is_equivalent_to(want, 3)
        # Batch 6 takes fsdp (2) but not fsdp·expert (4); embed 5 is not split over tensor.
        y = jax.jit(lambda v: shd.constrain(v, axes))(jnp.ones((6, 4, 5)))
        assert y.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec("fsdp")), 3)


@pytest.mark.parametrize("family", ["mai", pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_jitted_on_a_mesh_with_constraints_equals_no_mesh(family):
    scfg = scanned(FAMILIES[family], remat_policy="minimal")
    graphdef, state = abstract_model(scfg)[0], state_of(scfg)
    mesh = shd.make_mesh(shd.MeshConfig(data=1, fsdp=2, tensor=2, expert=2))
    sharded = shard_state(state, mesh)
    wq = sharded["scan_blocks"][0]["attn"]["wq"]
    # layers replicated, the width over fsdp x expert
    assert wq.sharding.spec == PartitionSpec(None, ("fsdp", "expert"), "tensor", None)
    x = tokens(4, 8, seed=3)

    def step(s, x):
        out = nnx.merge(graphdef, s)(x)
        return out.logits, out.routing

    lowered = jax.jit(step).lower(state, x)
    assert "sharding_constraint" not in lowered.as_text()  # no mesh in context: no constraint
    ref_logits, ref_routing = lowered.compile()(state, x)
    xs = jax.device_put(x, NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None)))
    with jax.set_mesh(mesh):
        lowered = jax.jit(step).lower(sharded, xs)
        assert lowered.as_text().count("sharding_constraint") >= 10
        logits, routing = lowered.compile()(sharded, xs)
    # Batch over the data-parallel axes, vocab over tensor, as the constraint on the logits says.
    want = NamedSharding(mesh, PartitionSpec(("fsdp", "expert"), None, "tensor"))
    assert logits.sharding.is_equivalent_to(want, 3)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(routing, ref_routing):
        np.testing.assert_array_equal(a, b)


def test_create_sharded_scanned_model():
    scfg = scanned(GPT_OSS)
    mesh = shd.make_mesh(shd.MeshConfig(data=1, fsdp=2, tensor=2, expert=2))
    model = create_sharded(scfg, mesh, seed=0)
    w_gate = model.scan_blocks[0].ffn.w_gate[...]
    assert w_gate.shape == (2, 4, 32, 24)
    assert w_gate.sharding.spec == PartitionSpec(None, "expert", "fsdp", "tensor")
    eager = nnx.state(Transformer(GPT_OSS, rngs=nnx.Rngs(0)))
    assert_trees_close(unstack_layers(nnx.state(model), scfg), eager, rtol=1e-6, atol=1e-7)


# Errors ------------------------------------------------------------------------------------------


def test_bad_scan_and_remat_configs_are_clear():
    with pytest.raises(ValueError, match=r"num_layers=5 cannot be scanned.*no whole period.*6 layers"):
        dataclasses.replace(MAI, num_layers=5, scan_layers=True)
    with pytest.raises(ValueError, match=r"num_layers=1 cannot be scanned.*first_dense_layers=1"):
        dataclasses.replace(DEEPSEEK, num_layers=1, scan_layers=True)
    dataclasses.replace(MAI, num_layers=8)  # unrolled: any number of layers
    dataclasses.replace(MAI, num_layers=8, scan_layers=True)  # one period and two tail layers
    with pytest.raises(ValueError, match="remat_policy='everything' must be one of"):
        dataclasses.replace(MAI, remat_policy="everything")
    with pytest.raises(ValueError, match="cache has 4 entries, the model expects 2"):
        model_of(scanned(GPT_OSS))(tokens(1, 2), cache=init_cache(GPT_OSS, 1, 4))


@pytest.mark.parametrize("family", ["mai", "deepseek"])
def test_pallas_kernels_run_on_local_shards_under_a_mesh(family):
    """With a mesh in context the Pallas kernels (interpret mode on CPU) run under shard_map on
    each device's batch and heads, and give what they give without a mesh (MLA too: its flash
    attention with 12-wide q/k, 8-wide values and its own scale)."""
    base = dataclasses.replace(MAI, num_layers=6) if family == "mai" else DEEPSEEK
    cfg = dataclasses.replace(base, attention_impl="pallas", moe_impl="pallas")
    graphdef, state = abstract_model(cfg)[0], state_of(cfg)
    mesh = shd.make_mesh(shd.MeshConfig(data=1, fsdp=2, tensor=2, expert=2))
    x = tokens(4, 8, seed=5)

    def step(s, x):
        return nnx.merge(graphdef, s)(x).logits

    ref = jax.jit(step)(state, x)
    with jax.set_mesh(mesh):
        lowered = jax.jit(step).lower(shard_state(state, mesh), x)
        assert "shard_map" in str(lowered.as_text()) or "sdy.manual_computation" in lowered.as_text()
        logits = lowered.compile()(shard_state(state, mesh), x)
    np.testing.assert_allclose(logits, ref, rtol=1e-5, atol=1e-5)
