"""Cross-process executor: learner processes offer the slices of their entries, each inference
process pulls exactly its entries' slices, in bounded chunks, over `jax.experimental.transfer`.

Flow control uses the same transport: after pulling a chunk the receiver offers a one-element
acknowledgement, and the sender keeps at most `window` unacknowledged chunks alive.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.experimental import transfer as jax_transfer

from hcjax.transfer import delta as delta_codec
from hcjax.transfer.local import (
    ExecutionResult,
    SourceShards,
    TransferError,
    assemble_shard,
    chunked,
    slice_source,
    source_leaves,
)
from hcjax.transfer.reshard_plan import TransferEntry, TransferPlan, _to_box

_PROCESS_BITS, _CHUNK_BITS = 10, 16

# Where an inference process may pull weights from: comma-separated hosts, host:port pairs,
# CIDR networks, or "*" for anywhere. Loopback is always trusted; nothing else by default.
TRUSTED_PEERS_ENV = "HCJAX_TRUSTED_PEERS"


# Test hook (hcjax.bench.chaos only): when this variable names a file and that file exists, the
# next delta this process receives has the last byte of its payload flipped on arrival (so it
# fails its checksum, or does not decode: both are a ChecksumMismatch) and the file is removed.
# Unset, as in production, nothing changes.
TEST_CORRUPT_NEXT_DELTA_ENV = "HCJAX_TEST_CORRUPT_NEXT_DELTA"


def _test_corrupt_next_delta(body: np.ndarray) -> np.ndarray:
    trigger = os.environ.get(TEST_CORRUPT_NEXT_DELTA_ENV)
    if not trigger or body.size == 0:
        return body
    try:
        os.remove(trigger)  # one delta only, whichever pull removes it first
    except FileNotFoundError:
        return body
    body = body.copy()
    body[-1] ^= 0xFF
    return body


class UntrustedPeer(PermissionError):
    """A weights pull was asked to go to an address the receiving side does not trust."""


def trusted_peers_from_env(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    env = os.environ if env is None else env
    return tuple(e.strip() for e in env.get(TRUSTED_PEERS_ENV, "").split(",") if e.strip())


def _split(address: str) -> tuple[str, str]:
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise UntrustedPeer(f"transfer address {address!r} is not host:port")
    return host.strip("[]"), port


def _ips(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return {ipaddress.ip_address(host)}
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return set()
    return {ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}


def check_trusted(address: str, trusted: Sequence[str]) -> None:
    """Raise UntrustedPeer unless `address` (host:port) is loopback or matches `trusted`."""
    host, port = _split(address)
    ips = _ips(host)
    if ips and all(ip.is_loopback for ip in ips):
        return
    for entry in trusted:
        if entry == "*":
            return
        if "/" in entry:
            try:
                net = ipaddress.ip_network(entry, strict=False)
            except ValueError:
                continue
            if ips and all(ip in net for ip in ips):
                return
            continue
        e_host, e_port = entry, None
        if entry.count(":") == 1 or entry.startswith("["):
            e_host, e_port = _split(entry)
        if e_port is not None and e_port != port:
            continue
        if e_host == host or (ips and ips <= _ips(e_host)):
            return
    raise UntrustedPeer(
        f"refusing to pull weights from {address}: it is not loopback and not in the trusted "
        f"peers {list(trusted)}; set {TRUSTED_PEERS_ENV} on the inference process to the "
        "learner's host(s) (hosts, host:port, CIDR networks)")


class TransferBackend(Protocol):
    """What the executors need from a transport: offer arrays under an id, pull them by id."""

    @property
    def address(self) -> str: ...

    def offer(self, uuid: int, arrays: Sequence[jax.Array]) -> None: ...

    def pull(
        self, peer: str, uuid: int, specs: Sequence[jax.ShapeDtypeStruct]
    ) -> list[jax.Array]: ...


class JaxTransferBackend:
    """A `jax.experimental.transfer` server for this process.

    Seen with jax 0.10.2 on CPU: two single-process runtimes on 127.0.0.1 connect, a pull lands
    directly on the local device named in its ShapeDtypeStruct's sharding, a pull of an id not
    offered yet waits for it, and a pull from a peer that exits raises 'Connection closed'.
    `address` is where this server listens; `transport_address` the address peers send bulk
    data to (by default the same host, any free port).
    """

    def __init__(self, address: str = "127.0.0.1:0", transport_address: str | None = None):
        client = jax.local_devices()[0].client
        transport = transport_address or address.rsplit(":", 1)[0] + ":0"
        self._server = jax_transfer.start_transfer_server(client, address, [transport])
        self._connections: dict[str, Any] = {}
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return self._server.address()

    def offer(self, uuid: int, arrays: Sequence[jax.Array]) -> None:
        self._server.await_pull(uuid, list(arrays))

    def pull(self, peer: str, uuid: int, specs: Sequence[jax.ShapeDtypeStruct]) -> list[jax.Array]:
        with self._lock:
            if peer not in self._connections:
                self._connections[peer] = self._server.connect(peer)
            connection = self._connections[peer]
        return connection.pull(uuid, list(specs))


# Transfer modes (two bits of every id): the plain device-to-device path, and the checked path's
# delta and full pushes (hcjax.transfer.delta payloads with a CRC-32 per entry). A checked full
# push that retries a failed delta of the same version gets ids of its own.
PLAIN, CHECKED_DELTA, CHECKED_FULL = 0, 1, 2


def transfer_uuid(version: int, src_process: int, dst_process: int, chunk: int, ack: bool,
                  mode: int = PLAIN) -> int:
    """One id per (version, mode, sender, receiver, chunk, data-or-ack); fits in 63 bits."""
    limit = 1 << _PROCESS_BITS
    if not (0 <= src_process < limit and 0 <= dst_process < limit):
        raise ValueError(f"process indices ({src_process}, {dst_process}) must be in [0, {limit})")
    if not 0 <= chunk < 1 << _CHUNK_BITS:
        raise ValueError(f"chunk={chunk} is out of range; raise max_bytes_per_pull")
    if not 0 <= version < 1 << (60 - 2 * _PROCESS_BITS - _CHUNK_BITS):
        raise ValueError(f"version={version} is out of range for a transfer id")
    if mode not in (PLAIN, CHECKED_DELTA, CHECKED_FULL):
        raise ValueError(f"mode={mode} is not a transfer mode")
    uuid = ((version << 2 | mode) << _PROCESS_BITS | src_process) << _PROCESS_BITS | dst_process
    return (uuid << _CHUNK_BITS | chunk) << 1 | int(ack)


class ChecksumMismatch(TransferError):
    """An entry's bytes after applying a delta do not match the sender's checksum."""


class BaseMismatch(TransferError):
    """A delta was sent against a base version the receiver does not hold."""


def chunk_entries(entries: Sequence[TransferEntry], max_bytes: int) -> list[list[TransferEntry]]:
    """Consecutive chunks of at most `max_bytes` (an entry larger than that travels alone)."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes_per_pull={max_bytes} must be positive")
    return chunked(entries, max_bytes)


