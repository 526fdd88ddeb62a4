"""The climb on Ray (`Placement.backend = "ray"`): a placement group with one bundle per learner
process and per inference replica (`RayPlacement.bundles`), an inference actor per replica running
`hcjax.rollout.standalone.serve` on a port it reports, and learner actors that run the `Climb`
against those replicas as remote ones (router, reshard-plan weight sync, health checks and
readmission, as in the multi-process placement). The controller runs inside the first learner
actor, which drives the learner as in every placement. Ray is imported only when a climb starts;
this module must not know the climb's internals beyond `Climb`'s constructor and its summary."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

# The actors bind the climb's gin files before building anything: everything they run is
# imported here, so each configurable is registered when they bind.
from hcjax import config
from hcjax.config import resolve_gin_file
from hcjax.data.tokenizer import ByteTokenizer
from hcjax.model import ModelConfig
from hcjax.rl.climber import Climb, ClimbConfig, engine_lengths
from hcjax.rl.placement import Placement, RayBundle, RayPlacement
from hcjax.rollout.standalone import ServeOptions, serve
from hcjax.tasks.task_config import TaskConfig

__all__ = ["RayClimb", "RayInference", "RayLearner", "check_fits", "merged_xla_flags"]

REPO = Path(__file__).resolve().parents[2]
# Requests wait in a replica's queue rather than being refused: the learner is its only client.
_SERVE_LIMITS = {"max_queue": 4096, "max_request_mb": 1024, "queue_share": 1.0}


def check_fits(bundles: Sequence[RayBundle], cluster: Mapping[str, float]) -> None:
    """Raise (naming the bindings to change) when the bundles ask for more of a resource than
    the Ray cluster has in all; a placement group that cannot fit would wait forever."""
    need: dict[str, float] = {}
    for b in bundles:
        for name, amount in b.resources.items():
            need[name] = need.get(name, 0.0) + amount
    short = {k: (v, float(cluster.get(k, 0.0))) for k, v in need.items()
             if v > float(cluster.get(k, 0.0)) + 1e-9}
    if short:
        said = ", ".join(f"{k} {v:g} (the cluster has {have:g})" for k, (v, have) in short.items())
        raise ValueError(
            f"the Ray placement's {len(bundles)} bundles ask for {said}; fit them with "
            "Placement.learner_mesh / Placement.inference_meshes, RayPlacement.cpus_per_actor / "
            "learner_processes / accelerator, or a larger RayPlacement.num_cpus")


def merged_xla_flags(inherited: str, own: str) -> str:
    """An actor's XLA_FLAGS: its bundle's own flags (`own`: the CPU device count) over this
    process's (`inherited`: optimisation level, dumps), so that an actor compiles as the driver
    would; a flag named in both is the bundle's."""
    named = {flag.split("=", 1)[0] for flag in own.split()}
    kept = [flag for flag in inherited.split() if flag.split("=", 1)[0] not in named]
    return " ".join([*kept, *own.split()])


def _actor_options(bundle: RayBundle, group: Any, index: int, **extra: Any) -> dict[str, Any]:
    """Ray actor options that take exactly the bundle's resources, in its process environment
    (the repository on PYTHONPATH: the actors import hcjax as the driver does)."""
    # optional: ray, imported only when Placement.backend = "ray" runs
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    resources = dict(bundle.resources)
    env = dict(bundle.env)
    if "XLA_FLAGS" in env:
        env["XLA_FLAGS"] = merged_xla_flags(os.environ.get("XLA_FLAGS", ""), env["XLA_FLAGS"])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                        if p)
    return {"num_cpus": resources.pop("CPU", 0.0), "num_gpus": resources.pop("GPU", 0.0),
            "resources": resources,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=index),
            "runtime_env": {"env_vars": env}, **extra}


def _mesh_bindings(role: str, bundle: RayBundle) -> list[str]:
    """Gin bindings that put an actor's role on its bundle's mesh (its own devices, offset 0)."""
    mesh = {f.name: getattr(bundle.mesh, f.name) for f in dataclasses.fields(bundle.mesh)}
    if role == "learner":
        # The learner actor climbs as the multi-process placement's learner process does.
        return [f"Placement.learner_mesh = {mesh!r}", "Placement.backend = 'local'"]
    return [f"MeshConfig.{k} = {v!r}" for k, v in mesh.items()]  # hcjax.serve's mesh


class RayInference:
    """An inference replica: `hcjax.rollout.standalone.serve` on a thread of this actor, on the
    bundle's devices, until `stop`."""

    def __init__(self, gin_files: Sequence[str], gin_params: Sequence[str]) -> None:
        config.setup_process()  # an actor's process is an hcjax process as an entry point's is
        config.bind(gin_files, gin_params)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, options: Mapping[str, Any]) -> str:
        """Build, compile and serve; return host:port once it accepts requests."""
        # optional: ray, imported only when Placement.backend = "ray" runs
        import ray

        ready, info, errors = threading.Event(), {}, []

        def run() -> None:
            try:
                serve(ServeOptions(**options), ready=lambda i: (info.update(i), ready.set()),
                      stop=self._stop)
            except BaseException as err:  # reported to the driver by start()
                errors.append(err)
                ready.set()

        self._thread = threading.Thread(target=run, name="hcjax-serve", daemon=True)
        self._thread.start()
        ready.wait()
        if errors:
            raise errors[0]
        host = options.get("host", "127.0.0.1")
        if host in ("0.0.0.0", "::", ""):
            host = ray.util.get_node_ip_address()
        return f"{host}:{info['port']}"

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)


