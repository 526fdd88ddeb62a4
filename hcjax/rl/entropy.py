"""Adaptive entropy control (RECIPE §3): one rule on the importance-weighted entropy estimate Ĥ,
driving two levers from one config. Pure rules and validation only; the states live with their
users (k in the learner state, the temperature in the climb's checkpoint data).

The rule (RECIPE §3, adaptive entropy control), for a lever x in [low, high]:

    x ← clip(x + δ·sign(H* − Ĥ), low, high)

- k, the upper clip offset of the GRPO objective (clip(r, 1−ε, (1−ε)⁻¹ + k)), starting at 0, in
  [0, k_max], is RECIPE §3's lever. The learner's jitted step applies it (`next_k`). Below the
  target entropy k grows, widening the upper clip so low-probability tokens with positive
  advantage can gain mass. k can only loosen the upper clip, so it has authority only where that
  clip binds: it can hold Ĥ down toward H*, never lift it above what unclipped updates give.
- The sampling temperature is a second, optional lever for regimes where the clip never binds
  (measured in the tiny climb); the climb applies it after each step (`next_temperature`). The
  learner's π_θ is the tempered policy (hcjax.rl.learner divides logits by each rollout's
  temperature), so Ĥ measures the entropy that is actually sampled. It is not part of RECIPE §3
  and is off (temperature_delta = 0) unless a config turns it on.
"""

from __future__ import annotations

import dataclasses
import math

import gin
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["EntropyController"]


def _sign_rule(xp, value, entropy, *, target: float, delta: float, low: float, high: float):
    """x ← clip(x + δ·sign(H* − Ĥ), low, high), in the array module `xp` (jnp or np)."""
    return xp.clip(value + delta * xp.sign(target - entropy), low, high)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class EntropyController:
    """H* (`target`) and both levers of RECIPE §3's entropy control.

    k: delta (δ), k_max, and k, its start value. Temperature: temperature_delta (δ; 0 keeps the
    sampling temperature fixed) within temperature_range (low, high); the climb's
    SamplingOptions.temperature is its start value.
    """

    target: float = 0.3
    delta: float = 0.25
    k_max: float = 2.5
    k: float = 0.0
    temperature_delta: float = 0.0
    temperature_range: tuple[float, float] = (0.5, 2.0)

    def __post_init__(self) -> None:
        # gin hands lists where tuples are declared; keep the config hashable.
        object.__setattr__(self, "temperature_range", tuple(self.temperature_range))
        if self.delta < 0:
            raise ValueError(f"EntropyController.delta={self.delta} must be >= 0")
        if self.k_max < 0:
            raise ValueError(f"EntropyController.k_max={self.k_max} must be >= 0")
        if not 0.0 <= self.k <= self.k_max:
            raise ValueError(f"EntropyController.k={self.k} must be in [0, k_max={self.k_max}]")
        if self.temperature_delta < 0:
            raise ValueError(f"EntropyController.temperature_delta={self.temperature_delta} "
                             "must be >= 0")
        if len(self.temperature_range) != 2:
            raise ValueError(f"EntropyController.temperature_range={self.temperature_range} "
                             "must be (low, high)")
        if self.controls_temperature:
            low, high = self.temperature_range
            if not 0.0 < low <= high:
                raise ValueError(f"EntropyController.temperature_range={self.temperature_range}"
                                 " must satisfy 0 < low <= high")
            if not (math.isfinite(self.target) and self.target > 0):
                raise ValueError(f"EntropyController.target={self.target} must be > 0 to "
                                 "control the temperature")

    # k ----------------------------------------------------------------------------------------
    def next_k(self, k: jax.Array, entropy: jax.Array) -> jax.Array:
        """One step of the rule on k (float32 jnp; runs inside the learner's jitted step)."""
        return _sign_rule(jnp, jnp.asarray(k, jnp.float32), jnp.asarray(entropy, jnp.float32),
                          target=self.target, delta=self.delta, low=0.0, high=self.k_max)

    # The sampling temperature -------------------------------------------------------------------
    @property
    def controls_temperature(self) -> bool:
        return self.temperature_delta > 0

    def initial_temperature(self, temperature: float) -> float | None:
        """The controlled temperature's start value (None when the lever is off), checked to
        lie in temperature_range."""
        if not self.controls_temperature:
            return None
        return self._in_range(temperature, "SamplingOptions.temperature")

    def next_temperature(self, temperature: float, entropy: float) -> float:
        """One step of the rule on the sampling temperature, on the host (float64): the
        temperature of the next samples."""
        if not np.isfinite(entropy):
            raise ValueError(f"entropy={entropy} is not finite")
        low, high = self.temperature_range
        return float(_sign_rule(np, float(temperature), float(entropy), target=self.target,
                                delta=self.temperature_delta, low=low, high=high))

    def temperature_state(self, temperature: float) -> dict[str, float]:
        """The temperature as the climb checkpoints it."""
        return {"temperature": float(temperature)}

    def load_temperature(self, state: dict) -> float:
        """The temperature of a `temperature_state`, checked to lie in temperature_range."""
        return self._in_range(state["temperature"], "checkpointed temperature")

    def _in_range(self, temperature: float, what: str) -> float:
        low, high = self.temperature_range
        t = float(temperature)
        if not low <= t <= high:
            raise ValueError(f"{what}={t} is outside EntropyController.temperature_range="
                             f"({low}, {high})")
        return t
