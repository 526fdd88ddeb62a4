"""`python -m hcjax.plan`: compile the learner train step and the rollout decode step for a real TPU
topology on this CPU host (libtpu's compile-only devices) and report per-chip memory, FLOPs,
collectives and roofline estimates. It must not allocate anything: every input is a
`jax.ShapeDtypeStruct` carrying its sharding, so the ~1T-parameter flagship plans on a laptop.

What is measured is XLA's own: `compiled.memory_analysis()` (argument / output / temp bytes per
device), `compiled.cost_analysis()` (FLOPs and HBM bytes per device) and the collectives in
`compiled.as_text()`. What is estimated is a roofline over those numbers (see `roofline`).
"""

from __future__ import annotations

if __name__ == "__main__":
    # Run the importable module, so gin registers PlanConfig once, under hcjax.plan (not also
    # under __main__, which would make `--gin_param PlanConfig...` ambiguous).

    from hcjax.config import run_main
    from hcjax.plan import main as _main

    run_main(_main)
    raise SystemExit(0)

import argparse
import dataclasses
import json
import math
import os
import re
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hcjax import config as hcfg
from hcjax.display import Phases
from hcjax.model import ModelConfig, Transformer, param_shardings
from hcjax.model.config import FULL_REMAT
from hcjax.rl.batch import BATCH_AXES, LearnerBatch
from hcjax.rl.learner import LearnerConfig, LearnerState, make_learner_step
from hcjax.rollout.engine import Engine
from hcjax.sharding import SERVING_RULES, MeshConfig, make_mesh
from hcjax.train.step import make_optimizer
from hcjax.transfer import network

__all__ = ["CHIP_SPECS", "ChipSpec", "PlanConfig", "collectives", "kv_fit", "plan", "tpu_devices"]


# Chip specs --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """Per-chip peak numbers used by the roofline (bytes and bytes/s, not bits)."""

    peak_bf16_flops: float
    hbm_bytes: float
    hbm_bytes_per_s: float
    ici_bytes_per_s: float  # all ICI links of one chip together


# Sources: Google Cloud TPU system-architecture pages (cloud.google.com/tpu/docs/v5p, /v5e, /v6e,
# /v4), "chip specifications" tables: peak bf16 compute, HBM capacity, HBM bandwidth and
# "Interchip Interconnect BW" per chip (given in Gbps; divided by 8 here).
#   v5p: 459 TFLOP/s, 95 GB, 2765 GB/s, 4800 Gbps ICI.
#   v5e: 197 TFLOP/s, 16 GB, 819 GB/s, 1600 Gbps ICI.
#   v6e: 918 TFLOP/s, 32 GB, 1640 GB/s, 3584 Gbps ICI.
#   v4: 275 TFLOP/s, 32 GiB, 1200 GB/s; the v4 page gives no per-chip ICI figure: 6 links x
#       50 GB/s = 300 GB/s from the TPU v4 paper (Jouppi et al., ISCA 2023) -- the least sure entry.
# HBM capacity is what XLA lets a program use (its out-of-memory messages print it: 95.74 GiB of
# v5p's 96 GiB, 15.75 GiB of v5e's 16 GiB, 31.25 GiB of v6e's 32 GiB; v4 taken as 32 GiB less the
# same 0.25 GiB reserve), so "fits" agrees with the compiler.
CHIP_SPECS: dict[str, ChipSpec] = {
    "v4": ChipSpec(275e12, 31.75 * 2**30, 1200e9, 300e9),
    "v5e": ChipSpec(197e12, 15.75 * 2**30, 819e9, 1600e9 / 8),
    "v5p": ChipSpec(459e12, 95.74 * 2**30, 2765e9, 4800e9 / 8),
    "v6e": ChipSpec(918e12, 31.25 * 2**30, 1640e9, 3584e9 / 8),
}
_TOPOLOGY_RE = re.compile(r"^(v4|v5e|v5p|v6e):(\d+(?:x\d+)*)$")


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


def tpu_devices(topology: str, num_slices: int = 1) -> tuple[list, ChipSpec, int]:
    """(compile-only devices, per-device spec, chips) for a name like "v5p:8x8x16", times
    `num_slices` slices joined over DCN (devices slice-major)."""
    m = _TOPOLOGY_RE.match(topology)
    if not m:
        raise ValueError(
            f"topology={topology!r} is not '<chip>:<AxBxC>' with chip one of {sorted(CHIP_SPECS)}"
        )
    # Compile-only devices touch no chip, so several processes (a plan beside the test suite) may
    # load libtpu at once; without this the second one fails on libtpu's lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
        devices = list(topologies.get_topology_desc(topology, platform="tpu", **kwargs).devices)
    except Exception as e:  # libtpu missing, or a shape it rejects
        raise ValueError(f"topology={topology!r}: libtpu could not build it ({e})") from e
    chips = math.prod(int(d) for d in m.group(2).split("x")) * num_slices
    spec = CHIP_SPECS[m.group(1)]
    per_chip = max(1, len(devices) // chips)  # v4 exposes each TensorCore as a device
    if per_chip > 1:
        spec = ChipSpec(*(v / per_chip for v in dataclasses.astuple(spec)))
    return devices, spec, chips


def _mesh(cfg: MeshConfig, devices: list, what: str, num_slices: int = 1) -> Mesh:
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


# HLO parsing: buffers and collectives ------------------------------------------------------------

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
                "s4": 0.5, "u4": 0.5}
