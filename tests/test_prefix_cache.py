"""Prefix reuse: the block store (lookup, sharing, eviction, versions) and the engine with and
without reuse giving the same prefills and the same multi-turn rollouts (window 8: the local
layers' ring buffers wrap inside reused prefixes)."""

import jax
import numpy as np
import pytest

from hcjax.rollout import Engine, GenerateRequest, RolloutServer
from hcjax.rollout.engine_api import VersionedParams
from hcjax.rollout.prefix_cache import PrefixCache
from tests.rollout_fixtures import tiny_model

# The engines here test serving, not the sampler: its sort-only setting (bit-identical draws,
# a third of the compile; tests/conftest.py).
pytestmark = pytest.mark.usefixtures("sort_only_sampler")


def _payload(i):
    return (f"kv{i}", np.full((2, 4, 2), i, np.int32))


def test_block_store_lookup_extend_share_and_limit():
    store = PrefixCache(block_size=4, max_blocks=100)
    a = list(range(10))  # two whole blocks + 2 tokens
    assert store.lookup(a, version=0, limit=9) == []
    stored = store.extend(a, 0, [], [_payload(0), _payload(1)])
    assert [b.kv for b in store.lookup(a, 0, limit=9)] == ["kv0", "kv1"]
    assert [b.kv for b in store.lookup(a, 0, limit=7)] == ["kv0"]  # limit caps the match
    b = a[:4] + [99, 98, 97, 96]  # shares the first block only
    chain = store.lookup(b, 0, limit=8)
    assert chain == stored[:1]
    store.extend(b, 0, chain, [_payload(2)])
    assert len(store) == 3  # the shared head is stored once
    assert store.lookup(a, 1, limit=9) == []  # other weights: no reuse
    with pytest.raises(ValueError, match="2 blocks given but tokens hold 1"):
        store.extend(list(range(6)), 1, [], [_payload(0), _payload(1)])


def test_block_store_evicts_tails_first_and_drops_old_versions():
    store = PrefixCache(block_size=2, max_blocks=3)
    head = [7, 7]
    store.extend(head + [1, 1], 0, [], [_payload(0), _payload(1)])
    store.lookup(head + [1, 1], 0, limit=4)
    store.extend(head + [2, 2], 0, store.lookup(head + [2, 2], 0, limit=4), [_payload(2)])
    store.extend(head + [3, 3], 0, store.lookup(head + [3, 3], 0, limit=4), [_payload(3)])
    assert len(store) == 3 and store.evicted == 1
    assert len(store.lookup(head, 0, limit=2)) == 1  # the shared head survived
    assert len(store.lookup(head + [1, 1], 0, limit=4)) == 1  # the oldest tail went
    store.lookup(head, 5, limit=2)  # newer weights make every older block useless
    assert len(store) == 0
    with pytest.raises(ValueError, match="max_blocks=0"):
        PrefixCache(block_size=2, max_blocks=0)


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


def _engine(model, blocks):
    return Engine(model, max_concurrent_decodes=4, max_prefill_length=40, max_target_length=64,
                  prefix_cache_blocks=blocks, prefix_block_size=4)


@pytest.fixture(scope="module")
def plain(model):
    return _engine(model, 0)


@pytest.fixture(scope="module")
def reusing(model):
    return _engine(model, 64)


def _assert_same_prefix(a, b):
    assert a.length == b.length and a.tokens == b.tokens
    np.testing.assert_allclose(np.asarray(a.logits), np.asarray(b.logits), atol=1e-5)
    np.testing.assert_array_equal(a.routing, b.routing)
    for x, y in zip(jax.tree.leaves(a.cache), jax.tree.leaves(b.cache)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)


def test_reused_prefill_equals_full_prefill(plain, reusing):
    rng = np.random.default_rng(1)
    history = rng.integers(0, 64, 21).tolist()
    params = reusing.load_params()
    reusing.prefill(params=params, padded_tokens=history, true_length=21)
    before = reusing.prefill_stats()
    longer = history + rng.integers(0, 64, 14).tolist()  # 35 tokens: 5 blocks reused, 15 new
    got = reusing.prefill(params=params, padded_tokens=longer, true_length=35)
    after = reusing.prefill_stats()
    assert after["reused_tokens"] - before["reused_tokens"] == 20
    assert after["computed_tokens"] - before["computed_tokens"] == 15
    _assert_same_prefix(got, plain.prefill(params=params, padded_tokens=longer, true_length=35))
    # A block-aligned repeat still computes its last token (the logits come from it).
    again = reusing.prefill(params=params, padded_tokens=longer[:32], true_length=32)
    _assert_same_prefix(again, plain.prefill(params=params, padded_tokens=longer[:32],
                                             true_length=32))
    # Other weights never see these blocks.
    stats = reusing.prefill_stats()
    reusing.prefill(params=VersionedParams(params, 3), padded_tokens=longer, true_length=35)
    assert reusing.prefill_stats()["reused_tokens"] == stats["reused_tokens"]


