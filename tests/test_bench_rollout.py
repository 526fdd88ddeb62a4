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


def test_device_bound_section_runs_alone():
    """`--only device_bound` at a toy size: both paths generate every token, figures present."""
    from hcjax.bench.rollout import main

    out = main(["--only", "device_bound", "--db_configs", "tiny", "--db_slots", "4",
                "--db_prompt", "8", "--db_response", "4", "--db_waves", "1", "--db_repeats", "1",
                "--db_light", "1", "--db_block_steps", "2"])
    tiny = out["device_bound"]["tiny"]
    # 4 steps when the four prefills are done before the first block (blocks of 2 steps); more
    # if the server started decoding some while others were still prefilling.
    assert tiny["tokens"] == 4 * 4 and tiny["server_steps"] >= 4 and tiny["server_blocks"] >= 2
    assert tiny["server_tokens_per_s"] > 0 and tiny["reference_tokens_per_s"] > 0
    assert out["server_over_reference_tiny"] == tiny["server_over_reference"]
    assert tiny["insert_latency"]["server_insert_latency_s"]["n"] >= 1
    with pytest.raises(ValueError, match="'huge'"):
        main(["--only", "device_bound", "--db_configs", "huge"])
