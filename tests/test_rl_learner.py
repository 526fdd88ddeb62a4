"""The learner: replay exactness against the rollout engine, exact invariance of loss and gradient to the
micro-batch split and to the device count, and a real train step (AdamW, controller, metrics)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hcjax.model import ModelConfig, Transformer, load_balance_loss_from_stats
from hcjax.rl.advantages import assign_advantages
from hcjax.rl.batch import bucket_rows, pack_rollouts, to_device, usable_rollouts
from hcjax.rl.entropy import EntropyController
from hcjax.rl.learner import Learner, LearnerConfig, chunked_token_logprobs, token_logprobs
from hcjax.rl.losses import LossConfig
from hcjax.rollout.records import Rollout
from hcjax.sharding import MeshConfig, make_mesh

CFG = ModelConfig(
    vocab_size=48, d_model=32, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16, window=6,
    attention_pattern=("local", "global"), d_ff=64, num_experts=4, experts_per_token=2,
    moe_latent_dim=16, moe_d_ff=32, max_seq_len=64, dtype="float32",
)


def _fresh_model():
    """CFG's model with every parameter perturbed: at init the attention output gains are 0, which
    would leave attention (and the KV cache path) out of every test."""
    graphdef, state = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


@pytest.fixture(scope="module")
def model():
    return _fresh_model()


@pytest.fixture(scope="module")
def sampled(model, sort_only_sampler):
    """Rollouts from the real rollout engine (continuous batching: 6 samples on 4 slots, cached
    decode; its sampler's sort-only setting, bit-identical to the CPU tuning's), graded with
    made-up rewards. All run to max_tokens; we treat them as complete."""
    from hcjax.rollout import Engine, generate
    from hcjax.rollout.request import SamplingOptions

    engine = Engine(model, max_concurrent_decodes=4, max_prefill_length=8, max_target_length=32)
    prompts = np.asarray(jax.random.randint(jax.random.key(7), (3, 5), 1, CFG.vocab_size))
    options = SamplingOptions(max_tokens=9, temperature=0.8, top_p=0.7, seed=3)
    recs = generate(None, prompts.tolist(), options, n=2, engine=engine)
    assert {r.finish_reason for r in recs} == {"length"}
    return assign_advantages([dataclasses.replace(r, finish_reason="stop", reward=float(i % 3))
                              for i, r in enumerate(recs)])


def test_replay_reproduces_sampler_logprobs(model, sampled):
    mesh = make_mesh(MeshConfig(data=1, fsdp=2), devices=jax.devices()[:2])
    assert np.mean([np.mean(r.n_kept < CFG.vocab_size) for r in sampled]) > 0.9  # top-p active
    gaps = {}
    for replay in (True, False):
        # Top-p replay on slices of 8 tokens (chunked_token_logprobs), the other whole rows.
        learner = Learner(model, LearnerConfig(seq_len=32, replay_top_p=replay,
                                               logprob_chunk=8 if replay else 0), mesh)
        batch = learner.make_batch(sampled)
        assert batch.num_tokens == sum(r.response_len for r in sampled)
        _, _, m = learner.loss_and_grad(learner.state.params, batch, 0.0)
        gaps[replay] = (float(m["logp_gap_max"]), float(m["support_miss_frac"]))
        if replay:  # on-policy: every ratio is 1, so the GRPO loss is -Σ_i |y_i|·A_i / Σ|y_i|
            expected = -sum(r.response_len * r.advantage for r in sampled) / batch.num_tokens
            np.testing.assert_allclose(m["policy_loss"], expected, atol=1e-5)
            np.testing.assert_allclose(m["ratio_max"], 1.0, atol=1e-4)
    # Same weights, fp32, routing and top-p support replayed: the sampler's log-probs exactly.
    assert gaps[True][0] <= 1e-5 and gaps[True][1] == 0.0, gaps
    # Without top-p replay the learner normalises over the full vocabulary: a visible gap.
    assert gaps[False][0] > 1e-2, gaps


@pytest.mark.parametrize("replay", [True, False])
def test_chunked_logprobs_match_whole_rows_with_ties(replay):
    """chunked_token_logprobs (3 tokens at a time, rows padded from 8 to 9) gives token_logprobs'
    values, misses and gradients, with ties at the top-p boundary broken by id as the sampler
    does: the head's weights hold repeated rows, so several logits tie exactly."""
    rng = np.random.default_rng(0)
    b, t, d, v = 2, 8, 4, 12
    hidden = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    base = rng.normal(size=(4, d))
    head = jnp.asarray(base[rng.integers(0, 4, v)], jnp.float32)  # 12 rows, 4 distinct: ties
    targets = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    temperature = jnp.asarray(rng.choice([0.7, 1.0], (b, t)), jnp.float32)
    n_kept = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)

    def whole(h, w):
        logits = jnp.einsum("btd,vd->btv", h, w)
        return token_logprobs(logits, targets, temperature, n_kept, replay)

    def chunked(h, w):
        return chunked_token_logprobs(h, w, targets, temperature, n_kept, replay, 3)

    # Jitted: one compile each rather than one per op, forward and backward.
    (want, want_miss), (got, got_miss) = jax.jit(whole)(hidden, head), jax.jit(chunked)(hidden, head)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got_miss, want_miss)
    if replay:
        assert np.any(want_miss) and not np.all(want_miss)
    loss = lambda fn: lambda h, w: jnp.sum(fn(h, w)[0] * jnp.arange(t))  # noqa: E731
    for g_want, g_got in zip(jax.jit(jax.grad(loss(whole), (0, 1)))(hidden, head),
                             jax.jit(jax.grad(loss(chunked), (0, 1)))(hidden, head)):
        np.testing.assert_allclose(g_got, g_want, rtol=1e-5, atol=1e-6)


