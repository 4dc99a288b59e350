"""Independent numpy/ml_dtypes reference of the formats of spec/model.md §12, written for the tests.

Nothing here imports ``deepinfer_jax``. Where the library uses a trick (bit patterns for ceil-log2, midpoint
comparisons for E2M1, two-factor power-of-two scaling), this reference uses the plain definition instead
(``math.frexp``, nearest-value search with an explicit tie rule, float64 products), so a shared mistake is
unlikely. Policies the spec leaves to the implementation follow ``docs/numerics.md``: float32 subnormal inputs
and outputs are flushed to signed zero; a group holding NaN or ±inf stores the NaN scale and all-zero codes.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu
TINY = 2.0**-126
E2M1_MAGS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E4M3_ALL_VALUES = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)

# (element, scale, Qmax, amax margin) of each scheme, straight from §12 / §16.
SCHEMES = {
    "mxfp8": ("e4m3", "ue8m0", 448.0, 1e-4, 32),
    "mxfp4": ("e2m1", "ue8m0", 6.0, 6.0 * 2.0**-126, 32),
    "fp4_e4m3": ("e2m1", "e4m3", 6.0, 6.0 * 2.0**-9, 16),
}


def flush(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    out = x.copy()
    small = np.abs(x) < np.float32(TINY)
    out[small] = np.copysign(np.float32(0.0), x[small])
    return out


def e4m3_codes(q: np.ndarray) -> np.ndarray:
    """Clamp to ±448, then round to nearest even (ml_dtypes does the rounding)."""
    return np.clip(flush(q), -448.0, 448.0).astype(np.float32).astype(E4M3).view(np.uint8)


def e2m1_codes(q: np.ndarray) -> np.ndarray:
    """Nearest E2M1 magnitude by exhaustive search; exact ties go to the even code; |q| > 6 saturates."""
    q = flush(q)
    a = np.abs(q).astype(np.float64)
    dist = np.abs(a[..., None] - E2M1_MAGS)
    best = dist.min(axis=-1, keepdims=True)
    tied = dist == best
    even = tied & (np.arange(8) % 2 == 0)
    pick = np.where(even.any(axis=-1), even.argmax(axis=-1), tied.argmax(axis=-1))
    pick = np.where(a > 6.0, 7, pick)
    return (pick | (np.signbit(q).astype(np.int64) << 3)).astype(np.uint8)


def e2m1_value(code: np.ndarray) -> np.ndarray:
    code = np.asarray(code).astype(np.int64)
    mag = E2M1_MAGS[code & 7]
    return np.where(code & 8, -mag, mag)


def ceil_log2(ratio: float) -> int:
    m, e = math.frexp(ratio)  # ratio = m * 2^e, 0.5 <= m < 1
    return e - 1 if m == 0.5 else e


def group_scale(values: np.ndarray, scheme: str) -> tuple[object, float, bool]:
    """(stored scale, divisor, poisoned) of one group; stored is an int byte or a float32 (V3)."""
    _, scale, qmax, margin, _ = SCHEMES[scheme]
    v = flush(values)
    if not np.all(np.isfinite(v)):
        return (0xFF if scale == "ue8m0" else 0x7F), 1.0, True
    amax = max(float(np.abs(v).max(initial=0.0)), margin)
    ratio = np.float32(amax) / np.float32(qmax)
    if scale == "ue8m0":
        e = ceil_log2(float(ratio))
        return e + 127, 2.0**e, False
    code = int(np.array([min(ratio, np.float32(448.0))], np.float32).astype(E4M3).view(np.uint8)[0])
    return code, float(E4M3_ALL_VALUES[code]), False


def quantize_group(values: np.ndarray, scheme: str) -> tuple[np.ndarray, object]:
    element = SCHEMES[scheme][0]
    stored, divisor, poisoned = group_scale(values, scheme)
    if poisoned:
        return np.zeros(values.shape, np.uint8), stored
    q = (flush(values) / np.float32(divisor)).astype(np.float32)
    return (e4m3_codes(q) if element == "e4m3" else e2m1_codes(q)), stored


def scale_value(stored: object, scheme: str) -> float:
    scale = SCHEMES[scheme][1]
    if scale == "ue8m0":
        return math.nan if stored == 0xFF else 2.0 ** (int(stored) - 127)
    return float(E4M3_ALL_VALUES[int(stored)])


def dequantize_group(codes: np.ndarray, stored: object, scheme: str) -> np.ndarray:
    element = SCHEMES[scheme][0]
    vals = E4M3_ALL_VALUES[codes].astype(np.float64) if element == "e4m3" else e2m1_value(codes)
    with np.errstate(invalid="ignore"):
        return flush((vals * scale_value(stored, scheme)).astype(np.float32))


def quantize_rows(x: np.ndarray, scheme: str) -> tuple[np.ndarray, np.ndarray]:
    """Groups along the last axis (exact multiples): codes ``[..., n]`` and stored scales ``[..., n/g]``."""
    g = SCHEMES[scheme][4]
    x = np.asarray(x, np.float32)
    flat = x.reshape(-1, x.shape[-1])
    codes = np.zeros(flat.shape, np.uint8)
    scales = np.zeros((flat.shape[0], flat.shape[1] // g), np.uint8)
    for r in range(flat.shape[0]):
        for j in range(flat.shape[1] // g):
            c, s = quantize_group(flat[r, j * g : (j + 1) * g], scheme)
            codes[r, j * g : (j + 1) * g] = c
            scales[r, j] = s
    return codes.reshape(x.shape), scales.reshape(*x.shape[:-1], -1)


def dequantize_rows(codes: np.ndarray, scales: np.ndarray, scheme: str) -> np.ndarray:
    g = SCHEMES[scheme][4]
    flat_c = codes.reshape(-1, codes.shape[-1])
    flat_s = scales.reshape(flat_c.shape[0], -1)
    out = np.zeros(flat_c.shape, np.float32)
    for r in range(flat_c.shape[0]):
        for j in range(flat_c.shape[1] // g):
            out[r, j * g : (j + 1) * g] = dequantize_group(
                flat_c[r, j * g : (j + 1) * g], flat_s[r, j], scheme
            )
    return out.reshape(codes.shape)


def pack_low_first(codes: np.ndarray) -> np.ndarray:
    out = np.zeros((*codes.shape[:-1], codes.shape[-1] // 2), np.uint8)
    for i in range(codes.shape[-1] // 2):
        out[..., i] = codes[..., 2 * i] + 16 * codes[..., 2 * i + 1]
    return out


def record(x: np.ndarray, scheme: str) -> np.ndarray:
    """Per-token record ``[codes][scales]`` of ``x [..., n]``, E2M1 packed low nibble first."""
    codes, scales = quantize_rows(x, scheme)
    if SCHEMES[scheme][0] == "e2m1":
        codes = pack_low_first(codes)
    return np.concatenate([codes, scales], axis=-1)


def fp8_blockwise(w: np.ndarray, block: tuple[int, int], scale_fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """Block-scaled E4M3 weight by explicit loops over the ceil-div grid: (codes uint8, scales)."""
    rows, cols = w.shape
    b0, b1 = block
    grid = (-(-rows // b0), -(-cols // b1))
    codes = np.zeros(w.shape, np.uint8)
    scales = np.zeros(grid, np.uint8 if scale_fmt == "ue8m0" else np.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            blk = flush(w[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1])
            if not np.all(np.isfinite(blk)):
                scales[i, j] = 0xFF if scale_fmt == "ue8m0" else np.nan
                continue
            amax = max(float(np.abs(blk).max()), 1e-4)
            ratio = np.float32(amax) / np.float32(448.0)
            if scale_fmt == "ue8m0":
                e = ceil_log2(float(ratio))
                scales[i, j], divisor = e + 127, np.float32(2.0**e)
            else:
                scales[i, j], divisor = ratio, ratio
            codes[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = e4m3_codes(
                (blk / divisor).astype(np.float32)
            )
    return codes, scales


def fp8_blockwise_dequant(codes: np.ndarray, scales: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    b0, b1 = block
    vals = E4M3_ALL_VALUES[codes].astype(np.float64)
    if scales.dtype == np.uint8:
        with np.errstate(invalid="ignore"):
            s = np.where(scales == 0xFF, np.nan, 2.0 ** (scales.astype(np.float64) - 127))
    else:
        s = scales.astype(np.float64)
    full = np.repeat(np.repeat(s, b0, axis=0), b1, axis=1)[: codes.shape[0], : codes.shape[1]]
    with np.errstate(invalid="ignore"):
        return flush((vals * full).astype(np.float32))


def bits(x: np.ndarray) -> np.ndarray:
    """Float32 bit patterns (compare these: XLA:CPU may flush subnormals in arithmetic)."""
    return np.asarray(x, np.float32).view(np.uint32)


def random_tensor(rng: np.random.Generator, shape: tuple[int, ...], spread: float = 8.0) -> np.ndarray:
    """Normal values with a per-row power-of-two magnitude spread, exercising many scale exponents."""
    rows = rng.normal(size=shape)
    exp = rng.integers(-int(spread), int(spread) + 1, size=(*shape[:-1], 1))
    return (rows * 2.0**exp).astype(np.float32)
