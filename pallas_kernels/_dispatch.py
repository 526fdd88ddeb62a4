"""Shared choice of implementation, lowering and interpret mode for every operation in this package.

What `impl="auto"` runs, by the platform compiled for (`backend()`), is the table `AUTO` below,
one row per operation; each row's comment says why. In short: on CPU the XLA forms measured
fastest there (hand-written backwards, blocked attention, the capacity expert dispatch); on GPU
and TPU the Pallas kernels where this package has one, and otherwise the CPU choice, which was
not measured there. Kept free of any kernel logic so each kernel module reads as reference +
implementations + dispatcher.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

IMPLS = ("auto", "pallas", "reference")
LOWERINGS = ("gpu", "tpu")

# impl="auto" by operation and platform.
_PALLAS_OFF_CPU = {"cpu": "reference", "gpu": "pallas", "tpu": "pallas"}
AUTO: dict[str, dict[str, str]] = {
    # The Pallas kernels compile on GPU (Triton) and TPU (Mosaic); on CPU they could only be
    # interpreted, so the jnp reference runs there.
    "flash_attention": _PALLAS_OFF_CPU,
    "decode_attention": _PALLAS_OFF_CPU,
    "paged_decode_attention": _PALLAS_OFF_CPU,
    "gmm": _PALLAS_OFF_CPU,
    "tgmm": _PALLAS_OFF_CPU,
    # The projections' and dense SwiGLU's backward over tokens flattened to [N, .]: on XLA:CPU
    # autodiff of the batched einsums left transposed copies of the activation gradients
    # (projection.py, swiglu.py). GPU and TPU have no Pallas kernel for them and were not
    # measured with the reference; they keep the flat form, plain 2-d matmuls on any backend,
    # which is what `hcjax.bench.gpu` measured.
    "project": {"cpu": "flat", "gpu": "flat", "tpu": "flat"},
    "swiglu": {"cpu": "flat", "gpu": "flat", "tpu": "flat"},
    # Self-attention of packed rows (self_attention.py): the flash kernel on GPU/TPU (it skips
    # invisible key blocks on chip); on CPU the blocked XLA form, which skips them too, with a
    # hand-written backward (2-5x less work than the dense reference at the tiny config). With
    # attention sinks, which the flash kernel lacks, every platform runs the blocked form.
    "self_attention": {"cpu": "blocked", "gpu": "pallas", "tpu": "pallas"},
    # The routed experts' MLP (expert_mlp.py): the Pallas grouped matmul on GPU/TPU; on one CPU
    # device the capacity dispatch (batched matmuls over experts, the fastest there by
    # `python -m hcjax.bench.moe`), and under a multi-device mesh on CPU the blocked dispatch,
    # which XLA partitions (the capacity form's overflow loop is one device's).
    "expert_mlp": {"cpu": "capacity", "gpu": "pallas", "tpu": "pallas"},
    # Exact mode's projections (batch_invariant.py): on GPU/TPU the batch-invariant Pallas
    # matmul (invariant_matmul.py: fixed K chunks in order, whatever the rows); on CPU the same
    # [tile, K] x [K, N] XLA dot on every row tile, which XLA:CPU computes alike for every tile.
    "batch_invariant_project": {"cpu": "tiles", "gpu": "pallas", "tpu": "pallas"},
}


def backend() -> str:
    """The platform programs are being built for: "cpu", "gpu" or "tpu".

    That is the context mesh's platform when one is set with `jax.set_mesh` (a CPU host compiling
    for a TPU topology builds TPU programs), else the platform JAX runs on by default.
    """
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None) or jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform


def on_several_devices() -> bool:
    """Whether the context mesh spreads the program over several devices with Auto axes (axes
    XLA's partitioner splits), as opposed to no mesh, one device, or inside a `shard_map`."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.size > 1 and bool(mesh.auto_axes)


def choose(impl: str, kernel: str, impls: Sequence[str] = IMPLS) -> str:
    """`impl` checked against `impls`; "auto" becomes `AUTO[kernel]` for the platform built for."""
    if impl not in impls:
        raise ValueError(f"{kernel}: impl={impl!r} is not one of {tuple(impls)}")
    if impl != "auto":
        return impl
    table = AUTO[kernel]
    return table.get(backend(), table["cpu"])  # an unknown platform gets the portable XLA form


def resolve_impl(impl: str, kernel: str) -> str:
    """Maps `impl` to "pallas" or "reference": auto means Pallas on TPU/GPU, the reference on CPU."""
    return choose(impl, kernel, IMPLS)


def resolve_interpret(interpret: bool | None) -> bool:
    """interpret=None means interpret iff running on CPU (no Pallas backend to compile for)."""
    if interpret is None:
        return backend() not in LOWERINGS
    return bool(interpret)


def resolve_lowering(lowering: str | None, kernel: str) -> str:
    """Which Pallas program to build: the TPU one on TPU, otherwise the GPU (Triton) one.

    On CPU both can run in interpret mode; the GPU program is the default there because it is the
    kernel written in this package end to end.
    """
    if lowering is None:
        return "tpu" if backend() == "tpu" else "gpu"
    if lowering not in LOWERINGS:
        raise ValueError(f"{kernel}: lowering={lowering!r} is not one of {LOWERINGS}")
    return lowering


def next_power_of_2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


# Matmuls inside kernels, accumulating in fp32. Triton lowers them to tl.dot (each dimension
# >= 16); fp32 inputs run as TF32 there unless precision is HIGHEST (then IEEE fp32).
def dot_nt(a, b, precision=None):  # a [m, d] . b [n, d]^T -> [m, n]
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def dot_tn(a, b, precision=None):  # a [m, n]^T . b [m, d] -> [n, d]
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def dot_nn(a, b, precision=None):  # a [m, n] . b [n, d] -> [m, d]
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)