class RayLearner:
    """One learner process: binds gin, joins the others (jax.distributed) when there are several,
    and runs the `Climb` against the replicas' addresses; process 0 also runs the controller and
    returns the summary."""

    def __init__(self, gin_files: Sequence[str], gin_params: Sequence[str], process_id: int,
                 num_processes: int) -> None:
        config.setup_process()  # an actor's process is an hcjax process as an entry point's is
        self.gin_files, self.gin_params = list(gin_files), list(gin_params)
        self.process_id, self.num_processes = process_id, num_processes
        self.climb = None

    def coordinator_address(self) -> str:
        """A free host:port on this actor's node for jax.distributed's coordinator."""
        # optional: ray, imported only when Placement.backend = "ray" runs
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def run(self, output_dir: str, addresses: Sequence[str], coordinator: str | None,
            options: Mapping[str, Any]) -> dict[str, Any]:
        config.bind(self.gin_files, self.gin_params)
        if self.num_processes > 1:
            jax.distributed.initialize(coordinator, self.num_processes, self.process_id)
        self.climb = Climb(output_dir, inference_addresses=list(addresses), **options)
        result = self.climb.run()
        if self.process_id == 0:
            config.write_operative_config(output_dir)
        return result.summary

    def interrupt(self) -> None:
        """The driver's Ctrl-C: the step under way is the climb's last (as Ctrl-C is in-process)."""
        if self.climb is not None:
            self.climb.request_stop()


