"""Pieces shared by the Pallas GPU kernels: tile tables, in-kernel decoders, and the CUDA export recipe.

In-kernel decoders build float32 values from integer bit patterns (shifts, masks, ``bitcast``) instead of
converting through float8 types or looking values up in a table: those three operations lower on every Triton
version and in interpret mode alike, and give the same exact values as :mod:`deepinfer_jax.numerics` (every E4M3
and E2M1 value, and every power-of-two scale from byte 1 to 254, is a normal float32).

Two documented differences from the reference codecs, both far below any tolerance a GEMM is checked with:
a UE8M0 scale byte 0 (``2^-127``) decodes to 0 here, and products that land in the float32 subnormal range are
not flushed to zero. NaN scale bytes (``0xFF``) and E4M3 NaN codes do give NaN, like the reference: a poisoned
block must never turn into plausible numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

#: The abstract GPU a CUDA export lowers for when no GPU is attached (Triton lowering needs a device kind).
EXPORT_DEVICE_KIND = "NVIDIA H100"
EXPORT_NUM_CORES = 132
#: The custom-call target of a Pallas Triton kernel in lowered StableHLO.
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One kernel configuration: the output tile (``block_t`` rows × ``block_n`` columns), the reduction step
    ``block_k``, and Triton's ``num_warps`` / ``num_stages``. Block sizes are powers of two (Triton tensors),
    at least 16 (the smallest ``tl.dot``)."""

    block_t: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_t", "block_n", "block_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"Tiles.{name} must be a power of two >= 16, got {value!r}")
        for name in ("num_warps", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Tiles.{name} must be a positive int, got {value!r}")


def next_pow2(n: int, minimum: int = 16) -> int:
    """The smallest power of two ``>= max(n, minimum)``."""
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


def pick_tiles(
    table: Sequence[tuple[int, Tiles]], rows: int, n: int, k: int, *, k_multiple: int = 16
) -> Tiles:
    """The table entry for ``rows`` GEMM rows, shrunk to the problem so tiny shapes do not pay for huge tiles.

    ``table`` is a list of ``(max_rows, tiles)`` sorted by ``max_rows``; the first entry whose bound covers
    ``rows`` wins, the last one covers everything larger. The choice depends on shapes only, never on the
    device (which may not be the machine that traces, for an exported program).
    """
    chosen = table[-1][1]
    for bound, tiles in table:
        if rows <= bound:
            chosen = tiles
            break
    return dataclasses.replace(
        chosen,
        block_t=min(chosen.block_t, next_pow2(rows)),
        block_n=min(chosen.block_n, next_pow2(n)),
        block_k=max(min(chosen.block_k, next_pow2(k)), k_multiple),
    )


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------------------ decoders

_F32_NAN = float("nan")


def _bits_to_f32(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits.astype(jnp.int32), jnp.float32)


def e4m3_bits_to_f32(codes: jax.Array) -> jax.Array:
    """E4M3 codes (any integer dtype, values 0..255) to float32; ``0x7F``/``0xFF`` give NaN."""
    c = codes.astype(jnp.int32)
    sign = (c >> 7) & 1
    exp = (c >> 3) & 15
    man = c & 7
    normal = _bits_to_f32((sign << 31) | ((exp + 120) << 23) | (man << 20))
    sub = man.astype(jnp.float32) * jnp.float32(2.0**-9)
    sub = jnp.where(sign == 1, -sub, sub)
    value = jnp.where(exp == 0, sub, normal)
    return jnp.where((c & 0x7F) == 0x7F, jnp.float32(_F32_NAN), value)


def e2m1_bits_to_f32(codes: jax.Array) -> jax.Array:
    """4-bit E2M1 codes (values 0..15) to float32: ``±{0, 0.5, 1, 1.5, 2, 3, 4, 6}``."""
    c = codes.astype(jnp.int32)
    sign = (c >> 3) & 1
    exp = (c >> 1) & 3
    man = c & 1
    normal = _bits_to_f32((sign << 31) | ((exp + 126) << 23) | (man << 22))
    sub = man.astype(jnp.float32) * jnp.float32(0.5)
    sub = jnp.where(sign == 1, -sub, sub)
    return jnp.where(exp == 0, sub, normal)


def apply_ue8m0(values: jax.Array, scale_bytes: jax.Array) -> jax.Array:
    """``values · 2^(b - 127)`` for UE8M0 bytes ``b`` (see the module docstring for bytes 0 and 255)."""
    b = scale_bytes.astype(jnp.int32)
    scaled = values * _bits_to_f32(b << 23)
    return jnp.where(b == 255, jnp.float32(_F32_NAN), scaled)


def swiglu_f32(gate: jax.Array, up: jax.Array, limit: float | None) -> jax.Array:
    """Clamped SwiGLU of float32 halves (model.md §5.4): ``silu(min(g, L)) · clamp(u, -L, L)``."""
    if limit is not None:
        # Python floats, not jnp scalars: Triton lowering cannot negate a constant array.
        gate = jnp.minimum(gate, float(limit))
        up = jnp.clip(up, -float(limit), float(limit))
    return gate * jax.nn.sigmoid(gate) * up


def dot_nt(a: jax.Array, b: jax.Array, compute_dtype: Any) -> jax.Array:
    """``a [M, K] · b [N, K]ᵀ`` with float32 accumulation.

    bf16 operands multiply exactly into the float32 accumulator (the dequantised weights and the MXFP8-cast
    activations are exact in bf16), so production mode runs at tensor-core speed without changing the
    products; float32 operands use the IEEE (``HIGHEST``) algorithm to match the float32 reference.
    """
    precision = lax.Precision.HIGHEST if jnp.dtype(compute_dtype) == jnp.float32 else lax.Precision.DEFAULT
    return lax.dot_general(
        a.astype(compute_dtype),
        b.astype(compute_dtype),
        (((1,), (1,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )


def compute_dtype_for(x_dtype: Any) -> Any:
    """bf16 GEMM operands for bf16 activations (production), float32 for everything else (parity mode)."""
    return jnp.bfloat16 if jnp.dtype(x_dtype) == jnp.bfloat16 else jnp.float32


def compiler_params(tiles: Tiles) -> Any:
    """Triton compiler parameters of ``tiles`` (ignored by interpret mode)."""
    from jax.experimental.pallas import triton as pl_triton

    return pl_triton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)


# ------------------------------------------------------------------------------------------------ export


def export_for_cuda(fn: Callable[..., Any], *args: jax.ShapeDtypeStruct) -> Any:
    """``jax.export`` ``fn`` for CUDA on any machine: the recipe for Triton lowering without a GPU.

    Triton lowering reads the GPU's kind from the context, so the export runs under an abstract mesh whose
    device is an H100 (the oldest architecture these kernels target). ``args`` must be shape structs: creating
    arrays inside that context is an error. Returns the :class:`jax.export.Exported`.
    """
    from jax import export

    device = jax.sharding.AbstractDevice(
        device_kind=EXPORT_DEVICE_KIND, num_cores=EXPORT_NUM_CORES, platform="gpu"
    )
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        return export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)],
        )(*args)
