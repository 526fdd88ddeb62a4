"""`python -m hcjax.bench.serve_load`: `python -m hcjax.serve` under load on 127.0.0.1, started as
the launchers start it (`--max_prefill_length 32 --max_concurrent_decodes SLOTS`, defaults
otherwise), with client hosts modelled by loopback source addresses (127.0.0.2, 127.0.0.3, ...).

Per server size: a light client's latency (one sample, 8 tokens) alone; then flooding hosts keep
their full share busy with n=16 x 32-token requests while the light client asks again, a
learner pushes new weights every few seconds, and a probe calls Health every 50 ms. Prints the
light client's p50/p99 alone and under the flood, what each host held against its share
and how many waited in its line (sampled from Metrics), the RESOURCE_EXHAUSTED count, Health
p50/p99, the push times and the server's memory.

Then the mixed case (8 slots, --max_queue 64, --queue_share 0.5, --max_n 16, --max_target_length
64): 64 threads of one host send 256 valid requests, 8 at the limits (n=16, prompt 32, max_tokens
32: 1,024 tokens of the host's 2,304) and the rest small, each RESOURCE_EXHAUSTED asked again
after the server's retry-after hint (exponential backoff from 50 ms without one), at most 2 s
apart and 30 tries in all. Prints how many were answered, the large and the small requests'
p50/p99 and the most times one request was refused. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np

from hcjax import config as hcfg
from hcjax.rpc.auth import Security

REPO = Path(__file__).resolve().parents[2]
LAUNCHER_SIZES = ["--max_prefill_length", "32"]  # as hcjax.cluster.jobset and launch/*.sh
PROMPT = [10, 20, 30, 40, 50, 60, 70, 80]


class SourceProxy:
    """Forwards each TCP connection accepted on 127.0.0.1:`port` to `target` from the loopback
    address `source`, so the server sees the client as host `source` (gRPC clients cannot pick
    their source address)."""

    def __init__(self, source: str, target: tuple[str, int]) -> None:
        self.source, self.target = source, target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name=f"proxy-{source}").start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
                upstream = socket.create_connection(self.target, source_address=(self.source, 0))
            except OSError:
                return
            for s in (conn, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sockets += [conn, upstream]
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        self._closed.set()
        for s in [self._listener, *self._sockets]:
            try:
                s.close()
            except OSError:
                pass


def _percentiles(values: Sequence[float]) -> dict:
    if not values:
        return {"n": 0}
    a = np.asarray(values) * 1000.0
    return {"n": len(values), "p50_ms": round(float(np.percentile(a, 50)), 1),
            "p99_ms": round(float(np.percentile(a, 99)), 1),
            "max_ms": round(float(a.max()), 1)}


def _rss_mb(pid: int) -> dict:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = round(int(value.split()[0]) / 1024, 1)
    return {"rss_mb": fields.get("VmRSS"), "peak_rss_mb": fields.get("VmHWM")}


def _start_server(slots: int, gin_params: Sequence[str], log_path: Path,
                  serve_args: Sequence[str] = ()):
    cmd = [sys.executable, "-m", "hcjax.serve", *LAUNCHER_SIZES,
           "--max_concurrent_decodes", str(slots), "--status_every", "0", *serve_args]
    for p in gin_params:
        cmd += ["--gin_param", p]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               XLA_FLAGS=hcfg.cpu_xla_flags(1))
    env.pop("HCJAX_TOKEN", None)
    env.pop("HCJAX_TOKEN_FILE", None)
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, cwd=REPO,
                            text=True)
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        raise RuntimeError(f"hcjax.serve exited before serving: {log_path.read_text()[-2000:]}")
    return proc, json.loads(line), log


def _learner_params(gin_params: Sequence[str]):
    """The learner's parameters of the served model (same gin model), on this process's first
    device; two versions to alternate between."""
    # In the pusher's process, after its XLA_FLAGS and JAX_PLATFORMS are set (JAX reads them when
    # it starts), and after the flags: --help stays fast.
    import jax
    from flax import nnx

    from hcjax import rollout  # noqa: F401 - the engine's and server's configurables, before bind
    from hcjax.model import ModelConfig, add_weight_noise, create_sharded
    from hcjax.sharding import MeshConfig, make_mesh
    from hcjax.transfer import weights_service  # noqa: F401 - its WeightSyncConfig, before bind

    hcfg.bind(["tiny_cpu.gin"], list(gin_params))
    mesh = make_mesh(MeshConfig(fsdp=1, num_devices=1))
    state = nnx.state(create_sharded(ModelConfig(), mesh, seed=0))
    return [jax.tree.map(lambda x, ref: jax.device_put(x, ref.sharding),
                         add_weight_noise(state, seed, 0.01), state) for seed in (1, 2)]


def _flood_host(source: str, port: int, streams: int, stop, out) -> None:
    """One flooding client host (its own process): `streams` concurrent streams of n=16 x
    32-token requests from `source`, each asked again 50 ms after a refusal."""
    # after the flags: --help stays fast (this loads JAX)
    from hcjax.rollout import GenerateRequest
    from hcjax.rollout.service import RolloutClient

    proxy = SourceProxy(source, ("127.0.0.1", port))
    heavy = GenerateRequest(prompt=PROMPT, n=16, max_tokens=32, temperature=1.0)
    counts = {"ok": 0, "resource_exhausted": 0, "other_errors": 0}
    refusals: list[str] = []
    lock = threading.Lock()

    def stream() -> None:
        client = RolloutClient(proxy.address, Security())
        while not stop.is_set():
            try:
                client.generate(heavy, timeout=600)
                key = "ok"
            except grpc.RpcError as err:
                if stop.is_set():
                    break
                key = ("resource_exhausted" if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                       else "other_errors")
                if len(refusals) < 2:
                    refusals.append(f"{err.code().name}: {err.details()}")
                time.sleep(0.05)
            with lock:
                counts[key] += 1
        client.close()

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(30)
    out.put({"host": f"ipv4:{source}", **counts, "refusals": refusals})
    proxy.close()


def _health_prober(address: str, stop, probing, out) -> None:
    """The learner's Health probe (its own process, like the learner): every 50 ms. `probing` is
    set once the first probe has been sent, so that the flood is not over before the probe starts
    (on a loaded machine this process's imports alone can outlast a short flood)."""
    # after the flags: --help stays fast (this loads JAX)
    from hcjax.rollout.service import RolloutClient

    latencies, errors = [], []
    with RolloutClient(address, Security()) as client:
        while not (stop.is_set() and latencies + errors):
            t0 = time.perf_counter()
            try:
                client.health(timeout=5)
                latencies.append(time.perf_counter() - t0)
            except grpc.RpcError as err:
                errors.append(err.code().name)
            probing.set()
            time.sleep(0.05)
    out.put({"latencies": latencies, "errors": errors})


def _pusher(address: str, gin_params: list, every: float, stop, out) -> None:
    """A learner (its own process) pushing a new weights version every `every` s."""
    os.environ["XLA_FLAGS"] = hcfg.cpu_xla_flags(1)
    os.environ["JAX_PLATFORMS"] = "cpu"
    # after the environment above: JAX reads it when it starts; --help stays fast
    from hcjax.transfer.weights_service import WeightPublisher

    versions = _learner_params(gin_params)
    current = {"params": versions[0]}
    publisher = WeightPublisher(lambda: current["params"], [address], timeout=120)
    seconds, errors, version = [], [], 1
    out.put({"ready": True})
    while not stop.wait(every):
        current["params"] = versions[version % 2]
        t0 = time.perf_counter()
        try:
            publisher(version)
            seconds.append(time.perf_counter() - t0)
        except RuntimeError as err:
            errors.append(str(err)[:200])
        version += 1
    publisher.close()
    out.put({"seconds": seconds, "errors": errors})


# The mixed case: the server as `python -m hcjax.serve` with these flags beside LAUNCHER_SIZES.
MIXED_SERVE_ARGS = ["--max_queue", "64", "--queue_share", "0.5", "--max_n", "16",
                    "--max_target_length", "64"]
LARGE = {"n": 16, "prompt_len": 32, "max_tokens": 32}  # at the mixed server's limits


def mixed_requests(count: int, large: int, seed: int = 0) -> list:
    """`count` valid requests in a seeded order: `large` at the limits (LARGE), the rest smaller
    (n 4 or 8, prompt 16 or 32, max_tokens 32: 192-512 tokens of work, 336 on average, so
    seven fill the host's share); each with its own seed, so no two share a message."""
    # after the flags: --help stays fast (this loads JAX)
    from hcjax.rollout import GenerateRequest

    if not 0 <= large <= count:
        raise ValueError(f"large={large} must be in [0, count={count}]")
    rng = random.Random(seed)
    shapes = [LARGE] * large + [
        {"n": rng.choice((4, 8)), "prompt_len": rng.choice((16, 32)), "max_tokens": 32}
        for _ in range(count - large)]
    rng.shuffle(shapes)
    return [GenerateRequest(prompt=[1 + (i + j) % 60 for j in range(shape["prompt_len"])],
                            n=shape["n"], max_tokens=shape["max_tokens"], temperature=1.0,
                            seed=i)
            for i, shape in enumerate(shapes)]


def mixed_load(address: str, requests: Sequence, *, threads: int, tries: int = 30,
               backoff: float = 0.05, max_backoff: float = 2.0) -> list[dict]:
    """Send `requests` to `address` from `threads` threads of this host (one channel each),
    each taking the next request when its last one ends. A RESOURCE_EXHAUSTED is asked again
    after the refusal's retry-after hint if it has one, else after `backoff` doubling, at most
    `max_backoff` s, `tries` times in all. Per request: its kind ("large" if n is LARGE's),
    whether it was answered, the seconds from the first try to the answer, its refusals and
    the hints it was given."""
    # after the flags: --help stays fast (this loads JAX)
    from hcjax.rollout.service import RolloutClient, retry_after

    pending = list(enumerate(requests))
    out: list[dict] = [{} for _ in requests]
    lock = threading.Lock()

    def worker() -> None:
        with RolloutClient(address, Security()) as client:
            while True:
                with lock:
                    if not pending:
                        return
                    i, request = pending.pop(0)
                row = {"kind": "large" if request.n == LARGE["n"] else "small",
                       "answered": False, "refusals": 0, "hints": 0, "error": None}
                t0, wait = time.perf_counter(), backoff
                for _ in range(tries):
                    try:
                        client.generate(request, timeout=600)
                    except grpc.RpcError as err:
                        if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                            row["error"] = f"{err.code().name}: {err.details()}"
                            break
                        row["refusals"] += 1
                        hint = retry_after(err)
                        row["hints"] += hint is not None
                        time.sleep(min(max_backoff, wait if hint is None else hint))
                        if hint is None:
                            wait *= 2
                        continue
                    row["answered"] = True
                    row["seconds"] = time.perf_counter() - t0
                    break
                out[i] = row

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return out


def summarise_mixed(rows: Sequence[dict]) -> dict:
    """The mixed case's figures from `mixed_load`'s rows."""
    def seconds(kind: str) -> list[float]:
        return [r["seconds"] for r in rows if r["kind"] == kind and r["answered"]]

    large, small = _percentiles(seconds("large")), _percentiles(seconds("small"))
    return {
        "requests": len(rows), "answered": sum(r["answered"] for r in rows),
        "large_answered": sum(r["answered"] for r in rows if r["kind"] == "large"),
        "large": large, "small": small,
        "large_p99_over_p50": (round(large["p99_ms"] / large["p50_ms"], 2)
                               if large["n"] else None),
        "refusals": sum(r["refusals"] for r in rows),
        "max_refusals": max((r["refusals"] for r in rows), default=0),
        "max_refusals_large": max((r["refusals"] for r in rows if r["kind"] == "large"),
                                  default=0),
        "refusals_with_hint": sum(r["hints"] for r in rows),
        "errors": sorted({r["error"] for r in rows if r["error"]})[:4],
    }


def run_mixed(slots: int, *, requests: int, large: int, threads: int, tries: int,
              gin_params: Sequence[str], out_dir: Path,
              serve_args: Sequence[str] = tuple(MIXED_SERVE_ARGS), log=print) -> dict:
    """The mixed case (see the module doc) against its own server; afterwards the server must
    hold nothing and answer another request."""
    # after the flags: --help stays fast (this loads JAX)
    from hcjax.rollout import GenerateRequest
    from hcjax.rollout.service import RolloutClient

    proc, serving, server_log = _start_server(slots, gin_params,
                                              out_dir / f"serve_mixed_{slots}.log", serve_args)
    address = f"127.0.0.1:{serving['port']}"
    try:
        batch = mixed_requests(requests, large)
        with RolloutClient(address, Security()) as control:
            # The programs the case meets (prefill of every prompt length and row count, decode
            # blocks of every length) are compiled by a run of the same mix in another order,
            # untimed, so the timed one measures admission rather than compiles.
            warm = mixed_load(address, mixed_requests(requests, large, seed=1),
                              threads=threads, tries=tries)
            result = {"warmup_answered": sum(r["answered"] for r in warm)}
            t0 = time.perf_counter()
            rows = mixed_load(address, batch, threads=threads, tries=tries)
            result.update(slots=slots, serve_args=list(serve_args), threads=threads,
                          tries=tries, seconds=round(time.perf_counter() - t0, 1),
                          **summarise_mixed(rows))
            admission = control.metrics(timeout=10)["admission"]
            result["held_after"] = {"work": admission["work"], "requests": admission["requests"]}
            control.generate(GenerateRequest(prompt=PROMPT, n=1, max_tokens=4), timeout=120)
            result["answers_after"] = True
        log(f"[mixed, {slots} slots] {result}")
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        server_log.close()
    return result


def run_size(slots: int, *, light_requests: int, flood_streams: int, flood_hosts: int,
             flood_seconds: float, push_every: float, gin_params: Sequence[str],
             out_dir: Path, serve_args: Sequence[str] = (), log=print) -> dict:
    """One server size: the light client alone, then under the flood (see the module doc).
    Every client host, the prober and the learner run in processes of their own."""
    # after the flags: --help stays fast (this loads JAX)
    from hcjax.rollout import GenerateRequest
    from hcjax.rollout.service import RolloutClient

    ctx = mp.get_context("spawn")
    security = Security()
    proc, serving, server_log = _start_server(slots, gin_params, out_dir / f"serve_{slots}.log",
                                              serve_args)
    address = f"127.0.0.1:{serving['port']}"
    light_proxy = SourceProxy(f"127.0.0.{2 + flood_hosts}", ("127.0.0.1", serving["port"]))
    stop, out = ctx.Event(), ctx.Queue()
    children: list = []
    result: dict = {"slots": slots, "max_target_length": serving["max_target_length"]}
    try:
        light = RolloutClient(light_proxy.address, security)
        control = RolloutClient(address, security)
        light_request = GenerateRequest(prompt=PROMPT, n=1, max_tokens=8, temperature=1.0)

        def light_latencies(count: int) -> list[float]:
            out_s = []
            for i in range(count):
                t0 = time.perf_counter()
                light.generate(dataclasses.replace(light_request, seed=i), timeout=300)
                out_s.append(time.perf_counter() - t0)
            return out_s

        light_latencies(3)  # compile the shapes the light client meets
        control.generate(GenerateRequest(prompt=PROMPT, n=16, max_tokens=32), timeout=600)
        result["memory_idle"] = _rss_mb(proc.pid)
        result["light_alone"] = _percentiles(light_latencies(light_requests))
        log(f"[{slots} slots] light alone: {result['light_alone']}")

        pusher = ctx.Process(target=_pusher, args=(address, list(gin_params), push_every, stop,
                                                   out), daemon=True)
        pusher.start()
        children.append(pusher)
        ready = out.get(timeout=600)  # the learner built its params and handshook
        assert ready == {"ready": True}, ready
        children += [ctx.Process(target=_flood_host, args=(f"127.0.0.{2 + i}", serving["port"],
                                                           flood_streams, stop, out),
                                 daemon=True) for i in range(flood_hosts)]
        probing = ctx.Event()
        children.append(ctx.Process(target=_health_prober, args=(address, stop, probing, out),
                                    daemon=True))
        for child in children[1:]:
            child.start()
        if not probing.wait(timeout=300):
            raise RuntimeError("the Health prober sent no probe in 300 s")

        share: dict = {}
        held_max: dict[str, dict] = {}
        line_max: dict[str, int] = {}  # requests waiting in each host's line
        watching = threading.Event()

        def watch() -> None:  # what each host holds, from the server's Metrics
            while not watching.is_set():
                try:
                    adm = control.metrics(timeout=5)["admission"]
                except grpc.RpcError:
                    continue
                share.update(work=adm["host_share_work"], requests=adm["host_share_requests"])
                for host, held in adm["hosts"].items():
                    top = held_max.setdefault(host, {"work": 0, "requests": 0})
                    top["work"] = max(top["work"], held["work"])
                    top["requests"] = max(top["requests"], held["requests"])
                for host, line in adm.get("waiting", {}).items():
                    line_max[host] = max(line_max.get(host, 0), line["requests"])
                time.sleep(0.1)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t_flood = time.perf_counter()
        flooders = [f"ipv4:127.0.0.{2 + i}" for i in range(flood_hosts)]
        deadline = time.monotonic() + 300
        heavy_cost = 16 * (len(PROMPT) + 32)
        while time.monotonic() < deadline and not (share and all(  # full: no room for another
                held_max.get(h, {}).get("work", 0) + heavy_cost > share["work"]
                for h in flooders)):
            time.sleep(0.2)
        result["flood_fill_seconds"] = round(time.perf_counter() - t_flood, 1)
        under = light_latencies(light_requests)
        remaining = flood_seconds - (time.perf_counter() - t_flood)
        if remaining > 0:
            time.sleep(remaining)
        result["memory_under_load"] = _rss_mb(proc.pid)
        stop.set()
        reports = [out.get(timeout=120) for _ in children]
        watching.set()
        watcher.join(10)
        result["light_under_flood"] = _percentiles(under)
        p99_alone = result["light_alone"]["p99_ms"]
        result["light_p99_ratio"] = round(result["light_under_flood"]["p99_ms"] / p99_alone, 2)
        result["light_p99_target_ms"] = max(10 * p99_alone, 1000.0)
        hosts = [r for r in reports if "host" in r]
        result["flood"] = {"hosts": hosts, "streams_per_host": flood_streams,
                           "resource_exhausted": sum(h["resource_exhausted"] for h in hosts)}
        result["host_share"] = share
        result["held_max"] = held_max
        result["line_max"] = line_max
        result["over_share"] = sorted(
            h for h, held in held_max.items()
            if held["work"] > share.get("work", 0) or held["requests"] > share.get("requests", 0))
        [probe] = [r for r in reports if "latencies" in r]
        result["health"] = dict(_percentiles(probe["latencies"]), errors=len(probe["errors"]))
        [pushes] = [r for r in reports if "seconds" in r]
        result["pushes"] = dict(_percentiles(pushes["seconds"]), errors=pushes["errors"])
        log(f"[{slots} slots] light under flood: {result['light_under_flood']}, health "
            f"{result['health']}, pushes {result['pushes']}, held {held_max} of {share}")
        light.close()
        control.close()
    finally:
        stop.set()
        for child in children:
            child.join(30)
            if child.is_alive():
                child.kill()
        light_proxy.close()
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        server_log.close()
    return result


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", default="128,8",
                        help="server sizes (max_concurrent_decodes), comma-separated")
    parser.add_argument("--light_requests", type=int, default=40)
    parser.add_argument("--flood_hosts", type=int, default=2,
                        help="flooding client hosts, each at its full share")
    parser.add_argument("--flood_streams", type=int, default=0,
                        help="concurrent streams per flooding host (0: enough to hold its share "
                             "and be refused: slots // 2 + 16)")
    parser.add_argument("--flood_seconds", type=float, default=20.0,
                        help="at least this long under flood")
    parser.add_argument("--push_every", type=float, default=2.0,
                        help="seconds between weight pushes during the flood")
    parser.add_argument("--mixed_requests", type=int, default=256,
                        help="requests of the mixed case from one host (0: no mixed case)")
    parser.add_argument("--mixed_large", type=int, default=8,
                        help="of which at the limits (n=16, prompt 32, max_tokens 32)")
    parser.add_argument("--mixed_threads", type=int, default=64,
                        help="the mixed case's concurrent client threads")
    parser.add_argument("--mixed_tries", type=int, default=30,
                        help="tries per request of the mixed case before it fails")
    parser.add_argument("--gin_param", action="append", default=[],
                        help="gin binding for the served model (and the learner's copy)")
    parser.add_argument("--output_dir", default=None, help="server logs (default: a temp dir)")
    args = parser.parse_args(argv)

    out_dir = Path(args.output_dir or tempfile.mkdtemp(prefix="hcjax-serve-load-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.slots.split(",") if s]
    results = {}
    for slots in sizes:
        streams = args.flood_streams or slots // 2 + 16
        results[str(slots)] = run_size(
            slots, light_requests=args.light_requests, flood_streams=streams,
            flood_hosts=args.flood_hosts, flood_seconds=args.flood_seconds,
            push_every=args.push_every, gin_params=args.gin_param, out_dir=out_dir,
            log=lambda m: print(m, file=sys.stderr, flush=True))
    summary = {"bench": "serve_load", "cpu_count": os.cpu_count(), "sizes": results}
    if args.mixed_requests:
        summary["mixed"] = run_mixed(
            8, requests=args.mixed_requests, large=args.mixed_large,
            threads=args.mixed_threads, tries=args.mixed_tries, gin_params=args.gin_param,
            out_dir=out_dir, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)
