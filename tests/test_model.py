"""The MoE transformer against its contracts: causality, windows, GQA, NoPE, dropless MoE, replay,
global load balance, cached decode, packing, sharding, and clear config errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hcjax.model import (
    ModelConfig,
    Transformer,
    add_weight_noise,
    create_sharded,
    init_cache,
    load_balance_loss_from_stats,
)
from hcjax.sharding import MeshConfig, make_mesh
from pallas_kernels.self_attention import gqa_attention

BASE = ModelConfig(
    vocab_size=64,
    d_model=32,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    attention_pattern=("local", "global"),
    window=5,
    ffn_pattern=("moe", "dense"),
    d_ff=48,
    num_experts=4,
    experts_per_token=2,
    moe_latent_dim=16,
    moe_d_ff=24,
    dtype="float32",
    max_seq_len=64,
)


def make_model(cfg=BASE, seed=0):
    """A model whose zero-initialised attention-output gains are set to 1, so attention matters."""
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    for block in model.blocks:
        block.attn_out_norm.scale[...] = jnp.ones_like(block.attn_out_norm.scale[...])
    return model


@nnx.jit
def fwd(model, x, **kwargs):
    return model(x, **kwargs)


def tokens(b, t, seed=0, vocab=BASE.vocab_size):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab)


def test_output_record_shapes_and_dtypes():
    model = make_model()
    out = fwd(model, tokens(2, 11))
    assert out.logits.shape == (2, 11, BASE.vocab_size) and out.logits.dtype == jnp.float32
    assert len(out.routing) == BASE.num_moe_layers == 2
    for r in out.routing:
        assert r.shape == (2, 11, BASE.experts_per_token) and r.dtype == jnp.int32
        assert int(r.min()) >= 0 and int(r.max()) < BASE.num_experts
    assert out.load_balance_loss.shape == ()
    assert out.cache is None


def test_attention_output_starts_at_zero():
    model = Transformer(BASE, rngs=nnx.Rngs(0))
    for block in model.blocks:
        assert float(jnp.abs(block.attn_out_norm.scale[...]).max()) == 0.0


def test_weight_noise_moves_every_float_leaf_and_makes_attention_matter():
    state = {"w": jnp.zeros((64, 64)), "ids": jnp.arange(5, dtype=jnp.int32)}
    noisy = add_weight_noise(state, seed=3, scale=0.5)
    np.testing.assert_array_equal(noisy["ids"], state["ids"])  # integer leaves unchanged
    assert abs(float(jnp.std(noisy["w"])) - 0.5) < 0.05  # N(0, 0.5^2) over 4096 draws
    np.testing.assert_array_equal(add_weight_noise(state, 3, 0.5)["w"], noisy["w"])  # per seed
    assert not np.array_equal(add_weight_noise(state, 4, 0.5)["w"], noisy["w"])
    with pytest.raises(ValueError, match="scale=-1"):
        add_weight_noise(state, 0, -1.0)
    # The reason it exists: at init the attention gains are 0, with noise they are not.
    graphdef, init = nnx.split(Transformer(BASE, rngs=nnx.Rngs(0)))
    model = nnx.merge(graphdef, add_weight_noise(init, 1))
    assert all(float(jnp.abs(b.attn_out_norm.scale[...]).max()) > 0 for b in model.blocks)


def test_no_biases_and_tied_embeddings():
    model = make_model()
    names = [
        "/".join(str(k) for k in path)
        for path, _ in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
    ]
    assert not any("bias" in n for n in names)
    assert sum("embed" in n for n in names) == 1  # one matrix for input and output


def test_causality():
    model = make_model()
    x = tokens(2, 12)
    y = x.at[:, 7].set((x[:, 7] + 1) % BASE.vocab_size)
    a, b = fwd(model, x).logits, fwd(model, y).logits
    np.testing.assert_array_equal(np.asarray(a[:, :7]), np.asarray(b[:, :7]))
    assert not np.allclose(a[:, 7], b[:, 7])


def test_sliding_window_limits_receptive_field():
    layers, window = 2, 4
    cfg = dataclasses.replace(BASE, num_layers=layers, attention_pattern=("local",), window=window)
    model = make_model(cfg)
    x = tokens(1, 16)
    y = x.at[:, 0].set((x[:, 0] + 1) % cfg.vocab_size)
    a, b = fwd(model, x).logits, fwd(model, y).logits
    reach = layers * (window - 1)  # each local layer sees window-1 tokens back
    np.testing.assert_array_equal(np.asarray(a[:, reach + 1 :]), np.asarray(b[:, reach + 1 :]))
    assert not np.allclose(a[:, reach], b[:, reach])


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 1)])
def test_gqa_matches_repeated_kv_reference(hq, hkv):
    b, t, d = 2, 6, 8
    kq, kk, kv = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(kq, (b, t, hq, d))
    k = jax.random.normal(kk, (b, t, hkv, d))
    v = jax.random.normal(kv, (b, t, hkv, d))
    mask = jnp.tril(jnp.ones((t, t), bool))[None].repeat(b, 0)
    out = gqa_attention(q, k, v, mask)
    rk, rv = jnp.repeat(k, hq // hkv, axis=2), jnp.repeat(v, hq // hkv, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, rk) / np.sqrt(d)
    s = jnp.where(mask[:, None], s, -jnp.inf)
    ref = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), rv)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    cfg = dataclasses.replace(BASE, num_heads=hq, num_kv_heads=hkv)
    model = make_model(cfg)
    assert model.blocks[0].attn.wk.shape == (cfg.d_model, hkv, cfg.head_dim)
    assert fwd(model, tokens(1, 5)).logits.shape == (1, 5, cfg.vocab_size)


def test_global_layers_use_no_positions_local_layers_use_rope():
    x = tokens(1, 10)
    pos = jnp.arange(10)[None]
    for kind, should_change in (("global", False), ("local", True)):
        cfg = dataclasses.replace(BASE, attention_pattern=(kind,), window=64)
        model = make_model(cfg)
        # Stretching the gaps keeps the order (same causal mask) but changes relative positions.
        a, b = fwd(model, x, positions=pos).logits, fwd(model, x, positions=pos * 3).logits
        assert (not np.allclose(a, b, atol=1e-6)) == should_change, kind


@pytest.mark.parametrize("impl", ["ragged", "blocked", "tiled", "capacity"])
def test_dropless_moe_equals_dense_reference(impl):
    model = make_model(dataclasses.replace(BASE, moe_impl=impl))
    x = tokens(3, 9)
    ragged = fwd(model, x)
    dense_model = make_model(dataclasses.replace(BASE, moe_impl="dense"))
    nnx.update(dense_model, nnx.state(model))
    dense = fwd(dense_model, x)
    np.testing.assert_allclose(ragged.logits, dense.logits, atol=2e-5, rtol=1e-5)
    for r1, r2 in zip(ragged.routing, dense.routing):
        np.testing.assert_array_equal(r1, r2)


def test_routing_replay_reproduces_and_router_gets_gradient():
    model = make_model()
    x = tokens(2, 8)
    out = fwd(model, x)
    replayed = fwd(model, x, routing=out.routing)
    np.testing.assert_allclose(out.logits, replayed.logits, atol=1e-6)
    forced = tuple((r + 1) % BASE.num_experts for r in out.routing)
    assert not np.allclose(fwd(model, x, routing=forced).logits, out.logits, atol=1e-4)

    graphdef, params = nnx.split(model)

    def loss(p):
        m = nnx.merge(graphdef, p)
        return jnp.mean(m(x, routing=out.routing).logits ** 2)

    grads = jax.jit(jax.grad(loss))(params)  # one compile, not one per op of the backward
    router_grad = grads["blocks"][0]["ffn"]["router"][...]
    assert float(jnp.abs(router_grad).max()) > 0


def test_load_balance_loss_is_global_across_devices_and_microbatches():
    model = make_model()
    x = tokens(8, 6)
    seg = jnp.ones((8, 6), jnp.int32).at[:, -2:].set(0)  # padding excluded from the statistics
    full = fwd(model, x, segment_ids=seg)
    halves = [fwd(model, x[i : i + 2], segment_ids=seg[i : i + 2]) for i in range(0, 8, 2)]
    combined = load_balance_loss_from_stats(
        *[h.moe_stats for h in halves], experts_per_token=BASE.experts_per_token
    )
    np.testing.assert_allclose(combined, full.load_balance_loss, rtol=1e-6)
    # A mean of per-micro-batch losses is NOT the global loss (sanity: the test can fail).
    assert not np.isclose(np.mean([h.load_balance_loss for h in halves]), full.load_balance_loss)

    mesh = make_mesh(MeshConfig(data=8, fsdp=1))
    graphdef, state = nnx.split(model)
    shard = NamedSharding(mesh, PartitionSpec("data", None))
    xs, segs = jax.device_put(x, shard), jax.device_put(seg, shard)

    @jax.jit
    def lb(state, xs, segs):
        return nnx.merge(graphdef, state)(xs, segment_ids=segs).load_balance_loss

    np.testing.assert_allclose(lb(state, xs, segs), full.load_balance_loss, rtol=1e-6)


@pytest.mark.parametrize("prompt_lens", [(3, 3), (2, 6)])
def test_cached_decode_equals_full_forward(prompt_lens):
    model = make_model()  # window 5 < sequence length, so local ring buffers wrap around
    total = 14
    x = tokens(2, total, seed=3)
    full = fwd(model, x).logits
    cache = init_cache(BASE, batch_size=2, max_len=total)
    assert cache[0]["k"].shape[1] == BASE.window and cache[1]["k"].shape[1] == total
    # Ragged prefill: each row's prompt has its own length; shorter rows are padded (pos = -1).
    p = max(prompt_lens)
    pos = np.full((2, p), -1, np.int32)
    for row, n in enumerate(prompt_lens):
        pos[row, :n] = np.arange(n)
    out = fwd(model, x[:, :p], positions=jnp.asarray(pos), cache=cache)
    for row, n in enumerate(prompt_lens):
        np.testing.assert_allclose(out.logits[row, :n], full[row, :n], atol=1e-4)
    cache = out.cache
    nxt = np.array(prompt_lens)
    while nxt.max() < total:
        step_pos = jnp.asarray(np.minimum(nxt, total - 1))[:, None]
        step_tok = x[jnp.arange(2), step_pos[:, 0]][:, None]
        live = nxt < total
        step_pos = jnp.where(jnp.asarray(live)[:, None], step_pos, -1)
        out = fwd(model, step_tok, positions=step_pos, cache=cache)
        cache = out.cache
        for row in range(2):
            if live[row]:
                np.testing.assert_allclose(out.logits[row, 0], full[row, nxt[row]], atol=1e-4)
        nxt = nxt + live


def test_cached_decode_reads_only_the_slots_that_can_be_visible():
    """One-token decode reads the smallest of `decode_buckets` slots above the batch's largest
    position: logits equal the full forward as rows cross 16 and 32 in a 64-slot cache, with one
    row far ahead of the other, and the local ring buffers (24 slots) wrap around."""
    from hcjax.model.attention import decode_buckets

    assert decode_buckets(64) == (16, 32, 64) and decode_buckets(256) == (32, 64, 128, 256)
    assert decode_buckets(24) == (24,) and decode_buckets(14) == (14,)
    cfg = dataclasses.replace(BASE, window=24)
    model = make_model(cfg)
    total = 40
    x = tokens(2, total, seed=5)
    full = fwd(model, x).logits
    cache = init_cache(cfg, batch_size=2, max_len=64)
    assert cache[0]["k"].shape[1] == 24 and cache[1]["k"].shape[1] == 64
    lens = (4, 12)
    pos = np.full((2, 12), -1, np.int32)
    for row, n in enumerate(lens):
        pos[row, :n] = np.arange(n)
    cache = fwd(model, x[:, :12], positions=jnp.asarray(pos), cache=cache).cache
    nxt = np.array(lens)
    while nxt.min() < total:
        live = nxt < total
        at = np.minimum(nxt, total - 1)
        out = fwd(model, x[jnp.arange(2), at][:, None],
                  positions=jnp.asarray(np.where(live, at, -1))[:, None], cache=cache)
        cache = out.cache
        for row in range(2):
            if live[row]:
                np.testing.assert_allclose(out.logits[row, 0], full[row, nxt[row]], atol=1e-4)
        nxt = nxt + live


def test_segment_ids_isolate_packed_documents():
    model = make_model()
    a, b = tokens(1, 5, seed=1), tokens(1, 7, seed=2)
    packed = jnp.concatenate([a, b], axis=1)
    seg = jnp.array([[1] * 5 + [2] * 7])
    pos = jnp.array([list(range(5)) + list(range(7))])
    out = fwd(model, packed, positions=pos, segment_ids=seg).logits
    np.testing.assert_allclose(out[:, :5], fwd(model, a).logits, atol=1e-5)
    np.testing.assert_allclose(out[:, 5:], fwd(model, b).logits, atol=1e-5)


def test_sharded_forward_backward_equals_single_device():
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=2, expert=2))
    sharded = create_sharded(BASE, mesh, seed=0)
    single = Transformer(BASE, rngs=nnx.Rngs(0))
    for s_leaf, u_leaf in zip(jax.tree.leaves(nnx.state(sharded)), jax.tree.leaves(nnx.state(single))):
        # Born sharded under jit vs created eagerly: equal up to float rounding of the init.
        np.testing.assert_allclose(np.asarray(s_leaf), np.asarray(u_leaf), rtol=1e-6, atol=1e-7)
    wq = sharded.blocks[0].attn.wq[...]
    # The width over fsdp x expert (LOGICAL_RULES "embed"): 32 / 4 rows a shard.
    assert len(wq.sharding.device_set) == 8 and wq.addressable_shards[0].data.shape[0] == 8
    x = tokens(4, 8)

    def loss_and_grad(model, x):
        graphdef, state = nnx.split(model)

        def loss(s):
            out = nnx.merge(graphdef, s)(x)
            return jnp.mean(jax.nn.log_softmax(out.logits)[..., 0]) + out.load_balance_loss

        return jax.jit(jax.value_and_grad(loss))(state)

    xs = jax.device_put(x, NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None)))
    l1, g1 = loss_and_grad(sharded, xs)
    l2, g2 = loss_and_grad(single, x)
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)


def test_dropout_only_with_rng():
    cfg = dataclasses.replace(BASE, dropout_rate=0.5)
    model = make_model(cfg)
    x = tokens(1, 6)
    np.testing.assert_array_equal(fwd(model, x).logits, fwd(model, x).logits)
    d1 = fwd(model, x, dropout_rng=jax.random.key(1)).logits
    d2 = fwd(model, x, dropout_rng=jax.random.key(2)).logits
    assert not np.allclose(d1, d2)


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
        ModelConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="attention_pattern"):
        ModelConfig(attention_pattern=("local", "sideways"))
    with pytest.raises(ValueError, match="dtype='fp8'"):
        ModelConfig(dtype="fp8")
    with pytest.raises(ValueError, match="experts_per_token=9 exceeds num_experts=8"):
        ModelConfig(num_experts=8, experts_per_token=9)
    with pytest.raises(ValueError, match="d_model=0"):
        ModelConfig(d_model=0)
    with pytest.raises(ValueError, match="do not divide the 8 available devices"):
        make_mesh(MeshConfig(fsdp=-1, tensor=3))
    with pytest.raises(ValueError, match="need 16 devices"):
        make_mesh(MeshConfig(fsdp=4, tensor=4))
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=4))
    cfg = dataclasses.replace(BASE, num_kv_heads=2)  # 2 KV heads cannot split over tensor=4
    with pytest.raises(ValueError, match=r"parameter blocks/0/attn/wk.*not divisible"):
        create_sharded(cfg, mesh)
