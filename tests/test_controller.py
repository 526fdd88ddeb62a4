"""Controller, problem and rollout workers with a stub inference server and a stub learner: the
staleness bound, weight pushes every N steps, early exit, retries, aborted samples, partial
rollouts, and the rollout store (resume without losing an accepted group; distillation set)."""

import json
import threading

import numpy as np
import pytest

from hcjax.rl.controller import Controller, ControllerConfig, oldest_version, staleness
from hcjax.rl.curriculum import EarlyExit
from hcjax.rl.sources import PrioritizedSource, SequentialSource
from hcjax.rl.store import (
    RolloutStore,
    distillation_conversations,
    read_groups,
    rollout_from_json,
    rollout_to_json,
    write_distillation_set,
)
from hcjax.rl.workers import (
    Grade,
    GroupResult,
    PartialRegistry,
    ProblemWorker,
    RolloutWorker,
    Task,
    WorkerStats,
)
from hcjax.rollout.records import Rollout
from hcjax.rollout.request import SampledRollout, SamplingOptions

STOP, RIGHT, WRONG, FILL = 0, 1, 2, 3


def record(prompt, tokens, versions, reason="stop", *, partial=False, index=0, max_tokens=8,
           prior=None):
    if prior is not None:
        tokens = list(prior.response_ids) + list(tokens)
        versions = list(prior.versions) + list(versions)
    n = len(tokens)
    return SampledRollout(
        prompt_ids=np.asarray(prompt), response_ids=np.asarray(tokens),
        logprobs=np.full(n, -0.5), n_kept=np.zeros(n), threshold_logit=np.zeros(n),
        loss_mask=np.ones(n, bool), versions=np.asarray(versions), finish_reason=reason,
        sample_index=index, max_tokens=max_tokens, stop_tokens=(STOP,), partial=partial,
    )


class FakeServer:
    """Answers with [RIGHT|WRONG, FILL, FILL, STOP]; a prompt's first token sets P(RIGHT) in
    tenths. `lag` pretends the served weights are older than `version`. Scripted failures:
    `raise_first` calls raise; `bad_reasons` is a list of finish reasons given to the next
    samples. Supports token budgets and continuations like the real server."""

    def __init__(self, raise_first=0, bad_reasons=()):
        self.version = 0
        self.lag = 0
        self.calls = 0
        self.raise_first = raise_first
        self.bad_reasons = list(bad_reasons)
        self.lock = threading.Lock()
        self.requests = []

    def generate(self, request, timeout=None):
        with self.lock:
            self.calls += 1
            self.requests.append(request)
            if self.calls <= self.raise_first:
                raise RuntimeError("replica died")
            served = self.version - self.lag
        p = request.prompt[0] / 10
        rng = np.random.default_rng(request.seed)
        out = []
        priors = list(request.continue_from) or [None] * request.n
        for i, prior in enumerate(priors):
            full = [RIGHT if rng.random() < p else WRONG, FILL, FILL, STOP]
            if prior is not None:
                full = list(prior.meta_full)
            start = 0 if prior is None else prior.response_len
            end = len(full)
            if request.token_budget is not None:
                end = min(end, start + request.token_budget)
            reason = "stop" if end == len(full) else "length"
            with self.lock:
                if self.bad_reasons:
                    reason = self.bad_reasons.pop(0)
            rec = record(request.prompt, full[start:end], [served] * (end - start), reason,
                         partial=end < len(full) and reason == "length",
                         index=i if prior is None else prior.sample_index, prior=prior)
            rec.meta_full = full
            out.append(rec)
        return out


def grade(ids):
    ok = bool(ids) and ids[0] == RIGHT
    return Grade(reward=float(ok), correct=ok)


def task(i, tenths=5):
    return Task(f"t{i}", (tenths, 9, 9), grade, {"prompt": f"problem {i}"})


class StubLearner:
    def __init__(self, server=None):
        self.batches = []
        self.server = server

    def train(self, rollouts, policy_version=None):
        self.batches.append(list(rollouts))
        return {"loss": 0.0, "n": float(len(rollouts))}


