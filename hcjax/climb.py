"""`python -m hcjax.climb`: the RL climb end to end (RECIPE §1, §3, §4) on the synthetic suite.

With no arguments it pre-trains the tiny base (hcjax.sft) unless `--base_checkpoint` is given
(or `--hf_checkpoint DIR`: a Hugging Face folder's model and tokenizer, prompts in its chat
template, stopping on its eos ids), then climbs: an in-process rollout server on the inference
devices, the GRPO learner on disjoint learner devices, weights pushed through a transfer plan,
all driven by hcjax.rl.controller. With `--inference_address` the rollouts go to remote
`python -m hcjax.climb --role inference` processes through the router, and weights move to them
by a reshard plan (hcjax.rl.weight_sync).
"""

from __future__ import annotations

import os
import sys


def _force_cpu_devices(n: int) -> None:
    """Ask XLA for n host devices (learner + inference meshes); must run before JAX creates its
    backends (the first device query), and leaves an explicit setting alone."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


if __name__ == "__main__":
    # Devices first (before anything imports JAX); then run the importable module, so gin
    # registers this file's configurables once, under hcjax.climb, not also under __main__.
    _force_cpu_devices(int(os.environ.get("HCJAX_CPU_DEVICES", "2")))
    from hcjax.climb import main as _main

    _main(sys.argv[1:])
    raise SystemExit(0)

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import gin  # noqa: E402
import numpy as np  # noqa: E402

from hcjax.rl.controller import (  # noqa: E402
    PRIORITY_RULES,
    Controller,
    ControllerConfig,
    PrioritizedSource,
    SequentialSource,
    StepReport,
)
from hcjax.rl.entropy import TemperatureController  # noqa: E402
from hcjax.rl.sampling import EarlyExit  # noqa: E402
from hcjax.rl.store import RolloutStore, read_groups, rollout_from_json, rollout_to_json  # noqa: E402
from hcjax.rl.workers import (  # noqa: E402
    Grade,
    GroupResult,
    PartialRegistry,
    ProblemWorker,
    RolloutWorker,
    SamplingConfig,
    Task,
    WorkerStats,
)

__all__ = ["ClimbConfig", "ClimbResult", "main", "run_climb"]


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ClimbConfig:
    """The climb's own settings; the learner (LearnerConfig), controller (ControllerConfig), model
    (ModelConfig), task suite (ArithmeticSuite) and base pre-training (SFTConfig) have their own.

    max_minutes: stop climbing after this much wall time (None: run all num_steps).
    early_group / group: G_early and G of early-exit sampling; early/full windows as RECIPE §3.
    temperature: the sampling temperature (the start value when it is controlled).
    temperature_delta / temperature_range: δ and bounds of the sampling-temperature lever
    (hcjax.rl.entropy.TemperatureController: T moves by ±δ toward the learner's H* after every
    step); 0 keeps the temperature fixed (RECIPE §3 has only k).
    max_prompt_len: the engine's max prefill length, the longest prompt a task may have (longer
    ones are an error); None: 32 for the byte template, else measured from the suite's prompts in
    the tokenizer's chat template (`longest_prompt`).
    """

    num_steps: int = 60
    max_minutes: float | None = None
    group: int = 8
    early_group: int = 4
    early_window: tuple[float, float] = (0.05, 0.95)
    full_window: tuple[float, float] = (0.05, 0.95)
    advantage: str = "mean_std"
    max_tokens: int = 24
    temperature: float = 1.0
    temperature_delta: float = 0.0
    temperature_range: tuple[float, float] = (0.5, 2.0)
    top_p: float = 0.97
    token_budget: int | None = None
    max_retries: int = 3
    eval_every: int = 10
    eval_problems: int = 200
    learner_devices: int = 1
    inference_devices: int = 1
    max_concurrent_decodes: int = 64
    checkpoint_every: int = 10
    sampler: str = "sequential"
    priority_window: int = 64
    priority_floor: float = 0.05
    priority_rule: str = "learnability"
    profile_start: int = -1
    profile_stop: int = -1
    seed: int = 0
    max_prompt_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_steps", "group", "early_group", "max_tokens", "eval_every",
                     "learner_devices", "inference_devices", "max_concurrent_decodes",
                     "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"ClimbConfig.{name}={getattr(self, name)} must be >= 1")
        if self.early_group > self.group:
            raise ValueError(f"ClimbConfig.early_group={self.early_group} exceeds "
                             f"group={self.group}")
        if self.sampler not in ("sequential", "prioritized"):
            raise ValueError(f"ClimbConfig.sampler={self.sampler!r} is not 'sequential' or "
                             "'prioritized'")
        if self.priority_rule not in PRIORITY_RULES:
            raise ValueError(f"ClimbConfig.priority_rule={self.priority_rule!r} is not one of "
                             f"{PRIORITY_RULES}")
        if self.priority_window < 1 or not 0.0 < self.priority_floor <= 1.0:
            raise ValueError(f"ClimbConfig.priority_window={self.priority_window} must be >= 1 "
                             f"and priority_floor={self.priority_floor} in (0, 1]")
        if len(self.temperature_range) != 2:
            raise ValueError(f"ClimbConfig.temperature_range={self.temperature_range} must be "
                             "(low, high)")
        if self.temperature_delta > 0 and not (
                0 < self.temperature_range[0] <= self.temperature <= self.temperature_range[1]):
            raise ValueError(f"ClimbConfig.temperature={self.temperature} must lie in "
                             f"temperature_range={self.temperature_range} (low > 0) when "
                             f"temperature_delta={self.temperature_delta} > 0")
        if self.temperature_delta < 0:
            raise ValueError(f"ClimbConfig.temperature_delta={self.temperature_delta} must be >= 0")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ValueError(f"ClimbConfig.max_minutes={self.max_minutes} must be > 0 or None")
        if self.max_prompt_len is not None and self.max_prompt_len < 1:
            raise ValueError(f"ClimbConfig.max_prompt_len={self.max_prompt_len} must be >= 1 "
                             "or None")

    def early_exit(self) -> EarlyExit:
        return EarlyExit(self.early_group, self.group, tuple(self.early_window),
                         tuple(self.full_window))


@dataclasses.dataclass
class ClimbResult:
    output_dir: str
    summary: dict[str, Any]


# Tasks -----------------------------------------------------------------------------------------


def arithmetic_task(index: int, suite, tok, max_prompt_len: int | None = None) -> Task:
    """Training problem `index` of the synthetic suite as a worker Task (reward = correctness);
    a prompt longer than `max_prompt_len` tokens (the engine's prefill limit) is an error."""
    from hcjax.data.template import prompt_ids

    problem = suite.train_problem(index)
    ids = tuple(prompt_ids(problem.prompt, tok))
    if max_prompt_len is not None and len(ids) > max_prompt_len:
        raise ValueError(
            f"problem {problem.id} ({problem.prompt!r}) has a {len(ids)}-token prompt; "
            f"the engine's max prefill length is {max_prompt_len} (set ClimbConfig.max_prompt_len)")
    return Task(problem.id, ids, _grader(problem, tok),
                {"prompt": problem.prompt, "answer": problem.answer, "index": index,
                 "category": arithmetic_category(problem)})


def arithmetic_category(problem) -> str:
    """A problem's sampling category: its kind and its operands' digit counts ("add:2x1")."""
    from hcjax.data.tasks import operands

    a, b = operands(problem)
    return f"{problem.kind}:{len(a)}x{len(b)}"


def arithmetic_source(suite, tok, cfg: ClimbConfig, max_prompt_len: int | None = None):
    """The climb's problem source: training problems in index order ("sequential"), or drawn
    per category by a prioritised rule ("prioritized", hcjax.rl.controller.PrioritizedSource)."""
    if cfg.sampler == "sequential":
        return SequentialSource(lambda i: arithmetic_task(i, suite, tok, max_prompt_len))
    # The categories present in the training stream (a scan of its first problems).
    categories = sorted({arithmetic_category(suite.train_problem(i)) for i in range(2000)})

    def make(category: str, cursor: int) -> tuple[Task, int]:
        for i in range(cursor, cursor + 100_000):
            if arithmetic_category(suite.train_problem(i)) == category:
                return arithmetic_task(i, suite, tok, max_prompt_len), i + 1
        raise RuntimeError(f"no training problem of category {category!r} after index {cursor}")

    return PrioritizedSource(categories, make, lambda task: task.meta["category"],
                             window=cfg.priority_window, floor=cfg.priority_floor,
                             rule=cfg.priority_rule, seed=cfg.seed)


def longest_prompt(suite, tok, scan: int = 2000) -> int:
    """Tokens of the longest templated prompt the suite can give: the longest over its held-out
    problems and first `scan` training problems, and at least the template's own tokens plus one
    per character of the longest prompt the digit range allows (BPE never spends more than a
    token on a digit or operator)."""
    from hcjax.data.template import prompt_ids

    problems = [*suite.heldout(), *(suite.train_problem(i) for i in range(scan))]
    seen = max(len(prompt_ids(p.prompt, tok)) for p in problems)
    # "a op b =": a has at most max_digits digits, b too (add/sub) or 1 (mul) or 2 (mod).
    longest_chars = 2 * suite.max_digits + 2
    bound = len(prompt_ids("", tok)) + longest_chars
    return max(seen, bound)


def _grader(problem, tok) -> Callable[[Sequence[int]], Grade]:
    from hcjax.eval import grade_response

    def grade(ids: Sequence[int]) -> Grade:
        ok = bool(grade_response(problem, tok.decode(list(ids)), tok))
        return Grade(reward=float(ok), correct=ok)

    return grade


def heldout_pass_at_1(client, problems, tok, max_tokens: int, stop_tokens) -> float:
    """Greedy pass@1 of the served policy on `problems` (all submitted at once, then checked)."""
    from hcjax.data.template import prompt_ids
    from hcjax.eval import grade_response
    from hcjax.rollout.request import GenerateRequest

    if not problems:
        return float("nan")

    def one(p):
        req = GenerateRequest(prompt=tuple(prompt_ids(p.prompt, tok)), n=1, max_tokens=max_tokens,
                              temperature=0.0, top_p=1.0, seed=0, stop_tokens=tuple(stop_tokens),
                              request_id=f"eval-{p.id}")
        rec = client.generate(req)[0]
        return grade_response(p, tok.decode(rec.response_ids.tolist()), tok)

    from concurrent import futures

    with futures.ThreadPoolExecutor(16) as pool:
        ok = list(pool.map(one, problems))
    return float(np.mean(ok))


# The learner side ------------------------------------------------------------------------------


class LearnerAdapter:
    """hcjax.rl.learner.Learner behind the controller's `train(rollouts)`; rows are padded to a
    power of two so only a handful of batch shapes is ever compiled."""

    def __init__(self, learner) -> None:
        self.learner = learner
        self.step_seconds: list[float] = []

    def train(self, rollouts):
        from hcjax.rl import batch as batch_lib

        lr = self.learner
        cfg = lr.cfg
        usable = batch_lib.usable_rollouts(rollouts, mask_truncated=cfg.mask_truncated)
        if not usable:
            return {"skipped": 1.0}
        probe = batch_lib.pack_rollouts(usable, seq_len=cfg.seq_len, with_routing=False,
                                        mask_truncated=cfg.mask_truncated)
        step = cfg.micro_batches * lr.data_parallel_size
        rows = max(step, 2 ** math.ceil(math.log2(max(1, probe.tokens.shape[1]))))
        rows = -(-rows // step) * step
        t0 = time.perf_counter()
        metrics = lr.step(lr.make_batch(usable, num_rows=rows))
        self.step_seconds.append(time.perf_counter() - t0)
        metrics["rows"] = float(rows)
        metrics["train_rollouts"] = float(len(usable))
        return metrics


# The run ---------------------------------------------------------------------------------------


def _load_base_params(base_dir: str, model_cfg, mesh):
    """The model with the params of the latest checkpoint of an hcjax.sft run, on `mesh`."""
    from flax import nnx

    from hcjax.distill.sft import load_params
    from hcjax.model import create_sharded

    model = create_sharded(model_cfg, mesh)
    _, params, _ = nnx.split(model, nnx.Param, ...)
    # load_params checks the run's ModelConfig (implementation switches may differ) and places
    # each leaf like the target.
    nnx.replace_by_pure_dict(params, load_params(base_dir, model_cfg, nnx.to_pure_dict(params)))
    nnx.update(model, params)
    return model, params


def _pretrain_base(output_dir: str) -> str:
    """Pre-train the tiny base with hcjax.sft (resumes if a previous run left checkpoints)."""
    from hcjax.distill.sft import run_sft

    base_dir = os.path.join(output_dir, "base")
    run_sft(base_dir, progress=False, eval_problems=0)
    return base_dir


def _serialize_partials(partials: PartialRegistry) -> dict:
    return {k: [rollout_to_json(r) for r in v] for k, v in partials.snapshot().items()}


def _restore_partials(partials: PartialRegistry, data: dict) -> None:
    for task_id, records in data.items():
        partials.put(task_id, [rollout_from_json(r) for r in records])


def run_climb(
    output_dir: str,
    *,
    base_checkpoint: str | None = None,
    hf_checkpoint: str | None = None,
    inference_addresses: Sequence[str] = (),
    mode: str | None = None,
    progress: bool = True,
    stop_at_gain: float | None = None,
) -> ClimbResult:
    """Run (or resume) a climb in `output_dir`; returns its summary (also in summary.json).

    hf_checkpoint: a Hugging Face folder as the base (instead of base_checkpoint or the tiny
    pre-training): its model on the learner mesh, its tokenizer and chat template for prompts,
    stop ids and grading; recorded in the checkpoints' meta and OUTPUT_DIR/hf for export.
    inference_addresses: remote `hcjax.serve` replicas (multi-process placement); empty = the
    in-process engine on this process's inference devices. mode overrides ControllerConfig.mode.
    stop_at_gain: stop once held-out pass@1 is this much above the base's (used by bench.climb).
    """
    import jax
    from flax import nnx

    from hcjax.checkpoint import CheckpointConfig, Checkpointer, jsonable
    from hcjax.data.tasks import ArithmeticSuite
    from hcjax.data.template import stop_ids
    from hcjax.data.tokenizer import ByteTokenizer, load_tokenizer
    from hcjax.metrics import MetricsWriter
    from hcjax.model import ModelConfig
    from hcjax.profiling import StepTracer
    from hcjax.rl.learner import Learner, LearnerConfig
    from hcjax.rl.multihost import DistributedLearner
    from hcjax.sharding import MeshConfig, make_mesh

    if hf_checkpoint is not None and base_checkpoint is not None:
        raise ValueError(f"hf_checkpoint={hf_checkpoint!r} and base_checkpoint={base_checkpoint!r}:"
                         " the climb starts from one base, give one of them")
    if hf_checkpoint is not None and inference_addresses:
        raise ValueError("hf_checkpoint with remote inference (inference_addresses) is not "
                         "supported: `--role inference` serves the gin ModelConfig")
    t_start = time.perf_counter()
    output_dir = os.path.abspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    cfg = ClimbConfig()
    ctl_cfg = ControllerConfig()
    if mode is not None:
        ctl_cfg = dataclasses.replace(ctl_cfg, mode=mode)
    model_cfg = ModelConfig()
    learner_cfg = LearnerConfig()
    suite = ArithmeticSuite()
    tok = ByteTokenizer() if hf_checkpoint is None else load_tokenizer(hf_checkpoint)
    stops = stop_ids(tok)
    max_prompt_len = cfg.max_prompt_len
    if max_prompt_len is None:
        max_prompt_len = 32 if hf_checkpoint is None else longest_prompt(suite, tok)

    processes = jax.process_count()
    if processes > 1 and not inference_addresses:
        raise ValueError(
            f"a learner over {processes} processes needs remote inference (--inference_address): "
            "the in-process engine cannot hold parameters that span every process")
    if processes > 1 and base_checkpoint is None:
        raise ValueError(
            f"a learner over {processes} processes needs --base_checkpoint: pre-train the base "
            "first with `python -m hcjax.sft` (every process would otherwise pre-train its own)")
    devices = jax.devices()  # every process's devices: the learner mesh may span them all
    need = cfg.learner_devices + (0 if inference_addresses else cfg.inference_devices)
    if len(devices) < need:
        raise ValueError(
            f"ClimbConfig needs {need} devices (learner_devices={cfg.learner_devices}, "
            f"inference_devices={cfg.inference_devices}), found {len(devices)}; set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N on CPU"
        )
    learner_mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1, expert=1, device_offset=0,
                                        num_devices=cfg.learner_devices))

    t_base = time.perf_counter()
    ckpt_meta: dict[str, Any] = {}
    if hf_checkpoint is not None:
        from hcjax.distill.sft import hf_source_meta, load_hf_model

        model, model_cfg = load_hf_model(hf_checkpoint, learner_mesh)
        ckpt_meta = hf_source_meta(hf_checkpoint, output_dir)
        if tok.vocab_size > model_cfg.vocab_size:
            raise ValueError(f"the tokenizer of {hf_checkpoint!r} has {tok.vocab_size} ids; the "
                             f"model's vocab_size is {model_cfg.vocab_size}")
    else:
        base_dir = base_checkpoint or _pretrain_base(output_dir)
        model, _ = _load_base_params(base_dir, model_cfg, learner_mesh)
    base_seconds = time.perf_counter() - t_base
    learner = Learner(model, learner_cfg, learner_mesh)
    # Several learner processes: process 0 sends every learner call (train, gather, save,
    # restore) to the others, which run them in the same order (hcjax.rl.multihost). From here
    # on, the leader touches the learner mesh only through `dist`.
    dist = DistributedLearner(learner) if processes > 1 else None
    adapter = LearnerAdapter(dist or learner)
    ckpt = Checkpointer(os.path.join(output_dir, "checkpoints"),
                        CheckpointConfig(save_every=cfg.checkpoint_every, keep=2),
                        {"model_config": jsonable(model_cfg), **ckpt_meta})
    if dist is not None and not dist.is_leader:
        return _follow(output_dir, dist, ckpt, t_start)

    # Inference side: in-process engine on disjoint devices, or remote replicas via the router.
    server = None
    router = None
    publish_remote = None
    if inference_addresses:
        from hcjax.rollout.router import Router

        router = Router(list(inference_addresses), max_inflight_per_replica=256)
        client = _RouterClient(router)
        publish_remote = _remote_publisher(
            learner, inference_addresses, router.remove_replica,
            params=dist.local_params if dist is not None else None)
    else:
        from hcjax.model import shard_state
        from hcjax.rollout import Engine, RolloutServer
        from hcjax.transfer import VersionedWeights, make_plan

        inf_mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1, expert=1,
                                        device_offset=cfg.learner_devices,
                                        num_devices=cfg.inference_devices))
        graphdef, params = nnx.split(learner.model())
        inf_model = nnx.merge(graphdef, shard_state(jax.tree.map(jnp_copy, params), inf_mesh))
        engine = Engine(inf_model, mesh=inf_mesh, max_concurrent_decodes=cfg.max_concurrent_decodes,
                        max_prefill_length=max_prompt_len,
                        max_target_length=min(model_cfg.max_seq_len,
                                              max_prompt_len + cfg.max_tokens + 8))
        served = VersionedWeights(None, -1)
        plan = make_plan(learner.state.params,
                         jax.tree.map(lambda x: x.sharding, engine.load_params()))
        server = RolloutServer(engine, max_queue=4096)
        client = server

    def publish(version: int) -> None:
        if publish_remote is not None:
            publish_remote(version)
            return
        tree = served.update(lambda: plan.execute(learner.state.params), version)
        server.update_weights(tree, version)

    # Store, metrics.
    stats = WorkerStats()
    partials = PartialRegistry()
    sampling = SamplingConfig(max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                              top_p=cfg.top_p, stop_tokens=tuple(stops),
                              token_budget=cfg.token_budget)
    rollout_worker = RolloutWorker(client, sampling, max_retries=cfg.max_retries, stats=stats,
                                   partials=partials)
    worker = ProblemWorker(rollout_worker, cfg.early_exit(), advantage=cfg.advantage, stats=stats)
    temperature = TemperatureController(
        learner_cfg.entropy.target, cfg.temperature_delta, *cfg.temperature_range,
        temperature=cfg.temperature) if cfg.temperature_delta > 0 else None

    def sample_at(t: float) -> None:  # requests made from now on sample at temperature t
        rollout_worker.sampling = dataclasses.replace(sampling, temperature=t)
    source = arithmetic_source(suite, tok, cfg, max_prompt_len)
    store = RolloutStore(os.path.join(output_dir, "rollouts"), decode=tok.decode)
    holder: dict[str, Controller] = {}

    def on_group(group: GroupResult, accepted: bool) -> None:
        c = holder["controller"]
        store.append(group, accepted=accepted, step=c.step, version=c.version)

    controller = Controller(ctl_cfg, source, worker, adapter, publish, on_group=on_group,
                            stats=stats)
    holder["controller"] = controller

    resumed_from = None
    history: dict[str, Any] = {"eval": [], "wall_offset": 0.0, "base_pass_at_1": None}
    latest = ckpt.latest_step()
    if latest is not None:
        if dist is not None:  # every learner process restores its shards
            data = dist.restore(ckpt, latest)
        else:
            state, data = ckpt.restore(latest, learner.state)
            learner.state = state
        pending = [g.to_group() for g in read_groups(
            store.path, accepted_only=True, start=int(data["controller"]["accepted_consumed"]))]
        controller.load_state_dict(data["controller"], pending)
        _restore_partials(partials, data.get("partials", {}))
        history = data["history"]
        resumed_from = latest if dist is not None else ckpt.restored_step  # after any fallback
        if temperature is not None and "temperature" in data:
            temperature.load_state_dict(data["temperature"])
            sample_at(temperature.temperature)

    # Serve the learner's current weights as the controller's version.
    if server is not None:
        tree = served.update(lambda: plan.execute(learner.state.params), controller.version)
        server.update_weights(tree, controller.version)
        server.start()
    elif publish_remote is not None:
        publish_remote(controller.version)

    heldout = suite.heldout()[: cfg.eval_problems]
    writer = MetricsWriter(output_dir)
    tracer = StepTracer(os.path.join(output_dir, "profile"), cfg.profile_start, cfg.profile_stop)
    t_climb = time.perf_counter()
    wall_offset = float(history.get("wall_offset", 0.0))
    if history.get("base_pass_at_1") is None:
        history["base_pass_at_1"] = heldout_pass_at_1(client, heldout, tok, cfg.max_tokens, stops)
        history["eval"].append({"step": 0, "wall": 0.0, "pass_at_1": history["base_pass_at_1"]})
        writer.write(0, {"heldout_pass_at_1": history["base_pass_at_1"]})
    if progress:
        print(json.dumps({"event": "base", "base_pass_at_1": history["base_pass_at_1"],
                          "resumed_from": resumed_from}), flush=True)
    deadline = None if cfg.max_minutes is None else t_climb + 60 * cfg.max_minutes
    last_step_time = [time.perf_counter()]
    target = learner_cfg.entropy.target

    def climb_wall() -> float:
        return wall_offset + time.perf_counter() - t_climb

    saved = {"step": resumed_from}

    def save(step: int, force: bool = False) -> None:
        if saved["step"] == step:  # already on disk (a step is saved at most once)
            return
        data = {"controller": controller.state_dict(), "partials": _serialize_partials(partials),
                "history": dict(history, wall_offset=climb_wall())}
        if temperature is not None:
            data["temperature"] = temperature.state_dict()
        started = (dist.save(ckpt, step, data, force=force) if dist is not None
                   else ckpt.save(step, learner.state, data, force=force))
        if started:
            saved["step"] = step

    def on_step(report: StepReport) -> bool:
        now = time.perf_counter()
        m = report.metrics
        rewards = [r.reward for g in report.groups for r in g.valid]
        lengths = [r.response_len for g in report.groups for r in g.valid]
        record = {
            "reward_mean": float(np.mean(rewards)) if rewards else float("nan"),
            "response_len_mean": float(np.mean(lengths)) if lengths else float("nan"),
            "entropy": m.get("entropy", float("nan")),
            "entropy_target": target,
            "k": m.get("k", float("nan")),
            "logp_gap_mean": m.get("logp_gap_mean", float("nan")),
            "logp_gap_max": m.get("logp_gap_max", float("nan")),
            "loss": m.get("loss", float("nan")),
            "grad_norm": m.get("grad_norm", float("nan")),
            "staleness_mean": float(np.mean(report.staleness)) if report.staleness else 0.0,
            "staleness_max": float(np.max(report.staleness)) if report.staleness else 0.0,
            "version": report.version,
            "step_seconds": now - last_step_time[0],
            "wall": climb_wall(),
            "rollouts_per_s": stats.rollouts / max(climb_wall(), 1e-9),
            "stale_rollouts_dropped": controller.counters["stale_rollouts_dropped"],
            "early_dropped": stats.early_dropped,
            "full_dropped": stats.full_dropped,
            "failures": stats.failures,
        }
        # The learner's own diagnostics (clip fractions, ratio statistics, support misses, LB).
        for key in ("clip_low_frac", "clip_high_frac", "clip_outer_frac", "ratio_mean",
                    "ratio_max", "support_miss_frac", "load_balance_loss", "policy_loss"):
            if key in m:
                record[key] = m[key]
        if temperature is not None:
            # The next samples use the new temperature (in-flight requests keep theirs; every
            # rollout records the temperature it was sampled at, which the learner uses). A step
            # with no trained token has no Ĥ and leaves it as it is.
            if np.isfinite(record["entropy"]):
                sample_at(temperature.update(record["entropy"]))
            record["temperature"] = temperature.temperature
        for age in report.staleness:
            history.setdefault("staleness_hist", {}).setdefault(str(age), 0)
            history["staleness_hist"][str(age)] += 1
        last_step_time[0] = now
        stop = False
        if report.step % cfg.eval_every == 0 or report.step >= cfg.num_steps:
            acc = heldout_pass_at_1(client, heldout, tok, cfg.max_tokens, stops)
            record["heldout_pass_at_1"] = acc
            record["eval_version"] = float(report.version)
            history["eval"].append({"step": report.step, "wall": climb_wall(), "pass_at_1": acc,
                                    "version": report.version})
            if stop_at_gain is not None and acc >= history["base_pass_at_1"] + stop_at_gain:
                history["reached_gain_at_wall"] = climb_wall()
                stop = True
        writer.write(report.step, {k: v for k, v in record.items()
                                   if not isinstance(v, float) or np.isfinite(v)})
        tracer.after_step(report.step, None)
        tracer.before_step(report.step + 1)
        if progress:
            shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()
                     if k in ("reward_mean", "heldout_pass_at_1", "entropy", "k", "temperature",
                              "staleness_mean", "rollouts_per_s", "wall")}
            print(json.dumps({"step": report.step, **shown}), flush=True)
        save(report.step, force=stop)
        if deadline is not None and time.perf_counter() > deadline:
            stop = True
        return stop

    controller.on_step = on_step
    try:
        tracer.before_step(controller.step + 1)
        controller.run(cfg.num_steps)
        # The last pushed version may lag the learner: serve the final weights for the final eval.
        final_version = controller.version + 1
        publish(final_version)
        controller.version = final_version
        final = heldout_pass_at_1(client, heldout, tok, cfg.max_tokens, stops)
        history["eval"].append({"step": controller.step, "wall": climb_wall(), "pass_at_1": final,
                                "version": final_version})
        writer.write(controller.step, {"heldout_pass_at_1_final": final})
        save(controller.step, force=True)
    except BaseException as err:
        if dist is not None:  # the followers raise this instead of waiting for a command
            dist.abort(f"{type(err).__name__}: {err}")
        raise
    finally:
        if dist is not None:  # before ckpt.close(): the followers close theirs after `stop`
            dist.stop()
        tracer.close()
        writer.close()
        ckpt.close()
        store.close()
        if server is not None:
            server.stop()
        if router is not None:
            router.close()

    util = controller.utilisation()
    summary = {
        "base_pass_at_1": history["base_pass_at_1"],
        "final_pass_at_1": final,
        "improvement": final - history["base_pass_at_1"],
        "steps": controller.step,
        "wall_seconds": time.perf_counter() - t_start,
        "climb_wall_seconds": climb_wall(),
        "base_pretrain_seconds": base_seconds,
        "resumed_from": resumed_from,
        "mode": ctl_cfg.mode,
        "placement": "multi_process" if inference_addresses else "single_process",
        "learner_processes": processes,
        "rollouts": stats.rollouts,
        "stale_rollouts_dropped": controller.counters["stale_rollouts_dropped"],
        "accepted_groups_consumed": controller.accepted_consumed,
        "buffered_groups": len(controller.buffer),
        "logp_gap_mean": _mean_metric(os.path.join(output_dir, "metrics.jsonl"),
                                      "logp_gap_mean"),
        "entropy_within_25pct": _entropy_within(os.path.join(output_dir, "metrics.jsonl"),
                                                target),
        "entropy_within_25pct_smoothed_10": _entropy_within(
            os.path.join(output_dir, "metrics.jsonl"), target, smooth=10),
        "worker_stats": stats.as_dict(),
        "evals": history["eval"],
        "reached_gain_at_wall": history.get("reached_gain_at_wall"),
        "staleness_hist": history.get("staleness_hist", {}),
        **util,
    }
    with open(os.path.join(output_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    write_report(output_dir, summary, target)
    return ClimbResult(output_dir, summary)


def _follow(output_dir: str, dist, ckpt, t_start: float) -> ClimbResult:
    """A follower learner process (jax.process_index() > 0): run the leader's learner commands
    (train, gather, save, restore) until it stops; see hcjax.rl.multihost."""
    import jax

    try:
        steps = dist.follow(ckpt)
    finally:
        ckpt.close()
    return ClimbResult(output_dir, {"role": "follower", "process_index": jax.process_index(),
                                    "learner_steps": steps,
                                    "wall_seconds": time.perf_counter() - t_start})


def _mean_metric(path: str, key: str) -> float:
    from hcjax.metrics import read_metrics

    _, ys = _series(read_metrics(path), key)
    return float(np.mean(ys)) if ys else float("nan")


def _entropy_within(path: str, target: float, warmup_fraction: float = 0.25,
                    smooth: int = 1) -> float:
    """Fraction of steps after warm-up (the first quarter) whose Ĥ is within ±25% of H*; with
    `smooth` > 1, Ĥ is first averaged over the last `smooth` steps (one step's estimate comes from
    a few hundred tokens and is noisy by itself)."""
    from hcjax.metrics import read_metrics

    _, ys = _series(read_metrics(path), "entropy")
    if smooth > 1 and ys:
        csum = np.cumsum([0.0, *ys])
        ys = [(csum[i + 1] - csum[max(0, i + 1 - smooth)]) / min(i + 1, smooth)
              for i in range(len(ys))]
    warm = ys[int(len(ys) * warmup_fraction):]
    if not warm:
        return float("nan")
    return float(np.mean([abs(e - target) <= 0.25 * target for e in warm]))


# Report ----------------------------------------------------------------------------------------


def _series(records: list[dict], key: str, x: str = "step") -> tuple[list, list]:
    pts = [(r[x], r[key]) for r in records
           if key in r and x in r and np.isfinite(float(r[key]))]
    return ([p[0] for p in pts], [p[1] for p in pts]) if pts else ([], [])


def write_report(output_dir: str, summary: dict, entropy_target: float) -> str:
    """report.md with PNG plots of the climb (reward, pass@1, entropy, k, lengths, staleness,
    train-inference log-prob gap) from metrics.jsonl and the summary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hcjax.metrics import read_metrics

    records = read_metrics(os.path.join(output_dir, "metrics.jsonl"))
    evals = summary.get("evals", [])
    plots: list[tuple[str, str]] = []

    def figure(name: str, title: str, draw) -> None:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        draw(ax)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(output_dir, name), dpi=90)
        plt.close(fig)
        plots.append((name, title))

    def reward_vs(x: str, xlabel: str):
        def draw(ax):
            xs, ys = _series(records, "reward_mean", x)
            ax.plot(xs, ys, label="train reward (mean)")
            ax.plot([e[x if x == "step" else "wall"] for e in evals],
                    [e["pass_at_1"] for e in evals], "o-", label="held-out pass@1")
            ax.set_xlabel(xlabel)
        return draw

    figure("reward_vs_step.png", "reward and held-out pass@1 vs step", reward_vs("step", "step"))
    figure("reward_vs_wall.png", "reward and held-out pass@1 vs wall time",
           reward_vs("wall", "climb wall time (s)"))

    def entropy(ax):
        xs, ys = _series(records, "entropy")
        ax.plot(xs, ys, label="entropy estimate")
        if xs:
            ax.axhline(entropy_target, color="k", ls="--", label="target H*")
            ax.fill_between(xs, 0.75 * entropy_target, 1.25 * entropy_target, alpha=0.15,
                            label="H* +-25%")
        ax.set_xlabel("step")

    figure("entropy.png", "entropy vs target", entropy)
    levers = [("k", "k.png", "upper-clip offset k")]
    if _series(records, "temperature")[0]:
        levers.append(("temperature", "temperature.png", "sampling temperature (entropy lever)"))
    for key, name, title in [*levers,
                             ("response_len_mean", "lengths.png", "mean response length"),
                             ("logp_gap_mean", "logp_gap.png",
                              "train-inference log-prob gap (mean |diff|)")]:
        def draw(ax, key=key):
            xs, ys = _series(records, key)
            ax.plot(xs, ys, label=key)
            ax.set_xlabel("step")

        figure(name, title, draw)

    def hist(ax):
        h = summary.get("staleness_hist", {})
        ages = sorted(int(a) for a in h)
        ax.bar(ages, [h[str(a)] for a in ages])
        ax.set_xlabel("versions behind at training time")
        ax.set_ylabel("rollouts")

    figure("staleness.png", "staleness of trained rollouts", hist)
    keys = ("base_pass_at_1", "final_pass_at_1", "improvement", "steps", "wall_seconds",
            "climb_wall_seconds", "base_pretrain_seconds", "mode", "placement", "rollouts",
            "stale_rollouts_dropped", "learner_utilisation", "rollout_utilisation")
    within = summary.get("entropy_within_25pct", float("nan"))
    gaps = _series(records, "logp_gap_mean")[1]
    lines = ["# hcjax climb report", "", "| figure | value |", "|---|---|"]
    for k in keys:
        v = summary.get(k)
        lines.append(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
    lines.append(f"| entropy within +-25% of H*={entropy_target} after warm-up (fraction of "
                 f"steps) | {within:.3g} |")
    smoothed = summary.get("entropy_within_25pct_smoothed_10", float("nan"))
    lines.append(f"| same, Ĥ averaged over 10 steps | {smoothed:.3g} |")
    lines.append(f"| mean train-inference log-prob gap | "
                 f"{(float(np.mean(gaps)) if gaps else float('nan')):.3g} |")
    lines += ["", "## Held-out pass@1", "", "| step | wall (s) | pass@1 |", "|---|---|---|"]
    lines += [f"| {e['step']} | {e['wall']:.1f} | {e['pass_at_1']:.3f} |" for e in evals]
    lines += [""] + [f"![{title}]({name})" for name, title in plots]
    text = "\n".join(lines) + "\n"
    path = os.path.join(output_dir, "report.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def jnp_copy(x):
    import jax.numpy as jnp

    return jnp.copy(x)


class _RouterClient:
    """The router under the workers' `generate(request, timeout)` call."""

    def __init__(self, router) -> None:
        self.router = router

    def generate(self, request, timeout=None):
        return self.router.generate(request, timeout=timeout)


def _remote_publisher(learner, addresses: Sequence[str],
                      on_dead: Callable[[str], None] | None = None,
                      params: Callable[[], Any] | None = None):
    """Learner side of the multi-process placement: `publish(version)` moves the learner's
    current params to every inference process through a reshard plan (hcjax.rl.weight_sync); a
    replica that fails is dropped (`on_dead`, e.g. the router's remove_replica).

    params: the tree to publish (default: the learner's); a learner over several processes
    passes DistributedLearner.local_params, its params gathered onto process 0's devices."""
    from hcjax.rl.weight_sync import WeightPublisher

    return WeightPublisher(params or (lambda: learner.state.params), addresses, on_dead=on_dead)


def serve_inference(host: str, port: int, ready: Callable[[int], None] | None = None,
                    stop: Any = None) -> None:
    """The inference process of the multi-process placement: the gin-configured model on every
    local device, a RolloutServer, and gRPC services Rollout (generate) and Weights (the plan
    transfer's control channel, hcjax.rl.weight_sync).
    Serves until `stop` (a threading.Event) is set or SIGTERM/SIGINT."""
    import signal
    import threading

    from hcjax.model import ModelConfig, create_sharded
    from hcjax.rl.weight_sync import weights_service
    from hcjax.rollout import Engine, GenerateRequest, RolloutServer
    from hcjax.rollout.auth import Security, add_port
    from hcjax.rollout.service import RolloutServicer
    from hcjax.rollout.service import grpc_server as service_grpc_server
    from hcjax.sharding import MeshConfig, make_mesh

    cfg = ClimbConfig()
    model_cfg = ModelConfig()
    mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1, expert=1))
    model = create_sharded(model_cfg, mesh)
    longest_prompt = 32
    engine = Engine(model, mesh=mesh, max_concurrent_decodes=cfg.max_concurrent_decodes,
                    max_prefill_length=longest_prompt,
                    max_target_length=min(model_cfg.max_seq_len,
                                          longest_prompt + cfg.max_tokens + 8))
    server = RolloutServer(engine, version=-1, max_queue=4096).start()
    server.generate(GenerateRequest(prompt=[0], max_tokens=2, temperature=0.0, seed=0))
    security = Security.from_env()  # token / TLS from the environment, as the clients read them
    grpc_server = service_grpc_server(security, max_receive_mb=1024, max_send_mb=1024)
    grpc_server.add_generic_rpc_handlers(
        (RolloutServicer(server).handler(), weights_service(server, engine.load_params(), host)))
    bound = add_port(grpc_server, f"{host}:{port}", security)
    grpc_server.start()
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    if ready is not None:
        ready(bound)
    stop.wait()
    grpc_server.stop(grace=2.0).wait()
    server.stop()


