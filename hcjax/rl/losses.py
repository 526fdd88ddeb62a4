"""Policy-gradient losses as pure functions of per-token arrays, selected by name from gin.

Every loss takes `logp`, `old_logp`, `mask` [B, T], advantages [B] or [B, T] and the *global*
batch totals, and returns `(loss, metrics)`. Losses are sums over the tokens given divided by the
global totals, so a micro-batched or sharded learner adds per-part losses (and metrics, except
those named `*_max`, which combine by max: hcjax.train.step.combine_metrics) to get the global
value exactly. No model code here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import gin
import jax
import jax.numpy as jnp

__all__ = [
    "CORRECTIONS",
    "LOSSES",
    "LossConfig",
    "dpo_loss",
    "grpo_loss",
    "gspo_loss",
    "kimi_loss",
    "rollout_correction",
    "segment_sum",
]

Metrics = dict[str, jax.Array]


def _per_token(advantages: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    advantages = jnp.asarray(advantages, jnp.float32)
    if advantages.shape == shape:
        return advantages
    if advantages.shape == shape[:1]:
        return jnp.broadcast_to(advantages[:, None], shape)
    raise ValueError(f"advantages shape {advantages.shape} must be [B]={shape[:1]} or [B, T]={shape}")


def segment_sum(x_bt: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """[B, T]: at each token, the sum of `x_bt` over its sequence (same row, same segment id).

    With `segment_ids=None` every row is one sequence. Padding (id 0) forms its own group; callers
    mask it out.
    """
    if segment_ids is None:
        return jnp.broadcast_to(jnp.sum(x_bt, axis=1, keepdims=True), x_bt.shape)
    b, t = x_bt.shape
    # A (row, segment) pair gets a unique id; segment ids are < T+1 in a row of T tokens.
    gid = (jnp.arange(b)[:, None] * (t + 1) + segment_ids).reshape(-1)
    sums = jax.ops.segment_sum(x_bt.reshape(-1), gid, num_segments=b * (t + 1))
    return sums[gid].reshape(b, t)


def _clipped_exp(log_ratio: jax.Array, r_max: float) -> jax.Array:
    """exp(log_ratio), capped just above r_max so it cannot overflow.

    Above r_max the outer clip already zeroes the gradient, so the cap changes no value or gradient
    of the loss; without it exp overflows to inf and 0·inf poisons the backward pass with NaN.
    """
    cap = jnp.log(jnp.float32(r_max)) + 1.0 if r_max < jnp.inf else jnp.inf
    return jnp.exp(jnp.minimum(log_ratio, cap))


def _weighted(objective: jax.Array, token_weights: jax.Array | None) -> jax.Array:
    if token_weights is None:
        return objective
    return objective * jax.lax.stop_gradient(jnp.asarray(token_weights, jnp.float32))


def _token_metrics(logp, old_logp, ratio, adv, mask, num_tokens, lo, hi, r_min, r_max) -> Metrics:
    """Clip fractions, ratio mean/max and the importance-weighted entropy estimate Ĥ (eq. 7)."""
    ratio, logp = jax.lax.stop_gradient(ratio), jax.lax.stop_gradient(logp)
    m = mask.astype(jnp.float32)

    def frac(cond):
        return jnp.sum(jnp.where(cond, m, 0.0)) / num_tokens

    return {
        "clip_low_frac": frac((adv < 0) & (ratio < lo)),
        "clip_high_frac": frac((adv > 0) & (ratio > hi)),
        "clip_outer_frac": frac((ratio > r_max) | (ratio < r_min)),
        "ratio_mean": jnp.sum(m * ratio) / num_tokens,
        "ratio_max": jnp.max(jnp.where(mask, ratio, -jnp.inf)),
        # Ĥ = 1/|T| Σ -log π_θ(y_t) · r_t: an estimate of the entropy of π_θ from π_old samples.
        "entropy": jnp.sum(m * (-logp) * ratio) / num_tokens,
        "num_loss_tokens": jnp.sum(m),
    }


def grpo_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps: float,
    k: float | jax.Array,
    r_min: float,
    r_max: float,
    num_tokens: float | jax.Array,
    num_sequences: float | jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    token_weights: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """The token-level MAI objective (RECIPE §3), negated to a loss.

    J = 1/N Σ_t min(r_out·A, clip(r_out, 1-ε, (1-ε)⁻¹ + k)·A) with r_out = clip(r, r_min, r_max)
    on every branch (the outer clip also stops the branch PPO leaves unclipped), N = num_tokens,
    the loss tokens of the global batch. `num_sequences`/`segment_ids` are unused (uniform API).
    `token_weights` [B, T] (no gradient; a rollout correction's w_t) multiply each token's term.
    """
    del num_sequences, segment_ids
    mask = jnp.asarray(mask).astype(bool)
    adv = _per_token(advantages, logp.shape)
    lo, hi = 1.0 - eps, 1.0 / (1.0 - eps) + k
    log_ratio = jnp.where(mask, logp - old_logp, 0.0)
    r_out = jnp.clip(_clipped_exp(log_ratio, r_max), r_min, r_max)
    objective = jnp.minimum(r_out * adv, jnp.clip(r_out, lo, hi) * adv)
    objective = _weighted(objective, token_weights)
    loss = -jnp.sum(jnp.where(mask, objective, 0.0)) / num_tokens
    ratio = jnp.exp(log_ratio)
    metrics = _token_metrics(logp, old_logp, ratio, adv, mask, num_tokens, lo, hi, r_min, r_max)
    return loss, metrics


def gspo_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_low: float,
    eps_high: float,
    k: float | jax.Array,
    r_min: float,
    r_max: float,
    num_tokens: float | jax.Array,
    num_sequences: float | jax.Array,
    segment_ids: jax.Array | None = None,
    token_weights: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """GSPO (RECIPE §6): one length-normalised importance ratio per sequence.

    s_i = exp(mean_t(log π_θ - log π_old) over the loss tokens of y_i);
    J = 1/num_sequences Σ_i min(s_i·A_i, clip(s_i, 1-ε_low, 1+ε_high+k)·A_i), with the same
    outer clip [r_min, r_max] as GRPO. Sequences are rows, or segments of packed rows.
    `token_weights` [B, T] (no gradient) multiply each token's 1/|y_i| share of its sequence's
    term, so a weight constant over a sequence (a sequence-level correction) weights J_i.
    """
    mask = jnp.asarray(mask).astype(bool)
    m = mask.astype(jnp.float32)
    adv = _per_token(advantages, logp.shape)
    log_ratio = jnp.where(mask, logp - old_logp, 0.0)
    seq_len = segment_sum(m, segment_ids)
    safe_len = jnp.maximum(seq_len, 1.0)
    seq_log_ratio = segment_sum(log_ratio, segment_ids) / safe_len
    seq_ratio = jnp.exp(seq_log_ratio)
    lo, hi = 1.0 - eps_low, 1.0 + eps_high + k
    r_out = jnp.clip(_clipped_exp(seq_log_ratio, r_max), r_min, r_max)
    objective = jnp.minimum(r_out * adv, jnp.clip(r_out, lo, hi) * adv)
    # Each token carries 1/|y_i| of its sequence's objective, so the token sum is Σ_i objective_i.
    objective = _weighted(objective, token_weights)
    loss = -jnp.sum(jnp.where(mask, objective / safe_len, 0.0)) / num_sequences
    metrics = _token_metrics(
        logp, old_logp, jnp.exp(log_ratio), adv, mask, num_tokens, lo, hi, r_min, r_max
    )
    # Clip fractions for GSPO are about the sequence ratio.
    seq_ratio = jax.lax.stop_gradient(seq_ratio)

    def frac(cond):
        return jnp.sum(jnp.where(mask & cond, m, 0.0)) / num_tokens

    metrics["clip_low_frac"] = frac((adv < 0) & (seq_ratio < lo))
    metrics["clip_high_frac"] = frac((adv > 0) & (seq_ratio > hi))
    metrics["clip_outer_frac"] = frac((seq_ratio > r_max) | (seq_ratio < r_min))
    metrics["seq_ratio_max"] = jnp.max(jnp.where(mask, seq_ratio, -jnp.inf))
    return loss, metrics


def kimi_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    tau: float,
    num_tokens: float | jax.Array,
    num_sequences: float | jax.Array,
    segment_ids: jax.Array | None = None,
    k: float | jax.Array = 0.0,
) -> tuple[jax.Array, Metrics]:
    """Kimi k1.5 online-mirror-descent surrogate (RECIPE §5), with π_ref = π_old.

    L = 1/num_sequences Σ_i (A_i - τ·log(π_θ(y_i)/π_old(y_i)))², where A_i = r_i - mean_group(r)
    stands for r_i - τ·log Z (pass *mean-only* advantages). The τ term is the KL regulariser to the
    previous iterate; metric `kl_prev` estimates KL(π_old ‖ π_θ) per sequence. `k` is unused.
    """
    del k
    mask = jnp.asarray(mask).astype(bool)
    m = mask.astype(jnp.float32)
    adv = _per_token(advantages, logp.shape)
    log_ratio = jnp.where(mask, logp - old_logp, 0.0)
    seq_log_ratio = segment_sum(log_ratio, segment_ids)  # log π_θ(y_i) - log π_old(y_i)
    seq_len = jnp.maximum(segment_sum(m, segment_ids), 1.0)
    residual = adv - tau * seq_log_ratio
    loss = jnp.sum(jnp.where(mask, jnp.square(residual) / seq_len, 0.0)) / num_sequences
    ratio = jnp.exp(log_ratio)
    metrics = _token_metrics(
        logp, old_logp, ratio, adv, mask, num_tokens, 0.0, jnp.inf, -jnp.inf, jnp.inf
    )
    metrics["kl_prev"] = jnp.sum(
        jnp.where(mask, -jax.lax.stop_gradient(seq_log_ratio) / seq_len, 0.0)
    ) / num_sequences
    return loss, metrics


CORRECTIONS = ("none", "tis", "seq_tis", "mis", "seq_mis", "icepop")


def rollout_correction(
    prox_logp: jax.Array,
    sampler_logp: jax.Array,
    mask: jax.Array,
    *,
    kind: str,
    cap: float,
    low: float,
    high: float,
    num_tokens: float | jax.Array,
    segment_ids: jax.Array | None = None,
    seq_form: str = "product",
) -> tuple[jax.Array, Metrics]:
    """Per-token weights w [B, T] (no gradient) correcting for the sampler/learner mismatch.

    Notation (RECIPE §3 calls the sampler's distribution π_old): π_samp is the distribution the
    rollout's tokens were drawn from, as the sampler computed it (the records' `logprobs`, after
    top-p); π_prox is the same distribution computed by the learner at the parameters the
    gradient is taken at (detached; routing and top-p replay applied). Per token
    ρ_it = π_prox(y_it)/π_samp(y_it), per sequence ρ_i = Π_t ρ_it (seq_form="product") or
    ρ_i = (Π_t ρ_it)^(1/|y_i|) (seq_form="geometric"), over the loss tokens of y_i. With C = cap
    and the band [lo, hi] = [low, high]:

      tis      w_it = min(ρ_it, C)                 truncated IS, token level
      seq_tis  w_it = min(ρ_i, C)                  truncated IS, sequence level
      mis      w_it = 1[lo ≤ ρ_it ≤ hi]            masked: drop tokens outside the band
      seq_mis  w_it = 1[lo ≤ ρ_i ≤ hi]             masked: drop whole sequences outside the band
      icepop   w_it = ρ_it · 1[lo ≤ ρ_it ≤ hi]     IcePop: IS weight in the band, 0 outside
      none     w_it = 1

    Metrics (shares of the global batch, like the losses'): `is_clip_frac` (loss tokens whose
    weight was truncated at C or masked), `is_ratio_mean`, `is_ratio_max` (token ρ), `is_weight_mean`
    and `is_kl`, the k3 estimate mean_t(ρ_it - 1 - log ρ_it) of KL(π_samp ‖ π_prox).
    """
    if kind not in CORRECTIONS:
        raise ValueError(f"rollout correction kind={kind!r} is not one of {CORRECTIONS}")
    if seq_form not in ("product", "geometric"):
        raise ValueError(f"seq_form={seq_form!r} must be 'product' or 'geometric'")
    mask = jnp.asarray(mask).astype(bool)
    m = mask.astype(jnp.float32)
    log_rho = jnp.where(mask, jax.lax.stop_gradient(prox_logp) - sampler_logp, 0.0)
    if kind.startswith("seq_"):
        log_rho_w = segment_sum(log_rho, segment_ids)
        if seq_form == "geometric":
            log_rho_w = log_rho_w / jnp.maximum(segment_sum(m, segment_ids), 1.0)
    else:
        log_rho_w = log_rho
    log_cap = jnp.log(jnp.float32(cap))
    log_lo, log_hi = jnp.log(jnp.float32(low)), jnp.log(jnp.float32(high))
    inside = (log_rho_w >= log_lo) & (log_rho_w <= log_hi)
    if kind in ("tis", "seq_tis"):
        weight = jnp.exp(jnp.minimum(log_rho_w, log_cap))  # min(ρ, C) without overflow
        clipped = log_rho_w > log_cap
    elif kind in ("mis", "seq_mis"):
        weight, clipped = inside.astype(jnp.float32), ~inside
    elif kind == "icepop":
        weight = jnp.where(inside, jnp.exp(jnp.clip(log_rho_w, log_lo, log_hi)), 0.0)
        clipped = ~inside
    else:
        weight, clipped = jnp.ones_like(log_rho), jnp.zeros(log_rho.shape, bool)
    weight = jnp.where(mask, weight, 0.0)
    rho = jnp.exp(jnp.minimum(log_rho, 30.0))  # metrics only; e^30 keeps the k3 sum finite
    metrics = {
        "is_clip_frac": jnp.sum(jnp.where(clipped, m, 0.0)) / num_tokens,
        "is_ratio_mean": jnp.sum(m * rho) / num_tokens,
        "is_ratio_max": jnp.max(jnp.where(mask, rho, -jnp.inf)),
        "is_weight_mean": jnp.sum(weight) / num_tokens,
        "is_kl": jnp.sum(m * (rho - 1.0 - log_rho)) / num_tokens,
    }
    return jax.lax.stop_gradient(weight), metrics


LOSSES: dict[str, Callable[..., tuple[jax.Array, Metrics]]] = {
    "grpo": grpo_loss,
    "gspo": gspo_loss,
    "kimi": kimi_loss,
}


@gin.configurable
@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Which loss, and its hyperparameters (RECIPE §3 defaults for GRPO; GSPO paper ε for GSPO).

    Rollout correction (`correction`, one of CORRECTIONS; `rollout_correction` gives the weights):
    with a correction the loss is the decoupled form

      J = 1/N Σ_(i,t) w_it · min(r'_it·A_i, clip(r'_it, 1−ε, (1−ε)⁻¹ + k)·A_i),
      r'_it = π_θ(y_it)/π_prox(y_it)

    where π_prox is the learner's own π_old (the parameters the step's gradient is taken at,
    detached) and w_it corrects π_samp → π_prox (cap C = `is_cap`, band [`is_low`, `is_high`],
    `is_seq_form` for the sequence-level kinds). The learner takes one optimiser step per batch,
    so r' = 1 in value (its gradient is ∇log π_θ) and the ε/k and outer clips never bind: the
    weight's truncation or band bounds the update instead. The entropy estimate Ĥ keeps RECIPE
    §3's form against π_samp, so the entropy controller reads the same figure. Routing and top-p
    replay still act (they shape π_prox); the correction bounds what mismatch remains. Not for
    `kimi` (its τ term regularises towards the sampling policy itself).
    """

    name: str = "grpo"
    eps: float = 0.6
    r_min: float = 0.0
    r_max: float = 50.0
    gspo_eps_low: float = 3e-4
    gspo_eps_high: float = 4e-4
    tau: float = 0.1
    correction: str = "none"
    is_cap: float = 2.0
    is_low: float = 0.5
    is_high: float = 2.0
    is_seq_form: str = "product"

    def __post_init__(self) -> None:
        if self.name not in LOSSES:
            raise ValueError(f"LossConfig.name={self.name!r} is not one of {sorted(LOSSES)}")
        if not 0.0 < self.eps < 1.0:
            raise ValueError(f"LossConfig.eps={self.eps} must be in (0, 1)")
        if not 0.0 <= self.r_min < self.r_max:
            raise ValueError(f"LossConfig r_min={self.r_min}, r_max={self.r_max}: need 0 <= min < max")
        if not (0.0 <= self.gspo_eps_low < 1.0 and self.gspo_eps_high >= 0.0):
            raise ValueError(
                f"LossConfig gspo_eps_low={self.gspo_eps_low}, gspo_eps_high={self.gspo_eps_high}: "
                "need 0 <= low < 1 and high >= 0"
            )
        if self.tau <= 0.0:
            raise ValueError(f"LossConfig.tau={self.tau} must be > 0")
        if self.correction not in CORRECTIONS:
            raise ValueError(f"LossConfig.correction={self.correction!r} is not one of "
                             f"{CORRECTIONS}")
        if self.correction != "none" and self.name == "kimi":
            raise ValueError(f"LossConfig.correction={self.correction!r} does not apply to "
                             "name='kimi' (its τ term regularises towards the sampler itself)")
        if not self.is_cap > 0.0:
            raise ValueError(f"LossConfig.is_cap={self.is_cap} must be > 0")
        if not 0.0 < self.is_low <= 1.0 <= self.is_high:
            raise ValueError(f"LossConfig is_low={self.is_low}, is_high={self.is_high}: need "
                             "0 < low <= 1 <= high")
        if self.is_seq_form not in ("product", "geometric"):
            raise ValueError(f"LossConfig.is_seq_form={self.is_seq_form!r} must be 'product' "
                             "or 'geometric'")

    def make(self) -> Callable[..., tuple[jax.Array, Metrics]]:
        """The chosen loss with its hyperparameters bound. Call it as
        `fn(logp, old_logp, advantages, mask, k=, num_tokens=, num_sequences=, segment_ids=)`."""
        fn = LOSSES[self.name]
        if self.name == "grpo":
            hp = dict(eps=self.eps, r_min=self.r_min, r_max=self.r_max)
        elif self.name == "gspo":
            hp = dict(
                eps_low=self.gspo_eps_low, eps_high=self.gspo_eps_high,
                r_min=self.r_min, r_max=self.r_max,
            )
        else:
            hp = dict(tau=self.tau)

        if self.correction == "none":

            def loss_fn(logp, old_logp, advantages, mask, **totals):
                return fn(logp, old_logp, advantages, mask, **hp, **totals)

            return loss_fn

        def corrected_loss_fn(logp, old_logp, advantages, mask, **totals):
            # old_logp is the sampler's (π_samp); π_prox is π_θ itself, detached.
            prox = jax.lax.stop_gradient(logp)
            weights, is_metrics = rollout_correction(
                prox, old_logp, mask, kind=self.correction, cap=self.is_cap, low=self.is_low,
                high=self.is_high, num_tokens=totals["num_tokens"],
                segment_ids=totals.get("segment_ids"), seq_form=self.is_seq_form,
            )
            loss, metrics = fn(logp, prox, advantages, mask, token_weights=weights, **hp, **totals)
            # Ĥ of RECIPE §3 against the sampler: the figure the entropy controller reads.
            bmask = jnp.asarray(mask).astype(bool)
            r = jnp.exp(jnp.minimum(jnp.where(bmask, prox - old_logp, 0.0), 30.0))
            metrics["entropy"] = jnp.sum(jnp.where(bmask, -prox * r, 0.0)) / totals["num_tokens"]
            return loss, {**metrics, **is_metrics}

        return corrected_loss_fn


def dpo_loss(
    policy_chosen: jax.Array,
    policy_rejected: jax.Array,
    ref_chosen: jax.Array,
    ref_rejected: jax.Array,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    weights: jax.Array | None = None,
    chosen_lengths: jax.Array | None = None,
    nll_weight: float = 0.0,
) -> tuple[jax.Array, Metrics]:
    """Direct preference optimisation (Rafailov et al. 2023; Kimi k1.5 long2short, RECIPE §5).

    Inputs are [P] sequence log-probs (sums over each response's tokens) of the chosen and
    rejected response of P pairs under the policy and the frozen reference. With
    z = β·((π_c − ref_c) − (π_r − ref_r)):
      loss = mean_p [ −(1 − ε)·log σ(z) − ε·log σ(−z) ]   (ε = label_smoothing, "conservative DPO")
    `weights` [P] (e.g. 0 for padding pairs) make it a weighted mean. `nll_weight` α > 0 adds
    α·mean_p(−π_c / chosen_lengths_p), the chosen response's per-token negative log-likelihood
    (the NLL term of RPO, Pang et al. 2024), which keeps DPO from lowering the chosen responses'
    likelihood along with the rejected ones'. Metrics: the implicit rewards β·(π − ref) of chosen
    and rejected, their margin, and accuracy (chosen reward > rejected), and `chosen_nll`.
    """
    if beta <= 0:
        raise ValueError(f"beta={beta} must be > 0")
    if nll_weight < 0 or (nll_weight > 0 and chosen_lengths is None):
        raise ValueError(f"nll_weight={nll_weight} must be >= 0, and needs chosen_lengths")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 0.5)")
    chosen_reward = beta * (policy_chosen - ref_chosen)
    rejected_reward = beta * (policy_rejected - ref_rejected)
    z = chosen_reward - rejected_reward
    per_pair = (-(1.0 - label_smoothing) * jax.nn.log_sigmoid(z)
                - label_smoothing * jax.nn.log_sigmoid(-z))
    w = jnp.ones_like(z) if weights is None else jnp.asarray(weights, z.dtype)
    total = jnp.maximum(jnp.sum(w), 1e-9)

    def mean(x):
        return jnp.sum(w * x) / total

    cr, rr = jax.lax.stop_gradient(chosen_reward), jax.lax.stop_gradient(rejected_reward)
    metrics = {
        "dpo_loss": mean(jax.lax.stop_gradient(per_pair)),
        "reward_chosen": mean(cr),
        "reward_rejected": mean(rr),
        "reward_margin": mean(cr - rr),
        "reward_accuracy": mean((cr > rr).astype(z.dtype)),
    }
    loss = mean(per_pair)
    if chosen_lengths is not None:
        nll = -policy_chosen / jnp.maximum(jnp.asarray(chosen_lengths, z.dtype), 1.0)
        metrics["chosen_nll"] = mean(jax.lax.stop_gradient(nll))
        if nll_weight > 0:
            loss = loss + nll_weight * mean(nll)
    return loss, metrics
