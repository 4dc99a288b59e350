"""Manifold-constrained hyper-connections (mHC, model.md §6) as pure functions.

The residual of V4/V4.1 is not one vector per token but ``m = hc_mult`` streams ``R [..., m, H]``. Around every
sub-layer (attention, FFN) a small projection of the flattened streams yields three mixes:

* ``pre [m]`` collapses the streams into the sub-layer's input (``Σ_s pre_s · R[s]``);
* ``post [m]`` spreads the sub-layer's output back over the streams;
* ``comb [m, m]`` mixes the old streams into the new ones (indexed ``[source, destination]``), projected
  onto (nearly) doubly-stochastic matrices by Sinkhorn iterations so that stacking many layers cannot blow the
  residual up.

Everything here runs in float32 whatever the activation dtype: transformers and the reference keep mHC in float32
inside a bf16 model (spec/oracles.md), and the mixes are tiny (``m (m + 2)`` values per token).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax.ops import get as get_op
from deepinfer_jax.ops import register_impl, register_op
from deepinfer_jax.ops.ascend import ascend_impl

__all__ = [
    "HcMixes",
    "hc_collapse",
    "hc_expand",
    "hc_head",
    "hc_mixes",
    "sinkhorn",
]


class HcMixes(NamedTuple):
    """The three mixes of one sub-layer for every token: ``pre [..., m]``, ``post [..., m]``, ``comb [..., m, m]``."""

    pre: jax.Array
    post: jax.Array
    comb: jax.Array


def _mix_logits(streams: jax.Array, fn: jax.Array, norm_eps: float) -> jax.Array:
    """``(ρ · fnᵀ) · rsqrt(mean(ρ²) + eps)`` with ``ρ`` the flattened float32 streams (norm folded into ``fn``)."""
    flat = streams.astype(jnp.float32).reshape(*streams.shape[:-2], -1)
    inv_rms = lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + jnp.float32(norm_eps))
    mixed = lax.dot_general(
        flat * inv_rms,
        fn.astype(jnp.float32),
        (((flat.ndim - 1,), (1,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return mixed


def sinkhorn(logits: jax.Array, *, iters: int, eps: float) -> jax.Array:
    """Project ``[..., m, m]`` logits onto near doubly-stochastic matrices (model.md §6.3).

    Row softmax plus ``eps``, one column normalisation, then ``iters - 1`` rounds of row and column
    normalisation, each dividing by ``sum + eps``. The result's columns sum to ~1 (exactly 1 up to ``eps``
    after the final column step); rows converge towards 1 as ``iters`` grows.
    """
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"sinkhorn: iters (hc_sinkhorn_iters) must be an int >= 1, got {iters!r}")
    e = jnp.float32(eps)
    x = jax.nn.softmax(logits.astype(jnp.float32), axis=-1) + e
    x = x / (jnp.sum(x, axis=-2, keepdims=True) + e)

    def body(_: int, x: jax.Array) -> jax.Array:
        x = x / (jnp.sum(x, axis=-1, keepdims=True) + e)
        return x / (jnp.sum(x, axis=-2, keepdims=True) + e)

    return lax.fori_loop(0, iters - 1, body, x)


register_op(
    "mhc_sinkhorn",
    sinkhorn,
    doc="mHC: Sinkhorn projection of each token's m x m mixing logits onto doubly-stochastic matrices (§6.3)",
)
register_impl(
    "mhc_sinkhorn",
    "pallas_gpu",
    "pallas_kernels.mhc:mhc_sinkhorn",
    platforms=("gpu",),
    reason="the Pallas Triton kernel needs the pallas_kernels package",
)
register_impl("mhc_sinkhorn", "ascend", ascend_impl("mhc_sinkhorn", sinkhorn), platforms=("ascend",))


def hc_mixes(
    streams: jax.Array,
    fn: jax.Array,
    base: jax.Array,
    scale: jax.Array,
    *,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_eps: float,
) -> HcMixes:
    """The ``pre``/``post``/``comb`` mixes of one sub-layer from its input streams ``[..., m, H]``.

    Args:
      streams: the stream state entering the sub-layer.
      fn: ``[m (m + 2), m H]`` mix projection (its RMSNorm weight already folded in).
      base: ``[m (m + 2)]`` biases; channel layout ``[pre (m) | post (m) | comb (m², row-major)]``.
      scale: ``[3]`` multipliers of the pre, post and comb channel groups.
      hc_eps: added to ``pre`` and inside the Sinkhorn normalisations.
      sinkhorn_iters: ``hc_sinkhorn_iters``.
      norm_eps: the RMS epsilon of the flattened streams (``rms_norm_eps``).
    """
    m = streams.shape[-2]
    channels = m * (m + 2)
    if fn.shape != (channels, m * streams.shape[-1]):
        raise ValueError(
            f"hc_mixes: fn has shape {fn.shape}, expected ({channels}, {m * streams.shape[-1]}) for streams "
            f"{streams.shape}"
        )
    if base.shape != (channels,) or scale.shape != (3,):
        raise ValueError(f"hc_mixes: base {base.shape} / scale {scale.shape} must be ({channels},) / (3,)")
    mixed = _mix_logits(streams, fn, norm_eps)
    base = base.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    pre = jax.nn.sigmoid(mixed[..., :m] * scale[0] + base[:m]) + jnp.float32(hc_eps)
    post = 2.0 * jax.nn.sigmoid(mixed[..., m : 2 * m] * scale[1] + base[m : 2 * m])
    comb_logits = mixed[..., 2 * m :] * scale[2] + base[2 * m :]
    comb = get_op("mhc_sinkhorn")(
        comb_logits.reshape(*comb_logits.shape[:-1], m, m), iters=sinkhorn_iters, eps=hc_eps
    )
    return HcMixes(pre=pre, post=post, comb=comb)


def hc_collapse(streams: jax.Array, pre: jax.Array) -> jax.Array:
    """``Σ_s pre_s · R[s]`` -> ``[..., H]`` in the streams' dtype (accumulated in float32)."""
    out = jnp.sum(pre.astype(jnp.float32)[..., None] * streams.astype(jnp.float32), axis=-2)
    return out.astype(streams.dtype)


