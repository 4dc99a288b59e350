"""Pallas (Triton) mHC Sinkhorn projection: the ``pallas_gpu`` implementation of op ``"mhc_sinkhorn"``.

Every sub-layer of DeepSeek-V4/V4.1 projects each token's ``m × m`` mixing logits (``m = hc_mult = 4``) onto a
nearly doubly-stochastic matrix (``spec/model.md`` §6.3): a row softmax plus ``eps``, a column normalisation, then
``iters - 1`` rounds of row and column normalisation, each dividing by ``sum + eps``. The matrices are tiny and
the iterations many (20): XLA runs them as a loop of small fused kernels over the whole batch; here one program
keeps ``block_n`` tokens' matrices in registers for all iterations and writes the result once.

Matrices are padded to a power-of-two ``m`` with zeros that every sum ignores (padded logits are ``-inf`` for the
softmax and reset to 0 after each step).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import cdiv, next_pow2

__all__ = ["mhc_sinkhorn"]


def _kernel(x_ref: Any, o_ref: Any, *, n: int, m: int, mp: int, bn: int, iters: int, eps: float) -> None:
    from jax.experimental.pallas import triton as pl_triton

    i = pl.program_id(0)
    r = i * bn + jnp.arange(bn, dtype=jnp.int32)
    a = jnp.arange(mp, dtype=jnp.int32)
    rows, ii, jj = r[:, None, None], a[None, :, None], a[None, None, :]
    valid = (rows < n) & (ii < m) & (jj < m)
    idx = (jnp.minimum(rows, n - 1) * m + jnp.minimum(ii, m - 1)) * m + jnp.minimum(jj, m - 1)
    logits = jnp.where(valid, x_ref[idx].astype(jnp.float32), -jnp.inf)
    e = jnp.float32(eps)
    peak = jnp.max(logits, axis=2, keepdims=True)
    peak = jnp.where(peak == -jnp.inf, 0.0, peak)
    ex = jnp.exp(logits - peak)
    x = jnp.where(valid, ex / jnp.sum(ex, axis=2, keepdims=True) + e, 0.0)
    x = x / (jnp.sum(x, axis=1, keepdims=True) + e)

    def body(_: jax.Array, x: jax.Array) -> jax.Array:
        x = x / (jnp.sum(x, axis=2, keepdims=True) + e)
        return x / (jnp.sum(x, axis=1, keepdims=True) + e)

    x = jax.lax.fori_loop(0, iters - 1, body, x)
    out = jnp.where(valid, idx, n * m * m)  # masked lanes address past the end (see paged_mla)
    pl_triton.store(o_ref.at[out], x, mask=valid)


def mhc_sinkhorn(
    logits: jax.Array, *, iters: int, eps: float, block_n: int = 64, interpret: bool = False
) -> jax.Array:
    """Op ``"mhc_sinkhorn"``: ``[..., m, m]`` logits -> float32 ``[..., m, m]`` (signature of the reference)."""
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"mhc_sinkhorn: iters (hc_sinkhorn_iters) must be an int >= 1, got {iters!r}")
    shape = logits.shape
    m = shape[-1]
    if logits.ndim < 2 or shape[-2] != m:
        raise ValueError(f"mhc_sinkhorn: logits must be [..., m, m], got {shape}")
    n = 1
    for d in shape[:-2]:
        n *= d
    if n == 0:
        return jnp.zeros(shape, jnp.float32)
    bn = min(block_n, next_pow2(n, 1))
    kernel = functools.partial(_kernel, n=n, m=m, mp=next_pow2(m, 1), bn=bn, iters=iters, eps=float(eps))
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n * m * m,), jnp.float32),
        grid=(cdiv(n, bn),),
        interpret=interpret,
        name="mhc_sinkhorn",
    )(logits.reshape(-1))
    return out.reshape(shape)