_SHAPE_RE = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_INSTR_RE = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*)$")
_COMP_RE = re.compile(r"^(ENTRY )?%(\S+) .*\{\s*$")
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                "collective-permute")


def _type_bytes(text: str) -> list[float]:
    """Bytes of each array shape in an HLO type string (a tuple gives several)."""
    out = []
    for dtype, dims in _SHAPE_RE.findall(text):
        size = _DTYPE_BYTES.get(dtype) or (1 if dtype.startswith("f8") else None)
        if size is None:
            continue
        out.append(size * math.prod(int(d) for d in dims.split(",") if d))
    return out


def _split_type(rest: str) -> tuple[str, str]:
    """(result type, remainder starting at the opcode) of an instruction's right-hand side."""
    if rest.startswith("("):
        depth = 0
        for i, c in enumerate(rest):
            depth += c == "("
            depth -= c == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].lstrip()
    head, _, tail = rest.partition(" ")
    return head, tail


def _parse_hlo(text: str):
    """Instructions per computation: {comp: [(name, type, opcode, args, attrs)]}, entry name."""
    comps: dict[str, list] = defaultdict(list)
    entry, current = None, None
    for line in text.splitlines():
        cm = _COMP_RE.match(line)
        if cm and "=" not in line.split("(")[0]:
            current = cm.group(2)
            entry = current if cm.group(1) else entry
            continue
        im = _INSTR_RE.match(line)
        if not im or current is None:
            continue
        typ, rest = _split_type(im.group(2))
        opcode, _, rest = rest.partition("(")
        args, _, attrs = rest.partition(")")
        comps[current].append((im.group(1), typ, opcode.strip(), args, attrs))
    return comps, entry


