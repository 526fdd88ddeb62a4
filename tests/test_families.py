"""The five open model families through the whole loop, on the Hugging Face fixtures
(../shared/fixtures/hf): the rollout engine and server (greedy = the reference's greedy tokens;
cached decoding, with MLA's compressed cache and GPT-OSS's wrapping ring buffer, = the full
forward), the learner (routing and top-p replay reproduce the sampler's log-probs; a train step
moves the weights; loss and gradient do not depend on the micro-batch split), and transfer plans
from a learner layout to an inference layout (every element once, values and logits kept)."""

import collections
import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hcjax.model import hf, param_shardings, shard_state
from hcjax.rl.advantages import assign_advantages
from hcjax.rl.batch import pack_rollouts, to_device
from hcjax.rl.learner import Learner, LearnerConfig
from hcjax.rl.mismatch import MismatchConfig, check, format_table, measure_mismatch
from hcjax.rl.store import rollout_from_json, rollout_to_json
from hcjax.rollout import Engine, GenerateRequest, RolloutServer, generate, wire
from hcjax.rollout.request import SamplingOptions
from hcjax.sharding import MeshConfig, make_mesh
from hcjax.transfer import LocalTransfer, make_plan
from tests.hf_fixtures import FAMILIES, fixture, golden

# The engines' sampler: its sort-only setting (bit-identical, compiles in a third of the time).
pytestmark = pytest.mark.usefixtures("sort_only_sampler")
MOE_FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3")
MAX_LEN = 48  # engine cache length; 12 + 24 tokens leave GPT-OSS's window of 8 far behind
PROMPT_LEN, LONG = 12, 24
TEMPERATURE, TOP_P = 0.9, 0.9
SEQ_LEN = 24  # learner rows


# One model, engine and set of records per family, shared by the tests below (compiles once).


@functools.cache
def loaded(family: str):
    return hf.load(fixture(family))


@functools.cache
def engine(family: str) -> Engine:
    model, _ = loaded(family)
    return Engine(model, max_concurrent_decodes=4, max_prefill_length=16, max_target_length=MAX_LEN)


@functools.cache
def full_forward(family: str):
    """tokens -> (logits [T, V], routing [L, T, k]) of one no-cache forward (padded to MAX_LEN:
    causal attention and per-token routing make the padding harmless, and one shape compiles)."""
    graphdef, state = nnx.split(loaded(family)[0])

    @jax.jit
    def fwd(tokens):
        out = nnx.merge(graphdef, state)(tokens[None])
        routing = [r[0] for r in out.routing]
        return out.logits[0], jnp.stack(routing) if routing else jnp.zeros((0, MAX_LEN, 0), jnp.int32)

    def run(tokens):
        n = len(tokens)
        logits, routing = fwd(np.pad(np.asarray(tokens, np.int32), (0, MAX_LEN - n)))
        return np.asarray(logits, np.float64)[:n], np.asarray(routing)[:, :n]

    return run


@functools.cache
def served(family: str, one_step_calls: bool = False) -> dict:
    """Records from the continuous-batching server (decode blocks of up to 16 steps, or of one
    step per device call, the same program): greedy 8 and 24 tokens, and 2 sampled."""
    prompt = golden(family, "input_ids")[0, :PROMPT_LEN].tolist()
    srv = RolloutServer(engine(family), block_steps=16)
    if one_step_calls:
        srv._block_size = lambda owners: 1
    with srv.start():
        handles = {
            "greedy8": srv.submit(GenerateRequest(prompt=prompt, max_tokens=8, temperature=0.0)),
            "greedy": srv.submit(GenerateRequest(prompt=prompt, max_tokens=LONG, temperature=0.0)),
            "sampled": srv.submit(GenerateRequest(prompt=prompt, n=2, max_tokens=LONG,
                                                  temperature=TEMPERATURE, top_p=TOP_P, seed=5)),
        }
        return {name: h.result(timeout=300) for name, h in handles.items()}


@functools.cache
def sampled_rollouts(family: str) -> tuple:
    """6 graded rollouts (3 prompts x 2 samples on 4 slots), top-p active, each feeding 18 tokens
    (one per packed row of SEQ_LEN). All run to max_tokens; we treat them as complete."""
    ids = golden(family, "input_ids")
    prompts = [ids[0, :10], ids[1, :10], ids[0, 12:22]]  # the prefill bucket `served` compiled
    options = SamplingOptions(max_tokens=9, temperature=0.8, top_p=0.7, seed=3)
    recs = generate(None, [p.tolist() for p in prompts], options, n=2, engine=engine(family))
    recs = [dataclasses.replace(r, finish_reason="stop", reward=float(i % 3))
            for i, r in enumerate(recs)]
    return tuple(assign_advantages(recs))


