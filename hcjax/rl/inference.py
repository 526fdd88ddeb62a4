"""The climb's inference side behind one interface (`generate`, `publish`, `start`, `close`):
in-process replicas (an Engine + continuous-batching RolloutServer per inference mesh, fed the
learner's weights through a TransferPlan each) or remote `python -m hcjax.serve` processes (the
Router for requests, reshard plans over gRPC for weights). Training and evaluation share it."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hcjax.model import shard_state
from hcjax.rollout import Engine, RolloutServer
from hcjax.rollout.router import Router
from hcjax.rollout.service import wait_ready
from hcjax.sharding import SERVING_RULES
from hcjax.transfer import LocalTransfer, TransferFailed, VersionedWeights, make_plan
from hcjax.transfer.quantize import check_format, dequantize_tree, quantize_tree, wire_layout
from hcjax.transfer.weights_service import WeightPublisher, WeightSyncConfig

__all__ = ["LocalInference", "RemoteInference"]


class LocalInference:
    """Replicas on this process's inference meshes. `params()` is the learner's current params
    tree; `publish(version)` moves it to every replica (each replica's LocalTransfer runs its
    plan once per push).

    quantize / quant_block (default: the gin WeightSyncConfig's): serve quantised weights. Each
    push quantises the learner's matmul kernels once on its devices
    (hcjax.transfer.quantize.quantize_tree), the plans move the one-byte values and their
    scales, and each replica dequantises them into its parameter dtype and serves those values:
    the sampler's log-probs are the served weights'. `wire_bytes` is what one push moves to one
    replica."""

    def __init__(self, model: Any, meshes: Sequence[Any], params: Callable[[], Any], *,
                 max_concurrent_decodes: int, max_prefill_length: int, max_target_length: int,
                 max_queue: int = 4096, quantize: str | None = None,
                 quant_block: int | None = None) -> None:
        self._params = params
        self._lock = threading.Lock()
        defaults = WeightSyncConfig()
        self.quantize = check_format(defaults.quantize if quantize is None else quantize)
        self.quant_block = defaults.quant_block if quant_block is None else quant_block
        check_format(self.quantize, self.quant_block)
        graphdef, state = nnx.split(model)
        self.replicas: list[dict[str, Any]] = []
        for mesh in meshes:
            served = shard_state(jax.tree.map(jnp.copy, state), mesh, SERVING_RULES)
            replica_model = nnx.merge(graphdef, served)
            engine = Engine(replica_model, mesh=mesh,
                            max_concurrent_decodes=max_concurrent_decodes,
                            max_prefill_length=max_prefill_length,
                            max_target_length=max_target_length)
            served = engine.load_params()
            if self.quantize is None:
                plan = make_plan(params(), jax.tree.map(lambda x: x.sharding, served))
            else:  # the wire trees: quantised values and scales on each side's devices
                plan = make_plan(wire_layout(params(), self.quantize, self.quant_block),
                                 {p: v.sharding for p, v in wire_layout(
                                     served, self.quantize, self.quant_block).items()})
            template = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), served)
            self.replicas.append({"engine": engine, "transfer": LocalTransfer(plan), "inflight": 0,
                                  "served": VersionedWeights(None, -1), "template": template,
                                  "server": RolloutServer(engine, max_queue=max_queue)})
        self.wire_bytes = sum(  # per replica and push: what its plan moves
            math.prod(s.shape) * np.dtype(s.dtype).itemsize
            for s in self.replicas[0]["transfer"].plan.src_leaves.values()) if meshes else 0

    @property
    def engines(self) -> list[Any]:
        return [r["engine"] for r in self.replicas]

    def _build(self, r: dict[str, Any], source: Any) -> Any:
        """The tree replica `r` serves, from the learner's params or their wire tree."""
        if self.quantize is None:
            return r["transfer"](source)
        return dequantize_tree(r["transfer"](source), r["template"], self.quant_block)

    def publish(self, version: int) -> None:
        source = self._params()
        if self.quantize is not None:  # once per push, on the learner's devices
            source = quantize_tree(source, self.quantize, self.quant_block)
        for r in self.replicas:
            served: VersionedWeights = r["served"]
            if version <= served.version:
                raise ValueError(f"version={version} is not newer than the served {served.version}")
            try:
                tree = jax.block_until_ready(self._build(r, source))
            except Exception as err:
                served.last_error = TransferFailed(version, served.version, err)
                raise served.last_error from err
            # The server refuses NaN/Inf weights (NonFiniteWeights) before anything is swapped:
            # the replica's kept copy and what it serves stay one version.
            r["server"].update_weights(tree, version)
            served.swap(tree, version)

    def start(self, version: int) -> None:
        """Serve the learner's current weights as `version`, then accept requests."""
        self.publish(version)
        for r in self.replicas:
            r["server"].start()

    def generate(self, request, timeout: float | None = None) -> list:
        with self._lock:  # the least loaded replica takes the request
            r = min(self.replicas, key=lambda x: x["inflight"])
            r["inflight"] += 1
        try:
            return r["server"].generate(request, timeout=timeout)
        finally:
            with self._lock:
                r["inflight"] -= 1

    def close(self) -> None:
        for r in self.replicas:
            r["server"].stop()


class RemoteInference:
    """Remote replicas: requests through the Router, weights by reshard plans to every live
    replica (hcjax.transfer.weights_service.WeightPublisher).

    Start: waits (with backoff, up to `ready_timeout` s) for the replicas' Health to answer
    SERVING; those not ready by then, and any whose transfer later fails or that the router's
    watchdog finds stalled, are taken out of the router and of weight sync. The router keeps
    probing them; one that answers SERVING again is readmitted once it holds the current
    weights: pushed at once when no other replica is serving (the learner waits for rollouts,
    so its params are not being stepped), else with the next version published.
    """

    def __init__(self, addresses: Sequence[str], params: Callable[[], Any], *,
                 ready_timeout: float = 900.0, stall_seconds: float | None = 120.0,
                 params_lock: Any = None, health_timeout: float = 2.0) -> None:
        """params_lock: a lock the learner holds while it steps; given, a readmitted replica
        always gets the current params at once. health_timeout: a replica that does not answer
        Health this fast before a push is left out of it (see `publish`), and one that stops
        answering during a push is dropped from it (the publisher probes every 5 s)."""
        addresses = list(addresses)
        wait_ready(addresses, timeout=ready_timeout, require="any")
        self.publisher: WeightPublisher | None = None
        self._params_lock = params_lock
        self.health_timeout = health_timeout
        # Handshaken again by a readmission and waiting for the router to take them back: they
        # stay in weight sync meanwhile (the router still holds them down, and a publish drops
        # replicas the router holds down, which would undo the readmission at every push).
        self._awaiting: set[str] = set()
        self.router = Router(addresses, max_inflight_per_replica=256,
                             stall_seconds=stall_seconds, on_readmit=self._readmit)
        self.publisher = WeightPublisher(params, addresses, on_dead=self._on_dead,
                                         is_up=self._in_sync, params_lock=params_lock,
                                         unresponsive=self._unresponsive)

    def _in_sync(self, address: str) -> bool:
        """The publisher's is_up: up in the router, or readmitted and awaiting its weights."""
        return self.router.is_up(address) or address in self._awaiting

    def _on_dead(self, address: str) -> None:
        self._awaiting.discard(address)
        self.router.mark_down(address)

    def _readmit(self, address: str) -> bool:
        """The router's on_readmit: True once `address` holds the last published version."""
        publisher = self.publisher
        if publisher is None or publisher.current_version is None:
            return False  # not started: start() publishes to every replica
        if publisher.caught_up(address):
            self._awaiting.discard(address)
            return True
        if address in publisher.live:
            return False  # handshaken; the next publish brings it the current version
        others = [a for a in publisher.live if a != address and self.router.is_up(a)]
        if publisher.readmit(address, push=self._params_lock is not None or not others):
            self._awaiting.discard(address)
            return True
        if address in publisher.live:
            self._awaiting.add(address)
        return False

    def _unresponsive(self, among: list[str]) -> list[str]:
        """The probe before a push (`publish`) and the publisher's inside one: those of `among`
        that no longer answer Health in health_timeout s while another does (marked down in the
        router: their requests retry elsewhere, and the prober readmits them once they answer)."""
        return self.router.mark_down_unresponsive(self.health_timeout, among)

    def publish(self, version: int) -> None:
        # A stopped or hung replica would hold the push, and with it the learner, for the
        # publisher's whole timeout (the stall watchdog needs stall_seconds to see it): one that
        # does not answer Health in health_timeout s while another does is left out (its
        # requests retry elsewhere; the router readmits it once it answers and has the weights).
        among = [a for a in self.publisher.live if self._in_sync(a)]
        for address in self._unresponsive(among):
            self._awaiting.discard(address)
        self.publisher(version)

    def start(self, version: int) -> None:
        self.publish(version)

    def generate(self, request, timeout: float | None = None) -> list:
        return self.router.generate(request, timeout=timeout)

    def close(self) -> None:
        self.router.close()
        if self.publisher is not None:
            self.publisher.close()
