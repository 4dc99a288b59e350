"""Writing DeepSeek-V4/V4.1 cache records: ops ``"kv_store_records"`` and ``"v4_compress_store"``.

* ``kv_store_records(pages, values, slots, *, key_format)`` encodes ``values [N, D]`` into records of
  ``key_format`` (``"mxfp8"`` window keys, ``"fp4"`` / ``"mxfp8"`` compressed keys, ``"mxfp4"`` indexer keys;
  ``None`` stores the float values) and writes row ``n`` at flat row ``slots[n]`` of ``pages`` viewed as
  ``[rows, record_bytes]``; a negative slot skips its row.
* ``v4_compress_store(pages, kv, gate, norm_weight, cos, sin, slots, *, eps, rope_dim, key_format, entry_dtype)``
  is compress-and-store of finished compression windows (§7.3): the softmax-gated pooling of each window's
  ``S`` slots (``kv``, ``gate`` ``[N, S, D]`` float32, softmax over the slots per channel), rounded to
  ``entry_dtype``; the RMSNorm with ``norm_weight`` (the rounding points of :func:`deepinfer_jax.ops.rms_norm`);
  that is the pre-RoPE entry ``P`` the indexer keys are projected from, returned. Then RoPE of the last
  ``rope_dim`` channels at the entry's position (``cos``/``sin [N, rope_dim/2]``), rounded to ``entry_dtype``,
  encoded and written like ``kv_store_records``. Returns ``(pages, P)``.

The references are the numerics codecs and the ops' own ``jnp`` math; the ``pallas_gpu`` kernels
(``pallas_kernels/kv_records.py``, ``pallas_kernels/compress_store.py``) encode in registers bit-exactly and
write the records in place (the page array is aliased to the output).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.numerics.kv_records import encode_records
from deepinfer_jax.ops.ascend import ascend_impl
from deepinfer_jax.ops.registry import register_impl, register_op
from deepinfer_jax.ops.rmsnorm import rms_norm
from deepinfer_jax.ops.rope import apply_rope
from deepinfer_jax.ops.sparse_attention import key_record_format

__all__ = ["STORE_FORMATS", "kv_store_records", "pool_windows", "v4_compress_store"]

#: Formats the store ops write (``None``: float values).
STORE_FORMATS: tuple[str | None, ...] = (None, "mxfp8", "fp4", "mxfp4")


def _encode(values: jax.Array, key_format: str | None, pages: jax.Array) -> jax.Array:
    fmt = key_record_format(key_format, values.shape[-1])
    if fmt is None:
        return values.astype(pages.dtype)
    return encode_records(values.astype(jnp.float32), fmt)


def _check_pages(op: str, pages: jax.Array, dim: int, key_format: str | None) -> None:
    if key_format not in STORE_FORMATS:
        raise ValueError(f"{op}: key_format must be one of {STORE_FORMATS}, got {key_format!r}")
    fmt = key_record_format(key_format, dim)
    want = dim if fmt is None else fmt.record_bytes
    if pages.shape[-1] != want or (fmt is not None and pages.dtype != jnp.uint8):
        raise ValueError(
            f"{op}: pages must end in {want} {'values' if fmt is None else 'record bytes (uint8)'} for "
            f"{key_format} keys of {dim} values, got {pages.dtype} {pages.shape}"
        )


def _scatter(pages: jax.Array, records: jax.Array, slots: jax.Array) -> jax.Array:
    flat = pages.reshape(-1, pages.shape[-1])
    target = jnp.where(slots >= 0, slots, flat.shape[0])  # out of range: dropped
    return flat.at[target].set(records.astype(flat.dtype), mode="drop").reshape(pages.shape)


def kv_store_records(
    pages: jax.Array, values: jax.Array, slots: jax.Array, *, key_format: str | None
) -> jax.Array:
    """``pages`` with ``values [N, D]`` encoded (module docstring) at flat rows ``slots [N]`` (``-1`` = skip)."""
    pages, values, slots = jnp.asarray(pages), jnp.asarray(values), jnp.asarray(slots)
    if values.ndim != 2 or slots.shape != values.shape[:1]:
        raise ValueError(
            f"kv_store_records: values [N, D] and slots [N] expected, got {values.shape}, {slots.shape}"
        )
    _check_pages("kv_store_records", pages, values.shape[1], key_format)
    return _scatter(pages, _encode(values, key_format, pages), slots.astype(jnp.int32))


def pool_windows(kv: jax.Array, gate: jax.Array) -> jax.Array:
    """``Σ_slot softmax_slot(gate) ⊙ kv`` over axis ``-2`` in float32 (the V4 compressor's pooling)."""
    weights = jax.nn.softmax(gate.astype(jnp.float32), axis=-2)
    return jnp.sum(weights * kv.astype(jnp.float32), axis=-2)


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
) -> tuple[jax.Array, jax.Array]:
    """Compress-and-store (module docstring): ``(pages with the new entries, P [N, D] in entry_dtype)``."""
    pages, kv, gate, cos, sin, slots = (jnp.asarray(a) for a in (pages, kv, gate, cos, sin, slots))
    if kv.ndim != 3 or gate.shape != kv.shape:
        raise ValueError(f"v4_compress_store: kv and gate must be [N, S, D], got {kv.shape} and {gate.shape}")
    n, _, dim = kv.shape
    if cos.shape != (n, rope_dim // 2) or sin.shape != cos.shape or slots.shape != (n,):
        raise ValueError(
            f"v4_compress_store: cos/sin [{n}, {rope_dim // 2}] and slots [{n}] expected, got {cos.shape}, "
            f"{sin.shape}, {slots.shape}"
        )
    _check_pages("v4_compress_store", pages, dim, key_format)
    dtype = jnp.dtype(entry_dtype)
    pooled = pool_windows(kv, gate).astype(dtype)
    pre_rope = rms_norm(pooled, norm_weight, eps=eps, out_dtype=dtype)
    keys = apply_rope(pre_rope, cos, sin, rope_dim=rope_dim)
    return _scatter(pages, _encode(keys, key_format, pages), slots.astype(jnp.int32)), pre_rope


register_op(
    "kv_store_records",
    kv_store_records,
    doc="encode vectors as MXFP8 / FP4 / MXFP4 cache records and write them at flat page rows",
)
register_op(
    "v4_compress_store",
    v4_compress_store,
    doc="DeepSeek-V4 compress-and-store: gated pooling, RMSNorm, RoPE, record encoding and the paged write",
)
for _op, _target, _ref in (
    ("kv_store_records", "kv_records:store_records_op", kv_store_records),
    ("v4_compress_store", "compress_store:v4_compress_store", v4_compress_store),
):
    register_impl(
        _op,
        "pallas_gpu",
        f"pallas_kernels.{_target}",
        platforms=("gpu",),
        reason="the Pallas Triton kernel needs the pallas_kernels package",
    )
    register_impl(_op, "ascend", ascend_impl(_op, _ref), platforms=("ascend",))
