"""A learner spread over several JAX processes: process 0 leads, the others follow in lockstep.

Only the leader (process 0) runs the controller, so only it has rollouts. Every jitted learner
computation spans the mesh of all processes, so every process must run the same ones in the same
order on the same global batch. The leader sends each of its learner calls (train, gather params,
checkpoint save and restore, stop) as a numbered command through the jax.distributed key-value store; the
followers' `follow()` loop runs them in order. A train command carries only the packed rows each
follower's devices hold. This module knows nothing of rollout sources or inference.

CPU multi-process collectives need `jax_cpu_collectives_implementation` = "gloo" (the default in
jax 0.10; with it unset, every cross-process computation fails with "Multiprocess computations
aren't implemented on the CPU backend").
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Mapping, Sequence
from typing import Any

import gin
import jax
import numpy as np
from jax._src import distributed  # no public accessor; Orbax and JAX use the same field
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hcjax.rl import batch as batch_lib
from hcjax.rl.batch import LearnerBatch
from hcjax.rollout.records import Rollout

__all__ = [
    "Command",
    "CommandChannel",
    "CommandTimeout",
    "DistributedLearner",
    "LeaderAborted",
    "batch_shardings",
    "global_batch",
]

LEADER = 0


class CommandTimeout(TimeoutError):
    """A follower waited longer than its timeout for the leader's next command."""


class LeaderAborted(RuntimeError):
    """The leader failed and told its followers to stop."""


@dataclasses.dataclass(frozen=True)
class Command:
    """One lockstep command: its number, kind, small JSON arguments and this process's arrays."""

    seq: int
    kind: str
    args: dict[str, Any]
    arrays: dict[str, np.ndarray]


def _kv_client():
    """The jax.distributed client (the key-value store also used by Orbax and multihost_utils)."""
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            f"jax.process_count()={jax.process_count()} but jax.distributed is not initialised; "
            "call jax.distributed.initialize(coordinator, num_processes, process_id) first"
        )
    return client


def _encode(seq: int, kind: str, args: dict[str, Any], arrays: dict[str, np.ndarray]) -> bytes:
    meta = json.dumps({"seq": seq, "kind": kind, "args": args}).encode()
    buf = io.BytesIO()
    np.savez(buf, __meta__=np.frombuffer(meta, np.uint8), **arrays)
    return buf.getvalue()


def _decode(data: bytes) -> Command:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    meta = json.loads(arrays.pop("__meta__").tobytes())
    return Command(int(meta["seq"]), meta["kind"], meta["args"], arrays)


class CommandChannel:
    """Numbered commands from process 0 to every other process, each read exactly once.

    Command `seq` for process p lives under key `{name}/{seq}/{p}` until p has read it (the
    reader deletes it), so the store holds at most the commands not yet consumed. A follower
    waits at most `timeout_s` for each command, then raises `CommandTimeout`.
    """

    def __init__(self, name: str = "hcjax/learner", timeout_s: float = 3600.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"CommandChannel timeout_s={timeout_s} must be > 0")
        self.name, self.timeout_s = name, timeout_s
        self.process_index, self.process_count = jax.process_index(), jax.process_count()
        self._client = _kv_client() if self.process_count > 1 else None
        self.seq = 0  # the next command's number
        self.last_kind: str | None = None

    @property
    def is_leader(self) -> bool:
        return self.process_index == LEADER

    def send(self, kind: str, args: dict[str, Any] | None = None,
             arrays: dict[int, dict[str, np.ndarray]] | None = None) -> int:
        """Leader: post command `kind` to every follower (`arrays[p]`: process p's arrays)."""
        if not self.is_leader:
            raise RuntimeError(f"process {self.process_index} is a follower; only process "
                               f"{LEADER} sends commands")
        seq = self.seq
        for p in range(self.process_count):
            if p == LEADER:
                continue
            data = _encode(seq, kind, args or {}, (arrays or {}).get(p, {}))
            self._client.key_value_set_bytes(f"{self.name}/{seq}/{p}", data)
        self.seq, self.last_kind = seq + 1, kind
        return seq

    def receive(self) -> Command:
        """Follower: the next command, in order; `CommandTimeout` after `timeout_s`."""
        if self.is_leader:
            raise RuntimeError(f"process {LEADER} leads; it sends commands, not receives them")
        key = f"{self.name}/{self.seq}/{self.process_index}"
        try:
            data = self._client.blocking_key_value_get_bytes(key, int(self.timeout_s * 1000))
        except Exception as err:  # JaxRuntimeError: DEADLINE_EXCEEDED, or the service is gone
            after = (f"after command {self.seq - 1} ({self.last_kind!r})" if self.seq
                     else "before any command")
            if "DEADLINE_EXCEEDED" in str(err):
                raise CommandTimeout(
                    f"learner process {self.process_index} waited {self.timeout_s:g}s for command "
                    f"{self.seq} from the leader (process {LEADER}) {after}; the leader died or "
                    "stalled (raise DistributedLearner.timeout_s if it may legitimately pause "
                    "longer)") from err
            raise RuntimeError(f"learner process {self.process_index} lost the command channel to "
                               f"the leader waiting for command {self.seq} {after}: {err}") from err
        self._client.key_value_delete(key)
        cmd = _decode(data)
        if cmd.seq != self.seq:
            raise RuntimeError(f"command channel {self.name!r} out of order: expected command "
                               f"{self.seq}, got {cmd.seq}")
        self.seq, self.last_kind = self.seq + 1, cmd.kind
        return cmd


