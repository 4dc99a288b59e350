"""FP8 block-scaled GEMM (model.md §5.2, §12.1.1, §12.2), registered as op ``"fp8_block_linear"``.

``y = Q(x) · deq(W)ᵀ`` for an E4M3 weight ``W [N, K]`` with one scale per ``b0 × b1`` block: UE8M0 bytes
(V4/V4.1, 32×32 blocks) or float32 ``weight_scale_inv`` (V3, 128×128). ``Q`` is the activation round trip of the
precision mode: ``"none"`` (float32 parity mode, weight-only quantisation), ``"mxfp8"`` (V4/V4.1 production: E4M3
per token per 32 channels with a power-of-two scale) or ``"fp8_token_128"`` (V3 production: E4M3 per token per
128 channels with a float32 scale). Accumulation is float32; the result is rounded once to ``out_dtype``.

The reference is :func:`deepinfer_jax.numerics.qlinear.fp8_linear`, which decodes the weight one tile of output
rows at a time and never holds a dequantised copy of the whole weight. Kernels of the same name and signature
are registered per backend: ``pallas_gpu`` (``pallas_kernels/fp8_block_linear.py``, Triton) and ``ascend`` (a
named custom call, ``custom_calls/ascend``); the CuteDSL SM100 kernel registers itself from ``custom_calls``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.numerics import qlinear
from deepinfer_jax.numerics.activation import V3_ACTIVATION_BLOCK
from deepinfer_jax.numerics.codecs import check_block
from deepinfer_jax.ops.registry import register_impl, register_op

__all__ = ["GEMM_ACTIVATION_CASTS", "canonical_activation_cast", "fp8_block_linear"]

#: Activation casts the quantised GEMM ops accept (``"fp8_token_block"``, the name
#: :class:`~deepinfer_jax.numerics.activation.CastPolicy` uses, is accepted as a synonym of ``"fp8_token_128"``).
GEMM_ACTIVATION_CASTS: tuple[str, ...] = ("none", "mxfp8", "fp8_token_128")

_CAST_SYNONYMS = {"fp8_token_block": "fp8_token_128"}
# The numerics package names the V3 cast by its scale layout and takes the block separately.
_NUMERICS_CAST = {"none": "none", "mxfp8": "mxfp8", "fp8_token_128": "fp8_token_block"}


def canonical_activation_cast(op: str, kind: Any, allowed: tuple[str, ...] = GEMM_ACTIVATION_CASTS) -> str:
    """Validate an ``activation_cast`` argument of op ``op`` and return its canonical name.

    A model passes its :class:`~deepinfer_jax.numerics.activation.CastPolicy` field straight through, so the
    policy's spelling ``"fp8_token_block"`` is accepted for ``"fp8_token_128"``.
    """
    if not isinstance(kind, str):
        raise TypeError(f"{op}: activation_cast must be a str, got {type(kind).__name__} {kind!r}")
    canonical = _CAST_SYNONYMS.get(kind, kind)
    if canonical not in allowed:
        raise ValueError(f"{op}: activation_cast = {kind!r} is not one of {allowed}")
    return canonical


def numerics_cast(kind: str) -> str:
    """The :func:`~deepinfer_jax.numerics.activation.activation_cast` kind of a canonical op cast name."""
    return _NUMERICS_CAST[kind]


def _check_tokens(op: str, x: Any) -> jax.Array:
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"{op}: x must have shape [tokens, in], got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{op}: x must be a floating-point array, got dtype {x.dtype}")
    return x


def _check_out_dtype(op: str, out_dtype: Any) -> jnp.dtype:
    try:
        dtype = jnp.dtype(out_dtype)
    except TypeError as e:
        raise TypeError(f"{op}: out_dtype must be a floating dtype, got {out_dtype!r}") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{op}: out_dtype must be a floating dtype, got {dtype}")
    return dtype


def fp8_block_linear(
    x: jax.Array,
    w_q: jax.Array,
    scale: jax.Array,
    *,
    block: tuple[int, int] = (32, 32),
    activation_cast: str = "none",
    out_dtype: Any = jnp.bfloat16,
) -> jax.Array:
    """``Q(x) · deq(w_q, scale)ᵀ`` -> ``[T, N]`` in ``out_dtype``, float32 accumulation (reference of the op).

    Args:
      x: activations ``[T, K]``, any float dtype.
      w_q: E4M3 codes ``[N, K]``, as ``float8_e4m3fn`` or its ``uint8`` bit pattern (the cheaper storage on
        XLA:CPU, which cannot slice float8 arrays in place).
      scale: block scales ``[ceil(N/b0), ceil(K/b1)]``: UE8M0 (``float8_e8m0fnu``/``uint8``) or float32
        ``weight_scale_inv``.
      block: ``(b0, b1)``, the rows and columns one scale covers.
      activation_cast: ``"none"``, ``"mxfp8"`` or ``"fp8_token_128"`` (module docstring).
      out_dtype: floating dtype of the result.
    """
    op = "fp8_block_linear"
    x = _check_tokens(op, x)
    kind = canonical_activation_cast(op, activation_cast)
    dtype = _check_out_dtype(op, out_dtype)
    return qlinear.fp8_linear(
        x,
        w_q,
        scale,
        block=check_block(block),
        activation_cast=numerics_cast(kind),
        activation_block=V3_ACTIVATION_BLOCK,
        out_dtype=dtype,
    )


register_op(
    "fp8_block_linear",
    fp8_block_linear,
    doc="FP8 E4M3 block-scaled GEMM with the precision mode's activation cast, f32 accumulation (model.md §5.2)",
)
register_impl(
    "fp8_block_linear",
    "pallas_gpu",
    "pallas_kernels.fp8_block_linear:fp8_block_linear",
    platforms=("gpu",),
    reason="the Pallas Triton kernel needs the pallas_kernels package",
)
register_impl(
    "fp8_block_linear",
    "ascend",
    "custom_calls.ascend.lowerings:fp8_block_linear",
    platforms=("ascend",),
    reason="the Ascend lowering needs the custom_calls package",
)
