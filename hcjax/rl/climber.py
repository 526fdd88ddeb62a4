"""The climb as a library object (RECIPE §1, §3, §4): `Climb(output_dir, base_checkpoint=...)`
builds every part from gin — the task suite and its rewards (TaskConfig), the climb's settings
and sampling (ClimbConfig), the placement (Placement), the learner (LearnerConfig), the
controller (ControllerConfig), the problem source (SourceConfig) — on a base it is given, and
`run()` climbs and returns the summary. Each part lives in the module that owns it; this file
only wires them and keeps the climb's history (evaluations, checkpoints, metrics). It trains no
base: the job that wants one pre-trained (`python -m hcjax.climb`) makes it first."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import gin
import jax
import numpy as np

from hcjax.checkpoint import CheckpointConfig, Checkpointer, jsonable
from hcjax.data.template import stop_ids
from hcjax.data.tokenizer import ByteTokenizer, load_tokenizer
from hcjax.display import ClimbDisplay, resolve_format
from hcjax.finite import check_finite
from hcjax.metrics import MetricsWriter
from hcjax.model import ModelConfig, with_batch_invariant, with_compute_dtype
from hcjax.model.config import DTYPES
from hcjax.model_io import hf_source_meta, load_hf_model, load_model
from hcjax.profiling import StepTracer
from hcjax.rewards.types import Grade
from hcjax.rl.controller import Controller, ControllerConfig, StepReport
from hcjax.rl.curriculum import EarlyExit, LengthCurriculum
from hcjax.rl.inference import LocalInference, RemoteInference
from hcjax.rl.learner import Learner, LearnerConfig
from hcjax.rl.multihost import DistributedLearner
from hcjax.rl.pass_at_1 import PassAt1, greedy
from hcjax.rl.placement import Placement
from hcjax.rl.report import (
    entropy_within,
    mean_metric,
    step_record,
    suite_gain,
    write_report,
)
from hcjax.rl.sources import SourceConfig, TaskBuilder, longest_prompt, make_source
from hcjax.rl.store import RolloutStore, read_groups, rollout_from_json, rollout_to_json
from hcjax.rl.workers import (
    GroupResult,
    PartialRegistry,
    ProblemWorker,
    RolloutWorker,
    WorkerStats,
)
from hcjax.rollout.request import SamplingOptions, sampling_options_from_gin
from hcjax.tasks.task_config import TaskConfig
from hcjax.transfer.weights_service import Unreached

log = logging.getLogger(__name__)

__all__ = ["Climb", "ClimbConfig", "ClimbResult", "ClimbSettings", "EngineLengths",
           "engine_lengths", "run_climb"]


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ClimbConfig:
    """The climb's own settings; the task (TaskConfig: suite and rewards), placement (Placement),
    learner (LearnerConfig), controller (ControllerConfig), problem source (SourceConfig), model
    (ModelConfig) and a base's pre-training (TrainerConfig, AdamWConfig) have their own.

    sampling: how rollouts are drawn (hcjax.rollout.request.SamplingOptions; default: gin's
      `SamplingOptions.*` bindings over its defaults): max_tokens, response tokens per model
      turn (a length_curriculum, hcjax.rl.curriculum.LengthCurriculum, replaces it by a growing
      budget per stage of learner steps); temperature (the start value when the entropy
      controller moves it: EntropyController.temperature_delta > 0, hcjax.rl.entropy); top_p;
      token_budget (Kimi partial rollouts); priority. Its stop tokens are the tokenizer's and
      each request's seed comes from the climb, so those two stay unset.
    max_minutes: the whole run's wall-time budget (None: run all num_steps): from the start of the
      command (the base's pre-training, loading, compiling and the base evaluation count), the
      climb stops stepping early enough to leave the final evaluation (timed as the base's) and
      the save, so a slower host climbs fewer steps rather than running over.
    early_group / group: G_early and G of early-exit sampling; early/full windows as RECIPE §3.
    max_prompt_len: the engine's max prefill length for single-turn prompts; None: the suite's
      longest templated prompt (at least 32). max_prefill_length: for multi-turn episodes, whose
      later turns carry the earlier ones (None: prompt + the episode budget's turns).
    checkpoint_every: learner steps between the climb's checkpoints (its other checkpoint
      settings, keep and async_save, are the gin CheckpointConfig's).
    template_observations: tool episodes append the tokenizer's chat-template wrapping of tool
      messages (an HFTokenizer's template) instead of plain-text observations, and count the
      episodes whose whole re-rendering drifts from the sampled tokens (report.md).
    sampler_dtype: the in-process inference replicas' compute dtype ("float32" or "bfloat16"),
      over the learner's fp32 master weights as pushed; None: the learner's (ModelConfig.dtype).
      E.g. "bfloat16" with ModelConfig.dtype = "float32" samples in bf16 against an fp32
      learner (bench.precision's climbs). Remote replicas compute in their own ModelConfig.dtype.
    """

    sampling: SamplingOptions = dataclasses.field(default_factory=sampling_options_from_gin)
    num_steps: int = 60
    max_minutes: float | None = None
    group: int = 8
    early_group: int = 4
    early_window: tuple[float, float] = (0.05, 0.95)
    full_window: tuple[float, float] = (0.05, 0.95)
    advantage: str = "mean_std"
    length_curriculum: LengthCurriculum | None = None
    max_retries: int = 3
    eval_every: int = 10
    eval_problems: int = 200
    max_concurrent_decodes: int = 64
    checkpoint_every: int = 10
    profile_start: int = -1
    profile_stop: int = -1
    seed: int = 0
    max_prompt_len: int | None = None
    max_prefill_length: int | None = None
    template_observations: bool = False
    sampler_dtype: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingOptions):
            raise ValueError(f"ClimbConfig.sampling={self.sampling!r} must be a SamplingOptions")
        # As plain options (gin builds `@SamplingOptions()` as its registered wrapper).
        object.__setattr__(self, "sampling", self.sampling.options())
        if self.sampling.stop_tokens or self.sampling.seed is not None:
            raise ValueError(
                f"ClimbConfig.sampling has stop_tokens={self.sampling.stop_tokens} and seed="
                f"{self.sampling.seed}: the climb's stop tokens are its tokenizer's and each "
                "request's seed is drawn from ClimbConfig.seed; leave both unset")
        if self.sampler_dtype is not None and self.sampler_dtype not in DTYPES:
            raise ValueError(f"ClimbConfig.sampler_dtype={self.sampler_dtype!r} must be None or "
                             f"one of {sorted(DTYPES)}")
        for name in ("num_steps", "group", "early_group", "eval_every",
                     "max_concurrent_decodes", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"ClimbConfig.{name}={getattr(self, name)} must be >= 1")
        if self.early_group > self.group:
            raise ValueError(f"ClimbConfig.early_group={self.early_group} exceeds "
                             f"group={self.group}")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ValueError(f"ClimbConfig.max_minutes={self.max_minutes} must be > 0 or None")
        for name in ("max_prompt_len", "max_prefill_length"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"ClimbConfig.{name}={getattr(self, name)} must be >= 1 or None")

    def early_exit(self) -> EarlyExit:
        return EarlyExit(self.early_group, self.group, tuple(self.early_window),
                         tuple(self.full_window))

    def longest_response(self) -> int:
        """The most response tokens one model turn may take over the whole climb."""
        if self.length_curriculum is None:
            return self.sampling.max_tokens
        return self.length_curriculum.end

    def max_tokens_at(self, step: int) -> int:
        if self.length_curriculum is None:
            return self.sampling.max_tokens
        return self.length_curriculum.max_length(step)


@dataclasses.dataclass
class ClimbResult:
    output_dir: str
    summary: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ClimbSettings:
    """What a climb reads from gin, built and checked together, so that a binding mistake or an
    impossible placement fails before anything heavy runs (a base pre-trained, a model loaded,
    a step compiled). `from_gin` builds it; a job checks it, makes its base, then builds the
    Climb from it."""

    cfg: ClimbConfig
    task: TaskConfig
    suite: Any
    controller: ControllerConfig
    learner: LearnerConfig
    model: ModelConfig
    placement: Placement  # resolved against the devices present
    processes: int  # learner processes (jax.process_count())

    @classmethod
    def from_gin(cls, *, inference_addresses: Sequence[str] = (), mode: str | None = None
                 ) -> ClimbSettings:
        """inference_addresses override Placement.inference_addresses; mode,
        ControllerConfig.mode."""
        cfg, task = ClimbConfig(), TaskConfig()
        controller = ControllerConfig()
        if mode is not None:
            controller = dataclasses.replace(controller, mode=mode)
        learner, model, placement = LearnerConfig(), ModelConfig(), Placement()
        if inference_addresses:
            placement = dataclasses.replace(placement,
                                            inference_addresses=tuple(inference_addresses))
        suite = task.make_suite()
        # Placement first: a mesh the devices cannot form fails here, before any compile.
        processes = jax.process_count()
        if processes > 1 and not placement.inference_addresses:
            raise ValueError(
                f"a learner over {processes} processes needs remote inference "
                "(Placement.inference_addresses or --inference_address): the in-process engine "
                "cannot hold parameters that span every process")
        placement = placement.resolve(jax.devices())
        if cfg.sampler_dtype is not None and placement.remote:
            raise ValueError(
                f"ClimbConfig.sampler_dtype={cfg.sampler_dtype!r} sets the in-process replicas' "
                "compute dtype; remote replicas (Placement.inference_addresses, --inference_address"
                ", Placement.backend='ray') compute in their own ModelConfig.dtype: bind it there")
        return cls(cfg, task, suite, controller, learner, model, placement, processes)

    def check_base(self, base_checkpoint: str | None, hf_checkpoint: str | None) -> None:
        """The base the climb may start from: one of the two, and a run folder when the learner
        spans processes (each would otherwise load or make its own). Neither: the job is about to
        pre-train one (`hcjax.train.sft.pretrain_base`), which only one process may do."""
        if hf_checkpoint is not None and base_checkpoint is not None:
            raise ValueError(f"hf_checkpoint={hf_checkpoint!r} and base_checkpoint="
                             f"{base_checkpoint!r}: the climb starts from one base, give one")
        if self.processes > 1 and base_checkpoint is None:
            raise ValueError(
                f"a learner over {self.processes} processes needs --base_checkpoint: pre-train "
                "the base first with `python -m hcjax.sft` (every process would pre-train its own)")


def _shaping_for(rewards: Mapping[str, Any], max_tokens: Any, step: Any, decode: Any):
    """suite -> the group shaping callable of its RewardSpec (None when it has none): the
    graded rollouts of a kept group -> the same with the spec's composed rewards (RECIPE §3)."""
    def for_suite(suite: Any):
        spec = rewards.get(getattr(suite, "name", ""))
        if spec is None:
            return None

        def shape(rollouts: list) -> list:
            valid = [r for r in rollouts if not r.aborted]
            grades = [Grade(float(r.reward), correct=r.reward_components.get("correct", 0) > 0,
                            components=dict(r.reward_components)) for r in valid]
            lengths = [int(r.loss_mask.sum()) for r in valid]
            texts = ([decode(r.response_ids[r.loss_mask].tolist()) for r in valid]
                     if spec.language_weight > 0 else None)
            shaped = iter(spec.group_rewards(grades, lengths, max_length=max_tokens(),
                                             step=step(), texts=texts))
            out = []
            for r in rollouts:
                if r.aborted:
                    out.append(r)
                    continue
                g = next(shaped)
                out.append(dataclasses.replace(r, reward=float(g.reward),
                                               reward_components=dict(g.components)))
            return out

        return shape

    return for_suite


@dataclasses.dataclass(frozen=True)
class EngineLengths:
    """Token lengths of the climb's inference engines, in-process or remote (hcjax.serve's
    --max_prefill_length / --max_target_length)."""

    max_prompt_len: int
    max_prefill_length: int
    max_target_length: int


def engine_lengths(cfg: ClimbConfig, suite: Any, tok: Any, max_seq_len: int) -> EngineLengths:
    """The engine lengths a climb of `suite` needs: prompts a quarter longer than the longest
    seen in a scan of the suite (a later problem may tokenize a little longer; a longer one is an
    error naming it); the prefill holds the longest prompt, or for suites with tools (whose later
    turns carry the earlier ones) all of the model's context but one turn's response."""
    longest = longest_prompt(suite, tok)
    max_prompt_len = cfg.max_prompt_len or max(32, longest + longest // 4)
    if cfg.max_prefill_length is not None:
        prefill = cfg.max_prefill_length
    elif any(suite.tools(p) is not None for p in suite.heldout()):
        prefill = max(max_prompt_len, max_seq_len - cfg.longest_response() - 8)
    else:
        prefill = max_prompt_len
    target = min(max_seq_len, prefill + cfg.longest_response() + 8)
    return EngineLengths(max_prompt_len, prefill, target)


class Climb:
    """One climb in `output_dir` (resumed when it holds checkpoints), from a base it is given.

    base_checkpoint: any hcjax run (e.g. an hcjax.sft base; `hcjax.train.sft.pretrain_base`
    makes the tiny one); hf_checkpoint: a Hugging Face folder as the base instead (its model,
    tokenizer and chat template). settings: the gin settings already built and checked
    (`ClimbSettings.from_gin`); None builds them here, with inference_addresses (remote `python -m
    hcjax.serve` replicas, overriding Placement.inference_addresses) and mode (overriding
    ControllerConfig.mode). stop_at_gain: stop once held-out pass@1 is this much above the
    base's (bench.climb). progress: show the climb as log_format says (hcjax.display: "auto" is
    a live panel on a terminal, JSON lines otherwise); False shows nothing but notes.
    base_seconds: what making the base took the job before this climb was built (pre-training),
    counted in the summary's `wall_seconds` and `base_pretrain_seconds`."""

    def __init__(self, output_dir: str, *, base_checkpoint: str | None = None,
                 hf_checkpoint: str | None = None, settings: ClimbSettings | None = None,
                 inference_addresses: Sequence[str] = (), mode: str | None = None,
                 progress: bool = True, stop_at_gain: float | None = None,
                 log_format: str = "auto", base_seconds: float = 0.0) -> None:
        if settings is not None and (inference_addresses or mode is not None):
            raise ValueError(f"inference_addresses={list(inference_addresses)} and mode={mode!r} "
                             "are settings: pass them to ClimbSettings.from_gin, not beside one")
        self.t_start = time.perf_counter() - base_seconds
        self.unreached_pushes = 0  # weight pushes no replica installed (kept; see _publish)
        self.output_dir = os.path.abspath(output_dir)
        self.progress, self.stop_at_gain = progress, stop_at_gain
        settings = settings or ClimbSettings.from_gin(inference_addresses=inference_addresses,
                                                      mode=mode)
        settings.check_base(base_checkpoint, hf_checkpoint)
        if base_checkpoint is None and hf_checkpoint is None:
            raise ValueError("a climb starts from a base: give base_checkpoint (any hcjax run; "
                             "hcjax.train.sft.pretrain_base makes the tiny one) or hf_checkpoint")
        os.makedirs(self.output_dir, exist_ok=True)
        self.cfg = cfg = settings.cfg
        self.task, self.suite, self.processes = settings.task, settings.suite, settings.processes
        self.ctl_cfg, self.learner_cfg = settings.controller, settings.learner
        self.placement = settings.placement
        # Entropy control (hcjax.rl.entropy): k moves inside the learner's step; the sampling
        # temperature, when the controller moves it, here after each step (None: fixed).
        self.entropy = self.learner_cfg.entropy
        self.temperature = self.entropy.initial_temperature(cfg.sampling.temperature)
        self.display = ClimbDisplay(resolve_format(log_format) if progress else "off",
                                    num_steps=cfg.num_steps, max_minutes=cfg.max_minutes,
                                    entropy_target=self.entropy.target)
        self.interrupted = False
        self.tok = self._tokenizer(hf_checkpoint)
        self.stops = tuple(stop_ids(self.tok))
        self.step_now = 0
        shaping = _shaping_for(self.task.rewards, lambda: self.rollout_worker.sampling.max_tokens,
                               lambda: self.step_now, self.tok.decode)

        # The base model on the learner mesh.
        t_base = time.perf_counter()
        ckpt_meta: dict[str, Any] = {}
        learner_mesh = self.placement.learner_mesh
        if hf_checkpoint is not None:
            model, model_cfg = load_hf_model(hf_checkpoint, learner_mesh)
            # Exact mode is the one ModelConfig switch an HF model takes from gin.
            model = with_batch_invariant(model, settings.model.batch_invariant)
            model_cfg = model.config
            ckpt_meta = hf_source_meta(hf_checkpoint, self.output_dir)
            if self.tok.vocab_size > model_cfg.vocab_size:
                raise ValueError(f"the tokenizer of {hf_checkpoint!r} has {self.tok.vocab_size} "
                                 f"ids; the model's vocab_size is {model_cfg.vocab_size}")
        else:
            model, model_cfg = load_model(base_checkpoint, learner_mesh, settings.model)
        self.model_cfg = model_cfg
        self.base_seconds = base_seconds + time.perf_counter() - t_base
        # Tool episodes' later turns are prefilled with everything before them: their context
        # is capped at the engine's prefill limit (an episode reaching it ends as "length").
        self.lengths = engine_lengths(cfg, self.suite, self.tok, model_cfg.max_seq_len)
        self.max_prompt_len = self.lengths.max_prompt_len
        self.prefill_length = self.lengths.max_prefill_length
        self.builder = TaskBuilder(self.suite, self.tok, max_prompt_len=self.max_prompt_len,
                                   max_context=self.prefill_length, shaping=shaping,
                                   template_observations=cfg.template_observations)
        learner = Learner(model, self.learner_cfg, learner_mesh)
        self.learner = learner
        # Several learner processes: process 0 sends every learner call to the others, which
        # run them in the same order (hcjax.rl.multihost); the leader then touches the learner
        # mesh only through `dist`.
        self.dist = None
        if self.processes > 1:
            self.dist = DistributedLearner(learner)
        # ClimbConfig.checkpoint_every is the climb's save interval; the rest (keep, async_save)
        # is the gin CheckpointConfig's.
        self.ckpt = Checkpointer(os.path.join(self.output_dir, "checkpoints"),
                                 dataclasses.replace(CheckpointConfig(),
                                                     save_every=cfg.checkpoint_every),
                                 {"model_config": jsonable(model_cfg), **ckpt_meta})
        self.is_follower = self.dist is not None and not self.dist.is_leader
        if self.is_follower:
            return
        self.inference = self._inference(model)

        self.stats = WorkerStats()
        self.partials = PartialRegistry()
        self.sampling = dataclasses.replace(cfg.sampling, max_tokens=cfg.max_tokens_at(0),
                                            stop_tokens=self.stops)
        self.rollout_worker = RolloutWorker(self.inference, self.sampling,
                                            max_retries=cfg.max_retries, stats=self.stats,
                                            partials=self.partials)
        worker = ProblemWorker(self.rollout_worker, cfg.early_exit(), advantage=cfg.advantage,
                               stats=self.stats)
        self.source = make_source(self.builder, SourceConfig())
        self.store = RolloutStore(os.path.join(self.output_dir, "rollouts"),
                                  decode=self.tok.decode)
        self.controller = Controller(self.ctl_cfg, self.source, worker, self.dist or learner,
                                     self._publish, on_group=self._on_group,
                                     on_step=self._on_step, stats=self.stats)
        self.evaluator = PassAt1(self.inference, self.builder,
                                 list(self.suite.heldout())[: cfg.eval_problems],
                                 greedy(self.sampling), max_retries=cfg.max_retries)
        self.history: dict[str, Any] = {"eval": [], "wall_offset": 0.0, "base_pass_at_1": None}
        self.resumed_from: int | None = None
        self.saved_step: int | None = None
        self.deadline: float | None = None
        self.t_climb = time.perf_counter()
        self.last_step_time = self.t_run = time.perf_counter()
        # Opened when climbing starts (`_climb`), closed by `close`.
        self.writer: MetricsWriter | None = None
        self.tracer: StepTracer | None = None

    # Construction helpers ----------------------------------------------------------------------
    @staticmethod
    def _tokenizer(hf_checkpoint: str | None):
        return ByteTokenizer() if hf_checkpoint is None else load_tokenizer(hf_checkpoint)

    def _inference(self, model):
        params = self._params
        if self.placement.remote:
            return RemoteInference(self.placement.inference_addresses, params)
        prefill, target = self.lengths.max_prefill_length, self.lengths.max_target_length
        if prefill >= target:
            raise ValueError(
                f"prompts of up to {prefill} tokens plus {self.cfg.longest_response()} response "
                f"tokens do not fit the model's max_seq_len={self.model_cfg.max_seq_len} (set "
                "ClimbConfig.max_prefill_length / max_tokens)")
        model = self.learner.model()
        if self.cfg.sampler_dtype is not None:
            model = with_compute_dtype(model, self.cfg.sampler_dtype)
        return LocalInference(model, self.placement.inference_meshes, params,
                              max_concurrent_decodes=self.cfg.max_concurrent_decodes,
                              max_prefill_length=prefill, max_target_length=target)

    def _params(self) -> Any:
        """The learner's current parameters, as the inference side receives them."""
        return self.dist.local_params() if self.dist is not None else self.learner.params()

    def _publish(self, version: int) -> None:
        """Move the learner's weights to inference as `version` once they are checked: an update
        that left NaN or Inf in them stops the climb here, naming the tensors, before any
        replica could serve it (one pass over the parameters on the learner's devices)."""
        check_finite(self._params(), f"the learner's parameters for weights version {version} "
                     "(the last train step made them non-finite; its metrics are in "
                     f"{os.path.join(self.output_dir, 'metrics.jsonl')})")
        try:
            self.inference.publish(version)
        except Unreached as err:  # kept: a replica readmitted later receives it
            self.unreached_pushes += 1
            log.warning("%s; the climb goes on, replicas get it when readmitted", err)

    # State ------------------------------------------------------------------------------------
    def _climb_wall(self) -> float:
        return float(self.history.get("wall_offset", 0.0)) + time.perf_counter() - self.t_climb

    def _restore(self) -> None:
        latest = self.ckpt.latest_step()
        if latest is None:
            return
        # Several learner processes: every one restores its shards (hcjax.rl.multihost).
        data = (self.dist or self.learner).restore(self.ckpt, latest)
        pending = [g.to_group() for g in read_groups(
            self.store.path, accepted_only=True,
            start=int(data["controller"]["accepted_consumed"]))]
        self.controller.load_state_dict(data["controller"], pending)
        for task_id, records in data.get("partials", {}).items():
            self.partials.put(task_id, [rollout_from_json(r) for r in records])
        self.history = data["history"]
        self.resumed_from = latest if self.dist is not None else self.ckpt.restored_step
        self.saved_step = self.resumed_from
        if self.temperature is not None and "temperature" in data:
            self.temperature = self.entropy.load_temperature(data["temperature"])
            self.rollout_worker.set_sampling(temperature=self.temperature)
        self._follow_curriculum(self.controller.step)

    def _save(self, step: int, force: bool = False) -> None:
        if self.saved_step == step:  # already on disk (a step is saved at most once)
            return
        data = {"controller": self.controller.state_dict(),
                "partials": {k: [rollout_to_json(r) for r in v]
                             for k, v in self.partials.snapshot().items()},
                "history": dict(self.history, wall_offset=self._climb_wall())}
        if self.temperature is not None:
            data["temperature"] = self.entropy.temperature_state(self.temperature)
        if (self.dist or self.learner).save(self.ckpt, step, data, force=force):
            self.saved_step = step

    def _follow_curriculum(self, step: int) -> None:
        """The length curriculum's response budget and the source's curriculum at `step`."""
        self.step_now = step
        self.source.advance(step)
        max_tokens = self.cfg.max_tokens_at(step)
        if max_tokens != self.rollout_worker.sampling.max_tokens:
            self.rollout_worker.set_sampling(max_tokens=max_tokens)
            self.evaluator.set_max_tokens(max_tokens)
        self.sampling = self.rollout_worker.sampling

    # Callbacks of the controller --------------------------------------------------------------
    def _on_group(self, group: GroupResult, accepted: bool, step: int, version: int) -> None:
        self.store.append(group, accepted=accepted, step=step, version=version)

    def _evaluate(self, step: int, version: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        with self.display.during("evaluating"):
            result = self.evaluator.evaluate()
        self.history["eval_seconds"] = time.perf_counter() - t0
        entry = {"step": step, "wall": self._climb_wall(), "pass_at_1": result["pass_at_1"],
                 "version": version, "by_category": result["by_category"],
                 "by_suite": result["by_suite"],
                 "extraction": result["extraction"]}
        self.history["eval"].append(entry)
        self.history.setdefault("category_sizes", result["category_sizes"])
        self.history.setdefault("suite_sizes", result["suite_sizes"])
        return result

    def _on_step(self, report: StepReport) -> bool:
        now = time.perf_counter()
        record = step_record(report, self.entropy.target, self.stats,
                             self.controller.counters, now - self.last_step_time,
                             self._climb_wall())
        self.last_step_time = now
        if self.temperature is not None:
            # The next samples use the new temperature (every rollout records the temperature
            # it was sampled at, which the learner uses). A step with no trained token has no Ĥ.
            if np.isfinite(record["entropy"]):
                self.temperature = self.entropy.next_temperature(self.temperature,
                                                                 record["entropy"])
                self.rollout_worker.set_sampling(temperature=self.temperature)
            record["temperature"] = self.temperature
        self._follow_curriculum(report.step)
        record["max_tokens"] = self.rollout_worker.sampling.max_tokens
        for age in report.staleness:
            hist = self.history.setdefault("staleness_hist", {})
            hist[str(age)] = hist.get(str(age), 0) + 1
        stop = self.interrupted  # Ctrl-C: this step is the last (see _on_sigint)
        if report.step % self.cfg.eval_every == 0 or report.step >= self.cfg.num_steps:
            result = self._evaluate(report.step, report.version)
            self.display.evaluated(report.step, result["pass_at_1"],
                                   result["by_suite"] if len(result["by_suite"]) > 1
                                   else result["by_category"])
            record["heldout_pass_at_1"] = result["pass_at_1"]
            record["eval_version"] = float(report.version)
            for c, v in [*result["by_category"].items(), *result["by_suite"].items()]:
                record[f"heldout_pass_at_1/{c}"] = v
            gain = self.stop_at_gain
            if gain is not None and result["pass_at_1"] >= self.history["base_pass_at_1"] + gain:
                self.history["reached_gain_at_wall"] = self._climb_wall()
                stop = True
        self.writer.write(report.step, {k: v for k, v in record.items()
                                        if not isinstance(v, float) or np.isfinite(v)})
        self.tracer.after_step(report.step, None)
        self.tracer.before_step(report.step + 1)
        self.display.step(report.step, record, self._utilisation())
        self._save(report.step, force=stop)
        if self.deadline is not None and time.perf_counter() > self.deadline:
            stop = True
        return stop

    def _utilisation(self) -> dict[str, float | None]:
        """Learner and rollout utilisation so far, for the display (Controller.utilisation()
        covers a finished run): fractions of this process's climbing time."""
        ctl = self.controller
        wall = max(time.perf_counter() - self.t_run, 1e-9)
        return {"learner_utilisation": ctl.learner_seconds / wall,
                "rollout_utilisation": min(ctl.generation_busy_now() / wall, 1.0)}

    def _on_sigint(self, signum: int, frame: Any) -> None:
        """Ctrl-C once: the step under way is the last (`_on_step` stops the controller), then
        the climb ends as a finished one does (final evaluation, checkpoint, summary, report);
        the same command resumes it. Twice: exit at once (checkpoints on disk stay)."""
        if self.interrupted:
            self.display.abort("hcjax.climb: Ctrl-C again: exiting now")
            os._exit(130)
        self.interrupted = True
        self.display.interrupt()

    def request_stop(self) -> None:
        """Stop after the step under way, as one Ctrl-C does (for a climb run off the main
        thread, e.g. in a Ray actor)."""
        if not self.interrupted:
            self._on_sigint(signal.SIGINT, None)

    # Run --------------------------------------------------------------------------------------
    def run(self) -> ClimbResult:
        if self.is_follower:
            return self._follow()
        # Ctrl-C is ours while climbing (signal handlers can only be set on the main thread).
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGINT, self._on_sigint)
        self.display.start()
        try:
            return self._climb()
        finally:
            self.display.close()
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    def _climb(self) -> ClimbResult:
        cfg = self.cfg
        try:
            self._restore()
            # Serve the learner's current weights as the controller's version.
            self.inference.start(self.controller.version)
            self.writer = MetricsWriter(self.output_dir)
            self.tracer = StepTracer(os.path.join(self.output_dir, "profile"),
                                     cfg.profile_start, cfg.profile_stop)
            self.t_climb = time.perf_counter()
            if self.history.get("base_pass_at_1") is None:
                result = self._evaluate(0, self.controller.version)
                self.history["base_pass_at_1"] = result["pass_at_1"]
                self.history["eval"][-1]["wall"] = 0.0
                self.writer.write(0, {"heldout_pass_at_1": result["pass_at_1"],
                                      **{f"heldout_pass_at_1/{c}": v for c, v in
                                         [*result["by_category"].items(),
                                          *result["by_suite"].items()]}})
            self.display.base(self.history["base_pass_at_1"], self.resumed_from,
                              self.controller.step)
            self.display.phase("climbing")
            if cfg.max_minutes is not None:
                # What the end needs: the final evaluation, as long as the last one took, and
                # the save and report (a margin).
                end = 1.25 * self.history.get("eval_seconds", 0.0) + 15.0
                self.deadline = self.t_start + 60 * cfg.max_minutes - end
                self.display.stop_stepping_in(self.deadline - time.perf_counter())
            self.last_step_time = self.t_run = time.perf_counter()
            self.tracer.before_step(self.controller.step + 1)
            self.controller.run(cfg.num_steps)
            # The last pushed version may lag the learner: serve the final weights for the
            # final evaluation.
            final_version = self.controller.push_final()
            final = self._evaluate(self.controller.step, final_version)
            self.writer.write(self.controller.step, {"heldout_pass_at_1_final": final["pass_at_1"]})
            self.display.phase("saving")
            self._save(self.controller.step, force=True)
        except BaseException as err:
            if self.dist is not None:  # the followers raise this instead of waiting
                self.dist.abort(f"{type(err).__name__}: {err}")
            raise
        finally:
            self.close()
        return self._finish(final)

    def close(self) -> None:
        if self.dist is not None:  # before ckpt.close(): the followers close theirs after `stop`
            self.dist.stop()
        for part in (self.tracer, self.writer):
            if part is not None:
                part.close()
        self.ckpt.close()
        self.store.close()
        self.inference.close()

    def _finish(self, final: dict[str, Any]) -> ClimbResult:
        history = self.history
        metrics = os.path.join(self.output_dir, "metrics.jsonl")
        target = self.entropy.target
        evals = history["eval"]
        sizes = history.get("category_sizes", {})
        categories = {c: {"base": evals[0]["by_category"].get(c, float("nan")),
                          "final": v, "problems": sizes.get(c)}
                      for c, v in final["by_category"].items()} if evals else {}
        suites = {s: suite_gain(evals[0].get("by_suite", {}).get(s, float("nan")), v,
                                history.get("suite_sizes", {}).get(s))
                  for s, v in final["by_suite"].items()} if evals else {}
        summary = {
            "suite": self.suite.name,
            "base_pass_at_1": history["base_pass_at_1"],
            "final_pass_at_1": final["pass_at_1"],
            "improvement": final["pass_at_1"] - history["base_pass_at_1"],
            "categories": categories,
            "suites": suites,
            "extraction": final["extraction"],
            "steps": self.controller.step,
            "wall_seconds": time.perf_counter() - self.t_start,
            "climb_wall_seconds": self._climb_wall(),
            "base_pretrain_seconds": self.base_seconds,
            "resumed_from": self.resumed_from,
            "interrupted": self.interrupted,
            "mode": self.ctl_cfg.mode,
            "learner_dtype": self.model_cfg.dtype,
            "sampler_dtype": (None if self.placement.remote
                              else self.cfg.sampler_dtype or self.model_cfg.dtype),
            "placement": "multi_process" if self.placement.remote else "single_process",
            "placement_detail": self.placement.describe(),
            "learner_processes": self.processes,
            "rollouts": self.stats.rollouts,
            "stale_rollouts_dropped": self.controller.counters["stale_rollouts_dropped"],
            "accepted_groups_consumed": self.controller.accepted_consumed,
            "buffered_groups": len(self.controller.buffer),
            "logp_gap_mean": mean_metric(metrics, "logp_gap_mean"),
            "logp_exact_share": mean_metric(metrics, "logp_exact_share"),
            "entropy_within_25pct": entropy_within(metrics, target),
            "entropy_within_25pct_smoothed_10": entropy_within(metrics, target, smooth=10),
            "worker_stats": self.stats.as_dict(),
            "evals": evals,
            "reached_gain_at_wall": history.get("reached_gain_at_wall"),
            "staleness_hist": history.get("staleness_hist", {}),
            "unreached_pushes": self.unreached_pushes,
            **self.controller.utilisation(),
        }
        with open(os.path.join(self.output_dir, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
        write_report(self.output_dir, summary, target)
        return ClimbResult(self.output_dir, summary)

    def _follow(self) -> ClimbResult:
        """A follower learner process (jax.process_index() > 0): run the leader's learner
        commands (train, gather, save, restore) until it stops; see hcjax.rl.multihost."""
        try:
            steps = self.dist.follow(self.ckpt)
        finally:
            self.ckpt.close()
        return ClimbResult(self.output_dir, {"role": "follower",
                                             "process_index": jax.process_index(),
                                             "learner_steps": steps,
                                             "wall_seconds": time.perf_counter() - self.t_start})


def run_climb(output_dir: str, **options: Any) -> ClimbResult:
    """Build a Climb from the bound gin configuration and run it (options: see Climb)."""
    return Climb(output_dir, **options).run()
