"""Pallas (Triton) compress-and-store: the ``pallas_gpu`` implementation of op ``"v4_compress_store"``.

For ``block_n`` finished compression windows per program, all in registers: the softmax-gated pooling of the
window's ``S`` slots per channel (two passes over the slots: the maximum, then the weighted sums), the rounding to
the entry dtype, the RMSNorm with its rounding points, the interleaved RoPE of the last ``rope_dim`` channels at
the entry's position, the rounding again, the record encoding (FP4 with E4M3-per-16 scales, MXFP8, MXFP4;
bit-exact with ``numerics``, :mod:`pallas_kernels._records`) and the write of each record into its page row (the
page array is aliased to the output, so only the new rows are touched). The pre-RoPE entry ``P`` is the second
output (the indexer keys are projected from it).

RoPE pairs channel ``2i`` with ``2i + 1``. A register tile cannot exchange neighbouring lanes, so every lane also
computes its partner channel (``c ^ 1``) from the same inputs -- twice the pooling arithmetic, none of it memory
traffic beyond a second read of the window's projections. Packed FP4 bytes take the even lane's code and its
partner's, written by the even lane.

Float results can differ from the reference in the last bit (``exp``, ``rsqrt`` and division are the GPU's), so a
code can land on the other side of a rounding midpoint; the encoding of a given float vector is exact.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import cdiv, next_pow2
from pallas_kernels._records import RecordLayout, encode_group

__all__ = ["v4_compress_store"]


def _round(x: jax.Array, dtype: Any) -> jax.Array:
    return x if jnp.dtype(dtype) == jnp.float32 else x.astype(dtype).astype(jnp.float32)


def _kernel(
    kv_ref: Any,
    g_ref: Any,
    w_ref: Any,
    cos_ref: Any,
    sin_ref: Any,
    slot_ref: Any,
    pages_in: Any,
    o_ref: Any,
    p_ref: Any,
    *,
    n: int,
    slots: int,
    dim: int,
    rope_dim: int,
    eps: float,
    bn: int,
    kind: str | None,
    entry_dtype: Any,
) -> None:
    from jax.experimental.pallas import triton as pl_triton

    del pages_in
    i = pl.program_id(0)
    r = i * bn + jnp.arange(bn, dtype=jnp.int32)
    live_row = r < n
    rr = jnp.minimum(r, n - 1)[:, None]
    layout = RecordLayout(kind or "float", dim)
    g = layout.group or 1
    dp = next_pow2(dim) if kind is None else next_pow2(dim // g, 1) * g
    cols = jnp.arange(dp, dtype=jnp.int32)[None, :]
    cvalid = cols < dim
    own = jnp.minimum(cols, dim - 1)
    partner = jnp.minimum(cols ^ 1, dim - 1)

    def pooled(cc: jax.Array) -> jax.Array:
        def load(ref: Any, s: int | jax.Array) -> jax.Array:
            return ref[rr * slots + s, cc].astype(jnp.float32)

        peak = jax.lax.fori_loop(
            0, slots, lambda s, m: jnp.maximum(m, load(g_ref, s)), jnp.full((bn, dp), -jnp.inf, jnp.float32)
        )

        def acc(s: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            tot, val = carry
            e = jnp.exp(load(g_ref, s) - peak)
            return tot + e, val + e * load(kv_ref, s)

        zeros = jnp.zeros((bn, dp), jnp.float32)
        tot, val = jax.lax.fori_loop(0, slots, acc, (zeros, zeros))
        return _round(val / tot, entry_dtype)

    c_own, c_par = pooled(own), pooled(partner)
    c_own = jnp.where(cvalid, c_own, 0.0)
    inv = jax.lax.rsqrt(jnp.sum(c_own * c_own, axis=1, keepdims=True) / dim + jnp.float32(eps))
    narrow = jnp.dtype(entry_dtype) != jnp.float32

    def normed(c: jax.Array, cc: jax.Array) -> jax.Array:
        x = c * inv
        if narrow:
            x = _round(x, entry_dtype)
        return _round(x * w_ref[cc].astype(jnp.float32), entry_dtype)

    p_own, p_par = normed(c_own, own), normed(c_par, partner)
    pl_triton.store(
        p_ref.at[jnp.where(live_row[:, None], rr, n), jnp.where(cvalid, cols, dim)],
        p_own.astype(p_ref.dtype),
        mask=live_row[:, None] & cvalid,
    )
    start = dim - rope_dim
    pair = jnp.clip((cols - start) // 2, 0, rope_dim // 2 - 1)
    cs = cos_ref[rr, pair].astype(jnp.float32)
    sn = sin_ref[rr, pair].astype(jnp.float32)
    even = (cols & 1) == 0
    z_even = jnp.where(even, p_own, p_par)  # the pair (2i, 2i + 1) this lane belongs to
    z_odd = jnp.where(even, p_par, p_own)
    new_even = _round(z_even * cs - z_odd * sn, entry_dtype)  # apply_rope's operation order
    new_odd = _round(z_even * sn + z_odd * cs, entry_dtype)
    rope = cols >= start
    key = jnp.where(rope, jnp.where(even, new_even, new_odd), p_own)
    key_par = jnp.where(rope, jnp.where(even, new_odd, new_even), p_par)

    slot = slot_ref[jnp.minimum(r, n - 1)]
    live = live_row & (slot >= 0)
    dest = jnp.where(live, slot, o_ref.shape[0])[:, None]
    if kind is None:
        pl_triton.store(
            o_ref.at[dest, jnp.where(cvalid, cols, dim)], key.astype(o_ref.dtype), mask=live[:, None] & cvalid
        )
        return
    groups, gp = dim // g, dp // g
    codes, scales, _ = encode_group(jnp.where(cvalid, key, 0.0).reshape(bn, gp, g), kind)
    gcols = jnp.arange(gp, dtype=jnp.int32)[None, :]
    pl_triton.store(
        o_ref.at[dest, jnp.where(gcols < groups, gcols + layout.code_bytes, layout.record_bytes)],
        scales.astype(o_ref.dtype),
        mask=live[:, None] & (gcols < groups),
    )
    codes = codes.reshape(bn, dp)
    if kind == "mxfp8":
        pl_triton.store(
            o_ref.at[dest, jnp.where(cvalid, cols, layout.record_bytes)],
            codes.astype(o_ref.dtype),
            mask=live[:, None] & cvalid,
        )
        return
    # E2M1: the even lane writes byte c/2 = its code | partner's code << 4 (the partner's code is re-derived
    # from the partner's key with the group's scale: same inputs, same code)
    # (a group holds whole pairs, so the partners' group amax -- and scale -- is the group's own)
    codes_par, _, _ = encode_group(jnp.where(cvalid, key_par, 0.0).reshape(bn, gp, g), kind)
    byte = (codes & 15) | ((codes_par.reshape(bn, dp) & 15) << 4)
    write = live[:, None] & cvalid & even
    pl_triton.store(
        o_ref.at[dest, jnp.where(write, cols // 2, layout.record_bytes)], byte.astype(o_ref.dtype), mask=write
    )


def v4_compress_store(
    pages: jax.Array,
    kv: jax.Array,
    gate: jax.Array,
    norm_weight: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    slots: jax.Array,
    *,
    eps: float,
    rope_dim: int,
    key_format: str | None,
    entry_dtype: Any = jnp.bfloat16,
    block_n: int = 8,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Op ``"v4_compress_store"`` (signature of ``deepinfer_jax.ops.kv_store.v4_compress_store``)."""
    n, num_slots, dim = kv.shape
    dtype = jnp.dtype(entry_dtype)
    if n == 0:
        return pages, jnp.zeros((0, dim), dtype)
    shape = pages.shape
    flat = pages.reshape(-1, shape[-1])
    bn = min(block_n, next_pow2(n, 1))
    kernel = functools.partial(
        _kernel,
        n=n,
        slots=num_slots,
        dim=dim,
        rope_dim=rope_dim,
        eps=float(eps),
        bn=bn,
        kind=key_format,
        entry_dtype=dtype,
    )
    out, pre_rope = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(flat.shape, flat.dtype), jax.ShapeDtypeStruct((n, dim), dtype)),
        grid=(cdiv(n, bn),),
        input_output_aliases={6: 0},
        interpret=interpret,
        name="v4_compress_store",
    )(
        kv.reshape(n * num_slots, dim),
        gate.reshape(n * num_slots, dim),
        norm_weight,
        cos,
        sin,
        slots.astype(jnp.int32),
        flat,
    )
    return out.reshape(shape), pre_rope
