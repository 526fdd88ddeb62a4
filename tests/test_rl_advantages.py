"""Group advantages (mean/std, mean-only), aborted rollouts, zero-variance groups."""

import numpy as np
import pytest

from hcjax.rl.advantages import assign_advantages, group_advantages, mean_only_advantages
from hcjax.rollout.records import Rollout


def test_mean_std_hand_values():
    # group a: rewards 1, 0, 0, 1 -> mean 0.5, std 0.5 -> ±1; group b: 2, 4 -> mean 3, std 1.
    adv = group_advantages([1, 0, 2, 0, 1, 4], ["a", "a", "b", "a", "a", "b"])
    np.testing.assert_allclose(adv, [1, -1, -1, -1, 1, 1])
    np.testing.assert_allclose(mean_only_advantages([1, 0, 2, 4], [0, 0, 1, 1]), [0.5, -0.5, -1, 1])


def test_aborted_rollouts_do_not_move_group_statistics():
    rewards = np.array([1.0, 0.0, 0.0, 1.0])
    base = group_advantages(rewards, [0] * 4)
    # Add aborted members with arbitrary (even NaN) rewards: the valid ones are unchanged.
    rewards2 = np.concatenate([rewards, [np.nan, 100.0]])
    valid = np.array([True] * 4 + [False, False])
    adv = group_advantages(rewards2, [0] * 6, valid)
    np.testing.assert_allclose(adv[:4], base)
    np.testing.assert_allclose(adv[4:], 0.0)


def test_zero_variance_groups_get_zero():
    adv = group_advantages([1.0, 1.0, 1.0, 0.0, 1.0], [0, 0, 0, 1, 1])
    np.testing.assert_allclose(adv, [0, 0, 0, -1, 1])
    # A group whose only valid member is alone carries no signal either.
    np.testing.assert_allclose(group_advantages([3.0, 5.0], [0, 0], [True, False]), [0, 0])


def test_bad_inputs_name_the_value():
    with pytest.raises(ValueError, match="non-finite reward nan"):
        group_advantages([np.nan, 1.0], [0, 0])
    with pytest.raises(ValueError, match="len\\(group_ids\\)=1"):
        group_advantages([0.0, 1.0], [0])


def _rollout(group, reward, finish="stop"):
    return Rollout(prompt_ids=[1, 2], response_ids=[3, 4], logprobs=[-1, -1], n_kept=[2, 2],
                   threshold_logit=[0, 0], loss_mask=[1, 1], versions=[0, 0], finish_reason=finish,
                   group_id=group, reward=reward)


def test_assign_advantages_on_records():
    rs = [_rollout("p", 1.0), _rollout("p", 0.0), _rollout("p", None, "aborted"),
          _rollout("q", 0.5), _rollout("q", 0.5)]
    out = assign_advantages(rs, "mean_std")
    assert [r.advantage for r in out] == [1.0, -1.0, 0.0, 0.0, 0.0]
    assert rs[0].advantage is None  # copies, not mutation
    with pytest.raises(ValueError, match="has no reward"):
        assign_advantages([_rollout("p", None)])
    with pytest.raises(ValueError, match="estimator 'median'"):
        assign_advantages(rs, "median")