@pytest.fixture(scope="module", autouse=True)
def _release_family_caches():
    yield
    for cached in (loaded, engine, full_forward, served, sampled_rollouts, transferred):
        cached.cache_clear()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.sum(np.exp(x), -1, keepdims=True))


def moe_layers(family: str) -> int:
    return loaded(family)[1].num_moe_layers


# Rollout engine and server ------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_server_greedy_reproduces_reference_tokens(family):
    records = served(family)
    want = golden(family, "greedy")[0].tolist()
    assert records["greedy8"][0].response_ids.tolist() == want
    assert records["greedy"][0].response_ids[:8].tolist() == want


@pytest.mark.parametrize("family", FAMILIES)
def test_paged_kv_gives_the_slot_layouts_tokens(family):
    """The paged layout (pages of 4, a pool that holds three of the 36-token sequences, so
    pages are taken as sequences grow) gives the slot layout's greedy and sampled tokens and
    log-probs; every page comes back."""
    eng = Engine(loaded(family)[0], max_concurrent_decodes=4, max_prefill_length=16,
                 max_target_length=MAX_LEN, kv_layout="paged", page_size=4, num_pages=30)
    prompt = golden(family, "input_ids")[0, :PROMPT_LEN].tolist()
    with RolloutServer(eng).start() as srv:
        greedy = srv.submit(GenerateRequest(prompt=prompt, max_tokens=LONG, temperature=0.0))
        sampled = srv.submit(GenerateRequest(prompt=prompt, n=2, max_tokens=LONG,
                                             temperature=TEMPERATURE, top_p=TOP_P, seed=5))
        got = {"greedy": greedy.result(timeout=300), "sampled": sampled.result(timeout=300)}
    for name, records in got.items():
        for rec, want in zip(records, served(family)[name], strict=True):
            assert rec.response_ids.tolist() == want.response_ids.tolist()
            np.testing.assert_allclose(rec.logprobs, want.logprobs, atol=1e-4)
    assert got["greedy"][0].response_ids[:8].tolist() == golden(family, "greedy")[0].tolist()
    assert eng.page_stats()["in_use"] == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decoding_matches_full_forward(family):
    """24 tokens past a 12-token prompt: GPT-OSS's window-8 ring buffer has wrapped 4 times."""
    fwd = full_forward(family)
    rec = served(family)["greedy"][0]
    seq = np.concatenate([rec.prompt_ids, rec.response_ids])
    logits, _ = fwd(seq)
    steps = logits[PROMPT_LEN - 1 : PROMPT_LEN - 1 + LONG]
    assert rec.response_ids.tolist() == np.argmax(steps, axis=-1).tolist()
    raw = log_softmax(steps)[np.arange(LONG), rec.response_ids]
    np.testing.assert_allclose(rec.raw_logprobs, raw, atol=1e-4)
    np.testing.assert_array_equal(rec.n_kept, 1)

    for rec in served(family)["sampled"]:
        seq = np.concatenate([rec.prompt_ids, rec.response_ids])
        logits, _ = fwd(seq)
        z = logits[PROMPT_LEN - 1 : PROMPT_LEN - 1 + LONG] / TEMPERATURE
        for t, tok in enumerate(rec.response_ids):
            order = np.lexsort((np.arange(z.shape[1]), -z[t]))  # descending, ties by lower id
            probs = np.exp(z[t] - z[t].max())
            probs /= probs.sum()
            mass_before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
            kept = order[mass_before < TOP_P]
            assert rec.n_kept[t] == kept.size, t
            assert tok in kept
            np.testing.assert_allclose(rec.logprobs[t], np.log(probs[tok] / probs[kept].sum()),
                                       atol=1e-4)
        raw = log_softmax(logits[PROMPT_LEN - 1 : PROMPT_LEN - 1 + LONG])
        np.testing.assert_allclose(rec.raw_logprobs, raw[np.arange(LONG), rec.response_ids],
                                   atol=1e-4)
        assert np.mean(rec.n_kept > 1) > 0.5  # really sampled, from more than the argmax


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_blocks_do_not_change_records(family):
    """One decode step per device call and blocks of 16 give the same records, greedy and
    sampled: tokens, log-probs, top-p records, routing, versions, bit for bit (one compiled
    program run 1 or 16 steps a call; that it equals the single-step `generate` is
    test_rollout_engine's test_generate_block_equals_single_steps)."""
    one, blocks = served(family, True), served(family)
    for name in ("greedy8", "greedy", "sampled"):
        for a, b in zip(one[name], blocks[name], strict=True):
            for field in ("response_ids", "logprobs", "raw_logprobs", "n_kept",
                          "threshold_logit", "routing", "versions"):
                np.testing.assert_array_equal(getattr(a, field), getattr(b, field),
                                              err_msg=f"{name}.{field}")
            assert a.finish_reason == b.finish_reason