def _pair_entries(
    entries: Sequence[TransferEntry], plan: TransferPlan
) -> dict[tuple[int, int], list[TransferEntry]]:
    """Entries by (src process, dst process), in one order both sides compute alike."""
    order = {path: i for i, path in enumerate(plan.dst_paths)}
    pairs: dict[tuple[int, int], list[TransferEntry]] = defaultdict(list)
    for entry in sorted(
        entries, key=lambda e: (order[e.dst_leaf], e.dst_device, e.src_leaf, e.src_device)
    ):
        pairs[(entry.src_process, entry.dst_process)].append(entry)
    return pairs


def _in_daemon_threads(fn: Callable[[int], int], keys: Sequence[int], name: str) -> dict[int, int]:
    """{key: fn(key)}, each call in its own daemon thread; re-raises the first error. Not an
    executor: a pull left waiting on a peer that died, stopped, or gave the transfer up would keep
    an executor's thread, and with it the process, from exiting (they are joined at exit)."""
    results: dict[int, int] = {}
    errors: list[BaseException] = []

    def run(key: int) -> None:
        try:
            results[key] = fn(key)
        except BaseException as err:  # re-raised on the calling thread below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(k,), daemon=True, name=f"{name}-{k}")
               for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


_ACK = np.ones((1,), np.int32)


