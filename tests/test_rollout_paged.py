"""The engine's paged KV layout (kv_layout="paged") against the slot layout on the tiny model:
the same tokens and log-probs (scanned layers, the paged Pallas kernel in interpret mode, an
inference mesh), pages taken as sequences grow and given back, admission by pages free, and
clear errors. The five model families are covered in test_families.py."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from hcjax.model import Transformer, add_weight_noise
from hcjax.rollout import Engine, SamplingOptions, generate
from tests.rollout_fixtures import TINY_TEST_CONFIG

# The engines' sampler: its sort-only setting (bit-identical, compiles in a third of the time).
pytestmark = pytest.mark.usefixtures("sort_only_sampler")
PROMPTS = [[1, 5, 9, 3, 7, 2, 11, 4, 6, 8, 10, 12, 13], [3, 1, 4, 1, 5], [7] * 9]
OPTIONS = SamplingOptions(max_tokens=20, temperature=0.9, top_p=0.8, seed=4)


def _model(**changes):
    model = Transformer(dataclasses.replace(TINY_TEST_CONFIG, **changes), rngs=nnx.Rngs(0))
    nnx.update(model, add_weight_noise(nnx.state(model), 1))
    return model


def _engine(model, max_target_length=64, **kw):
    return Engine(model, max_concurrent_decodes=4, max_prefill_length=16,
                  max_target_length=max_target_length, **kw)


def _rollouts(engine, options=OPTIONS):
    recs = generate(None, PROMPTS, options, n=2, engine=engine)  # 6 samples on 4 slots
    return [(r.response_ids.tolist(), np.asarray(r.logprobs)) for r in recs]


def _assert_same(got, want):
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5)


@pytest.mark.slow
def test_paged_equals_slot_layout_while_sequences_wait_for_pages():
    """Scanned layers (stacked [layers, pages, ...] pools); 6 samples of up to 33 tokens on 4
    slots, pages of 4 from a pool of 16 (a sequence may grow to 10): two are admitted at a
    time, and as they grow one waits (paused) for pages the other gives back."""
    model = _model(scan_layers=True)
    want = _rollouts(_engine(model, max_target_length=40))
    paged = _engine(model, max_target_length=40, kv_layout="paged", page_size=4, num_pages=17)
    assert paged.num_free_slots == 2
    _assert_same(_rollouts(paged), want)
    stats = paged.page_stats()
    assert stats["waits"] > 0 and stats["in_use"] == 0 and stats["free"] == 16


@pytest.mark.slow
def test_paged_kernel_equals_slot_kernel():
    """Decode on the Pallas kernels (interpret mode): the paged one against the slot one."""
    model = _model(attention_impl="pallas")
    want = _rollouts(_engine(model))
    _assert_same(_rollouts(_engine(model, kv_layout="paged", page_size=16, num_pages=13)), want)


@pytest.mark.slow
def test_paged_on_an_inference_mesh():
    """Decode batch split two ways: each shard's slots take pages of its half of the pool."""
    from hcjax.model import create_sharded
    from hcjax.sharding import MeshConfig, make_mesh

    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2, device_offset=4, num_devices=4))
    sharded = create_sharded(TINY_TEST_CONFIG, mesh, seed=0)
    kw = dict(max_concurrent_decodes=4, max_prefill_length=16, max_target_length=64)
    want = _rollouts(Engine(sharded, **kw))
    paged = Engine(sharded, mesh=mesh, kv_layout="paged", page_size=8, num_pages=24, **kw)
    _assert_same(_rollouts(paged), want)
    pool = paged.init_decode_state().cache[1]["k"]  # layer 1 is global
    assert pool.sharding.spec[0] in ("fsdp", ("fsdp",)) and pool.sharding.spec[2] == "tensor"