@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_routing_matches_full_forward(family):
    """MoE families: the experts recorded at prefill and decode are the full forward's. Dense
    families record an empty [0, P + R - 1, 0], which the learner replays as "no MoE layer"."""
    fwd = full_forward(family)
    for rec in [served(family)["greedy"][0], *served(family)["sampled"]]:
        seq = np.concatenate([rec.prompt_ids, rec.response_ids])
        _, routing = fwd(seq)
        assert rec.routing.shape[:2] == (moe_layers(family), rec.input_len)
        np.testing.assert_array_equal(rec.routing, routing[:, : rec.input_len])
    if family in MOE_FAMILIES:
        assert rec.routing.shape == (moe_layers(family), rec.input_len, 2)
    else:
        assert rec.routing.shape == (0, rec.input_len, 0)
    # The record keeps its routing through the gRPC wire format and the JSON rollout store
    # (where an empty one comes back as [] and is given its shape again).
    meta, arrays = wire.record_to_wire(rec, "r")
    for back in (wire.record_from_wire(*wire.decode(wire.encode(meta, arrays)), "r"),
                 rollout_from_json(json.loads(json.dumps(rollout_to_json(rec))))):
        assert back.routing.shape == rec.routing.shape
        np.testing.assert_array_equal(back.routing, rec.routing)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_matches_full_forward(family):
    """24 prompt tokens in chunks of 16 + 8 (MLA's latent cache and the ring buffer filled by
    chunks, the second one partly padding)."""
    eng = engine(family)
    tokens = golden(family, "input_ids")[0]
    prefix = eng.prefill(params=eng.load_params(), padded_tokens=tokens, true_length=24)
    logits, routing = full_forward(family)(tokens)
    np.testing.assert_allclose(np.asarray(prefix.logits), logits[23], atol=1e-4)
    np.testing.assert_array_equal(np.asarray(prefix.routing), routing)


@pytest.mark.parametrize("family", FAMILIES)
def test_bulk_prefill_equals_prefill_alone(family):
    """Four prompts of 9-16 tokens in one call (rows of the 16-token bucket `served` compiled)
    and the 24-token one alone in chunks: each Prefix is the lone prefill's (MLA's latent cache,
    GPT-OSS's ring folded from the wide cache), and decoding from them gives the same greedy and
    sampled tokens."""
    eng, params = engine(family), engine(family).load_params()
    ids = golden(family, "input_ids")
    prompts = [ids[0, :PROMPT_LEN], ids[1, :10], ids[0, 3:12], ids[1, :16], ids[0]]
    options = [SamplingOptions(max_tokens=8, temperature=t, top_p=TOP_P, seed=i)
               for i, t in enumerate([0.0, TEMPERATURE, 0.0, TEMPERATURE, 0.0])]
    alone = [eng.prefill(params=params, padded_tokens=p, true_length=len(p), sampling=o)
             for p, o in zip(prompts, options)]
    bulk = eng.bulk_prefill(params=params, prompts=prompts, samplings=options)
    for got, want in zip(bulk, alone, strict=True):
        assert (got.length, got.tokens, got.sampling) == (want.length, want.tokens, want.sampling)
        np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), atol=1e-4)
        np.testing.assert_array_equal(got.routing, want.routing)
        jax.tree.map(lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w),
                                                             atol=1e-4), got.cache, want.cache)

    def decode(prefixes):
        state = eng.init_decode_state()
        for slot, prefix in enumerate(prefixes[:4]):
            state = eng.bulk_insert(prefix, state, [slot])
        _, block = eng.generate_block(params, state, 8, max_steps=16)  # `served`'s program
        return jax.device_get(block)

    got, want = decode(bulk), decode(alone)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)


