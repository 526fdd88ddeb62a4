"""The `hcjax.Weights` gRPC service: weights from the learner process to inference processes by
a precomputed reshard plan (RECIPE §4). A small control channel steers PlanSender / PlanReceiver
pulls over `jax.experimental.transfer`; no message ever holds the parameters themselves. The
learner side is `WeightPublisher` (the service's client), the inference side `WeightsServicer`
(its handlers, mounted on an `hcjax.rpc` server by `weights_service`).

Protocol, per inference process (replica k, transfer process index p_k; the learner is 0):
  Handshake  learner -> replica: its parameter layout (paths, shapes, dtypes, mesh, specs), its
             transfer-server address, p_k and the chunk size; the replica checks the layouts
             agree, builds the plan and its PlanReceiver, and answers with its own layout, its
             transfer-server address, its bytes per version and the plan's fingerprint.
  Pull       "pull version v": the replica pulls its entries while the learner serves them,
             installs the tree atomically and answers with the bytes it received.
  Status     (debug) versions served, bytes per version and optionally a digest per leaf.

Delta sync (`WeightPublisher(sync="delta")`): every push goes by the checked path
(hcjax.transfer.remote.PlanSender.send_checked): a full push (every slice whole) when the replica
holds no version the learner still has the slices of, on request (`request_full`) and after
`full_every` deltas in a row; otherwise only what changed since the version the replica holds,
with a CRC-32 per entry checked after applying. A delta the replica cannot apply (checksum
failure: DATA_LOSS; base mismatch: FAILED_PRECONDITION) is followed at once by a full push of the
same version; the replica serves its previous version meanwhile and never a failed one.

Both sides build the same plan from the two layouts. Processes run separate JAX runtimes, so the
plan's device ids are each side's own ids: the other side's mesh is stood in for by local devices
with the same ids (every process needs at least as many devices as the other side's mesh uses).
This module sees pytrees of arrays and shardings, never a model, and imports nothing of the
rollout or RL layers: the replica's server is anything with `update_weights(tree, version)`.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import hashlib
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import gin
import grpc
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hcjax.finite import NonFiniteWeights
from hcjax.rpc.auth import open_channel
from hcjax.rpc.server import blocking
from hcjax.transfer.delta import ENCODINGS
from hcjax.transfer.local import TransferError
from hcjax.transfer.quantize import check_format, dequantize_tree, quantize_tree, wire_layout
from hcjax.transfer.remote import (
    CHECKED_DELTA,
    CHECKED_FULL,
    PLAIN,
    BaseMismatch,
    ChecksumMismatch,
    JaxTransferBackend,
    PlanReceiver,
    PlanSender,
    UntrustedPeer,
)
from hcjax.transfer.reshard_plan import TransferPlan, assign_processes, make_plan, path_str
from hcjax.transfer.versioned import VersionedWeights

__all__ = [
    "WEIGHTS_SERVICE",
    "Unreached",
    "WeightSyncConfig",
    "WeightPublisher",
    "WeightsServicer",
    "build_plan",
    "check_same_parameters",
    "describe_layout",
    "param_digests",
    "weights_service",
    "weights_status",
]

WEIGHTS_SERVICE = "hcjax.Weights"
LEARNER_PROCESS = 0
_MAX_PROCESSES = 1024  # transfer ids hold 10 bits of process index (hcjax.transfer.remote)
_WILDCARD_HOSTS = {"0.0.0.0", "::", "[::]", ""}
_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}

_NON_FINITE = "INVALID_ARGUMENT: refused: "  # a replica's answer to a push of NaN/Inf weights

log = logging.getLogger(__name__)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class WeightSyncConfig:
    """How a WeightPublisher pushes when its arguments do not say (gin: the multi-process climb).

    sync: "full" (every version whole, device to device, unchecked) or "delta" (the checked path:
    only what changed since the replica's version, a CRC-32 per entry; see the module doc).
    full_every: with delta sync, a full push after this many deltas in a row (0: never forced).
    encoding: the delta encoding (hcjax.transfer.delta.ENCODINGS).
    quantize: serve quantised weights (hcjax.transfer.quantize.FORMATS: "fp8_e4m3", "int8",
      "bfloat16"; None: as trained): the push quantises the matmul kernels on the learner's
      devices, one byte per value plus a float32 scale per `quant_block` values of the last axis
      travel, and each replica serves their dequantised values in its own parameter dtype.
      Both paths: in-process replicas (hcjax.rl.inference.LocalInference) and WeightPublisher
      (the plan and a delta then cover the quantised values and scales).
    """

    sync: str = "full"
    full_every: int = 16
    encoding: str = "sparse"
    quantize: str | None = None
    quant_block: int = 128

    def __post_init__(self) -> None:
        check_format(self.quantize, self.quant_block)


class Unreached(RuntimeError):
    """A push that no replica installed. The publisher keeps it as the current version: a
    replica readmitted later (`readmit`) receives it."""


# Layouts: what each side tells the other about its parameters -----------------------------------


def _flat(tree: Any) -> list[tuple[str, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(path_str(k), v) for k, v in flat]


def _spec_to_json(spec: PartitionSpec) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def _spec_from_json(spec: list) -> PartitionSpec:
    return PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in spec])


def describe_layout(tree: Any) -> dict:
    """A JSON-able layout of a parameter tree: its mesh (device ids, shape, axis names) and, per
    leaf path, shape, dtype and PartitionSpec. Every leaf must be a NamedSharding on one mesh."""
    meshes: dict[Any, Mesh] = {}
    leaves = {}
    for path, leaf in _flat(tree):
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            raise ValueError(f"parameter {path!r} has sharding {sharding!r}; weight sync needs a "
                             "NamedSharding on the process's mesh for every parameter")
        meshes[id(sharding.mesh)] = sharding.mesh
        leaves[path] = {"shape": list(leaf.shape), "dtype": np.dtype(leaf.dtype).name,
                        "spec": _spec_to_json(sharding.spec)}
    distinct = {(m.axis_names, tuple(d.id for d in m.devices.flat), m.devices.shape)
                for m in meshes.values()}
    if len(distinct) != 1:
        raise ValueError(f"weight sync needs every parameter on one mesh; found {len(distinct)} "
                         f"meshes: {sorted(map(str, distinct))}")
    names, ids, shape = distinct.pop()
    return {"mesh": {"axis_names": list(names), "device_ids": list(ids), "shape": list(shape)},
            "leaves": leaves}


def _fmt_leaf(leaf: dict) -> str:
    return f"{leaf['dtype']}{leaf['shape']}"


def check_same_parameters(learner: dict, inference: dict) -> None:
    """Raise ValueError listing every parameter whose path, shape or dtype differs between the
    learner's and an inference process's layouts (both from `describe_layout`)."""
    ours, theirs = learner["leaves"], inference["leaves"]
    problems = []
    only_learner = sorted(set(ours) - set(theirs))
    only_inference = sorted(set(theirs) - set(ours))
    if only_learner:
        problems.append(f"only on the learner: {only_learner}")
    if only_inference:
        problems.append(f"only on the inference process: {only_inference}")
    for path in sorted(set(ours) & set(theirs)):
        a, b = ours[path], theirs[path]
        if a["shape"] != b["shape"] or a["dtype"] != b["dtype"]:
            problems.append(f"{path}: learner {_fmt_leaf(a)} vs inference {_fmt_leaf(b)}")
    if problems:
        raise ValueError("learner and inference parameters differ (same gin model config on "
                         "every process?): " + "; ".join(problems))


def _local_mesh(mesh: dict, side: str) -> Mesh:
    """The mesh of `side`'s layout on this process's devices with the same ids."""
    local = {d.id: d for d in jax.local_devices()}
    missing = [i for i in mesh["device_ids"] if i not in local]
    if missing:
        raise ValueError(
            f"the {side} mesh uses device ids {mesh['device_ids']} but this process has devices "
            f"{sorted(local)} (missing {missing}); give every process at least "
            f"{max(mesh['device_ids']) + 1} devices (on CPU: "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    devices = np.array([local[i] for i in mesh["device_ids"]]).reshape(mesh["shape"])
    return Mesh(devices, tuple(mesh["axis_names"]))


def _abstract(layout: dict, side: str) -> dict[str, jax.ShapeDtypeStruct]:
    mesh = _local_mesh(layout["mesh"], side)
    return {path: jax.ShapeDtypeStruct(tuple(leaf["shape"]), np.dtype(leaf["dtype"]),
                                       sharding=NamedSharding(mesh, _spec_from_json(leaf["spec"])))
            for path, leaf in layout["leaves"].items()}


def build_plan(learner: dict, inference: dict) -> TransferPlan:
    """The plan learner layout -> inference layout, identical in every process that builds it
    from the same two layouts; learner entries are process 0, inference entries process 1
    (relabelled per replica with `assign_processes`)."""
    check_same_parameters(learner, inference)
    plan = make_plan(_abstract(learner, "learner"), _abstract(inference, "inference"))
    return plan.with_processes(LEARNER_PROCESS, 1)


def plan_fingerprint(plan: TransferPlan) -> str:
    return hashlib.sha256("\n".join(map(str, plan.entries)).encode()).hexdigest()[:16]


def param_digests(tree: Any) -> dict[str, str]:
    """Per leaf path, a sha256 of dtype, shape and bytes (gathers every leaf to the host: for
    checks and debugging only)."""
    out = {}
    for path, leaf in _flat(tree):
        x = np.asarray(jax.device_get(leaf))
        h = hashlib.sha256(f"{x.dtype.name}{list(x.shape)}".encode())
        h.update(np.ascontiguousarray(x).tobytes())
        out[path] = h.hexdigest()
    return out


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0]


def _reachable(address: str, fallback_host: str) -> str:
    """A transfer-server address that a peer can dial: a wildcard bind gets `fallback_host`."""
    host, port = address.rsplit(":", 1)
    return f"{fallback_host}:{port}" if host in _WILDCARD_HOSTS else address


def _peer_host(peer: str) -> str:
    """The host of a gRPC peer string ('ipv4:10.0.0.5:4242', 'ipv6:[::1]:4242')."""
    return _host(peer.split(":", 1)[1]) if peer.startswith(("ipv4:", "ipv6:")) else "127.0.0.1"


def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> cf.Future:
    """Run fn(*args) in a daemon thread, so that a call stuck on a failed peer does not keep the
    process from exiting (executor threads are joined at exit)."""
    fut: cf.Future = cf.Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits on fut
            fut.set_exception(err)

    threading.Thread(target=run, daemon=True, name=f"weight-sync-{fn.__name__}").start()
    return fut


def _why(err: BaseException) -> str:
    """One line for a failure; a gRPC error by its status code and details."""
    code, details = getattr(err, "code", None), getattr(err, "details", None)
    if callable(code) and callable(details):
        return f"{code().name}: {details()}"
    return f"{type(err).__name__}: {err}"


def _code(err: BaseException) -> Any:
    code = getattr(err, "code", None)
    return code() if callable(code) else None


def _delta_refused(err: BaseException) -> bool:
    """A replica's answer to a delta it could not apply (checksum failure or another base)."""
    return _code(err) in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.FAILED_PRECONDITION)


