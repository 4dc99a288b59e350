"""Pallas (Triton) DeepSeek-V4 attention with sinks over keys gathered by row id, decoded in the kernel.

DeepSeek-V4/V4.1 attention (``spec/model.md`` §7.5) is multi-query attention with one shared key = value head per
token and a per-head sink logit. The keys of a query come from *segments*: the window ring (MXFP8 records), the
compressed entries the indexer selected (FP4 or MXFP8 records in paged blocks), or plain float keys. A segment is
a 2-D storage array (one key per row: a record or a float vector) and an int32 ``ids [N, K]`` table naming, for
each query row, the storage rows of its keys (``-1`` = no key). The kernel loads each key row straight from the
storage, decodes it in registers (:mod:`pallas_kernels._records`, bit-exact with ``numerics``) and folds it into
an online softmax: no decoded copy of any key, and no gathered copy of the records, ever exists in memory.

Ops implemented here (``pallas_gpu`` backend):

* ``"v4_sparse_attention"`` (:func:`v4_sparse_attention`): window records + selected compressed records + sinks,
  for decode tokens and prefill chunks alike (one query row per token of the flat batch);
* ``"v4_sink_attention"`` (:func:`v4_sink_attention`): the models' dense form, ``q [B, S, H, D]`` over
  ``kv [B, T, D]`` with a boolean mask, as one float segment whose ids come from the mask.

One program computes ``block_h`` heads of one query row; the grid is ``(N, ceil(H / block_h))``. Value columns are
accumulated in ``chunk``-wide pieces (``D = 512``: four float32 accumulators of ``block_h × 128``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._attention import AttnTiles, OnlineSoftmax, dot_kt
from pallas_kernels._common import cdiv, next_pow2
from pallas_kernels._records import RecordLayout, decode_bytes, record_layout

__all__ = ["TILES", "Segment", "sink_attention_segments", "v4_sink_attention", "v4_sparse_attention"]

#: Default tile (untuned: no GPU has run it yet): 16 heads per program (V4.1-Flash has 64), 32 keys per step.
TILES = AttnTiles(block_h=16, block_k=32, chunk=128, num_warps=4, num_stages=2)


@dataclasses.dataclass(frozen=True)
class Segment:
    """One source of keys: ``storage [R, bytes or D]``, ``ids [N, K]`` int32 rows into it (-1 = none), format."""

    storage: jax.Array
    ids: jax.Array
    kind: str | None  # None (float keys), "mxfp8", "fp4", "mxfp4"


def _exact_in_bf16(seg: Segment) -> bool:
    return seg.kind is not None or jnp.dtype(seg.storage.dtype) == jnp.bfloat16


def _kernel(
    *refs: Any,
    layouts: Sequence[RecordLayout],
    tiles: AttnTiles,
    heads: int,
    dim: int,
    scale: float,
    compute_dtype: Any,
    with_sinks: bool,
) -> None:
    from jax.experimental.pallas import triton as pl_triton

    q_ref, sink_ref = refs[0], refs[1]
    seg_refs = refs[2:-1]
    o_ref = refs[-1]
    bh, bk, dc = tiles.block_h, tiles.block_k, tiles.chunk
    n, hb = pl.program_id(0), pl.program_id(1)
    h = hb * bh + jnp.arange(bh, dtype=jnp.int32)
    hrow = (n * heads + jnp.minimum(h, heads - 1))[:, None]
    cols = [i * dc + jnp.arange(dc, dtype=jnp.int32)[None, :] for i in range(cdiv(dim, dc))]
    q = [jnp.where(c < dim, q_ref[hrow, jnp.minimum(c, dim - 1)], 0).astype(compute_dtype) for c in cols]
    state = OnlineSoftmax.init(bh, tuple(dc for _ in cols))

    for s, layout in enumerate(layouts):
        store_ref, ids_ref = seg_refs[2 * s], seg_refs[2 * s + 1]
        num_keys = ids_ref.shape[1]
        width = store_ref.shape[1]

        def step(
            i: jax.Array,
            st: Any,
            store_ref=store_ref,
            ids_ref=ids_ref,
            num_keys=num_keys,
            width=width,
            layout=layout,
        ) -> Any:
            kk = i * bk + jnp.arange(bk, dtype=jnp.int32)
            ids = ids_ref[n, jnp.minimum(kk, num_keys - 1)]
            live = (kk < num_keys) & (ids >= 0)
            krow = jnp.maximum(ids, 0)[:, None]

            def load(byte_cols: jax.Array) -> jax.Array:
                v = store_ref[krow, jnp.clip(byte_cols, 0, width - 1)]
                return v if layout.kind == "float" else v.astype(jnp.int32)

            logits = jnp.zeros((bh, bk), jnp.float32)
            values = []
            for c, qc in zip(cols, q, strict=True):
                k = decode_bytes(load, layout, jnp.minimum(c, dim - 1))
                k = jnp.where((c < dim) & live[:, None], k, 0.0)
                logits = logits + dot_kt(qc, k, compute_dtype)
                values.append(k)
            logits = jnp.where(live[None, :], logits * jnp.float32(scale), -jnp.inf)
            return OnlineSoftmax.update(st, logits, tuple(values), compute_dtype)

        state = jax.lax.fori_loop(0, cdiv(num_keys, bk), step, state)

    sink = sink_ref[jnp.minimum(h, heads - 1)].astype(jnp.float32) if with_sinks else None
    out = OnlineSoftmax.finish(state, sink)
    hmask = (h < heads)[:, None]
    srow = jnp.where(hmask, hrow, o_ref.shape[0])  # masked lanes address past the end (see paged_mla)
    for c, o in zip(cols, out, strict=True):
        cmask = c < dim
        pl_triton.store(o_ref.at[srow, jnp.where(cmask, c, dim)], o.astype(o_ref.dtype), mask=hmask & cmask)


def pick_tiles(heads: int, dim: int, keys: int) -> AttnTiles:
    """:data:`TILES` shrunk to small problems."""
    return dataclasses.replace(
        TILES,
        block_h=max(16, min(TILES.block_h, next_pow2(heads))),
        block_k=max(16, min(TILES.block_k, next_pow2(max(keys, 1)))),
        chunk=max(16, min(TILES.chunk, next_pow2(dim))),
    )


def sink_attention_segments(
    q: jax.Array,
    segments: Sequence[Segment],
    sinks: jax.Array | None,
    *,
    scale: float,
    out_dtype: Any = None,
    tiles: AttnTiles | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Softmax attention (plus sinks) of ``q [N, H, D]`` over the keys of ``segments`` -> ``[N, H, D]``.

    Keys are values; a query row with no live key gives 0. ``out_dtype`` defaults to ``q.dtype``.
    """
    n_rows, heads, dim = q.shape
    out_dtype = jnp.dtype(out_dtype or q.dtype)
    if n_rows == 0:
        return jnp.zeros((0, heads, dim), out_dtype)
    layouts, operands = [], []
    for seg in segments:
        if seg.ids.shape[0] != n_rows or seg.ids.ndim != 2:
            raise ValueError(f"segment ids must be [{n_rows}, K], got {seg.ids.shape}")
        if seg.ids.shape[1] == 0:
            continue
        layout = record_layout(seg.kind, dim)
        storage = seg.storage.reshape(-1, seg.storage.shape[-1])
        if layout.kind != "float" and storage.shape[1] != layout.record_bytes:
            raise ValueError(
                f"{seg.kind} records of {dim} elements have {layout.record_bytes} bytes, got {storage.shape}"
            )
        if layout.kind == "float" and storage.shape[1] != dim:
            raise ValueError(f"float keys must have {dim} values, got {storage.shape}")
        layouts.append(layout)
        operands += [storage, seg.ids.astype(jnp.int32)]
    max_keys = max((s.ids.shape[1] for s in segments), default=1)
    tiles = tiles or pick_tiles(heads, dim, max_keys)
    exact = all(_exact_in_bf16(s) for s in segments)
    compute_dtype = jnp.bfloat16 if jnp.dtype(q.dtype) == jnp.bfloat16 and exact else jnp.float32
    with_sinks = sinks is not None
    sink_arr = (sinks if with_sinks else jnp.zeros((heads,), jnp.float32)).astype(jnp.float32)
    kernel = functools.partial(
        _kernel,
        layouts=tuple(layouts),
        tiles=tiles,
        heads=heads,
        dim=dim,
        scale=float(scale),
        compute_dtype=compute_dtype,
        with_sinks=with_sinks,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n_rows * heads, dim), out_dtype),
        grid=(n_rows, cdiv(heads, tiles.block_h)),
        compiler_params=tiles.compiler_params(),
        interpret=interpret,
        name="v4_sink_attention_segments",
    )(q.reshape(n_rows * heads, dim), sink_arr, *operands)
    return out.reshape(n_rows, heads, dim)