def _trip_count(comps, attrs: str, operand: str = "", caller: str = "") -> int:
    """A while loop's trip count: XLA's `known_trip_count` when the backend records it (CPU
    does), else read from its condition `i < N` with N a constant (TPU's loops from scan and
    fori_loop), and from the body's `i + step` and the loop's initial i when those are constants:
    TPU's windowed einsums (a collective matmul over an FSDP axis, "windowed_dot_general") step
    by 2, taking a block from each neighbour per iteration, so N / step iterations, not N."""
    t = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
    if t:
        return int(t.group(1))
    cond = re.search(r"condition=%([\w.\-]+)", attrs)
    instrs = comps.get(cond.group(1), []) if cond else []
    by_name = {name: (op, args, a) for name, _, op, args, a in instrs}
    for _, _, op, args, cattrs in instrs:
        if op == "compare" and "direction=LT" in cattrs:
            operands = re.findall(r"%([\w.\-]+)", args)
            if len(operands) != 2 or not _constant(by_name, operands[1]).isdigit():
                continue
            bound = int(_constant(by_name, operands[1]))
            index = _tuple_index(by_name, operands[0])
            body = re.search(r"body=%([\w.\-]+)", attrs)
            step = _loop_step(comps.get(body.group(1), []) if body else [], index)
            start = _loop_start(comps.get(caller, []), operand, index)
            return max(0, -(-(bound - start) // step))
    return 1


def _constant(by_name: dict, name: str) -> str:
    """The literal of instruction `name` if it is a scalar constant (through copies), else ""."""
    for _ in range(4):
        op, args, _ = by_name.get(name, ("", "", ""))
        if op == "constant":
            return args.strip()
        if op not in ("copy", "bitcast", "convert"):
            return ""
        name = (re.findall(r"%([\w.\-]+)", args) or [""])[0]
    return ""


def _tuple_index(by_name: dict, name: str) -> int | None:
    """Which loop-state element `name` reads (a get-tuple-element of the parameter), if any."""
    for _ in range(4):
        op, args, attrs = by_name.get(name, ("", "", ""))
        if op == "get-tuple-element":
            m = re.search(r"index=(\d+)", attrs)
            return int(m.group(1)) if m else None
        if op not in ("copy", "bitcast", "convert"):
            return None
        name = (re.findall(r"%([\w.\-]+)", args) or [""])[0]
    return None


def _loop_step(body: list, index: int | None) -> int:
    """The constant the body adds to loop-state element `index` (1 when it cannot tell)."""
    if index is None or not body:
        return 1
    by_name = {name: (op, args, a) for name, _, op, args, a in body}
    root = body[-1]
    if root[2] != "tuple":
        return 1
    elements = re.findall(r"%([\w.\-]+)", root[3])
    if index >= len(elements):
        return 1
    op, args, _ = by_name.get(elements[index], ("", "", ""))
    if op != "add":
        return 1
    steps = [int(c) for c in (_constant(by_name, n) for n in re.findall(r"%([\w.\-]+)", args))
             if c.isdigit()]
    return steps[0] if len(steps) == 1 and steps[0] > 0 else 1


def _loop_start(caller: list, operand: str, index: int | None) -> int:
    """The initial value of loop-state element `index` when the loop's operand is a tuple whose
    element is a constant; 0 otherwise (scan and fori_loop count from 0)."""
    names = re.findall(r"%([\w.\-]+)", operand)
    if index is None or not names or not caller:
        return 0
    by_name = {name: (op, args, a) for name, _, op, args, a in caller}
    op, args, _ = by_name.get(names[0], ("", "", ""))
    elements = re.findall(r"%([\w.\-]+)", args) if op == "tuple" else []
    value = _constant(by_name, elements[index]) if index < len(elements) else ""
    return int(value) if value.isdigit() else 0


def _multipliers(comps, entry) -> dict[str, int]:
    """How often each computation runs per step: while bodies times their trip count."""
    mult = {entry: 1}
    stack = [entry]
    while stack:
        comp = stack.pop()
        for _, _, opcode, args, attrs in comps.get(comp, ()):
            trip = _trip_count(comps, attrs, args, comp) if opcode == "while" else 1
            for key, callee in re.findall(r"\b(body|calls|to_apply|branch_computations)=\{?%([\w.\-]+)",
                                          attrs):
                n = mult[comp] * (trip if key == "body" else 1)
                if mult.get(callee, 0) < n:
                    mult[callee] = n
                    stack.append(callee)
    return mult


def collectives(hlo_text: str) -> dict[str, dict[str, float]]:
    """{kind: {"count", "bytes"}} per device per step from compiled HLO text.

    Bytes of one collective = the larger of its operands and its result (an all-gather's output,
    a reduce-scatter's input), i.e. the data one device holds before or after; a ring algorithm
    moves about that much (all-reduce about twice). A ragged all-to-all counts the smaller of its
    input and its result (an upper bound on the rows it sends). Ops inside while loops count
    trip-count times.
    """
    comps, entry = _parse_hlo(hlo_text)
    mult = _multipliers(comps, entry)
    sizes = {name: max(_type_bytes(typ), default=0)
             for instrs in comps.values() for name, typ, *_ in instrs}
    out: dict[str, dict[str, float]] = {}
    for comp, instrs in comps.items():
        n = mult.get(comp, 1)
        for _, typ, opcode, args, _ in instrs:
            kind = opcode.removesuffix("-start")
            if kind not in _COLLECTIVES:
                continue
            names = re.findall(r"%([\w.\-]+)", args)
            result = max(_type_bytes(typ), default=0)
            if kind == "ragged-all-to-all":
                # Sends only the rows its sizes say, at most its input and what the result can
                # take; both buffers are sized for the dropless worst case on one side only.
                nbytes = min(sizes.get(names[0], 0), result) if names else result
            else:
                nbytes = max(result, sum(sizes.get(a, 0) for a in names))
            entry_ = out.setdefault(kind, {"count": 0, "bytes": 0.0})
            entry_["count"] += n
            entry_["bytes"] += n * nbytes
    return out


_NO_TRAFFIC = ("parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "call",
               "conditional", "after-all", "opt-barrier", "partition-id", "replica-id")


def _dims(typ: str) -> list[int]:
    m = _SHAPE_RE.search(typ)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _window_attrs(attrs: str) -> dict:
    """A convolution's window padding [(lo, hi)] and strides per spatial dim."""
    m = re.search(r"window=\{([^}]*)\}", attrs)
    text = m.group(1) if m else ""
    pad = re.search(r"pad=([\d_x\-]+)", text)
    stride = re.search(r"stride=([\dx]+)", text)
    return {"pad": [tuple(int(v) for v in p.split("_")) for p in pad.group(1).split("x")]
            if pad else [],
            "stride": [int(v) for v in stride.group(1).split("x")] if stride else []}


def _dot_flops(typ, opcode, args, attrs, shapes) -> float:
    """2 · output elements · contraction size of a dot or of a convolution (TPU's form of dots)."""
    names = re.findall(r"%([\w.\-]+)", args)
    if len(names) < 2:
        return 0.0
    lhs, rhs, out = shapes.get(names[0], []), shapes.get(names[1], []), _dims(typ)
    if opcode == "dot":
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attrs)
        dims = [int(d) for d in m.group(1).split(",") if d] if m else []
        contraction = math.prod(lhs[d] for d in dims if d < len(lhs))
    else:
        m = re.search(r"dim_labels=([^_]+)_([^-]+)->(\S+?)[,\s]", attrs + " ")
        if not m or len(m.group(2)) != len(rhs) or len(m.group(1)) != len(lhs):
            return 0.0
        lhs_l, rhs_l, out_l = m.group(1), m.group(2), m.group(3)
        contraction = math.prod(n for n, c in zip(rhs, rhs_l) if c == "i")
        groups = re.search(r"feature_group_count=(\d+)", attrs)
        contraction //= int(groups.group(1)) if groups else 1
        # Spatial (window) dims: the TPU compiler writes batched dots as convolutions whose
        # window runs over a batch dim with padding (one real tap per output), and weight
        # gradients as windows spanning the contracted length: count the taps that land inside
        # the input, summed over output positions.
        window = _window_attrs(attrs)
        spatial = 1.0
        for k, c in enumerate(sorted(ch for ch in rhs_l if ch.isdigit())):
            w = rhs[rhs_l.index(c)]
            s_in, s_out = lhs[lhs_l.index(c)], out[out_l.index(c)]
            lo = window["pad"][k][0] if k < len(window["pad"]) else 0
            stride = window["stride"][k] if k < len(window["stride"]) else 1
            start = np.arange(s_out) * stride - lo  # input position of tap 0 per output
            taps = np.minimum(w, s_in - start) - np.maximum(0, -start)
            spatial *= float(np.clip(taps, 0, None).sum()) / s_out
        return 2.0 * math.prod(out) * contraction * spatial
    return 2.0 * math.prod(out) * contraction


def _fusion_access(instrs, sizes) -> tuple[dict[int, float], float | None]:
    """What a fusion really moves: ({operand index: bytes read} for operands only sliced inside
    (a layer's slice of stacked weights), bytes written if it updates a buffer in place)."""
    params = {}
    for name, _, opcode, args, _ in instrs:
        if opcode == "parameter":
            params[name] = int(args.strip() or 0)
    users: dict[str, list] = defaultdict(list)
    for _, typ, opcode, args, _ in instrs:
        for i, a in enumerate(re.findall(r"%([\w.\-]+)", args)):
            users[a].append((opcode, i, sum(_type_bytes(typ)), args))
    reads = {}
    for name, index in params.items():
        uses = users.get(name, [])
        if uses and all(op in ("dynamic-slice", "gather") and i == 0 for op, i, _, _ in uses):
            reads[index] = float(sum(b for _, _, b, _ in uses))
        elif uses and all(op == "dynamic-update-slice" and i == 0 for op, i, _, _ in uses):
            reads[index] = 0.0  # the buffer updated in place is not read
    root = instrs[-1] if instrs else None
    written = None
    if root is not None and root[2] == "dynamic-update-slice":
        update = re.findall(r"%([\w.\-]+)", root[3])
        written = float(sizes.get(update[1], 0)) if len(update) > 1 else None
    return reads, written


def hlo_costs(hlo_text: str) -> dict[str, float]:
    """FLOPs and HBM bytes per device per step, counting loop bodies their trip count of times
    (XLA's `cost_analysis` visits a while body once, so a scan over layers or micro-batches is
    undercounted by its length). FLOPs: dots and convolutions (TPU lowers dots to both) plus the
    cost estimates Pallas kernels declare; other ops' FLOPs are ignored (elementwise work is small
    beside the matmuls). Bytes: operands plus result of every unfused instruction, the traffic
    of a fusion to and from HBM."""
    comps, entry = _parse_hlo(hlo_text)
    mult = _multipliers(comps, entry)
    shapes = {name: _dims(typ) for instrs in comps.values() for name, typ, *_ in instrs}
    sizes = {name: sum(_type_bytes(typ)) for instrs in comps.values() for name, typ, *_ in instrs}
    fused = {callee for instrs in comps.values() for _, _, op, _, attrs in instrs if op == "fusion"
             for callee in re.findall(r"calls=%([\w.\-]+)", attrs)}
    fusion_access = {comp: _fusion_access(comps[comp], sizes) for comp in fused}
    flops = kernel_flops = nbytes = 0.0
    by_op: dict[str, float] = defaultdict(float)
    for comp, instrs in comps.items():
        n = mult.get(comp, 0)
        for _, typ, opcode, args, attrs in instrs:
            if opcode in ("dot", "convolution"):
                f = n * _dot_flops(typ, opcode, args, attrs, shapes)
                flops += f
                op = re.search(r'op_name="([^"]*)"', attrs)
                by_op[_op_label(op.group(1) if op else opcode)] += f
            elif opcode == "custom-call":
                est = re.search(r'"cost_estimate":\{"flops":"(\d+)"', attrs)
                kernel_flops += n * (int(est.group(1)) if est else 0)
            if comp in fused or opcode in _NO_TRAFFIC:
                continue
            names = re.findall(r"%([\w.\-]+)", args)
            result = sum(_type_bytes(typ))
            if opcode in ("dynamic-slice", "gather"):  # reads only what it returns
                nbytes += n * 2 * result
            elif opcode in ("dynamic-update-slice", "scatter") and len(names) >= 2:
                nbytes += n * 2 * sizes.get(names[-1], 0)  # in place: the update in and out
            elif opcode == "fusion":
                callee = re.search(r"calls=%([\w.\-]+)", attrs)
                access = fusion_access.get(callee.group(1) if callee else "", ({}, None))
                reads = sum(access[0].get(i, sizes.get(a, 0)) for i, a in enumerate(names))
                nbytes += n * (reads + (result if access[1] is None else access[1]))
            else:
                nbytes += n * (result + sum(sizes.get(a, 0) for a in names))
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:12]
    return {"flops": flops + kernel_flops, "kernel_flops": kernel_flops, "bytes": nbytes,
            "matmul_flops_by_op": dict(top)}


