"""KV-record decoding and encoding inside kernels, bit-exact with :mod:`deepinfer_jax.numerics`.

A cache record (``spec/model.md`` §12.3) is one token's vector as ``[code bytes][scale bytes]``. The functions
here work on ``jnp`` arrays of integer bytes and float32 values using only shifts, masks, comparisons, integer
arithmetic, multiplications and ``bitcast``: every one of them lowers to Triton and runs in interpret mode, and
none depends on a GPU's float8/float4 conversion instructions or on the rounding of its division.

**Decoding** (``decode_*``) reproduces :func:`deepinfer_jax.numerics.kv_records.decode_records` bit for bit:
UE8M0 scales are applied as two normal powers of two (``2^lo · 2^hi``; byte 0 means ``2^-127``), results below the
float32 normal range are flushed to signed zero, NaN scale bytes and E4M3 NaN codes give NaN.

**Encoding** (``encode_group``) reproduces :func:`deepinfer_jax.numerics.codecs.quantize_groups`, whose
definition divides with IEEE rounding (``exact_divide``). A GPU's ``a / b`` is not correctly rounded, so no
division is used: every rounding decision the reference takes on ``fl(x / s)`` is taken on ``x`` against an exact
product ``t · s`` instead. That is the same decision, because the thresholds ``t`` (code midpoints, powers of
two) and the scales ``s`` have so few significant bits that ``x / s`` can never lie strictly between ``t`` and a
neighbour of ``t`` within half an ulp (the derivations are next to each function). Inputs that are float32
subnormals count as zero (as XLA:CPU, where the reference is checked, treats them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax.numerics.formats import (
    E2M1_UE8M0_AMAX_MARGIN,
    E4M3_AMAX_MARGIN,
    FP4_E4M3_AMAX_MARGIN,
)

__all__ = [
    "FORMATS",
    "RecordLayout",
    "decode_bytes",
    "encode_group",
    "flush",
    "record_layout",
]

_NAN_BITS = 0x7FC00000
_SIGN = -0x80000000  # 0x80000000 as an int32
_EXP_MASK = 0x7F800000

# E2M1 midpoints and their tie direction (numerics.elements.e2m1_encode): at a "down" midpoint an exact tie
# keeps the lower code, at an "up" midpoint it takes the upper one (the neighbour with the even code).
_E2M1_DOWN = (0.25, 1.25, 2.5, 5.0)
_E2M1_UP = (0.75, 1.75, 3.5)


# ------------------------------------------------------------------------------------------------ bit helpers


def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def _f32(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits.astype(jnp.int32), jnp.float32)


def _pow2(e: jax.Array) -> jax.Array:
    """``2^e`` for integer ``-126 <= e <= 127`` (a normal float32, from its bit pattern)."""
    return _f32((e + 127) << 23)


def flush(x: jax.Array) -> jax.Array:
    """Float32 subnormals to zero of the same sign (numerics' ``flush_subnormals``)."""
    b = _bits(x)
    return _f32(jnp.where((b & _EXP_MASK) == 0, b & _SIGN, b))


def scale_by_pow2(v: jax.Array, e: jax.Array) -> jax.Array:
    """``v · 2^e`` for ``-127 <= e <= 127`` as two exact normal factors, then the subnormal flush."""
    lo = e >> 1  # floor(e / 2): both halves stay normal for every exponent a UE8M0 byte can hold
    return flush(v * _pow2(lo) * _pow2(e - lo))


# ------------------------------------------------------------------------------------------------ decoding


def e4m3_value(code: jax.Array) -> jax.Array:
    """Float32 value of E4M3 bytes (int array, 0..255); ``0x7F``/``0xFF`` are NaN. Exact."""
    c = code.astype(jnp.int32)
    sign = (c >> 7) & 1
    exp = (c >> 3) & 15
    man = c & 7
    normal = _f32((sign << 31) | ((exp + 120) << 23) | (man << 20))
    sub = man.astype(jnp.float32) * jnp.float32(2.0**-9)
    sub = jnp.where(sign == 1, -sub, sub)
    value = jnp.where(exp == 0, sub, normal)
    return jnp.where((c & 0x7F) == 0x7F, _f32(jnp.full(c.shape, _NAN_BITS, jnp.int32)), value)


def e2m1_value(code: jax.Array) -> jax.Array:
    """Float32 value of 4-bit E2M1 codes (int array, 0..15). Exact."""
    c = code.astype(jnp.int32)
    sign = (c >> 3) & 1
    exp = (c >> 1) & 3
    man = c & 1
    normal = _f32((sign << 31) | ((exp + 126) << 23) | (man << 22))
    sub = man.astype(jnp.float32) * jnp.float32(0.5)
    sub = jnp.where(sign == 1, -sub, sub)
    return jnp.where(exp == 0, sub, normal)


def apply_ue8m0(values: jax.Array, byte: jax.Array) -> jax.Array:
    """``values · 2^(byte - 127)``, flushed; byte 255 gives NaN (numerics' ``scale_by_pow2``)."""
    b = byte.astype(jnp.int32)
    out = scale_by_pow2(values, jnp.minimum(b, 254) - 127)
    return jnp.where(b == 255, _f32(jnp.full(b.shape, _NAN_BITS, jnp.int32)), out)


class RecordLayout:
    """Where element ``c`` of a record lives: its code byte (and nibble), its scale byte(s).

    ``kind`` is one of :data:`FORMATS`; ``n`` the number of elements. ``"fp8_latent"`` is the DeepSeek-V3 FP8
    latent record of :mod:`deepinfer_jax.cache.paged` (``C`` E4M3 codes, one float32 scale per 128 latent values,
    then the ``R`` rope values in bf16); it needs ``rope`` (``R``) and ``n`` = ``C``.
    """

    def __init__(self, kind: str, n: int, rope: int = 0) -> None:
        if kind not in FORMATS:
            raise ValueError(f"record kind must be one of {FORMATS}, got {kind!r}")
        self.kind, self.n, self.rope = kind, int(n), int(rope)
        if kind in ("fp4", "mxfp4") and self.n % 2:
            raise ValueError(f"{kind} records need an even element count, got {n}")

    @property
    def group(self) -> int:
        return {"mxfp8": 32, "fp4": 16, "mxfp4": 32, "fp8_latent": 128}.get(self.kind, 0)

    @property
    def code_bytes(self) -> int:
        return self.n // 2 if self.kind in ("fp4", "mxfp4") else self.n

    @property
    def num_groups(self) -> int:
        return -(-self.n // self.group) if self.group else 0

    @property
    def record_bytes(self) -> int:
        if self.kind == "float":
            return 0
        scale = 4 if self.kind == "fp8_latent" else 1
        return self.code_bytes + scale * self.num_groups + 2 * self.rope


FORMATS: tuple[str, ...] = ("float", "mxfp8", "fp4", "mxfp4", "fp8_latent")


def record_layout(kind: str | None, n: int, rope: int = 0) -> RecordLayout:
    """The :class:`RecordLayout` of a format name (``None`` means unquantised float storage)."""
    return RecordLayout("float" if kind is None else kind, n, rope)


def decode_bytes(load, layout: RecordLayout, cols: jax.Array) -> jax.Array:
    """Values ``[rows, len(cols)]`` float32 of elements ``cols`` of some records.

    ``load(byte_cols)`` returns the record bytes (int32) at byte offsets ``byte_cols`` (an int array broadcast
    against the rows: ``[1, n]``) for every row, as ``[rows, n]``; for ``"float"`` storage it returns the stored
    values. ``cols`` is an int32 row vector ``[1, n]`` of element indices (already clamped into range).
    For ``"fp8_latent"`` records, columns ``>= layout.n`` address the bf16 rope values.
    """
    kind, n = layout.kind, layout.n
    if kind == "float":
        return load(cols).astype(jnp.float32)
    if kind == "mxfp8":
        return apply_ue8m0(e4m3_value(load(cols)), load(n + cols // 32))
    if kind in ("fp4", "mxfp4"):
        byte = load(cols // 2)
        nib = (byte >> ((cols & 1) * 4)) & 15
        v = e2m1_value(nib)
        if kind == "mxfp4":
            return apply_ue8m0(v, load(n // 2 + cols // 32))
        return flush(v * e4m3_value(load(n // 2 + cols // 16)))
    # fp8_latent: C E4M3 codes, ceil(C/128) little-endian float32 scales, then R little-endian bf16 rope values
    latent = cols < n
    c = jnp.minimum(cols, n - 1)
    base = n + 4 * (c // 128)
    sbits = load(base) | (load(base + 1) << 8) | (load(base + 2) << 16) | (load(base + 3) << 24)
    lat = flush(e4m3_value(load(c)) * _f32(sbits))
    r = jnp.maximum(cols - n, 0)
    rbase = n + 4 * layout.num_groups + 2 * r
    rope = _f32((load(rbase) | (load(rbase + 1) << 8)) << 16)
    return jnp.where(latent, lat, rope)


# ------------------------------------------------------------------------------------------------ encoding


def _ceil_log2_ratio(c: jax.Array, q: float) -> jax.Array:
    """``ceil(log2(c / q))`` for positive normal ``c``, exactly (no division).

    The reference takes ``ceil(log2(fl(c / q)))``. Rounding can only change that where ``c / q`` lies within
    half an ulp above a power of two ``2^k`` without being one; ``c`` then differs from the exact ``q · 2^k`` by
    less than one of its own ulps, impossible for ``q = 448 = 7·2^6`` or ``q = 6 = 3·2``, whose multiples by
    ``2^k`` are float32 numbers. So the answer is the least ``e`` with ``c <= q · 2^e``: an estimate from the
    bits of ``c · (1/q)``, corrected by comparing ``c · 2^-e`` (exact) with ``q``.
    """
    est = c * jnp.float32(1.0 / q)
    e = ((_bits(est) - 1) >> 23) + 1 - 127
    e = jnp.clip(e, -126, 127)
    t = c * _pow2(jnp.clip(-e, -126, 127))  # exact: -e in range, c · 2^-e close to q (normal)
    # For q = 6 and 448 the estimate was already exact on every input the tests try (thresholds, their float32
    # neighbours, wide random ranges); the two exact corrections make the rule independent of that.
    e = jnp.where(t > q, e + 1, e)
    e = jnp.where(t * 2.0 <= q, e - 1, e)
    return e


def _e4m3_rne_nonneg(a: jax.Array) -> jax.Array:
    """E4M3 magnitude code (int32, 0..126) of a non-negative normal-or-zero float32 ``a <= 448``, RNE.

    Integer rounding of the 24-bit significand to 3 mantissa bits, or to multiples of ``2^-9`` below ``2^-6``
    (E4M3 subnormals); a carry moves into the exponent naturally.
    """
    b = _bits(a)
    e = ((b >> 23) & 255) - 127
    sig = (b & 0x7FFFFF) | 0x800000
    shift = jnp.clip(20 + jnp.maximum(-6 - e, 0), 0, 30)  # >= 25 already rounds every significand to 0
    q = sig >> shift
    rem = sig - (q << shift)
    half = (1 << shift) >> 1
    q = q + jnp.where((rem > half) | ((rem == half) & ((q & 1) == 1)), 1, 0)
    code = (jnp.maximum(e, -6) + 6) * 8 + q
    return jnp.where(a == 0.0, 0, code)


def _fp4_scale_code(c: jax.Array) -> jax.Array:
    """E4M3 code of ``min(c / 6, 448)`` rounded to nearest even, exactly (``c >= 6 · 2^-9``).

    The reference rounds ``fl(c / 6)`` to E4M3. An E4M3 midpoint ``m`` has at most 5 significant bits, so ``6m``
    is a float32 and ``c / 6`` cannot sit strictly within half an ulp of ``m`` unless ``c == 6m``: rounding the
    quotient first never moves it across a midpoint. An estimate from ``c · (1/6)`` is therefore corrected by
    comparing ``c`` with ``6 ·`` the midpoints around it (exact products), ties to the even code.
    """
    est = jnp.minimum(c * jnp.float32(1.0 / 6.0), 448.0)
    k = _e4m3_rne_nonneg(est)
    for _ in range(2):  # the estimate is off by at most one code
        up = jnp.minimum(k + 1, 126)
        mid_up = (e4m3_value(k) + e4m3_value(up)) * 0.5 * 6.0
        go_up = (k < 126) & ((c > mid_up) | ((c == mid_up) & ((up & 1) == 0)))
        down = jnp.maximum(k - 1, 0)
        mid_dn = (e4m3_value(down) + e4m3_value(k)) * 0.5 * 6.0
        go_dn = (k > 0) & ((c < mid_dn) | ((c == mid_dn) & ((down & 1) == 0)))
        k = jnp.where(go_up, up, jnp.where(go_dn, down, k))
    return k


def encode_group(x: jax.Array, kind: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Quantise groups: ``x [..., g]`` float32 -> ``(codes [..., g] int32, scale code [...] int32, ok [...])``.

    ``kind``: ``"mxfp8"`` (E4M3 codes, UE8M0 scale), ``"mxfp4"`` (E2M1 codes, UE8M0), ``"fp4"`` (E2M1 codes, E4M3
    scale per 16). E2M1 codes are 4-bit (sign in bit 3), unpacked. Poisoned groups (a NaN or an infinity) get the
    format's NaN scale and zero codes, like the reference. ``ok`` is false for poisoned groups.
    """
    xf = flush(x)
    a = jnp.abs(xf)
    finite = a < jnp.float32(float("inf"))  # false for inf and NaN
    ok = jnp.min(finite.astype(jnp.int32), axis=-1) == 1  # (a min, not jnp.all: Triton has no and-reduction)
    amax = jnp.max(jnp.where(finite, a, 0.0), axis=-1)
    neg = (_bits(xf) >> 31) & 1
    if kind in ("mxfp8", "mxfp4"):
        qmax, margin = (448.0, E4M3_AMAX_MARGIN) if kind == "mxfp8" else (6.0, E2M1_UE8M0_AMAX_MARGIN)
        c = jnp.maximum(amax, jnp.float32(margin))
        e = _ceil_log2_ratio(c, qmax)
        scode = jnp.where(ok, e + 127, 255)
        y = scale_by_pow2(a, -e[..., None])  # exact |x| / 2^e (flushed, as the reference's quotient)
        if kind == "mxfp8":
            mag = _e4m3_rne_nonneg(jnp.minimum(y, 448.0))
            codes = mag | (neg << 7)
        else:
            mag = jnp.zeros(y.shape, jnp.int32)
            for t in _E2M1_DOWN:
                mag = mag + (y > t).astype(jnp.int32)
            for t in _E2M1_UP:
                mag = mag + (y >= t).astype(jnp.int32)
            codes = mag | (neg << 3)
    elif kind == "fp4":
        c = jnp.maximum(amax, jnp.float32(FP4_E4M3_AMAX_MARGIN))
        k = _fp4_scale_code(c)
        scode = jnp.where(ok, k, 0x7F)
        sf = e4m3_value(k)[..., None]
        # |x| / sf compared with each E2M1 midpoint t as |x| against t·sf (exact: t has <= 3 significant
        # bits, sf <= 4): fl(|x| / sf) > t exactly when |x| > t·sf, since |x| != t·sf means the quotient is at
        # least a whole ulp of t·sf / sf away from t, more than half an ulp of t.
        mag = jnp.zeros(a.shape, jnp.int32)
        for t in _E2M1_DOWN:
            mag = mag + (a > t * sf).astype(jnp.int32)
        for t in _E2M1_UP:
            mag = mag + (a >= t * sf).astype(jnp.int32)
        codes = mag | (neg << 3)
    else:
        raise ValueError(f"encode_group: kind must be 'mxfp8', 'mxfp4' or 'fp4', got {kind!r}")
    codes = jnp.where(ok[..., None], codes, 0)
    return codes, scode, ok
