"""Group and weight codecs in ``jnp``: quantise to codes + scales and back, jit-able and vectorised.

Two layouts are covered:

* **groups along the last axis** (:func:`quantize_groups` / :func:`dequantize_groups`): every ``group_size``
  consecutive values share one scale -- MXFP8/MXFP4 activations, KV records, MXFP4 expert rows;
* **2-D blocks** (:func:`quantize_fp8_blockwise` / :func:`dequantize_fp8_blockwise`): a ``b0 × b1`` tile of a
  ``[..., out, in]`` weight shares one scale on a ceil-div grid, so dimensions that are not multiples of
  the block work (the edge blocks are simply smaller).

Leading dimensions (experts, layers, tokens) are batch dimensions everywhere. The numpy twins in
:mod:`deepinfer_jax.numerics.host` produce the same bytes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax.numerics.elements import (
    as_uint8,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    exact_divide,
    flush_subnormals,
    pack_nibbles,
    scale_by_pow2,
    ue8m0_exponent,
    unpack_nibbles,
)
from deepinfer_jax.numerics.formats import MXFP4, QuantScheme, fp8_block_scheme
from deepinfer_jax.numerics.scales import group_amax, scales_for


class QuantizedGroups(NamedTuple):
    """Codes (``uint8``, one per element, E2M1 codes unpacked in ``0..15``) and their per-group scales."""

    codes: jax.Array
    scales: jax.Array


def _check_float(x: jax.Array, name: str) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype}")
    return x.astype(jnp.float32)


def check_block(block: tuple[int, int]) -> tuple[int, int]:
    """Validate a ``(rows, cols)`` weight block (a list from a config file is accepted) and return it as ints."""
    if (
        not isinstance(block, tuple | list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(f"block must be a pair of positive ints (rows, cols), got {block!r}")
    return int(block[0]), int(block[1])


def encode_elements(q: jax.Array, scheme: QuantScheme) -> jax.Array:
    """Element codes (``uint8``) of already-scaled values ``q = x / sf``."""
    return e4m3_encode(q) if scheme.element == "e4m3" else e2m1_encode(q)


def decode_elements(codes: jax.Array, scheme: QuantScheme) -> jax.Array:
    """Float32 values of element codes (before the scale is applied)."""
    return e4m3_decode(codes) if scheme.element == "e4m3" else e2m1_decode(codes)


def apply_scales(values: jax.Array, scales: jax.Array, scheme: QuantScheme) -> jax.Array:
    """``values · scale`` with ``scales`` already broadcastable to ``values``; exact for power-of-two scales.

    Results below the float32 normal range are flushed to signed zero and NaN scales give NaN, on every
    platform (see :func:`deepinfer_jax.numerics.elements.scale_by_pow2`).
    """
    if scheme.scale == "ue8m0":
        return scale_by_pow2(values, ue8m0_exponent(scales))
    if scheme.scale == "e4m3":
        return flush_subnormals(values * e4m3_decode(scales))
    return flush_subnormals(values * jnp.asarray(scales, jnp.float32))


def quantize_groups(x: jax.Array, scheme: QuantScheme) -> QuantizedGroups:
    """Quantise ``x [..., n]`` in groups of ``scheme.group_size`` along the last axis.

    Returns codes ``uint8 [..., n]`` (E2M1 unpacked) and scales ``[..., ceil(n / g)]`` (``uint8`` bytes for
    UE8M0/E4M3 scales, ``float32`` for ``scale_inv``). A ragged last group is handled by zero padding,
    which does not change its ``amax``. Groups holding NaN or ±inf get the NaN scale and all-zero codes.
    """
    x = _check_float(x, "x")
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension (the grouped axis), got a scalar")
    g = scheme.group_size
    n = x.shape[-1]
    num_groups = -(-n // g)
    pad = num_groups * g - n
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    xg = x.reshape(*x.shape[:-1], num_groups, g)
    sc = scales_for(group_amax(xg, axis=-1), scheme)
    codes = encode_elements(exact_divide(xg, sc.divisor[..., None]), scheme)
    codes = jnp.where(sc.poisoned[..., None], jnp.uint8(0), codes)
    codes = codes.reshape(*x.shape[:-1], num_groups * g)[..., :n]
    return QuantizedGroups(codes, sc.stored)


def dequantize_groups(
    codes: jax.Array, scales: jax.Array, scheme: QuantScheme, dtype: jnp.dtype = jnp.float32
) -> jax.Array:
    """Inverse of :func:`quantize_groups`: codes ``[..., n]`` and scales ``[..., ceil(n / g)]`` to values."""
    codes = jnp.asarray(codes)
    scales = jnp.asarray(scales)
    g = scheme.group_size
    n = codes.shape[-1]
    num_groups = -(-n // g)
    if scales.shape != (*codes.shape[:-1], num_groups):
        raise ValueError(
            f"scales must have shape {(*codes.shape[:-1], num_groups)} for codes of shape {codes.shape} "
            f"and group_size {g}, got {scales.shape}"
        )
    values = decode_elements(codes, scheme)
    pad = num_groups * g - n
    if pad:
        values = jnp.pad(values, [(0, 0)] * (values.ndim - 1) + [(0, pad)])
    vg = values.reshape(*values.shape[:-1], num_groups, g)
    out = apply_scales(vg, scales[..., None], scheme)
    return out.reshape(*values.shape[:-1], num_groups * g)[..., :n].astype(dtype)


def quantize_dequantize_groups(x: jax.Array, scheme: QuantScheme) -> jax.Array:
    """The quantise-dequantise round trip of ``x`` along its last axis, returned in ``x``'s dtype."""
    x = jnp.asarray(x)
    q = quantize_groups(x, scheme)
    return dequantize_groups(q.codes, q.scales, scheme, dtype=x.dtype)


