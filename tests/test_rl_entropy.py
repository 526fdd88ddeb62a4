"""Entropy control (hcjax.rl.entropy): the recipe's clip offset k and the optional
sampling-temperature lever, one rule and one config; trajectories against hand-computed values,
the temperature's checkpoint state, and the errors that name the bad value."""

import gin
import numpy as np
import pytest

from hcjax.rl.entropy import EntropyController
from hcjax.rl.learner import LearnerConfig


def test_k_trajectory():
    c = EntropyController(target=0.3, delta=0.25, k_max=0.6)
    entropies = [0.1, 0.2, 0.25, 0.1, 0.5, 0.3, 0.9, 0.9, 0.9, 0.2]
    k, ks = c.k, []
    for h in entropies:
        k = c.next_k(k, h)
        ks.append(float(k))
    # below target: +δ (capped at k_max=0.6); at target: unchanged; above: -δ (floored at 0).
    np.testing.assert_allclose(ks, [0.25, 0.5, 0.6, 0.6, 0.35, 0.35, 0.1, 0.0, 0.0, 0.25], atol=1e-6)
    assert k.dtype == np.float32  # it runs inside the learner's jitted step on float32 state
    # RECIPE §3's defaults: H* 0.3, δ 0.25, k_max 2.5, k starts at 0; the temperature is fixed.
    d = EntropyController()
    assert (d.target, d.delta, d.k_max, d.k, d.controls_temperature) == (0.3, 0.25, 2.5, 0.0, False)
    assert d.initial_temperature(3.0) is None  # off: any sampling temperature is left alone


def test_temperature_trajectory_and_state():
    c = EntropyController(target=0.2, temperature_delta=0.1, temperature_range=(0.8, 1.2))
    t = c.initial_temperature(1.0)
    entropies = [0.1, 0.1, 0.1, 0.2, 0.3, 0.3, 0.3, 0.3, 0.3, 0.1]
    ts = []
    for h in entropies:
        t = c.next_temperature(t, h)
        ts.append(t)
    # below target: hotter by δ (capped at 1.2); at target: unchanged; above: cooler (floor 0.8).
    np.testing.assert_allclose(ts, [1.1, 1.2, 1.2, 1.2, 1.1, 1.0, 0.9, 0.8, 0.8, 0.9], atol=1e-9)
    assert isinstance(t, float)  # host float64: the climb's record is exact to 1e-9
    assert c.load_temperature(c.temperature_state(t)) == t and c.controls_temperature
    with pytest.raises(ValueError, match="checkpointed temperature=1.5 is outside"):
        c.load_temperature({"temperature": 1.5})
    with pytest.raises(ValueError, match="entropy=inf"):
        c.next_temperature(t, float("inf"))
    with pytest.raises(ValueError, match=r"SamplingOptions.temperature=2.0 is outside .*\(0.8, 1.2\)"):
        c.initial_temperature(2.0)


def test_bad_settings_name_the_value():
    with pytest.raises(ValueError, match="delta=-0.1"):
        EntropyController(delta=-0.1)
    with pytest.raises(ValueError, match="k=3.0"):
        EntropyController(k=3.0)
    with pytest.raises(ValueError, match="temperature_delta=-0.1"):
        EntropyController(temperature_delta=-0.1)
    with pytest.raises(ValueError, match=r"temperature_range=\(0.5,\) must be"):
        EntropyController(temperature_range=(0.5,))
    with pytest.raises(ValueError, match=r"temperature_range=\(0.0, 1.0\) must satisfy"):
        EntropyController(temperature_delta=0.1, temperature_range=(0.0, 1.0))
    with pytest.raises(ValueError, match="target=0"):
        EntropyController(target=0.0, temperature_delta=0.1)
    # The lever off (the default): the range is not used, so not checked beyond its shape.
    assert EntropyController(temperature_range=(3.0, 1.0)).temperature_range == (3.0, 1.0)


def test_gin_binds_both_levers_in_one_config():
    gin.parse_config(["EntropyController.target = 0.5", "EntropyController.temperature_delta = 0.05",
                      "EntropyController.temperature_range = [0.6, 1.6]"])
    c = LearnerConfig().entropy  # the learner's k and the climb's temperature read this one
    assert (c.target, c.temperature_delta, c.temperature_range) == (0.5, 0.05, (0.6, 1.6))
    hash(c)  # gin's list became a tuple: the config stays hashable
