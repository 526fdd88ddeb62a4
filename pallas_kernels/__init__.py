"""Kernels for hcjax's hot spots, each with a plain-jnp reference and a dispatcher (`impl=`).

The Pallas kernels (flash, decode and paged decode attention, grouped matmul, the batch-invariant
matmul) and the XLA forms tuned for CPU (projections and SwiGLU with backwards by hand, blocked
self-attention, the tiled and capacity expert MLPs) live side by side; `_dispatch.AUTO` says
which one `impl="auto"` runs on each platform. Must not import hcjax: the kernels are usable and
testable on their own.
"""

from pallas_kernels._dispatch import backend
from pallas_kernels.decode_attention import decode_attention, decode_attention_reference
from pallas_kernels.expert_mlp import expert_mlp, expert_mlp_reference
from pallas_kernels.flash_attention import flash_attention, flash_attention_reference
from pallas_kernels.gmm import gmm, gmm_reference, tgmm, tgmm_reference
from pallas_kernels.invariant_matmul import invariant_matmul, invariant_matmul_reference
from pallas_kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
)
from pallas_kernels.projection import project, project_reference
from pallas_kernels.self_attention import self_attention, self_attention_reference
from pallas_kernels.swiglu import swiglu, swiglu_reference

__all__ = [
    "backend",
    "decode_attention",
    "decode_attention_reference",
    "expert_mlp",
    "expert_mlp_reference",
    "flash_attention",
    "flash_attention_reference",
    "gmm",
    "invariant_matmul",
    "invariant_matmul_reference",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "gmm_reference",
    "project",
    "project_reference",
    "self_attention",
    "self_attention_reference",
    "swiglu",
    "swiglu_reference",
    "tgmm",
    "tgmm_reference",
]