def hc_expand(streams: jax.Array, y: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """``R'[b] = post[b] · y + Σ_a comb[a, b] · R[a]`` -> ``[..., m, H]`` in the streams' dtype."""
    r = streams.astype(jnp.float32)
    mixed = jnp.einsum("...ab,...ah->...bh", comb.astype(jnp.float32), r, precision=lax.Precision.HIGHEST)
    out = post.astype(jnp.float32)[..., None] * y.astype(jnp.float32)[..., None, :] + mixed
    return out.astype(streams.dtype)


def hc_head(
    streams: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, hc_eps: float, norm_eps: float
) -> jax.Array:
    """The final stream collapse of the non-shifted schedule (model.md §6.5, "HC head") -> ``[..., H]``.

    ``w = sigmoid(μ · scale + base) + hc_eps`` with ``μ = (ρ · fnᵀ) · rsqrt(mean(ρ²) + eps)`` (``fn [m, m H]``,
    ``base [m]``, ``scale [1]``), then ``Σ_s w_s · R[s]``.
    """
    m = streams.shape[-2]
    if fn.shape != (m, m * streams.shape[-1]) or base.shape != (m,) or scale.shape != (1,):
        raise ValueError(
            f"hc_head: fn {fn.shape} / base {base.shape} / scale {scale.shape} must be "
            f"({m}, {m * streams.shape[-1]}) / ({m},) / (1,)"
        )
    mixed = _mix_logits(streams, fn, norm_eps)
    w = jax.nn.sigmoid(mixed * scale.astype(jnp.float32)[0] + base.astype(jnp.float32)) + jnp.float32(hc_eps)
    return hc_collapse(streams, w)
