"""Host (``numpy`` + ``ml_dtypes``) codecs: offline weight conversion and synthetic checkpoints, without JAX.

Every function mirrors its ``jnp`` counterpart in :mod:`~deepinfer_jax.numerics.codecs` or
:mod:`~deepinfer_jax.numerics.kv_records` and produces the same bytes (the test-suite checks this bit for bit):
the same subnormal flush, the same power-of-two rule on the float32 bit pattern, the same E2M1 midpoint rounding,
the same NaN/inf poisoning of a group. Importing this module does not import JAX, so conversion tools and the
built-in tiny-model writer can run in a process that never initialises an accelerator.
"""

from __future__ import annotations

import numpy as np
from ml_dtypes import bfloat16, float8_e4m3fn, float8_e8m0fnu

from deepinfer_jax.numerics.formats import (
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    E4M3_NAN_CODE,
    F32_MIN_NORMAL,
    MXFP4,
    UE8M0_BIAS,
    UE8M0_NAN_CODE,
    QuantScheme,
    RecordFormat,
    fp8_block_scheme,
)

__all__ = [
    "decode_records",
    "dequantize_fp8_blockwise",
    "dequantize_groups",
    "dequantize_mxfp4",
    "e2m1_decode",
    "e2m1_encode",
    "e4m3_decode",
    "e4m3_encode",
    "encode_records",
    "pack_nibbles",
    "pack_page",
    "quantize_fp8_blockwise",
    "quantize_groups",
    "quantize_mxfp4",
    "ue8m0_decode",
    "unpack_nibbles",
    "unpack_page",
]

_F32 = np.float32
_E2M1_ROUND_DOWN_AT = (0.25, 1.25, 2.5, 5.0)
_E2M1_ROUND_UP_AT = (0.75, 1.75, 3.5)
_E2M1_TABLE = np.asarray(E2M1_VALUES, np.float32)


def _as_f32(x: np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(x)
    if not (np.issubdtype(x.dtype, np.floating) or x.dtype.name in ("bfloat16", "float16")):
        raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype}")
    return x.astype(np.float32)


