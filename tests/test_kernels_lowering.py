"""The GPU (Triton) and TPU (Mosaic) programs lower from this CPU-only machine.

Cross-platform export runs Pallas's own lowering to Triton / Mosaic IR, which catches unsupported
operations, block shapes and index maps without an accelerator. It does not run the Triton or
Mosaic compilers, so it is no substitute for running on the hardware.
"""

import jax
import jax.numpy as jnp
import pytest
from jax import export

import pallas_kernels as pk

B, T, HQ, HKV, D = 1, 256, 8, 2, 128
Q = jax.ShapeDtypeStruct((B, T, HQ, D), jnp.bfloat16)
KV = jax.ShapeDtypeStruct((B, T, HKV, D), jnp.bfloat16)
SEG = jax.ShapeDtypeStruct((B, T), jnp.int32)
LHS = jax.ShapeDtypeStruct((500, 256), jnp.bfloat16)
RHS = jax.ShapeDtypeStruct((8, 256, 512), jnp.bfloat16)
SIZES = jax.ShapeDtypeStruct((8,), jnp.int32)


def _lower(fn, *args, platform):
    # Triton kernels travel as custom calls without a stability guarantee; that is fine here,
    # nothing is serialised for later.
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exported = export.export(jax.jit(fn), platforms=(platform,), disabled_checks=checks)(*args)
    return exported.mlir_module()


def _attention_grads(lowering):
    def loss(q, k, v, seg):
        out = pk.flash_attention(
            q, k, v, window=64, segment_ids=seg, impl="pallas", interpret=False, lowering=lowering
        )
        return out.astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2))


def _gmm_grads(lowering):
    def loss(lhs, rhs, sizes):
        out = pk.gmm(lhs, rhs, sizes, impl="pallas", interpret=False, lowering=lowering)
        return out.astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1))


@pytest.mark.parametrize("platform,lowering", [("cuda", "gpu"), ("tpu", "tpu")])
def test_attention_forward_and_backward_lower(platform, lowering):
    module = _lower(_attention_grads(lowering), Q, KV, KV, SEG, platform=platform)
    assert ("triton" if platform == "cuda" else "tpu_custom_call") in module


@pytest.mark.parametrize("platform,lowering", [("cuda", "gpu"), ("tpu", "tpu")])
def test_mla_attention_forward_and_backward_lower(platform, lowering):
    # DeepSeek-V3's head shapes: q/k 192 wide (128 no-RoPE + 64 RoPE), v 128, its own scale.
    q = jax.ShapeDtypeStruct((B, T, 4, 192), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((B, T, 4, 128), jnp.bfloat16)

    def loss(q, k, v, seg):
        out = pk.flash_attention(q, k, v, segment_ids=seg, scale=0.1, impl="pallas",
                                 interpret=False, lowering=lowering)
        return out.astype(jnp.float32).sum()

    module = _lower(jax.grad(loss, argnums=(0, 1, 2)), q, q, v, SEG, platform=platform)
    assert ("triton" if platform == "cuda" else "tpu_custom_call") in module


@pytest.mark.parametrize("platform,lowering", [("cuda", "gpu"), ("tpu", "tpu")])
def test_gmm_forward_and_backward_lower(platform, lowering):
    module = _lower(_gmm_grads(lowering), LHS, RHS, SIZES, platform=platform)
    assert ("triton" if platform == "cuda" else "tpu_custom_call") in module


@pytest.mark.parametrize("platform,lowering", [("cuda", "gpu"), ("tpu", "tpu")])
def test_decode_lowers(platform, lowering):
    q = jax.ShapeDtypeStruct((4, HQ, D), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((4, 1024, HKV, D), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((4,), jnp.int32)

    def decode(q, k, v, n):
        return pk.decode_attention(
            q, k, v, n, window=512, impl="pallas", interpret=False, lowering=lowering
        )

    module = _lower(decode, q, cache, cache, lengths, platform=platform)
    assert ("triton" if platform == "cuda" else "tpu_custom_call") in module


@pytest.mark.parametrize("platform,lowering", [("cuda", "gpu"), ("tpu", "tpu")])
def test_paged_decode_lowers(platform, lowering):
    q = jax.ShapeDtypeStruct((4, HQ, D), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((64, 32, HKV, D), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((4, 16), jnp.int32)
    lengths = jax.ShapeDtypeStruct((4,), jnp.int32)

    def decode(q, k, v, table, n):
        return pk.paged_decode_attention(q, k, v, table, n, impl="pallas", interpret=False,
                                         lowering=lowering)

    module = _lower(decode, q, pool, pool, table, lengths, platform=platform)
    assert ("triton" if platform == "cuda" else "tpu_custom_call") in module


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("platform,lowering", [("cuda", "gpu"), ("tpu", "tpu")])
def test_invariant_matmul_lowers(platform, lowering, dtype):
    x = jax.ShapeDtypeStruct((500, 512), dtype)  # 500 rows: padded to 4 row tiles of 128
    w = jax.ShapeDtypeStruct((512, 256), dtype)

    def matmul(x, w):
        return pk.invariant_matmul(x, w, impl="pallas", interpret=False, lowering=lowering)

    module = _lower(matmul, x, w, platform=platform)
    assert ("triton" if platform == "cuda" else "tpu_custom_call") in module