def _rpc(channel, method: str, timeout: float) -> Callable[[dict], dict]:
    call = channel.unary_unary(f"/{WEIGHTS_SERVICE}/{method}")

    def invoke(request: dict) -> dict:
        return json.loads(call(json.dumps(request).encode(), timeout=timeout))

    return invoke


def _start_call(method, request: dict, timeout: float) -> tuple[cf.Future, Any]:
    """Start a unary call; returns its decoded answer as a concurrent future (to wait on beside
    other futures) and the gRPC call (to cancel: the other side then stops waiting for it)."""
    call = method.future(json.dumps(request).encode(), timeout=timeout)
    answer: cf.Future = cf.Future()

    def done(c) -> None:
        try:
            answer.set_result(json.loads(c.result()))
        except grpc.FutureCancelledError:
            answer.set_exception(RuntimeError("cancelled"))
        except Exception as err:  # noqa: BLE001 - the call's error, for whoever waits on it
            answer.set_exception(err)

    call.add_done_callback(done)
    return answer, call


# Learner side ------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Replica:
    address: str
    process: int
    channel: Any
    pull: Any  # the Pull method (a gRPC multi-callable)
    sender: PlanSender
    expected_bytes: int


class WeightPublisher:
    """Learner side: `publisher(version)` moves the current params to every live replica.

    params: returns the learner's current parameter tree (its layout never changes).
    on_dead(address): called once for a replica that fails (e.g. the router's mark_down); it
    gets no further versions until `readmit(address)` handshakes with it again. A layout
    mismatch is a configuration error and raises.
    is_up(address): when given, a publish skips (and drops) replicas it says are down, so a hung
    replica cannot hold up a push for `timeout` s; a readmitted replica awaiting its first
    version is always included.
    unresponsive(addresses): when given, a push still waiting after `probe_every` s (and every
    `probe_every` s after that) asks it which of the push's replicas no longer answer (e.g. the
    router's Health probe), and drops those it is waiting for: a replica that hangs or is
    stopped in the middle of a push holds the learner for seconds, not `timeout`. A dropped
    replica's Pull is cancelled, so it stops waiting for the rest of that version.

    Readmission (`readmit`): a replica that comes back (restarted, or resumed after a hang) gets
    a fresh handshake under a new transfer process index (so no transfer id of an interrupted
    push is reused), then either the current version at once (`push=True`: the learner's
    `params()` under `params_lock` when one is given; without it the caller must know the
    params are not being donated by a train step at that moment) or the next version published
    (`push=False`, the safe default while other replicas serve).
    """

    def __init__(
        self,
        params: Callable[[], Any],
        addresses: Sequence[str],
        *,
        on_dead: Callable[[str], None] | None = None,
        timeout: float = 120.0,
        max_bytes_per_pull: int = 16 << 20,
        transfer_address: str | None = None,
        is_up: Callable[[str], bool] | None = None,
        params_lock: Any = None,
        unresponsive: Callable[[list[str]], Sequence[str]] | None = None,
        probe_every: float = 5.0,
        sync: str | None = None,
        full_every: int | None = None,
        encoding: str | None = None,
        quantize: str | None = None,
        quant_block: int | None = None,
    ) -> None:
        defaults = WeightSyncConfig()
        sync = defaults.sync if sync is None else sync
        full_every = defaults.full_every if full_every is None else full_every
        encoding = defaults.encoding if encoding is None else encoding
        self.quantize = check_format(defaults.quantize if quantize is None else quantize)
        self.quant_block = defaults.quant_block if quant_block is None else quant_block
        check_format(self.quantize, self.quant_block)
        if self.quantize is not None:  # every push sends the wire tree (quantised on our devices)
            params = functools.partial(_quantized, params, self.quantize, self.quant_block)
        if sync not in ("full", "delta"):
            raise ValueError(f"sync={sync!r} must be 'full' or 'delta'")
        if full_every < 0:
            raise ValueError(f"full_every={full_every} must be >= 0 (0: no forced full pushes)")
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding={encoding!r} is not one of {ENCODINGS}")
        self.sync, self.full_every, self.encoding = sync, full_every, encoding
        self._full_requested = False
        self._deltas_in_row: dict[str, int] = {}  # address -> deltas since its last full push
        if not addresses:
            raise ValueError("addresses=[]: weight sync needs at least one inference process")
        if timeout <= 0:
            raise ValueError(f"timeout={timeout} must be positive")
        if probe_every <= 0:
            raise ValueError(f"probe_every={probe_every} must be positive")
        self.params, self.on_dead, self.timeout = params, on_dead, timeout
        self.is_up, self.params_lock = is_up, params_lock
        self.unresponsive, self.probe_every = unresponsive, probe_every
        self.addresses = list(addresses)
        self.current_version: int | None = None  # the last version published
        self.installed: dict[str, int] = {}  # address -> version it installed last
        self._pending: set[str] = set()  # readmitted, waiting for their first version
        # Transfer ids are (version, process index, chunk): a learner restarted from a checkpoint
        # numbers its versions from there again, and an id left half-used on a replica by a push
        # the killed learner never finished must not be met again (the dead learner's pending
        # pull of that id's ack takes the replica's next offer of it, and the push hangs until
        # its timeout). So the indices start at a random point, and a replica refuses one it has
        # handed out before (`WeightsServicer.handshake`): the publisher then takes the next.
        self._handshakes = secrets.randbelow(_MAX_PROCESSES - 1)
        self._lock = threading.RLock()  # one publish or readmission at a time
        self.max_bytes_per_pull = max_bytes_per_pull
        self.layout = describe_layout(params())
        if transfer_address is None:
            loopback = all(_host(a) in _LOOPBACK_HOSTS for a in addresses)
            transfer_address = "127.0.0.1:0" if loopback else "0.0.0.0:0"
        self.backend = JaxTransferBackend(transfer_address)
        self.plans: dict[str, TransferPlan] = {}  # by inference layout: identical replicas share
        self.replicas: list[_Replica] = []
        self.dead: dict[str, str] = {}  # address -> why
        self.history: list[dict] = []
        for address in addresses:
            channel = open_channel(address)
            try:
                self.replicas.append(self._handshake_unused(address, channel))
            except grpc.RpcError as err:
                channel.close()
                if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise ValueError(f"inference process {address}: {err.details()}") from err
                self._mark_dead(address, f"handshake failed: {_why(err)}")
        if not self.replicas:
            raise RuntimeError(f"no inference process answered the weights handshake: {self.dead}")

    def _next_process(self) -> int:
        """The next transfer process index, cycling through 1..1023 (0 is the learner's)."""
        process = 1 + self._handshakes % (_MAX_PROCESSES - 1)
        self._handshakes += 1
        return process

    def _handshake_unused(self, address: str, channel) -> _Replica:
        """`_handshake` with the next process index the replica has not used before: one it
        refuses (ALREADY_EXISTS) is skipped. Raises grpc.RpcError for any other refusal."""
        for _ in range(_MAX_PROCESSES - 1):
            try:
                return self._handshake(address, self._next_process(), channel)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.ALREADY_EXISTS:
                    raise
                last = err
        raise last

    def _handshake(self, address: str, process: int, channel) -> _Replica:
        request = {"layout": self.layout, "process_index": process,
                   "transfer_address": self.backend.address,
                   "max_bytes_per_pull": self.max_bytes_per_pull,
                   "quantize": self.quantize, "quant_block": self.quant_block}
        reply = _rpc(channel, "Handshake", self.timeout)(request)
        check_same_parameters(self.layout, reply["layout"])
        key = json.dumps(reply["layout"], sort_keys=True)
        if key not in self.plans:
            self.plans[key] = build_plan(self.layout, reply["layout"])
        plan = self.plans[key]
        if reply["plan_fingerprint"] != plan_fingerprint(plan):
            raise ValueError(f"inference process {address} built a different transfer plan "
                             f"({reply['plan_fingerprint']} != {plan_fingerprint(plan)})")
        entries = assign_processes(plan.entries, LEARNER_PROCESS, process)
        peer = _reachable(reply["transfer_address"], _host(address))
        sender = PlanSender(plan, LEARNER_PROCESS, self.backend, {process: peer}, entries=entries,
                            max_bytes_per_pull=self.max_bytes_per_pull)
        expected = sum(e.nbytes for e in entries)
        if reply["expected_bytes"] != expected:
            raise ValueError(f"inference process {address} expects {reply['expected_bytes']} B "
                             f"per version, the learner's plan sends it {expected} B")
        return _Replica(address, process, channel,
                        channel.unary_unary(f"/{WEIGHTS_SERVICE}/Pull"), sender, expected)

    @property
    def live(self) -> list[str]:
        return [r.address for r in self.replicas]

    def _mark_dead(self, address: str, why: str) -> None:
        self.dead[address] = why
        log.warning("inference process %s dropped from weight sync: %s", address, why)
        if self.on_dead is not None:
            self.on_dead(address)

    def request_full(self) -> None:
        """Make the next push a full one to every replica (delta sync)."""
        self._full_requested = True

    def _base_for(self, replica: _Replica) -> int | None:
        """The version a delta to `replica` is encoded against, or None for a full push."""
        if self.sync != "delta" or self._full_requested:
            return None
        base = replica.sender.base_version
        if base is None or self.installed.get(replica.address) != base:
            return None
        if self.full_every and self._deltas_in_row.get(replica.address, 0) >= self.full_every:
            return None
        return base

    def _start(self, replica: _Replica, version: int, params: Any, base: int | None):
        """Start sending `version` to `replica` and its Pull: (sent, pulled, call) futures."""
        if self.sync != "delta":
            return (_in_daemon_thread(replica.sender.send, params, version),
                    *_start_call(replica.pull, {"version": version}, self.timeout))
        sent = _in_daemon_thread(replica.sender.send_checked, params, version, base,
                                 self.encoding)
        request = {"version": version, "mode": "delta" if base is not None else "full",
                   "base": base}
        return (sent, *_start_call(replica.pull, request, self.timeout))

    def __call__(self, version: int) -> None:
        """Serve `version` to every live replica while each pulls it; returns once every replica
        installed it or was dropped. Raises RuntimeError if none installed it."""
        with self._lock:
            if self.is_up is not None:  # down replicas leave now; readmit brings them back
                for replica in [r for r in self.replicas if r.address not in self._pending
                                and not self.is_up(r.address)]:
                    self.replicas.remove(replica)
                    replica.channel.close()
                    self.dead[replica.address] = f"down at version {version}"
            if not self.replicas:
                self.current_version = int(version)  # a readmitted replica gets this one
                raise Unreached(f"weights version {version} reached no replica: every one "
                                   f"failed before: {self.dead}")
            self._push(list(self.replicas), int(version), self.params())
            self.current_version = int(version)

    def _push(self, replicas: list[_Replica], version: int, params: Any) -> None:
        t0 = time.perf_counter()
        bases = {r.address: self._base_for(r) for r in replicas}
        self._full_requested = False
        waiting = {r.address: (r, *self._start(r, version, params, bases[r.address]))
                   for r in replicas}
        fallbacks: dict[str, str] = {}  # address -> why its delta was followed by a full push
        deadline = time.monotonic() + self.timeout
        next_probe = time.monotonic() + self.probe_every
        failed: dict[str, str] = {}

        def drop(address: str, why: str) -> None:
            failed[address] = why
            waiting.pop(address)[3].cancel()  # the replica stops waiting for this version

        while waiting:
            now = time.monotonic()
            if now >= deadline:
                for address in list(waiting):
                    drop(address, f"timed out after {self.timeout} s")
                break
            if self.unresponsive is not None and now >= next_probe:
                among = [r.address for r in replicas if r.address not in failed]
                for address in set(self.unresponsive(among)) & set(waiting):
                    drop(address, f"stopped answering during the push ({now - t0:.1f} s in)")
                next_probe = time.monotonic() + self.probe_every
                continue
            wake = deadline if self.unresponsive is None else min(deadline, next_probe)
            cf.wait([f for _, sent, pulled, _ in waiting.values() for f in (sent, pulled)],
                    timeout=max(0.0, wake - now), return_when=cf.FIRST_EXCEPTION)
            for address, (replica, sent, pulled, _) in list(waiting.items()):
                errors = [f.exception() for f in (sent, pulled)
                          if f.done() and f.exception() is not None]
                if (errors and bases[address] is not None and address not in fallbacks
                        and _delta_refused(errors[0])):
                    # the delta could not be applied there: the same version, whole, now
                    fallbacks[address] = _why(errors[0])
                    log.warning("weights version %d: the delta to %s was refused (%s); sending "
                                "it whole", version, address, fallbacks[address])
                    bases[address] = None
                    waiting[address] = (replica, *self._start(replica, version, params, None))
                elif errors:
                    drop(address, _why(errors[0]))
                elif sent.done() and pulled.done():
                    waiting.pop(address)
                    want = replica.expected_bytes if self.sync != "delta" else sent.result()
                    if (got := pulled.result())["bytes"] != want:
                        failed[address] = (f"received {got['bytes']} B, the learner sent "
                                           f"{want} B")
        # A replica that refused NaN/Inf weights keeps serving its version and stays in weight
        # sync: the fault is the learner's, which must stop (raised below).
        refused = {a: failed.pop(a) for a in list(failed) if _NON_FINITE in failed[a]}
        for replica in [r for r in replicas if r.address in failed]:
            self.replicas.remove(replica)
            replica.channel.close()
            self._pending.discard(replica.address)
            self._mark_dead(replica.address, f"version {version}: {failed[replica.address]}")
        for replica in replicas:
            if replica.address not in failed and replica.address not in refused:
                self.installed[replica.address] = int(version)
                self._pending.discard(replica.address)
                self._deltas_in_row[replica.address] = (
                    0 if bases[replica.address] is None
                    else self._deltas_in_row.get(replica.address, 0) + 1)
        if refused:
            raise NonFiniteWeights(f"weights version {version} was refused: {refused}")
        if len(failed) == len(replicas):
            raise Unreached(f"weights version {version} reached no replica: {failed}")
        record = {"version": int(version), "seconds": time.perf_counter() - t0,
                  "bytes": sum(r.expected_bytes for r in replicas if r.address not in failed),
                  "replicas": len(replicas) - len(failed), "sync": self.sync}
        if self.sync == "delta":
            ok = [r for r in replicas if r.address not in failed]
            record.update({
                "wire_bytes": sum(r.sender.last_push.get("wire_bytes", 0) for r in ok),
                "deltas": sum(bases[r.address] is not None for r in ok),
                "fulls": sum(bases[r.address] is None for r in ok),
                "fallbacks": fallbacks,
                "changed_fraction": max((r.sender.last_push.get("changed_fraction", 0.0)
                                         for r in ok if bases[r.address] is not None),
                                        default=None)})
        self.history.append(record)

    def caught_up(self, address: str) -> bool:
        """Whether `address` takes part in weight sync and holds the last published version."""
        with self._lock:
            return (address in self.live and self.current_version is not None
                    and self.installed.get(address) == self.current_version)

    def readmit(self, address: str, *, push: bool = False) -> bool:
        """Take `address` (one of this publisher's replicas) back into weight sync: a fresh
        handshake; then with push=True the current params as the last published version, now.
        Returns whether it holds the last published version (False: it gets the next one, or
        the handshake or push failed and the caller may try again later)."""
        if address not in self.addresses:
            raise ValueError(f"readmit({address!r}): not one of this publisher's replicas "
                             f"{self.addresses}")
        lock = self.params_lock if push and self.params_lock is not None else _NoLock()
        with lock, self._lock:
            if self.caught_up(address):
                return True
            for stale in [r for r in self.replicas if r.address == address]:
                self.replicas.remove(stale)
                stale.channel.close()
            channel = open_channel(address)
            try:  # a fresh process index: no id of an interrupted push reused
                replica = self._handshake_unused(address, channel)
            except (grpc.RpcError, ValueError) as err:
                channel.close()
                log.warning("readmission of %s failed at the handshake: %s", address, _why(err))
                return False
            self.replicas.append(replica)
            self.dead.pop(address, None)
            self._pending.add(address)
            log.info("inference process %s readmitted to weight sync (process %d)", address,
                     replica.process)
            if not push or self.current_version is None:
                return False
            try:
                self._push([replica], self.current_version, self.params())
            except RuntimeError:
                return False
            return self.caught_up(address)

    def close(self) -> None:
        for replica in self.replicas:
            replica.channel.close()


