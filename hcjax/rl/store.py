"""The rollout store: every finished group is appended to a JSON-lines file during the climb (token
ids, log-probs, masks, routing, rewards, versions, plus decoded text), and read back to resume a
run or to build a self-distillation set (RECIPE §3). No JAX here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from hcjax.rewards.types import Grade
from hcjax.rl.workers import GroupResult, Task
from hcjax.rollout.records import (
    ROLLOUT_SCHEMA,
    Rollout,
    record_schema,
    rollout_arrays,
    rollout_from_parts,
    rollout_scalars,
)
from hcjax.rollout.request import SampledRollout

__all__ = [
    "RolloutStore",
    "StoredGroup",
    "distillation_conversations",
    "read_groups",
    "rollout_from_json",
    "rollout_to_json",
    "write_distillation_set",
]

GROUPS_FILE = "groups.jsonl"
# Fields a subclass adds to the base Rollout schema (SampledRollout's sampling metadata) are
# nested under this key; its presence is what makes the reader build a SampledRollout.
_SUBCLASS_KEY = "sampled"


def rollout_to_json(r: Rollout) -> dict[str, Any]:
    """A JSON-able dict of every field of a Rollout (or SampledRollout), from its schema.

    Arrays are {"dtype", "shape", "data" (flat, C order)} so that empty ones keep their shape;
    unset optional arrays are null.
    """
    arrays, scalars = rollout_arrays(r), rollout_scalars(r)
    fields = {}
    for spec in record_schema(type(r)):
        if spec.kind != "array":
            fields[spec.name] = scalars[spec.name]
        elif spec.name in arrays:
            fields[spec.name] = _array_to_json(arrays[spec.name])
        else:
            fields[spec.name] = None
    base = {spec.name for spec in ROLLOUT_SCHEMA}
    out = {name: v for name, v in fields.items() if name in base}
    extra = {name: v for name, v in fields.items() if name not in base}
    if extra:
        out[_SUBCLASS_KEY] = extra
    return out


def rollout_from_json(d: Mapping[str, Any], cls: type[Rollout] | None = None) -> Rollout:
    """Inverse of rollout_to_json: a `cls`, by default a SampledRollout when the sampling
    metadata was stored and a Rollout otherwise.

    Also reads lines written before arrays carried their shape (arrays as nested lists; an empty
    routing record as [], which Rollout reshapes to [0, P + R - 1, 0]), and lines that lack a
    field added to the schema since (it takes its default).
    """
    fields = {k: v for k, v in d.items() if k != _SUBCLASS_KEY}
    fields.update(d.get(_SUBCLASS_KEY) or {})
    if cls is None:
        cls = SampledRollout if _SUBCLASS_KEY in d else Rollout
    scalars, arrays = {}, {}
    for spec in record_schema(cls):
        if spec.name not in fields:
            continue
        value = fields.pop(spec.name)
        if spec.kind == "array":
            arrays[spec.name] = None if value is None else _array_from_json(value, spec.name)
        else:
            scalars[spec.name] = value
    scalars.update(fields)  # names outside cls's schema: rollout_from_parts names them
    return rollout_from_parts(scalars, arrays, cls, strict=False)


def _array_to_json(a: np.ndarray) -> dict[str, Any]:
    return {"dtype": a.dtype.name, "shape": list(a.shape), "data": a.ravel().tolist()}


def _array_from_json(value: Any, name: str) -> np.ndarray:
    if isinstance(value, Mapping):
        return np.asarray(value["data"], np.dtype(value["dtype"])).reshape(value["shape"])
    if isinstance(value, list):  # the earlier format: nested lists, shape implied
        return np.asarray(value)
    raise ValueError(f"stored array {name}={value!r:.80} is neither an array object nor a list")


@dataclasses.dataclass
class StoredGroup:
    """One line of the store."""

    task_id: str
    accepted: bool  # entered the learner's buffer (kept by the filters and fresh enough)
    pass_rate: float
    stage: str
    step: int  # learner step when the group finished
    version: int  # inference version when the group finished
    rollouts: list[Rollout]
    prompt_text: str = ""
    response_texts: list[str] = dataclasses.field(default_factory=list)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_group(self, grade: Callable[[Sequence[int]], Grade] | None = None) -> GroupResult:
        """Back to a GroupResult (the task's grader is not stored; pass one if needed)."""
        task = Task(self.task_id, tuple(self.rollouts[0].prompt_ids.tolist()),
                    grade or _no_grader, self.meta)
        return GroupResult(task, list(self.rollouts), True, self.pass_rate, self.stage)


def _no_grader(ids: Sequence[int]) -> Grade:
    raise RuntimeError("this group was read back from the rollout store without a grader")


class RolloutStore:
    """Appends groups to `<directory>/groups.jsonl`, one line each, written and flushed per line,
    so a killed process loses at most the line being written (which readers skip).

    fsync: make lines durable against an operating-system crash or power loss as well, at most
    `fsync_interval_s` seconds after they are written (group commit: one fsync covers every line
    since the last; 0 = an fsync per line). Closing the store fsyncs what is left. An fsync per
    line cost the climb's controller thread about as much time as its learner steps.
    """

    def __init__(
        self,
        directory: str,
        decode: Callable[[Sequence[int]], str] | None = None,
        *,
        fsync: bool = True,
        fsync_interval_s: float = 1.0,
    ) -> None:
        if not isinstance(fsync_interval_s, int | float) or fsync_interval_s < 0:
            raise ValueError(f"fsync_interval_s={fsync_interval_s!r} must be a number >= 0")
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.path = os.path.join(directory, GROUPS_FILE)
        self.decode = decode
        self.fsync = fsync
        self.fsync_interval_s = float(fsync_interval_s)
        self.fsyncs = 0
        self._unsynced = 0
        self._last_fsync = time.monotonic()
        self._lock = threading.Lock()
        _drop_torn_tail(self.path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def append(self, group: GroupResult, *, accepted: bool, step: int, version: int) -> None:
        line = {
            "task_id": group.task.id,
            "accepted": bool(accepted),
            "pass_rate": float(group.pass_rate),
            "stage": group.stage,
            "step": int(step),
            "version": int(version),
            "meta": {k: v for k, v in group.task.meta.items() if _is_json(v)},
            "prompt_text": str(group.task.meta.get("prompt", "")),
            "response_texts": [self._text(r) for r in group.rollouts],
            "rollouts": [rollout_to_json(r) for r in group.rollouts],
        }
        text = json.dumps(line) + "\n"
        with self._lock:
            self._file.write(text)
            self._file.flush()
            self._unsynced += 1
            if self.fsync and time.monotonic() - self._last_fsync >= self.fsync_interval_s:
                self._sync()

    def _sync(self) -> None:
        if self._unsynced:
            os.fsync(self._file.fileno())
            self.fsyncs += 1
        self._unsynced = 0
        self._last_fsync = time.monotonic()

    def _text(self, r: Rollout) -> str:
        if self.decode is None:
            return ""
        ids = r.response_ids.tolist()
        stops = set(getattr(r, "stop_tokens", ()) or ())
        if ids and r.finish_reason == "stop" and (not stops or ids[-1] in stops):
            ids = ids[:-1]  # the stop token is the template's end of turn, re-added by SFT
        return self.decode(ids)

    def close(self) -> None:
        with self._lock:
            if self._file.closed:
                return
            self._file.flush()
            if self.fsync:
                self._sync()
            self._file.close()

    def __enter__(self) -> RolloutStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_json(v: Any) -> bool:
    return isinstance(v, str | int | float | bool) or v is None


def _drop_torn_tail(path: str) -> None:
    """Cut a last line without its newline (a write interrupted by a kill)."""
    if not os.path.isfile(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def _lines(path: str) -> Iterator[dict[str, Any]]:
    if os.path.isdir(path):
        path = os.path.join(path, GROUPS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"rollout store {path!r} does not exist")
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.endswith("\n"):
                return  # torn last line of a killed run
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a stored group ({e.msg})") from e


def read_groups(path: str, *, accepted_only: bool = False, start: int = 0) -> list[StoredGroup]:
    """Groups of a store (a directory or its groups.jsonl), in order; with `accepted_only`, only
    the accepted ones, skipping the first `start` of those."""
    out = []
    seen = 0
    for d in _lines(path):
        if accepted_only and not d["accepted"]:
            continue
        seen += 1
        if seen <= start:
            continue
        out.append(StoredGroup(
            task_id=d["task_id"], accepted=d["accepted"], pass_rate=d["pass_rate"],
            stage=d["stage"], step=d["step"], version=d["version"],
            rollouts=[rollout_from_json(r) for r in d["rollouts"]],
            prompt_text=d.get("prompt_text", ""), response_texts=d.get("response_texts", []),
            meta=d.get("meta", {}),
        ))
    return out


def distillation_conversations(
    path: str,
    *,
    successful_only: bool = True,
    min_step_fraction: float = 0.5,
    max_examples: int | None = None,
    max_per_prompt: int | None = None,
    seed: int = 0,
) -> list[list[dict[str, str]]]:
    """Self-distillation data (RECIPE §3): (prompt, response) conversations from the store.

    Only rollouts from the late part of the climb (learner step >= min_step_fraction x the last
    step seen) are used; successful ones only by default; plain uniform random sampling (no biased
    selection) down to `max_examples`; at most `max_per_prompt` per prompt (more prompts beat
    more samples per prompt).
    """
    if not 0.0 <= min_step_fraction <= 1.0:
        raise ValueError(f"min_step_fraction={min_step_fraction} is not in [0, 1]")
    groups = read_groups(path)
    if not groups:
        raise ValueError(f"rollout store {path!r} holds no groups")
    last = max(g.step for g in groups)
    cutoff = min_step_fraction * last
    rng = random.Random(seed)
    candidates: list[list[dict[str, str]]] = []
    for g in groups:
        if g.step < cutoff or not g.prompt_text:
            continue
        picks = []
        for r, text in zip(g.rollouts, g.response_texts, strict=False):
            if r.aborted or not text:
                continue
            if successful_only and not r.reward_components.get("correct", 0.0) > 0:
                continue
            picks.append([{"role": "user", "content": g.prompt_text},
                          {"role": "assistant", "content": text}])
        if max_per_prompt is not None and len(picks) > max_per_prompt:
            picks = rng.sample(picks, max_per_prompt)
        candidates += picks
    if max_examples is not None and len(candidates) > max_examples:
        candidates = rng.sample(candidates, max_examples)
    rng.shuffle(candidates)
    return candidates


def write_distillation_set(
    path: str,
    out_path: str,
    *,
    base_conversations: Sequence[list[dict[str, str]]] = (),
    base_fraction: float = 0.0,
    seed: int = 0,
    **select: Any,
) -> int:
    """Write a chat JSONL file (`{"messages": [...]}` per line) for `python -m hcjax.sft` with
    DataConfig.source="chat_jsonl", optionally mixing in base (mid-training) conversations so
    they make up `base_fraction` of the lines. Returns the number of lines written."""
    if not 0.0 <= base_fraction < 1.0:
        raise ValueError(f"base_fraction={base_fraction} is not in [0, 1)")
    convs = distillation_conversations(path, seed=seed, **select)
    if not convs:
        raise ValueError(f"no rollout in {path!r} passes the selection {select}")
    if base_fraction > 0:
        want = round(len(convs) * base_fraction / (1.0 - base_fraction))
        if want > len(base_conversations):
            raise ValueError(f"base_fraction={base_fraction} needs {want} base conversations, "
                             f"got {len(base_conversations)}")
        rng = random.Random(seed + 1)
        convs = convs + rng.sample(list(base_conversations), want)
        rng.shuffle(convs)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps({"messages": c}) + "\n")
    return len(convs)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m hcjax.rl.store RUN_OR_STORE_DIR OUT.jsonl [options]`: write the self-distillation
    set of a climb for `python -m hcjax.sft` (DataConfig.source="chat_jsonl")."""
    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("store", help="a climb's output folder, its rollouts/ folder or the file")
    parser.add_argument("out", help="chat JSONL file to write")
    parser.add_argument("--min_step_fraction", type=float, default=0.5)
    parser.add_argument("--max_examples", type=int, default=None)
    parser.add_argument("--max_per_prompt", type=int, default=None)
    parser.add_argument("--all", dest="successful_only", action="store_false",
                        help="keep unsuccessful rollouts too")
    parser.add_argument("--base_fraction", type=float, default=0.0,
                        help="fraction of lines taken from the arithmetic suite's reference "
                        "solutions (the base's own training data)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = args.store
    if os.path.isdir(os.path.join(path, "rollouts")):
        path = os.path.join(path, "rollouts")
    base: list[list[dict[str, str]]] = []
    if args.base_fraction > 0:
        from hcjax.tasks.arithmetic import ArithmeticSuite  # after the flags: --help stays fast

        suite = ArithmeticSuite()
        base = [p.conversation() for p in map(suite.train_problem, range(100_000, 105_000))]
    n = write_distillation_set(
        path, args.out, base_conversations=base, base_fraction=args.base_fraction,
        seed=args.seed, successful_only=args.successful_only,
        min_step_fraction=args.min_step_fraction, max_examples=args.max_examples,
        max_per_prompt=args.max_per_prompt)
    print(json.dumps({"written": n, "out": args.out}))
    return n


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)