class PlanSender:
    """Learner side: serves the slices of this process's entries to each receiver process."""

    def __init__(
        self,
        plan: TransferPlan,
        process_index: int,
        backend: TransferBackend,
        peers: Mapping[int, str],
        entries: Sequence[TransferEntry] | None = None,
        max_bytes_per_pull: int = 16 << 20,
        window: int = 2,
    ):
        if window <= 0:
            raise ValueError(f"window={window} must be positive")
        self.plan, self.process_index, self.backend = plan, process_index, backend
        self.peers, self.window = dict(peers), window
        pairs = _pair_entries(plan.entries if entries is None else entries, plan)
        self.chunks = {
            dst: chunk_entries(es, max_bytes_per_pull)
            for (src, dst), es in pairs.items()
            if src == process_index
        }
        missing = sorted(set(self.chunks) - set(self.peers))
        if missing:
            raise ValueError(f"no address for receiver processes {missing}")
        self.bytes_sent = 0
        # The checked path (`send_checked`): the wire slices of the last version sent, on the
        # host, per receiver and chunk: the base the next delta is encoded against.
        self.base: dict[int, list[list[np.ndarray]]] = {}
        self.base_version: int | None = None
        self.tamper: Callable[[int, bytes], bytes] | None = None  # tests: corrupt a payload
        self._started = 0
        self.last_push: dict[str, Any] = {}

    def send(self, source: Any, version: int) -> int:
        """Serve `version` of `source` to every receiver; returns when all chunks are acked."""
        leaves = source_leaves(self.plan, source)
        shard_of = SourceShards(leaves)
        ack_device = jax.local_devices()[0]

        def serve(dst: int) -> int:
            sent, unacked = 0, deque()
            for c, chunk in enumerate(self.chunks[dst]):
                if len(unacked) >= self.window:
                    self._wait_ack(version, dst, unacked.popleft(), ack_device)
                pieces = []
                for e in chunk:
                    route = self.plan.routes[(e.src_leaf, e.dst_leaf)]
                    try:
                        data, box = shard_of(e.src_leaf, e.src_device)
                        pieces.append(slice_source(e, route, data, box))
                    except Exception as err:
                        raise TransferError(f"version {version}: entry {e} failed: {err}") from err
                self.backend.offer(
                    transfer_uuid(version, self.process_index, dst, c, False), pieces
                )
                unacked.append(c)
                sent += sum(e.nbytes for e in chunk)
            while unacked:
                self._wait_ack(version, dst, unacked.popleft(), ack_device)
            return sent

        results = _in_daemon_threads(serve, sorted(self.chunks), "plan-send")
        sent = sum(results.values())
        self.bytes_sent += sent
        return sent

    def send_checked(self, source: Any, version: int, base: int | None = None,
                     encoding: str = "sparse") -> int:
        """Serve `version` by the checked path: per chunk a header (payload bytes and CRC-32 per
        entry) and one uint8 payload of `hcjax.transfer.delta` encodings, against version `base`
        (the version this sender sent last, which the receiver must hold) or, with base=None,
        whole (a full push). Returns the payload bytes sent; `last_push` has the counts."""
        if base is not None and base != self.base_version:
            raise ValueError(f"delta against version {base}, but this sender's base is "
                             f"{self.base_version}")
        mode = CHECKED_FULL if base is None else CHECKED_DELTA
        self._started += 1
        started = self._started  # a send started after this one (a retry) commits, not this one
        leaves = source_leaves(self.plan, source)
        shard_of = SourceShards(leaves)
        ack_device = jax.local_devices()[0]
        new_base: dict[int, list[list[np.ndarray]]] = {}
        counts: dict[int, tuple[int, int, int]] = {}

        def serve(dst: int) -> int:
            sent, changed, elements, unacked = 0, 0, 0, deque()
            kept = new_base.setdefault(dst, [])
            for c, chunk in enumerate(self.chunks[dst]):
                if len(unacked) >= self.window:
                    self._wait_ack(version, dst, unacked.popleft(), ack_device, mode)
                pieces = []
                for e in chunk:
                    route = self.plan.routes[(e.src_leaf, e.dst_leaf)]
                    try:
                        data, box = shard_of(e.src_leaf, e.src_device)
                        pieces.append(slice_source(e, route, data, box))
                    except Exception as err:
                        raise TransferError(f"version {version}: entry {e} failed: {err}") from err
                # Copies: on CPU a device_get may alias the device buffer, which the learner's
                # next step may donate and overwrite, and these are the next delta's base.
                host = [np.array(p, copy=True) for p in jax.device_get(pieces)]
                kept.append(host)
                payloads = []
                for i, x in enumerate(host):
                    old = None if base is None else self.base[dst][c][i]
                    payload, n = delta_codec.encode(old, x, encoding)
                    changed, elements = changed + n, elements + x.size
                    if self.tamper is not None:
                        payload = self.tamper(c, payload)
                    payloads.append(payload)
                header = np.array([[len(p), delta_codec.checksum(x)]
                                   for p, x in zip(payloads, host, strict=True)], np.uint32)
                body = np.frombuffer(b"".join(payloads), np.uint8)
                self.backend.offer(transfer_uuid(version, self.process_index, dst, 2 * c, False,
                                                 mode), [jax.device_put(header, ack_device)])
                self.backend.offer(transfer_uuid(version, self.process_index, dst, 2 * c + 1,
                                                 False, mode), [jax.device_put(body, ack_device)])
                unacked.append(c)
                sent += header.nbytes + body.nbytes
            while unacked:
                self._wait_ack(version, dst, unacked.popleft(), ack_device, mode)
            counts[dst] = (sent, changed, elements)
            return sent

        results = _in_daemon_threads(serve, sorted(self.chunks), "plan-send-checked")
        sent = sum(results.values())
        self.bytes_sent += sent
        if started != self._started:
            return sent
        self.base, self.base_version = new_base, version
        changed = sum(c[1] for c in counts.values())
        elements = sum(c[2] for c in counts.values())
        self.last_push = {"version": version, "base": base, "wire_bytes": sent,
                          "changed_elements": changed, "elements": elements,
                          "changed_fraction": changed / max(1, elements)}
        return sent

    def _wait_ack(self, version: int, dst: int, chunk: int, device: Any,
                  mode: int = PLAIN) -> None:
        spec = jax.ShapeDtypeStruct(
            _ACK.shape, _ACK.dtype, sharding=jax.sharding.SingleDeviceSharding(device)
        )
        uuid = transfer_uuid(version, self.process_index, dst, chunk, True, mode)
        self.backend.pull(self.peers[dst], uuid, [spec])[0].block_until_ready()