def _random_rollouts(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = int(rng.integers(2, 7)), int(rng.integers(2, 9))
        out.append(Rollout(
            prompt_ids=rng.integers(1, CFG.vocab_size, p), response_ids=rng.integers(1, 48, r),
            logprobs=-rng.uniform(0.5, 4.0, r), n_kept=rng.integers(0, CFG.vocab_size, r),
            threshold_logit=np.zeros(r), loss_mask=rng.uniform(size=r) < 0.85,
            versions=np.zeros(r), finish_reason="stop",
            routing=np.stack([rng.permutation(CFG.num_experts)[:2] for _ in range(p + r - 1)])[None],
            temperature=float(rng.choice([0.7, 1.0])), group_id=i // 4,
            reward=float(rng.integers(0, 2)),
        ))
    return assign_advantages(out)


def _loss_and_grads(model, rollouts, mesh_cfg, devices, **cfg):
    mesh = make_mesh(mesh_cfg, devices=devices)
    lcfg = LearnerConfig(seq_len=16, load_balance_coef=1.0, **cfg)
    learner = Learner(model, lcfg, mesh)
    packed = pack_rollouts(rollouts, seq_len=16, micro_batches=lcfg.micro_batches, num_rows=8,
                           with_routing=lcfg.replay_routing)
    batch = to_device(packed, mesh)
    loss, grads, metrics = learner.loss_and_grad(learner.state.params, batch, 0.5)
    return float(loss), jax.device_get(grads), jax.device_get(metrics)


def _assert_same(a, b):
    np.testing.assert_allclose(a[0], b[0], rtol=2e-6, atol=1e-7)
    for x, y in zip(jax.tree.leaves(a[1]), jax.tree.leaves(b[1])):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-7)
    for name in a[2]:
        if "gap" in name:  # measured on the first micro-batch, which depends on the split
            continue
        np.testing.assert_allclose(a[2][name], b[2][name], rtol=2e-5, atol=1e-7, err_msg=name)


@pytest.mark.slow
def test_loss_and_grad_invariant_to_microbatches_and_devices(model):
    rollouts = _random_rollouts(14)
    one = jax.devices()[:1]
    ref = _loss_and_grads(model, rollouts, MeshConfig(fsdp=1), one, micro_batches=1)
    assert ref[0] != 0 and ref[2]["load_balance_loss"] > 0
    # 8 devices (fsdp x tensor x expert), 4 micro-batches of 2 rows.
    _assert_same(ref, _loss_and_grads(model, rollouts, MeshConfig(fsdp=2, tensor=2, expert=2),
                                      jax.devices(), micro_batches=4))