# Global batches from host data -----------------------------------------------------------------


def batch_shardings(shapes: dict[str, Sequence[int]], mesh: Mesh,
                    batch_axes: Sequence[str] = batch_lib.BATCH_AXES) -> dict[str, NamedSharding]:
    """Shardings of a learner batch's fields (given by shape; absent fields left out), the layout
    of `batch.to_device`: rows (dim 1; dim 2 for routing) over the batch axes, scalars
    replicated."""
    axes = tuple(a for a in batch_axes if a in mesh.axis_names)
    out = {}
    for name, shape in shapes.items():
        if name == "routing":
            spec = PartitionSpec(None, None, axes)
        elif len(shape) == 0:
            spec = PartitionSpec()
        else:
            spec = PartitionSpec(None, axes, None)
        out[name] = NamedSharding(mesh, spec)
    return out


def _index_key(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A shard's index (tuple of slices) as hashable (start, stop) pairs."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _process_shards(x: np.ndarray, sharding: NamedSharding) -> dict[int, dict[tuple, np.ndarray]]:
    """{process: {index key: block}}: the distinct blocks each process's devices hold."""
    out: dict[int, dict[tuple, np.ndarray]] = {}
    for device, index in sharding.devices_indices_map(x.shape).items():
        key = _index_key(index, x.shape)
        out.setdefault(device.process_index, {}).setdefault(key, np.asarray(x[index]))
    return out


def global_batch(blocks: dict[str, dict[tuple, np.ndarray] | None], shapes: dict[str, tuple],
                 dtypes: dict[str, Any], shardings: dict[str, NamedSharding]) -> LearnerBatch:
    """A global `LearnerBatch` from this process's blocks of every field (None = absent field).

    Each process provides only the shards of its own devices (`make_array_from_callback`), so no
    process needs rows that another one holds.
    """

    def build(name):
        if blocks.get(name) is None:
            return None
        shape, have = tuple(shapes[name]), blocks[name]

        def block(index):
            key = _index_key(index, shape)
            if key not in have:
                raise KeyError(f"batch field {name!r}: this process has no block {key}")
            return np.asarray(have[key], dtypes[name])

        return jax.make_array_from_callback(shape, shardings[name], block)

    return LearnerBatch(**{f.name: build(f.name) for f in dataclasses.fields(LearnerBatch)})


# The learner -----------------------------------------------------------------------------------


@gin.configurable(denylist=["learner"])
class DistributedLearner:
    """A `hcjax.rl.learner.Learner` on a mesh over every process, driven by process 0.

    On the leader it is the controller's learner (hcjax.rl.controller.Learner: `train`) and
    stands in for the learner (`cfg`, `data_parallel_size`, `make_batch`, `step`, `state`):
    `make_batch` packs on the host only, `step` sends each follower its rows, then trains;
    `train` packs as `Learner.train` does (bucketed rows), then steps. `host_params` /
    `local_params`, `save` and `restore` are collective too and are sent the same way: between
    building the learner and `stop`, the leader must run no other computation over the learner
    mesh. Every other process calls `follow(checkpointer)` until the leader calls `stop()` (or
    `abort()`). With one process it is the plain learner plus host-side packing.

    timeout_s bounds a follower's wait for the next command: it must exceed the longest pause of
    the controller between learner calls (rollouts, evals).
    """

    def __init__(self, learner, timeout_s: float = 3600.0, name: str = "hcjax/learner") -> None:
        if timeout_s <= 0:
            raise ValueError(f"DistributedLearner.timeout_s={timeout_s} must be > 0")
        self.learner = learner
        self.mesh: Mesh = learner.mesh
        owners = {d.process_index for d in self.mesh.devices.flat}
        missing = sorted(set(range(jax.process_count())) - owners)
        if missing:
            raise ValueError(
                f"the learner mesh {dict(self.mesh.shape)} has no device of processes {missing} "
                f"(of {jax.process_count()}); every learner process needs devices in it")
        self.channel = CommandChannel(name, timeout_s)
        self.steps = 0
        self._stopped = False

    # The learner's interface -----------------------------------------------------------------

    @property
    def cfg(self):
        return self.learner.cfg

    @property
    def data_parallel_size(self) -> int:
        return self.learner.data_parallel_size

    @property
    def state(self):
        return self.learner.state

    @property
    def is_leader(self) -> bool:
        return self.channel.is_leader

    def make_batch(self, rollouts: Sequence[Rollout], num_rows: int | None = None) -> LearnerBatch:
        """Pack rollouts into a host (numpy) batch for this learner's mesh; `step` places it."""
        return self.learner.pack(rollouts, num_rows)

    def train(self, rollouts: Sequence[Rollout], policy_version: int | None = None
              ) -> Mapping[str, float]:
        """Leader: the controller's step, as `Learner.train` (bucketed rows), run by every
        process; {"skipped": 1.0} when no rollout is usable."""
        batch = self.learner.pack_bucketed(rollouts, policy_version)
        if batch is None:
            return {"skipped": 1.0}
        return {**self.step(batch), "rows": float(batch.rows),
                "train_rollouts": float(batch.num_sequences)}

    def step(self, batch: LearnerBatch | Sequence[Rollout]) -> dict[str, float]:
        """Leader: one train step on a host batch (or rollouts), run by every process."""
        self._check_leader("step")
        if not isinstance(batch, LearnerBatch):
            batch = self.make_batch(batch)
        if any(isinstance(getattr(batch, f.name), jax.Array) for f in dataclasses.fields(batch)):
            raise TypeError("DistributedLearner.step needs a host (numpy) batch from make_batch, "
                            "not a device batch: followers receive the rows from the host copy")
        fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
        shardings = batch_shardings({n: np.shape(x) for n, x in fields.items() if x is not None},
                                    self.mesh)
        shards = {name: _process_shards(np.asarray(x), shardings[name])
                  for name, x in fields.items() if x is not None}
        args = {
            "shapes": {n: list(np.shape(x)) for n, x in fields.items() if x is not None},
            "dtypes": {n: np.asarray(x).dtype.str for n, x in fields.items() if x is not None},
            "blocks": {}, "absent": [n for n, x in fields.items() if x is None],
        }
        per_process: dict[int, dict[str, np.ndarray]] = {}
        for p in range(jax.process_count()):
            if p == LEADER:
                continue
            arrays, keys = {}, {}
            for name, by_process in shards.items():
                keys[name] = []
                for i, (key, block) in enumerate(by_process.get(p, {}).items()):
                    arrays[f"{name}.{i}"] = block
                    keys[name].append([list(k) for k in key])
            per_process[p] = arrays
            args["blocks"][str(p)] = keys
        self.channel.send("train", args, per_process)
        mine = {n: by_process.get(LEADER, {}) for n, by_process in shards.items()}
        return self._train(mine, args)

    def host_params(self):
        """Leader: the full parameters as host numpy arrays (a collective every process runs)."""
        self._check_leader("host_params")
        self.channel.send("gather")
        return self._gather()

    def local_params(self):
        """Leader: the full parameters on this process's part of the learner mesh (same
        PartitionSpecs), for a publisher that serves weights from process 0 alone."""
        local = self.mesh.local_mesh
        return jax.tree.map(
            lambda x, like: jax.device_put(x, NamedSharding(local, like.sharding.spec)),
            self.host_params(), self.learner.state.params)

    def restore(self, checkpointer, step: int) -> dict[str, Any]:
        """Leader: restore `step` into the learner state on every process; returns the data
        state (the leader's; Orbax reads each process's shards)."""
        self._check_leader("restore")
        self.channel.send("restore", {"step": int(step)})
        return self._restore(checkpointer, step)

    def save(self, checkpointer, step: int, data_state: dict[str, Any] | None = None,
             force: bool = False) -> bool:
        """Leader: `checkpointer.save(step, state, data_state, force)` on every process (Orbax
        writes each process's shards; only the primary process writes `data_state`)."""
        self._check_leader("save")
        self.channel.send("save", {"step": int(step), "force": bool(force)})
        return self.learner.save(checkpointer, step, data_state, force=force)

    def stop(self) -> None:
        """Leader: release the followers (their `follow` returns). Idempotent."""
        if self.is_leader and not self._stopped:
            self.channel.send("stop")
            self._stopped = True

    def abort(self, reason: str) -> None:
        """Leader: make every follower raise `LeaderAborted(reason)` instead of waiting."""
        if self.is_leader and not self._stopped:
            self.channel.send("abort", {"reason": str(reason)})
            self._stopped = True

    def __enter__(self) -> DistributedLearner:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.stop()
        else:
            self.abort(f"{exc_type.__name__}: {exc}")

    # Followers --------------------------------------------------------------------------------

    def follow(self, checkpointer=None) -> int:
        """Follower: run the leader's commands in order until `stop`; returns the steps trained.

        Raises `LeaderAborted` if the leader aborts, `CommandTimeout` if it goes silent.
        """
        if self.is_leader:
            raise RuntimeError(f"process {LEADER} leads; only the other processes follow")
        while True:
            cmd = self.channel.receive()
            if cmd.kind in ("save", "restore") and checkpointer is None:
                raise RuntimeError(f"command {cmd.seq}: the leader runs checkpoint {cmd.kind!r} "
                                   "but this follower was given no checkpointer")
            if cmd.kind == "train":
                self._train(self._blocks_of(cmd), cmd.args)
            elif cmd.kind == "gather":
                self._gather()
            elif cmd.kind == "save":
                # Orbax writes `data` on the primary process only; followers pass none.
                self.learner.save(checkpointer, cmd.args["step"], {}, force=cmd.args["force"])
            elif cmd.kind == "restore":
                self._restore(checkpointer, cmd.args["step"])
            elif cmd.kind == "stop":
                return self.steps
            elif cmd.kind == "abort":
                raise LeaderAborted(f"the leader (process {LEADER}) aborted at command "
                                    f"{cmd.seq}: {cmd.args.get('reason')}")
            else:
                raise RuntimeError(f"command {cmd.seq}: unknown kind {cmd.kind!r}")

    # Shared by leader and followers: the same computations in the same order --------------------

    def _blocks_of(self, cmd: Command) -> dict[str, dict[tuple, np.ndarray]]:
        keys = cmd.args["blocks"][str(self.channel.process_index)]
        return {name: {tuple(tuple(b) for b in key): cmd.arrays[f"{name}.{i}"]
                       for i, key in enumerate(blocks)}
                for name, blocks in keys.items()}

    def _train(self, mine, args) -> dict[str, float]:
        shapes = {n: tuple(s) for n, s in args["shapes"].items()}
        dtypes = {n: np.dtype(d) for n, d in args["dtypes"].items()}
        shardings = batch_shardings(shapes, self.mesh)
        blocks = {n: (None if n in args["absent"] else mine.get(n, {}))
                  for n in [f.name for f in dataclasses.fields(LearnerBatch)]}
        batch = global_batch(blocks, shapes, dtypes, shardings)
        metrics = self.learner.step(batch)
        self.steps += 1
        return metrics

    def _restore(self, checkpointer, step: int) -> dict[str, Any]:
        checkpointer.wait()  # a save of this step may still be in flight
        return self.learner.restore(checkpointer, step)

    def _gather(self):
        return multihost_utils.process_allgather(self.learner.state.params, tiled=True)

    def _check_leader(self, what: str) -> None:
        if not self.is_leader:
            raise RuntimeError(f"DistributedLearner.{what} is the leader's (process {LEADER}); "
                               f"process {self.channel.process_index} runs follow()")
        if self._stopped:
            raise RuntimeError(f"DistributedLearner.{what} after stop(): the followers are gone")