def _as_bytes(a: np.ndarray, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype == np.uint8:
        return a
    if a.dtype in (np.dtype(np.int8), np.dtype(float8_e4m3fn), np.dtype(float8_e8m0fnu)):
        return a.view(np.uint8)
    raise TypeError(
        f"{name} must have an 8-bit storage dtype (uint8, int8, float8_e4m3fn or float8_e8m0fnu), got {a.dtype}"
    )


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if (
        not isinstance(block, tuple | list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(f"block must be a pair of positive ints (rows, cols), got {block!r}")
    return int(block[0]), int(block[1])


# ----------------------------------------------------------------------------------------------------
# Element codes
# ----------------------------------------------------------------------------------------------------


def flush_subnormals(x: np.ndarray) -> np.ndarray:
    """Float32 subnormals to zero of the same sign (the codecs' denormals-are-zero rule)."""
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore"):
        return np.where(np.abs(x) < _F32(F32_MIN_NORMAL), np.copysign(_F32(0.0), x), x).astype(np.float32)


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """Float values to E4M3 codes (``uint8``): subnormal flush, clamp to ±448, round to nearest even."""
    q = np.clip(flush_subnormals(x), _F32(-E4M3_MAX), _F32(E4M3_MAX))
    return q.astype(float8_e4m3fn).view(np.uint8)


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """E4M3 codes (any 8-bit storage dtype) to float32."""
    return _as_bytes(codes, "codes").view(float8_e4m3fn).astype(np.float32)


def e2m1_encode(x: np.ndarray) -> np.ndarray:
    """Float values to 4-bit E2M1 codes (``uint8``): RNE at the exact midpoints, saturating at ±6."""
    x = flush_subnormals(x)
    a = np.abs(x)
    mag = np.zeros(x.shape, np.uint8)
    with np.errstate(invalid="ignore"):
        for t in _E2M1_ROUND_DOWN_AT:
            mag += (a > _F32(t)).astype(np.uint8)
        for t in _E2M1_ROUND_UP_AT:
            mag += (a >= _F32(t)).astype(np.uint8)
    return (np.signbit(x).astype(np.uint8) << 3) | mag


def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    """4-bit E2M1 codes to float32."""
    return _E2M1_TABLE[np.asarray(codes).astype(np.int64) & 0xF]


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """4-bit codes ``[..., 2n]`` to bytes ``[..., n]``: element ``2i`` in the low nibble."""
    codes = np.asarray(codes).astype(np.uint8)
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dimension, got shape {codes.shape}")
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes ``[..., n]`` to 4-bit codes ``[..., 2n]`` (low nibble first)."""
    b = _as_bytes(packed, "packed")
    return np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)


def _pow2(e: np.ndarray) -> np.ndarray:
    return ((np.asarray(e, np.int32) + UE8M0_BIAS).astype(np.uint32) << 23).view(np.float32)


def ue8m0_decode(scale_bytes: np.ndarray) -> np.ndarray:
    """UE8M0 bytes to float32 ``2^(b-127)`` (byte 0: subnormal ``2^-127``; 255: NaN)."""
    return _as_bytes(scale_bytes, "scale").view(float8_e8m0fnu).astype(np.float32)


def _scale_by_pow2(values: np.ndarray, exponent: np.ndarray) -> np.ndarray:
    e = np.asarray(exponent, np.int32)
    finite_e = np.minimum(e, 127)
    lo = np.floor_divide(finite_e, 2)
    out = flush_subnormals((np.asarray(values, np.float32) * _pow2(lo)) * _pow2(finite_e - lo))
    return np.where(e > 127, _F32(np.nan), out).astype(np.float32)


# ----------------------------------------------------------------------------------------------------
# Scales and groups
# ----------------------------------------------------------------------------------------------------


def _scales(amax: np.ndarray, scheme: QuantScheme) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(stored, divisor, poisoned) of the scale rule of ``scheme``; see :mod:`deepinfer_jax.numerics.scales`."""
    amax = np.asarray(amax, np.float32)
    poisoned = ~np.isfinite(amax)
    margin = _F32(scheme.amax_margin)
    clamped = np.where(poisoned, margin, np.maximum(amax, margin)).astype(np.float32)
    if scheme.scale == "ue8m0":
        bits = (clamped / _F32(scheme.qmax)).astype(np.float32).view(np.int32)
        e = ((bits - 1) >> 23) + 1 - UE8M0_BIAS
        stored = np.where(poisoned, UE8M0_NAN_CODE, e + UE8M0_BIAS).astype(np.uint8)
        return stored, _pow2(e), poisoned
    if scheme.scale == "e4m3":
        code = e4m3_encode(np.minimum(clamped / _F32(E2M1_MAX), _F32(E4M3_MAX)))
        stored = np.where(poisoned, np.uint8(E4M3_NAN_CODE), code).astype(np.uint8)
        return stored, e4m3_decode(code), poisoned
    divisor = (clamped / _F32(E4M3_MAX)).astype(np.float32)
    return np.where(poisoned, _F32(np.nan), divisor).astype(np.float32), divisor, poisoned


def _encode_elements(q: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    return e4m3_encode(q) if scheme.element == "e4m3" else e2m1_encode(q)


def _decode_elements(codes: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    return e4m3_decode(codes) if scheme.element == "e4m3" else e2m1_decode(codes)


def _apply_scales(values: np.ndarray, scales: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    if scheme.scale == "ue8m0":
        return _scale_by_pow2(values, _as_bytes(scales, "scale").astype(np.int32) - UE8M0_BIAS)
    if scheme.scale == "e4m3":
        return flush_subnormals(values * e4m3_decode(scales))
    return flush_subnormals(values * np.asarray(scales, np.float32))


def _group_amax(x: np.ndarray, axis: int | tuple[int, ...]) -> np.ndarray:
    a = np.abs(flush_subnormals(x))
    finite = np.isfinite(a)
    amax = np.max(np.where(finite, a, _F32(0.0)), axis=axis)
    return np.where(np.all(finite, axis=axis), amax, _F32(np.nan)).astype(np.float32)


def quantize_groups(x: np.ndarray, scheme: QuantScheme) -> tuple[np.ndarray, np.ndarray]:
    """Host twin of :func:`deepinfer_jax.numerics.codecs.quantize_groups`: (codes ``[..., n]``, scales)."""
    x = _as_f32(x, "x")
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension (the grouped axis), got a scalar")
    g, n = scheme.group_size, x.shape[-1]
    num_groups = -(-n // g)
    if num_groups * g != n:
        x = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, num_groups * g - n)])
    xg = x.reshape(*x.shape[:-1], num_groups, g)
    stored, divisor, poisoned = _scales(_group_amax(xg, -1), scheme)
    with np.errstate(invalid="ignore", over="ignore"):  # poisoned groups: codes are zeroed below
        codes = _encode_elements((xg / divisor[..., None]).astype(np.float32), scheme)
    codes = np.where(poisoned[..., None], np.uint8(0), codes).astype(np.uint8)
    return codes.reshape(*x.shape[:-1], num_groups * g)[..., :n], stored


def dequantize_groups(codes: np.ndarray, scales: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    """Host twin of :func:`deepinfer_jax.numerics.codecs.dequantize_groups` (float32 output)."""
    codes, scales = np.asarray(codes), np.asarray(scales)
    g, n = scheme.group_size, codes.shape[-1]
    num_groups = -(-n // g)
    if scales.shape != (*codes.shape[:-1], num_groups):
        raise ValueError(
            f"scales must have shape {(*codes.shape[:-1], num_groups)} for codes of shape {codes.shape} "
            f"and group_size {g}, got {scales.shape}"
        )
    values = _decode_elements(codes, scheme)
    if num_groups * g != n:
        values = np.pad(values, [(0, 0)] * (values.ndim - 1) + [(0, num_groups * g - n)])
    vg = values.reshape(*values.shape[:-1], num_groups, g)
    out = _apply_scales(vg, scales[..., None], scheme)
    return out.reshape(*values.shape[:-1], num_groups * g)[..., :n]


# ----------------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------------


def _blocks(w: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    b0, b1 = block
    rows, cols = w.shape[-2:]
    ob, ib = -(-rows // b0), -(-cols // b1)
    if ob * b0 != rows or ib * b1 != cols:
        w = np.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, ob * b0 - rows), (0, ib * b1 - cols)])
    return w.reshape(*w.shape[:-2], ob, b0, ib, b1)


def _unblock(x: np.ndarray, rows: int, cols: int) -> np.ndarray:
    *lead, ob, b0, ib, b1 = x.shape
    return x.reshape(*lead, ob * b0, ib * b1)[..., :rows, :cols]


def quantize_fp8_blockwise(
    w: np.ndarray, block: tuple[int, int] = (32, 32), scale_fmt: str = "ue8m0"
) -> tuple[np.ndarray, np.ndarray]:
    """Quantise float32 ``w [..., out, in]`` to (``float8_e4m3fn [..., out, in]``, block scales).

    Scales lie on the ceil-div grid ``[..., ceil(out/b0), ceil(in/b1)]``: ``float8_e8m0fnu`` for ``"ue8m0"``
    (power-of-two rule) or float32 ``weight_scale_inv`` for ``"float32"`` (V3: ``amax/448``).
    """
    b0, b1 = _check_block(block)
    scheme = fp8_block_scheme(scale_fmt, b0 * b1)
    w = _as_f32(w, "w")
    if w.ndim < 2:
        raise ValueError(f"w must have shape [..., out, in], got shape {w.shape}")
    rows, cols = w.shape[-2:]
    blocks = _blocks(w, (b0, b1))
    stored, divisor, poisoned = _scales(_group_amax(blocks, (-3, -1)), scheme)
    with np.errstate(invalid="ignore", over="ignore"):  # poisoned groups: codes are zeroed below
        codes = e4m3_encode((blocks / divisor[..., :, None, :, None]).astype(np.float32))
    codes = np.where(poisoned[..., :, None, :, None], np.uint8(0), codes).astype(np.uint8)
    q = np.ascontiguousarray(_unblock(codes, rows, cols)).view(float8_e4m3fn)
    if scheme.scale == "ue8m0":
        return q, stored.view(float8_e8m0fnu)
    return q, stored


def dequantize_fp8_blockwise(
    q: np.ndarray, scale: np.ndarray, block: tuple[int, int] = (32, 32)
) -> np.ndarray:
    """Float32 values of an FP8 block-scaled weight; float32 scales are V3 ``scale_inv``, others UE8M0."""
    b0, b1 = _check_block(block)
    q, scale = np.asarray(q), np.asarray(scale)
    if q.ndim < 2:
        raise ValueError(f"q must have shape [..., out, in], got shape {q.shape}")
    rows, cols = q.shape[-2:]
    expected = (*q.shape[:-2], -(-rows // b0), -(-cols // b1))
    if scale.shape != expected:
        raise ValueError(
            f"scale must have shape {expected} for a weight of shape {q.shape} and block {(b0, b1)}, "
            f"got {scale.shape}"
        )
    if scale.dtype == np.float32:
        scheme = fp8_block_scheme("float32", b0 * b1)
    elif scale.dtype in (np.dtype(float8_e8m0fnu), np.dtype(np.uint8), np.dtype(np.int8)):
        scheme = fp8_block_scheme("ue8m0", b0 * b1)
    else:
        raise TypeError(
            f"scale must be float32 (V3 weight_scale_inv) or UE8M0 bytes (float8_e8m0fnu, uint8, int8), "
            f"got {scale.dtype}"
        )
    blocks = _blocks(e4m3_decode(q), (b0, b1))
    return _unblock(_apply_scales(blocks, scale[..., :, None, :, None], scheme), rows, cols)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantise float32 ``w [..., out, in]`` (``in % 32 == 0``) to MXFP4.

    Returns packed ``uint8 [..., out, in/2]`` (element ``2i`` in the low nibble) and ``float8_e8m0fnu``
    scales ``[..., out, in/32]``.
    """
    w = _as_f32(w, "w")
    if w.ndim < 2:
        raise ValueError(f"w must have shape [..., out, in], got shape {w.shape}")
    if w.shape[-1] % MXFP4.group_size:
        raise ValueError(
            f"w in-dimension must be a multiple of {MXFP4.group_size} for MXFP4, got {w.shape[-1]}"
        )
    codes, scales = quantize_groups(w, MXFP4)
    return pack_nibbles(codes), scales.view(float8_e8m0fnu)


def dequantize_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Float32 values of an MXFP4 weight (``packed [..., out, in/2]``, ``scale [..., out, in/32]``)."""
    packed = _as_bytes(packed, "packed")
    scale = _as_bytes(scale, "scale")
    cols = packed.shape[-1] * 2
    expected = (*packed.shape[:-1], -(-cols // MXFP4.group_size))
    if packed.ndim < 2 or cols % MXFP4.group_size or scale.shape != expected:
        raise ValueError(
            f"scale must have shape {expected} for packed codes of shape {packed.shape} "
            f"(in = {cols}, a multiple of {MXFP4.group_size}), got {scale.shape}"
        )
    return dequantize_groups(unpack_nibbles(packed), scale, MXFP4)


# ----------------------------------------------------------------------------------------------------
# KV records
# ----------------------------------------------------------------------------------------------------


def encode_records(x: np.ndarray, fmt: RecordFormat) -> np.ndarray:
    """Host twin of :func:`deepinfer_jax.numerics.kv_records.encode_records`."""
    x = _as_f32(x, "x")
    if x.ndim == 0 or x.shape[-1] != fmt.num_elements:
        raise ValueError(
            f"values for {fmt.name!r} records must have last dimension {fmt.num_elements}, got shape {x.shape}"
        )
    if not fmt.quantized:
        bits = x.astype(bfloat16).view(np.uint16)
        lo_hi = np.stack([(bits & 0xFF).astype(np.uint8), (bits >> 8).astype(np.uint8)], axis=-1)
        return lo_hi.reshape(*x.shape[:-1], fmt.record_bytes)
    codes, scales = quantize_groups(x, fmt.scheme)
    if fmt.element == "e2m1":
        codes = pack_nibbles(codes)
    return np.concatenate([codes, scales], axis=-1)


def decode_records(records: np.ndarray, fmt: RecordFormat) -> np.ndarray:
    """Host twin of :func:`deepinfer_jax.numerics.kv_records.decode_records` (float32 output)."""
    records = _as_bytes(records, "records")
    if records.ndim == 0 or records.shape[-1] != fmt.record_bytes:
        raise ValueError(
            f"{fmt.name!r} records must have last dimension {fmt.record_bytes} (record_bytes), "
            f"got shape {records.shape}"
        )
    if not fmt.quantized:
        pairs = records.reshape(*records.shape[:-1], fmt.num_elements, 2).astype(np.uint16)
        return (pairs[..., 0] | (pairs[..., 1] << 8)).view(bfloat16).astype(np.float32)
    codes = records[..., : fmt.code_bytes]
    if fmt.element == "e2m1":
        codes = unpack_nibbles(codes)
    return dequantize_groups(codes, records[..., fmt.code_bytes :], fmt.scheme)


def pack_page(records: np.ndarray, fmt: RecordFormat) -> np.ndarray:
    """Block-sectioned page of ``records [..., N, record_bytes]``: all code rows, then all scale rows."""
    records = _as_bytes(records, "records")
    if records.ndim < 2 or records.shape[-1] != fmt.record_bytes:
        raise ValueError(f"records must have shape [..., tokens, {fmt.record_bytes}], got {records.shape}")
    lead, n = records.shape[:-2], records.shape[-2]
    codes = records[..., : fmt.code_bytes].reshape(*lead, n * fmt.code_bytes)
    scales = records[..., fmt.code_bytes :].reshape(*lead, n * fmt.scale_bytes)
    return np.concatenate([codes, scales], axis=-1)


def unpack_page(page: np.ndarray, fmt: RecordFormat, num_tokens: int) -> np.ndarray:
    """Records ``[..., num_tokens, record_bytes]`` of a block-sectioned page."""
    page = _as_bytes(page, "page")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
    if page.ndim == 0 or page.shape[-1] != num_tokens * fmt.record_bytes:
        raise ValueError(
            f"a {fmt.name!r} page of {num_tokens} tokens must have last dimension "
            f"{num_tokens * fmt.record_bytes}, got shape {page.shape}"
        )
    lead, split = page.shape[:-1], num_tokens * fmt.code_bytes
    codes = page[..., :split].reshape(*lead, num_tokens, fmt.code_bytes)
    scales = page[..., split:].reshape(*lead, num_tokens, fmt.scale_bytes)
    return np.concatenate([codes, scales], axis=-1)
