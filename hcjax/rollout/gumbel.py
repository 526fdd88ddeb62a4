"""Gumbel noise that belongs to an id, not to a position in an array: a counter-mode threefry hash
of (a row's key, a token or block id, a stream), so a draw over a few candidates, over a sorted
vocabulary and over the unsorted one all see the same numbers (sampling.py's top-p paths draw the
same token). Pure jnp functions of arrays; no sampling logic here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["BLOCK_STREAM", "TOKEN_STREAM", "bits_to_gumbel", "gumbel_at", "gumbel_range",
           "hash_pairs", "threefry2x32"]

# Noise streams: one Gumbel variable per (row key, token id) and an independent one per (row key,
# 16-id block), told apart by the hash's second counter word.
TOKEN_STREAM, BLOCK_STREAM = 0, 1


def gumbel_at(keypair_b2: jax.Array, ids: jax.Array, stream: int = TOKEN_STREAM) -> jax.Array:
    """f32 standard Gumbel noise of ids [B, ...] (token ids, or block ids with `BLOCK_STREAM`):
    a threefry hash of (row key, id, stream).

    Noise that belongs to an id rather than to a position in an array lets a draw over 32
    candidates, over a sorted vocabulary and over the unsorted one all see the same numbers,
    hence draw the same token (`sampling._draw_in_blocks`). One hash gives two words: ids 2i
    and 2i + 1 share one.
    """
    ids = ids.astype(jnp.uint32)
    y0, y1 = hash_pairs(keypair_b2, ids >> 1, stream)
    return bits_to_gumbel(jnp.where((ids & 1) == 1, y1, y0))


def gumbel_range(keypair_b2: jax.Array, n: int, stream: int) -> jax.Array:
    """f32[B, n]: `gumbel_at(keypair_b2, arange(n)[None], stream)` with one hash per pair of ids
    (`gumbel_at` hashes every element's pair, i.e. each pair twice)."""
    y0, y1 = hash_pairs(keypair_b2, jnp.arange((n + 1) // 2, dtype=jnp.uint32)[None, :], stream)
    bits = jnp.stack([y0, y1], axis=-1).reshape(keypair_b2.shape[0], -1)[:, :n]
    return bits_to_gumbel(bits)


def hash_pairs(keypair_b2, pairs, stream=TOKEN_STREAM):
    """threefry2x32((row key), (pairs, stream)) for pairs [B, ...]."""
    shape = (keypair_b2.shape[0],) + (1,) * (pairs.ndim - 1)
    k0, k1, x0 = jnp.broadcast_arrays(keypair_b2[:, 0].reshape(shape),
                                      keypair_b2[:, 1].reshape(shape), pairs)
    return threefry2x32(k0, k1, x0, jnp.full_like(x0, stream))


def threefry2x32(k0, k1, x0, x1):
    """Threefry-2x32 with 20 rounds (Salmon et al., SC'11), bit-identical to JAX's
    `threefry2x32_p` (tested), written as plain uint32 arithmetic so XLA fuses all 20 rounds into
    one loop. On CPU the primitive lowers to a rolled loop that writes both words to memory every
    four rounds: hashing a 152k vocabulary for 64 rows took 108 ms that way, 6.6 ms this way."""
    def rotate_left(x, r):
        return (x << jnp.uint32(r)) | (x >> jnp.uint32(32 - r))

    rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
    ks = (k0, k1, k0 ^ k1 ^ jnp.uint32(0x1BD11BDA))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in rotations[i % 2]:
            x0 = x0 + x1
            x1 = rotate_left(x1, r) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
    return x0, x1


def bits_to_gumbel(bits):
    """f32 standard Gumbel noise from uint32 bits."""
    # 23 random mantissa bits -> uniform in [0, 1), kept away from 0 so the log stays finite.
    u = jax.lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0
    u = jnp.maximum(u, jnp.finfo(jnp.float32).tiny)
    return -jnp.log(-jnp.log(u))
