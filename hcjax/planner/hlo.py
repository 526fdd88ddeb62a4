"""Reading XLA's compiled HLO text: collectives, matmul FLOPs and HBM traffic per device per
step with while loops counted their trip count of times, the largest buffers, whole-weight
all-gathers and the Pallas kernels compiled in. It reads text only: it compiles nothing and
knows no model."""

from __future__ import annotations

import math
import re
from collections import defaultdict

import jax
import numpy as np

__all__ = ["collectives", "hlo_costs", "largest_buffers", "pallas_calls", "weight_all_gathers"]

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
