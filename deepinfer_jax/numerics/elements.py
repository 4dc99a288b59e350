"""Element-level codes in ``jnp``: E4M3 and E2M1 encode/decode, UE8M0 decode, nibble packing.

Every function here works on arrays of any shape, is jit-able and is bit-exact on every platform:

* float32 subnormal inputs are flushed to signed zero explicitly (:func:`flush_subnormals`), because
  XLA:CPU flushes them inside arithmetic anyway and other platforms may not -- an explicit rule gives the
  same bytes everywhere (the host codecs apply the same rule);
* E2M1 rounding is written as comparisons against the exact midpoints instead of relying on a backend's
  float4 conversion, whose NaN and overflow handling differs between implementations;
* scale bytes are turned into float32 by building the bit pattern, never by ``exp2``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax.numerics.formats import (
    E2M1_VALUES,
    E4M3_MAX,
    F32_MIN_NORMAL,
    UE8M0_BIAS,
    UE8M0_NAN_CODE,
)

# Midpoints between consecutive E2M1 magnitudes, each with the rounding direction round-to-nearest-even
# gives to an exact tie: a tie goes to the neighbour whose 3-bit code is even.  ``>`` means the tie rounds
# down (the lower neighbour's code is even), ``>=`` that it rounds up (the upper neighbour's code is even).
_E2M1_ROUND_DOWN_AT = (0.25, 1.25, 2.5, 5.0)  # ties between codes 0|1, 2|3, 4|5, 6|7
_E2M1_ROUND_UP_AT = (0.75, 1.75, 3.5)  # ties between codes 1|2, 3|4, 5|6


def flush_subnormals(x: jax.Array) -> jax.Array:
    """Replace float32 subnormals by zero of the same sign (the denormals-are-zero rule of the codecs)."""
    x = jnp.asarray(x, jnp.float32)
    return jnp.where(jnp.abs(x) < F32_MIN_NORMAL, jnp.copysign(jnp.float32(0.0), x), x)


def exact_divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """Correctly rounded float32 ``a / b`` with broadcasting, on every backend.

    XLA's algebraic simplifier rewrites a division by a broadcast value (a constant such as 448, or a per-group
    scale broadcast over its group) into a multiplication by the rounded reciprocal, which is off by one ulp
    for about half of all inputs when ``b`` is not a power of two -- enough to move a code across a rounding
    midpoint or a scale across a power of two. Materialising the broadcast divisor behind an optimisation
    barrier keeps the IEEE division the codecs are specified with.
    """
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    a = jnp.broadcast_to(a, shape)
    b = lax.optimization_barrier(jnp.broadcast_to(b, shape))
    return a / b


def as_uint8(a: jax.Array, name: str = "codes") -> jax.Array:
    """View 8-bit code or scale storage (``uint8``, ``int8``, ``float8_e4m3fn``, ``float8_e8m0fnu``) as bytes.

    Checkpoints store the same bytes under several dtypes (§12.1.2: ``U8``, ``I8``); every decoder accepts
    all of them and reinterprets the bits without conversion.
    """
    a = jnp.asarray(a)
    if a.dtype == jnp.uint8:
        return a
    if a.dtype in (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e8m0fnu):
        return lax.bitcast_convert_type(a, jnp.uint8)
    raise TypeError(
        f"{name} must have an 8-bit storage dtype (uint8, int8, float8_e4m3fn or float8_e8m0fnu), "
        f"got {a.dtype}"
    )


def e4m3_encode(x: jax.Array) -> jax.Array:
    """Round float values to E4M3 codes (``uint8``): subnormal flush, clamp to ±448, then RNE.

    Clamping first is the spec's saturation rule (§12); without it the conversion would turn values
    from 464 up into NaN. NaN inputs give an E4M3 NaN code (callers that poison groups overwrite it).
    """
    q = jnp.clip(flush_subnormals(x), -E4M3_MAX, E4M3_MAX)
    return lax.bitcast_convert_type(q.astype(jnp.float8_e4m3fn), jnp.uint8)


def e4m3_decode(codes: jax.Array) -> jax.Array:
    """E4M3 codes (any 8-bit storage dtype) to float32 values; exact (every E4M3 value is a normal float32)."""
    codes = jnp.asarray(codes)
    if codes.dtype != jnp.float8_e4m3fn:
        codes = lax.bitcast_convert_type(as_uint8(codes), jnp.float8_e4m3fn)
    return codes.astype(jnp.float32)


def e2m1_encode(x: jax.Array) -> jax.Array:
    """Round float values to 4-bit E2M1 codes (``uint8`` in ``0..15``), RNE with saturation at ±6.

    The sign bit follows the sign of the input, so negative values that round to zero give code 8
    (negative zero), like an IEEE conversion. NaN inputs give a signed zero code; callers that poison
    groups overwrite it.
    """
    x = flush_subnormals(x)
    a = jnp.abs(x)
    mag = jnp.zeros(x.shape, jnp.uint8)
    for t in _E2M1_ROUND_DOWN_AT:
        mag = mag + (a > t).astype(jnp.uint8)
    for t in _E2M1_ROUND_UP_AT:
        mag = mag + (a >= t).astype(jnp.uint8)
    sign = jnp.signbit(x).astype(jnp.uint8) << 3
    return sign | mag


def e2m1_decode(codes: jax.Array) -> jax.Array:
    """4-bit E2M1 codes (values ``0..15`` in an integer array) to float32 values."""
    table = jnp.asarray(E2M1_VALUES, jnp.float32)
    return jnp.take(table, jnp.asarray(codes).astype(jnp.int32) & 0xF, axis=0)


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """Pack 4-bit codes ``[..., 2n]`` into bytes ``[..., n]``: element ``2i`` low nibble, ``2i+1`` high."""
    codes = jnp.asarray(codes)
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dimension, got shape {codes.shape}")
    pairs = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """Inverse of :func:`pack_nibbles`: bytes ``[..., n]`` to 4-bit codes ``[..., 2n]``."""
    b = as_uint8(packed, "packed")
    pairs = jnp.stack([b & 0xF, b >> 4], axis=-1)
    return pairs.reshape(*b.shape[:-1], b.shape[-1] * 2)


def ue8m0_exponent(scale_bytes: jax.Array) -> jax.Array:
    """UE8M0 bytes to their unbiased exponents (``int32``, ``b - 127``); byte 255 (NaN) gives 128."""
    return as_uint8(scale_bytes, "scale").astype(jnp.int32) - UE8M0_BIAS


def pow2(exponent: jax.Array) -> jax.Array:
    """Exact float32 ``2^e`` for integer ``e`` in ``[-126, 127]``, built from the bit pattern."""
    bits = (jnp.asarray(exponent, jnp.int32) + UE8M0_BIAS).astype(jnp.uint32) << 23
    return lax.bitcast_convert_type(bits, jnp.float32)


def ue8m0_decode(scale_bytes: jax.Array) -> jax.Array:
    """UE8M0 bytes to float32 scale values ``2^(b-127)``; byte 0 gives the subnormal ``2^-127``, 255 NaN."""
    b = as_uint8(scale_bytes, "scale").astype(jnp.uint32)
    bits = jnp.where(b == 0, jnp.uint32(0x00400000), b << 23)
    bits = jnp.where(b == UE8M0_NAN_CODE, jnp.uint32(0x7FC00000), bits)
    return lax.bitcast_convert_type(bits, jnp.float32)


def scale_by_pow2(values: jax.Array, exponent: jax.Array) -> jax.Array:
    """``values * 2^exponent`` for exponents in ``[-127, 128]``; 128 (a NaN scale byte) gives NaN.

    The power of two is applied as two normal factors ``2^floor(e/2)`` and ``2^ceil(e/2)``: each product is
    exact while it stays in the normal range, so the result is the correctly rounded ``values * 2^e`` even
    where ``2^e`` itself (``2^-127``) would be a subnormal that XLA:CPU flushes. Results that land below
    the normal range are flushed to signed zero, identically on every platform.
    """
    e = jnp.asarray(exponent, jnp.int32)
    finite_e = jnp.minimum(e, 127)
    lo = jnp.floor_divide(finite_e, 2)
    out = (jnp.asarray(values, jnp.float32) * pow2(lo)) * pow2(finite_e - lo)
    out = flush_subnormals(out)
    return jnp.where(e > 127, jnp.float32(jnp.nan), out)
