"""Scale rules in ``jnp``: from a group's ``amax`` to the stored scale and the value codes are divided by.

Three rules exist (``spec/model.md`` §12, §16):

* power of two (UE8M0): ``sf = 2^ceil(log2(max(amax, margin) / Qmax))``, stored as the biased exponent;
* E4M3 per 16 (FP4 compressed KV): ``sf = e4m3(min(max(amax, 6·2^-9) / 6, 448))``, rounded to nearest;
* float32 ``scale_inv`` (DeepSeek-V3): ``sf = max(amax, 1e-4) / 448``, stored as float32.

A group whose ``amax`` is not finite (it holds a NaN or an infinity) is *poisoned*: its stored scale is the
format's NaN (UE8M0 ``0xFF``, E4M3 ``0x7F``, float32 NaN), so the whole group decodes to NaN. The returned
``poisoned`` mask lets the codecs zero that group's element codes, which keeps the bytes deterministic.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax.numerics.elements import e4m3_decode, e4m3_encode, exact_divide, flush_subnormals, pow2
from deepinfer_jax.numerics.formats import (
    E2M1_MAX,
    E4M3_MAX,
    E4M3_NAN_CODE,
    UE8M0_BIAS,
    UE8M0_NAN_CODE,
    QuantScheme,
)


class GroupScales(NamedTuple):
    """Scales of a set of groups.

    ``stored``: what the format stores (``uint8`` for UE8M0/E4M3 scales, ``float32`` for ``scale_inv``).
    ``divisor``: the float32 value codes are computed against (``code = round(x / divisor)``); finite and
    positive for every group, poisoned or not, so the division never produces a spurious NaN.
    ``poisoned``: ``bool``, true where ``amax`` was NaN or infinite.
    """

    stored: jax.Array
    divisor: jax.Array
    poisoned: jax.Array


def group_amax(x: jax.Array, axis: int | tuple[int, ...] = -1) -> jax.Array:
    """``max |x|`` over ``axis`` after the subnormal flush, or NaN where the group holds a NaN or an infinity.

    Non-finite elements are detected explicitly rather than trusted to propagate through the max reduction:
    XLA:CPU's vectorised max reduction may drop a NaN.
    """
    a = jnp.abs(flush_subnormals(x))
    finite = jnp.isfinite(a)
    amax = jnp.max(jnp.where(finite, a, jnp.float32(0.0)), axis=axis)
    return jnp.where(jnp.all(finite, axis=axis), amax, jnp.float32(jnp.nan))


def ceil_log2_exponent(ratio: jax.Array) -> jax.Array:
    """``ceil(log2(ratio))`` for positive normal float32 ``ratio``, computed on the bit pattern.

    Subtracting one from the bits of an exact power of two borrows out of the exponent field, so the
    (unbiased) exponent field of ``bits - 1`` is ``log2(ratio) - 1`` for a power of two and
    ``floor(log2(ratio))`` otherwise; adding one gives the ceiling in both cases. No transcendental
    function is involved, so every platform agrees.
    """
    bits = lax.bitcast_convert_type(jnp.asarray(ratio, jnp.float32), jnp.int32)
    return ((bits - 1) >> 23) + 1 - UE8M0_BIAS


def pow2_scales(amax: jax.Array, qmax: float, margin: float) -> GroupScales:
    """The UE8M0 power-of-two rule: stored byte ``e + 127`` where ``sf = 2^e >= max(amax, margin) / qmax``."""
    amax = jnp.asarray(amax, jnp.float32)
    poisoned = ~jnp.isfinite(amax)
    clamped = jnp.where(poisoned, jnp.float32(margin), jnp.maximum(amax, jnp.float32(margin)))
    e = ceil_log2_exponent(exact_divide(clamped, qmax))
    stored = jnp.where(poisoned, UE8M0_NAN_CODE, e + UE8M0_BIAS).astype(jnp.uint8)
    return GroupScales(stored, pow2(e), poisoned)


def e4m3_fp4_scales(amax: jax.Array, margin: float) -> GroupScales:
    """The E4M3-per-16 rule of the FP4 compressed-KV record (§12.3.2): not a power of two, no global scale.

    ``sf = e4m3(min(max(amax, margin) / 6, 448))`` rounded to nearest even; the divisor is the decoded
    E4M3 value, so a scale that rounded down can push codes past 6, where E2M1 saturates.
    """
    amax = jnp.asarray(amax, jnp.float32)
    poisoned = ~jnp.isfinite(amax)
    clamped = jnp.where(poisoned, jnp.float32(margin), jnp.maximum(amax, jnp.float32(margin)))
    code = e4m3_encode(jnp.minimum(exact_divide(clamped, E2M1_MAX), jnp.float32(E4M3_MAX)))
    divisor = e4m3_decode(code)
    stored = jnp.where(poisoned, jnp.uint8(E4M3_NAN_CODE), code)
    return GroupScales(stored, divisor, poisoned)


def float32_scales(amax: jax.Array, margin: float) -> GroupScales:
    """DeepSeek-V3 rule: ``scale_inv = max(amax, margin) / 448`` in float32 (``W = W_q · scale_inv``)."""
    amax = jnp.asarray(amax, jnp.float32)
    poisoned = ~jnp.isfinite(amax)
    clamped = jnp.where(poisoned, jnp.float32(margin), jnp.maximum(amax, jnp.float32(margin)))
    divisor = exact_divide(clamped, E4M3_MAX)
    stored = jnp.where(poisoned, jnp.float32(jnp.nan), divisor)
    return GroupScales(stored, divisor, poisoned)


def scales_for(amax: jax.Array, scheme: QuantScheme) -> GroupScales:
    """Dispatch to the scale rule of ``scheme``."""
    if scheme.scale == "ue8m0":
        return pow2_scales(amax, scheme.qmax, scheme.amax_margin)
    if scheme.scale == "e4m3":
        return e4m3_fp4_scales(amax, scheme.amax_margin)
    return float32_scales(amax, scheme.amax_margin)