# Learner ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_learner_replays_sampler_logprobs_and_trains(family):
    """Same weights, fp32, routing and top-p support replayed: the learner's log-probs of the
    sampled tokens are the sampler's (a record misaligned by one position would replay other
    experts and show here), so every ratio is 1; then one AdamW step moves every parameter that
    has a gradient; then the mismatch gate."""
    model, cfg = loaded(family)
    rollouts = sampled_rollouts(family)
    assert np.mean([np.mean(r.n_kept < cfg.vocab_size) for r in rollouts]) > 0.9
    mesh = make_mesh(MeshConfig(data=1, fsdp=2), devices=jax.devices()[:2])
    learner = Learner(model, LearnerConfig(seq_len=SEQ_LEN, learning_rate=1e-3), mesh)
    batch = learner.make_batch(rollouts)
    assert batch.routing.shape[:2] == (1, cfg.num_moe_layers)
    before = jax.device_get(learner.state.params)
    m = learner.step(batch)  # metrics are those of the parameters before the update

    assert m["logp_gap_max"] <= 1e-5 and m["support_miss_frac"] == 0.0, m
    np.testing.assert_allclose(m["ratio_max"], 1.0, atol=1e-4)
    assert np.isfinite(m["loss"]) and m["grad_norm"] > 0
    if family in MOE_FAMILIES:
        assert m["load_balance_loss"] > 0
    else:
        assert m["load_balance_loss"] == 0.0

    after = jax.device_get(learner.state.params)
    unchanged = [
        jax.tree_util.keystr(path)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(before),
                                jax.tree.leaves(after))
        if np.array_equal(a, b)
    ]
    # DeepSeek's correction bias only picks experts (no gradient through the choice, and with
    # routing replay it is not even read); DeepSeek-V3 moves it by a load rule, not by SGD.
    assert all("correction_bias" in p for p in unchanged), unchanged
    assert bool(unchanged) == (family == "deepseek_v3")

    # The mismatch gate (hcjax.rl.mismatch) on this learner (its compiled step reused): 20 more
    # GRPO steps, the count (about 1 s more than 3 on these fixtures), with the engine as
    # the sampler of the learner's weights. fp32 with replay stays under BOUNDS; without replay
    # the gap is at least that of the lost top-p support (-log of the nucleus mass).
    gate = MismatchConfig(steps=20, prompts=3, samples=2, prompt_len=10, max_tokens=9,
                          temperature=0.8, top_p=0.7)
    table = [dict(row, family=family)
             for row in measure_mismatch(model, gate, engine=engine(family), learner=learner)]
    print("\n" + format_table(table))
    assert check(table) == [], format_table(table)
    rows = {row["replay"]: row for row in table}
    assert rows[True]["tokens"] == rows[False]["tokens"] == 20 * 3 * 2 * 9
    assert rows[False]["mean_abs_dlogp"] > 1e3 * rows[True]["mean_abs_dlogp"], table


def test_mismatch_check_names_the_bound_it_breaks():
    row = {"family": "x", "sampler_dtype": "float32", "learner_dtype": "float32", "replay": True,
           "tokens": 4, "mean_abs_dlogp": 2e-5, "max_abs_dlogp": 1e-4, "kl": float("nan")}
    bad = check([row, dict(row, replay=False, mean_abs_dlogp=1.0),
                 dict(row, sampler_dtype="bfloat16", kl=1.0)])
    assert len(bad) == 2 and "mean_abs_dlogp=2e-05 > 1e-05" in bad[0] and "kl=nan" in bad[1], bad
    assert check([dict(row, mean_abs_dlogp=1e-7, kl=0.0)]) == []