def test_pages_follow_length_and_admission_counts_pages():
    model = _model()
    eng = _engine(model, kv_layout="paged", page_size=8, num_pages=9)  # 8 usable pages
    # A new sequence is counted at a 16-token prompt (2 pages) that may grow to 64 tokens (8
    # pages): one can be admitted and still finish whatever the others do.
    assert eng.num_free_slots == 1
    state = eng.init_decode_state()
    prefix = eng.prefill(params=eng.load_params(), padded_tokens=PROMPTS[1], true_length=5,
                         sampling=SamplingOptions(max_tokens=12, temperature=0.0))
    slots = eng.allocate_slots(2)
    state = eng.bulk_insert(prefix, state, slots)
    assert eng.page_stats()["in_use"] == 2  # one page each for 5 prompt tokens
    for _ in range(3):  # positions 5, 6, 7 fed: still the first page
        state, _ = eng.generate(eng.load_params(), state)
    assert eng.page_stats()["in_use"] == 2
    state, _ = eng.generate(eng.load_params(), state)  # position 8: a second page each
    assert eng.page_stats()["in_use"] == 4
    for _ in range(20):  # the budget (12 tokens, last fed at position 16) caps the pages
        state, _ = eng.generate(eng.load_params(), state)
    assert eng.page_stats()["in_use"] == 6
    for slot in slots:
        eng.free_resource(slot)
    assert eng.page_stats()["in_use"] == 0 and eng.num_free_slots == 1
    # A 13-token prompt in two slots: its full page is shared, each has its own second page.
    prefix = eng.prefill(params=eng.load_params(), padded_tokens=PROMPTS[0], true_length=13,
                         sampling=SamplingOptions(max_tokens=4, temperature=0.0))
    slots = eng.allocate_slots(2)
    state = eng.bulk_insert(prefix, state, slots)
    pages = [eng._kv.pool.owned[s] for s in slots]
    assert pages[0][0] == pages[1][0] and pages[0][1] != pages[1][1]
    assert eng.page_stats()["in_use"] == 3
    tokens = []
    for _ in range(4):  # position 16 takes a third page each
        state, result = eng.generate(eng.load_params(), state)
        tokens.append(np.asarray(result.tokens)[slots])
    assert eng.page_stats()["in_use"] == 5
    np.testing.assert_array_equal(*np.stack(tokens).T)  # greedy: both slots alike
    eng.free_resource(slots[0])
    assert eng.page_stats()["in_use"] == 3  # the shared page stays with the other slot
    eng.free_resource(slots[1])
    assert eng.page_stats()["in_use"] == 0


def test_unsafe_admission_and_bad_options_raise_clear_errors():
    model = _model()
    eng = _engine(model, kv_layout="paged", page_size=4, num_pages=4)  # 3 usable pages
    state = eng.init_decode_state()
    prefix = eng.prefill(params=eng.load_params(), padded_tokens=PROMPTS[0], true_length=13,
                         sampling=SamplingOptions(max_tokens=20, temperature=0.0))
    with pytest.raises(RuntimeError, match="4 pages needed for 1 x a 13-token prompt, 3 free"):
        eng.insert(prefix, state, 0)
    short = eng.prefill(params=eng.load_params(), padded_tokens=PROMPTS[1], true_length=5,
                        sampling=SamplingOptions(max_tokens=20, temperature=0.0))
    with pytest.raises(RuntimeError, match="could leave shard 0 without pages"):
        eng.insert(short, state, 0)  # 5 + 20 tokens may need 7 pages
    with pytest.raises(ValueError, match="kv_layout='pages'"):
        _engine(model, kv_layout="pages")
    with pytest.raises(ValueError, match="num_pages=1 "):
        _engine(model, kv_layout="paged", num_pages=1)
    with pytest.raises(ValueError, match="page_size=0 "):
        _engine(model, kv_layout="paged", page_size=0)