def _window_ids(mask: jax.Array) -> jax.Array:
    tokens, width = mask.shape
    rows = jnp.arange(tokens, dtype=jnp.int32)[:, None] * width + jnp.arange(width, dtype=jnp.int32)[None, :]
    return jnp.where(mask, rows, -1)


def v4_sparse_attention(
    q: jax.Array,
    window: jax.Array,
    window_mask: jax.Array,
    sinks: jax.Array,
    pages: jax.Array | None = None,
    slots: jax.Array | None = None,
    *,
    scale: float,
    window_format: str | None = None,
    compressed_format: str | None = None,
    tiles: AttnTiles | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Op ``"v4_sparse_attention"`` (signature of ``deepinfer_jax.ops.sparse_attention.v4_sparse_attention``)."""
    tokens = q.shape[0]
    if tokens == 0:
        return jnp.zeros(q.shape, q.dtype)
    segs = [Segment(window.reshape(tokens * window.shape[1], -1), _window_ids(window_mask), window_format)]
    if pages is not None and slots is not None and slots.shape[1]:
        segs.append(Segment(pages.reshape(-1, pages.shape[-1]), slots, compressed_format))
    return sink_attention_segments(q, segs, sinks, scale=scale, tiles=tiles, interpret=interpret)


def v4_sink_attention(
    q: jax.Array,
    kv: jax.Array,
    mask: jax.Array,
    sinks: jax.Array,
    *,
    scale: float,
    tiles: AttnTiles | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Op ``"v4_sink_attention"``: ``q [B, S, H, D]`` over ``kv [B, T, D]`` with ``mask [B, S, T]`` and sinks."""
    b, s, h, d = q.shape
    t = kv.shape[1]
    rows = jnp.arange(b, dtype=jnp.int32)[:, None, None] * t + jnp.arange(t, dtype=jnp.int32)[None, None, :]
    ids = jnp.where(mask, rows, -1).reshape(b * s, t)
    out = sink_attention_segments(
        q.reshape(b * s, h, d),
        [Segment(kv.reshape(b * t, d), ids, None)],
        sinks,
        scale=scale,
        tiles=tiles,
        interpret=interpret,
    )
    return out.reshape(b, s, h, d)