def _op_label(op_name: str) -> str:
    """A jax op_name without loop/transform noise: where in the model a matmul comes from."""
    parts = [p for p in op_name.split("/") if p and not p.startswith(("jit(", "while", "body",
                                                                      "closed_call", "cond"))]
    return "/".join(parts[-3:])


def largest_buffers(hlo_text: str, top: int) -> list[dict]:
    """The largest arrays the program materialises (results of non-fused instructions), a proxy
    for the buffers behind the temp size: XLA's buffer assignment is not exposed as text."""
    comps, _ = _parse_hlo(hlo_text)
    fused = {callee for instrs in comps.values() for _, _, op, _, attrs in instrs if op == "fusion"
             for callee in re.findall(r"calls=%([\w.\-]+)", attrs)}
    found = []
    for comp, instrs in comps.items():
        if comp in fused:
            continue
        for name, typ, opcode, _, attrs in instrs:
            if opcode in ("parameter", "get-tuple-element", "tuple", "bitcast", "constant"):
                continue
            nbytes = sum(_type_bytes(typ))
            op = re.search(r'op_name="([^"]+)"', attrs)
            found.append({"bytes": int(nbytes), "shape": typ[:120], "instruction": name,
                          "op_name": op.group(1)[-120:] if op else opcode})
    found.sort(key=lambda b: -b["bytes"])
    return found[:top]


