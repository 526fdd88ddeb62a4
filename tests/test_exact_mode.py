"""Exact mode (ModelConfig.batch_invariant): the learner's log-prob of every sampled token equals
the engine's recorded one to the bit, on the tiny model and every family fixture, in fp32 and in
bf16 (sampler and learner both), greedy and sampled (top-p replayed), with routing replay, under
continuous batching of requests of different lengths, slot and paged KV layouts, prefix reuse on
and off. The default mode is left as it was (its gaps are small but not zero)."""

import dataclasses
import functools

import gin
import jax
import numpy as np
import pytest
from flax import nnx

from hcjax import config as hcfg
from hcjax.model import ModelConfig, Transformer, hf
from hcjax.rl.batch import pack_rollouts
from hcjax.rl.mismatch import logprob_gaps
from hcjax.rollout import Engine, generate
from hcjax.rollout.records import Rollout
from hcjax.rollout.request import SamplingOptions
from tests.hf_fixtures import FAMILIES, fixture, golden
from tests.rollout_fixtures import tiny_model

pytestmark = pytest.mark.usefixtures("sort_only_sampler")
SAMPLED = SamplingOptions(max_tokens=6, temperature=0.9, top_p=0.8, seed=7)
GREEDY = SamplingOptions(max_tokens=6, temperature=0.0)


def _exact(model: Transformer, dtype: str, exact: bool = True) -> Transformer:
    """`model`'s weights under its config with batch_invariant=exact and compute dtype `dtype`."""
    cfg = dataclasses.replace(model.config, batch_invariant=exact, dtype=dtype)
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[0]
    return nnx.merge(graphdef, nnx.state(model))


@functools.cache
def _tiny() -> Transformer:
    """The climb's tiny model (configs/tiny_cpu.gin), its weights given noise so the sampled
    tokens depend on the context."""
    hcfg.bind(["tiny_cpu.gin"], [])
    cfg = ModelConfig()
    gin.clear_config()
    return tiny_model(3, cfg)


def _gaps(model, engine, prompts) -> np.ndarray:
    """Δ over every token of `prompts` sampled twice, then once greedily, through `engine`."""
    records = []
    for options, n in ((SAMPLED, 2), (GREEDY, 1)):
        records += generate(None, prompts, options, n=n, engine=engine)
    assert any(r.n_kept is not None and (np.asarray(r.n_kept) > 1).any() for r in records)
    return logprob_gaps(model, records)