@pytest.mark.slow
def test_paged_kernel_on_local_shards_under_a_mesh():
    """With the mesh in context (as the planner compiles it), the paged kernel runs per shard
    on local page ids: slots 1 and 3 sit in different batch shards and take pages from
    different halves of the pool; their tokens equal the slot layout's under the same mesh."""
    import jax

    from hcjax.model import create_sharded
    from hcjax.sharding import MeshConfig, make_mesh

    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2, device_offset=4, num_devices=4))
    sharded = create_sharded(dataclasses.replace(TINY_TEST_CONFIG, attention_impl="pallas"),
                             mesh, seed=0)

    def tokens(**kw):
        eng = Engine(sharded, mesh=mesh, max_concurrent_decodes=4, max_prefill_length=16,
                     max_target_length=64, **kw)
        params = eng.load_params()
        with jax.set_mesh(mesh):
            state = eng.init_decode_state()
            prefix = eng.prefill(params=params, padded_tokens=PROMPTS[0], true_length=13,
                                 sampling=SamplingOptions(max_tokens=20, temperature=0.0))
            state = eng.bulk_insert(prefix, state, [1, 3])
            out = []
            for _ in range(12):  # positions 13..24: each slot crosses into a second page
                state, result = eng.generate(params, state)
                out.append(np.asarray(result.tokens)[[1, 3]])
        return np.stack(out), eng

    want, _ = tokens()
    got, paged = tokens(kv_layout="paged", page_size=16, num_pages=18)
    assert paged._kv.pool.owned[3][0] >= 9  # shard 1's half of the pool
    np.testing.assert_array_equal(got, want)


def _prefill(eng, prompt, max_tokens=6):
    return eng.prefill(params=eng.load_params(), padded_tokens=prompt, true_length=len(prompt),
                       sampling=SamplingOptions(max_tokens=max_tokens, temperature=0.0))


def _greedy(eng, state, slots, steps=6):
    out = []
    for _ in range(steps):
        state, result = eng.generate(eng.load_params(), state)
        out.append(np.asarray(result.tokens)[slots])
    return state, np.stack(out)


def test_prefix_cache_blocks_are_shared_pages():
    """With prefix reuse, a prompt page that holds a cached block is mapped by every later
    prompt starting with it (not taken and written again), stays cached when no sequence holds
    it, and is taken back when the free list runs out; tokens equal the slot layout's with the
    same prefix cache."""
    model = _model()
    head = [1, 5, 9, 3, 7, 2, 11, 4]  # two blocks of 4
    a, b, c = head + [6, 8, 10], head + [12, 13, 3, 1, 4], [7] * 27
    kw = dict(prefix_cache_blocks=64, prefix_block_size=4)

    def run(eng, shared_pages):
        state = eng.init_decode_state()
        assert eng.allocate_slots(4) == [0, 1, 2, 3]
        pa, pb = _prefill(eng, a), _prefill(eng, b)
        assert pa.blocks and pb.blocks[:2] == pa.blocks  # b's chain is a's two blocks, exact
        state = eng.insert(pa, state, 0)
        state = eng.bulk_insert(pb, state, [1, 2])
        if shared_pages:
            pool = eng._kv.pool
            assert pool.owned[1][:2] == pool.owned[0][:2] == pool.owned[2][:2]
            head_pages = pool.owned[0][:2]
            # a: 2 cached + 1 partial; b (two samples): its third block + a partial page each
            assert eng.page_stats()["in_use"] == 3 + 1 + 2
            assert eng.page_stats()["shared"] == 2 and eng.page_stats()["cached"] == 3
        state, first = _greedy(eng, state, [0, 1, 2])
        for slot in (0, 1, 2):
            state = eng.deactivate(state, slot)
            eng.free_resource(slot)
        if shared_pages:
            stats = eng.page_stats()
            assert stats["in_use"] == 0 and stats["idle_cached"] == 3
        # The head again, after every sequence holding it finished: the idle pages come back.
        pc = _prefill(eng, head + [9, 9])
        state = eng.insert(pc, state, 3)
        if shared_pages:
            assert eng.page_stats()["shared"] == 4 and pool.owned[3][:2] == head_pages
        state, second = _greedy(eng, state, [3])
        state = eng.deactivate(state, 3)
        eng.free_resource(3)
        assert eng.allocate_slots(1) == [0]
        # A prompt sharing nothing in a nearly full pool: idle cached pages are taken back.
        state = eng.insert(_prefill(eng, c, max_tokens=3), state, 0)
        state, third = _greedy(eng, state, [0], steps=3)
        if shared_pages:
            assert eng.page_stats()["reclaimed"] > 0
        return first, second, third

    want = run(_engine(model, **kw), shared_pages=False)
    got = run(_engine(model, kv_layout="paged", page_size=4, num_pages=10, **kw),
              shared_pages=True)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="prefix_block_size=8 must equal page_size=4"):
        _engine(model, kv_layout="paged", page_size=4, prefix_cache_blocks=8, prefix_block_size=8)
