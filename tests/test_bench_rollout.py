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