def _prompts(vocab: int, lengths, shared: int = 0, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    head = rng.integers(1, vocab, shared).tolist()
    return [head + rng.integers(1, vocab, n - shared).tolist() for n in lengths]


# Continuous batching: 4 prompts x 2 samples on 3 slots, prompts of 9 to 16 tokens (one
# prefill bucket: one compile).
LENGTHS = (9, 16, 11, 14)


@pytest.mark.parametrize("dtype,layout", [("float32", "slot"), ("bfloat16", "paged")])
def test_tiny_models_learner_logprobs_equal_the_engines_bit_for_bit(dtype, layout):
    """fp32 on the slot layout: the climb's tiny model, reusing prefixes (prompts sharing a
    16-token head: the first ones prefill it, later ones take it from the cache). bf16 on the
    paged layout: TINY_TEST_CONFIG, whose local layers see 8 keys (prompts and responses run
    well past them: the default mode's ring buffer would wrap; exact mode keeps every key at its
    position), every prompt prefilled whole. (Each family below runs both dtypes, one layout
    each.)"""
    reuse = layout == "slot"
    model = _exact(_tiny() if reuse else tiny_model(1), dtype)
    engine = Engine(model, max_concurrent_decodes=3, max_prefill_length=24, max_target_length=40,
                    kv_layout=layout, page_size=8, prefix_cache_blocks=8 if reuse else 0,
                    prefix_block_size=8)
    lengths = (20, 23, 18, 21) if reuse else LENGTHS
    gaps = _gaps(model, engine, _prompts(model.config.vocab_size, lengths, 16 if reuse else 0))
    if reuse:
        assert engine.prefill_stats()["reused_tokens"] > 0
    assert gaps.size > 50 and np.max(np.abs(gaps)) == 0.0


def test_default_mode_is_close_but_not_bit_equal():
    """The same weights and requests in the default mode: gaps are rounding-sized, so exact
    mode is what makes them zero."""
    base = _tiny()
    engine = Engine(base, max_concurrent_decodes=3, max_prefill_length=24, max_target_length=40)
    gaps = logprob_gaps(base, generate(None, _prompts(base.config.vocab_size, LENGTHS), SAMPLED,
                                       n=2, engine=engine))
    assert 0 < np.max(np.abs(gaps)) < 1e-4


def _rollout(prompt_len: int, response_len: int) -> Rollout:
    r = response_len
    return Rollout(prompt_ids=np.arange(1, prompt_len + 1, dtype=np.int32),
                   response_ids=np.ones(r, np.int32), logprobs=np.zeros(r, np.float32),
                   n_kept=np.ones(r, np.int32), threshold_logit=np.zeros(r, np.float32),
                   loss_mask=np.ones(r, bool), versions=np.zeros(r, np.int32),
                   finish_reason="stop", advantage=1.0)


def test_aligned_packing_starts_each_rollout_at_a_multiple_of_its_span():
    rollouts = [_rollout(p, r) for p, r in [(3, 2), (9, 6), (4, 1), (20, 7), (2, 2)]]
    batch = pack_rollouts(rollouts, seq_len=64, with_routing=False, align_segments=True)
    seg, pos = batch.segment_ids[0], batch.positions[0]
    for row_seg, row_pos in zip(seg, pos):
        for s in set(row_seg.tolist()) - {0}:
            start = int(np.argmax(row_seg == s))
            length = int(np.sum(row_seg == s))
            span = 1 << (length - 1).bit_length()
            assert start % span == 0 and row_pos[start] == 0
    assert batch.num_sequences == 5


def test_a_token_is_fresh_only_when_its_whole_context_is_the_learners_version():
    """A weight push in the middle of a rollout leaves the earlier keys in the engine's cache from
    the older weights: only tokens whose versions up to their own all equal the learner's can
    match its forward to the bit, and only those count toward `logp_exact_share`."""
    versions = [[3, 3, 3], [2, 3, 3], [3, 3, 2, 3]]
    rollouts = [dataclasses.replace(_rollout(4, len(v)), versions=np.asarray(v, np.int32))
                for v in versions]
    batch = pack_rollouts(rollouts, seq_len=16, with_routing=False, align_segments=True,
                          fresh_version=3)
    seg, fresh, loss = batch.segment_ids[0], batch.fresh[0], batch.loss_mask[0]
    got = sorted(fresh[row][(seg[row] == s) & loss[row]].astype(int).tolist()
                 for row in range(seg.shape[0]) for s in set(seg[row].tolist()) - {0})
    assert got == sorted([[1, 1, 1], [0, 0, 0], [1, 1, 0, 0]])


@pytest.mark.parametrize("family", FAMILIES)
def test_family_learner_logprobs_equal_the_engines_in_fp32_and_bf16(family):
    loaded, _ = hf.load(fixture(family))
    ids = golden(family, "input_ids")
    # 9 to 12 tokens: one prefill bucket, one prefill compile per engine.
    prompts = [ids[0, :10].tolist(), ids[1, :12].tolist(), ids[0, 12:21].tolist()]
    for dtype, layout in (("float32", "slot"), ("bfloat16", "paged")):
        model = _exact(loaded, dtype)
        engine = Engine(model, max_concurrent_decodes=2, max_prefill_length=12,
                        max_target_length=24, kv_layout=layout, page_size=8)
        gaps = _gaps(model, engine, prompts)
        assert gaps.size > 40 and np.max(np.abs(gaps)) == 0.0, (family, dtype, layout)
    jax.clear_caches()
