"""The processes and probes of `python -m hcjax.bench.chaos`: child processes with their commands
kept (to restart them) and their output in log files, the replicas, a watch over the climb's
metrics and rollout store read from outside, and the RPC probes (health, metrics, weights state, a
good request). Nothing here asserts: a failed probe is a value."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hcjax.config import cpu_xla_flags

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gin_args(bindings: Sequence[str]) -> list[str]:
    return [arg for b in bindings for arg in ("--gin_param", b)]


def child_env(devices: int, token: str) -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = cpu_xla_flags(devices)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["HCJAX_TOKEN"] = token
    env.pop("HCJAX_TOKEN_FILE", None)
    return env


class Process:
    """A child process with its command kept (to restart it) and its output in log files."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], logs: Path) -> None:
        self.name, self.cmd, self.env, self.logs = name, cmd, env, logs
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        stem = self.logs / f"{self.name}.{self.starts}"
        self.stdout_path, self.stderr_path = Path(f"{stem}.out"), Path(f"{stem}.err")
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=self.env,
                                     stdout=open(self.stdout_path, "w"),  # noqa: SIM115
                                     stderr=open(self.stderr_path, "w"))  # noqa: SIM115

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def alive(self) -> bool:
        """Running, and its main thread has not died (a climb whose main thread raised can hang
        in interpreter shutdown, waiting on a transfer thread)."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        return 'File "<frozen runpy>"' not in self.stderr_tail(20000)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout) if self.proc is not None else None
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """SIGCONT (it may be stopped), then SIGTERM, then SIGKILL."""
        if not self.alive():
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        if self.wait(20) is None:
            self.signal(signal.SIGKILL)
            self.wait(20)

    def stderr_tail(self, n: int = 3000) -> str:
        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stdout_text(self) -> str:
        try:
            return self.stdout_path.read_text(errors="replace")
        except OSError:
            return ""

    def stderr_text(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""


class Replica(Process):
    """`python -m hcjax.serve` on a fixed port of 127.0.0.1 (a restart binds the same one)."""

    def __init__(self, name: str, port: int, token: str, logs: Path, max_prompt: int,
                 max_tokens: int, model: Sequence[str]) -> None:
        cmd = [sys.executable, "-m", "hcjax.serve", "--port", str(port),
               "--gin_file", "climb_tiny.gin", "--max_prefill_length", str(max_prompt),
               "--max_target_length", str(max_prompt + max_tokens + 8),
               "--max_concurrent_decodes", "16", "--version", "-1", "--max_queue", "4096",
               "--max_request_mb", "1024", "--status_every", "3600", *gin_args(model)]
        # after the flags: --help stays fast (this loads JAX)
        from hcjax.transfer.remote import TEST_CORRUPT_NEXT_DELTA_ENV

        env = child_env(2, token)
        # The receiver's test hook: while this file exists, the next delta this replica receives
        # arrives with a byte flipped (hcjax.transfer.remote); `Chaos._corrupt_next_delta` makes it.
        self.corrupt_trigger = logs / f"corrupt-next-delta.{name}"
        env[TEST_CORRUPT_NEXT_DELTA_ENV] = str(self.corrupt_trigger)
        super().__init__(name, cmd, env, logs)
        self.address = f"127.0.0.1:{port}"

    def wait_serving(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if '"event": "serving"' in self.stdout_text():
                return
            if not self.alive():
                break
            time.sleep(0.2)
        raise RuntimeError(f"replica {self.name} ({self.address}) never served:\n"
                           f"{self.stderr_tail()}")


@dataclasses.dataclass
class Seen:
    """A line of a climb file, with the time this bench first saw it."""

    t: float
    record: dict[str, Any]


class ClimbWatch:
    """Tails the climb's metrics.jsonl (learner steps) and rollouts/groups.jsonl (finished groups,
    accepted or not) from a thread, timestamping every new complete line."""

    def __init__(self, out: Path) -> None:
        self.files = {"steps": out / "metrics.jsonl", "groups": out / "rollouts" / "groups.jsonl"}
        self.offsets = {k: 0 for k in self.files}
        self.steps: list[Seen] = []
        self.groups: list[Seen] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="climb-watch")
        self._thread.start()

    def _read(self, key: str) -> list[dict]:
        path = self.files[key]
        try:
            with open(path, "rb") as f:
                f.seek(self.offsets[key])
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offsets[key] += end + 1
        out = []
        for line in data[: end + 1].splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            self.poll()

    def poll(self) -> None:
        steps, groups = self._read("steps"), self._read("groups")
        now = time.monotonic()
        with self._lock:
            self.steps += [Seen(now, r) for r in steps if "reward_mean" in r]
            self.groups += [Seen(now, {"task_id": g["task_id"], "accepted": g["accepted"],
                                       "rollouts": len(g["rollouts"]), "step": g["step"]})
                            for g in groups]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.poll()

    def snapshot(self) -> tuple[list[Seen], list[Seen]]:
        with self._lock:
            return list(self.steps), list(self.groups)

    def last_step(self) -> int:
        with self._lock:
            return self.steps[-1].record["step"] if self.steps else 0

    def steps_after(self, t: float) -> list[Seen]:
        with self._lock:
            return [s for s in self.steps if s.t > t]

    def groups_after(self, t: float) -> list[Seen]:
        with self._lock:
            return [g for g in self.groups if g.t > t]

    def wait(self, predicate: Callable[[], bool], timeout: float, what: str,
             alive: Callable[[], bool] | None = None) -> float:
        """Wait for `predicate`; returns the time it came true. TimeoutError names `what`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return time.monotonic()
            if alive is not None and not alive():
                raise RuntimeError(f"the climb process exited while waiting for {what}")
            time.sleep(0.05)
        raise TimeoutError(f"no {what} within {timeout:.0f} s")

    def wait_steps_after(self, t: float, n: int, timeout: float, alive=None) -> float:
        return self.wait(lambda: len(self.steps_after(t)) >= n, timeout,
                         f"{n} learner steps", alive)


