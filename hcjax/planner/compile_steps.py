"""The learner's train step and the rollout decode step compiled for a TPU topology on this host
(libtpu's compile-only devices), measured and estimated: `PlanConfig` says what to plan, `plan`
returns the record `python -m hcjax.plan` prints. It must not allocate anything: every input is
a `jax.ShapeDtypeStruct` carrying its sharding, so the ~1T-parameter flagship plans on a laptop.

What is measured is XLA's own: `compiled.memory_analysis()` (argument / output / temp bytes per
device), `compiled.cost_analysis()` (FLOPs and HBM bytes per device) and the compiled HLO text
(hcjax.planner.hlo). What is estimated is a roofline over those numbers (hcjax.planner.cost).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

import gin
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hcjax.display import Phases
from hcjax.hardware import chips_of
from hcjax.model import ModelConfig, Transformer, param_shardings
from hcjax.model.config import FULL_REMAT
from hcjax.planner import hlo
from hcjax.planner.cost import (
    DeviceSpec,
    account_flops,
    active_params,
    causal_mean_ctx,
    kv_fit,
    model_flops_split,
    roofline,
)
from hcjax.planner.tpu import tpu_devices
from hcjax.rl.batch import BATCH_AXES, LearnerBatch
from hcjax.rl.learner import LearnerConfig, LearnerState, make_learner_step
from hcjax.rollout.engine import Engine
from hcjax.sharding import SERVING_RULES, MeshConfig, make_mesh
from hcjax.train.step import make_optimizer
from hcjax.transfer import network

__all__ = ["PlanConfig", "decode_inputs", "inference_mesh_config", "mesh_over", "plan",
           "train_inputs"]


@gin.configurable
@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """What to plan. Defaults are the acceptance figures of issue S1 (1M-token batches of 8K rows;
    256 concurrent decodes at 32K of KV); the CLI flags override them.

    inference_mesh None = `inference_mesh_config` of the gin `MeshConfig` (its tensor and expert
    axes, no FSDP, data filling the inference chips).
    serve_dtype: the dtype the inference side holds its weights in (None = the learner's fp32
    masters, as the in-process engine does today).
    mean_len, page_size: the decode report's KV fit (`kv_fit`) for sequences of kv_len tokens
    at most and mean_len (capped at kv_len) on average, slot caches against pages of page_size.
    kv_layout: the decode step's engine layout; "paged" compiles it with a pool of pages for
    decode_batch sequences of mean_len plus a page each, and one kv_len sequence per batch shard
    (then the report has no `kv_fit`: the compiled step's memory is the paged figure).
    """

    topology: str = "v5p:2x2x1"
    inference_topology: str | None = None  # None = same as `topology`
    num_slices: int = 1  # learner slices joined over DCN (multi-slice)
    inference_num_slices: int = 1
    global_batch_tokens: int = 1 << 20
    seq_len: int = 8192
    decode_batch: int = 256
    kv_len: int = 32768
    inference_mesh: MeshConfig | None = None
    serve_dtype: str | None = "bfloat16"
    train: bool = True
    decode: bool = True
    top_buffers: int = 8
    mean_len: int = 4096
    page_size: int = 16
    kv_layout: str = "slot"

    def __post_init__(self) -> None:
        for name in ("global_batch_tokens", "seq_len", "decode_batch", "kv_len", "num_slices",
                     "inference_num_slices", "mean_len", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"PlanConfig.{name}={value!r} must be a positive integer")
        if self.kv_layout not in ("slot", "paged"):
            raise ValueError(f"PlanConfig.kv_layout={self.kv_layout!r} is not 'slot' or 'paged'")
        if self.global_batch_tokens % self.seq_len:
            raise ValueError(
                f"PlanConfig.global_batch_tokens={self.global_batch_tokens} is not a multiple of "
                f"seq_len={self.seq_len}"
            )


def mesh_over(cfg: MeshConfig, devices: list, what: str, num_slices: int = 1) -> Mesh:
    """The `what` (learner, inference) mesh of `cfg` over all of a topology's `devices`."""
    mesh = make_mesh(cfg, devices)
    if mesh.size != len(devices):
        raise ValueError(
            f"{what} mesh axes {dict(mesh.shape)} multiply to {mesh.size}, not the {len(devices)} "
            "devices of the topology"
        )
    # Devices are slice-major, so only the outermost axis (data) may cross the slices: over DCN
    # a step should only all-reduce gradients, never gather weights or exchange tokens.
    if num_slices > 1 and mesh.shape["data"] % num_slices:
        raise ValueError(
            f"{what} mesh: MeshConfig.data={mesh.shape['data']} is not a multiple of "
            f"num_slices={num_slices}; only the data axis may span the slices (DCN)"
        )
    return mesh


# Abstract inputs ---------------------------------------------------------------------------------


def _abstract(tree, shardings):
    """`tree` with every leaf a ShapeDtypeStruct carrying its sharding (`shardings` may hold one
    sharding where `tree` holds an nnx.Variable, as `param_shardings` returns)."""

    def one(x, s):
        if isinstance(s, nnx.Variable):
            s = s.get_value()
        if isinstance(x, nnx.Variable):
            v = x.get_value()
            return x.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    return jax.tree.map(one, tree, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _abstract_params(model_cfg: ModelConfig, mesh: Mesh, dtype=None, rules=None):
    """(graphdef, abstract nnx.Param state with shardings): nothing allocated."""
    model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    graphdef, params, _ = nnx.split(model, nnx.Param, ...)
    shardings = param_shardings(params, mesh, rules)
    if dtype is not None:
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), params)
    return graphdef, _abstract(params, shardings), model


