"""Pallas (Triton) KV-record codec kernels: decode records to float32, encode vectors into records in place.

* :func:`decode_records` -- ``[N, record_bytes]`` records to ``[N, elements]`` float32 (every format of
  :data:`pallas_kernels._records.FORMATS`); the same in-kernel decoder the attention kernels use.
* :func:`store_records` -- the ``pallas_gpu`` implementation of op ``"kv_store_records"``: encode ``values [N, D]``
  (MXFP8, FP4 with E4M3-per-16 scales, or MXFP4) and write each row's record at a flat row of a page array,
  in place (the page array is aliased to the output); rows with a negative slot are skipped.
* :func:`encode_records` -- :func:`store_records` into a fresh array, one record per row.

Both directions are bit-exact with :mod:`deepinfer_jax.numerics.kv_records` (tests compare every code and
scale byte); how the encoder avoids the GPU's inexact division is explained in :mod:`pallas_kernels._records`.
A program handles ``block_rows`` records whole (the group ``amax`` needs the group in registers).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import cdiv, next_pow2
from pallas_kernels._records import RecordLayout, decode_bytes, encode_group, record_layout

__all__ = ["ENCODABLE", "decode_records", "encode_records", "store_records", "store_records_op"]

#: Formats :func:`store_records` can encode (the V4/V4.1 cache records).
ENCODABLE: tuple[str, ...] = ("mxfp8", "fp4", "mxfp4")


def _decode_kernel(rec_ref: Any, o_ref: Any, *, layout: RecordLayout, rows: int, bn: int, width: int) -> None:
    i = pl.program_id(0)
    r = i * bn + jnp.arange(bn, dtype=jnp.int32)
    rr = jnp.minimum(r, rows - 1)[:, None]
    total = layout.n + layout.rope
    cols = jnp.arange(width, dtype=jnp.int32)[None, :]
    cc = jnp.minimum(cols, total - 1)
    nbytes = rec_ref.shape[1]

    def load(byte_cols: jax.Array) -> jax.Array:
        v = rec_ref[rr, jnp.clip(byte_cols, 0, nbytes - 1)]
        return v if layout.kind == "float" else v.astype(jnp.int32)

    values = decode_bytes(load, layout, cc)
    rok, cok = (r < rows)[:, None], cols < total
    from jax.experimental.pallas import triton as pl_triton

    # masked lanes address past the end, never a clamped duplicate of a live element (see paged_mla)
    pl_triton.store(o_ref.at[jnp.where(rok, rr, rows), jnp.where(cok, cc, total)], values, mask=rok & cok)


def decode_records(
    records: jax.Array,
    kind: str,
    num_elements: int,
    *,
    rope: int = 0,
    block_rows: int = 16,
    interpret: bool = False,
) -> jax.Array:
    """Float32 values ``[N, num_elements + rope]`` of ``records [N, record_bytes]`` (uint8) of format ``kind``."""
    layout = record_layout(kind, num_elements, rope)
    records = jnp.asarray(records)
    if records.ndim != 2 or (layout.kind != "float" and records.shape[1] != layout.record_bytes):
        raise ValueError(
            f"decode_records: {kind} records of {num_elements} elements must be [N, {layout.record_bytes}], "
            f"got {records.shape}"
        )
    n = records.shape[0]
    total = num_elements + rope
    if n == 0:
        return jnp.zeros((0, total), jnp.float32)
    bn = min(block_rows, next_pow2(n, 1))
    kernel = functools.partial(_decode_kernel, layout=layout, rows=n, bn=bn, width=next_pow2(total))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, total), jnp.float32),
        grid=(cdiv(n, bn),),
        interpret=interpret,
        name="decode_kv_records",
    )(records)


def _store_kernel(
    x_ref: Any, slot_ref: Any, pages_in: Any, o_ref: Any, *, kind: str, rows: int, bn: int, n: int
) -> None:
    del pages_in  # aliased to o_ref: only the addressed rows change
    from jax.experimental.pallas import triton as pl_triton

    layout = RecordLayout(kind, n)
    g = layout.group
    groups = layout.num_groups
    gp = next_pow2(groups, 1)
    i = pl.program_id(0)
    r = i * bn + jnp.arange(bn, dtype=jnp.int32)
    rr = jnp.minimum(r, rows - 1)
    slot = slot_ref[rr]
    live = (r < rows) & (slot >= 0)
    dest = jnp.where(live, slot, o_ref.shape[0])[:, None]  # skipped rows address past the end
    cols = jnp.arange(gp * g, dtype=jnp.int32)[None, :]
    x = x_ref[rr[:, None], jnp.minimum(cols, n - 1)].astype(jnp.float32)
    x = jnp.where(cols < n, x, 0.0)  # padding groups (to a power of two) are computed, never stored
    codes, scales, _ = encode_group(x.reshape(bn, gp, g), kind)
    gcols = jnp.arange(gp, dtype=jnp.int32)[None, :]
    pl_triton.store(
        o_ref.at[dest, jnp.where(gcols < groups, gcols + layout.code_bytes, layout.record_bytes)],
        scales.astype(o_ref.dtype),
        mask=live[:, None] & (gcols < groups),
    )
    if kind == "mxfp8":
        flat = codes.reshape(bn, gp * g)
        bcols = cols
    else:  # two E2M1 codes per byte, element 2j in the low nibble
        pairs = codes.reshape(bn, gp * g // 2, 2)
        shift = jnp.arange(2, dtype=jnp.int32)[None, None, :] * 4
        flat = jnp.sum(pairs << shift, axis=-1)
        bcols = jnp.arange(gp * g // 2, dtype=jnp.int32)[None, :]
    nb = layout.code_bytes
    pl_triton.store(
        o_ref.at[dest, jnp.where(bcols < nb, bcols, layout.record_bytes)],
        flat.astype(o_ref.dtype),
        mask=live[:, None] & (bcols < nb),
    )


def store_records(
    pages: jax.Array,
    values: jax.Array,
    slots: jax.Array,
    kind: str,
    *,
    block_rows: int = 8,
    interpret: bool = False,
) -> jax.Array:
    """``pages [R, record_bytes]`` (uint8) with ``values [N, D]`` encoded in format ``kind`` at rows ``slots [N]``.

    A negative slot skips its row. Two rows must not name the same slot (which one lands would be undefined).
    Leading page dimensions are accepted and flattened (``[NB, E, record_bytes]`` -> ``[NB·E, record_bytes]``).
    """
    if kind not in ENCODABLE:
        raise ValueError(f"store_records: kind must be one of {ENCODABLE}, got {kind!r}")
    values = jnp.asarray(values)
    if values.ndim != 2:
        raise ValueError(f"store_records: values must be [N, D], got {values.shape}")
    n_rows, d = values.shape
    layout = RecordLayout(kind, d)
    if d % layout.group:
        raise ValueError(f"store_records: {kind} needs a multiple of {layout.group} elements, got {d}")
    shape = pages.shape
    if pages.dtype != jnp.uint8 or shape[-1] != layout.record_bytes:
        raise ValueError(
            f"store_records: pages must be uint8 [..., {layout.record_bytes}] for {kind} records of {d} "
            f"elements, got {pages.dtype} {shape}"
        )
    slots = jnp.asarray(slots, jnp.int32)
    if slots.shape != (n_rows,):
        raise ValueError(f"store_records: slots must be [{n_rows}], got {slots.shape}")
    if n_rows == 0:
        return pages
    flat = pages.reshape(-1, shape[-1])
    bn = min(block_rows, next_pow2(n_rows, 1))
    kernel = functools.partial(_store_kernel, kind=kind, rows=n_rows, bn=bn, n=d)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(flat.shape, jnp.uint8),
        grid=(cdiv(n_rows, bn),),
        input_output_aliases={2: 0},
        interpret=interpret,
        name="store_kv_records",
    )(values, slots, flat)
    return out.reshape(shape)


def encode_records(values: jax.Array, kind: str, *, interpret: bool = False) -> jax.Array:
    """Records ``uint8 [N, record_bytes]`` of ``values [N, D]`` in format ``kind`` (one per row)."""
    values = jnp.asarray(values)
    layout = RecordLayout(kind, values.shape[-1])
    n = values.shape[0]
    pages = jnp.zeros((n, layout.record_bytes), jnp.uint8)
    return store_records(pages, values, jnp.arange(n, dtype=jnp.int32), kind, interpret=interpret)


def store_records_op(
    pages: jax.Array,
    values: jax.Array,
    slots: jax.Array,
    *,
    key_format: str | None,
    block_rows: int = 8,
    interpret: bool = False,
) -> jax.Array:
    """Op ``"kv_store_records"``: the kernel for record formats; float pages are a plain scatter."""
    if key_format is None:
        flat = pages.reshape(-1, pages.shape[-1])
        target = jnp.where(slots >= 0, slots, flat.shape[0])
        return flat.at[target].set(values.astype(flat.dtype), mode="drop").reshape(pages.shape)
    return store_records(pages, values, slots, key_format, block_rows=block_rows, interpret=interpret)
