"""`python -m hcjax.bench.sync`: delta against full weight pushes between two processes.

A weights-service process (an `hcjax.Weights` servicer, as `python -m hcjax.serve` mounts it,
in front of a stand-in server that only installs versions) and this process, the learner: a
~40M-parameter model (d_model 512, 8 layers, vocab 32000) with fp32 masters stepped by AdamW
(optax) on the next-token loss of a fixed batch, served in bf16. Per learning rate (default:
1e-6 and the tiny climb's 2e-4), each optimiser step is followed by a delta push, then the same
version pushed whole (a checked full push, on request) for comparison. Reports the fraction of
served elements each step changed, wire bytes and push seconds for both, the ratios, any
checksum fallbacks, whether the replica's final digests equal the learner's, the plain (device
path, unchecked) full push's seconds, and the size and speed of every delta encoding on one step's
change. Prints one JSON object as its last line; timings are not asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hcjax import config as hcfg
from hcjax.model import ModelConfig, Transformer
from hcjax.rpc.auth import Security
from hcjax.rpc.server import RpcServer
from hcjax.transfer import delta
from hcjax.transfer.weights_service import (
    WeightPublisher,
    WeightsServicer,
    param_digests,
    weights_status,
)

REPO = Path(__file__).resolve().parent.parent.parent


def _model_config(args):

    return ModelConfig(vocab_size=args.vocab, d_model=args.d_model, num_layers=args.layers,
                       num_heads=8, num_kv_heads=8, head_dim=args.d_model // 8,
                       d_ff=4 * args.d_model, max_seq_len=256)


def _served_template(cfg):
    """The served tree's layout: bf16 zeros on a one-device mesh."""


    mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(
        lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param))
    put = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda s: jax.device_put(jnp.zeros(s.shape, jnp.bfloat16), put),
                        shapes), put