def train_inputs(model_cfg: ModelConfig, learner_cfg: LearnerConfig, pc: PlanConfig,
                 mesh: Mesh) -> tuple:
    """(jitted learner step, its abstract (state, batch), abstract params) for `pc`'s batch."""
    graphdef, params, _ = _abstract_params(model_cfg, mesh)
    tx = make_optimizer(learner_cfg.optimizer())
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shardings = optax.tree_map_params(
        tx, lambda _, p: p.sharding, jax.eval_shape(tx.init, params), params,
        transform_non_params=lambda _: replicated)
    opt_state = _abstract(jax.eval_shape(tx.init, params), opt_shardings)
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=replicated)  # noqa: E731
    state = LearnerState(params=params, opt_state=opt_state, entropy={"k": scalar(jnp.float32)},
                         step=scalar(jnp.int32))

    m = learner_cfg.micro_batches
    rows = pc.global_batch_tokens // pc.seq_len
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    shards = math.prod(mesh.shape[a] for a in axes)
    if rows % (m * shards):
        raise ValueError(
            f"{rows} rows (global_batch_tokens={pc.global_batch_tokens} / seq_len={pc.seq_len}) "
            f"do not divide into micro_batches={m} x batch mesh axes {axes} of size {shards}"
        )
    shape = (m, rows // m, pc.seq_len)
    per_token = NamedSharding(mesh, PartitionSpec(None, axes, None))

    def tok(dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=per_token)

    routing = None
    if learner_cfg.replay_routing and model_cfg.num_moe_layers:
        routing = jax.ShapeDtypeStruct(
            (m, model_cfg.num_moe_layers, rows // m, pc.seq_len, model_cfg.experts_per_token),
            jnp.int32, sharding=NamedSharding(mesh, PartitionSpec(None, None, axes)))
    batch = LearnerBatch(
        tokens=tok(jnp.int32), positions=tok(jnp.int32), segment_ids=tok(jnp.int32),
        targets=tok(jnp.int32), loss_mask=tok(jnp.bool_), old_logp=tok(jnp.float32),
        advantages=tok(jnp.float32), n_kept=tok(jnp.int32), temperature=tok(jnp.float32),
        routing=routing, num_tokens=scalar(jnp.float32), num_sequences=scalar(jnp.float32),
    )
    step = make_learner_step(graphdef, learner_cfg, model_cfg)
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    fn = jax.jit(step, donate_argnums=0, out_shardings=(state_shardings, replicated))
    return fn, (state, batch), params


def decode_inputs(model_cfg: ModelConfig, pc: PlanConfig, mesh: Mesh) -> tuple:
    """(jitted engine decode step, its abstract (params, decode state, version), abstract params)
    for `pc`'s concurrent decodes, KV length and layout, weights in `pc.serve_dtype`."""
    dtype = None if pc.serve_dtype is None else jnp.dtype(pc.serve_dtype)
    _, params, model = _abstract_params(model_cfg, mesh, dtype, SERVING_RULES)
    kw = dict(mesh=mesh, max_concurrent_decodes=pc.decode_batch, max_target_length=pc.kv_len,
              max_prefill_length=max(1, pc.kv_len // 2), kv_layout=pc.kv_layout)
    engine = Engine(model, **kw)
    if pc.kv_layout == "paged":
        ways, mean = engine.page_stats()["batch_shards"], min(pc.mean_len, pc.kv_len)
        pages = -(-pc.decode_batch * (mean + pc.page_size) // pc.page_size)
        per_shard = -(-pages // ways) + -(-pc.kv_len // pc.page_size) + 1
        engine = Engine(model, page_size=pc.page_size, num_pages=ways * per_shard, **kw)
    state = jax.eval_shape(lambda: engine._init_decode_impl(model_cfg.vocab_size))
    shardings = engine.decode_state_shardings(model_cfg.vocab_size)
    state = _abstract(state, shardings)
    replicated = NamedSharding(mesh, PartitionSpec())
    version = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    # The engine's own step body, jitted with explicit shardings (Engine.generate's jit infers
    # them from concrete arrays, which we do not have).
    fn = jax.jit(engine._generate_impl, donate_argnums=(1,), out_shardings=(shardings, None))
    return fn, (params, state, version), params


def inference_mesh_config(learner: MeshConfig) -> MeshConfig:
    """The default inference layout: the learner's tensor and expert axes, no FSDP (a decode step
    must not all-gather weights), the rest of the chips over data (replicas of the weights)."""
    return MeshConfig(data=-1, fsdp=1, tensor=learner.tensor, expert=learner.expert)


# Compile and measure -----------------------------------------------------------------------------


def _tree_bytes(tree) -> int:
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def _compile(fn, args, mesh: Mesh, spec: DeviceSpec, top: int, weights=None) -> dict:
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        lowered = fn.lower(*args)
        try:
            # Without this libtpu refuses a program over HBM with only its temp total; with it
            # the compile finishes and the memory analysis shows by how much and where.
            compiled = lowered.compile(compiler_options={"xla_tpu_no_crash_on_oom": True})
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" in str(e):
                return _oom_record(str(e), args, spec, time.perf_counter() - t0)
            # Seen with the option on programs far over HBM ("Invalid TPU program"): compile
            # again without it, which fails with the out-of-memory message we can parse.
            try:
                compiled = lowered.compile()
            except jax.errors.JaxRuntimeError as e2:
                if "RESOURCE_EXHAUSTED" not in str(e2):
                    raise
                return _oom_record(str(e2), args, spec, time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    text = compiled.as_text()
    arguments = int(mem.argument_size_in_bytes)
    outputs = int(mem.output_size_in_bytes)
    temp = int(mem.temp_size_in_bytes)
    alias = int(mem.alias_size_in_bytes)
    # Donated inputs alias their outputs: count those bytes once.
    total = arguments + outputs - alias + temp
    colls = hlo.collectives(text)
    costs = hlo.hlo_costs(text)
    out = {
        "compiled": True,
        "fits": total <= spec.hbm_bytes,
        "bytes_per_chip": {"arguments": arguments, "outputs": outputs, "temp": temp,
                           "total": total, "aliased": alias},
        # Loop-aware counts from the HLO (see hlo_costs); XLA's own below for reference.
        "xla_flops_per_chip": costs["flops"] - costs["kernel_flops"],
        "kernel_declared_flops_per_chip": costs["kernel_flops"],
        "matmul_flops_by_op": costs["matmul_flops_by_op"],
        # HBM traffic, bracketed: at least every argument read, every output written and every
        # temporary byte written and read once; at most operands + results of every unfused op
        # (a Pallas kernel counted as reading its whole buffers) -- see `roofline`.
        "hbm_bytes_accessed_per_chip": arguments + outputs - alias + 2 * temp,
        "hbm_bytes_upper_bound_per_chip": costs["bytes"],
        "xla_cost_analysis": {"flops": float(cost.get("flops", 0.0)),
                              "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
                              "note": "visits each loop body once"},
        "collective_bytes_per_chip": float(sum(c["bytes"] for c in colls.values())),
        "collectives": colls,
        "pallas_kernels": hlo.pallas_calls(text),
        "compile_s": round(seconds, 2),
    }
    if weights is not None:
        out["weight_all_gathers"] = hlo.weight_all_gathers(text, weights)
    if not out["fits"]:
        out["bytes_over"] = total - int(spec.hbm_bytes)
        out["largest_buffers"] = hlo.largest_buffers(text, top)
    return out


_SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _xla_size(text: str) -> int:
    """XLA's "5.84T" / "95.74G" (binary units) in bytes."""
    m = re.fullmatch(r"([\d.]+)([KMGT]?)B?", text.strip())
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)]) if m else 0


def _oom_record(message: str, args, spec: DeviceSpec, seconds: float) -> dict:
    """What can be said when even `xla_tpu_no_crash_on_oom` cannot finish the compile: a single
    buffer larger than all of HBM, or the temp total only. Arguments are exact (the shards of
    the abstract inputs); outputs are not known; temp is XLA's figure when it gives one."""
    arguments = sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
                    for x in jax.tree.leaves(args))
    temp, buffers = 0, []
    if m := re.search(r"HLO temporaries \(([^)]+)\)", message):
        temp = _xla_size(m.group(1))
    if m := re.search(r"Allocation \(size=(\d+)\).*?\[shape: ([a-z0-9]+\[[^\]]*\]).*::\s*(\S+)",
                      message):
        buffers.append({"bytes": int(m.group(1)), "shape": m.group(2), "instruction": m.group(3),
                        "op_name": m.group(3)})
        temp = max(temp, int(m.group(1)))
    total = int(arguments) + temp
    return {
        "compiled": False, "fits": False,
        "bytes_per_chip": {"arguments": int(arguments), "outputs": 0, "temp": temp,
                           "total": total, "aliased": 0},
        "xla_flops_per_chip": 0.0, "kernel_declared_flops_per_chip": 0.0,
        "hbm_bytes_accessed_per_chip": 0.0, "hbm_bytes_upper_bound_per_chip": 0.0,
        "collective_bytes_per_chip": 0.0, "collectives": {},
        "compile_s": round(seconds, 2), "bytes_over": total - int(spec.hbm_bytes),
        "largest_buffers": buffers, "error": message.splitlines()[0][:500],
    }


# The plan ----------------------------------------------------------------------------------------


def plan(pc: PlanConfig, model_cfg: ModelConfig | None = None, learner_cfg=None,
         mesh_cfg: MeshConfig | None = None, phases: Phases | None = None) -> dict:
    """Compile the configured steps for `pc.topology` / `pc.inference_topology`; the JSON record.
    phases: where each compile shows as a phase (default: nowhere)."""
    phases = phases or Phases("hcjax.plan", mode="off")
    compiles = int(pc.train) + int(pc.decode)

    def compiling(what: str, topology: str, i: int) -> str:
        return f"compiling the {what} step for {topology}" + (
            f" ({i}/{compiles})" if compiles > 1 else "")

    model_cfg = model_cfg or ModelConfig()
    learner_cfg = learner_cfg or LearnerConfig()
    mesh_cfg = mesh_cfg or MeshConfig()
    with phases.phase(f"building the {pc.topology} topology (libtpu, compile-only)"):
        devices, spec, chips = tpu_devices(pc.topology, pc.num_slices)
    result: dict = {"topology": pc.topology, "num_slices": pc.num_slices, "chips": chips,
                    "devices": len(devices), "hbm_bytes_per_chip": spec.hbm_bytes}
    t0 = time.perf_counter()
    if pc.train:
        with phases.phase(compiling("train", pc.topology, 1)):
            mesh = mesh_over(mesh_cfg, devices, "learner", pc.num_slices)
            fn, args, params = train_inputs(model_cfg, learner_cfg, pc, mesh)
            step = {"mesh": dict(mesh.shape)}
            step.update(_compile(fn, args, mesh, spec, pc.top_buffers))
        n_active = active_params(model_cfg, params)
        # Training model FLOPs (forward + backward = 3x forward): 6·N_active·tokens plus causal
        # attention 3·2·H·ctx·(d_qk + d_v) per token per layer, ctx the mean keys per query.
        ctx_g, ctx_l = causal_mean_ctx(pc.seq_len, model_cfg.window)
        split = model_flops_split(model_cfg, params, pc.global_batch_tokens, ctx_g, ctx_l, True)
        # Full remat runs each layer's forward again in the backward: 4 passes instead of 3.
        remat = 4 / 3 if model_cfg.remat_policy in FULL_REMAT else 1.0
        account_flops(step, split, len(devices), remat)
        roofline(step, spec, len(devices), split["total"])
        step["active_params"] = n_active
        step["tokens"] = pc.global_batch_tokens
        result["train_step"] = step
    if pc.decode:
        inf_topology = pc.inference_topology or pc.topology
        with phases.phase(compiling("decode", inf_topology, compiles)):
            inf_devices, inf_spec, inf_chips = tpu_devices(inf_topology, pc.inference_num_slices)
            mesh = mesh_over(pc.inference_mesh or inference_mesh_config(mesh_cfg), inf_devices,
                             "inference", pc.inference_num_slices)
            fn, args, params = decode_inputs(model_cfg, pc, mesh)
            step = {"topology": inf_topology, "chips": inf_chips, "mesh": dict(mesh.shape)}
            step.update(_compile(fn, args, mesh, inf_spec, pc.top_buffers, weights=params))
        # Decode model FLOPs per step: 2·N_active per token plus attention over a full KV of
        # kv_len keys (global layers) or `window` keys (local), for every concurrent sequence.
        split = model_flops_split(model_cfg, params, pc.decode_batch, pc.kv_len,
                                  min(model_cfg.window, pc.kv_len), False)
        account_flops(step, split, len(inf_devices), 1.0)
        roofline(step, inf_spec, len(inf_devices), split["total"])
        step["tokens_per_s_estimate"] = (
            pc.decode_batch / step["estimated_step_s"] if step["estimated_step_s"] else 0.0)
        if pc.kv_layout == "slot":
            step["kv_fit"] = kv_fit(args[1], params, inf_spec.hbm_bytes, pc.kv_len,
                                    min(pc.mean_len, pc.kv_len), pc.page_size)
        result["decode_step"] = step
        # Weight transfer learner -> inference: every parameter once, in the serving dtype; each
        # inference device receives its shard at its full ICI bandwidth (a lower bound; across
        # slices over DCN it is slower).
        nbytes = _tree_bytes(params)
        result["transfer"] = {"bytes": nbytes, "estimated_s":
                              nbytes / len(inf_devices) / inf_spec.ici_bytes_per_s}
    result["compile_seconds"] = round(time.perf_counter() - t0, 2)
    result["weight_sync"] = _weight_sync(pc, model_cfg, mesh_cfg, result)
    return result


def _weight_sync(pc: PlanConfig, model_cfg: ModelConfig, mesh_cfg: MeshConfig, result) -> dict:
    """Full and delta weight-push estimates over the path between the meshes (ICI, DCN or GPU
    fabric; hcjax.transfer.network), from the parameter shapes alone: no compile."""
    dtype = jnp.dtype(pc.serve_dtype or jnp.float32)
    if "transfer" in result:
        nbytes = result["transfer"]["bytes"]
    else:
        model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
        nbytes = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))
                     ) * dtype.itemsize
    inf_topology = pc.inference_topology or pc.topology
    inf_mesh = pc.inference_mesh or inference_mesh_config(mesh_cfg)
    _, inf_chips = chips_of(inf_topology, pc.inference_num_slices)
    replicas = (inf_mesh.data if inf_mesh.data > 0 else
                max(1, inf_chips // max(1, inf_mesh.fsdp * inf_mesh.tensor * inf_mesh.expert)))
    try:
        return network.sync_estimate(
            nbytes, pc.topology, pc.inference_topology, inference_replicas=replicas,
            learner_slices=pc.num_slices, inference_slices=pc.inference_num_slices,
            value_bytes=dtype.itemsize)
    except ValueError as err:  # a link without a figure: the rest of the plan stands
        return {"error": str(err), "bytes": nbytes}
