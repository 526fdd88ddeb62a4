"""The Rollout record that crosses from the rollout side to the learner, and the top-p support
record helpers that both sides share. Plain numpy and Python scalars only; no model code here.

Top-p support record, per generated token: the kept set of top-p sampling is the `n_kept` tokens
with the largest temperature-scaled logit, ties broken by the lower token id; `threshold_logit` is
the scaled logit of the last kept token (a diagnostic). The learner rebuilds the kept set *by rank*
from its own logits (`support_mask_from_record`) and sets every other logit to -inf before the
log-softmax. Rank-based replay is exact whenever learner and sampler order the logits alike, which
is the design: it never depends on the two sides agreeing on logit values to the last bit.
`n_kept == 0` means "no record" (e.g. a tool-observation token that was not sampled): full vocab.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "FINISH_REASONS",
    "Rollout",
    "mask_logits_to_support",
    "support_mask_from_record",
]

FINISH_REASONS = ("stop", "length", "aborted", "error")


@dataclasses.dataclass
class Rollout:
    """One sampled response to one prompt, as token ids plus everything the learner replays.

    P = len(prompt_ids), R = len(response_ids). The learner feeds the model `prompt + response`
    minus its last token (P + R - 1 positions, exactly the tokens the sampler fed its model), so
    `routing` covers those P + R - 1 positions; the last response token is never an input.

    Fields:
      prompt_ids: int32 [P].
      response_ids: int32 [R]; in multi-turn rollouts this includes tool-observation tokens.
      logprobs: float32 [R], the sampling log-prob of each response token under the distribution
        actually sampled from (temperature-scaled, top-p truncated, renormalised). 0 where
        loss_mask is False.
      n_kept: int32 [R], top-p support record (0 = no record: full vocabulary).
      threshold_logit: float32 [R], scaled logit of the last kept token (diagnostic only).
      routing: int32 [num_moe_layers, P + R - 1, experts_per_token], experts chosen at sampling
        time for every token fed to the model, or None when not recorded. A model without MoE
        layers records an empty [0, P + R - 1, 0].
      loss_mask: bool [R], True for policy tokens, False for tool observations.
      versions: int32 [R], the policy version that produced each token (partial rollouts span
        several versions); -1 for tokens no policy produced (tool observations).
      finish_reason: one of FINISH_REASONS.
      temperature: sampling temperature (0 = greedy; then n_kept is 1 and logprobs are 0).
      group_id: the problem this response answers; advantages are normalised within a group.
      reward: the scalar reward (None until graded; never set for aborted rollouts).
      reward_components: named parts of the reward, for logging.
      advantage: set by hcjax.rl.advantages (None until then).
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    n_kept: np.ndarray
    threshold_logit: np.ndarray
    loss_mask: np.ndarray
    versions: np.ndarray
    finish_reason: str
    routing: np.ndarray | None = None
    temperature: float = 1.0
    group_id: str | int = 0
    reward: float | None = None
    reward_components: Mapping[str, float] = dataclasses.field(default_factory=dict)
    advantage: float | None = None

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, np.int32)
        self.response_ids = np.asarray(self.response_ids, np.int32)
        self.logprobs = np.asarray(self.logprobs, np.float32)
        self.n_kept = np.asarray(self.n_kept, np.int32)
        self.threshold_logit = np.asarray(self.threshold_logit, np.float32)
        self.loss_mask = np.asarray(self.loss_mask, bool)
        self.versions = np.asarray(self.versions, np.int32)
        if self.routing is not None:
            self.routing = np.asarray(self.routing, np.int32)
            if self.routing.size == 0 and self.routing.ndim != 3:
                # An empty record (no MoE layer) loses its shape on the way through JSON ([]).
                self.routing = self.routing.reshape(0, self.input_len, 0)
        self.validate()

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def response_len(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def input_len(self) -> int:
        """Tokens the learner feeds to the model for this rollout: P + R - 1."""
        return self.prompt_len + self.response_len - 1

    def validate(self) -> None:
        """Raise ValueError naming the first field whose shape or value breaks the contract."""
        if self.prompt_ids.ndim != 1 or self.prompt_len < 1:
            raise ValueError(f"prompt_ids shape {self.prompt_ids.shape} must be [P] with P >= 1")
        if self.response_ids.ndim != 1 or self.response_len < 1:
            raise ValueError(
                f"response_ids shape {self.response_ids.shape} must be [R] with R >= 1"
            )
        r = self.response_len
        for name in ("logprobs", "n_kept", "threshold_logit", "loss_mask", "versions"):
            shape = getattr(self, name).shape
            if shape != (r,):
                raise ValueError(f"{name} shape {shape} must be [R]=({r},) like response_ids")
        if np.any(self.n_kept < 0):
            raise ValueError(f"n_kept has negative entries {self.n_kept[self.n_kept < 0][:4]}")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason={self.finish_reason!r} is not in {FINISH_REASONS}")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if self.routing is not None:
            if self.routing.ndim != 3 or self.routing.shape[1] != self.input_len:
                raise ValueError(
                    f"routing shape {self.routing.shape} must be [num_moe_layers, P + R - 1="
                    f"{self.input_len}, experts_per_token]"
                )

    @property
    def aborted(self) -> bool:
        """Infrastructure failures: never scored, kept out of group statistics and the loss."""
        return self.finish_reason in ("aborted", "error")


def support_mask_from_record(logits_v: jax.Array, n_kept: jax.Array) -> jax.Array:
    """bool[..., V]: True for the top-`n_kept` entries of `logits_v` (ties: lower id first).

    Batched over leading axes (`n_kept` has the leading shape of `logits_v`). n_kept == 0 means
    no record and keeps every token. Pass the temperature-scaled logits, as the sampler ranked
    those (scaling by a positive temperature can only merge values into ties, never reorder).

    One sort instead of an argsort: the n_kept-th largest value v splits the vocabulary into
    "certainly kept" (> v) and "tied at v"; among the ties the lowest ids fill the remaining slots.
    """
    logits_v = jnp.asarray(logits_v)
    n_kept = jnp.asarray(n_kept, jnp.int32)
    vocab = logits_v.shape[-1]
    n = jnp.where(n_kept <= 0, vocab, jnp.minimum(n_kept, vocab))[..., None]
    descending = -jnp.sort(-logits_v, axis=-1)
    v = jnp.take_along_axis(descending, n - 1, axis=-1)
    above = logits_v > v
    tied = logits_v == v
    slots = n - jnp.sum(above, axis=-1, keepdims=True)
    tie_rank = jnp.cumsum(tied, axis=-1) - 1  # 0 for the lowest-id tied token
    return above | (tied & (tie_rank < slots))


def mask_logits_to_support(logits_v: jax.Array, n_kept: jax.Array) -> jax.Array:
    """`logits_v` with every token outside the recorded top-p kept set set to -inf."""
    keep = support_mask_from_record(logits_v, n_kept)
    return jnp.where(keep, logits_v, -jnp.inf)