def weight_all_gathers(hlo_text: str, params) -> list[dict]:
    """All-gathers whose result is a whole parameter (or one layer of a stacked, scanned one):
    what a decode step must not do every step, since it moves every weight every token."""
    full = set()
    for x in jax.tree.leaves(params):
        full.add(tuple(x.shape))
        if len(x.shape) > 2:  # one layer of a [layers, ...] stack
            full.add(tuple(x.shape[1:]))
    comps, _ = _parse_hlo(hlo_text)
    found = []
    for instrs in comps.values():
        for name, typ, opcode, _, _ in instrs:
            if opcode.removesuffix("-start") != "all-gather":
                continue
            for dtype, dims in _SHAPE_RE.findall(typ):
                shape = tuple(int(d) for d in dims.split(",") if d)
                if len(shape) >= 2 and shape in full:
                    found.append({"instruction": name, "shape": f"{dtype}{list(shape)}"})
    return found


def pallas_calls(hlo_text: str) -> dict[str, int]:
    """Pallas kernels compiled into the program (Mosaic custom calls on TPU), by kernel name."""
    out: dict[str, int] = defaultdict(int)
    for line in hlo_text.splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        op = re.search(r'op_name="([^"]*)"', line)
        parts = (op.group(1) if op else "").split("/")
        if len(parts) >= 2 and parts[-1] == "pallas_call":
            name = re.sub(r"^jit\((.*)\)$", r"\1", parts[-2])
        else:  # kernels named by their own custom call (TPU flash attention is splash attention)
            im = _INSTR_RE.match(line)
            name = re.sub(r"\.\d+$", "", im.group(1)) if im else "unknown"
        out[name] += 1
    return dict(out)


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


def active_params(model_cfg: ModelConfig, params) -> float:
    """Parameters in matmuls per token: expert weights count k/E of their size; the embedding
    counts once when tied (it is the output head), not at all when untied (a lookup)."""
    frac = model_cfg.experts_per_token / model_cfg.num_experts
    total = 0.0
    for path, var in nnx.to_flat_state(params):
        if path[0] == "embed" and not model_cfg.tie_embeddings:
            continue
        axes = var.get_metadata().get("logical_axes") or ()
        n = math.prod(var.shape)
        total += n * frac if "experts" in axes else n
    return total


def attention_flops_per_token(model_cfg: ModelConfig, ctx_global: float, ctx_local: float) -> float:
    """Forward QKᵀ and AV FLOPs of one token summed over layers: 2·H·ctx·(d_qk + d_v) each."""
    if model_cfg.attention_type == "mla":
        d_qk, d_v = model_cfg.qk_nope_head_dim + model_cfg.qk_rope_head_dim, model_cfg.v_head_dim
    else:
        d_qk = d_v = model_cfg.head_dim
    total = 0.0
    for layer in range(model_cfg.num_layers):
        ctx = ctx_local if model_cfg.attention_kind(layer) == "local" else ctx_global
        total += 2 * model_cfg.num_heads * ctx * (d_qk + d_v)
    return total


def _causal_mean_ctx(seq: int, window: int) -> tuple[float, float]:
    """Mean keys attended per query in a full causal row: global, and local (sliding window)."""
    glob = (seq + 1) / 2
    loc = glob if seq <= window else window - window * (window - 1) / (2 * seq)
    return glob, loc


def _train_inputs(model_cfg, learner_cfg, pc: PlanConfig, mesh: Mesh):
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


