"""bench.rollout's synthetic logits: the head sizes it promises, and a clear error for a bad one."""

import jax
import numpy as np
import pytest

from hcjax.bench.rollout import peaked_logits


def test_peaked_logits_heads():
    vocab = 4096
    lifted = np.asarray(peaked_logits(jax.random.key(0), 8, vocab, head=24)) > np.log(vocab)
    # 24 ids drawn per row (a repeat is possible); the N(0, 1) background stays below log(vocab).
    assert np.all(lifted.sum(-1) <= 24) and np.all(lifted.sum(-1) >= 20), lifted.sum(-1)
    free = np.asarray(peaked_logits(jax.random.key(0), 64, vocab)) > np.log(vocab)
    assert 1 <= free.sum(-1).min() and free.sum(-1).max() <= 32 and len(set(free.sum(-1))) > 4
    for bad in (0, 33):
        with pytest.raises(ValueError, match=f"head={bad}"):
            peaked_logits(jax.random.key(0), 2, vocab, head=bad)


@pytest.mark.slow  # ~10-20 s: compiling a fresh engine's prefill, insert and decode programs
def test_device_bound_section():
    """The device-bound section at a toy size on the test model: both paths generate every
    token, the figures are there; `--only device_bound` names a bad config clearly."""
    import argparse
    import dataclasses

    from hcjax.bench.rollout import device_bound_comparison, main
    from tests.rollout_fixtures import TINY_TEST_CONFIG

    args = argparse.Namespace(db_slots=4, db_prompt=8, db_response=4, db_waves=1, db_repeats=1,
                              db_light=1, db_block_steps=2)
    # Two layers (one local, one global; one MoE, one dense): what compiles is the cost here.
    cfg = dataclasses.replace(TINY_TEST_CONFIG, num_layers=2)
    out = device_bound_comparison(cfg, "test", args)
    # 4 steps when the four prefills are done before the first block (blocks of 2 steps); more
    # if the server started decoding some while others were still prefilling.
    assert out["tokens"] == 4 * 4 and out["server_steps"] >= 4 and out["server_blocks"] >= 2
    assert out["server_tokens_per_s"] > 0 and out["reference_tokens_per_s"] > 0
    assert out["params"] > 0 and out["insert_latency"]["server_insert_latency_s"]["n"] >= 1
    with pytest.raises(ValueError, match="'huge'"):
        main(["--only", "device_bound", "--db_configs", "huge"])


def test_shared_pages_section():
    """Four sequences with an 8-token common head in pages of 4: without reuse each holds its
    own three prompt pages; with reuse the head's two pages are held once."""
    import argparse
    import dataclasses

    from flax import nnx

    from hcjax.bench.rollout import shared_pages_comparison
    from hcjax.model import Transformer
    from tests.rollout_fixtures import TINY_TEST_CONFIG

    model = Transformer(dataclasses.replace(TINY_TEST_CONFIG, num_layers=2), rngs=nnx.Rngs(0))
    args = argparse.Namespace(sp_requests=4, sp_system=8, sp_tail=3, sp_response=2,
                              prefix_block_size=4, prefix_cache_blocks=64)
    out = shared_pages_comparison(model, args, max_len=32)
    assert out["pages_after_insert_without_reuse"] == 4 * 3
    assert out["pages_after_insert_with_reuse"] == 2 + 4 * 1
    assert out["shared_page_maps_with_reuse"] == 3 * 2 and out["shared_page_maps_without_reuse"] == 0
    assert out["tokens_equal"]
