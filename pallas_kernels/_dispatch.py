"""Shared choice of implementation, lowering and interpret mode for every kernel in this package.

Kept free of any kernel logic so each kernel module reads as reference + kernel + dispatcher.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("auto", "pallas", "reference")
LOWERINGS = ("gpu", "tpu")


def backend() -> str:
    """The platform programs are being built for: "cpu", "gpu" or "tpu".

    That is the context mesh's platform when one is set with `jax.set_mesh` (a CPU host compiling
    for a TPU topology builds TPU programs), else the platform JAX runs on by default.
    """
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None) or jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform


def resolve_impl(impl: str, kernel: str) -> str:
    """Maps `impl` to "pallas" or "reference": auto means Pallas on TPU/GPU, the reference on CPU."""
    if impl not in IMPLS:
        raise ValueError(f"{kernel}: impl={impl!r} is not one of {IMPLS}")
    if impl == "auto":
        return "pallas" if backend() in LOWERINGS else "reference"
    return impl


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