def test_learner_moves_deepseek_correction_bias_by_the_replayed_load():
    """router_bias_rate u: after the step each MoE layer's bias is b + u·sign(mean - load), the
    load counted by hand from the batch's routing record (what replay fed the forward)."""
    model, cfg = loaded("deepseek_v3")
    mesh = make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1])
    learner = Learner(model, LearnerConfig(seq_len=SEQ_LEN, learning_rate=0.0,
                                           router_bias_rate=0.01), mesh)
    batch = learner.pack(sampled_rollouts("deepseek_v3"))
    bias = lambda params: np.stack([np.asarray(params["blocks"][i]["ffn"]["correction_bias"][...])
                                    for i in cfg.moe_layers])
    before = bias(jax.device_get(learner.state.params))
    m = learner.step(batch)
    valid = batch.segment_ids[0] > 0  # [b, T]
    load = np.zeros((cfg.num_moe_layers, cfg.num_experts))
    for layer in range(cfg.num_moe_layers):
        np.add.at(load[layer], batch.routing[0, layer][valid].reshape(-1), 1.0)
    expected = before + 0.01 * np.sign(load.mean(-1, keepdims=True) - load)
    np.testing.assert_allclose(bias(jax.device_get(learner.state.params)), expected, rtol=1e-6)
    assert np.any(expected != before)
    ratio = load.max(-1) / load.mean(-1)
    np.testing.assert_allclose(m["router_load_imbalance_max"], ratio.max(), rtol=1e-5)
    with pytest.raises(ValueError, match="router_bias_rate=0.01"):
        Learner(loaded("qwen3_moe")[0], LearnerConfig(seq_len=SEQ_LEN, router_bias_rate=0.01),
                mesh)


def _off_policy(rollouts) -> list:
    """The rollouts as if sampled by an older policy, some tokens masked, advantages shifted:
    on-policy, with equal lengths and group-centred advantages, the GRPO loss is 0 up to
    rounding, which would make its comparison meaningless."""
    rng = np.random.default_rng(0)
    return [
        dataclasses.replace(
            r, logprobs=r.logprobs + rng.normal(0.0, 0.3, r.response_len).astype(np.float32),
            loss_mask=np.arange(r.response_len) < r.response_len - i % 4,
            advantage=r.advantage + 0.5,
        )
        for i, r in enumerate(rollouts)
    ]


def _loss_and_grads(family, micro_batches, mesh_cfg, devices):
    model, _ = loaded(family)
    mesh = make_mesh(mesh_cfg, devices=devices)
    cfg = LearnerConfig(seq_len=SEQ_LEN, load_balance_coef=1.0, micro_batches=micro_batches)
    learner = Learner(model, cfg, mesh)
    packed = pack_rollouts(_off_policy(sampled_rollouts(family)), seq_len=SEQ_LEN,
                           micro_batches=micro_batches, num_rows=8)
    loss, grads, metrics = learner.loss_and_grad(learner.state.params, to_device(packed, mesh),
                                                 0.5)
    return float(loss), jax.device_get(grads), jax.device_get(metrics)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "deepseek_v3"])
def test_loss_and_grad_invariant_to_micro_batches_and_devices(family):
    """One pass on one device = 4 micro-batches of 2 rows over 4 devices (8 rows, 6 rollouts),
    with the global-batch load-balance loss of a sigmoid grouped router (DeepSeek-V3) and with an
    empty routing record (Llama 3, no MoE layer)."""
    one = _loss_and_grads(family, 1, MeshConfig(fsdp=1), jax.devices()[:1])
    four = _loss_and_grads(family, 4, MeshConfig(fsdp=2, expert=2), jax.devices()[:4])
    assert abs(one[2]["policy_loss"]) > 0.1
    np.testing.assert_allclose(one[0], four[0], rtol=2e-6, atol=1e-7)
    for x, y in zip(jax.tree.leaves(one[1]), jax.tree.leaves(four[1])):
        # fp32 sums in another order (rows and the embedding dimension split over devices): an
        # error relative to the leaf's scale, not to each (possibly tiny) element.
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-5 * np.abs(x).max())
    for name in one[2]:
        if "gap" in name:  # measured on the first micro-batch, which depends on the split
            continue
        np.testing.assert_allclose(one[2][name], four[2][name], rtol=2e-5, atol=1e-6,
                                   err_msg=name)
    if family in MOE_FAMILIES:
        assert one[2]["load_balance_loss"] > 0


# Transfer plans -----------------------------------------------------------------------------


def _layout(state: nnx.State, mesh) -> nnx.State:
    """`state`'s tree with each parameter's NamedSharding on `mesh` in place of its array."""
    shardings = dict(nnx.to_flat_state(param_shardings(state, mesh)))
    return nnx.map_state(lambda path, v: v.replace(shardings[path]), state)


LEARNER_MESH = MeshConfig(fsdp=4, num_devices=4)  # devices 0-3
INFERENCE_MESH = MeshConfig(fsdp=1, tensor=2, expert=2, device_offset=4, num_devices=4)  # 4-7


