"""DeepSeek-V4/V4.1 sparse attention over cache records, registered as op ``"v4_sparse_attention"``.

The attention core of a compressed layer (``spec/model.md`` §7.5) for a flat ragged batch, reading the caches in
their stored formats: each token attends to

* its **window** -- ``window [T, W, ...]``, the records (or float keys) of positions ``p - W + 1 .. p`` as
  :func:`deepinfer_jax.cache.ragged.history` returns them, with ``window_mask [T, W]``;
* its **selected compressed entries** -- ``slots [T, K]``, flat rows into the compressed pages
  ``pages [num_blocks, E, ...]`` viewed as ``[num_blocks·E, ...]`` (:func:`entry_slots` turns the indexer's
  compressed indices into them; ``-1`` = none);
* plus one value-less **sink** logit per head; keys are values (one shared K = V head).

Formats: ``window_format`` ``None`` (float keys) or ``"mxfp8"`` (§12.3.1); ``compressed_format`` ``None``,
``"fp4"`` (E2M1 with E4M3 per-16 scales, §12.3.2) or ``"mxfp8"``. The reference decodes with
:mod:`deepinfer_jax.numerics.kv_records` and runs the sink softmax in float32 (``HIGHEST``); the result is in
``q``'s dtype. The ``pallas_gpu`` kernel decodes each record in registers instead (``pallas_kernels/
sparse_attention.py``); the ``ascend`` backend emits the named custom call ``deepinfer.ascend.v4_sparse_attention``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax.numerics.formats import (
    RecordFormat,
    fp4_e4m3_record_format,
    mxfp4_record_format,
    mxfp8_record_format,
)
from deepinfer_jax.numerics.kv_records import decode_records
from deepinfer_jax.ops.ascend import ascend_impl
from deepinfer_jax.ops.registry import register_impl, register_op

__all__ = ["KEY_FORMATS", "entry_slots", "key_record_format", "v4_sparse_attention"]

#: Key storage formats the op reads (``None``: unquantised float keys).
KEY_FORMATS: tuple[str | None, ...] = (None, "mxfp8", "fp4", "mxfp4")

_HIGHEST = lax.Precision.HIGHEST


def key_record_format(kind: str | None, dim: int) -> RecordFormat | None:
    """The :class:`RecordFormat` of a key format name at ``dim`` elements (``None`` for float keys)."""
    if kind is None:
        return None
    if kind == "mxfp8":
        return mxfp8_record_format(dim)
    if kind == "fp4":
        return fp4_e4m3_record_format(dim)
    if kind == "mxfp4":
        return mxfp4_record_format(dim)
    raise ValueError(f"key format must be one of {KEY_FORMATS}, got {kind!r}")


def decode_keys(stored: jax.Array, kind: str | None, dim: int) -> jax.Array:
    """Float32 keys ``[..., dim]`` of stored keys (records or float vectors)."""
    fmt = key_record_format(kind, dim)
    if fmt is None:
        return stored.astype(jnp.float32)
    return decode_records(stored, fmt, dtype=jnp.float32)


def entry_slots(
    index: jax.Array,
    block_tables: jax.Array,
    rows: jax.Array,
    *,
    entries_per_block: int,
    valid: jax.Array | None = None,
) -> jax.Array:
    """Flat page rows ``[T, K]`` (``block · E + offset``) of compressed indices ``index [T, K]`` (``-1`` = none).

    Entry ``c`` of row ``r`` lives in block ``block_tables[r, c // E]`` at offset ``c % E``
    (:mod:`deepinfer_jax.cache.ragged`). Negative indices, unallocated blocks and (with ``valid [T]``) padding
    tokens give ``-1``.
    """
    max_blocks = block_tables.shape[1]
    column = jnp.clip(index // entries_per_block, 0, max_blocks - 1)
    block = block_tables[rows[:, None], column]
    ok = (index >= 0) & (block >= 0) & (index // entries_per_block < max_blocks)
    if valid is not None:
        ok = ok & valid[:, None]
    return jnp.where(ok, block * entries_per_block + jnp.mod(index, entries_per_block), -1).astype(jnp.int32)


def _check(
    q: Any, window: Any, window_mask: Any, sinks: Any, pages: Any, slots: Any, wf: Any, cf: Any
) -> None:
    if q.ndim != 3:
        raise ValueError(f"v4_sparse_attention: q must be [T, H, D], got {q.shape}")
    tokens, heads, _ = q.shape
    if window.ndim != 3 or window.shape[0] != tokens or window_mask.shape != window.shape[:2]:
        raise ValueError(
            f"v4_sparse_attention: window must be [{tokens}, W, ...] with window_mask [{tokens}, W], got "
            f"{window.shape} and {window_mask.shape}"
        )
    if sinks.shape != (heads,):
        raise ValueError(f"v4_sparse_attention: sinks must be [{heads}], got {sinks.shape}")
    for name, kind in (("window_format", wf), ("compressed_format", cf)):
        if kind not in KEY_FORMATS:
            raise ValueError(f"v4_sparse_attention: {name} must be one of {KEY_FORMATS}, got {kind!r}")
    if (pages is None) != (slots is None):
        raise ValueError("v4_sparse_attention: pages and slots go together")
    if slots is not None and (slots.ndim != 2 or slots.shape[0] != tokens):
        raise ValueError(f"v4_sparse_attention: slots must be [{tokens}, K], got {slots.shape}")


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
) -> jax.Array:
    """Sink attention of ``q [T, H, D]`` over its window and selected entries (module docstring) -> ``[T, H, D]``.

    Args:
      q: queries (any float dtype; the result has this dtype).
      window: ``[T, W, record_bytes]`` uint8 records or ``[T, W, D]`` float keys.
      window_mask: bool ``[T, W]`` which window keys exist.
      sinks: ``[H]`` per-head sink logits.
      pages: compressed pages ``[num_blocks, E, record_bytes]`` (or float ``[..., D]``); ``None`` for window-only.
      slots: int ``[T, K]`` flat rows of ``pages`` (:func:`entry_slots`), ``-1`` = none.
      scale: the softmax scale.
      window_format, compressed_format: the storage formats (module docstring).
    """
    q, window, window_mask, sinks = (jnp.asarray(a) for a in (q, window, window_mask, sinks))
    pages = None if pages is None else jnp.asarray(pages)
    slots = None if slots is None else jnp.asarray(slots)
    _check(q, window, window_mask, sinks, pages, slots, window_format, compressed_format)
    dim = q.shape[-1]
    keys = decode_keys(window, window_format, dim)
    mask = window_mask
    if pages is not None and slots is not None and slots.shape[1]:
        flat = pages.reshape(-1, pages.shape[-1])
        gathered = flat.at[jnp.maximum(slots, 0)].get(mode="fill", fill_value=0)
        keys = jnp.concatenate([keys, decode_keys(gathered, compressed_format, dim)], axis=1)
        mask = jnp.concatenate([mask, slots >= 0], axis=1)
    logits = jnp.einsum("thd,tkd->thk", q.astype(jnp.float32), keys, precision=_HIGHEST) * jnp.float32(scale)
    logits = jnp.where(mask[:, None, :], logits, -jnp.inf)
    sink = sinks.astype(jnp.float32)[None, :]
    peak = jnp.maximum(jnp.max(logits, axis=-1), sink)
    probs = jnp.exp(logits - peak[..., None])
    denom = jnp.sum(probs, axis=-1) + jnp.exp(sink - peak)
    out = jnp.einsum("thk,tkd->thd", probs, keys, precision=_HIGHEST)
    return (out / denom[..., None]).astype(q.dtype)


register_op(
    "v4_sparse_attention",
    v4_sparse_attention,
    doc="DeepSeek-V4/V4.1 sink attention over window records + selected compressed records, decoded per key",
)
register_impl(
    "v4_sparse_attention",
    "pallas_gpu",
    "pallas_kernels.sparse_attention:v4_sparse_attention",
    platforms=("gpu",),
    reason="the Pallas Triton kernel needs the pallas_kernels package",
)
register_impl(
    "v4_sparse_attention",
    "ascend",
    ascend_impl("v4_sparse_attention", v4_sparse_attention),
    platforms=("ascend",),
)