class RayClimb:
    """One climb on Ray. `RayClimb(...)` checks the bindings (before Ray starts or a base is
    made); `with rc:` starts (or joins) Ray, reserves the placement group and starts the replicas
    and the learner actors; `rc.run(base)` runs the climb from that base on the learner actors
    and returns the leader's summary; leaving the block stops the actors, removes the group and
    shuts down a Ray instance it started."""

    def __init__(self, output_dir: str, gin_files: Sequence[str], gin_params: Sequence[str], *,
                 mode: str | None = None, progress: bool = True, log: Any = print) -> None:
        self.placement, self.cfg = Placement(), RayPlacement()
        # Everything a bad binding can break fails here, before Ray starts.
        self.bundles = self.cfg.bundles(self.placement)
        if self.cfg.num_cpus is not None:
            check_fits(self.bundles, {"CPU": float(self.cfg.num_cpus)})
        climb_cfg = ClimbConfig()
        lengths = engine_lengths(climb_cfg, TaskConfig().make_suite(), ByteTokenizer(),
                                 ModelConfig().max_seq_len)
        self.serve_options = {
            "host": self.cfg.host, "port": 0, "version": -1, "status_every": 0.0,
            "max_concurrent_decodes": climb_cfg.max_concurrent_decodes,
            "max_prefill_length": lengths.max_prefill_length,
            "max_target_length": lengths.max_target_length, **_SERVE_LIMITS}
        self.output_dir = os.path.abspath(output_dir)
        # Absolute paths: the actors' working directory need not be ours.
        self.gin_files = [str(resolve_gin_file(f).resolve()) for f in gin_files]
        self.gin_params = list(gin_params)
        self.climb_options = {"mode": mode, "progress": progress, "log_format": "json"}
        self.log = log
        self.started_ray = False
        self.group = None
        self.replicas: list[Any] = []
        self.learners: list[Any] = []
        self.addresses: list[str] = []

    # Start --------------------------------------------------------------------------------------
    def __enter__(self) -> RayClimb:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _start(self) -> None:
        # optional: ray, imported only when Placement.backend = "ray" runs
        import ray
        from ray.util.placement_group import placement_group

        cfg = self.cfg
        # Ray's usage report would try to reach the internet; nothing here needs it.
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if not ray.is_initialized():
            if cfg.address is None:
                cpus = cfg.num_cpus or math.ceil(sum(b.resources["CPU"] for b in self.bundles))
                # No default workers prestarted for this driver: every actor here has its own
                # runtime_env (PYTHONPATH, XLA_FLAGS), so none of them could use one.
                ray.init(num_cpus=cpus, include_dashboard=False, namespace="hcjax",
                         object_store_memory=cfg.object_store_mb * 2**20, log_to_driver=True,
                         _system_config={"prestart_worker_first_driver": False})
            else:
                ray.init(address=cfg.address, namespace="hcjax", log_to_driver=True)
            self.started_ray = True
        check_fits(self.bundles, ray.cluster_resources())
        self.group = placement_group([b.resources for b in self.bundles], strategy=cfg.strategy,
                                     name=f"hcjax-climb-{os.getpid()}")
        ready, _ = ray.wait([self.group.ready()], timeout=cfg.ready_timeout)
        if not ready:
            raise TimeoutError(
                f"the Ray placement group {[b.resources for b in self.bundles]} (strategy "
                f"{cfg.strategy}) was not placed within RayPlacement.ready_timeout="
                f"{cfg.ready_timeout:g} s; available: {ray.available_resources()}")
        self.log(f"ray: placement group of {len(self.bundles)} bundles ready: "
                 + ", ".join(f"{b.role}[{b.index}] {b.resources}" for b in self.bundles))
        inference = ray.remote(RayInference)
        starts = []
        for i, b in enumerate(self.bundles):
            if b.role != "inference":
                continue
            actor = inference.options(**_actor_options(
                b, self.group, i, name=f"hcjax-inference-{b.index}-{os.getpid()}")).remote(
                    self.gin_files, [*self.gin_params, *_mesh_bindings("inference", b)])
            self.replicas.append(actor)
            starts.append(actor.start.remote(self.serve_options))
        # The learner actors start (a process each, importing the climb) while the replicas
        # compile; they climb once the replicas serve (`run`).
        learner = ray.remote(RayLearner)
        bundles = [(i, b) for i, b in enumerate(self.bundles) if b.role == "learner"]
        # max_concurrency 2: `interrupt` runs beside `run` (the climb then runs off the main
        # thread, so the actor sets no signal handler of its own).
        self.learners = [learner.options(**_actor_options(
            b, self.group, i, max_concurrency=2,
            name=f"hcjax-learner-{b.index}-{os.getpid()}")).remote(
                self.gin_files, [*self.gin_params, *_mesh_bindings("learner", b)], b.index,
                len(bundles)) for i, b in bundles]
        ready, pending = ray.wait(starts, num_returns=len(starts), timeout=cfg.ready_timeout)
        if pending:
            raise TimeoutError(f"{len(pending)} of {len(starts)} inference replicas did not serve "
                               f"within RayPlacement.ready_timeout={cfg.ready_timeout:g} s")
        self.addresses = ray.get(starts)
        self.log(f"ray: inference replicas serving at {', '.join(self.addresses)}")

    def check_base(self, base_checkpoint: str | None) -> None:
        """No base given means the job pre-trains one here first: refused when the learner spans
        processes, whose actors may run where this folder is not."""
        if self.cfg.learner_processes > 1 and base_checkpoint is None:
            raise ValueError(
                f"RayPlacement.learner_processes={self.cfg.learner_processes} needs "
                "--base_checkpoint: pre-train the base first with `python -m hcjax.sft` (every "
                "learner process would pre-train its own)")

    # Run ----------------------------------------------------------------------------------------
    def run(self, base_checkpoint: str, base_seconds: float = 0.0) -> dict[str, Any]:
        """Run the learner actors to the end of the climb from `base_checkpoint` (any hcjax run;
        base_seconds: what making it took, see `Climb`); the leader's summary, with the placement
        recorded as "ray" (also in summary.json)."""
        # optional: ray, imported only when Placement.backend = "ray" runs
        import ray

        coordinator = (ray.get(self.learners[0].coordinator_address.remote())
                       if len(self.learners) > 1 else None)
        options = {**self.climb_options, "base_checkpoint": os.path.abspath(base_checkpoint),
                   "base_seconds": base_seconds}
        runs = [a.run.remote(self.output_dir, self.addresses, coordinator, options)
                for a in self.learners]
        interrupted = False
        while True:
            try:
                done, _ = ray.wait(runs, num_returns=len(runs), timeout=1.0)
                if len(done) == len(runs):
                    break
            except KeyboardInterrupt:
                if interrupted:
                    raise
                interrupted = True
                self.log("hcjax.climb: Ctrl-C: the climb stops after this step (again: now)")
                self.learners[0].interrupt.remote()
        summary = ray.get(runs)[0]
        summary["placement"] = "ray"
        summary["placement_detail"] = {
            "kind": "ray", "strategy": self.cfg.strategy, "inference": list(self.addresses),
            "bundles": [{"role": b.role, "index": b.index, "resources": b.resources,
                         "devices": b.devices} for b in self.bundles]}
        path = Path(self.output_dir, "summary.json")
        path.write_text(json.dumps(summary, indent=2), encoding="utf-8")
        return summary

    # Stop ---------------------------------------------------------------------------------------
    def close(self) -> None:
        # optional: ray, imported only when Placement.backend = "ray" runs
        import ray

        if not ray.is_initialized():
            return
        stops = [r.stop.remote() for r in self.replicas]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=40)
        for actor in [*self.learners, *self.replicas]:
            ray.kill(actor)
        self.learners, self.replicas = [], []
        if self.group is not None:
            # optional: ray, imported only when Placement.backend = "ray" runs
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            self.group = None
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False
