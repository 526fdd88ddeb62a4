"""`python -m hcjax.bench.chaos`: the tiny climb in the multi-process placement (a climb process and
two `python -m hcjax.serve` replicas on 127.0.0.1, one shared token; weights by delta sync) with
faults injected one at a time: SIGKILL a replica mid-generation (restarted on its port), SIGSTOP a
replica, kill the learner during a delta weights push (restarted with the same command), corrupt
the latest checkpoint before a restart, malformed and unauthenticated RPCs together with a
corrupted delta push to the other replica (its receiver's test hook flips a byte). For each fault
it measures accepted rollouts lost, retries, time to recover and whether the climb kept stepping;
one JSON object is the last stdout line, progress goes to stderr. It observes the climb only from
outside (files, RPCs, signals) and never asserts: a loss or a hang is reported as measured."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import signal
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from hcjax.bench.chaos_processes import (
    ClimbWatch,
    Process,
    Replica,
    child_env,
    failures_around,
    free_port,
    gin_args,
    good_request,
    health_of,
    push_kinds,
    replica_metrics,
    round_to,
    since,
    stepping_after,
    weights_state,
    weights_version,
)
from hcjax.display import Phases
from hcjax.rpc.auth import open_channel

# A model and task small enough that a climb step takes well under a second on a shared CPU core:
# 1-digit addition in the reasoning template ("<think>51</think><answer>15</answer>", 36 bytes),
# so max_tokens = 40 lets a correct answer finish.
MODEL = [
    "ModelConfig.d_model = 32", "ModelConfig.num_layers = 2", "ModelConfig.num_heads = 2",
    "ModelConfig.num_kv_heads = 1", "ModelConfig.head_dim = 16",
    "ModelConfig.attention_pattern = ('local', 'global')", "ModelConfig.window = 16",
    "ModelConfig.d_ff = 64", "ModelConfig.num_experts = 4", "ModelConfig.moe_latent_dim = 16",
    "ModelConfig.moe_d_ff = 32", "ModelConfig.max_seq_len = 96",
    "ArithmeticSuite.kinds = ('add',)", "ArithmeticSuite.max_digits = 1",
    "ArithmeticSuite.num_heldout = 32", "DataConfig.row_len = 64",
]
SFT = ("ModelConfig", "DataConfig", "TrainerConfig", "AdamWConfig", "ArithmeticSuite")
MAX_PROMPT, MAX_TOKENS = 32, 40
CLIMB = [
    "ClimbConfig.group = 4", "ClimbConfig.early_group = 2",
    "ClimbConfig.early_window = (0.0, 1.0)", "ClimbConfig.full_window = (0.0, 1.0)",
    f"SamplingOptions.max_tokens = {MAX_TOKENS}", f"ClimbConfig.max_prompt_len = {MAX_PROMPT}",
    "ClimbConfig.eval_problems = 32", "ClimbConfig.max_concurrent_decodes = 16",
    "ClimbConfig.max_minutes = None", "ClimbConfig.num_steps = 100000",
    "ControllerConfig.groups_per_batch = 2", "ControllerConfig.num_workers = 4",
    "ControllerConfig.max_inflight = None", "LearnerConfig.seq_len = 96",
    "LearnerConfig.learning_rate = 1e-3",
]
# Weights move every SYNC steps; a checkpoint every CKPT steps, so the last checkpoint usually
# lags the step a learner is killed at, and the restarted learner redoes steps the killed one
# logged (the comparison of "its next step equals an uninterrupted run's").
SYNC, CKPT = 2, 3
# Weights move by delta sync (hcjax.transfer.weights_service.WeightSyncConfig): only what changed
# since the replica's version, with a full push after FULL_EVERY deltas in a row, so the pushes
# the faults meet are mostly deltas.
FULL_EVERY = 3
# The learner-step metrics compared between the killed learner and the restarted one.
COMPARED = ("loss", "policy_loss", "grad_norm", "entropy", "logp_gap_mean", "reward_mean",
            "ratio_mean", "k")


@dataclasses.dataclass(frozen=True)
class Settings:
    """One bench mode: base pre-training steps, climb steps around each fault, stop length."""

    sft_steps: int
    sft_batch: int
    warmup_steps: int
    steps_after_fault: int
    stop_seconds: float
    eval_every: int
    final_steps: int
    timeout: float  # the longest wait for any one thing (a step, a restart, a readmission)


FULL = Settings(sft_steps=300, sft_batch=32, warmup_steps=6, steps_after_fault=6,
                stop_seconds=30.0, eval_every=10, final_steps=10, timeout=600.0)
QUICK = Settings(sft_steps=40, sft_batch=8, warmup_steps=2, steps_after_fault=2,
                 stop_seconds=6.0, eval_every=1000, final_steps=2, timeout=240.0)



# The faults ---------------------------------------------------------------------------------------


class Chaos:
    """The processes of one chaos run and the faults, each a method returning its figures."""

    def __init__(self, work: Path, settings: Settings, phases: Any) -> None:
        self.work, self.s, self.phases = work, settings, phases
        self.token = secrets.token_hex(24)
        os.environ["HCJAX_TOKEN"] = self.token  # this process's clients (health, status)
        os.environ.pop("HCJAX_TOKEN_FILE", None)
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.replicas = [Replica(n, free_port(), self.token, self.logs, MAX_PROMPT, MAX_TOKENS,
                                 MODEL) for n in ("a", "b")]
        self.base = work / "base"
        self.out = work / "climb"
        cmd = [sys.executable, "-m", "hcjax.climb", "--output_dir", str(self.out), "--quiet",
               "--base_checkpoint", str(self.base),
               *gin_args([*MODEL, *CLIMB, f"ClimbConfig.eval_every = {settings.eval_every}",
                      f"ClimbConfig.checkpoint_every = {CKPT}",
                      f"ControllerConfig.sync_every = {SYNC}", "WeightSyncConfig.sync = 'delta'",
                      f"WeightSyncConfig.full_every = {FULL_EVERY}"]),
               *[arg for r in self.replicas for arg in ("--inference_address", r.address)]]
        self.climb = Process("climb", cmd, child_env(2, self.token), self.logs)
        self.watch: ClimbWatch | None = None
        self.fault_marks: dict[str, int] = {}  # fault -> groups seen in the store at the fault

    # Set-up -----------------------------------------------------------------------------------
    def start(self) -> None:
        with self.phases.phase("starting 2 replicas and pre-training the base"):
            for r in self.replicas:
                r.start()
            sft = Process("sft", [sys.executable, "-m", "hcjax.sft", "--output_dir",
                                  str(self.base),
                                  *gin_args([b for b in MODEL if b.startswith(SFT)]),
                                  *gin_args([f"TrainerConfig.num_steps = {self.s.sft_steps}",
                                         f"TrainerConfig.batch_size = {self.s.sft_batch}",
                                         "run_sft.eval_problems = 0"])],
                          child_env(1, self.token), self.logs)
            sft.start()
            if sft.wait(900) != 0:
                raise RuntimeError(f"base pre-training failed:\n{sft.stderr_tail()}")
            for r in self.replicas:
                r.wait_serving()
        with self.phases.phase("starting the climb"):
            self.climb.start()
            self.watch = ClimbWatch(self.out)
            self.watch.wait_steps_after(0.0, self.s.warmup_steps, self.s.timeout, self.climb.alive)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
        for p in [self.climb, *self.replicas]:
            p.stop()

    def _mark(self, fault: str) -> float:
        _, groups = self.watch.snapshot()
        self.fault_marks[fault] = len(groups)
        return time.monotonic()

    def _after(self, t: float, steps: int | None = None) -> None:
        """Let the climb take `steps` (default: steps_after_fault) more steps after `t`."""
        self.watch.wait_steps_after(t, steps or self.s.steps_after_fault, self.s.timeout,
                                    self.climb.alive)

    # (1) ---------------------------------------------------------------------------------------
    def kill_replica(self) -> dict[str, Any]:
        """SIGKILL replica a while it has requests in flight; restart it on its port."""
        rep = self.replicas[0]
        inflight = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # mid-generation: requests in flight on it
            h = health_of(rep.address)
            if h and h.get("inflight", 0) > 0:
                inflight = int(h["inflight"])
                break
            time.sleep(0.05)
        failures0 = failures_around(self.watch, time.monotonic(), after=True)
        t_fault = self._mark("replica_sigkill")
        rep.signal(signal.SIGKILL)
        rep.wait(30)
        self.watch.wait(lambda: bool(self.watch.steps_after(t_fault)), self.s.timeout,
                        "learner step",
                        self.climb.alive)
        # Restart on the same port: readmitted (router) once it holds the current weights.
        t_restart = time.monotonic()
        rep.start()
        rep.wait_serving()
        t_serving = time.monotonic()
        requests0 = (replica_metrics(rep.address) or {}).get("requests_total", 0)

        def readmitted() -> bool:
            m = replica_metrics(rep.address) or {}
            return m.get("version", -1) >= 0 and m.get("requests_total", 0) > requests0

        t_readmitted = self.watch.wait(readmitted, self.s.timeout,
                                       "readmission of the restarted replica",
                                       self.climb.alive)
        served = weights_version(rep.address)
        steps, _ = self.watch.snapshot()
        learner_version = steps[-1].record["version"] if steps else None
        self._after(t_readmitted)
        return {
            "requests_in_flight_at_kill": inflight,
            "worker_retries": failures_around(self.watch, 0, after=True) - failures0,
            "recover_next_learner_step_s": since(t_fault, self.watch.steps_after(t_fault)),
            "recover_next_generation_s": since(t_fault, self.watch.groups_after(t_fault)),
            "restart_to_serving_s": round_to(t_serving - t_restart),
            "restart_to_readmitted_s": round_to(t_readmitted - t_restart),
            "readmitted_with_version": served,
            "learner_version_at_readmission": learner_version,
            **stepping_after(self.watch, t_fault, self.s.steps_after_fault),
        }

    # (2) ---------------------------------------------------------------------------------------
    def stop_replica(self) -> dict[str, Any]:
        """SIGSTOP replica b for stop_seconds, then SIGCONT. If no learner step has finished by
        then (a train-step compile or a slow, shared machine can take longer than the quick
        mode's window), the replica stays stopped until one does, for at most a minute more:
        the question is whether the learner steps on while a replica is stopped, not how
        fast."""
        rep = self.replicas[1]
        inflight = (health_of(rep.address) or {}).get("inflight")
        failures0 = failures_around(self.watch, time.monotonic(), after=True)
        t_fault = self._mark("replica_sigstop")
        rep.signal(signal.SIGSTOP)
        time.sleep(self.s.stop_seconds)
        try:
            self.watch.wait(lambda: bool(self.watch.steps_after(t_fault)), 60,
                            "a learner step while the replica is stopped", self.climb.alive)
        except TimeoutError:
            pass  # reported as learner_steps_during_stop = 0
        stopped_s = time.monotonic() - t_fault
        steps_during = len(self.watch.steps_after(t_fault))
        groups_during = len(self.watch.groups_after(t_fault))
        t_cont = time.monotonic()
        rep.signal(signal.SIGCONT)
        requests0 = (replica_metrics(rep.address, timeout=30) or {}).get("requests_total", 0)

        def serving_again() -> bool:
            m = replica_metrics(rep.address) or {}
            h = health_of(rep.address) or {}
            return h.get("status") == "SERVING" and m.get("requests_total", 0) > requests0

        try:
            t_back = self.watch.wait(serving_again, 300, "new requests on the resumed replica",
                                     self.climb.alive)
        except TimeoutError:
            t_back = None
        self._after(t_cont)
        return {
            "stopped_s": round_to(stopped_s),
            "requests_in_flight_at_stop": inflight,
            "learner_steps_during_stop": steps_during,
            "groups_finished_during_stop": groups_during,
            "worker_retries": failures_around(self.watch, 0, after=True) - failures0,
            "recover_next_learner_step_s": since(t_fault, self.watch.steps_after(t_fault)),
            "recover_next_generation_s": since(t_fault, self.watch.groups_after(t_fault)),
            "cont_to_taking_requests_s": None if t_back is None else round_to(t_back - t_cont),
            **stepping_after(self.watch, t_fault, self.s.steps_after_fault),
        }

    # (5) ---------------------------------------------------------------------------------------
    def bad_rpcs(self) -> dict[str, Any]:
        """Malformed and unauthenticated RPCs to replica a during the climb; after each, one good
        authenticated request. Meanwhile replica b receives a corrupted delta push
        (`corrupted_delta`, checked after the RPCs)."""
        # after the flags: --help stays fast (this loads JAX)
        from hcjax.rollout import GenerateRequest
        from hcjax.rollout.service import _request_to_bytes
        from hcjax.rollout.wire import encode

        rep = self.replicas[0]
        auth = (("authorization", f"Bearer {self.token}"),)
        wrong = (("authorization", "Bearer " + "0" * 48),)
        good = _request_to_bytes(GenerateRequest(prompt=[1, 2], max_tokens=2, seed=0))

        def msg(options: dict, **kw) -> bytes:
            return encode({"options": {"prompt": [1, 2], "max_tokens": 2, **options},
                           "continue_from": []}, **kw)

        def header(obj: bytes) -> bytes:
            return b"HCJ1" + struct.pack("<I", len(obj)) + obj

        cases = [  # (what, method, payload, metadata, expected status)
            ("no token", "Generate", good, None, "UNAUTHENTICATED"),
            ("wrong token", "Generate", good, wrong, "UNAUTHENTICATED"),
            ("Health without token", "Health", b"", None, "UNAUTHENTICATED"),
            ("Metrics with a wrong token", "Metrics", b"", wrong, "UNAUTHENTICATED"),
            ("temperature NaN", "Generate", msg({"temperature": float("nan")}), auth,
             "INVALID_ARGUMENT"),
            ("n = 10**9", "Generate", msg({"n": 10**9}), auth, "INVALID_ARGUMENT"),
            ("float token ids", "Generate", msg({"prompt": [1.0, 2.0]}), auth,
             "INVALID_ARGUMENT"),
            ("token id past the vocabulary", "Generate", msg({"prompt": [2**40]}), auth,
             "INVALID_ARGUMENT"),
            ("prompt too long", "Generate", msg({"prompt": list(range(200))}), auth,
             "INVALID_ARGUMENT"),
            ("unknown option", "Generate", msg({"beam": 2}), auth, "INVALID_ARGUMENT"),
            ("empty message", "Generate", b"", auth, "INVALID_ARGUMENT"),
            ("length past the message", "Generate",
             b"HCJ1" + struct.pack("<I", 1 << 30) + b"{}", auth, "INVALID_ARGUMENT"),
            ("not JSON", "Generate", header(b"\xff\xfe{}"), auth, "INVALID_ARGUMENT"),
            ("nested too deeply", "Generate", header(b"[" * 100_000), auth, "INVALID_ARGUMENT"),
            ("bad array header", "Generate", header(b'{"arrays": [["a", "float64", [1]]]}'),
             auth, "INVALID_ARGUMENT"),
        ]
        t_fault = self._mark("bad_rpcs")
        armed = self._corrupt_next_delta()
        results = []
        with grpc.insecure_channel(rep.address) as channel:
            for what, method, payload, metadata, expected in cases:
                try:
                    if method == "Generate":
                        list(channel.unary_stream(f"/hcjax.Rollout/{method}")(
                            payload, timeout=30, metadata=metadata))
                    else:
                        channel.unary_unary(f"/hcjax.Rollout/{method}")(
                            payload, timeout=30, metadata=metadata)
                    code, details = "OK", ""
                except grpc.RpcError as err:
                    code, details = err.code().name, err.details() or ""
                after = good_request(rep.address)
                results.append({"what": what, "status": code, "expected": expected,
                                "rejected": code == expected, "reason": details[:120],
                                "good_request_after": after["ok"],
                                "good_request_seconds": after.get("seconds")})
        codes: dict[str, int] = {}
        for r in results:
            codes[r["status"]] = codes.get(r["status"], 0) + 1
        health = health_of(rep.address) or {}
        return {
            "sent": len(results),
            "rejected": sum(r["rejected"] for r in results),
            "status_codes": codes,
            "good_request_succeeded_after_each": all(r["good_request_after"] for r in results),
            "replica_serving_after": health.get("status") == "SERVING",
            "cases": results,
            "corrupted_delta": self._check_corrupted_delta(armed),
            **stepping_after(self.watch, t_fault, self.s.steps_after_fault),
        }

    def _corrupt_next_delta(self) -> dict[str, Any]:
        """Arm replica b's test hook (its next delta arrives with a byte flipped) and watch its
        weights Status from a thread until `_check_corrupted_delta`."""
        rep = self.replicas[1]
        state = weights_state(rep.address) or {}
        armed = {"t": time.monotonic(), "served": len(state.get("served", [])),
                 "failed": len(state.get("failed", [])), "stop": threading.Event()}
        armed["polls"] = [(armed["t"], state.get("version"), [], [])]

        def poll() -> None:
            while not armed["stop"].wait(0.05):
                st = weights_state(rep.address, timeout=2.0)
                if st is not None:
                    armed["polls"].append((time.monotonic(), st["version"],
                                           st["failed"][armed["failed"]:],
                                           st["served"][armed["served"]:]))

        rep.corrupt_trigger.touch()
        armed["thread"] = threading.Thread(target=poll, daemon=True, name="corrupt-delta-watch")
        armed["thread"].start()
        return armed

    def _check_corrupted_delta(self, armed: dict[str, Any]) -> dict[str, Any]:
        """The replica refused the corrupted delta (DATA_LOSS), kept serving its previous version
        and installed the same version from the full push that followed; it and the other
        replica then hold the same weights at the same version, and generation goes on."""
        rep, other = self.replicas[1], self.replicas[0]

        def refused() -> dict | None:
            for t, _, failed, _ in list(armed["polls"]):
                for f in failed:
                    if f["mode"] == "delta":
                        return {"t": t, **f}
            return None

        def reinstalled() -> bool:
            f = refused()
            return f is not None and any(s["version"] == f["version"]
                                         for _, _, _, served in armed["polls"][-1:]
                                         for s in served)

        try:
            self.watch.wait(reinstalled, self.s.timeout,
                            "a corrupted delta refused and its version installed whole",
                            self.climb.alive)
        finally:
            armed["stop"].set()
            armed["thread"].join(5)
            self.replicas[1].corrupt_trigger.unlink(missing_ok=True)
        fail = refused()
        version, t_refused = fail["version"], fail["t"]
        served = armed["polls"][-1][3]
        installs = [s["mode"] for s in served if s["version"] == version]
        earlier = [v for t, v, _, _ in armed["polls"] if t < t_refused]
        # Status polls after the refusal and before the version was installed: the version each
        # reported, and any poll that reported the refused version before its full push landed.
        after = [(v, sv) for t, v, _, sv in armed["polls"] if t >= t_refused]
        waiting = sorted({v for v, sv in after if not any(s["version"] == version for s in sv)})
        early = sum(1 for v, sv in after if v == version
                    and not any(s["version"] == version and s["mode"] == "full" for s in sv))
        warning = next((line.strip()[:300] for line in self.climb.stderr_text().splitlines()
                        if f"weights version {version}: the delta to {rep.address} was refused"
                        in line), "")
        # Both replicas at one version (they usually are between pushes): the same weights.
        same = None
        for _ in range(20):
            sa, sb = weights_state(other.address, True), weights_state(rep.address, True)
            if sa and sb and sa["version"] == sb["version"] >= version:
                same = {"version": sb["version"], "equal": sa["digests"] == sb["digests"]}
                break
            time.sleep(0.1)
        self.watch.wait(lambda: bool(self.watch.steps_after(t_refused))
                        and bool(self.watch.groups_after(t_refused)), self.s.timeout,
                        "a learner step and a group after the corrupted delta", self.climb.alive)
        answer = good_request(rep.address)
        return {
            "replica": rep.name, "version": version, "base": fail.get("base"),
            "refused": fail["why"][:200], "climb_log": warning,
            "answered_data_loss": "DATA_LOSS" in warning and "ChecksumMismatch" in fail["why"],
            "installs_of_version": installs,
            "version_reported_before": earlier[-1] if earlier else None,
            "reported_versions_while_refused": waiting,
            "polls_reporting_version_before_its_full_push": early,
            "never_served_half_applied": installs == ["full"] and early == 0
                                         and all(v < version for v in waiting),
            "same_weights_as_other_replica": same,
            "learner_steps_after": len(self.watch.steps_after(t_refused)),
            "groups_after": len(self.watch.groups_after(t_refused)),
            "good_request_after": answer["ok"], "its_answer_versions": answer.get("versions"),
        }

    # (3) ---------------------------------------------------------------------------------------
    def kill_learner_in_transfer(self) -> dict[str, Any]:
        """SIGKILL the climb inside a delta weights push: as soon as a replica installs the new
        version or starts pulling it as a delta, the learner is frozen (SIGSTOP); if a replica
        still lacks it a second later and is pulling it as a delta (its pull waits on the frozen
        learner) the learner is killed, else resumed and the next push tried. Then the same command
        is restarted; it holds no base version, so its first push to that replica is a full one."""
        # after the flags: --help stays fast (this loads JAX)
        from hcjax.transfer.weights_service import WEIGHTS_SERVICE

        channels = {r.address: open_channel(r.address) for r in self.replicas}
        status = {a: c.unary_unary(f"/{WEIGHTS_SERVICE}/Status") for a, c in channels.items()}

        def state_of(address: str) -> dict:
            try:
                return json.loads(status[address](b"{}", timeout=2.0))
            except grpc.RpcError:
                return {}

        def version_of(address: str) -> int | None:
            return state_of(address).get("version")

        def pulling_delta(state: dict, version: int) -> bool:
            pulling = state.get("pulling") or {}
            return pulling.get("mode") == "delta" and pulling.get("version") == version

        attempt, tries = None, 0
        try:
            while attempt is None and tries < 40:
                tries += 1
                # A step s after which the next step pushes, and which lies after the last
                # checkpoint (so the restarted learner redoes it: it can be compared).
                last = self.watch.last_step()
                target = next(s for s in range(last + 1, last + 2 * SYNC * CKPT + 2)
                              if (s + 1) % SYNC == 0 and s % CKPT != 0)
                self.watch.wait(lambda t=target: self.watch.last_step() >= t, self.s.timeout,
                                f"learner step {target}", self.climb.alive)
                if self.watch.last_step() != target:
                    continue  # overshot: try the next one
                version = int(self.watch.snapshot()[0][-1].record["version"])
                frozen = False
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and self.watch.last_step() == target:
                    # a replica has the new version, or has started pulling it as a delta
                    states = [state_of(a) for a in status]
                    if any(st.get("version") == version + 1 or pulling_delta(st, version + 1)
                           for st in states):
                        self.climb.signal(signal.SIGSTOP)
                        frozen = True
                        break
                if not frozen:
                    continue
                time.sleep(1.0)
                states = {a: state_of(a) for a in status}
                versions = {a: st.get("version") for a, st in states.items()}
                # the replicas still on the old version whose delta pull of the new one waits on
                # the frozen learner
                behind = [a for a, st in states.items()
                          if st.get("version") == version and pulling_delta(st, version + 1)]
                state = states[behind[0]] if behind else {}
                pulling = state.get("pulling") or {}
                if behind and self.watch.last_step() == target:
                    ahead = [a for a in versions if a not in behind]
                    attempt = {"after_step": target, "old_version": version,
                               "new_version": version + 1, "tries": tries,
                               "interrupted_push": {
                                   "replica": next(r.name for r in self.replicas
                                                   if r.address == behind[0]),
                                   "version": pulling["version"], "mode": pulling["mode"],
                                   "base": pulling.get("base")},
                               "behind": behind[0], "ahead": ahead[0] if ahead else None,
                               "served_before": len(state.get("served", [])),
                               "failed_before": len(state.get("failed", []))}
                else:
                    self.climb.signal(signal.SIGCONT)  # the push had finished: try the next
        finally:
            for c in channels.values():
                c.close()
        if attempt is None:
            return {"error": f"could not catch the learner inside a weights push in {tries} "
                             "tries"}
        t_fault = self._mark("learner_kill_in_transfer")
        self.climb.signal(signal.SIGKILL)
        self.climb.wait(30)
        # The push failed mid-way: the replica that never got the new version serves the old
        # one (checked again 5 s later: its pull fails with the learner gone).
        behind, ahead = attempt.pop("behind"), attempt.pop("ahead")
        served0, failed0 = attempt.pop("served_before"), attempt.pop("failed_before")
        time.sleep(1.0)
        served_b = weights_version(behind)
        good_b = good_request(behind)
        good_a = good_request(ahead) if ahead else {}
        time.sleep(5.0)
        served_b_later = weights_version(behind)
        killed_steps = [s.record for s in self.watch.snapshot()[0]]
        t_restart = time.monotonic()
        self.climb.start()
        restart = self._await_restart(t_restart)
        redone = self._compare_redone(killed_steps, restart, t_restart)
        # The replica's record of the interrupted pull, and of the pushes since the restart.
        try:
            self.watch.wait(lambda: len((weights_state(behind) or {}).get("served", []))
                            > served0, self.s.timeout, "a push after the restart",
                            self.climb.alive)
        except (TimeoutError, RuntimeError):
            pass  # reported as no push
        state = weights_state(behind) or {}
        new = state.get("served", [])[served0:]
        attempt["interrupted_push"]["pull_failed"] = [
            {"version": f["version"], "mode": f["mode"], "why": f["why"][:160]}
            for f in state.get("failed", [])[failed0:]]
        return {
            **attempt,
            "during_failed_transfer": {
                "replica_without_new_version_serves": served_b,
                "its_answer_versions": good_b.get("versions"),
                "serves_5s_later": served_b_later,
                "other_replica_answer_versions": good_a.get("versions"),
                "keeps_serving_old_version": (good_b["ok"] and served_b == attempt["old_version"]
                                              and served_b_later == attempt["old_version"]
                                              and good_b.get("versions") ==
                                              [attempt["old_version"]]),
            },
            "first_push_after_restart": ({"version": new[0]["version"], "mode": new[0]["mode"]}
                                         if new else None),
            "pushes_after_restart": push_kinds(new),
            **restart,
            "recover_next_learner_step_s": since(t_fault, self.watch.steps_after(t_fault)),
            "next_step_equals_uninterrupted": redone,
            **stepping_after(self.watch, t_fault, self.s.steps_after_fault),
        }

    def _await_restart(self, t_restart: float) -> dict[str, Any]:
        """After restarting the climb: the step it resumed from (its first new step - 1), the
        time to its first step, and what it said about checkpoints on stderr."""
        try:
            t_step = self.watch.wait(lambda: bool(self.watch.steps_after(t_restart)),
                                     self.s.timeout,
                                     "learner step after the restart", self.climb.alive)
        except (TimeoutError, RuntimeError) as err:
            return {"restarted": False, "error": str(err),
                    "climb_stderr": self.climb.stderr_tail(1500)}
        first = self.watch.steps_after(t_restart)[0].record["step"]
        self._after(t_restart)
        stderr = self.climb.stderr_tail(20000)
        dropped = [line.strip()[:200] for line in stderr.splitlines()
                   if "dropped from weight sync" in line]
        return {"restarted": True, "resumed_from_step": first - 1,
                "restart_to_first_step_s": round_to(t_step - t_restart),
                "replicas_dropped_after_restart": dropped}

    def _compare_redone(self, killed: list[dict], restart: dict[str, Any],
                        t_restart: float) -> dict[str, Any]:
        """Steps the killed learner logged after its last checkpoint, redone by the restarted
        one from that checkpoint on the same accepted groups (read back from the store)."""
        if not restart.get("restarted"):
            return {"compared_steps": [], "note": "the climb did not restart"}
        resumed = restart["resumed_from_step"]
        mine = {r["step"]: r for r in killed if r["step"] > resumed}
        again = {}
        for s in self.watch.steps_after(t_restart):
            if s.record["step"] in mine:
                again.setdefault(s.record["step"], s.record)
        common = sorted(set(mine) & set(again))
        diffs = {}
        for key in COMPARED:
            pairs = [(mine[s].get(key), again[s].get(key)) for s in common]
            pairs = [(x, y) for x, y in pairs if x is not None and y is not None]
            if pairs:
                diffs[key] = max(abs(float(x) - float(y)) for x, y in pairs)
        return {"compared_steps": common, "max_abs_diff": diffs,
                "equal": bool(common) and all(d == 0.0 for d in diffs.values())}

    # (4) ---------------------------------------------------------------------------------------
    def corrupt_checkpoint(self) -> dict[str, Any]:
        """Let the climb write a checkpoint, kill it, damage its latest step (every data file
        cut to half) and restart: it should warn naming the step and resume from the previous
        kept one."""
        ckpts = self.out / "checkpoints"

        def steps() -> list[int]:
            return sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())

        t0 = time.monotonic()
        self.watch.wait(lambda: len(self.watch.steps_after(t0)) >= CKPT + 1, self.s.timeout,
                        "a new checkpoint", self.climb.alive)
        time.sleep(1.0)  # let an asynchronous save commit
        self.climb.signal(signal.SIGKILL)
        self.climb.wait(30)
        kept = steps()
        if len(kept) < 2:
            return {"error": f"need two kept checkpoints to fall back, have {kept}"}
        bad, previous = kept[-1], kept[-2]
        damaged = 0
        for p in (ckpts / str(bad)).rglob("*"):
            if p.is_file() and p.parent.name == "d":
                with open(p, "r+b") as f:
                    f.truncate(p.stat().st_size // 2)
                damaged += 1
        t_fault = self._mark("corrupt_checkpoint")
        self.climb.start()
        restart = self._await_restart(t_fault)
        # The whole log: orbax's failed restore can print dozens of "Event loop is closed"
        # tracebacks after the warning (measured: 58 kB on a loaded machine).
        stderr = self.climb.stderr_text()
        warning = next((line.strip() for line in stderr.splitlines()
                        if "CheckpointFallback" in line or "is corrupt or partial" in line), "")
        return {
            "corrupted_step": bad, "data_files_truncated": damaged, "previous_kept_step": previous,
            **restart,
            "fell_back_to_previous": restart.get("resumed_from_step") == previous,
            "warning_names_bad_step": f"step {bad} is corrupt" in warning,
            "warning": warning[:300],
            "set_aside": sorted(p.name for p in ckpts.glob(f"corrupt-{bad}-*")),
            "recover_next_learner_step_s": since(t_fault, self.watch.steps_after(t_fault)),
            **stepping_after(self.watch, t_fault, self.s.steps_after_fault),
        }

    # End ----------------------------------------------------------------------------------------
    def finish(self) -> dict[str, Any]:
        """Ctrl-C the climb (it ends as a finished climb does: final evaluation, summary) and
        account for every accepted group the store holds."""
        # after the flags: --help stays fast (this loads JAX)
        from hcjax.rl.store import read_groups

        self._after(time.monotonic(), self.s.final_steps)
        # Each replica's installed pushes by kind since it (re)started, and its failed pulls.
        pushes = {}
        for r in self.replicas:
            state = weights_state(r.address) or {}
            pushes[r.name] = {"installed": push_kinds(state.get("served", [])),
                              "failed": [{"version": f["version"], "mode": f["mode"],
                                          "why": f["why"].split(":")[0]}
                                         for f in state.get("failed", [])]}
        self.climb.signal(signal.SIGINT)
        code = self.climb.wait(600)
        self.watch.close()
        summary_path = self.out / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        stored = read_groups(str(self.out / "rollouts"))
        accepted = [g for g in stored if g.accepted]
        consumed = summary.get("accepted_groups_consumed")
        buffered = summary.get("buffered_groups")
        lost_groups = (None if consumed is None else len(accepted) - consumed - buffered)
        # Every fault: the groups the bench saw logged before it are still the store's first
        # lines, in order, with the same accepted flag.
        _, seen = self.watch.snapshot()
        per_fault = {}
        for fault, n in self.fault_marks.items():
            before = [(g.record["task_id"], g.record["accepted"]) for g in seen[:n]]
            now = [(g.task_id, g.accepted) for g in stored[:n]]
            missing = [i for i, (x, y) in enumerate(zip(before, now + [None] * n)) if x != y]
            per_fault[fault] = {
                "accepted_before_fault": sum(a for _, a in before),
                "accepted_rollouts_missing_after": sum(
                    seen[i].record["rollouts"] for i in missing if seen[i].record["accepted"]),
            }
        evals = [{"step": e["step"], "pass_at_1": e["pass_at_1"]}
                 for e in summary.get("evals", [])]
        return {
            "climb_exit_code": code,
            "weight_pushes": pushes,
            "steps": summary.get("steps"),
            "base_pass_at_1": summary.get("base_pass_at_1"),
            "final_pass_at_1": summary.get("final_pass_at_1"),
            "evals": evals,
            "store_accepted_groups": len(accepted),
            "store_accepted_rollouts": sum(len(g.rollouts) for g in accepted),
            "accepted_groups_consumed": consumed,
            "buffered_groups": buffered,
            "accepted_groups_lost": lost_groups,
            "accepted_rollouts_lost": (None if lost_groups is None else
                                       lost_groups * (len(accepted[0].rollouts)
                                                      if accepted else 0)),
            "per_fault": per_fault,
        }


def run(settings: Settings, work: Path, scenarios: Sequence[str]) -> dict[str, Any]:
    phases = Phases("hcjax.bench.chaos")
    chaos = Chaos(work, settings, phases)
    faults: dict[str, Any] = {}
    t0 = time.monotonic()
    methods = {"replica_sigkill": chaos.kill_replica, "replica_sigstop": chaos.stop_replica,
               "bad_rpcs": chaos.bad_rpcs,
               "learner_kill_in_transfer": chaos.kill_learner_in_transfer,
               "corrupt_checkpoint": chaos.corrupt_checkpoint}
    end: dict[str, Any] = {}
    try:
        chaos.start()
        with phases.phase("injecting faults", total=len(scenarios)) as phase:
            for name in scenarios:
                phase.now(name)
                t_fault = time.monotonic()
                try:
                    faults[name] = methods[name]()
                except Exception as err:  # noqa: BLE001 - a hang or crash is a result
                    faults[name] = {"error": f"{type(err).__name__}: {err}"[:500],
                                    "climb_alive": chaos.climb.alive(),
                                    "climb_stderr": chaos.climb.stderr_tail(1500)}
                faults[name]["fault_seconds"] = round_to(time.monotonic() - t_fault, 1)
                print(json.dumps({"fault": name, **faults[name]}), file=sys.stderr, flush=True)
                phase.advance()
                if not chaos.climb.alive():
                    break
        with phases.phase("finishing the climb"):
            if chaos.climb.alive():
                end = chaos.finish()
            else:
                end = {"error": "the climb process is not running",
                       "climb_stderr": chaos.climb.stderr_tail(1500)}
    finally:
        chaos.close()
    for name, figures in faults.items():
        figures.update(end.get("per_fault", {}).get(name, {}))
    return {"bench": "chaos", "wall_seconds": round_to(time.monotonic() - t0, 1),
            "token_auth": True, "work_dir": str(work),
            "faults": faults, "climb": {k: v for k, v in end.items() if k != "per_fault"}}


SCENARIOS = ("replica_sigkill", "replica_sigstop", "bad_rpcs", "learner_kill_in_transfer",
             "corrupt_checkpoint")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="CI size: a short base, 2 steps after each fault, a 6 s SIGSTOP")
    parser.add_argument("--stop_seconds", type=float, default=None,
                        help="how long replica b stays SIGSTOPped (default 30, quick 6)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated, in order, from {SCENARIOS}")
    parser.add_argument("--work_dir", default=None, help="default: a new temporary folder")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.stop_seconds is not None:
        settings = dataclasses.replace(settings, stop_seconds=args.stop_seconds)
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(f"--scenarios has {unknown}; expected names from {SCENARIOS}")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_chaos_"))
    result = {"mode": "quick" if args.quick else "full",
              **run(settings, work, scenarios)}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)