EARLY = EarlyExit(4, 8, (0.05, 0.8), (0.1, 0.8))


def make(cfg, server, tenths=5, early=EARLY, budget=None, on_group=None, stats=None):
    stats = stats or WorkerStats()
    rw = RolloutWorker(server, SamplingOptions(max_tokens=8, stop_tokens=(STOP,),
                                              token_budget=budget), stats=stats)
    pw = ProblemWorker(rw, early, stats=stats)
    learner = StubLearner()
    pushed = []

    def publish(version):
        pushed.append(version)
        server.version = version

    source = SequentialSource(lambda i: task(i, tenths))
    ctl = Controller(cfg, source, pw, learner, publish, on_group=on_group, stats=stats)
    return ctl, learner, pushed


def test_staleness_is_counted_from_the_oldest_policy_token():
    r = Rollout(prompt_ids=[1], response_ids=[5, 6, 7, 8], logprobs=np.zeros(4),
                n_kept=np.zeros(4), threshold_logit=np.zeros(4),
                loss_mask=[True, False, True, True], versions=[3, -1, 4, 5],
                finish_reason="stop")
    assert oldest_version(r) == 3  # -1 (a tool observation) is no policy's token
    assert staleness(r, 11) == 8
    assert staleness(r, 3) == 0


def test_rollout_worker_retries_failures_but_not_as_aborted():
    server = FakeServer(raise_first=1, bad_reasons=["error", "aborted"])
    stats = WorkerStats()
    rw = RolloutWorker(server, SamplingOptions(stop_tokens=(STOP,)), stats=stats)
    out = rw.run(task(0), 4, seed=1)
    assert len(out) == 4 and not any(r.aborted for r in out)
    # 1 raised request + 1 "error" sample are failures; the aborted sample is retried, not failed
    assert stats.failures == 2
    assert stats.aborted == 1
    assert server.calls == 3  # the raise, then 4 samples (2 bad), then the 2 redone
    assert all(r.group_id == "t0" and r.reward in (0.0, 1.0) for r in out)


def test_rollout_worker_gives_up_with_aborted_placeholders():
    server = FakeServer(bad_reasons=["aborted"] * 100)
    stats = WorkerStats()
    rw = RolloutWorker(server, SamplingOptions(stop_tokens=(STOP,)), max_retries=2, stats=stats)
    out = rw.run(task(0), 2, seed=0)
    assert [r.finish_reason for r in out] == ["aborted", "aborted"]
    assert all(r.reward is None for r in out)
    assert stats.failures == 0 and stats.gave_up == 2 and stats.aborted == 6


def test_invalid_requests_are_not_retried():
    class Rejects:
        calls = 0

        def generate(self, request, timeout=None):
            Rejects.calls += 1
            raise ValueError("prompt too long")

    with pytest.raises(ValueError, match="prompt too long"):
        RolloutWorker(Rejects(), SamplingOptions()).run(task(0), 2)
    assert Rejects.calls == 1


def test_partial_rollouts_continue_and_span_versions():
    server = FakeServer()
    partials = PartialRegistry()

    class Bump:  # the weights move on between a sample's segments
        def generate(self, request, timeout=None):
            out = server.generate(request, timeout)
            server.version += 1
            return out

    rw = RolloutWorker(Bump(), SamplingOptions(max_tokens=8, stop_tokens=(STOP,), token_budget=3),
                       partials=partials)
    out = rw.run(task(0, 10), 2, seed=0)
    assert [r.response_ids.tolist() for r in out] == [[RIGHT, FILL, FILL, STOP]] * 2
    assert [r.versions.tolist() for r in out] == [[0, 0, 0, 1]] * 2  # segments of 2 versions
    assert rw.stats.continuations == 1 and len(partials) == 0
    assert server.requests[1].continue_from  # tokens were continued, not regenerated


