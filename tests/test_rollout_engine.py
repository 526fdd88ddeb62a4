"""Engine and server on the real model's cache path: greedy = full-forward argmax, recorded
top-p support / log-probs / routing = recomputation from the full forward, seeds, bulk_insert,
weight versions, partial rollouts, stop tokens, bad requests, concurrent load."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hcjax.model import add_weight_noise
from hcjax.rollout import (
    Engine,
    GenerateRequest,
    RolloutServer,
    SamplingOptions,
    ServerStopped,
    generate,
)
from hcjax.rollout.records import support_mask_from_record
from hcjax.rollout.request import request_from_dict
from tests.rollout_fixtures import tiny_model

PROMPTS = [[1, 5, 9, 3, 7, 2, 11, 4, 6, 8, 10, 12, 13], [3, 1, 4, 1, 5]]


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, max_concurrent_decodes=4, max_prefill_length=16, max_target_length=64)


@pytest.fixture(scope="module")
def full_forward(model):
    graphdef = nnx.graphdef(model)

    @jax.jit
    def fwd(state, tokens):  # fixed length 64: one compile; causal, so padding is harmless
        out = nnx.merge(graphdef, state)(tokens[None])
        return out.logits[0], jnp.stack(out.routing)[:, 0]

    return lambda tokens, state=None: fwd(
        nnx.state(model) if state is None else state,
        np.pad(np.asarray(tokens, np.int32), (0, 64 - len(tokens))),
    )


def _serve(engine, **kw):
    return RolloutServer(engine, **kw).start()


def test_greedy_cached_generation_equals_full_forward_argmax(engine, full_forward):
    with _serve(engine) as srv:
        handles = [
            srv.submit(GenerateRequest(prompt=p, max_tokens=20, temperature=0.0)) for p in PROMPTS
        ]
        records = [h.result(timeout=120)[0] for h in handles]
    for prompt, rec in zip(PROMPTS, records):
        seq = list(prompt)
        for _ in range(20):
            logits, _ = full_forward(seq)
            seq.append(int(np.argmax(np.asarray(logits[len(seq) - 1]))))
        assert rec.response_ids.tolist() == seq[len(prompt) :]
        assert rec.finish_reason == "length" and not rec.partial
        np.testing.assert_array_equal(rec.n_kept, 1)
        np.testing.assert_array_equal(rec.logprobs, 0.0)


def test_server_accepts_prompts_longer_than_max_prefill_length(engine, full_forward):
    """37 prompt tokens on an engine whose prefill chunk is 16: prefilled in 3 chunks, then
    decoded greedily as the full forward would."""
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 64, 37)]
    with _serve(engine) as srv:
        rec = srv.generate(GenerateRequest(prompt=prompt, max_tokens=8, temperature=0.0),
                           timeout=120)[0]
    seq = list(prompt)
    for _ in range(8):
        logits, _ = full_forward(seq)
        seq.append(int(np.argmax(np.asarray(logits[len(seq) - 1]))))
    assert rec.response_ids.tolist() == seq[37:]
    assert rec.routing.shape[1] == 37 + 8 - 1


def test_chunked_prefill_longer_than_max_prefill_length(engine, full_forward):
    prompt = list(np.random.default_rng(0).integers(0, 64, 37))  # 16 + 16 + 5 tokens
    prefix = engine.prefill(params=engine.load_params(), padded_tokens=prompt, true_length=37)
    logits, routing = full_forward(prompt)
    np.testing.assert_allclose(np.asarray(prefix.logits), np.asarray(logits[36]), atol=1e-4)
    np.testing.assert_array_equal(np.asarray(prefix.routing), np.asarray(routing[:, :37]))


def test_recorded_support_logprobs_routing_match_full_forward(engine, full_forward):
    temperature, top_p = 0.8, 0.9
    with _serve(engine) as srv:
        recs = srv.generate(
            GenerateRequest(prompt=PROMPTS[0], n=3, max_tokens=24, temperature=temperature,
                            top_p=top_p, seed=7),
            timeout=120,
        )
    for rec in recs:
        p, r = rec.prompt_len, rec.response_len
        seq = np.concatenate([rec.prompt_ids, rec.response_ids])
        logits, routing = full_forward(seq)
        logits = np.asarray(logits, np.float64)[p - 1 : p + r - 1]
        z = logits / temperature
        for t in range(r):
            order = sorted(range(z.shape[1]), key=lambda i, t=t: (-z[t, i], i))
            probs = np.exp(z[t] - z[t].max())
            probs /= probs.sum()
            mass_before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
            kept = [order[i] for i in range(len(order)) if mass_before[i] < top_p]
            assert rec.n_kept[t] == len(kept), t
            tok = rec.response_ids[t]
            assert tok in kept
            expected = np.log(probs[tok] / probs[kept].sum())
            np.testing.assert_allclose(rec.logprobs[t], expected, atol=1e-4)
            raw = logits[t] - logits[t].max()
            raw_lp = raw[tok] - np.log(np.exp(raw).sum())
            np.testing.assert_allclose(rec.raw_logprobs[t], raw_lp, atol=1e-4)
        # The learner's replay rebuilds exactly the kept sets from its own logits.
        mask = np.asarray(support_mask_from_record(jnp.asarray(z, jnp.float32), rec.n_kept))
        assert mask.sum() == rec.n_kept.sum()
        np.testing.assert_array_equal(rec.routing, np.asarray(routing[:, : p + r - 1]))
        np.testing.assert_array_equal(rec.versions, 0)


def test_bulk_insert_is_one_call_equal_to_inserting_slot_by_slot(engine):
    params = engine.load_params()
    sp = SamplingOptions(top_p=0.9, seed=7, max_tokens=10, stop_tokens=(2, 5))
    prefix = engine.prefill(params=params, padded_tokens=PROMPTS[1], true_length=5, sampling=sp)
    one = engine.init_decode_state()
    for slot, index in [(3, 0), (1, 1), (2, 5)]:
        one = engine.insert(prefix, one, slot, sample_index=index, max_tokens=6)
    bulk = engine.bulk_insert(prefix, engine.init_decode_state(), [3, 1, 2],
                              sample_indices=[0, 1, 5], max_tokens=6)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(one), jax.device_get(bulk))
    assert np.asarray(bulk.active).tolist() == [False, True, True, True]
    with pytest.raises(ValueError, match="slot=4"):
        engine.bulk_insert(prefix, bulk, [0, 4])
    with pytest.raises(ValueError, match="2 sample indices for 1 slots"):
        engine.bulk_insert(prefix, bulk, [0], sample_indices=[0, 1])


def test_generate_block_equals_single_steps(engine):
    """k steps in one call = k `generate` calls: every record field and the final state, with a
    stop token, a token limit and an idle slot inside the block; a shorter block of the same
    program gives the same first rows and invalid ones after."""
    params = engine.load_params()
    options = [([1, 5, 9, 3], SamplingOptions(temperature=0.8, top_p=0.9, seed=3, max_tokens=20,
                                              stop_tokens=(7, 11))),
               ([3, 1, 4], SamplingOptions(temperature=0.0, max_tokens=9)),
               ([2, 2], SamplingOptions(top_p=0.97, seed=1, max_tokens=30))]

    def fresh():
        state = engine.init_decode_state()
        for slot, (prompt, sp) in enumerate(options):
            prefix = engine.prefill(params=params, padded_tokens=prompt,
                                    true_length=len(prompt), sampling=sp)
            state = engine.insert(prefix, state, slot)
        return state

    state, singles = fresh(), []
    for _ in range(16):
        state, result = engine.generate(params, state)
        singles.append(jax.device_get(result))
    block_state, block = engine.generate_block(engine.flatten_params(params), fresh(), 16)
    block = jax.device_get(block)
    assert int(block.steps) == 16 and not block.valid[:, 3].any()
    assert block.done[:, 1].any() and block.valid[:, 1].sum() == 9  # its token limit, in-block
    for i, r in enumerate(singles):
        row = block.step(i)
        for name in ("tokens", "valid", "lengths", "logprobs", "raw_logprobs", "n_kept",
                     "threshold_logit", "routing", "positions", "versions", "done"):
            np.testing.assert_array_equal(row[name], np.asarray(getattr(r, name)), err_msg=name)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state),
                 jax.device_get(block_state))
    _, short = engine.generate_block(params, fresh(), 5, max_steps=16)
    short = jax.device_get(short)
    np.testing.assert_array_equal(short.tokens[:5], block.tokens[:5])
    assert not short.valid[5:].any()
    with pytest.raises(ValueError, match="steps=17"):
        engine.generate_block(params, fresh(), 17, max_steps=16)


def test_same_seed_same_tokens_and_bulk_insert_shares_one_prefill(engine):
    calls = []
    original = engine.prefill

    def counting_prefill(**kw):
        calls.append(kw["true_length"])
        return original(**kw)

    engine.prefill = counting_prefill
    try:
        with _serve(engine) as srv:
            req = GenerateRequest(prompt=PROMPTS[1], n=4, max_tokens=12, top_p=0.97, seed=3)
            a = srv.generate(req, timeout=120)
            b = srv.generate(req, timeout=120)
            c = srv.generate(GenerateRequest(prompt=PROMPTS[1], n=4, max_tokens=12, seed=4),
                             timeout=120)
    finally:
        del engine.prefill
    assert calls == [5, 5, 5]  # one prefill per request of 4 samples
    assert [x.response_ids.tolist() for x in a] == [x.response_ids.tolist() for x in b]
    assert [x.sample_index for x in a] == [0, 1, 2, 3]
    assert len({tuple(x.response_ids.tolist()) for x in a}) == 4  # the group's samples differ
    assert [x.response_ids.tolist() for x in a] != [x.response_ids.tolist() for x in c]


def test_weight_swap_mid_request_is_reflected_in_versions(engine, model):
    new_params = add_weight_noise(nnx.state(model), seed=99, scale=0.5)
    with _serve(engine, min_step_seconds=0.05, block_steps=8, min_block_steps=8) as srv:
        handle = srv.submit(GenerateRequest(prompt=PROMPTS[0], max_tokens=40, seed=1))
        seen = 0
        for _event in handle.events(timeout=120):
            seen += 1
            if seen == 5:
                srv.update_weights(new_params, version=1)
        rec = handle.result()[0]
        assert srv.metrics()["version"] == 1
    v = rec.versions
    assert v[0] == 0 and v[-1] == 1
    assert np.all(np.diff(v) >= 0)
    # The swap lands between blocks: tokens already streamed were drawn from version 0; a block's
    # first token is drawn from the logits of the block before it, so the first version-1 token
    # is the second of a block.
    assert np.all(v[:5] == 0)
    assert int(np.argmax(v == 1)) % 8 == 1, v


def test_partial_rollout_continued_equals_uninterrupted(engine):
    base = dict(prompt=PROMPTS[0], n=2, max_tokens=20, temperature=1.0, top_p=0.97, seed=11)
    with _serve(engine) as srv:
        full = srv.generate(GenerateRequest(**base), timeout=120)
        part = srv.generate(GenerateRequest(**base, token_budget=7), timeout=120)
        assert all(p.partial and p.response_len == 7 for p in part)
        mid = srv.generate(GenerateRequest.continuation(part, token_budget=6), timeout=120)
        assert all(m.partial and m.response_len == 13 for m in mid)
        done = srv.generate(GenerateRequest.continuation(mid), timeout=120)
    for f, d, p in zip(full, done, part):
        assert not d.partial and d.finish_reason == "length"
        assert d.response_ids.tolist() == f.response_ids.tolist()
        np.testing.assert_array_equal(d.response_ids[:7], p.response_ids)  # not regenerated
        np.testing.assert_array_equal(d.logprobs[:7], p.logprobs)
        np.testing.assert_allclose(d.logprobs, f.logprobs, atol=1e-4)
        np.testing.assert_allclose(d.raw_logprobs, f.raw_logprobs, atol=1e-4)
        np.testing.assert_array_equal(d.n_kept, f.n_kept)
        np.testing.assert_array_equal(d.routing, f.routing)


def test_stop_tokens_end_the_sample(engine):
    with _serve(engine) as srv:
        greedy = srv.generate(GenerateRequest(prompt=PROMPTS[0], max_tokens=20, temperature=0.0))
        stop = int(greedy[0].response_ids[3])
        first = greedy[0].response_ids.tolist().index(stop)
        rec = srv.generate(GenerateRequest(prompt=PROMPTS[0], max_tokens=20, temperature=0.0,
                                           stop_tokens=(stop,)))[0]
    assert rec.finish_reason == "stop"
    assert rec.response_ids.tolist() == greedy[0].response_ids[: first + 1].tolist()


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(prompt=[]), "prompt is empty"),
        (dict(prompt=[1] * 60, max_tokens=8), "prompt length 60 \\+ max_tokens 8"),
        (dict(prompt=[1, 2], max_tokens=0), "max_tokens=0"),
        (dict(prompt=[1, 2], n=0), "n=0"),
        (dict(prompt=[1, 2], n=-2), "n=-2"),
        (dict(prompt=[1, 2], top_k=5), "unknown request options"),
        (dict(prompt=[1, 2], top_p=1.5), "top_p=1.5"),
        (dict(prompt=[1, 2], temperature=-1.0), "temperature=-1.0"),
        (dict(prompt=[1, 99], max_tokens=4), "vocab_size=64"),
        (dict(prompt=[1, 2], max_tokens=63), "max_target_length=64"),
        (dict(prompt=[1, 2], max_tokens=4, stop_tokens=list(range(9))), "max_stop_tokens=8"),
    ],
)
def test_bad_requests_get_clear_errors(engine, options, message):
    with _serve(engine) as srv:
        with pytest.raises(ValueError, match=message):
            srv.submit(request_from_dict(options))
        assert srv.generate(GenerateRequest(prompt=[1, 2], max_tokens=2), timeout=120)


def test_cancel_frees_slots(engine):
    with _serve(engine, min_step_seconds=0.01) as srv:
        h = srv.submit(GenerateRequest(prompt=PROMPTS[0], n=4, max_tokens=40))
        next(h.events(timeout=120))
        h.cancel()
        with pytest.raises(ServerStopped, match="cancelled"):
            h.result(timeout=60)
        # All four slots come back: a new full-width request completes.
        assert len(srv.generate(GenerateRequest(prompt=PROMPTS[1], n=4, max_tokens=3),
                                timeout=120)) == 4


@pytest.mark.slow
def test_hundreds_of_concurrent_requests_complete(engine):
    rng = np.random.default_rng(0)
    with _serve(engine, max_queue=16) as srv:
        results, errors = {}, []

        def client(worker):
            try:
                for i in range(worker, 240, 8):
                    n = int(rng.integers(1, 3))
                    req = GenerateRequest(prompt=PROMPTS[i % 2], n=n,
                                          max_tokens=int(rng.integers(1, 8)), seed=i)
                    results[i] = (req, srv.generate(req, timeout=300))
            except Exception as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=client, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        metrics = srv.metrics()
    assert not errors and len(results) == 240
    for req, recs in results.values():
        assert len(recs) == req.n
        assert all(1 <= r.response_len <= req.max_tokens for r in recs)
    assert metrics["tokens_total"] == sum(r.response_len for _, rs in results.values() for r in rs)


def test_offline_generate_matches_server(engine):
    recs = generate(None, PROMPTS, SamplingOptions(max_tokens=6, temperature=0.0), n=2,
                    engine=engine)
    assert [r.group_id for r in recs] == [0, 0, 1, 1]
    with _serve(engine) as srv:
        served = srv.generate(GenerateRequest(prompt=PROMPTS[1], max_tokens=6, temperature=0.0))
    assert recs[2].response_ids.tolist() == served[0].response_ids.tolist()
    assert recs[2].routing.shape == (2, 5 + 6 - 1, 2)
    assert recs[2].raw_logprobs.shape == (6,)
    assert recs[2].tokens is recs[2].response_ids


@pytest.mark.slow
def test_engine_on_an_inference_mesh_matches_default_device(engine):
    from hcjax.model import create_sharded
    from hcjax.sharding import MeshConfig, make_mesh
    from tests.rollout_fixtures import TINY_TEST_CONFIG

    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2, device_offset=4, num_devices=4))
    sharded = create_sharded(TINY_TEST_CONFIG, mesh, seed=0)
    nnx.update(sharded, add_weight_noise(nnx.state(sharded), 1))
    meshed = Engine(sharded, mesh=mesh, max_concurrent_decodes=2, max_prefill_length=16,
                    max_target_length=64)
    def run(eng):  # two prompts of one bucket, waiting together: one batched prefill call
        srv = RolloutServer(eng)
        handles = [srv.submit(GenerateRequest(prompt=p, max_tokens=8, temperature=0.0))
                   for p in (PROMPTS[1], [2, 9, 4])]
        with srv.start():
            tokens = [h.result(timeout=120)[0].response_ids.tolist() for h in handles]
            return tokens, srv.metrics()["prefill_calls"]

    got, calls = run(meshed)
    assert got == run(engine)[0] and calls == 1


def test_a_failing_prefill_fails_only_its_request(engine):
    def broken(**kw):
        raise RuntimeError("simulated device error")

    with _serve(engine) as srv:
        engine.prefill = broken
        try:
            handle = srv.submit(GenerateRequest(prompt=[1, 2], max_tokens=2))
            with pytest.raises(ServerStopped, match="simulated device error"):
                handle.result(timeout=60)
        finally:
            del engine.prefill  # back to the class method
        assert srv.health()["ok"]
        assert srv.generate(GenerateRequest(prompt=[1, 2], max_tokens=2), timeout=60)


# Several prompts per prefill call ---------------------------------------------------------
MIXED = [[1, 5, 9, 3, 7, 2, 11, 4, 6, 8, 10, 12, 13], [3, 1, 4, 1, 5], [7] * 9, [2, 9, 4],
         list(range(1, 31))]  # 13, 5, 9 and 3 tokens in buckets 16 and 8; 30 > max_prefill_length


def _assert_same_prefix(got, want):
    assert (got.length, got.tokens, got.sampling, got.version) == (
        want.length, want.tokens, want.sampling, want.version)
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), atol=1e-5)
    np.testing.assert_array_equal(got.routing, want.routing)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5),
                 got.cache, want.cache)


def test_bulk_prefill_equals_each_prompt_prefilled_alone(engine):
    """Four prompts of 3-13 tokens in one call (rows of 16 tokens), the 30-token one alone in
    chunks: each Prefix is the lone prefill's (cache entries, logits, routing), and decoding
    from them gives the same greedy and sampled tokens."""
    params = engine.load_params()
    options = [SamplingOptions(max_tokens=12, temperature=t, top_p=0.9, seed=i)
               for i, t in enumerate([0.0, 1.0, 0.0, 1.0, 1.0])]
    alone = [engine.prefill(params=params, padded_tokens=p, true_length=len(p), sampling=o)
             for p, o in zip(MIXED, options)]
    before = engine.prefill_stats()
    bulk = engine.bulk_prefill(params=params, prompts=MIXED, samplings=options)
    after = engine.prefill_stats()
    assert after["prefills"] - before["prefills"] == 5
    assert after["prompt_tokens"] - before["prompt_tokens"] == sum(map(len, MIXED))
    for got, want in zip(bulk, alone, strict=True):
        _assert_same_prefix(got, want)

    def decode(prefixes):
        state = engine.init_decode_state()
        for slot, prefix in enumerate(prefixes[:4]):
            state = engine.bulk_insert(prefix, state, [slot])
        _, block = engine.generate_block(params, state, 12, max_steps=16)  # the server's
        return jax.device_get(block)

    got, want = decode(bulk), decode(alone)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.routing, want.routing)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
    assert len(set(map(tuple, got.tokens.T.tolist()))) == 4  # four different continuations


def test_bulk_prefill_errors_name_the_prompt(engine):
    params = engine.load_params()
    with pytest.raises(ValueError, match=r"prompts\[1\]: token id 64 is not in \[0, vocab"):
        engine.bulk_prefill(params=params, prompts=[[1, 2], [3, 64]])
    with pytest.raises(ValueError, match="1 sampling options for 2 prompts"):
        engine.bulk_prefill(params=params, prompts=[[1, 2], [3]], samplings=[None])
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=f"prefill_batch={bad!r} must be a positive"):
            RolloutServer(engine, prefill_batch=bad)


def _mixed_records(engine, prefill_batch):
    """MIXED as greedy and sampled requests, queued before the server starts (so the prefill
    thread finds them waiting together)."""
    srv = RolloutServer(engine, prefill_batch=prefill_batch)
    handles = [srv.submit(GenerateRequest(prompt=p, n=1 + i % 2, max_tokens=10,
                                          temperature=[0.0, 1.0][i % 2], top_p=0.9, seed=i))
               for i, p in enumerate(MIXED * 2)]
    with srv.start():
        records = [h.result(timeout=120) for h in handles]
    return records, srv.metrics()


@pytest.mark.parametrize("layout", ["slot", pytest.param("paged", marks=pytest.mark.slow)])
def test_server_prefill_batch_gives_the_records_of_prompts_prefilled_alone(engine, model, layout):
    """10 mixed greedy and sampled requests (n = 1 or 2) of 3-30 tokens waiting together:
    prefill_batch=4 prefills them in fewer calls and gives prefill_batch=1's records; the paged
    layout (~14 s: its own engine's programs) inserts the batched prefixes alike."""
    eng = engine if layout == "slot" else Engine(
        model, max_concurrent_decodes=4, max_prefill_length=16, max_target_length=64,
        kv_layout="paged", page_size=8)
    want, alone = _mixed_records(eng, 1)
    got, batched = _mixed_records(eng, 4)
    assert alone["prefill_calls"] == alone["prefilled_prompts"] == 10
    # Buckets 16 (13, 9 tokens), 8 (5, 3) and the 30-token prompt alone, in fair order.
    assert batched["prefilled_prompts"] == 10 and batched["prefill_calls"] < 10
    for got_recs, want_recs in zip(got, want, strict=True):
        for g, w in zip(got_recs, want_recs, strict=True):
            assert g.response_ids.tolist() == w.response_ids.tolist()
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
            np.testing.assert_allclose(g.raw_logprobs, w.raw_logprobs, atol=1e-5)
            np.testing.assert_array_equal(g.n_kept, w.n_kept)
            np.testing.assert_array_equal(g.routing, w.routing)
    if layout == "paged":
        assert eng.page_stats()["in_use"] == 0


def test_a_failing_batched_prefill_falls_back_to_prompts_alone(engine):
    """The batched call fails (a device error): each prompt is prefilled alone, and only the
    request whose own prefill fails fails, with its error."""
    real = engine.prefill

    def bulk(**kw):
        raise RuntimeError("simulated device error")

    def alone(**kw):
        if kw["padded_tokens"][0] == 63:
            raise RuntimeError("bad prompt")
        return real(**kw)

    engine.bulk_prefill, engine.prefill = bulk, alone
    try:
        srv = RolloutServer(engine, prefill_batch=4)
        prompts = [[1, 2, 3], [63, 2], [4, 5, 6, 7]]
        handles = [srv.submit(GenerateRequest(prompt=p, max_tokens=3, temperature=0.0))
                   for p in prompts]
        with srv.start():
            with pytest.raises(ServerStopped, match="bad prompt"):
                handles[1].result(timeout=60)
            ok = [handles[0].result(timeout=60), handles[2].result(timeout=60)]
            assert srv.health()["ok"]
    finally:
        del engine.bulk_prefill, engine.prefill  # back to the class methods
    for h, recs in zip([handles[0], handles[2]], ok):
        want = generate(None, [h.request.prompt], SamplingOptions(max_tokens=3, temperature=0.0),
                        engine=engine)[0]
        assert recs[0].response_ids.tolist() == want.response_ids.tolist()