# ----------------------------------------------------------------------------------------------------
# Block-scaled FP8 weights (§12.1.1, §16)
# ----------------------------------------------------------------------------------------------------


def _pad_to_blocks(w: jax.Array, block: tuple[int, int]) -> jax.Array:
    """Zero-pad the last two axes to whole blocks and view them as ``[..., OB, b0, IB, b1]``."""
    b0, b1 = block
    rows, cols = w.shape[-2:]
    ob, ib = -(-rows // b0), -(-cols // b1)
    if ob * b0 != rows or ib * b1 != cols:
        w = jnp.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, ob * b0 - rows), (0, ib * b1 - cols)])
    return w.reshape(*w.shape[:-2], ob, b0, ib, b1)


def scale_grid_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Shape of the scale tensor of a ``[..., out, in]`` weight: ``[..., ceil(out/b0), ceil(in/b1)]``."""
    b0, b1 = check_block(block)
    return (*shape[:-2], -(-shape[-2] // b0), -(-shape[-1] // b1))


def quantize_fp8_blockwise(
    w: jax.Array, block: tuple[int, int] = (32, 32), scale_fmt: str = "ue8m0"
) -> tuple[jax.Array, jax.Array]:
    """Quantise ``w [..., out, in]`` to E4M3 with one scale per ``block`` tile (ceil-div grid).

    Returns ``(q, scale)``: ``q`` is ``float8_e4m3fn [..., out, in]``; ``scale`` is
    ``float8_e8m0fnu [..., ceil(out/b0), ceil(in/b1)]`` for ``scale_fmt="ue8m0"`` (V4/V4.1, power-of-two
    rule) or float32 ``weight_scale_inv`` for ``"float32"`` (V3: ``amax / 448``, ``W = q · scale_inv``).
    """
    b0, b1 = check_block(block)
    scheme = fp8_block_scheme(scale_fmt, b0 * b1)
    w = _check_float(w, "w")
    if w.ndim < 2:
        raise ValueError(f"w must have shape [..., out, in], got shape {w.shape}")
    rows, cols = w.shape[-2:]
    blocks = _pad_to_blocks(w, (b0, b1))
    sc = scales_for(group_amax(blocks, axis=(-3, -1)), scheme)
    divisor = sc.divisor[..., :, None, :, None]
    codes = encode_elements(exact_divide(blocks, divisor), scheme)
    codes = jnp.where(sc.poisoned[..., :, None, :, None], jnp.uint8(0), codes)
    codes = codes.reshape(*codes.shape[:-4], codes.shape[-4] * b0, codes.shape[-2] * b1)[..., :rows, :cols]
    q = lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
    if scheme.scale == "ue8m0":
        return q, lax.bitcast_convert_type(sc.stored, jnp.float8_e8m0fnu)
    return q, sc.stored


def fp8_scale_scheme(scale: jax.Array, block: tuple[int, int]) -> QuantScheme:
    """The scheme of an FP8 block-scale tensor, told by its dtype: float32 ``scale_inv`` (V3) or UE8M0 bytes."""
    if scale.dtype == jnp.float32:
        return fp8_block_scheme("float32", block[0] * block[1])
    if scale.dtype in (jnp.float8_e8m0fnu, jnp.uint8, jnp.int8):
        return fp8_block_scheme("ue8m0", block[0] * block[1])
    raise TypeError(
        f"scale must be float32 (V3 weight_scale_inv) or UE8M0 bytes (float8_e8m0fnu, uint8, int8), "
        f"got {scale.dtype}"
    )


def dequantize_fp8_blockwise(
    q: jax.Array, scale: jax.Array, block: tuple[int, int] = (32, 32), dtype: jnp.dtype = jnp.float32
) -> jax.Array:
    """Inverse of :func:`quantize_fp8_blockwise`; the scale format follows the scale's dtype.

    ``float32`` scales are V3 ``weight_scale_inv``; ``float8_e8m0fnu``/``uint8``/``int8`` scales are UE8M0.
    """
    b0, b1 = check_block(block)
    q = jnp.asarray(q)
    scale = jnp.asarray(scale)
    if q.ndim < 2:
        raise ValueError(f"q must have shape [..., out, in], got shape {q.shape}")
    expected = scale_grid_shape(q.shape, (b0, b1))
    if scale.shape != expected:
        raise ValueError(
            f"scale must have shape {expected} for a weight of shape {q.shape} and block {(b0, b1)}, "
            f"got {scale.shape}"
        )
    scheme = fp8_scale_scheme(scale, (b0, b1))
    rows, cols = q.shape[-2:]
    blocks = _pad_to_blocks(e4m3_decode(q), (b0, b1))
    out = apply_scales(blocks, scale[..., :, None, :, None], scheme)
    out = out.reshape(*out.shape[:-4], out.shape[-4] * b0, out.shape[-2] * b1)[..., :rows, :cols]
    return out.astype(dtype)


# ----------------------------------------------------------------------------------------------------
# MXFP4 expert weights (§12.1.2)
# ----------------------------------------------------------------------------------------------------


def quantize_mxfp4(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Quantise ``w [..., out, in]`` (``in % 32 == 0``) to MXFP4.

    Returns packed E2M1 codes ``uint8 [..., out, in/2]`` (element ``2i`` in the low nibble) and UE8M0
    scales ``float8_e8m0fnu [..., out, in/32]``.
    """
    w = _check_float(w, "w")
    if w.ndim < 2:
        raise ValueError(f"w must have shape [..., out, in], got shape {w.shape}")
    if w.shape[-1] % MXFP4.group_size:
        raise ValueError(
            f"w in-dimension must be a multiple of {MXFP4.group_size} for MXFP4, got {w.shape[-1]}"
        )
    q = quantize_groups(w, MXFP4)
    return pack_nibbles(q.codes), lax.bitcast_convert_type(q.scales, jnp.float8_e8m0fnu)


def dequantize_mxfp4(packed: jax.Array, scale: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Inverse of :func:`quantize_mxfp4`: ``[..., out, in/2]`` bytes and ``[..., out, in/32]`` scales."""
    packed = jnp.asarray(packed)
    scale = jnp.asarray(scale)
    if packed.ndim < 2:
        raise ValueError(f"packed must have shape [..., out, in/2], got shape {packed.shape}")
    cols = packed.shape[-1] * 2
    expected = (*packed.shape[:-1], math.ceil(cols / MXFP4.group_size))
    if scale.shape != expected or cols % MXFP4.group_size:
        raise ValueError(
            f"scale must have shape {expected} for packed codes of shape {packed.shape} "
            f"(in = {cols}, a multiple of {MXFP4.group_size}), got {scale.shape}"
        )
    return dequantize_groups(unpack_nibbles(packed), as_uint8(scale, "scale"), MXFP4, dtype=dtype)
