"""Ascend lowerings: each weight-side op becomes one named custom call in StableHLO exported for ``"ascend"``.

Every op here is a JAX primitive with two lowering rules:

* on ``"ascend"``: a ``stablehlo.custom_call`` named ``deepinfer.ascend.<op>`` whose operands are the op's
  arrays as given (codes and scales in their checkpoint dtypes) and whose attributes (``mhlo.backend_config``,
  the typed-FFI dictionary) carry the static arguments: block size, activation cast, SwiGLU limit, output dtype.
  An Ascend toolchain implements these targets; :data:`CUSTOM_CALL_TARGETS` lists them;
* on every other platform: the reference computation (:mod:`deepinfer_jax.numerics`), so the same program runs
  on the CPU, and a multi-platform export (``platforms=["ascend", "cpu"]``) carries both.

The primitives have no differentiation or batching rules: they serve inference, where neither is used.

Attributes of each target (all targets also take ``out_dtype``, a dtype name):

| target | operands | attributes |
|---|---|---|
| ``deepinfer.ascend.fp8_block_linear`` | x, w_q, scale | ``block_rows``, ``block_cols``, ``activation_cast``, ``scale_format`` (``ue8m0``/``float32``) |
| ``deepinfer.ascend.mxfp4_grouped_linear`` | x, packed, scale, group_sizes | ``activation_cast`` |
| ``deepinfer.ascend.mxfp4_grouped_swiglu`` | x, gate packed, gate scale, up packed, up scale, group_sizes | ``activation_cast``, ``has_limit``, ``limit`` |
| ``deepinfer.ascend.swiglu`` | u | ``has_limit``, ``limit`` |
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import mlir

from custom_calls.ascend.platform import PLATFORM, register_ascend_platform
from deepinfer_jax.numerics import qlinear
from deepinfer_jax.numerics.activation import V3_ACTIVATION_BLOCK
from deepinfer_jax.numerics.codecs import check_block

__all__ = [
    "CUSTOM_CALL_TARGETS",
    "fp8_block_linear",
    "mxfp4_grouped_linear",
    "mxfp4_grouped_swiglu",
    "swiglu",
    "target_name",
]

_PREFIX = "deepinfer.ascend."
# Attribute spelling of each accepted cast name ("fp8_token_block" is the CastPolicy synonym of "fp8_token_128"),
# and the numerics kind each attribute value means.
_FP8_CAST_ATTR = {
    "none": "none",
    "mxfp8": "mxfp8",
    "fp8_token_128": "fp8_token_128",
    "fp8_token_block": "fp8_token_128",
}
_FP8_CAST_NUMERICS = {"none": "none", "mxfp8": "mxfp8", "fp8_token_128": "fp8_token_block"}
_MXFP4_CASTS = {"none": "none", "mxfp8": "mxfp8"}


def target_name(op: str) -> str:
    """The custom-call target of op ``op`` (``deepinfer.ascend.<op>``)."""
    return _PREFIX + op


register_ascend_platform()


def _define(
    op: str, reference: Callable[..., jax.Array], out_aval: Callable[..., jax.core.ShapedArray]
) -> Primitive:
    prim = Primitive(f"deepinfer_ascend_{op}")
    prim.def_impl(functools.partial(dispatch.apply_primitive, prim))
    prim.def_abstract_eval(out_aval)
    mlir.register_lowering(prim, mlir.lower_fun(reference, multiple_results=False))
    mlir.register_lowering(prim, jax.ffi.ffi_lowering(target_name(op)), platform=PLATFORM)
    return prim


def _swiglu_f32(gate: jax.Array, up: jax.Array, has_limit: bool, limit: float) -> jax.Array:
    g, v = gate.astype(jnp.float32), up.astype(jnp.float32)
    if has_limit:
        g = jnp.minimum(g, jnp.float32(limit))
        v = jnp.clip(v, -jnp.float32(limit), jnp.float32(limit))
    return g * jax.nn.sigmoid(g) * v


# ------------------------------------------------------------------------------------------------ fp8_block_linear


def _fp8_reference(x, w_q, scale, *, block_rows, block_cols, activation_cast, scale_format, out_dtype):
    del scale_format  # told by the scale's dtype
    return qlinear.fp8_linear(
        x,
        w_q,
        scale,
        block=(block_rows, block_cols),
        activation_cast=_FP8_CAST_NUMERICS[activation_cast],
        activation_block=V3_ACTIVATION_BLOCK,
        out_dtype=jnp.dtype(out_dtype),
    )


def _fp8_aval(x, w_q, scale, *, out_dtype, **_):
    return jax.core.ShapedArray((x.shape[0], w_q.shape[0]), jnp.dtype(out_dtype))


_fp8_p = _define("fp8_block_linear", _fp8_reference, _fp8_aval)


def _check_tokens(op: str, x: jax.Array) -> None:
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{op}: x must be a float [tokens, in] array, got {x.dtype} {x.shape}")


def _check_cast(op: str, kind: str, allowed: dict[str, str]) -> None:
    if kind not in allowed:
        raise ValueError(f"{op}: activation_cast = {kind!r} is not one of {tuple(allowed)}")


def fp8_block_linear(
    x: jax.Array,
    w_q: jax.Array,
    scale: jax.Array,
    *,
    block: tuple[int, int] = (32, 32),
    activation_cast: str = "none",
    out_dtype: Any = jnp.bfloat16,
) -> jax.Array:
    """Op ``fp8_block_linear`` as the custom call ``deepinfer.ascend.fp8_block_linear`` (reference elsewhere)."""
    b0, b1 = check_block(block)
    x, w_q, scale = jnp.asarray(x), jnp.asarray(w_q), jnp.asarray(scale)
    _check_tokens("fp8_block_linear", x)
    _check_cast("fp8_block_linear", activation_cast, _FP8_CAST_ATTR)
    if w_q.ndim != 2 or w_q.shape[1] != x.shape[1]:
        raise ValueError(f"fp8_block_linear: w_q must have shape [N, {x.shape[1]}], got {w_q.shape}")
    return _fp8_p.bind(
        x,
        w_q,
        scale,
        block_rows=b0,
        block_cols=b1,
        activation_cast=_FP8_CAST_ATTR[activation_cast],
        scale_format="float32" if scale.dtype == jnp.float32 else "ue8m0",
        out_dtype=jnp.dtype(out_dtype).name,
    )


# ------------------------------------------------------------------------------------------------ grouped MXFP4


def _grouped_reference(x, packed, scale, group_sizes, *, activation_cast, out_dtype):
    return qlinear.grouped_mxfp4_linear(
        x,
        packed,
        scale,
        group_sizes=group_sizes,
        activation_cast=activation_cast,
        out_dtype=jnp.dtype(out_dtype),
    )


def _grouped_aval(x, packed, *_, out_dtype, **__):
    return jax.core.ShapedArray((x.shape[0], packed.shape[1]), jnp.dtype(out_dtype))


_grouped_p = _define("mxfp4_grouped_linear", _grouped_reference, _grouped_aval)


def _grouped_swiglu_reference(
    x, gp, gs, up, us, group_sizes, *, activation_cast, has_limit, limit, out_dtype
):
    common = dict(group_sizes=group_sizes, activation_cast=activation_cast, out_dtype=jnp.float32)
    g = qlinear.grouped_mxfp4_linear(x, gp, gs, **common)
    u = qlinear.grouped_mxfp4_linear(x, up, us, **common)
    return _swiglu_f32(g, u, has_limit, limit).astype(jnp.dtype(out_dtype))


_grouped_swiglu_p = _define("mxfp4_grouped_swiglu", _grouped_swiglu_reference, _grouped_aval)


def _check_group_sizes(op: str, group_sizes: Any, num_experts: int) -> jax.Array:
    sizes = jnp.asarray(group_sizes)
    if sizes.shape != (num_experts,) or not jnp.issubdtype(sizes.dtype, jnp.integer):
        raise ValueError(
            f"{op}: group_sizes must be an integer array of shape ({num_experts},), got {sizes.dtype} {sizes.shape}"
        )
    return sizes.astype(jnp.int32)


def _limit_attrs(op: str, limit: float | None) -> dict[str, Any]:
    if limit is None:
        return {"has_limit": False, "limit": 0.0}
    if isinstance(limit, bool) or not isinstance(limit, int | float) or not limit > 0:
        raise ValueError(f"{op}: limit must be a real number > 0 or None, got {limit!r}")
    return {"has_limit": True, "limit": float(limit)}


def mxfp4_grouped_linear(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    group_sizes: jax.Array,
    *,
    activation_cast: str = "none",
    out_dtype: Any = jnp.bfloat16,
) -> jax.Array:
    """Op ``mxfp4_grouped_linear`` as the custom call ``deepinfer.ascend.mxfp4_grouped_linear``."""
    op = "mxfp4_grouped_linear"
    x, packed, scale = jnp.asarray(x), jnp.asarray(packed), jnp.asarray(scale)
    _check_tokens(op, x)
    _check_cast(op, activation_cast, _MXFP4_CASTS)
    if packed.ndim != 3 or packed.shape[2] * 2 != x.shape[1]:
        raise ValueError(f"{op}: packed must have shape [E, N, {x.shape[1] // 2}], got {packed.shape}")
    sizes = _check_group_sizes(op, group_sizes, packed.shape[0])
    return _grouped_p.bind(
        x, packed, scale, sizes, activation_cast=activation_cast, out_dtype=jnp.dtype(out_dtype).name
    )


def mxfp4_grouped_swiglu(
    x: jax.Array,
    gate_packed: jax.Array,
    gate_scale: jax.Array,
    up_packed: jax.Array,
    up_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    limit: float | None = None,
    activation_cast: str = "none",
    out_dtype: Any = jnp.bfloat16,
) -> jax.Array:
    """Op ``mxfp4_grouped_swiglu`` as the custom call ``deepinfer.ascend.mxfp4_grouped_swiglu``."""
    op = "mxfp4_grouped_swiglu"
    x = jnp.asarray(x)
    _check_tokens(op, x)
    _check_cast(op, activation_cast, _MXFP4_CASTS)
    gp, up = jnp.asarray(gate_packed), jnp.asarray(up_packed)
    if gp.ndim != 3 or gp.shape[2] * 2 != x.shape[1] or gp.shape != up.shape:
        raise ValueError(
            f"{op}: gate and up packed weights must both have shape [E, I, {x.shape[1] // 2}], got {gp.shape} "
            f"and {up.shape}"
        )
    sizes = _check_group_sizes(op, group_sizes, gp.shape[0])
    return _grouped_swiglu_p.bind(
        x,
        gp,
        jnp.asarray(gate_scale),
        up,
        jnp.asarray(up_scale),
        sizes,
        activation_cast=activation_cast,
        out_dtype=jnp.dtype(out_dtype).name,
        **_limit_attrs(op, limit),
    )


# ------------------------------------------------------------------------------------------------ swiglu


def _swiglu_reference(u, *, has_limit, limit, out_dtype):
    half = u.shape[-1] // 2
    return _swiglu_f32(u[:, :half], u[:, half:], has_limit, limit).astype(jnp.dtype(out_dtype))


def _swiglu_aval(u, *, out_dtype, **_):
    return jax.core.ShapedArray((u.shape[0], u.shape[1] // 2), jnp.dtype(out_dtype))


_swiglu_p = _define("swiglu", _swiglu_reference, _swiglu_aval)


def swiglu(u: jax.Array, *, limit: float | None = None, out_dtype: Any = None) -> jax.Array:
    """Op ``swiglu`` as the custom call ``deepinfer.ascend.swiglu``; leading dimensions are flattened into rows."""
    u = jnp.asarray(u)
    if u.ndim < 1 or u.shape[-1] % 2 or not jnp.issubdtype(u.dtype, jnp.floating):
        raise ValueError(f"swiglu: u must be a float [..., 2I] array, got {u.dtype} {u.shape}")
    attrs = _limit_attrs("swiglu", limit)
    out = _swiglu_p.bind(
        u.reshape(-1, u.shape[-1]),
        out_dtype=jnp.dtype(u.dtype if out_dtype is None else out_dtype).name,
        **attrs,
    )
    return out.reshape(*u.shape[:-1], u.shape[-1] // 2)


#: Every custom-call target this module can emit.
CUSTOM_CALL_TARGETS: tuple[str, ...] = tuple(
    target_name(op) for op in ("fp8_block_linear", "mxfp4_grouped_linear", "mxfp4_grouped_swiglu", "swiglu")
)
