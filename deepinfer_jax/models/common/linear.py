"""Linear layers over weights kept in their checkpoint format, dense or grouped by expert.

A linear weight is a small dict whose *keys* tell its storage format. Keys are pytree structure, so the format
is known at trace time and no ``if`` on a runtime value is needed:

* ``{"weight": W}`` -- an unquantised ``[out, in]`` (or ``[E, out, in]`` for experts) float array, used as
  stored (float32 in parity mode, bfloat16 in production mode);
* ``{"weight": codes, "scale": s}`` -- FP8 E4M3 block-scaled: ``codes`` are the E4M3 bytes (``uint8`` or
  ``float8_e4m3fn``), ``s`` the block scales on the ceil-div grid of :attr:`LinearNumerics.block` (float32
  ``weight_scale_inv`` for V3, UE8M0 bytes for V4/V4.1);
* ``{"packed": p, "scale": s}`` -- MXFP4 (two E2M1 codes per byte, one UE8M0 scale per 32 inputs).

Quantised weights are never dequantised as a whole: FP8 GEMMs go through the ``fp8_block_linear`` op (so a
kernel backend can take them), the others through :mod:`deepinfer_jax.numerics.qlinear`; both decode one tile
at a time. :class:`LinearNumerics` carries the two static facts those calls need (the
FP8 block shape and the activation round trip of the precision mode, ``ARCHITECTURE.md`` §8).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax import ops
from deepinfer_jax.numerics import qlinear
from deepinfer_jax.numerics.activation import ACTIVATION_CAST_KINDS, V3_ACTIVATION_BLOCK

__all__ = [
    "LinearNumerics",
    "grouped_linear",
    "linear",
    "linear_format",
    "linear_out_features",
]

LinearParams = Mapping[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class LinearNumerics:
    """Static numerics of the quantised linears of one model (hashable, so it can be a jit static argument).

    Attributes:
      block: ``(rows, cols)`` of one FP8 weight scale block (``(128, 128)`` for V3, ``(32, 32)`` for V4.1);
        ``None`` when the model has no FP8 weights.
      activation_cast: the round trip applied to every activation entering an FP8/FP4 GEMM: ``"none"``
        (float32 parity mode: weight-only dequantisation), ``"fp8_token_block"`` (V3 production: E4M3 per token
        per ``activation_block`` channels) or ``"mxfp8"`` (V4/V4.1 production). Unquantised weights never see it.
      activation_block: channel group of the ``"fp8_token_block"`` cast (128 for V3).
    """

    block: tuple[int, int] | None = None
    activation_cast: str = "none"
    activation_block: int = V3_ACTIVATION_BLOCK

    def __post_init__(self) -> None:
        if self.block is not None and (
            not isinstance(self.block, tuple)
            or len(self.block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in self.block)
        ):
            raise ValueError(f"LinearNumerics.block: expected None or two positive ints, got {self.block!r}")
        if self.activation_cast not in ACTIVATION_CAST_KINDS:
            raise ValueError(
                f"LinearNumerics.activation_cast: {self.activation_cast!r} is not one of {ACTIVATION_CAST_KINDS}"
            )
        if (
            isinstance(self.activation_block, bool)
            or not isinstance(self.activation_block, int)
            or self.activation_block < 1
        ):
            raise ValueError(
                f"LinearNumerics.activation_block: expected a positive int, got {self.activation_block!r}"
            )

    def fp8_block(self) -> tuple[int, int]:
        if self.block is None:
            raise ValueError(
                "LinearNumerics.block is None but an FP8 weight (keys 'weight' + 'scale') was given; "
                "build the numerics from the checkpoint's quantization_config.weight_block_size"
            )
        return self.block


def linear_format(p: LinearParams) -> str:
    """``"dense"``, ``"fp8"`` or ``"mxfp4"``, from the keys of a linear weight dict (see the module docstring)."""
    if not isinstance(p, Mapping):
        raise TypeError(f"linear weight: expected a dict of arrays, got {type(p).__name__}")
    keys = set(p)
    if keys == {"weight"}:
        return "dense"
    if keys == {"weight", "scale"}:
        return "fp8"
    if keys == {"packed", "scale"}:
        return "mxfp4"
    raise ValueError(
        f"linear weight: keys {sorted(keys)} match no format; expected {{'weight'}} (dense), "
        "{'weight', 'scale'} (FP8 block-scaled) or {'packed', 'scale'} (MXFP4)"
    )


def linear_out_features(p: LinearParams) -> int:
    """Number of output rows of a (dense or grouped) linear weight dict."""
    w = p["packed"] if "packed" in p else p["weight"]
    return int(w.shape[-2])


def _dense_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [..., in] · w [out, in]ᵀ`` accumulated in float32.

    bf16 operands stay bf16 into the GEMM (production numerics); mixed operands meet in the wider dtype, so a
    float32 weight (the router) never rounds a bf16 activation's product down to bf16.
    """
    common = jnp.promote_types(x.dtype, w.dtype)
    return lax.dot_general(
        x.astype(common),
        w.astype(common),
        (((x.ndim - 1,), (1,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def linear(x: jax.Array, p: LinearParams, numerics: LinearNumerics, *, out_dtype: Any = None) -> jax.Array:
    """``y = x · Wᵀ`` for any weight format; float32 accumulation, result in ``out_dtype`` (default ``x.dtype``).

    A dense weight multiplies the activation as given; an FP8 or MXFP4 weight first applies the
    precision mode's activation round trip (``numerics.activation_cast``), then decodes tile by tile.
    """
    out = jnp.dtype(out_dtype or x.dtype)
    fmt = linear_format(p)
    if fmt == "dense":
        w = p["weight"]
        if w.ndim != 2 or w.shape[1] != x.shape[-1]:
            raise ValueError(f"linear: weight {w.shape} does not take inputs of width {x.shape[-1]}")
        return _dense_matmul(x, w).astype(out)
    if fmt == "fp8" and (
        numerics.activation_cast != "fp8_token_block" or numerics.activation_block == V3_ACTIVATION_BLOCK
    ):
        # Through the op registry, so an accelerator backend (Pallas / CuteDSL / Ascend) takes over the GEMM.
        lead = x.shape[:-1]
        y = ops.call(
            "fp8_block_linear",
            x.reshape(-1, x.shape[-1]),
            p["weight"],
            p["scale"],
            block=numerics.fp8_block(),
            activation_cast=numerics.activation_cast,
            out_dtype=out,
        )
        return y.reshape(*lead, y.shape[-1])
    if fmt == "fp8":  # an activation block the op does not cover
        return qlinear.fp8_linear(
            x,
            p["weight"],
            p["scale"],
            block=numerics.fp8_block(),
            activation_cast=numerics.activation_cast,
            activation_block=numerics.activation_block,
            out_dtype=out,
        )
    return qlinear.mxfp4_linear(
        x,
        p["packed"],
        p["scale"],
        activation_cast=numerics.activation_cast,
        activation_block=numerics.activation_block,
        out_dtype=out,
    )


def _grouped_dense(x: jax.Array, w: jax.Array, ids: jax.Array, out_dtype: Any) -> jax.Array:
    """Per-row expert GEMM for unquantised experts ``w [E, out, in]``: loop over experts, skip unused ones.

    The same loop shape as :func:`deepinfer_jax.numerics.qlinear.grouped_fp8_linear` (one GEMM per expert
    that received rows; ``lax.ragged_dot`` needs far more temporary memory on XLA:CPU). Rows whose id is
    outside ``[0, E)`` come out as zeros.
    """
    num_experts, rows, _ = w.shape

    def body(e: jax.Array, y: jax.Array) -> jax.Array:
        mask = ids == e

        def run(y: jax.Array) -> jax.Array:
            we = lax.dynamic_index_in_dim(w, e, axis=0, keepdims=False)
            return jnp.where(mask[:, None], _dense_matmul(x, we), y)

        return lax.cond(jnp.any(mask), run, lambda y: y, y)

    y = lax.fori_loop(0, num_experts, body, jnp.zeros((x.shape[0], rows), jnp.float32))
    return y.astype(out_dtype)


def grouped_linear(
    x: jax.Array, p: LinearParams, ids: jax.Array, numerics: LinearNumerics, *, out_dtype: Any = None
) -> jax.Array:
    """``y[t] = x[t] · W[ids[t]]ᵀ`` for expert weights ``[E, out, in]`` in any format -> ``[T, out]``.

    ``x`` is ``[T, in]`` and ``ids`` ``int [T]``; quantised experts go through qlinear's grouped forms.
    """
    out = jnp.dtype(out_dtype or x.dtype)
    if x.ndim != 2:
        raise ValueError(f"grouped_linear: x must be [tokens, in], got shape {x.shape}")
    if ids.shape != (x.shape[0],):
        raise ValueError(f"grouped_linear: ids must have shape ({x.shape[0]},), got {ids.shape}")
    fmt = linear_format(p)
    if fmt == "dense":
        w = p["weight"]
        if w.ndim != 3 or w.shape[2] != x.shape[1]:
            raise ValueError(f"grouped_linear: weight {w.shape} is not [E, out, {x.shape[1]}]")
        return _grouped_dense(x, w, ids, out)
    if fmt == "fp8":
        return qlinear.grouped_fp8_linear(
            x,
            p["weight"],
            p["scale"],
            expert_ids=ids,
            block=numerics.fp8_block(),
            activation_cast=numerics.activation_cast,
            activation_block=numerics.activation_block,
            out_dtype=out,
        )
    return qlinear.grouped_mxfp4_linear(
        x,
        p["packed"],
        p["scale"],
        expert_ids=ids,
        activation_cast=numerics.activation_cast,
        activation_block=numerics.activation_block,
        out_dtype=out,
    )
