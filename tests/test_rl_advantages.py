"""Group advantages (mean/std, mean-only), aborted rollouts, zero-variance groups; entropy control
(the recipe's clip offset k and the optional sampling-temperature lever)."""

import numpy as np
import pytest

from hcjax.rl.advantages import assign_advantages, group_advantages, mean_only_advantages
from hcjax.rl.entropy import EntropyController, TemperatureController, update_k
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


def test_entropy_controller_trajectory():
    c = EntropyController(target=0.3, delta=0.25, k_max=0.6)
    entropies = [0.1, 0.2, 0.25, 0.1, 0.5, 0.3, 0.9, 0.9, 0.9, 0.2]
    ks = [c.update(h) for h in entropies]
    # below target: +δ (capped at k_max=0.6); at target: unchanged; above: -δ (floored at 0).
    np.testing.assert_allclose(ks, [0.25, 0.5, 0.6, 0.6, 0.35, 0.35, 0.1, 0.0, 0.0, 0.25], atol=1e-6)
    state = c.state_dict()
    c2 = EntropyController(target=0.3, delta=0.25, k_max=0.6)
    c2.load_state_dict(state)
    assert c2.k == c.k
    np.testing.assert_allclose(update_k(0.0, 0.1, target=0.3, delta=0.25, k_max=2.5), 0.25)
    with pytest.raises(ValueError, match="k=3.0"):
        c2.load_state_dict({"k": 3.0})
    with pytest.raises(ValueError, match="entropy=nan"):
        c2.update(float("nan"))


def test_temperature_controller_trajectory():
    c = TemperatureController(target=0.2, delta=0.1, low=0.8, high=1.2, temperature=1.0)
    entropies = [0.1, 0.1, 0.1, 0.2, 0.3, 0.3, 0.3, 0.3, 0.3, 0.1]
    ts = [c.update(h) for h in entropies]
    # below target: hotter by δ (capped at 1.2); at target: unchanged; above: cooler (floor 0.8).
    np.testing.assert_allclose(ts, [1.1, 1.2, 1.2, 1.2, 1.1, 1.0, 0.9, 0.8, 0.8, 0.9], atol=1e-9)
    c2 = TemperatureController(target=0.2, delta=0.1, low=0.8, high=1.2)
    c2.load_state_dict(c.state_dict())
    assert c2.temperature == c.temperature and c2.active
    assert not TemperatureController(target=0.2).active  # δ = 0: a fixed temperature
    with pytest.raises(ValueError, match="temperature=1.5"):
        c2.load_state_dict({"temperature": 1.5})
    with pytest.raises(ValueError, match="entropy=inf"):
        c2.update(float("inf"))
    with pytest.raises(ValueError, match="temperature=2.0 is outside"):
        TemperatureController(target=0.2, delta=0.1, low=0.8, high=1.2, temperature=2.0)
    with pytest.raises(ValueError, match="delta=-0.1"):
        TemperatureController(target=0.2, delta=-0.1)
    with pytest.raises(ValueError, match="target=0"):
        TemperatureController(target=0.0)