def test_partial_registry_resumes_saved_partials():
    server = FakeServer()
    partials = PartialRegistry()
    first = record((10, 9, 9), [RIGHT, FILL], [0, 0], "length", partial=True, index=0)
    first.meta_full = [RIGHT, FILL, FILL, STOP]
    partials.put("t0", [first])
    rw = RolloutWorker(server, SamplingOptions(max_tokens=8, stop_tokens=(STOP,)),
                       partials=partials)
    server.version = 4
    out = rw.run(task(0, 10), 1, seed=0)
    assert out[0].response_ids.tolist() == [RIGHT, FILL, FILL, STOP]
    assert out[0].versions.tolist() == [0, 0, 4, 4]
    assert server.calls == 1


@pytest.mark.parametrize("tenths, kept, stage, calls", [(0, False, "early", 1),
                                                         (10, False, "early", 1),
                                                         (5, True, "full", 2)])
def test_early_exit_group_flow(tenths, kept, stage, calls):
    server = FakeServer()
    rw = RolloutWorker(server, SamplingOptions(stop_tokens=(STOP,)))
    pw = ProblemWorker(rw, EarlyExit(4, 16, (0.05, 0.8), (0.1, 0.8)))
    group = pw.run(task(0, tenths), seed=3)
    assert group.kept is kept and group.stage == stage and server.calls == calls
    if kept:
        assert len(group.rollouts) == 16
        rewards = np.array([r.reward for r in group.rollouts])
        adv = np.array([r.advantage for r in group.rollouts])
        np.testing.assert_allclose(adv, (rewards - rewards.mean()) / rewards.std(), rtol=1e-5)


def test_aborted_samples_are_kept_out_of_advantages():
    server = FakeServer(bad_reasons=["stop"] * 3 + ["aborted"] * 100)
    rw = RolloutWorker(server, SamplingOptions(stop_tokens=(STOP,)), max_retries=0)
    pw = ProblemWorker(rw, EarlyExit(4, 4, (0.0, 1.0), (0.0, 1.0)))
    group = pw.run(task(0, 5), seed=11)
    assert group.kept
    aborted = [r for r in group.rollouts if r.aborted]
    valid = [r for r in group.rollouts if not r.aborted]
    assert len(aborted) == 1 and aborted[0].advantage == 0.0 and aborted[0].reward is None
    rewards = np.array([r.reward for r in valid])
    if rewards.std() > 0:
        np.testing.assert_allclose([r.advantage for r in valid],
                                   (rewards - rewards.mean()) / rewards.std(), rtol=1e-5)
    assert rw.stats.failures == 0


def test_pushes_every_n_steps_and_bounds_staleness():
    cfg = ControllerConfig(groups_per_batch=2, sync_every=2, max_staleness=1, num_workers=2,
                           max_inflight=4)
    server = FakeServer()
    ctl, learner, pushed = make(cfg, server)
    ctl.run(6)
    assert ctl.step == 6 and pushed == [1, 2, 3]
    for step, batch in enumerate(learner.batches):
        version_at_step = step // 2  # weights pushed after steps 2, 4, 6
        for r in batch:
            assert staleness(r, version_at_step) <= 1


def test_stale_rollouts_are_dropped_and_counted():
    cfg = ControllerConfig(groups_per_batch=2, sync_every=1, max_staleness=2, num_workers=2)
    server = FakeServer()
    stop = threading.Event()
    seen = []

    def on_group(group, accepted, step, version):
        seen.append((group.kept, accepted))
        if len(seen) > 20:
            stop.set()

    ctl, learner, pushed = make(cfg, server, on_group=on_group)
    ctl.run(6)
    assert ctl.counters["stale_rollouts_dropped"] == 0
    server.lag = 5  # the inference side now serves weights 5 versions behind the learner
    seen.clear()
    ctl.run(8, stop)
    assert ctl.step == 6  # nothing fresh enough arrived: no step on stale data
    kept = sum(k for k, _ in seen)
    assert kept > 0 and not any(a for _, a in seen)
    assert ctl.counters["stale_groups_dropped"] == kept
    assert ctl.counters["stale_rollouts_dropped"] == kept * 8
    server.lag = 0
    ctl.run(8)
    assert ctl.step == 8
    for step, batch in enumerate(learner.batches):
        assert all(staleness(r, step) <= 2 for r in batch)