def _decode_inputs(model_cfg, pc: PlanConfig, mesh: Mesh):
    dtype = None if pc.serve_dtype is None else jnp.dtype(pc.serve_dtype)
    _, params, model = _abstract_params(model_cfg, mesh, dtype, SERVING_RULES)
    kw = dict(mesh=mesh, max_concurrent_decodes=pc.decode_batch, max_target_length=pc.kv_len,
              max_prefill_length=max(1, pc.kv_len // 2), kv_layout=pc.kv_layout)
    engine = Engine(model, **kw)
    if pc.kv_layout == "paged":
        ways, mean = engine._pages.ways, min(pc.mean_len, pc.kv_len)
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


def _chip_bytes(x) -> int:
    """Bytes of one device's shard of an abstract array (the whole array without a sharding)."""
    sharding = getattr(x, "sharding", None)
    shape = x.shape if sharding is None else sharding.shard_shape(x.shape)
    return math.prod(shape) * jnp.dtype(x.dtype).itemsize


def kv_fit(state, params, hbm_bytes: float, max_len: int, mean_len: int,
           page_size: int) -> dict:
    """Sequences that fit in the decode mesh at most `max_len` and on average `mean_len` tokens
    each: slot caches (every global layer holds max_len positions a sequence) against the paged
    layout (`Engine(kv_layout="paged")`: pages for the tokens held, mean_len plus one page of
    slack a sequence, a page-table row per global layer, and one max_len sequence of pages per
    batch shard kept back, the engine's guarantee that some sequence can always finish).

    From the abstract, sharded decode state and weights the compiled step takes: a chip holds
    its shard of the weights and of its batch shard's sequences; what HBM leaves after the
    weights is divided by one sequence's bytes on that chip (global-layer cache entries, which
    grow with the length, plus the rest: local rings, logits, sampling state), times the batch
    shards. The step's temporaries are left out for both layouts alike.
    """
    weights = sum(_chip_bytes(x) for x in jax.tree.leaves(params))
    batch = state.active.shape[0]
    ways = batch // state.active.sharding.shard_shape(state.active.shape)[0]
    per_chip = batch // ways
    total = sum(_chip_bytes(x) for x in jax.tree.leaves(state))
    glob = pos = layers = 0
    for layer in state.cache:
        if layer["pos"].shape[-1] != max_len:  # a ring buffer of a local layer
            continue
        layers += math.prod(layer["pos"].shape[:-2])
        pos += _chip_bytes(layer["pos"])
        glob += sum(_chip_bytes(x) for name, x in layer.items() if name != "pos")
    rest = (total - glob - pos) / per_chip
    per_token = glob / per_chip / max_len
    max_pages = -(-max_len // page_size)
    slot_seq = (glob + pos) / per_chip + rest
    paged_seq = per_token * (mean_len + page_size) + layers * max_pages * 4 + rest
    free = hbm_bytes - weights
    reserve = per_token * max_len
    slot = ways * max(0, int(free // slot_seq))
    paged = ways * max(0, int((free - reserve) // paged_seq))
    return {
        "max_len": max_len, "mean_len": mean_len, "page_size": page_size,
        "batch_shards": ways, "weight_bytes_per_chip": weights, "free_bytes_per_chip": free,
        "global_kv_bytes_per_token_per_chip": per_token,
        "slot_bytes_per_sequence_per_chip": slot_seq,
        "paged_bytes_per_sequence_per_chip": paged_seq,
        "slot_sequences": slot, "paged_sequences": paged,
        "paged_over_slot": paged / slot if slot else float("inf"),
    }


def inference_mesh_config(learner: MeshConfig) -> MeshConfig:
    """The default inference layout: the learner's tensor and expert axes, no FSDP (a decode step
    must not all-gather weights), the rest of the chips over data (replicas of the weights)."""
    return MeshConfig(data=-1, fsdp=1, tensor=learner.tensor, expert=learner.expert)


# Compile and measure -----------------------------------------------------------------------------


def _tree_bytes(tree) -> int:
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def _compile(fn, args, mesh: Mesh, spec: ChipSpec, top: int, weights=None) -> dict:
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
    colls = collectives(text)
    costs = hlo_costs(text)
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
        "pallas_kernels": pallas_calls(text),
        "compile_s": round(seconds, 2),
    }
    if weights is not None:
        out["weight_all_gathers"] = weight_all_gathers(text, weights)
    if not out["fits"]:
        out["bytes_over"] = total - int(spec.hbm_bytes)
        out["largest_buffers"] = largest_buffers(text, top)
    return out


_SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _xla_size(text: str) -> int:
    """XLA's "5.84T" / "95.74G" (binary units) in bytes."""
    m = re.fullmatch(r"([\d.]+)([KMGT]?)B?", text.strip())
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)]) if m else 0


def _oom_record(message: str, args, spec: ChipSpec, seconds: float) -> dict:
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


def model_flops_split(model_cfg: ModelConfig, params, tokens: int, ctx_global: float,
                      ctx_local: float, train: bool) -> dict[str, float]:
    """Model FLOPs of a step by part: routed experts, attention scores (QKᵀ and AV) and the rest
    (projections, dense MLPs, router, head). Training counts forward + backward (3x forward)."""
    passes = 3 if train else 1
    frac = model_cfg.experts_per_token / model_cfg.num_experts
    expert_params = sum(math.prod(v.shape) * frac for _, v in nnx.to_flat_state(params)
                        if "experts" in (v.get_metadata().get("logical_axes") or ()))
    experts = passes * 2 * tokens * expert_params
    attention = passes * tokens * attention_flops_per_token(model_cfg, ctx_global, ctx_local)
    total = passes * 2 * tokens * active_params(model_cfg, params) + attention
    return {"total": total, "experts": experts, "attention": attention,
            "other": total - experts - attention}


def account_flops(step: dict, split: dict[str, float], devices: int, remat_factor: float) -> None:
    """Executed FLOPs per chip = the XLA-lowered matmuls (counted in the HLO) + the model FLOPs of
    the parts that run in Pallas kernels (their declared cost is the dropless worst case of the
    buffers they get, not the work done), times the recompute of rematerialisation.
    `flops_ratio` = XLA matmul FLOPs / (the model FLOPs of the parts XLA runs x remat_factor):
    1.0 is no waste beyond remat."""
    kernels = step.get("pallas_kernels", {})
    in_kernels = 0.0
    if any("gmm" in k for k in kernels):
        in_kernels += split["experts"]
    if any(s in k for k in kernels for s in ("splash", "flash", "decode_attention")):
        in_kernels += split["attention"]
    step["model_flops_split"] = split
    step["model_flops_in_kernels"] = in_kernels
    step["remat_factor"] = remat_factor
    step["flops_per_chip"] = step["xla_flops_per_chip"] + in_kernels * remat_factor / devices
    in_xla = (split["total"] - in_kernels) * remat_factor
    step["flops_ratio"] = step["xla_flops_per_chip"] * devices / in_xla if in_xla else 0.0


# Collectives that exchange a layer's activations (expert-parallel dispatch and combine, ring
# shifts): the layer's compute waits on them. The rest (weight all-gathers, gradient reductions)
# move data the compute does not need at once and XLA's scheduler can prefetch or defer.
_EXPOSED_COLLECTIVES = ("all-to-all", "ragged-all-to-all", "collective-permute")


def roofline(step: dict, spec: ChipSpec, devices: int, model_flops: float) -> None:
    """Two step times and the MFU of each (MFU = model FLOPs / (devices · peak · step time)).

    `bound_step_s` / `mfu_upper_bound`: max(compute, HBM, collectives), each at its peak and all
    perfectly overlapped -- a lower bound on the step, so an upper bound on MFU, not a forecast.
    compute = executed FLOPs (`account_flops`) / peak bf16; HBM = the compulsory traffic
    (arguments and outputs once, temporaries written and read once) / HBM bandwidth (the HLO's
    upper bound, `hlo_costs`: every unfused op's operands and results, is `hbm_upper_s`);
    collectives = collective bytes / ICI bandwidth of one chip (several slices: the data axis's
    all-reduce crosses DCN, which is slower).

    `estimated_step_s` / `estimated_mfu`: the same parts without assuming perfect overlap:
    compute + HBM + the exposed collectives (`_EXPOSED_COLLECTIVES`: activation exchanges the
    layer waits on) + whatever of the other collectives (weight gathers, gradient reductions,
    overlappable with compute) exceeds the compute time. Still optimistic about kernels (each at
    peak) and pessimistic about HBM (never hidden under compute)."""
    colls = step.get("collectives", {})
    exposed = sum(v["bytes"] for k, v in colls.items() if k in _EXPOSED_COLLECTIVES)
    parts = {
        "compute_s": step["flops_per_chip"] / spec.peak_bf16_flops,
        "hbm_s": step["hbm_bytes_accessed_per_chip"] / spec.hbm_bytes_per_s,
        "collective_s": step["collective_bytes_per_chip"] / spec.ici_bytes_per_s,
    }
    bound_s = max(parts.values())
    step.update(parts)
    step["hbm_upper_s"] = step.get("hbm_bytes_upper_bound_per_chip", 0.0) / spec.hbm_bytes_per_s
    step["bound_by"] = max(parts, key=parts.get).removesuffix("_s")
    step["model_flops"] = model_flops
    step["bound_step_s"] = bound_s
    step["mfu_upper_bound"] = model_flops / (devices * spec.peak_bf16_flops * bound_s) if bound_s else 0.0
    exposed_s = exposed / spec.ici_bytes_per_s
    overlappable_s = parts["collective_s"] - exposed_s
    step["exposed_collective_s"] = exposed_s + max(0.0, overlappable_s - parts["compute_s"])
    est = parts["compute_s"] + parts["hbm_s"] + step["exposed_collective_s"]
    step["estimated_step_s"] = est
    step["estimated_mfu"] = model_flops / (devices * spec.peak_bf16_flops * est) if est else 0.0


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
            mesh = _mesh(mesh_cfg, devices, "learner", pc.num_slices)
            fn, args, params = _train_inputs(model_cfg, learner_cfg, pc, mesh)
            step = {"mesh": dict(mesh.shape)}
            step.update(_compile(fn, args, mesh, spec, pc.top_buffers))
        n_active = active_params(model_cfg, params)
        # Training model FLOPs (forward + backward = 3x forward): 6·N_active·tokens plus causal
        # attention 3·2·H·ctx·(d_qk + d_v) per token per layer, ctx the mean keys per query.
        ctx_g, ctx_l = _causal_mean_ctx(pc.seq_len, model_cfg.window)
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
            mesh = _mesh(pc.inference_mesh or inference_mesh_config(mesh_cfg), inf_devices,
                         "inference", pc.inference_num_slices)
            fn, args, params = _decode_inputs(model_cfg, pc, mesh)
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
    _, inf_chips = network.chips_of(inf_topology, pc.inference_num_slices)
    replicas = (inf_mesh.data if inf_mesh.data > 0 else
                max(1, inf_chips // max(1, inf_mesh.fsdp * inf_mesh.tensor * inf_mesh.expert)))
    chip = inf_topology.split(":")[0]
    try:
        return network.sync_estimate(
            nbytes, pc.topology, pc.inference_topology, inference_replicas=replicas,
            ici_bytes_per_s=CHIP_SPECS[chip].ici_bytes_per_s if chip in CHIP_SPECS else None,
            learner_slices=pc.num_slices, inference_slices=pc.inference_num_slices,
            value_bytes=dtype.itemsize)
    except ValueError as err:  # a link without a figure: the rest of the plan stands
        return {"error": str(err), "bytes": nbytes}


# Report ------------------------------------------------------------------------------------------


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def summary_table(result: dict) -> str:
    slices = result.get("num_slices", 1)
    lines = [f"topology {result['topology']}" + (f" x {slices} slices (DCN)" if slices > 1 else "")
             + f": {result['chips']} chips, "
             f"{_gb(result['hbm_bytes_per_chip'])} HBM per chip"]
    for name in ("train_step", "decode_step"):
        step = result.get(name)
        if step is None:
            continue
        b = step["bytes_per_chip"]
        lines += [
            f"\n{name} (mesh {step['mesh']}, compiled in {step['compile_s']} s)",
            f"  per chip: arguments {_gb(b['arguments'])}, outputs {_gb(b['outputs'])}, "
            f"temp {_gb(b['temp'])}, total {_gb(b['total'])} -> "
            + ("fits" if step["fits"] else f"DOES NOT FIT, {_gb(step['bytes_over'])} over"),
            f"  FLOPs per chip {step['flops_per_chip']:.3e} (XLA matmuls "
            f"{step['xla_flops_per_chip']:.3e} + Pallas kernels' model FLOPs); model FLOPs "
            f"{step['model_flops']:.3e} over all chips; XLA/model {step['flops_ratio']:.2f} beyond "
            f"remat x{step['remat_factor']:.2f}; HBM bytes {_gb(step['hbm_bytes_accessed_per_chip'])}"
            f" (upper bound {_gb(step['hbm_bytes_upper_bound_per_chip'])})",
            f"  collectives per chip {_gb(step['collective_bytes_per_chip'])}: "
            + ", ".join(f"{k} x{v['count']} {_gb(v['bytes'])}" for k, v in step["collectives"].items()),
            f"  roofline: compute {step['compute_s']:.4f} s, HBM {step['hbm_s']:.4f} s, "
            f"collectives {step['collective_s']:.4f} s -> step >= {step['bound_step_s']:.4f} s "
            f"(HBM upper bound {step['hbm_upper_s']:.4f} s) "
            f"({step['bound_by']}-bound), mfu_upper_bound {step['mfu_upper_bound']:.1%} (all "
            "three perfectly overlapped)",
            f"  estimate: compute + HBM + exposed collectives {step['exposed_collective_s']:.4f} s "
            f"(activation exchanges, and weight/gradient collectives beyond the compute time) = "
            f"{step['estimated_step_s']:.4f} s, MFU {step['estimated_mfu']:.1%}",
        ]
        if step.get("pallas_kernels"):
            lines.append("  Pallas kernels (Mosaic): " + ", ".join(
                f"{k} x{v}" for k, v in sorted(step["pallas_kernels"].items())))
        if "weight_all_gathers" in step:
            lines.append(f"  whole-weight all-gathers per step: {len(step['weight_all_gathers'])}")
        if "tokens_per_s_estimate" in step:
            lines.append(f"  decode: {step['tokens_per_s_estimate']:,.0f} tokens/s")
        if fit := step.get("kv_fit"):
            lines.append(
                f"  sequences that fit at {fit['max_len']} tokens max, {fit['mean_len']} mean "
                f"(weights {_gb(fit['weight_bytes_per_chip'])} a chip): slot caches "
                f"{fit['slot_sequences']:,}, paged (pages of {fit['page_size']}) "
                f"{fit['paged_sequences']:,} ({fit['paged_over_slot']:.1f}x)")
        for buf in step.get("largest_buffers", []):
            lines.append(f"    {_gb(buf['bytes'])}  {buf['shape']}  {buf['op_name']}")
    if "transfer" in result:
        t = result["transfer"]
        lines.append(f"\ntransfer: {_gb(t['bytes'])} of weights, ~{t['estimated_s']:.3f} s")
    if "weight_sync" in result:
        lines += ["", *network.summary_lines(result["weight_sync"])]
    lines.append(f"compile seconds: {result['compile_seconds']}")
    return "\n".join(lines)


EXAMPLES = """examples:
  python -m hcjax.plan                                            # the tiny model, in seconds
  python -m hcjax.plan --gin_file scale/flagship_v5p.gin          # v5p:8x8x16 learner, v5p:4x4x8 rollout
  python -m hcjax.plan --gin_file scale/qwen3_30b_a3b_v5p.gin --output_dir runs/plan_qwen3
"""


def _extra_flags(parser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    parser.add_argument("--topology", default=None, help="learner TPU topology, e.g. v5p:8x8x16")
    parser.add_argument("--inference_topology", default=None, help="e.g. v5p:4x4x8")
    for name in ("global_batch_tokens", "seq_len", "decode_batch", "kv_len", "num_slices",
                 "inference_num_slices"):
        parser.add_argument(f"--{name}", type=int, default=None)


def main(argv: Sequence[str] | None = None) -> dict:
    flags = hcfg.parse_flags(argv, description=__doc__.split("\n")[0],
                             default_gin_files=["tiny_cpu.gin"], extra_args=_extra_flags)
    hcfg.bind(flags.gin_files, flags.gin_params)
    overrides = {k: getattr(flags.extra, k) for k in
                 ("topology", "inference_topology", "global_batch_tokens", "seq_len",
                  "decode_batch", "kv_len", "num_slices", "inference_num_slices")
                 if getattr(flags.extra, k) is not None}
    pc = dataclasses.replace(PlanConfig(), **overrides)
    if flags.output_dir:
        hcfg.write_config(flags.output_dir, flags)
    result = plan(pc, phases=Phases("hcjax.plan"))
    table = summary_table(result)
    print(table)
    if flags.output_dir:
        out = Path(flags.output_dir)
        hcfg.write_operative_config(out)
        (out / "summary.txt").write_text(table + "\n")
        (out / "plan.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return result

