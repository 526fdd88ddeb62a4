"""Orbax checkpoints of a training state (any pytree of arrays), the data iterator's state and a
JSON description of the model config: async save every N steps and at the end, keep-N, resume
from the latest, and a clear error when a directory belongs to an incompatible model config.

Orbax writes each step into a temporary folder and renames it when complete, so a run that dies
mid-save leaves the previous checkpoint intact. A latest step that is corrupt or partial anyway
(truncated, deleted or overwritten files) is set aside as `corrupt-STEP-...` with a
`CheckpointFallback` warning naming it, and the previous kept step is restored instead. A step
whose weights hold NaN or Inf is refused (NonFiniteWeights, naming the tensors).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from typing import Any

import gin
import jax
import orbax.checkpoint as ocp
from etils import epath

from hcjax.finite import NonFiniteWeights, check_finite


@gin.configurable
@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """save_every: steps between saves (the last step is always saved); keep: newest N kept."""

    save_every: int = 100
    keep: int = 3
    async_save: bool = True

    def __post_init__(self) -> None:
        if self.save_every < 1:
            raise ValueError(f"save_every={self.save_every} must be >= 1")
        if self.keep < 1:
            raise ValueError(f"keep={self.keep} must be >= 1")


class IncompatibleCheckpoint(ValueError):
    """The checkpoint was written by another configuration (not a damaged one: no fallback)."""


class CorruptCheckpoint(RuntimeError):
    """No readable step: every candidate step failed to restore (each one's reason named)."""

    user_error = True  # an entry point reports it in one line (hcjax.config.run_main)


class CheckpointFallback(RuntimeWarning):
    """The latest step could not be read and an older kept step was restored instead."""


def _diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    keys = sorted(set(saved) | set(current))
    return [
        f"{k}: checkpoint has {saved.get(k, '<absent>')!r}, run has {current.get(k, '<absent>')!r}"
        for k in keys
        if saved.get(k) != current.get(k)
    ]


def _keys_like(tree: Any, target: Any) -> Any:
    """Orbax returns integer dict keys (e.g. nnx.List indices) as strings; give them back the
    key types of `target`."""
    if not isinstance(tree, dict) or not isinstance(target, dict):
        return tree
    by_str = {str(k): k for k in target}
    return {by_str.get(str(k), k): _keys_like(v, target.get(by_str.get(str(k), k)))
            for k, v in tree.items()}


def _is_array_metadata(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _aligned(saved: Any, target: Any, where: str) -> Any:
    """The saved metadata tree with each leaf made an abstract array like the matching `target`
    leaf (its dtype and sharding); errors name the first place the structures differ."""
    if isinstance(saved, dict):
        if not isinstance(target, dict):
            raise ValueError(f"{where} has a different structure from this run's (a dict where "
                             f"the run has {type(target).__name__})")
        by_str = {str(k): k for k in target}
        if set(map(str, saved)) != set(by_str):
            extra = sorted(set(map(str, saved)) - set(by_str))[:3]
            missing = sorted(set(by_str) - set(map(str, saved)))[:3]
            raise ValueError(f"{where} has a different structure from this run's (checkpoint "
                             f"only: {extra}, run only: {missing})")
        return {k: _aligned(v, target[by_str[str(k)]], f"{where}/{k}") for k, v in saved.items()}
    if not _is_array_metadata(saved) or not hasattr(target, "shape"):
        raise ValueError(f"{where} has a different structure from this run's")
    if tuple(saved.shape) != tuple(target.shape):
        raise ValueError(f"{where} has shape {tuple(saved.shape)}, this run expects "
                         f"{tuple(target.shape)}")
    sharding = getattr(target, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.ShapeDtypeStruct(saved.shape, target.dtype, sharding=sharding)


def jsonable(obj: Any) -> Any:
    """A JSON-safe copy (dataclasses → dicts, tuples → lists) used to compare model configs."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    return json.loads(json.dumps(obj, default=str))


class Checkpointer:
    """Saves `{"state": pytree, "data": dict, "meta": dict}` per step under `directory`.

    `meta` (e.g. {"model_config": ...}) is written with every step and checked on restore.
    """

    def __init__(self, directory: str, cfg: CheckpointConfig, meta: dict[str, Any]) -> None:
        self.directory = os.path.abspath(directory)
        self.cfg = cfg
        self.meta = jsonable(meta)
        self.restored_step: int | None = None  # the step the last `restore` returned
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            save_interval_steps=1,  # the interval is applied in `save` (no implicit first save)
            enable_async_checkpointing=cfg.async_save,
            create=True,
        )
        # Handlers registered up front: reading item metadata (restore_subtree) then needs no
        # guessing, and Orbax does not warn about items it "could not restore".
        self._mngr = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "data": ocp.JsonCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mngr.all_steps())

    def save(
        self, step: int, state: Any, data_state: dict[str, Any] | None = None, force: bool = False
    ) -> bool:
        """Save if `step` is on the interval (or `force`); returns whether a save started."""
        if not force and step % self.cfg.save_every:
            return False
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state or {}),
            meta=ocp.args.JsonSave(self.meta),
        )
        return self._mngr.save(step, args=args, force=force)

    def read_meta(self, step: int) -> dict[str, Any]:
        """The meta saved with `step` (e.g. its model_config)."""
        saved = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        if not isinstance(saved["meta"], dict):  # a missing or damaged meta item
            raise CorruptCheckpoint(f"checkpoint {self.directory!r} step {step} has no readable "
                                    f"meta (got {type(saved['meta']).__name__})")
        return dict(saved["meta"])

    def check_compatible(self, step: int, keys: tuple[str, ...] | None = None) -> None:
        """Raise if the checkpoint's meta differs from this run's (only `keys` if given)."""
        saved, current = self.read_meta(step), self.meta
        if keys is not None:
            saved = {k: saved.get(k) for k in keys}
            current = {k: current.get(k) for k in keys}
        diff = _diff(saved, current)
        if diff:
            raise IncompatibleCheckpoint(
                f"checkpoint directory {self.directory!r} step {step} was written by an "
                "incompatible configuration: " + "; ".join(diff)
            )

    def restore(
        self, step: int | None, target: Any, *, fallback: bool | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Restore `step` (None = latest) into arrays shaped and sharded like `target` (a pytree
        of arrays or `jax.ShapeDtypeStruct`s). Returns (state, data_state).

        fallback (default: when restoring the latest step): if the step is corrupt or partial,
        warn (CheckpointFallback, naming it), set it aside and restore the newest older kept
        step that reads; `restored_step` says which step came back. A configuration mismatch
        never falls back: it raises IncompatibleCheckpoint; nor do weights that read but hold
        NaN or Inf: NonFiniteWeights names the tensors (an older step of the same run would most
        likely diverge again; the caller decides).
        """
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no checkpoint in {self.directory!r}")
            step = max(steps)
        if step not in steps:
            raise FileNotFoundError(
                f"step={step} is not in {self.directory!r} (has {steps})"
            )
        if fallback is None:
            fallback = step == max(steps)
        candidates = [step] + (sorted((s for s in steps if s < step), reverse=True)
                               if fallback else [])
        failures: dict[int, str] = {}
        for candidate in candidates:
            try:
                state, data = self._restore_step(candidate, target)
            except (IncompatibleCheckpoint, NonFiniteWeights):
                raise
            except Exception as err:  # noqa: BLE001 - any read failure means a damaged step
                why = f"{type(err).__name__}: {err}"
                if not fallback:
                    raise CorruptCheckpoint(f"checkpoint {self.directory!r} step {candidate} "
                                            f"cannot be read: {why[:500]}") from err
                failures[candidate] = why[:300]
                warnings.warn(
                    f"checkpoint {self.directory!r} step {candidate} is corrupt or partial "
                    f"({why[:300]}); falling back to the previous kept step",
                    CheckpointFallback, stacklevel=2)
                continue
            for bad in failures:
                self._set_aside(bad)
            self.restored_step = candidate
            return state, data
        raise CorruptCheckpoint(
            f"no readable checkpoint in {self.directory!r}: "
            + "; ".join(f"step {s}: {why}" for s, why in failures.items()))

    def _restore_step(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        self.check_compatible(step)
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            target,
        )
        out = self._mngr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()
            ),
        )
        check_finite(out["state"], f"checkpoint {self.directory!r} step {step}")
        return out["state"], dict(out["data"] or {})

    def _set_aside(self, step: int) -> None:
        """Rename a damaged step out of Orbax's sight (kept for inspection), so later saves of
        that step number do not collide with it. One process renames; every one reloads."""
        src = os.path.join(self.directory, str(step))
        if jax.process_index() == 0 and os.path.isdir(src):
            dst = os.path.join(self.directory, f"corrupt-{step}-{int(time.time())}")
            try:
                os.rename(src, dst)
            except OSError as err:
                warnings.warn(f"could not set aside corrupt step {src!r}: {err}",
                              CheckpointFallback, stacklevel=3)
        self._mngr.reload()

    def saved_structure(self, step: int) -> Any:
        """The tree of `step`'s saved state with array metadata (shape, dtype) at its leaves,
        read without reading any array."""
        return self._mngr.item_metadata(step)["state"]

    def restore_subtree(self, step: int, key: str, target: Any) -> Any:
        """Only `state[key]` of a checkpoint (e.g. the params of another run, whose optimiser
        state may differ), read straight into the shardings and dtypes of `target`.

        Every other entry is skipped (a partial restore), and each array is read by the
        devices that hold its shards, so no device ever holds the whole subtree: the checkpoint
        may come from another device topology (e.g. a base pre-trained with more devices).
        """
        meta = self.saved_structure(step)
        if key not in meta:
            raise ValueError(f"checkpoint {self.directory!r} step {step} has no {key!r} entry")
        where = f"checkpoint {self.directory!r} step {step}: {key!r}"
        abstract = _aligned(meta[key], target, where)
        item_dir = os.path.join(self.directory, str(step), "state")
        if not os.path.isdir(item_dir):
            raise FileNotFoundError(f"{where}: no state folder at {item_dir!r}")
        restore_args = jax.tree.map(
            lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape,
                                           dtype=a.dtype),
            abstract,
        )
        # A partial restore of the one entry: the rest of the state is never read.
        restored = ocp.PyTreeCheckpointHandler().restore(
            epath.Path(item_dir),
            args=ocp.args.PyTreeRestore(
                item={key: abstract}, restore_args={key: restore_args}, partial_restore=True
            ),
        )
        check_finite(restored[key], f"checkpoint {self.directory!r} step {step} ({key!r})")
        return _keys_like(restored[key], target)

    def wait(self) -> None:
        """Block until pending async saves are on disk."""
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()
