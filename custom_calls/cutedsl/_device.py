"""Device-side helpers shared by the CuteDSL kernels: E4M3/E2M1 element and UE8M0 scale decoding, SwiGLU.

The kernels receive FP8 and FP4 codes as raw bytes (``uint8``) and decode them with integer arithmetic, which is
exact and independent of the hardware conversion instructions a given GPU generation offers:

* E4M3 (``s eeee mmm``): a normal code is ``(8 + m) · 2^(e-10)``, a subnormal one ``m · 2^-9``. Both are an
  integer times ``2^-9`` (``(8 + m) << (e - 1)`` or ``m``), so the value is one int→float conversion and one
  exact multiplication; ``0x7F``/``0xFF`` are NaN.
* E2M1 (``s ee m``): the eight magnitudes ``0, .5, 1, 1.5, 2, 3, 4, 6`` are an integer times ``0.5``
  (``m`` or ``(2 + m) << (e - 1)``).
* UE8M0 scale byte ``b`` means ``2^(b-127)`` (255 is NaN). It is applied as two multiplications by normal powers
  of two, ``2^lo · 2^hi`` with ``lo + hi = b - 127``, built from their bit patterns: ``2^-127`` (byte 0) is not a
  normal float, but each half is, which is the same split the reference codecs use.

:func:`clamped_swiglu` is the float32 epilogue of model.md §5.4, shared by the elementwise and the fused kernels.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

_E4M3_UNIT = 0.001953125  # 2^-9: the E4M3 value of integer step 1
_NAN_BITS = 0x7FC00000


@cute.jit
def pow2(e: cutlass.Int32) -> cutlass.Float32:
    """``2^e`` for a normal exponent ``-126 <= e <= 127``, from its bit pattern."""
    return cutlass.Uint32((e + 127) << 23).bitcast(cutlass.Float32)


@cute.jit
def e4m3_to_f32(code: cutlass.Int32) -> cutlass.Float32:
    """Float value of the E4M3 byte ``code`` (0..255)."""
    e = (code >> 3) & 0xF
    m = code & 0x7
    steps = m
    if e > 0:
        steps = (8 + m) << (e - 1)
    value = cutlass.Float32(steps) * cutlass.Float32(_E4M3_UNIT)
    if (code & 0x7F) == 0x7F:
        value = cutlass.Uint32(_NAN_BITS).bitcast(cutlass.Float32)
    if (code & 0x80) != 0:
        value = -value
    return value


@cute.jit
def e2m1_to_f32(code: cutlass.Int32) -> cutlass.Float32:
    """Float value of the 4-bit E2M1 code ``code`` (0..15)."""
    e = (code >> 1) & 0x3
    m = code & 0x1
    halves = m
    if e > 0:
        halves = (2 + m) << (e - 1)
    value = cutlass.Float32(halves) * cutlass.Float32(0.5)
    if (code & 0x8) != 0:
        value = -value
    return value


@cute.jit
def apply_ue8m0(value: cutlass.Float32, scale_byte: cutlass.Int32) -> cutlass.Float32:
    """``value · 2^(scale_byte - 127)``; byte 255 gives NaN."""
    e = scale_byte - 127
    lo = e >> 1  # floor(e / 2), so both halves stay in the normal range for every byte 0..254
    out = value * pow2(lo) * pow2(e - lo)
    if scale_byte == 255:
        out = cutlass.Uint32(_NAN_BITS).bitcast(cutlass.Float32)
    return out


@cute.jit
def clamped_swiglu(
    gate: cutlass.Float32, up: cutlass.Float32, limit: cutlass.Constexpr[float | None]
) -> cutlass.Float32:
    """model.md §5.4 in float32: ``g = min(gate, L)``, ``v = clamp(up, -L, L)``, ``g · sigmoid(g) · v``."""
    g = gate
    v = up
    if cutlass.const_expr(limit is not None):
        lim = cutlass.Float32(limit)
        g = cute.arch.fmin(g, lim)
        v = cute.arch.fmax(cute.arch.fmin(v, lim), -lim)
    return g / (cutlass.Float32(1.0) + cute.math.exp(-g)) * v
