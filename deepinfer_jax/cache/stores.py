"""How the compressed-attention families keep their keys: :class:`KeyStore` and the :class:`CompressedCache` pytree.

DeepSeek-V4 and V4.1 keep three kinds of keys -- window keys in per-slot rings, compressed keys and indexer keys
in paged blocks -- each either as plain values or as the production records of one format (MXFP8 window keys,
FP4 or MXFP8 compressed keys, MXFP4 indexer keys, :mod:`deepinfer_jax.numerics.kv_records`). A
:class:`KeyStore` says which, and every reader -- the step that wrote a key as well as later ones -- reads it
back through :meth:`KeyStore.decode`, which is exactly the model's production round trip.

Both families use one cache pytree, :class:`CompressedCache`: per-layer window rings, the pages of each layer
that owns compressed or indexer keys (V4: every compressed layer; V4.1: its KV and index-K sources, which
consumers alias), the projection rings of every compressor that pools several tokens, and V4.1's Engram
history. Everything per sequence (rings, history) is indexed by state slot; everything per token range
(pages) by block.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from deepinfer_jax.numerics.activation import kv_cast
from deepinfer_jax.numerics.formats import (
    RecordFormat,
    compressed_record_format,
    indexer_record_format,
    window_record_format,
)
from deepinfer_jax.numerics.kv_records import decode_records, encode_records

__all__ = ["KEY_CACHE_DTYPES", "CompressedCache", "KeyStore", "key_cache_storage", "key_store"]

KEY_CACHE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "quantized")
"""``kv_cache_dtype`` values of V4 / V4.1 besides ``"auto"``: unquantised float32 or bfloat16 keys, or the
production records (``"quantized"``: MXFP8 window, FP4 or MXFP8 compressed, MXFP4 indexer keys)."""

_RECORD_NAMES = {("e4m3", "ue8m0"): "MXFP8", ("e2m1", "e4m3"): "FP4", ("e2m1", "ue8m0"): "MXFP4"}
# The key formats of the attention-side ops (deepinfer_jax/ops/sparse_attention.py) by element, scale, group.
_OP_FORMATS = {("e4m3", "ue8m0", 32): "mxfp8", ("e2m1", "e4m3", 16): "fp4", ("e2m1", "ue8m0", 32): "mxfp4"}


def key_cache_storage(family: str, dtype: str, kv_cache_dtype: str) -> str:
    """The key storage of ``family`` in precision ``dtype`` with the ``kv_cache_dtype`` setting, or
    ``ValueError`` naming the value and the choices. ``"auto"`` follows the mode: float32 keys in parity mode,
    the production records (``"quantized"``) in production mode."""
    choices = ("auto", *KEY_CACHE_DTYPES)
    if kv_cache_dtype not in choices:
        raise ValueError(
            f"kv_cache_dtype: {kv_cache_dtype!r} is not supported for {family}; expected one of {choices} "
            "('quantized' stores the production formats: MXFP8 window, FP4/MXFP8 compressed, MXFP4 indexer keys)"
        )
    if kv_cache_dtype == "auto":
        return "float32" if dtype == "float32" else "quantized"
    return kv_cache_dtype


@dataclasses.dataclass(frozen=True)
class KeyStore:
    """How one kind of key (window, compressed, indexer) is stored: plain values or quantised records.

    With ``record`` set, keys are ``uint8 [..., record_bytes]`` records and reading one back gives the format's
    dequantised value; otherwise they are values of ``dtype`` and ``cast`` names the precision mode's own round
    trip (:func:`~deepinfer_jax.numerics.activation.kv_cast`, ``"none"`` in parity mode).
    """

    width: int
    dtype: str
    cast: str = "none"
    record: RecordFormat | None = None

    @property
    def item_shape(self) -> tuple[int, ...]:
        return (self.record.record_bytes,) if self.record is not None else (self.width,)

    @property
    def item_dtype(self) -> Any:
        return jnp.uint8 if self.record is not None else jnp.dtype(self.dtype)

    @property
    def item_bytes(self) -> int:
        if self.record is not None:
            return self.record.record_bytes
        return self.width * jnp.dtype(self.dtype).itemsize

    def describe(self) -> str:
        """One key's storage in words, e.g. ``"MXFP8 (e4m3 + ue8m0 scales per 32) 132 B"`` or
        ``"float32 512 B"``."""
        r = self.record
        if r is not None:
            name = _RECORD_NAMES.get((r.element, r.scale), r.name)
            return f"{name} ({r.element} + {r.scale} scales per {r.group_size}) {r.record_bytes} B"
        return f"{self.dtype} {self.item_bytes} B"

    def zeros(self, *lead: int) -> jax.Array:
        """A zeroed array of ``lead`` keys (rings ``(num_slots, W)``, pages ``(num_blocks, per_page)``)."""
        return jnp.zeros((*lead, *self.item_shape), self.item_dtype)

    def encode(self, x: jax.Array) -> jax.Array:
        """What is stored for keys ``x [..., width]``.

        Records are encoded from ``x`` once: the record format *is* the production cast, so a key read back in
        a later step equals the one the writing step attended to, bit for bit.
        """
        if self.record is not None:
            return encode_records(x.astype(jnp.float32), self.record)
        return kv_cast(x, self.cast).astype(self.item_dtype)

    def decode(self, stored: jax.Array, dtype: Any) -> jax.Array:
        """The keys a reader sees, in ``dtype``."""
        if self.record is not None:
            return decode_records(stored, self.record, dtype=jnp.float32).astype(dtype)
        return stored.astype(dtype)

    @property
    def op_format(self) -> str | None:
        """This storage as the attention-side ops name it (their ``key_format`` / ``window_format`` /
        ``compressed_format``): ``None`` for plain values, else ``"mxfp8"``, ``"fp4"`` or ``"mxfp4"``."""
        r = self.record
        if r is None:
            return None
        name = _OP_FORMATS.get((r.element, r.scale, r.group_size))
        if name is None:
            raise ValueError(f"KeyStore: record format {r.name!r} has no attention-op format name")
        return name

    @property
    def encodes_in_ops(self) -> bool:
        """Whether an op that computes the keys itself (``v4_compress_store``) stores exactly :meth:`encode`'s
        bytes: records (the op encodes them), or plain values without a cast (the op only converts them)."""
        return self.record is not None or self.cast == "none"

    def op_values(self, x: jax.Array) -> jax.Array:
        """What ``kv_store_records(..., key_format=self.op_format)`` takes to store exactly :meth:`encode`'s
        bytes for keys ``x``: ``x`` for records (the op encodes), the mode's cast of ``x`` for plain values."""
        if self.record is not None:
            return x
        return kv_cast(x, self.cast)