@functools.cache
def transferred(family: str):
    """(plan, source on the learner mesh, its destination layout, the executed plan's result)."""
    _, state = nnx.split(loaded(family)[0])
    source = shard_state(state, make_mesh(LEARNER_MESH))
    destination = _layout(state, make_mesh(INFERENCE_MESH))
    plan = make_plan(source, destination)
    return plan, source, destination, LocalTransfer(plan)(source)


@pytest.mark.parametrize("family", FAMILIES)
def test_transfer_plan_learner_to_inference_layout(family):
    plan, source, destination, moved = transferred(family)

    # Coverage: every element of every destination shard written exactly once (make_plan's
    # validate() already rejects overlaps), each source element read only where it is needed.
    written = collections.Counter()
    for e in plan.entries:
        assert e.src_device in range(4) and e.dst_device in range(4, 8), str(e)
        written[e.dst_leaf, e.dst_device] += math.prod(e.shape)
    expected = collections.Counter()
    for path, spec in plan.dst_leaves.items():
        for device in spec.sharding.device_set:
            expected[path, device.id] = math.prod(spec.sharding.shard_shape(spec.shape))
    assert written == expected
    assert plan.bytes_moved == plan.ideal_bytes

    flat_src = jax.tree_util.tree_leaves_with_path(source)
    flat_dst = jax.tree_util.tree_leaves_with_path(moved)
    flat_want = jax.tree.leaves(destination)
    assert len(flat_src) == len(flat_dst) == len(flat_want)
    for (path, a), (path_b, b), sharding in zip(flat_src, flat_dst, flat_want):
        assert path == path_b
        assert b.sharding.is_equivalent_to(sharding, b.ndim), jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a),
                                      err_msg=jax.tree_util.keystr(path))

    # The model on the inference devices computes what it computed on the learner's.
    graphdef = nnx.graphdef(loaded(family)[0])

    @jax.jit
    def logits(params, tokens):
        return nnx.merge(graphdef, params)(tokens).logits

    ids = golden(family, "input_ids")
    on_learner = np.asarray(logits(source, ids))
    on_inference = logits(moved, ids)
    assert {d.id for d in on_inference.devices()} <= set(range(4, 8))
    np.testing.assert_allclose(np.asarray(on_inference), on_learner, atol=2e-5)
    np.testing.assert_allclose(np.asarray(on_inference), golden(family, "logits"), atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_engine_on_inference_mesh_serves_transferred_weights(family):
    """The two unusual caches (ring buffer with sinks; MLA's latent) on the inference mesh, with
    the transferred weights: the reference's greedy tokens."""
    *_, moved = transferred(family)
    model = nnx.merge(nnx.graphdef(loaded(family)[0]), moved)
    eng = Engine(model, mesh=make_mesh(INFERENCE_MESH), max_concurrent_decodes=2,
                 max_prefill_length=16, max_target_length=32)
    prompt = golden(family, "input_ids")[0, :PROMPT_LEN].tolist()
    with RolloutServer(eng).start() as srv:
        rec = srv.generate(GenerateRequest(prompt=prompt, max_tokens=8, temperature=0.0),
                           timeout=300)[0]
    assert rec.response_ids.tolist() == golden(family, "greedy")[0].tolist()


@pytest.mark.slow  # about 15 s: a fresh engine, learner step and log-prob forward compile
def test_climb_check_mismatch_prints_the_gate_and_fails_past_its_bounds(capsys, monkeypatch):
    from hcjax import climb
    from hcjax.rl import mismatch

    out = climb.main(["--hf_checkpoint", fixture("llama3"), "--check_mismatch",
                      "--mismatch_steps", "1", "--output_dir", "/nonexistent/unused"])
    printed = capsys.readouterr().out.strip().splitlines()
    assert out["check_mismatch"] == "pass" and len(out["rows"]) == 2
    assert printed[0].split()[:4] == ["family", "sampler", "learner", "replay"]
    assert json.loads(printed[-1])["check_mismatch"] == "pass"
    bad = dict(out["rows"][0], mean_abs_dlogp=1.0)
    assert bad["replay"] and bad["sampler_dtype"] == "float32"
    monkeypatch.setattr(mismatch, "measure_mismatch", lambda *a, **k: [bad])
    with pytest.raises(SystemExit) as e:
        climb.main(["--hf_checkpoint", fixture("llama3"), "--check_mismatch"])
    assert e.value.code == 1
    assert "mean_abs_dlogp=1 > 1e-05" in capsys.readouterr().err
