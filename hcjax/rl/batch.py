"""Batch layout: Rollout records -> packed rows -> micro-batched arrays on the learner mesh.

Each rollout becomes one segment of a packed row: the model is fed `prompt + response` minus its
last token, and every field is aligned to the position that *predicts* a response token. Rows are
laid out [micro_batches, rows_per_micro_batch, seq_len], sharded over the batch mesh axes on the
second dimension, so every micro-batch is spread over all data-parallel devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hcjax.rollout.engine_api import next_pow2
from hcjax.rollout.records import Rollout

__all__ = ["BATCH_AXES", "LearnerBatch", "bucket_rows", "pack_rollouts", "to_device", "usable_rollouts"]

BATCH_AXES = ("data", "fsdp")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LearnerBatch:
    """Per-token arrays [M, b, T] (M micro-batches of b rows of T tokens) and global totals.

    At input position t of a segment: `tokens[t]` is fed, `targets[t]` is the next token, and the
    loss fields (`loss_mask`, `old_logp`, `n_kept`, `temperature`) describe that target.
    """

    tokens: np.ndarray | jax.Array  # int32 [M, b, T]
    positions: np.ndarray | jax.Array  # int32, restart at 0 per segment
    segment_ids: np.ndarray | jax.Array  # int32, 1.. per row, 0 = padding
    targets: np.ndarray | jax.Array  # int32
    loss_mask: np.ndarray | jax.Array  # bool
    old_logp: np.ndarray | jax.Array  # float32, sampler log-prob of the target
    advantages: np.ndarray | jax.Array  # float32, the segment's advantage on every position
    n_kept: np.ndarray | jax.Array  # int32, top-p support record (0 = full vocabulary)
    temperature: np.ndarray | jax.Array  # float32, the sampler's (1 where greedy: one kept token)
    routing: np.ndarray | jax.Array | None  # int32 [M, L, b, T, k] or None
    num_tokens: np.ndarray | jax.Array  # float32 scalar: loss tokens in the whole batch
    num_sequences: np.ndarray | jax.Array  # float32 scalar: sequences with >= 1 loss token
    # bool: the target, and every position before it, was computed by the weights the learner
    # holds (`fresh_version`); None = every target (the exact-equality share of the log-probs is
    # measured over these).
    fresh: np.ndarray | jax.Array | None = None

    @property
    def micro_batches(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def rows(self) -> int:
        """Packed rows over all micro-batches (M·b)."""
        return int(self.tokens.shape[0] * self.tokens.shape[1])


def usable_rollouts(rollouts: Sequence[Rollout], *, mask_truncated: bool = True) -> list[Rollout]:
    """The rollouts that can carry gradient: not aborted, with >= 1 loss token after masking.

    Aborted rollouts never enter the loss; truncated ones (finish_reason "length") are dropped
    when `mask_truncated` (RECIPE §6: truncated samples are masked out of the loss).
    """
    out = []
    for r in rollouts:
        if r.aborted or (mask_truncated and r.finish_reason == "length"):
            continue
        if not r.loss_mask.any():
            continue
        out.append(r)
    return out


def _first_fit_decreasing(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(seq_len - lengths[i])
    return rows


def pack_rollouts(
    rollouts: Sequence[Rollout],
    *,
    seq_len: int,
    micro_batches: int = 1,
    row_multiple: int = 1,
    num_rows: int | None = None,
    with_routing: bool = True,
    mask_truncated: bool = True,
    align_segments: bool = False,
    fresh_version: int | None = None,
) -> LearnerBatch:
    """Pack rollouts (first-fit decreasing) into a numpy `LearnerBatch`.

    The number of rows is padded up to a multiple of `micro_batches * row_multiple` (pass the
    data-parallel size as `row_multiple`), or fixed by `num_rows`. Aborted / truncated / fully
    masked rollouts are dropped (see `usable_rollouts`); every kept rollout needs an advantage.
    With `with_routing`, every kept rollout needs a routing record. `align_segments` (exact mode,
    `ModelConfig.batch_invariant`): each rollout takes the next power of two of its length (at
    most seq_len), and decreasing sizes packed first-fit start each one at a multiple of its own
    power of two, so its keys' sums in the learner's attention follow the same aligned tree as in
    the engine's cache, where position p sits at index p. `fresh_version`: the policy version of
    the learner's weights; `fresh` marks the targets whose whole context it computed too (None:
    `fresh` is None). A token's version is that of the forward that gave its logits, which also
    wrote the previous token's keys: a weight push in the middle of a rollout leaves the keys
    before it in the engine's cache from the older weights, so a token counts only when every
    version up to its own is the learner's (the first one stands for the prompt's prefill).
    """
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} must be >= 2")
    if micro_batches < 1 or row_multiple < 1:
        raise ValueError(f"micro_batches={micro_batches} and row_multiple={row_multiple} must be >= 1")
    kept = usable_rollouts(rollouts, mask_truncated=mask_truncated)
    if not kept:
        raise ValueError(f"none of the {len(rollouts)} rollouts has a loss token to train on")
    routing_shape = None
    for i, r in enumerate(kept):
        if r.advantage is None:
            raise ValueError(f"rollout {i} (group {r.group_id!r}) has no advantage")
        if r.input_len > seq_len:
            raise ValueError(
                f"rollout {i} feeds {r.input_len} tokens (prompt {r.prompt_len} + response "
                f"{r.response_len} - 1), more than seq_len={seq_len}"
            )
        if with_routing:
            if r.routing is None:
                raise ValueError(f"rollout {i} (group {r.group_id!r}) has no routing record; "
                                 "disable routing replay to train on it")
            shape = (r.routing.shape[0], r.routing.shape[2])
            if routing_shape not in (None, shape):
                raise ValueError(f"rollout {i} routing [L, ., k]={shape} differs from {routing_shape}")
            routing_shape = shape

    spans = [min(next_pow2(r.input_len), seq_len) if align_segments else r.input_len
             for r in kept]
    rows = _first_fit_decreasing(spans, seq_len)
    step = micro_batches * row_multiple
    padded = -(-len(rows) // step) * step
    if num_rows is not None:
        if num_rows % step:
            raise ValueError(f"num_rows={num_rows} is not a multiple of micro_batches x "
                             f"row_multiple = {step}")
        if len(rows) > num_rows:
            raise ValueError(f"the rollouts need {len(rows)} rows of {seq_len}, more than "
                             f"num_rows={num_rows}")
        padded = num_rows
    rows += [[] for _ in range(padded - len(rows))]

    n_rows, t = padded, seq_len
    tokens = np.zeros((n_rows, t), np.int32)
    positions = np.zeros((n_rows, t), np.int32)
    segment_ids = np.zeros((n_rows, t), np.int32)
    targets = np.zeros((n_rows, t), np.int32)
    loss_mask = np.zeros((n_rows, t), bool)
    old_logp = np.zeros((n_rows, t), np.float32)
    advantages = np.zeros((n_rows, t), np.float32)
    n_kept = np.zeros((n_rows, t), np.int32)
    temperature = np.ones((n_rows, t), np.float32)
    fresh = None if fresh_version is None else np.zeros((n_rows, t), bool)
    routing = None
    if with_routing:
        num_layers, k = routing_shape
        routing = np.zeros((num_layers, n_rows, t, k), np.int32)
        routing[..., :] = np.arange(k, dtype=np.int32)  # any distinct experts for padding

    for row, members in enumerate(rows):
        start = 0
        for seg, i in enumerate(members, start=1):
            r = kept[i]
            n, p = r.input_len, r.prompt_len
            if align_segments and start % spans[i]:
                raise AssertionError(f"segment at {start} is not aligned to {spans[i]}")
            sl = slice(start, start + n)
            full = np.concatenate([r.prompt_ids, r.response_ids])
            tokens[row, sl] = full[:-1]
            targets[row, sl] = full[1:]
            positions[row, sl] = np.arange(n)
            segment_ids[row, sl] = seg
            # Response token j is predicted at input position p - 1 + j.
            resp = slice(start + p - 1, start + n)
            loss_mask[row, resp] = r.loss_mask
            old_logp[row, resp] = np.where(r.loss_mask, r.logprobs, 0.0)
            n_kept[row, resp] = r.n_kept
            if fresh is not None:
                fresh[row, resp] = np.logical_and.accumulate(r.versions == fresh_version)
            advantages[row, sl] = r.advantage
            if r.temperature > 0:
                temperature[row, sl] = r.temperature
            if routing is not None:
                routing[:, row, sl] = r.routing
            start += spans[i]

    m = micro_batches

    def split(x):  # row i -> micro-batch i % m, so consecutive rows spread over micro-batches
        return np.ascontiguousarray(x.reshape(n_rows // m, m, *x.shape[1:]).swapaxes(0, 1))

    if routing is not None:
        routing = np.ascontiguousarray(
            # Sizes spelled out: a dense model's record is empty ([0, ...]), where -1 is ambiguous.
            routing.reshape(routing.shape[0], n_rows // m, m, t, routing.shape[-1])
            .transpose(2, 0, 1, 3, 4)
        )
    return LearnerBatch(
        tokens=split(tokens), positions=split(positions), segment_ids=split(segment_ids),
        targets=split(targets), loss_mask=split(loss_mask), old_logp=split(old_logp),
        advantages=split(advantages), n_kept=split(n_kept), temperature=split(temperature),
        routing=routing, fresh=None if fresh is None else split(fresh),
        num_tokens=np.float32(loss_mask.sum()),
        num_sequences=np.float32(sum(len(members) for members in rows)),
    )


def to_device(batch: LearnerBatch, mesh: Mesh, batch_axes: Sequence[str] = BATCH_AXES) -> LearnerBatch:
    """Put a numpy batch on `mesh`: rows (dim 1, dim 2 for routing) over `batch_axes`."""
    axes = tuple(a for a in batch_axes if a in mesh.axis_names)
    shards = int(np.prod([mesh.shape[a] for a in axes]))
    rows = batch.tokens.shape[1]
    if rows % shards:
        raise ValueError(f"{rows} rows per micro-batch do not divide over mesh axes {axes} of "
                         f"size {shards}; pack with row_multiple={shards}")
    per_token = NamedSharding(mesh, PartitionSpec(None, axes, None))
    scalar = NamedSharding(mesh, PartitionSpec())

    def put(name, x):
        if x is None:
            return None
        if name == "routing":
            return jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, None, axes)))
        if np.ndim(x) == 0:
            return jax.device_put(x, scalar)
        return jax.device_put(x, per_token)

    return LearnerBatch(**{f.name: put(f.name, getattr(batch, f.name))
                           for f in dataclasses.fields(batch)})


def bucket_rows(rows: int, step: int = 1) -> int:
    """The row count a batch of `rows` packed rows is padded to, then rounded up to a multiple of
    `step`: the next power of two up to 8 rows, above that the next of four sizes per doubling
    (9..16 rows -> 10, 12, 14 or 16; 17..32 -> 20, 24, 28 or 32). Above 8 rows at most a
    quarter of a step's rows are padding, an eighth on average, where padding to the next power
    of two wasted a quarter on average (up to a half); small batches keep one compiled shape per
    doubling, since each new shape is a compile of the train step."""
    if rows < 1 or step < 1:
        raise ValueError(f"rows={rows} and step={step} must be positive")
    top = 1 << (rows - 1).bit_length()  # the power of two >= rows
    grain = top if top <= 8 else top // 8
    padded = max(step, -(-rows // grain) * grain)
    return -(-padded // step) * step