class PlanReceiver:
    """Inference side: pulls exactly this process's entries and assembles fresh arrays."""

    def __init__(
        self,
        plan: TransferPlan,
        process_index: int,
        backend: TransferBackend,
        peers: Mapping[int, str],
        entries: Sequence[TransferEntry] | None = None,
        dst_shardings: Mapping[str, jax.sharding.Sharding] | None = None,
        max_bytes_per_pull: int = 16 << 20,
        trusted_peers: Sequence[str] | None = None,
    ):
        """trusted_peers: where pulls may go besides loopback (check_trusted); None: from
        $HCJAX_TRUSTED_PEERS. A peer outside them raises UntrustedPeer before anything moves."""
        self.plan, self.process_index, self.backend = plan, process_index, backend
        self.peers = dict(peers)
        trusted = trusted_peers_from_env() if trusted_peers is None else tuple(trusted_peers)
        for address in self.peers.values():
            check_trusted(address, trusted)
        pairs = _pair_entries(plan.entries if entries is None else entries, plan)
        self.chunks = {
            src: chunk_entries(es, max_bytes_per_pull)
            for (src, dst), es in pairs.items()
            if dst == process_index
        }
        missing = sorted(set(self.chunks) - set(self.peers))
        if missing:
            raise ValueError(f"no address for sender processes {missing}")
        self.dst_shardings = dict(
            dst_shardings or {p: s.sharding for p, s in plan.dst_leaves.items()}
        )
        mine = [e for chunks in self.chunks.values() for chunk in chunks for e in chunk]
        self.leaves = sorted({e.dst_leaf for e in mine})
        self.expected: dict[tuple[str, int], int] = defaultdict(int)
        for e in mine:
            self.expected[(e.dst_leaf, e.dst_device)] += 1
        self.bytes_received = 0
        self.chunks_pulled = 0  # over all versions, failed ones included
        # The checked path: the slices of the installed version (`commit_base`), per sender and
        # chunk, on the host; a delta is applied to them.
        self.base: dict[int, list[list[np.ndarray]]] = {}
        self.base_version: int | None = None
        self._pending: tuple[int, dict[int, list[list[np.ndarray]]]] | None = None

    def receive(self, version: int, mode: int = PLAIN, base: int | None = None) -> ExecutionResult:
        """Pull `version` from every sender; returns this process's destination leaves.

        mode=PLAIN: the slices travel as they are. CHECKED_DELTA / CHECKED_FULL: the sender's
        `send_checked` encodings, applied to the slices of version `base` this receiver holds
        (raises BaseMismatch if it holds another) and checked against the sender's CRC-32 per
        entry (raises ChecksumMismatch naming the entry). Either way every chunk is still pulled
        and acknowledged, so that the sender ends, and nothing of the version is returned. The decoded slices become the pending base, which `commit_base`
        makes this receiver's base once the version is installed."""
        if mode == CHECKED_FULL:
            base = None
        devices = {d.id: d for d in jax.local_devices()}
        ack = {d: jax.device_put(_ACK, d) for d in devices.values()}
        arrived: dict[tuple[str, int], list[tuple[TransferEntry, jax.Array]]] = defaultdict(list)
        shards: dict[str, dict[int, jax.Array]] = defaultdict(dict)
        lock = threading.Lock()
        pending: dict[int, list[list[np.ndarray]]] = {}
        corrupt: list[TransferError] = []

        def pull_checked(src: int, c: int, chunk: list[TransferEntry]) -> tuple[list, int]:
            device = devices[chunk[0].dst_device]
            one = jax.sharding.SingleDeviceSharding(device)
            try:
                header = np.asarray(self.backend.pull(
                    self.peers[src], transfer_uuid(version, src, self.process_index, 2 * c, False,
                                                   mode),
                    [jax.ShapeDtypeStruct((len(chunk), 2), np.uint32, sharding=one)])[0])
                body = np.asarray(self.backend.pull(
                    self.peers[src], transfer_uuid(version, src, self.process_index, 2 * c + 1,
                                                   False, mode),
                    [jax.ShapeDtypeStruct((int(header[:, 0].astype(np.int64).sum()),), np.uint8,
                                          sharding=one)])[0])
            except Exception as err:
                raise TransferError(
                    f"pull of version {version} chunk {c} from process {src} failed: {err}"
                ) from err
            if mode == CHECKED_DELTA:
                body = _test_corrupt_next_delta(body)
            if mode == CHECKED_DELTA and (base is None or base != self.base_version):
                raise BaseMismatch(f"version {version} is a delta against version {base}, but "
                                   f"this receiver holds base version {self.base_version}")
            host, offset = [], 0
            for i, (e, (size, crc)) in enumerate(zip(chunk, header, strict=True)):
                payload = body[offset:offset + int(size)]
                offset += int(size)
                old = None if base is None else self.base[src][c][i]
                try:
                    x = delta_codec.decode(old, payload, tuple(
                        s.stop - s.start for s in e.src_index), np.dtype(e.wire_dtype))
                except Exception as err:
                    raise ChecksumMismatch(f"version {version}: entry {e} did not decode: "
                                           f"{err}") from err
                if delta_codec.checksum(x) != int(crc):
                    raise ChecksumMismatch(
                        f"version {version}: entry {e} has CRC-32 {delta_codec.checksum(x)} "
                        f"after {'the delta' if base is not None else 'the transfer'}, the "
                        f"sender's is {int(crc)}")
                host.append(x)
            with lock:
                pending.setdefault(src, []).append(host)
            pieces = [jax.device_put(x, devices[e.dst_device]) for x, e in zip(host, chunk,
                                                                                strict=True)]
            return pieces, header.nbytes + body.nbytes

        def pull_from(src: int) -> int:
            received = 0
            for c, chunk in enumerate(self.chunks[src]):
                if mode != PLAIN:
                    try:
                        pieces, moved = pull_checked(src, c, chunk)
                    except (ChecksumMismatch, BaseMismatch) as err:  # pull and ack the rest,
                        corrupt.append(err)  # so that the sender ends
                        pieces, moved = None, 0
                else:
                    specs = [
                        jax.ShapeDtypeStruct(
                            tuple(s.stop - s.start for s in e.src_index),
                            np.dtype(e.wire_dtype),
                            sharding=jax.sharding.SingleDeviceSharding(devices[e.dst_device]),
                        )
                        for e in chunk
                    ]
                    uuid = transfer_uuid(version, src, self.process_index, c, False)
                    try:
                        pieces = self.backend.pull(self.peers[src], uuid, specs)
                    except Exception as err:
                        raise TransferError(
                            f"pull of version {version} chunk {c} from process {src} failed: "
                            f"{err}"
                        ) from err
                    moved = sum(e.nbytes for e in chunk)
                jax.block_until_ready(pieces)
                with lock:
                    self.chunks_pulled += 1
                self.backend.offer(
                    transfer_uuid(version, src, self.process_index, c, True, mode),
                    [ack[devices[chunk[0].dst_device]]],
                )
                received += moved
                if pieces is None or corrupt:
                    continue
                for e, piece in zip(chunk, pieces, strict=True):
                    key = (e.dst_leaf, e.dst_device)
                    with lock:
                        arrived[key].append((e, piece))
                        if len(arrived[key]) == self.expected[key]:
                            self._assemble(key, arrived.pop(key), shards, devices)
            return received

        received = sum(_in_daemon_threads(pull_from, sorted(self.chunks), "plan-pull").values())
        if corrupt:
            raise corrupt[0]
        self.bytes_received += received

        out = {}
        for path in self.leaves:
            spec, sharding = self.plan.dst_leaves[path], self.dst_shardings[path]
            arrays = [
                shards[path][d.id] for d in sharding.addressable_devices_indices_map(spec.shape)
            ]
            out[path] = jax.make_array_from_single_device_arrays(spec.shape, sharding, arrays)
        largest_chunk = max(
            (sum(e.nbytes for e in chunk) for chunks in self.chunks.values() for chunk in chunks),
            default=0,
        )
        if mode != PLAIN:
            self._pending = (version, pending)
        return ExecutionResult(jax.block_until_ready(out), received, largest_chunk)

    def commit_base(self, version: int) -> None:
        """Make the slices of `version` (received by the checked path, now installed) the base
        the next delta applies to. Without them (a plain push, or a failed one) the base is
        dropped: the next checked push must be full."""
        if self._pending is not None and self._pending[0] == version:
            self.base, self.base_version = self._pending[1], version
        else:
            self.base, self.base_version = {}, None
        self._pending = None

    def drop_pending(self) -> None:
        """Forget the slices of a version that was not installed (the base stays)."""
        self._pending = None

    def _assemble(self, key, group, shards, devices) -> None:
        path, dst_id = key
        spec, sharding = self.plan.dst_leaves[path], self.dst_shardings[path]
        shard_box = _to_box(sharding.devices_indices_map(spec.shape)[devices[dst_id]], spec.shape)
        entries = [e for e, _ in group]
        pieces = [p for _, p in group]
        shards[path][dst_id] = assemble_shard(self.plan, entries, pieces, shard_box, spec.dtype)