@pytest.mark.slow
def test_load_balance_without_routing_record_is_global(model):
    # Micro-batch split alone (1 device): without routing replay the global expert counts come
    # from a forward-only pre-pass, and loss, LB loss and gradients must not move.
    rollouts = _random_rollouts(10, seed=1)
    one = jax.devices()[:1]
    a = _loss_and_grads(model, rollouts, MeshConfig(fsdp=1), one, micro_batches=1,
                        replay_routing=False)
    b = _loss_and_grads(model, rollouts, MeshConfig(fsdp=1), one, micro_batches=4,
                        replay_routing=False)
    np.testing.assert_allclose(a[2]["load_balance_loss"], b[2]["load_balance_loss"], rtol=1e-6)
    np.testing.assert_allclose(a[0], b[0], rtol=2e-6)
    for x, y in zip(jax.tree.leaves(a[1]), jax.tree.leaves(b[1])):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-7)
    # And it is the model's own global-batch LB loss over the packed rows.
    packed = pack_rollouts(rollouts, seq_len=16, num_rows=8, with_routing=False)
    out = model(jnp.asarray(packed.tokens[0]), positions=jnp.asarray(packed.positions[0]),
                segment_ids=jnp.asarray(packed.segment_ids[0]))
    np.testing.assert_allclose(a[2]["load_balance_loss"], out.load_balance_loss, rtol=1e-5)
    np.testing.assert_allclose(
        load_balance_loss_from_stats(out.moe_stats, experts_per_token=2), out.load_balance_loss)


def test_train_step_improves_positive_sequences_and_updates_k(model, sampled):
    mesh = make_mesh(MeshConfig(data=2, fsdp=1), devices=jax.devices()[:2])
    cfg = LearnerConfig(seq_len=32, learning_rate=3e-3, max_grad_norm=1.0,
                        loss=LossConfig(name="grpo"),
                        entropy=EntropyController(target=5.0, delta=0.25, k_max=0.5))
    learner = Learner(model, cfg, mesh)
    batch = learner.make_batch(sampled)
    before = learner.loss_and_grad(learner.state.params, batch, 0.0)[0]
    ks = []
    for _ in range(3):
        m = learner.step(batch)
        ks.append(m["k"])
        assert np.isfinite(m["loss"]) and m["grad_norm"] > 0
        np.testing.assert_allclose(m["k_next"], cfg.entropy.next_k(m["k"], m["entropy"]))
    # Ĥ of this tiny model is below the 5.0 target: k climbs by δ and saturates at k_max.
    assert ks == [0.0, 0.25, 0.5]
    assert int(learner.state.step) == 3 and float(learner.state.entropy["k"]) == 0.5
    after = learner.loss_and_grad(learner.state.params, batch, 0.0)[0]
    assert after < before  # the GRPO surrogate went down on the data it trained on
    # The model given to the learner is untouched (its arrays are not donated).
    np.testing.assert_array_equal(model.embed[...], _fresh_model().embed[...])
    # The learner state is a plain pytree: it round-trips through flatten/unflatten.
    leaves, treedef = jax.tree.flatten(learner.state)
    restored = jax.tree.unflatten(treedef, leaves)
    assert dataclasses.is_dataclass(restored) and float(restored.entropy["k"]) == 0.5


def test_train_is_the_controllers_step_on_bucketed_rows(model):
    """`Learner.train(rollouts)` (the controller's Learner): the usable rollouts packed on the
    host with rows padded to `bucket_rows`, then `step`; nothing usable, no step."""
    mesh = make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1])
    learner = Learner(model, LearnerConfig(seq_len=16, micro_batches=2), mesh)
    rollouts = _random_rollouts(14, seed=2)
    rollouts[0] = dataclasses.replace(rollouts[0], finish_reason="aborted")
    usable = usable_rollouts(rollouts)
    rows = pack_rollouts(usable, seq_len=16, with_routing=False).tokens.shape[1]
    batch = learner.pack_bucketed(rollouts)
    assert isinstance(batch.tokens, np.ndarray) and batch.micro_batches == 2
    assert batch.rows == bucket_rows(rows, 2) > rows  # padded to the bucket: 6 rows -> 8
    start = jax.tree.map(jnp.copy, learner.state)
    got = learner.train(rollouts)
    assert (got.pop("rows"), got.pop("train_rollouts")) == (batch.rows, len(usable))
    learner.state = start
    assert learner.step(batch) == got  # a host batch is placed on the mesh by `step`
    assert learner._step._cache_size() == 1
    assert learner.train([dataclasses.replace(r, finish_reason="aborted") for r in rollouts]) \
        == {"skipped": 1.0}
    assert int(learner.state.step) == 1


