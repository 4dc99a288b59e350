"""RMSNorm (model.md §5.1), registered as op ``"rms_norm"``.

The normalisation itself always runs in float32: ``n = x · rsqrt(mean(x²) + eps)`` over the last axis. What
happens after it depends on the precision mode (ARCHITECTURE.md §8), and the mode is read off the output dtype:

* **float32 output** (parity mode): ``y = n · w`` in float32, no rounding anywhere.
* **narrower output** (bfloat16 production mode): the reference engine's fused kernel rounds twice,
  ``y = bf16(bf16(n) · w)``: the normalised value is rounded to the output dtype before it meets the (bf16)
  weight, and the product is rounded again. ``round_intermediate=False`` keeps only the final rounding, which is
  what some other implementations do (model.md §17, item 6); it exists to compare against them.

Following the output dtype rather than a separate mode flag keeps call sites honest: a parity-mode model passes
float32 activations and gets float32 out, a production model passes bf16 and gets the production rounding,
without every caller threading a mode through.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.ops.registry import register_op


def _round_to(x: jax.Array, dtype: np.dtype) -> jax.Array:
    """Round float32 ``x`` to the precision of ``dtype`` while keeping it float32.

    ``lax.reduce_precision`` instead of a pair of ``astype`` calls: XLA may drop a float32→bf16→float32 round trip
    as a "no-op" when it is allowed excess precision (the GPU default), which would silently remove the very
    rounding point this op exists to reproduce. ``reduce_precision`` is never simplified away.
    """
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def rms_norm(
    x: jax.Array,
    weight: jax.Array | None = None,
    *,
    eps: float,
    out_dtype: Any = None,
    round_intermediate: bool | None = None,
) -> jax.Array:
    """Root-mean-square normalisation over the last axis, with an optional per-channel weight.

    Args:
      x: floating array ``[..., d]`` (any float dtype; normalised in float32).
      weight: ``[d]`` scale, or ``None`` for norms without a weight (the hyper-connection mixes), which skip the
        multiply (and its rounding).
      eps: added to the mean square before the reciprocal square root; a non-negative Python/NumPy real.
      out_dtype: floating dtype of the result; ``None`` keeps ``x.dtype``.
      round_intermediate: round the normalised value to ``out_dtype`` before the weight multiply. ``None`` (the
        default) means "when ``out_dtype`` is narrower than float32", i.e. the production rounding points in
        bf16 mode and none in float32 mode. Has no effect without a weight or with a float32 output.

    Returns:
      ``[..., d]`` array of ``out_dtype``.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"rms_norm: x must be a floating array, got dtype {x.dtype}")
    if x.ndim < 1:
        raise ValueError(f"rms_norm: x must have at least one axis (the normalised one), got shape {x.shape}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"rms_norm: eps must be a real number, got {type(eps).__name__} {eps!r}")
    if not (eps >= 0 and np.isfinite(eps)):
        raise ValueError(f"rms_norm: eps must be finite and >= 0, got {eps!r}")
    out = np.dtype(x.dtype if out_dtype is None else out_dtype)
    if not jnp.issubdtype(out, jnp.floating):
        raise TypeError(f"rms_norm: out_dtype must be a floating dtype, got {out}")
    if round_intermediate is None:
        round_intermediate = jnp.finfo(out).bits < 32
    elif not isinstance(round_intermediate, bool):
        raise TypeError(
            f"rms_norm: round_intermediate must be a bool or None, got {type(round_intermediate).__name__}"
        )

    x32 = x.astype(jnp.float32)
    mean_sq = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    normed = x32 * jax.lax.rsqrt(mean_sq + jnp.float32(eps))
    if weight is None:
        return normed.astype(out)

    weight = jnp.asarray(weight)
    if weight.shape != (x.shape[-1],):
        raise ValueError(
            f"rms_norm: weight must have shape ({x.shape[-1]},) to match the last axis of x {x.shape}, "
            f"got {weight.shape}"
        )
    if not jnp.issubdtype(weight.dtype, jnp.floating):
        raise TypeError(f"rms_norm: weight must be a floating array, got dtype {weight.dtype}")
    if round_intermediate and jnp.finfo(out).bits < 32:
        normed = _round_to(normed, out)
    return (normed * weight.astype(jnp.float32)).astype(out)


register_op(
    "rms_norm",
    rms_norm,
    doc="RMSNorm over the last axis in float32, rounding points follow the output dtype (model.md §5.1)",
)
