"""Pallas kernels for hcjax's hot spots, each with a plain-jnp reference and one dispatcher.

Must not import hcjax: the kernels are usable and testable on their own.
"""

from pallas_kernels.decode_attention import decode_attention, decode_attention_reference
from pallas_kernels.flash_attention import flash_attention, flash_attention_reference
from pallas_kernels.gmm import gmm, gmm_reference, tgmm, tgmm_reference

__all__ = [
    "decode_attention",
    "decode_attention_reference",
    "flash_attention",
    "flash_attention_reference",
    "gmm",
    "gmm_reference",
    "tgmm",
    "tgmm_reference",
]