def _quantized(params: Callable[[], Any], fmt: str, block: int) -> dict[str, Any]:
    """The wire tree of the learner's current params (hcjax.transfer.quantize)."""
    return quantize_tree(params(), fmt, block)


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


# Inference side ----------------------------------------------------------------------------------


class WeightsServicer:
    """Inference side of `hcjax.Weights`: the replica's PlanReceiver and its served versions.

    server: anything with `update_weights(tree, version)` (a RolloutServer).
    params_template: the served parameter tree; new versions arrive in its layout.
    host: where this process's transfer server binds (the learner dials it).
    """

    def __init__(self, server: Any, params_template: Any, host: str = "127.0.0.1") -> None:
        self.server, self.host = server, host
        self.template = params_template
        self.quant: tuple[str, int] | None = None  # (format, block) of the session's pushes
        self.layout = describe_layout(params_template)
        self.paths = [p for p, _ in _flat(params_template)]
        self.treedef = jax.tree.structure(params_template)
        self.backend: JaxTransferBackend | None = None
        self.receiver: PlanReceiver | None = None
        self.weights = VersionedWeights()
        self.expected_bytes = 0
        self.served: list[dict] = []  # installed: version, bytes, mode (plain, full, delta)
        self.failed: list[dict] = []  # pulls that installed nothing: version, mode, base, why
        self.pulling: dict | None = None  # the pull in progress: version, mode, base
        self._new_session = False  # no version pulled since the last Handshake
        # Transfer process indices handed out by this replica's Handshakes so far. A learner
        # killed inside a push leaves a pull of that push's ack ids pending on this process's
        # transfer server, and such a pull takes the next offer of its id whoever it is for; a
        # restarted learner re-sends the same versions, so it must not get an index used before.
        self._indices_used: set[int] = set()
        self._lock = threading.Lock()  # one handshake or pull at a time

    def handshake(self, data: bytes, context) -> bytes:
        request = json.loads(data)
        quant, layout = None, self.layout
        try:
            if request.get("quantize") is not None:  # the learner sends quantised values
                quant = (check_format(request["quantize"], request["quant_block"]),
                         int(request["quant_block"]))
                layout = describe_layout(wire_layout(self.template, *quant))
            plan = build_plan(request["layout"], layout)
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        process = int(request["process_index"])
        entries = assign_processes(plan.entries, LEARNER_PROCESS, process)
        with self._lock:
            if len(self._indices_used) >= _MAX_PROCESSES - 1:
                # Every index used (over a thousand handshakes): start the record again, or no
                # index would be accepted. A reused index then meets a stale pull only if a
                # learner also re-sends that pull's version to it.
                self._indices_used.clear()
            if process in self._indices_used:
                context.abort(grpc.StatusCode.ALREADY_EXISTS,
                              f"process index {process} was used by an earlier weights session "
                              "on this replica; take another")
            if self.backend is None:
                self.backend = JaxTransferBackend(f"{self.host}:0")
            learner = _reachable(request["transfer_address"], _peer_host(context.peer()))
            try:
                self.receiver = PlanReceiver(
                    plan, process, self.backend, {LEARNER_PROCESS: learner}, entries=entries,
                    max_bytes_per_pull=int(request["max_bytes_per_pull"]))
            except UntrustedPeer as err:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, str(err))
            self._indices_used.add(process)
            self.expected_bytes = sum(e.nbytes for e in entries)
            self.quant = quant
            self.weights = VersionedWeights()  # a new learner session
            # whose first version may be older than the one served (the learner restarted from
            # a checkpoint): the server takes it back.
            self._new_session = True
        return json.dumps({"layout": layout, "transfer_address": self.backend.address,
                           "expected_bytes": self.expected_bytes,
                           "plan_fingerprint": plan_fingerprint(plan)}).encode()

    def pull(self, data: bytes, context) -> bytes:
        request = json.loads(data)
        version = int(request["version"])
        mode = {None: PLAIN, "full": CHECKED_FULL, "delta": CHECKED_DELTA}.get(request.get("mode"))
        if mode is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"mode={request.get('mode')!r}")
        base = request.get("base")
        with self._lock:
            receiver, quant = self.receiver, self.quant
            if receiver is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"pull of version {version} before any Handshake")
            received = {}

            def build():
                result = self._receive(receiver, version, context, mode, base)
                received["bytes"] = result.bytes_moved
                if quant is not None:  # serve the dequantised values, in our params' dtypes
                    tree = dequantize_tree(result.leaves, self.template, quant[1])
                else:
                    tree = jax.tree.unflatten(self.treedef, [result.leaves[p] for p in self.paths])
                if self._new_session and version < getattr(self.server, "version", version):
                    self.server.update_weights(tree, version, rollback=True)
                else:
                    self.server.update_weights(tree, version)
                return tree

            kind = {"version": version, "mode": request.get("mode") or "plain", "base": base}
            self.pulling = kind
            try:
                self.weights.update(build, version)
            except Exception as err:  # the previous version keeps serving
                self.pulling = None
                self.failed.append({**kind, "why": _why(err.__cause__ or err)[:300]})
                if mode != PLAIN:  # a session's pushes are all plain or all checked
                    receiver.drop_pending()
                if isinstance(err.__cause__, NonFiniteWeights):  # the learner's fault, not ours
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"refused: {err.__cause__}")
                if isinstance(err.__cause__, ChecksumMismatch):
                    context.abort(grpc.StatusCode.DATA_LOSS, str(err))
                if isinstance(err.__cause__, BaseMismatch):
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
                context.abort(grpc.StatusCode.INTERNAL, str(err))
            self.pulling = None
            if mode != PLAIN:
                receiver.commit_base(version)
            self._new_session = False
            self.served.append({"version": version, "bytes": received["bytes"],
                                "mode": kind["mode"]})
        return json.dumps({"version": version, "bytes": received["bytes"]}).encode()

    def _receive(self, receiver: PlanReceiver, version: int, context, mode: int = PLAIN,
                 base: int | None = None) -> Any:
        """receiver.receive(version), given up when the learner cancels the Pull or its deadline
        passes (it dropped this replica from the push): the version's remaining chunks will never
        be offered. The receiver is then retired (its pulls may stay blocked; a daemon thread
        holds them), so the next version needs a new Handshake, which readmission does."""
        args = (version,) if mode == PLAIN else (version, mode, base)
        pulling = _in_daemon_thread(receiver.receive, *args)
        while True:
            try:
                return pulling.result(timeout=0.2)
            except cf.TimeoutError:
                if context.is_active():
                    continue
            if self.receiver is receiver:
                self.receiver = None
            raise TransferError(f"version {version}: the learner gave the pull up (cancelled or "
                                "past its deadline); a new Handshake is needed")

    def status(self, data: bytes, context) -> bytes:
        request = json.loads(data or b"{}")
        version, tree = self.weights.current()
        reply = {"version": version, "served": self.served, "expected_bytes": self.expected_bytes,
                 "failed": self.failed, "pulling": self.pulling}
        if request.get("digests") and tree is not None:
            reply["digests"] = param_digests(tree)
        return json.dumps(reply).encode()

    def handler(self, pool):
        """The `hcjax.Weights` handler for an `hcjax.rpc.server.RpcServer`; its calls block (a
        Pull waits for the transfer), so they run in `pool` (the server's blocking pool): a push
        never waits for a thread behind generation streams, nor holds up the event loop."""
        return grpc.method_handlers_generic_handler(WEIGHTS_SERVICE, {
            name: grpc.unary_unary_rpc_method_handler(blocking(fn, pool))
            for name, fn in (("Handshake", self.handshake), ("Pull", self.pull),
                             ("Status", self.status))})


def weights_service(server: Any, params_template: Any, pool, host: str = "127.0.0.1"):
    """The gRPC handler of `hcjax.Weights` for an inference process serving `server`, its calls
    run in `pool` (an RpcServer's blocking_pool)."""
    return WeightsServicer(server, params_template, host).handler(pool)


def weights_status(address: str, digests: bool = False, timeout: float = 60.0) -> dict:
    """Call a replica's debug `Status` RPC (served versions, bytes, optional per-leaf digests)."""
    with open_channel(address) as channel:
        return _rpc(channel, "Status", timeout)({"digests": digests})