def replica_main(args) -> None:
    """The weights-service process: prints its address, serves until stdin closes."""

    template, _ = _served_template(_model_config(args))

    class Installs:  # what a RolloutServer does with a version, minus generation
        version = -1

        def update_weights(self, tree, version, rollback=False):
            self.version = version

    server = RpcServer(Security())
    server.add_generic_rpc_handlers(
        (WeightsServicer(Installs(), template).handler(server.blocking_pool),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(json.dumps({"address": f"127.0.0.1:{port}"}), flush=True)
    sys.stdin.read()
    server.stop(None)


def _encodings(base: dict, new: dict) -> dict:
    """Every delta encoding over one step's change of the served tree (host arrays)."""


    pairs = list(zip(jax.tree.leaves(base), jax.tree.leaves(new), strict=True))
    raw = sum(n.nbytes for _, n in pairs)
    out = {}
    for name in delta.ENCODINGS:
        t0 = time.perf_counter()
        payloads = [delta.encode(b, n, name)[0] for b, n in pairs]
        t1 = time.perf_counter()
        for (b, n), p in zip(pairs, payloads, strict=True):
            assert np.array_equal(delta.decode(b, p).view(np.uint16), n.view(np.uint16))
        t2 = time.perf_counter()
        size = sum(len(p) for p in payloads)
        out[name] = {"bytes": size, "ratio_to_raw": round(raw / size, 2),
                     "encode_s": round(t1 - t0, 4), "decode_s": round(t2 - t1, 4)}
    return out


def _train_step(loss_fn, opt):

    @jax.jit
    def step(p, s):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    return step


def _getter(holder: dict):
    return lambda: holder["tree"]


def run(args) -> dict:


    cfg = _model_config(args)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               XLA_FLAGS=hcfg.cpu_xla_flags(1))
    cmd = [sys.executable, "-m", "hcjax.bench.sync", "--replica", "--d_model", str(args.d_model),
           "--layers", str(args.layers), "--vocab", str(args.vocab)]
    replica = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                               cwd=REPO, text=True)
    try:
        line = replica.stdout.readline()
        if not line:
            raise RuntimeError("the weights-service process exited before serving")
        address = json.loads(line)["address"]
        _, put = _served_template(cfg)
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        n_params = sum(x.size for x in jax.tree.leaves(params))
        tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq + 1), 0, cfg.vocab_size)

        def loss_fn(p):
            out = nnx.merge(graphdef, p, rest)(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(
                out.logits.astype(jnp.float32), tokens[:, 1:]).mean()

        def served(p):
            return jax.tree.map(lambda x: jax.device_put(x.astype(jnp.bfloat16), put),
                                nnx.to_pure_dict(p))

        result: dict = {"bench": "sync", "params": int(n_params), "settings": {}}
        for lr in args.lrs:
            opt = optax.adamw(lr)
            step = _train_step(loss_fn, opt)
            p, s = params, opt.init(params)
            current = {"tree": served(p)}
            publisher = WeightPublisher(_getter(current), [address], timeout=120,
                                        sync="delta", encoding=args.encoding)
            version = 1
            publisher(version)  # the first version: whole
            rows, step_s, losses = [], [], []
            for i in range(args.steps):
                t0 = time.perf_counter()
                p, s, loss = step(p, s)
                jax.block_until_ready(p)
                step_s.append(time.perf_counter() - t0)
                losses.append(float(loss))
                before = current["tree"]
                current["tree"] = served(p)
                if i == 0 and args.encodings:
                    encodings = _encodings(jax.device_get(before), jax.device_get(current["tree"]))
                version += 1
                publisher(version)
                d = publisher.history[-1]
                version += 1
                publisher.request_full()
                publisher(version)
                f = publisher.history[-1]
                rows.append({"changed_fraction": d["changed_fraction"],
                             "delta_wire_bytes": d["wire_bytes"], "delta_s": d["seconds"],
                             "full_wire_bytes": f["wire_bytes"], "full_s": f["seconds"],
                             "fallbacks": len(d["fallbacks"]) + len(f["fallbacks"]),
                             "delta_was_delta": d["deltas"] == 1})
            status = weights_status(address, digests=True)
            digests_match = status["digests"] == param_digests(current["tree"])
            publisher.close()
            def med(key, rows=rows):
                return statistics.median(r[key] for r in rows)

            result["settings"][f"{lr:g}"] = {
                "learning_rate": lr, "steps": args.steps, "loss_first_last": [losses[0], losses[-1]],
                "train_step_s_median": round(statistics.median(step_s[1:] or step_s), 4),
                "changed_fraction_per_push": [round(r["changed_fraction"], 6) for r in rows],
                "delta_wire_bytes_median": med("delta_wire_bytes"),
                "full_wire_bytes": med("full_wire_bytes"),
                "wire_ratio_full_over_delta": round(med("full_wire_bytes")
                                                    / med("delta_wire_bytes"), 2),
                "delta_push_s_median": round(med("delta_s"), 4),
                "full_push_s_median": round(med("full_s"), 4),
                "time_ratio_full_over_delta": round(med("full_s") / med("delta_s"), 2),
                "every_push_delta": all(r["delta_was_delta"] for r in rows),
                "checksum_fallbacks": sum(r["fallbacks"] for r in rows),
                "checked_pushes": 1 + 2 * len(rows),
                "final_digests_match": digests_match,
            }
            if args.encodings and "encodings" not in result:
                result["encodings"] = {"learning_rate": lr, **encodings}
        # The plain path (device to device, no checksums) for reference.
        plain = WeightPublisher(_getter(current), [address], timeout=120)
        times = []
        for _ in range(3):
            version += 1
            plain(version)
            times.append(plain.history[-1]["seconds"])
        plain.close()
        result["plain_full_push_s_median"] = round(statistics.median(times), 4)
        result["served_bytes"] = int(sum(x.nbytes for x in jax.tree.leaves(current["tree"])))
        return result
    finally:
        replica.stdin.close()
        replica.wait(30)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replica", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--d_model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 2e-4],
                        help="learning rates (2e-4: configs/climb_tiny.gin)")
    parser.add_argument("--encoding", default="sparse")
    parser.add_argument("--no_encodings", dest="encodings", action="store_false")
    args = parser.parse_args(argv)
    if args.replica:
        replica_main(args)
        return {}
    result = run(args)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)