def test_batch_layout_and_errors(sampled):
    rs = list(sampled)
    rs[0] = dataclasses.replace(rs[0], finish_reason="length")
    rs[1] = dataclasses.replace(rs[1], finish_reason="aborted")
    b = pack_rollouts(rs, seq_len=32, micro_batches=2, row_multiple=2)
    r = sampled[2]
    assert b.tokens.shape[:2] == (2, 2) and b.routing.shape[:3] == (2, 1, 2)
    assert b.num_tokens == 4 * 9 and b.num_sequences == 4  # truncated and aborted are out
    # Row 0 (micro-batch 0, row 0) starts with a full rollout; its loss positions predict the
    # response: target at input position P - 1 + j is response token j.
    seg = b.segment_ids[0, 0]
    first = seg == 1
    n = int(first.sum())
    full = np.concatenate([r.prompt_ids, r.response_ids])
    assert n == r.input_len  # all rollouts have the same length here
    rows = [i for i in range(2, 6)]
    cand = [np.concatenate([sampled[i].prompt_ids, sampled[i].response_ids]) for i in rows]
    hit = [i for i, c in zip(rows, cand) if np.array_equal(b.tokens[0, 0, :n], c[:-1])]
    assert hit  # (two samples of one prompt may coincide; then either matches)
    r = sampled[hit[0]]
    full = np.concatenate([r.prompt_ids, r.response_ids])
    np.testing.assert_array_equal(b.targets[0, 0, :n], full[1:])
    np.testing.assert_array_equal(b.loss_mask[0, 0, :n], [False] * 4 + [True] * 9)
    np.testing.assert_allclose(b.old_logp[0, 0, 4:n], r.logprobs)
    np.testing.assert_array_equal(b.positions[0, 0, :n], np.arange(n))
    np.testing.assert_array_equal(b.routing[0, :, 0, :n], r.routing)
    np.testing.assert_allclose(b.temperature[0, 0, :n], 0.8)
    with pytest.raises(ValueError, match="more than seq_len=8"):
        pack_rollouts(sampled, seq_len=8)
    with pytest.raises(ValueError, match="has no advantage"):
        pack_rollouts([dataclasses.replace(sampled[0], advantage=None)], seq_len=32)
    with pytest.raises(ValueError, match="no routing record"):
        pack_rollouts([dataclasses.replace(sampled[0], routing=None)], seq_len=32)
    with pytest.raises(ValueError, match="more than num_rows=1"):
        pack_rollouts(sampled, seq_len=16, num_rows=1)
    with pytest.raises(ValueError, match="micro_batches=0"):
        LearnerConfig(micro_batches=0)


def test_kimi_loss_through_the_learner(model, sampled):
    # On-policy the log-ratio of every sequence is 0, so the Kimi surrogate is mean_i A_i², with
    # mean-only advantages; this checks the sequence plumbing (segments, num_sequences).
    rollouts = assign_advantages(sampled, "mean")
    mesh = make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1])
    learner = Learner(model, LearnerConfig(seq_len=32, loss=LossConfig(name="kimi", tau=0.5)), mesh)
    batch = learner.make_batch(rollouts)
    _, grads, m = learner.loss_and_grad(learner.state.params, batch, 0.0)
    expected = np.mean([r.advantage**2 for r in rollouts])
    np.testing.assert_allclose(m["policy_loss"], expected, rtol=1e-4)
    assert abs(float(m["kl_prev"])) < 1e-5
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