def test_on_policy_mode_trains_only_on_current_weights():
    cfg = ControllerConfig(groups_per_batch=3, mode="on_policy", num_workers=3)
    server = FakeServer()
    ctl, learner, pushed = make(cfg, server)
    ctl.run(4)
    assert pushed == [1, 2, 3, 4]  # every step
    for step, batch in enumerate(learner.batches):
        assert {int(v) for r in batch for v in r.versions} == {step}


def test_controller_config_errors_name_the_value():
    with pytest.raises(ValueError, match="mode='sideways'"):
        ControllerConfig(mode="sideways")
    with pytest.raises(ValueError, match="max_inflight=1"):
        ControllerConfig(groups_per_batch=2, max_inflight=1)


def test_worker_errors_are_counted_then_fatal():
    cfg = ControllerConfig(groups_per_batch=1, num_workers=1, max_worker_errors=2)

    def bad_grade(ids):
        raise KeyError("grader crashed")

    server = FakeServer()
    rw = RolloutWorker(server, SamplingOptions(stop_tokens=(STOP,)))
    pw = ProblemWorker(rw, EarlyExit(2, 2, (0.0, 1.0), (0.0, 1.0)))
    source = SequentialSource(lambda i: Task(f"t{i}", (5,), bad_grade))
    ctl = Controller(cfg, source, pw, StubLearner(), lambda v: None)
    with pytest.raises(RuntimeError, match="3 problem workers failed"):
        ctl.run(1)


def test_rollout_json_round_trip():
    r = record((4, 5), [RIGHT, STOP], [2, 3], partial=False, index=3)
    r.routing = np.arange(2 * 3 * 2).reshape(2, 3, 2)
    r.advantage, r.reward = 0.5, 1.0
    back = rollout_from_json(json.loads(json.dumps(rollout_to_json(r))))
    assert isinstance(back, SampledRollout) and back.sample_index == 3
    for name in ("prompt_ids", "response_ids", "logprobs", "versions", "routing"):
        np.testing.assert_array_equal(getattr(back, name), getattr(r, name))
    assert back.advantage == 0.5 and back.stop_tokens == (STOP,)


def test_store_resume_loses_no_accepted_group(tmp_path):
    """Kill after some steps: the groups accepted but not yet trained come back from the store."""
    cfg = ControllerConfig(groups_per_batch=2, sync_every=1, num_workers=2, max_inflight=6)
    server = FakeServer()
    store = RolloutStore(str(tmp_path), decode=lambda ids: " ".join(map(str, ids)))

    def on_group(group, accepted, step, version):
        store.append(group, accepted=accepted, step=ctl.step, version=ctl.version)

    ctl, learner, _ = make(cfg, server, on_group=on_group)
    ctl.run(3)
    state = json.loads(json.dumps(ctl.state_dict()))
    pending_ids = [g.task.id for g in ctl.buffer]
    store.close()
    with open(store.path, "a") as f:  # a torn line from the kill
        f.write('{"task_id": "t99", "acc')
    store2 = RolloutStore(str(tmp_path))
    store2.close()
    pending = [g.to_group() for g in read_groups(str(tmp_path), accepted_only=True,
                                                 start=state["accepted_consumed"])]
    assert [g.task.id for g in pending] == pending_ids
    ctl2, learner2, _ = make(cfg, FakeServer())
    ctl2.load_state_dict(state, pending)
    assert ctl2.step == 3 and [g.task.id for g in ctl2.buffer] == pending_ids
    assert ctl2.source.next_index == state["source"]["next_index"]
    all_accepted = read_groups(str(tmp_path), accepted_only=True)
    assert len(all_accepted) == state["accepted_consumed"] + len(pending_ids)