def _extra_args(parser) -> None:
    parser.add_argument("--role", choices=("climb", "inference"), default="climb",
                        help="climb: learner + controller (+ in-process inference unless "
                        "--inference_address); inference: a rollout server process")
    base = parser.add_mutually_exclusive_group()
    base.add_argument("--base_checkpoint", default=None,
                      help="run folder (or checkpoints/ folder) of an hcjax.sft base; default: "
                      "pre-train the tiny base into OUTPUT_DIR/base")
    from hcjax.config import add_hf_checkpoint_flag

    add_hf_checkpoint_flag(base)
    parser.add_argument("--inference_address", action="append", default=[],
                        help="host:port of an inference process (repeatable)")
    parser.add_argument("--host", default="127.0.0.1", help="inference role: address to bind")
    parser.add_argument("--port", type=int, default=0, help="inference role: port (0 = any)")
    parser.add_argument("--mode", choices=("async", "on_policy"), default=None)
    parser.add_argument("--coordinator_address", default=None,
                        help="jax.distributed coordinator host:port (multi-host learner)")
    parser.add_argument("--num_processes", type=int, default=1)
    parser.add_argument("--process_id", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no per-step progress lines")


def main(argv: Sequence[str] | None = None) -> ClimbResult | None:
    from hcjax import config

    flags = config.parse_flags(argv, description=__doc__.splitlines()[0],
                               default_gin_files=["climb_tiny.gin"], extra_args=_extra_args)
    args = flags.extra
    if args.hf_checkpoint and (args.role == "inference" or args.inference_address):
        raise SystemExit("error: --hf_checkpoint runs the in-process engine only; --role inference"
                         " and --inference_address serve the gin ModelConfig")
    config.bind(flags.gin_files, flags.gin_params)
    leader = True
    if args.coordinator_address:
        import jax

        if args.role == "inference":
            raise ValueError(
                f"--coordinator_address={args.coordinator_address} is for the learner processes "
                "(--role climb); an inference process serves on its own, without it")
        jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
        # A learner over several processes (hcjax.rl.multihost): every process runs run_climb and
        # builds the learner on the mesh over all of them; process 0 then drives the climb and
        # the others follow its learner commands until it stops.
        leader = jax.process_index() == 0
    if args.role == "inference":
        if flags.output_dir:
            config.write_config(flags.output_dir, flags)

        def ready(port: int) -> None:
            print(json.dumps({"event": "serving", "port": port}), flush=True)

        serve_inference(args.host, args.port, ready)
        return None
    output_dir = flags.output_dir or os.path.join("runs", "climb")
    if leader:
        config.write_config(output_dir, flags)
    result = run_climb(output_dir, base_checkpoint=args.base_checkpoint,
                       hf_checkpoint=args.hf_checkpoint,
                       inference_addresses=args.inference_address, mode=args.mode,
                       progress=not args.quiet and leader)
    if not leader:  # a follower learner process: its summary is its role and steps
        print(json.dumps({"event": "follower_done", **result.summary}), flush=True)
        return result
    config.write_operative_config(output_dir)
    s = result.summary
    print(json.dumps({k: s[k] for k in ("base_pass_at_1", "final_pass_at_1", "improvement",
                                        "steps", "wall_seconds", "mode", "placement")}))
    return result