def round_to(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(float(x), nd)


def since(t0: float, seen: list[Seen]) -> float | None:
    return round_to(seen[0].t - t0) if seen else None


def mean_reward(seen: list[Seen]) -> float | None:
    rewards = [s.record["reward_mean"] for s in seen if s.record.get("reward_mean") is not None]
    return round_to(sum(rewards) / len(rewards), 3) if rewards else None


def stepping_after(watch: ClimbWatch, t_fault: float, before: int) -> dict[str, Any]:
    """Whether the climb kept stepping after the fault, and the train reward around it."""
    steps, _ = watch.snapshot()
    prior = [s for s in steps if s.t <= t_fault][-before:]
    after = [s for s in steps if s.t > t_fault]
    return {"kept_stepping": bool(after), "steps_after_fault": len(after),
            "reward_mean_before": mean_reward(prior), "reward_mean_after": mean_reward(after)}


def failures_around(watch: ClimbWatch, t: float, after: bool) -> int:
    """The climb's cumulative worker failure count (requests retried by the rollout workers) at
    the last step line seen before (after=False) or the last seen at all (after=True)."""
    steps, _ = watch.snapshot()
    pick = steps if after else [s for s in steps if s.t <= t]
    return int(pick[-1].record.get("failures", 0)) if pick else 0


# Replicas as the bench sees them ------------------------------------------------------------------


def health_of(address: str, timeout: float = 2.0) -> dict[str, Any] | None:
    # after the flags: --help stays fast (this loads JAX)
    from hcjax.rollout.service import RolloutClient

    try:
        with RolloutClient(address) as client:
            return client.health(timeout=timeout)
    except Exception:  # noqa: BLE001 - down, stopped or refusing: no answer
        return None


def replica_metrics(address: str, timeout: float = 2.0) -> dict[str, Any] | None:
    # after the flags: --help stays fast (this loads JAX)
    from hcjax.rollout.service import RolloutClient

    try:
        with RolloutClient(address) as client:
            return client.metrics(timeout=timeout)
    except Exception:  # noqa: BLE001
        return None


def weights_version(address: str, timeout: float = 2.0) -> int | None:
    # after the flags: --help stays fast (this loads JAX)
    from hcjax.transfer.weights_service import weights_status

    try:
        return int(weights_status(address, timeout=timeout)["version"])
    except Exception:  # noqa: BLE001
        return None


def weights_state(address: str, digests: bool = False,
                   timeout: float = 5.0) -> dict[str, Any] | None:
    """A replica's weights Status: version, served (installed pushes and their kind: full or
    delta), failed (pulls that installed nothing, and why), pulling (the pull in progress)."""
    # after the flags: --help stays fast (this loads JAX)
    from hcjax.transfer.weights_service import weights_status

    try:
        return weights_status(address, digests=digests, timeout=timeout)
    except Exception:  # noqa: BLE001
        return None


def push_kinds(served: list[dict]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for s in served:
        kinds[s.get("mode", "?")] = kinds.get(s.get("mode", "?"), 0) + 1
    return kinds


def good_request(address: str, timeout: float = 60.0) -> dict[str, Any]:
    """One authenticated greedy request; its outcome and the weight versions that produced it."""
    # after the flags: --help stays fast (this loads JAX)
    from hcjax.rollout import GenerateRequest
    from hcjax.rollout.service import RolloutClient

    t0 = time.monotonic()
    try:
        with RolloutClient(address) as client:
            records = client.generate(GenerateRequest(prompt=[1, 2, 3], max_tokens=2,
                                                      temperature=0.0, seed=0), timeout=timeout)
    except Exception as err:  # noqa: BLE001 - reported
        return {"ok": False, "error": f"{type(err).__name__}: {err}"[:300]}
    versions = sorted({int(v) for r in records for v in r.versions.tolist()})
    return {"ok": True, "seconds": round_to(time.monotonic() - t0, 3), "versions": versions}
