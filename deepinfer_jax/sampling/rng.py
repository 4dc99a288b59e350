"""Position-keyed random numbers and the exact fixed-point categorical draw (spec/engine.md §9.3, §9.4).

Every random number the sampler uses is a pure function of the request's 64-bit ``seq_seed`` and the position of
the token being sampled. Nothing else enters: not the row the request occupies, not the batch size, not a global
RNG state advanced by earlier steps. That is what makes a seeded request reproducible on a re-run and identical
alone or in any batch, and what lets a preempted request that is recomputed draw the very same tokens again.

Seeds are carried as two uint32 words (``[lo, hi]``) because JAX without ``jax_enable_x64`` has no 64-bit
integers: a uint64 array would silently become uint32 and drop the high half of the seed. Threefry-2x32 takes
exactly such a pair as its key, and the position is folded into it; ``stream`` separates independent uses of the
same (seed, position) — ordinary sampling is stream 0, and speculative acceptance tests will take their own.

The categorical draw follows the reference kernel's semantics: probabilities become unsigned fixed-point weights
with 31 fractional bits, ``w = floor(p · 2^31)``, and a token is the one whose integer CDF interval contains a
uniform integer in ``[0, Σw)``. Integer prefix sums are exact, so the CDF does not depend on the summation order
(the draw is batch-invariant by construction once the probabilities are), and a token whose weight floors to zero
can never be drawn.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.sampling.tensors import split_seed

__all__ = [
    "FIXED_POINT_BITS",
    "SAMPLE_STREAM",
    "categorical_from_weights",
    "fixed_point_weights",
    "mulhi_u32",
    "random_bits",
    "split_seed",
]

FIXED_POINT_BITS = 31
"""Fractional bits of the fixed-point probability weights (a probability of 1 is ``2**31``)."""

SAMPLE_STREAM = 0
"""Stream id of ordinary token sampling; other uses of the same (seed, position) take other ids."""


def random_bits(seed_words: jax.Array, position: jax.Array, stream: int = SAMPLE_STREAM) -> jax.Array:
    """One uniform uint32 per row, a pure function of (seed, position, stream).

    Args:
      seed_words: uint32 ``[..., 2]``, the ``(lo, hi)`` words of each row's 64-bit seed.
      position: int32 ``[...]``, the 0-based position of the token being sampled (>= 0).
      stream: a static non-negative int separating independent draws at the same position.

    Returns:
      uint32 ``[...]``.
    """
    seed_words = jnp.asarray(seed_words, jnp.uint32)
    position = jnp.asarray(position, jnp.int32)
    if seed_words.shape[-1:] != (2,) or seed_words.shape[:-1] != position.shape:
        raise ValueError(
            f"random_bits: seed_words must have shape position.shape + (2,) = {(*position.shape, 2)}, "
            f"got {seed_words.shape}"
        )
    if isinstance(stream, bool) or not isinstance(stream, int) or stream < 0:
        raise ValueError(f"random_bits: stream must be a non-negative int, got {stream!r}")

    def one(words: jax.Array, pos: jax.Array) -> jax.Array:
        key = jax.random.wrap_key_data(words, impl="threefry2x32")
        key = jax.random.fold_in(jax.random.fold_in(key, pos.astype(jnp.uint32)), stream)
        return jax.random.bits(key, (), jnp.uint32)

    flat_words = seed_words.reshape(-1, 2)
    flat_pos = position.reshape(-1)
    return jax.vmap(one)(flat_words, flat_pos).reshape(position.shape)


def fixed_point_weights(probs: jax.Array) -> jax.Array:
    """``floor(p · 2^31)`` as uint32 for probabilities in ``[0, 1]`` (scaling by a power of two is exact)."""
    scaled = jnp.floor(jnp.clip(probs.astype(jnp.float32), 0.0, 1.0) * jnp.float32(2.0**FIXED_POINT_BITS))
    return scaled.astype(jnp.uint32)


def mulhi_u32(a: jax.Array, b: jax.Array) -> jax.Array:
    """The high 32 bits of the 64-bit product of two uint32 arrays, exactly, in 16-bit limbs.

    ``mulhi_u32(r, n)`` for a uniform 32-bit ``r`` is a uniform integer in ``[0, n)`` up to a probability error
    of at most ``2**-32`` per outcome interval (Lemire's multiply-shift), without 64-bit integers and without a
    data-dependent rejection loop.
    """
    a = a.astype(jnp.uint32)
    b = b.astype(jnp.uint32)
    mask = jnp.uint32(0xFFFF)
    a_hi, a_lo = a >> 16, a & mask
    b_hi, b_lo = b >> 16, b & mask
    lo_lo = a_lo * b_lo
    hi_lo = a_hi * b_lo
    lo_hi = a_lo * b_hi
    hi_hi = a_hi * b_hi
    # Each partial product is < 2**32; the middle column sums three 16-bit quantities, so no overflow anywhere.
    middle = (lo_lo >> 16) + (hi_lo & mask) + (lo_hi & mask)
    return hi_hi + (hi_lo >> 16) + (lo_hi >> 16) + (middle >> 16)


def categorical_from_weights(weights: jax.Array, bits: jax.Array) -> jax.Array:
    """Inverse-CDF draw over integer weights along the last axis.

    Args:
      weights: uint32 ``[..., V]`` with a positive sum below ``2**32``.
      bits: uint32 ``[...]`` uniform random words.

    Returns:
      int32 ``[...]``: the first index whose inclusive prefix sum exceeds ``mulhi(bits, Σw)``. Indices of zero
      weight are never returned: their prefix sum equals their predecessor's.
    """
    cdf = jnp.cumsum(weights.astype(jnp.uint32), axis=-1, dtype=jnp.uint32)
    target = mulhi_u32(bits, cdf[..., -1])
    index = jnp.sum(cdf <= target[..., None], axis=-1, dtype=jnp.int32)
    # Only an all-zero row (which the sampler reports as an error row) can count past the end; keep it in range.
    return jnp.minimum(index, weights.shape[-1] - 1)
