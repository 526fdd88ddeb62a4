"""Adaptive entropy control (RECIPE §3): the upper clip offset k moves by ±δ toward a target entropy.

k ← clip(k + δ·sign(H* − Ĥ), 0, k_max), starting at 0. Below the target entropy k grows, widening
the upper clip so low-probability tokens with positive advantage can gain mass. The state is a
plain dict {"k": float32} so it checkpoints with the rest of the learner state.

k can only loosen the upper clip, so it has authority only where that clip binds: it can hold Ĥ
down toward H*, never lift it above what unclipped updates give. TemperatureController is a second,
optional lever for regimes where the clip never binds (measured in the tiny climb): the same sign
rule on the sampling temperature. The learner's π_θ is the tempered policy (hcjax.rl.learner
divides logits by each rollout's temperature), so Ĥ measures the entropy that is actually sampled.
It is not part of RECIPE §3 and is off unless a config turns it on.
"""

from __future__ import annotations

import dataclasses

import gin
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["EntropyController", "TemperatureController", "update_k"]


def update_k(
    k: jax.Array, entropy: jax.Array, *, target: float, delta: float, k_max: float
) -> jax.Array:
    """One controller step as a pure jnp function (usable inside a jitted train step)."""
    k = jnp.asarray(k, jnp.float32)
    return jnp.clip(k + delta * jnp.sign(target - jnp.asarray(entropy, jnp.float32)), 0.0, k_max)


@gin.configurable
@dataclasses.dataclass
class EntropyController:
    """Holds k between steps; `update(Ĥ)` applies the rule and returns the new k."""

    target: float = 0.3
    delta: float = 0.25
    k_max: float = 2.5
    k: float = 0.0

    def __post_init__(self) -> None:
        if self.delta < 0:
            raise ValueError(f"EntropyController.delta={self.delta} must be >= 0")
        if self.k_max < 0:
            raise ValueError(f"EntropyController.k_max={self.k_max} must be >= 0")
        if not 0.0 <= self.k <= self.k_max:
            raise ValueError(f"EntropyController.k={self.k} must be in [0, k_max={self.k_max}]")

    def update(self, entropy: float) -> float:
        if not np.isfinite(entropy):
            raise ValueError(f"entropy={entropy} is not finite")
        self.k = float(
            update_k(self.k, entropy, target=self.target, delta=self.delta, k_max=self.k_max)
        )
        return self.k

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"k": np.float32(self.k)}

    def load_state_dict(self, state: dict) -> None:
        k = float(state["k"])
        if not 0.0 <= k <= self.k_max:
            raise ValueError(f"checkpointed k={k} is outside [0, k_max={self.k_max}]")
        self.k = k


@dataclasses.dataclass
class TemperatureController:
    """Sampling temperature T ← clip(T + δ·sign(H* − Ĥ), low, high); δ = 0 keeps T fixed."""

    target: float
    delta: float = 0.0
    low: float = 0.5
    high: float = 2.0
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not (np.isfinite(self.target) and self.target > 0):
            raise ValueError(f"TemperatureController.target={self.target} must be > 0")
        if self.delta < 0:
            raise ValueError(f"TemperatureController.delta={self.delta} must be >= 0")
        if not 0.0 < self.low <= self.high:
            raise ValueError(f"TemperatureController range ({self.low}, {self.high}) must satisfy "
                             "0 < low <= high")
        if not self.low <= self.temperature <= self.high:
            raise ValueError(f"TemperatureController.temperature={self.temperature} is outside "
                             f"[{self.low}, {self.high}]")

    @property
    def active(self) -> bool:
        return self.delta > 0

    def update(self, entropy: float) -> float:
        """One step of the rule on this step's Ĥ; returns the temperature for the next samples."""
        if not np.isfinite(entropy):
            raise ValueError(f"entropy={entropy} is not finite")
        step = self.delta * float(np.sign(self.target - entropy))
        self.temperature = float(np.clip(self.temperature + step, self.low, self.high))
        return self.temperature

    def state_dict(self) -> dict[str, float]:
        return {"temperature": self.temperature}

    def load_state_dict(self, state: dict) -> None:
        t = float(state["temperature"])
        if not self.low <= t <= self.high:
            raise ValueError(f"checkpointed temperature={t} is outside [{self.low}, {self.high}]")
        self.temperature = t