def test_bulk_prefill_reuses_blocks_per_row(plain, reusing):
    """One batched call whose rows reuse 2, 4 and 0 blocks (each row starts where its hit ends):
    every Prefix equals the plain prefill, and the blocks it computed are stored for reuse."""
    rng = np.random.default_rng(2)
    head = rng.integers(0, 64, 16).tolist()
    params = reusing.load_params()
    reusing.prefill(params=params, padded_tokens=head, true_length=16)  # 4 blocks of 4
    prompts = [head[:8] + rng.integers(0, 64, 6).tolist(), head + rng.integers(0, 64, 5).tolist(),
               rng.integers(0, 64, 9).tolist()]
    before = reusing.prefill_stats()
    got = reusing.bulk_prefill(params=params, prompts=prompts)
    after = reusing.prefill_stats()
    assert after["reused_tokens"] - before["reused_tokens"] == 8 + 16
    assert after["computed_tokens"] - before["computed_tokens"] == 6 + 5 + 9
    for prefix, prompt in zip(got, prompts, strict=True):
        _assert_same_prefix(prefix, plain.prefill(params=params, padded_tokens=prompt,
                                                  true_length=len(prompt)))
    longer = prompts[1] + [1, 2, 3, 4]  # its fifth block came from the batched call
    reusing.prefill(params=params, padded_tokens=longer, true_length=len(longer))
    assert reusing.prefill_stats()["reused_tokens"] - after["reused_tokens"] == 20


def test_existing_prefix_appends_tokens(plain, reusing):
    params = plain.load_params()
    head = plain.prefill(params=params, padded_tokens=[5, 6, 7, 8, 9, 10], true_length=6)
    for eng in (plain, reusing):
        joined = eng.prefill(params=params, existing_prefix=head, padded_tokens=[11, 12, 0],
                             true_length=2)
        _assert_same_prefix(joined, plain.prefill(params=params,
                                                  padded_tokens=[5, 6, 7, 8, 9, 10, 11, 12],
                                                  true_length=8))


def _episodes(eng, n_episodes=3, turns=4, seed=0):
    """ReAct-style: each turn's prompt = previous prompt + response + a new observation."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 64, 9).tolist()
    prompts = [system + rng.integers(0, 64, 3).tolist() for _ in range(n_episodes)]
    out = []
    with RolloutServer(eng) as srv:
        for _ in range(turns):
            reqs = [GenerateRequest(prompt=p, max_tokens=4, temperature=t, seed=i)
                    for i, (p, t) in enumerate(zip(prompts, [0.0, 1.0, 1.0]))]
            recs = [h.result(timeout=120)[0] for h in [srv.submit(r) for r in reqs]]
            out.append(recs)
            prompts = [p + r.response_ids.tolist() + rng.integers(0, 64, 3).tolist()
                       for p, r in zip(prompts, recs)]
    return out


def test_multi_turn_rollouts_unchanged_by_reuse(plain, reusing):
    start = reusing.prefill_stats()
    want, got = _episodes(plain), _episodes(reusing)
    for turn_want, turn_got in zip(want, got):
        for w, g in zip(turn_want, turn_got):
            assert g.response_ids.tolist() == w.response_ids.tolist()
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)
            np.testing.assert_allclose(g.raw_logprobs, w.raw_logprobs, atol=1e-4)
            np.testing.assert_array_equal(g.n_kept, w.n_kept)
            np.testing.assert_array_equal(g.routing, w.routing)
    stats = reusing.prefill_stats()
    reused = stats["reused_tokens"] - start["reused_tokens"]
    computed = stats["computed_tokens"] - start["computed_tokens"]
    assert reused > computed  # the shared system prompt and each episode's history
    assert len(reusing.prefix_cache) <= reusing.prefix_cache.max_blocks


def test_multi_turn_rollouts_on_shared_pages(model, plain):
    """The same episodes on the paged layout with reuse: each turn's history maps the pages its
    cached blocks hold (the system prompt's, the earlier turns') instead of writing them again."""
    paged = Engine(model, max_concurrent_decodes=4, max_prefill_length=40, max_target_length=64,
                   prefix_cache_blocks=64, prefix_block_size=4, kv_layout="paged", page_size=4)
    want, got = _episodes(plain), _episodes(paged)
    for turn_want, turn_got in zip(want, got):
        for w, g in zip(turn_want, turn_got):
            assert g.response_ids.tolist() == w.response_ids.tolist()
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)
            np.testing.assert_array_equal(g.routing, w.routing)
    stats = paged.page_stats()
    assert stats["shared"] > 0 and stats["in_use"] == 0 and stats["cached"] > 0