def test_tis_through_the_learner_against_the_replayed_sampler(model, sampled):
    # Routing and top-p replay make π_prox = π_samp here (ρ = 1): TIS changes nothing and clips
    # nothing. Lowering every sampler log-prob by 1 makes ρ = e > C = 2 on every token: each
    # weight is C, so the loss and gradient double (no load-balance term) and is_clip_frac is 1.
    mesh = make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1])
    cfg = LearnerConfig(seq_len=32, load_balance_coef=0.0,
                        loss=LossConfig(correction="tis", is_cap=2.0))
    learner = Learner(model, cfg, mesh)
    batch = learner.make_batch(sampled)
    _, grads, m = learner.loss_and_grad(learner.state.params, batch, 0.0)
    shifted = dataclasses.replace(batch, old_logp=batch.old_logp - 1.0)
    _, grads2, m2 = learner.loss_and_grad(learner.state.params, shifted, 0.0)
    n = float(batch.num_tokens)
    adv_sum = float(np.sum(np.where(batch.loss_mask, batch.advantages, 0.0)))
    np.testing.assert_allclose(m["policy_loss"], -adv_sum / n, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(m2["policy_loss"], -2.0 * adv_sum / n, rtol=1e-4, atol=1e-6)
    assert float(m["is_clip_frac"]) == 0.0 and float(m2["is_clip_frac"]) == 1.0
    np.testing.assert_allclose(m["is_ratio_mean"], 1.0, atol=1e-4)
    np.testing.assert_allclose(m2["is_ratio_mean"], math.e, rtol=1e-4)
    for g, g2 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads2)):
        np.testing.assert_allclose(g2, 2.0 * g, rtol=1e-3, atol=1e-6)


def test_gin_selects_loss_and_controller_by_name():
    import gin

    gin.clear_config()
    try:
        gin.parse_config([
            "LossConfig.name = 'gspo'", "LossConfig.gspo_eps_high = 0.01",
            "EntropyController.target = 0.5", "LearnerConfig.micro_batches = 4",
            "LossConfig.correction = 'seq_mis'", "LossConfig.is_seq_form = 'geometric'",
            "LearnerConfig.router_bias_rate = 0.001",
        ])
        cfg = LearnerConfig()
        assert cfg.loss.name == "gspo" and cfg.loss.gspo_eps_high == 0.01
        assert cfg.loss.correction == "seq_mis" and cfg.loss.is_seq_form == "geometric"
        assert cfg.router_bias_rate == 0.001
        assert cfg.entropy.target == 0.5 and cfg.micro_batches == 4
    finally:
        gin.clear_config()


def test_bench_model_flops_hand_count():
    from hcjax.bench.learner import model_flops

    cfg = ModelConfig(vocab_size=10, d_model=4, num_layers=1, num_heads=1, num_kv_heads=1,
                      head_dim=2, attention_pattern=("global",), ffn_pattern=("dense",), d_ff=8)
    # 2 tokens at positions 0, 1: logits 2·10·4·2 = 160; q,k,v,o 2·(2·4·2 + 2·4·2)·2 = 128;
    # attention 4·1·2·(1 + 2) = 24; SwiGLU 2·3·4·8·2 = 384; x3 for forward + backward.
    flops = model_flops(cfg, np.array([[0, 1, 0]]), np.array([[True, True, False]]))
    assert flops == 3 * (160 + 128 + 24 + 384)


def test_bucket_rows_pads_to_four_sizes_per_doubling_above_8_rows_and_the_step():
    assert [bucket_rows(n) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [bucket_rows(n) for n in (9, 10, 11, 13, 15, 16)] == [10, 10, 12, 14, 16, 16]
    assert [bucket_rows(n) for n in (17, 21, 29, 33)] == [20, 24, 32, 40]
    assert {bucket_rows(n) for n in range(65, 129)} == {80, 96, 112, 128}
    for n in range(1, 300):  # never fewer rows, at most a quarter padding, a multiple of step
        for step in (1, 2, 4, 8):
            r = bucket_rows(n, step)
            assert r >= n and r % step == 0
            assert (r - n) < (max(n / 4, step) if n > 8 else max(n, step))
    with pytest.raises(ValueError, match="rows=0"):
        bucket_rows(0)


def test_step_record_carries_the_rollout_correction_metrics():
    from types import SimpleNamespace

    from hcjax.rl.controller import StepReport
    from hcjax.rl.report import step_record

    metrics = {"entropy": 0.4, "is_clip_frac": 0.125, "is_kl": 0.01, "is_ratio_max": 3.0}
    stats = SimpleNamespace(rollouts=4, early_dropped=0, full_dropped=0, failures=0)
    counters = {"stale_rollouts_dropped": 0}
    record = step_record(StepReport(1, 1, metrics, [], []), 0.3, stats, counters, 1.0, 2.0)
    assert record["is_clip_frac"] == 0.125 and record["is_kl"] == 0.01
    assert record["is_ratio_max"] == 3.0 and "is_weight_mean" not in record