def test_store_group_commit_fsyncs_once_per_interval_and_on_close(tmp_path, monkeypatch):
    """Every line is written and flushed at once (a killed process loses nothing); fsync, for
    durability past an OS crash, runs at most once per interval and when the store closes."""
    synced = []
    monkeypatch.setattr("hcjax.rl.store.os.fsync", lambda fd: synced.append(fd))
    server = FakeServer()
    pw = ProblemWorker(RolloutWorker(server, SamplingOptions(stop_tokens=(STOP,))),
                       EarlyExit(4, 4, (0.0, 1.0), (0.0, 1.0)))
    groups = [pw.run(task(i, 5), seed=i) for i in range(6)]
    per_line = RolloutStore(str(tmp_path / "a"), fsync_interval_s=0)
    grouped = RolloutStore(str(tmp_path / "b"), fsync_interval_s=3600)
    for i, g in enumerate(groups):
        per_line.append(g, accepted=True, step=i, version=i)
        grouped.append(g, accepted=True, step=i, version=i)
        # written and flushed: a reader (or a restart after SIGKILL) sees the line already
        assert len(read_groups(str(tmp_path / "b"))) == i + 1
    assert per_line.fsyncs == 6 and grouped.fsyncs == 0
    grouped.close()
    per_line.close()
    assert grouped.fsyncs == 1 and per_line.fsyncs == 6 and len(synced) == 7
    assert [g.task_id for g in read_groups(str(tmp_path / "b"))] == [g.task.id for g in groups]
    with pytest.raises(ValueError, match="fsync_interval_s=-1"):
        RolloutStore(str(tmp_path / "c"), fsync_interval_s=-1)