def key_store(
    kind: str, width: int, cache_dtype: str, *, cast: str = "none", use_fp4: bool = True
) -> KeyStore:
    """The :class:`KeyStore` of ``kind`` (``"window"``, ``"compressed"``, ``"indexer"``) for keys of ``width``
    values: plain float32 or bfloat16 values (with the mode's ``cast`` applied first) for ``cache_dtype``
    ``"float32"`` / ``"bfloat16"``, else (``"quantized"``) the production record format (compressed keys: FP4,
    or MXFP8 with ``use_fp4 = False``)."""
    if cache_dtype in ("float32", "bfloat16"):
        return KeyStore(width, cache_dtype, cast)
    if cache_dtype != "quantized":
        raise ValueError(
            f"key_store: cache_dtype {cache_dtype!r} is not 'float32', 'bfloat16' or 'quantized'"
        )
    if kind == "window":
        fmt = window_record_format(width)
    elif kind == "compressed":
        fmt = compressed_record_format(width, use_fp4=use_fp4)
    elif kind == "indexer":
        fmt = indexer_record_format(width)
    else:
        raise ValueError(f"key_store: kind {kind!r} is not 'window', 'compressed' or 'indexer'")
    return KeyStore(width, "float32", cast, fmt)


class CompressedCache(NamedTuple):
    """The device cache of a compressed-attention model (module docstring), a pytree.

    Attributes:
      window: per layer, the window ring ``[num_slots, W, ...]`` (position ``q`` at ``q % W``).
      kv: per compressed-key owner, its pages ``[num_blocks, block / r, ...]``.
      ik: per indexer-key owner, its pages ``[num_blocks, block / r, ...]``.
      state: per compressor that pools several tokens, float32 rings ``(projections, gates)`` of its last
        tokens ``[num_slots, R, F]`` each (V4.1's ratio-2 pending pair keeps ``(a, g)`` there).
      engram: V4.1's Engram history ``int32 [num_slots, Nmax - 1]`` (the last compressed ids), or ``None``.
      draft: V4.1's DSpark context-key rings, one ``[num_slots, W + B, D]`` per draft layer (speculative engines
        only; empty otherwise).
    """

    window: tuple[jax.Array, ...]
    kv: tuple[jax.Array, ...]
    ik: tuple[jax.Array, ...]
    state: tuple[tuple[jax.Array, jax.Array], ...]
    engram: jax.Array | None = None
    draft: tuple[jax.Array, ...] = ()