def test_distillation_set_is_late_successful_and_random(tmp_path):
    store = RolloutStore(str(tmp_path / "store"), decode=lambda ids: "ans" + "".join(map(str, ids)),
                         fsync=False)
    server = FakeServer()
    rw = RolloutWorker(server, SamplingOptions(stop_tokens=(STOP,)))
    pw = ProblemWorker(rw, EarlyExit(8, 8, (0.0, 1.0), (0.0, 1.0)))
    for step in range(10):
        group = pw.run(task(step, 5), seed=step)
        store.append(group, accepted=True, step=step, version=step)
    store.close()
    convs = distillation_conversations(str(tmp_path / "store"), min_step_fraction=0.5)
    assert convs and all(c[1]["content"] == f"ans{RIGHT}{FILL}{FILL}" for c in convs)
    prompts = {c[0]["content"] for c in convs}
    assert prompts <= {f"problem {i}" for i in range(5, 10)}  # late steps only (>= 4.5)
    base = [[{"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]] * 100
    n = write_distillation_set(str(tmp_path / "store"), str(tmp_path / "sd.jsonl"),
                               base_conversations=base, base_fraction=0.5, min_step_fraction=0.5)
    lines = [json.loads(x) for x in open(tmp_path / "sd.jsonl")]
    assert n == len(lines) == 2 * len(convs)
    assert sum(x["messages"][0]["content"] == "b" for x in lines) == len(convs)
    with pytest.raises(ValueError, match="min_step_fraction=2"):
        distillation_conversations(str(tmp_path / "store"), min_step_fraction=2)


class CharTok:
    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class ToolPolicyServer:
    """Turn 1 calls a tool; once an observation is in the context, answers. Records carry a
    routing of one MoE layer whose expert id is the fed token, to check the glue."""

    CALL = '<tool_call>{"name": "calc", "arguments": {}}</tool_call>'

    def __init__(self):
        self.version = 3
        self.prompts = []

    def generate(self, request, timeout=None):
        text = CharTok().decode(request.prompt)
        self.prompts.append(text)
        out = CharTok().encode("answer 42" if "<tool_result>" in text else self.CALL)
        n, full = len(out), list(request.prompt) + out
        routing = np.asarray(full[:-1])[None, :, None]
        return [SampledRollout(
            prompt_ids=request.prompt, response_ids=out, logprobs=np.full(n, -0.25),
            n_kept=np.full(n, 5), threshold_logit=np.zeros(n), loss_mask=np.ones(n, bool),
            versions=np.full(n, self.version), finish_reason="stop", routing=routing)]


def test_multi_turn_rollouts_glue_policy_turns_and_observations():
    from hcjax.envs.tools import ToolResult

    calls = []

    def tools(call):
        calls.append(call.name)
        return ToolResult("42")

    def grade(ids):
        ok = CharTok().decode(ids).endswith("answer 42")
        return Grade(float(ok), correct=ok)

    server = ToolPolicyServer()
    task = Task("agent", CharTok().encode("Q?"), grade, tools=tools, tokenizer=CharTok())
    [r] = RolloutWorker(server, SamplingOptions()).run(task, 1, seed=0)
    text = CharTok().decode(r.response_ids)
    assert calls == ["calc"] and text.startswith(ToolPolicyServer.CALL)
    assert text.endswith("answer 42") and r.reward == 1.0 and r.finish_reason == "stop"
    call_n, obs_n = len(ToolPolicyServer.CALL), len(text) - len(ToolPolicyServer.CALL) - 9
    assert obs_n > 0 and "<tool_result>" in server.prompts[1]
    mask = r.loss_mask
    assert mask[:call_n].all() and not mask[call_n:call_n + obs_n].any() and mask[-9:].all()
    np.testing.assert_array_equal(r.logprobs[~mask], 0.0)
    np.testing.assert_array_equal(r.logprobs[mask], -0.25)
    np.testing.assert_array_equal(r.versions[~mask], -1)
    np.testing.assert_array_equal(r.n_kept[mask], 5)
    # Routing covers prompt + response - 1 fed tokens, from the last turn's record.
    full = np.concatenate([r.prompt_ids, r.response_ids])
    np.testing.assert_array_equal(r.routing[0, :, 0], full[:-1])


def test_multi_turn_infrastructure_failure_is_aborted_not_failed():
    from hcjax.envs.tools import ToolResult

    task = Task("agent", CharTok().encode("Q?"), grade,
                tools=lambda call: ToolResult("", aborted=True), tokenizer=CharTok())
    stats = WorkerStats()
    [r] = RolloutWorker(ToolPolicyServer(), SamplingOptions(), stats=stats).run(task, 1)
    assert r.aborted and r.reward is None and stats.failures == 0
    with pytest.raises(ValueError, match="no tokenizer"):
        Task("x", (1,), grade, tools=lambda call: None)


def test_prioritized_source_draws_categories_by_one_minus_success():
    made = []

    def make(category, cursor):
        made.append((category, cursor))
        return Task(f"{category}-{cursor}", (1,), grade, {"category": category}), cursor + 1

    src = PrioritizedSource(["easy", "mid", "hard"], make, lambda t: t.meta["category"],
                            window=4, floor=0.1, seed=3)
    # Unseen categories have rate 0: uniform at first.
    assert src.probabilities() == pytest.approx({"easy": 1 / 3, "mid": 1 / 3, "hard": 1 / 3})

    def finish(category, rate):
        src.update(GroupResult(Task(f"{category}-x", (1,), grade, {"category": category}), [],
                               kept=False, pass_rate=rate, stage="early"))

    for _ in range(6):  # the window keeps the last 4 only
        finish("easy", 1.0)
    finish("mid", 0.25)
    finish("mid", 0.75)
    finish("hard", 0.0)
    # Weights max(1 - s, floor): easy 0.1 (solved, floored), mid 0.5, hard 1.0.
    assert src.probabilities() == pytest.approx({"easy": 0.1 / 1.6, "mid": 0.5 / 1.6,
                                                 "hard": 1.0 / 1.6})
    drawn = [src.next_task().meta["category"] for _ in range(3200)]
    for c, p in src.probabilities().items():
        assert drawn.count(c) / len(drawn) == pytest.approx(p, abs=0.03)
    # Each category walks its own cursor: no problem is drawn twice.
    assert len(set(made)) == len(made)
    # State round trip: the copy draws exactly the same next problems.
    state = json.loads(json.dumps(src.state_dict()))
    copy = PrioritizedSource(["easy", "mid", "hard"], make, lambda t: t.meta["category"],
                             window=4, floor=0.1, seed=99)
    copy.load_state_dict(state)
    assert [copy.next_task().id for _ in range(20)] == [src.next_task().id for _ in range(20)]
    with pytest.raises(ValueError, match="unknown category 'other'"):
        finish("other", 0.5)
    with pytest.raises(ValueError, match="differ from this run"):
        PrioritizedSource(["easy"], make, lambda t: t.meta["category"]).load_state_dict(state)
    with pytest.raises(ValueError, match="floor=0"):
        PrioritizedSource(["a"], make, lambda t: "a", floor=0.0)


def test_learnability_rule_prefers_categories_with_mixed_results():
    def make(category, cursor):
        return Task(f"{category}-{cursor}", (1,), grade, {"category": category}), cursor + 1

    src = PrioritizedSource(["solved", "half", "hopeless", "new"], make,
                            lambda t: t.meta["category"], floor=0.01, rule="learnability")
    for category, rate in (("solved", 1.0), ("half", 0.5), ("hopeless", 0.0)):
        src.update(GroupResult(Task("x", (1,), grade, {"category": category}), [], kept=False,
                               pass_rate=rate, stage="early"))
    # w = s(1 - s): 0.25 for a coin flip and for an unseen category, the floor for 0 and 1.
    total = 0.01 + 0.25 + 0.01 + 0.25
    assert src.probabilities() == pytest.approx(
        {"solved": 0.01 / total, "half": 0.25 / total, "hopeless": 0.01 / total,
         "new": 0.25 / total})
    with pytest.raises(ValueError, match="rule='greedy'"):
        PrioritizedSource(["a"], make, lambda t: "a", rule="greedy")


def test_generation_busy_time_is_readable_while_the_run_goes_on():
    # The live display reads generation_busy_now() from the step callback; with groups always in
    # flight the busy interval never closes before the run ends, and it must still count.
    cfg = ControllerConfig(groups_per_batch=2, sync_every=2, max_staleness=4, num_workers=2,
                           max_inflight=4)
    seen = []
    ctl, _, _ = make(cfg, FakeServer())
    ctl.on_step = lambda report: seen.append(ctl.generation_busy_now()) and False
    ctl.run(4)
    assert len(seen) == 4 and seen[0] > 0 and seen == sorted(seen)
    assert ctl.generation_busy_now() == ctl.generation_busy_seconds > 0
    assert 0 < ctl.utilisation()["rollout_utilisation"] <= 1


def test_the_learner_s_time_blocked_by_each_push_is_reported():
    import time

    cfg = ControllerConfig(groups_per_batch=2, sync_every=2, max_staleness=4, num_workers=2,
                           max_inflight=4)
    reports = []
    ctl, _, pushed = make(cfg, FakeServer())
    publish = ctl.publish

    def slow(version):
        time.sleep(0.05)
        publish(version)

    ctl.publish = slow
    ctl.on_step = lambda report: reports.append(report.metrics) and False
    ctl.run(4)
    blocked = [m["publish_blocked_s"] for m in reports if "publish_blocked_s" in m]
    assert len(blocked) == len(pushed) == ctl.pushes >= 1 and min(blocked) >= 0.05
    assert all(m["learner_step_s"] >= 0 for m in reports)
    u = ctl.utilisation()
    assert u["publish_blocked_s_mean"] == pytest.approx(sum(blocked) / len(blocked))
    assert u["publish_blocked_over_step"] == pytest.approx(
        u["publish_blocked_s_mean"] / (ctl.learner_seconds / ctl.steps_timed))
