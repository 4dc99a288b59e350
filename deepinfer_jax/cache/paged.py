"""The paged DeepSeek-V3 latent cache: layout, memory planning, token writes, paged reads and attention.

Layout. One array ``[num_layers, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` holds, for every
layer (the MTP layers after the backbone), the normalised MLA latent ``c`` followed by the rotated shared key
``k_pe`` of each cached token. Block ``b`` row ``i`` of a sequence whose block table is ``bt`` holds the token
at position ``j * block_size + i`` when ``bt[j] == b``. **Block 0 is reserved**: it is never handed to a
sequence, so ``-1`` entries of a block table (unused) can be clamped to it safely -- every read of such an
entry is masked by position. Storage is float32 in parity mode and bfloat16 in production mode
(ARCHITECTURE.md §8; 1152 bytes per token and layer at V3's 512 + 64), ``kv_cache_dtype`` overriding either.

``kv_cache_dtype="quantized"`` selects the **FP8 latent record** (storage ``"fp8"``, ``uint8`` bytes, 656 B per
token and layer at 512 + 64, the FlashMLA-style layout of spec/model.md §16): the ``C`` latent values as E4M3
codes, one float32 ``scale_inv = max(amax, 1e-4) / 448`` per 128 latent values (little-endian bytes; a last
group may be shorter), then the ``R`` rope values as little-endian bf16. :func:`write_tokens` encodes and
:func:`read_tokens` / :func:`paged_mla_attention` decode it, so callers pass and get float values either way.

All device functions take the **whole** cache and a static layer index and address it with a single gather or
scatter, so XLA never slices a layer out (a slice of a donated buffer is a copy) and a decode step's temporary
memory stays proportional to one block per query token, not to the cache.

:func:`paged_mla_attention` is the reference implementation of op ``"paged_mla_attention"``: the absorbed-MLA
core of :func:`deepinfer_jax.models.deepseek_v3.attention.mla_attention` over a flat ragged token batch,
walking each token's block table one block at a time with an online (flash) softmax in float32.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from deepinfer_jax.cache.plan import CacheLayout
from deepinfer_jax.cache.record_bytes import record_bytes
from deepinfer_jax.numerics.codecs import dequantize_groups, quantize_groups
from deepinfer_jax.numerics.formats import QuantScheme
from deepinfer_jax.ops.ascend import ascend_impl
from deepinfer_jax.ops.registry import register_impl, register_op

__all__ = [
    "LATENT_CACHE_DTYPES",
    "LatentCacheSpec",
    "decode_latent_fp8",
    "dense_context",
    "encode_latent_fp8",
    "fp8_latent_record_bytes",
    "init_latent_cache",
    "latent_cache_dtype",
    "latent_cache_layout",
    "paged_mla_attention",
    "parse_bytes",
    "read_tokens",
    "slot_mapping",
    "write_tokens",
]

LATENT_CACHE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "fp8")
"""Storage formats of the paged V3 latent cache (``"fp8"``: the FP8 latent record, module docstring)."""

#: Latent values one float32 scale of the FP8 latent record covers.
FP8_LATENT_GROUP = 128
_FP8_LATENT = QuantScheme("e4m3", "float32", FP8_LATENT_GROUP)

_HIGHEST = lax.Precision.HIGHEST
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})
_BYTES_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Any, field: str = "kv_cache_memory") -> int:
    """A byte count from an int or a string such as ``"2GiB"``, ``"512 MiB"``, ``"1.5GB"`` or ``"4096"``.

    Binary (``KiB``, ``MiB``, ``GiB``, ``TiB``) and decimal (``KB`` ... ``TB``) units are accepted,
    case-insensitive. The result must be a positive whole number of bytes.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(f"{field}: expected an int or a string such as '2GiB', got {type(value).__name__}")
    if isinstance(value, int):
        number = value
    else:
        match = _BYTES_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{field}: cannot parse {value!r} as a size; expected e.g. '2GiB', '512MiB', '1.5GB' or '4096'"
            )
        scaled = float(match.group(1)) * _UNITS[unit]
        number = int(scaled)
        if number != scaled:
            raise ValueError(f"{field}: {value!r} is not a whole number of bytes ({scaled})")
    if number < 1:
        raise ValueError(f"{field}: must be at least 1 byte, got {value!r}")
    return number


def latent_cache_dtype(mode: str, kv_cache_dtype: str = "auto") -> str:
    """Storage format of the latent cache for precision ``mode`` and the ``kv_cache_dtype`` override.

    ``"auto"`` follows the mode (float32 parity, bfloat16 production); ``"float32"``/``"bfloat16"`` force it;
    ``"quantized"`` (or ``"fp8"``) is the FP8 latent record (module docstring).
    """
    if mode not in ("float32", "bfloat16"):
        raise ValueError(f"dtype: {mode!r} is not a precision mode; expected one of ('float32', 'bfloat16')")
    if kv_cache_dtype == "auto":
        return mode
    if kv_cache_dtype == "quantized":
        return "fp8"
    if kv_cache_dtype not in LATENT_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype: {kv_cache_dtype!r} is not supported by the DeepSeek-V3 paged latent cache; "
            f"expected 'auto', 'quantized' or one of {LATENT_CACHE_DTYPES}"
        )
    return kv_cache_dtype


def fp8_latent_record_bytes(kv_rank: int, rope_dim: int) -> int:
    """Bytes of one FP8 latent record: ``C`` codes, ``4 · ceil(C / 128)`` scale bytes, ``2 · R`` rope bytes."""
    return kv_rank + 4 * -(-kv_rank // FP8_LATENT_GROUP) + 2 * rope_dim


def storage_dtype(dtype: str) -> jnp.dtype:
    """The array dtype of a latent cache format (``uint8`` for the FP8 record)."""
    return jnp.dtype(jnp.uint8) if dtype == "fp8" else jnp.dtype(dtype)


def _le_bytes(bits: jax.Array, count: int) -> jax.Array:
    """The ``count`` little-endian bytes of unsigned ``bits [...]`` as ``uint8 [..., count]``."""
    return jnp.stack([((bits >> (8 * i)) & 0xFF).astype(jnp.uint8) for i in range(count)], axis=-1)


def _from_le(b: jax.Array) -> jax.Array:
    """``uint32 [...]`` from little-endian bytes ``uint8 [..., n]``."""
    out = jnp.zeros(b.shape[:-1], jnp.uint32)
    for i in range(b.shape[-1]):
        out = out | (b[..., i].astype(jnp.uint32) << (8 * i))
    return out


def encode_latent_fp8(entries: jax.Array, kv_rank: int) -> jax.Array:
    """FP8 latent records ``uint8 [..., fp8_latent_record_bytes(C, R)]`` of ``entries [..., C + R]``."""
    entries = jnp.asarray(entries)
    lat = entries[..., :kv_rank].astype(jnp.float32)
    rope = entries[..., kv_rank:]
    q = quantize_groups(lat, _FP8_LATENT)
    scale_bytes = _le_bytes(lax.bitcast_convert_type(q.scales, jnp.uint32), 4)
    rope_bits = lax.bitcast_convert_type(rope.astype(jnp.bfloat16), jnp.uint16).astype(jnp.uint32)
    parts = [
        q.codes,
        scale_bytes.reshape(*lat.shape[:-1], -1),
        _le_bytes(rope_bits, 2).reshape(*lat.shape[:-1], -1),
    ]
    return jnp.concatenate(parts, axis=-1)


def decode_latent_fp8(records: jax.Array, kv_rank: int, rope_dim: int, dtype: Any = jnp.float32) -> jax.Array:
    """Values ``[..., C + R]`` of FP8 latent records (inverse of :func:`encode_latent_fp8` up to the rounding)."""
    records = jnp.asarray(records)
    groups = -(-kv_rank // FP8_LATENT_GROUP)
    if records.shape[-1] != fp8_latent_record_bytes(kv_rank, rope_dim):
        raise ValueError(
            f"FP8 latent records of {kv_rank} + {rope_dim} values have {fp8_latent_record_bytes(kv_rank, rope_dim)} "
            f"bytes, got shape {records.shape}"
        )
    lead = records.shape[:-1]
    codes = records[..., :kv_rank]
    sbytes = records[..., kv_rank : kv_rank + 4 * groups].reshape(*lead, groups, 4)
    scales = lax.bitcast_convert_type(_from_le(sbytes), jnp.float32)
    lat = dequantize_groups(codes, scales, _FP8_LATENT)
    rbytes = records[..., kv_rank + 4 * groups :].reshape(*lead, rope_dim, 2)
    rope = lax.bitcast_convert_type(_from_le(rbytes).astype(jnp.uint16), jnp.bfloat16).astype(jnp.float32)
    return jnp.concatenate([lat, rope], axis=-1).astype(dtype)


@dataclasses.dataclass(frozen=True)
class LatentCacheSpec:
    """Static shape facts of a paged latent cache (hashable: a jit static argument).

    Attributes:
      num_layers: cached layers (backbone + MTP).
      num_blocks: blocks, including the reserved block 0.
      block_size: tokens per block.
      kv_rank: ``kv_lora_rank`` (the latent width ``C``).
      rope_dim: ``qk_rope_head_dim`` (``R``).
      dtype: storage format name, one of :data:`LATENT_CACHE_DTYPES`.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    kv_rank: int
    rope_dim: int
    dtype: str

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "kv_rank", "rope_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LatentCacheSpec.{name}: expected a positive int, got {value!r}")
        if isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int) or self.num_blocks < 2:
            raise ValueError(
                f"LatentCacheSpec.num_blocks: expected an int >= 2 (block 0 is reserved), got {self.num_blocks!r}"
            )
        if self.dtype not in LATENT_CACHE_DTYPES:
            raise ValueError(f"LatentCacheSpec.dtype: {self.dtype!r} is not one of {LATENT_CACHE_DTYPES}")

    @property
    def width(self) -> int:
        """Values per cached token and layer, ``C + R``."""
        return self.kv_rank + self.rope_dim

    @property
    def row_width(self) -> int:
        """Items per cached token and layer: ``C + R`` values, or the bytes of an FP8 latent record."""
        if self.dtype == "fp8":
            return fp8_latent_record_bytes(self.kv_rank, self.rope_dim)
        return self.width

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.num_blocks, self.block_size, self.row_width)

    @property
    def bytes_per_token_layer(self) -> int:
        return self.row_width * np.dtype(storage_dtype(self.dtype)).itemsize

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers (the unit memory planning divides by)."""
        return self.num_layers * self.block_size * self.bytes_per_token_layer

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def usable_tokens(self) -> int:
        """Token capacity of the allocatable blocks (all but block 0)."""
        return (self.num_blocks - 1) * self.block_size


def _bytes_per_token_layer(model_config: Any, dtype: str) -> int:
    width = model_config.kv_lora_rank + model_config.qk_rope_head_dim
    if dtype == "fp8":
        return fp8_latent_record_bytes(model_config.kv_lora_rank, model_config.qk_rope_head_dim)
    if dtype == "bfloat16":
        # The production record of the numerics library (bf16 latent + rope); it agrees with 2 * width.
        return record_bytes(model_config)["latent"]
    return width * 4


def latent_cache_layout(model_config: Any, *, block_size: int, dtype: str) -> CacheLayout:
    """The :class:`~deepinfer_jax.cache.plan.CacheLayout` of a V3 model's paged latent cache.

    Every cached layer (``num_layers_total`` of the config: the MTP layers keep a cache too) stores one latent
    record per token; V3 has no per-sequence state slots. :func:`~deepinfer_jax.cache.plan.plan_memory` sizes
    the block pool from it.
    """
    if dtype not in LATENT_CACHE_DTYPES:
        raise ValueError(
            f"dtype: {dtype!r} is not a latent cache dtype; expected one of {LATENT_CACHE_DTYPES}"
        )
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"cache.block_size: expected a positive int, got {block_size!r}")
    per_token = _bytes_per_token_layer(model_config, dtype)
    layers = int(model_config.num_layers_total)
    width = model_config.kv_lora_rank + model_config.qk_rope_head_dim
    what = "E4M3 latent + float32 scale per 128 + bf16 rope" if dtype == "fp8" else f"x {dtype}"
    return CacheLayout(
        block_size=block_size,
        bytes_per_block=per_token * block_size * layers,
        bytes_per_slot=0,
        dtype=dtype,
        lines=(
            f"latent record: {width} values ({model_config.kv_lora_rank} latent + "
            f"{model_config.qk_rope_head_dim} rope) {what} = {per_token} B per token per layer, {layers} layers",
        ),
    )


def init_latent_cache(spec: LatentCacheSpec, sharding: Any = None) -> jax.Array:
    """A zeroed cache of ``spec.shape`` in the storage dtype (zeros keep masked reads finite)."""
    dtype = storage_dtype(spec.dtype)
    if sharding is None:
        return jnp.zeros(spec.shape, dtype)
    return jax.jit(lambda: jnp.zeros(spec.shape, dtype), out_shardings=sharding)()


# -------------------------------------------------------------------------------------- device


def slot_mapping(
    block_tables: jax.Array, token_seq: jax.Array, positions: jax.Array, block_size: int, num_blocks: int
) -> tuple[jax.Array, jax.Array]:
    """Where each token of a ragged batch lives: ``(block ids [T], offsets [T])``.

    ``token_seq[t]`` is the row of ``block_tables [S, M]`` owning token ``t`` (``S`` or more = padding).
    Padding tokens, and tokens whose table entry is unused (``-1``), map to block ``num_blocks`` -- out of
    range, so a scatter with ``mode="drop"`` ignores them.
    """
    seqs, max_blocks = block_tables.shape
    real = token_seq < seqs
    row = jnp.where(real, token_seq, 0)
    index = jnp.clip(positions // block_size, 0, max_blocks - 1)
    block = block_tables[row, index]
    valid = real & (block >= 0) & (positions // block_size < max_blocks)
    return jnp.where(valid, block, num_blocks).astype(jnp.int32), (positions % block_size).astype(jnp.int32)


def write_tokens(
    cache: jax.Array,
    layer: int | jax.Array,
    entries: jax.Array,
    blocks: jax.Array,
    offsets: jax.Array,
    *,
    kv_rank: int | None = None,
) -> jax.Array:
    """``cache`` with ``entries [T, C + R]`` written at ``(layer, blocks[t], offsets[t])``.

    Tokens whose block is out of range (padding, see :func:`slot_mapping`) are dropped. Under ``jax.jit`` with
    the cache donated this is an in-place scatter. An FP8 latent cache (``uint8``) stores the encoded records;
    it needs the latent width ``kv_rank`` unless the record width tells it unambiguously (it does not when
    ``C`` is a multiple of 128 and ``C + 4`` would fit the same record, e.g. DeepSeek-V3's 512 + 64).
    """
    if cache.dtype == jnp.uint8:
        c = kv_rank if kv_rank is not None else _fp8_kv_rank(cache.shape[-1], entries.shape[-1])
        if fp8_latent_record_bytes(c, entries.shape[-1] - c) != cache.shape[-1]:
            raise ValueError(
                f"write_tokens: FP8 latent records of {c} + {entries.shape[-1] - c} values have "
                f"{fp8_latent_record_bytes(c, entries.shape[-1] - c)} bytes, the cache has {cache.shape[-1]}"
            )
        entries = encode_latent_fp8(entries, c)
    return cache.at[layer, blocks, offsets].set(entries.astype(cache.dtype), mode="drop")


def _fp8_kv_rank(record_width: int, width: int) -> int:
    """The latent width ``C`` of FP8 latent records of ``record_width`` bytes holding ``width = C + R`` values.

    Not unique when ``C`` is a multiple of 128 (``C`` and ``C + 4`` give the same record width): such widths
    are refused rather than guessed, and the caller passes ``kv_rank``.
    """
    found = [c for c in range(1, width + 1) if fp8_latent_record_bytes(c, width - c) == record_width]
    if len(found) != 1:
        raise ValueError(
            f"cannot tell the latent width of {width}-value entries from FP8 latent records of {record_width} "
            f"bytes (candidates {found}); pass kv_rank="
        )
    return found[0]


def read_tokens(
    cache: jax.Array,
    layer: int | jax.Array,
    blocks: jax.Array,
    offsets: jax.Array,
    *,
    kv_rank: int | None = None,
    rope_dim: int | None = None,
) -> jax.Array:
    """The entries at ``(layer, blocks, offsets)`` (matching index shapes); out-of-range blocks read 0.

    An FP8 latent cache needs ``kv_rank`` and ``rope_dim`` and returns the decoded float32 values.
    """
    rows = cache.at[layer, blocks, offsets].get(mode="fill", fill_value=0)
    if cache.dtype != jnp.uint8:
        return rows
    if kv_rank is None or rope_dim is None:
        raise ValueError("read_tokens: an FP8 latent cache needs kv_rank and rope_dim")
    return decode_latent_fp8(rows, kv_rank, rope_dim)


def paged_mla_attention(
    q_lat: jax.Array,
    q_pe: jax.Array,
    cache: jax.Array,
    layer: int | jax.Array,
    token_seq: jax.Array,
    positions: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    *,
    scale: float,
) -> jax.Array:
    """Absorbed MLA over the paged cache for a flat ragged batch (reference of op ``"paged_mla_attention"``).

    Args:
      q_lat: ``[T, Nh, C]`` queries in the latent space (``q_nope · W_UK``).
      q_pe: ``[T, Nh, R]`` rotated RoPE queries.
      cache: the whole paged cache ``[L, num_blocks, block_size, C + R]`` (or ``uint8`` FP8 latent records);
      this step's tokens are already in it.
      layer: the layer index into ``cache`` (an int, or a traced ``int32`` scalar in a scanned run of layers).
      token_seq: ``int [T]`` row of ``block_tables`` owning each token; ``>= S`` marks padding (output zeros).
      positions: ``int [T]`` absolute positions; key position ``k`` is visible to a query at ``p`` iff ``k <=
      p``.
      block_tables: ``int [S, M]`` physical block ids of each sequence; unused entries ``-1``.
      context_lens: ``int [S]`` cached tokens of each sequence after this step's writes (bounds the block
      walk).
      scale: the softmax scale.

    Returns:
      ``[T, Nh, C]`` float32 probability-weighted latents. The loop runs over the blocks of the longest
      context in the batch, one block per query token per iteration (``T · block_size · (C + R)`` values of
      temporary memory), with a running max and sum in float32.
    """
    tokens, heads, kv_rank = q_lat.shape
    seqs, max_blocks = block_tables.shape
    block_size = cache.shape[2]
    real = token_seq < seqs
    row = jnp.where(real, token_seq, 0)
    tables = jnp.where(block_tables >= 0, block_tables, 0)[
        row
    ]  # [T, M]; -1 -> reserved block 0, masked below
    q_lat32 = q_lat.astype(jnp.float32)
    q_pe32 = q_pe.astype(jnp.float32)
    pos = jnp.where(real, positions, -1).astype(jnp.int32)
    max_len = jnp.max(context_lens).astype(jnp.int32)
    num_iters = jnp.minimum((max_len + block_size - 1) // block_size, max_blocks)
    offsets = jnp.arange(block_size, dtype=jnp.int32)

    fp8 = cache.dtype == jnp.uint8
    rope_dim = q_pe.shape[-1]

    def body(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        peak, total, acc = carry
        blk = lax.dynamic_index_in_dim(tables, j, axis=1, keepdims=False)  # [T]
        if fp8:  # FP8 latent records, decoded one block per token at a time
            kv = decode_latent_fp8(cache[layer, blk], kv_rank, rope_dim)
        else:
            kv = cache[layer, blk].astype(jnp.float32)  # [T, bs, C + R]
        c, k_pe = kv[..., :kv_rank], kv[..., kv_rank:]
        scores = jnp.einsum("thc,tkc->thk", q_lat32, c, precision=_HIGHEST) + jnp.einsum(
            "thr,tkr->thk", q_pe32, k_pe, precision=_HIGHEST
        )
        scores = scores * jnp.float32(scale)
        visible = (j * block_size + offsets)[None, :] <= pos[:, None]  # [T, bs]
        scores = jnp.where(visible[:, None, :], scores, -jnp.inf)
        new_peak = jnp.maximum(peak, jnp.max(scores, axis=-1))
        safe_peak = jnp.where(jnp.isfinite(new_peak), new_peak, 0.0)
        correction = jnp.where(jnp.isfinite(peak), jnp.exp(peak - safe_peak), 0.0)
        probs = jnp.where(visible[:, None, :], jnp.exp(scores - safe_peak[..., None]), 0.0)
        total = total * correction + jnp.sum(probs, axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("thk,tkc->thc", probs, c, precision=_HIGHEST)
        return new_peak, total, acc

    init = (
        jnp.full((tokens, heads), -jnp.inf, jnp.float32),
        jnp.zeros((tokens, heads), jnp.float32),
        jnp.zeros((tokens, heads, kv_rank), jnp.float32),
    )
    _, total, acc = lax.fori_loop(0, num_iters, body, init)
    return acc / jnp.where(total > 0, total, 1.0)[..., None]


register_op(
    "paged_mla_attention",
    paged_mla_attention,
    doc="absorbed MLA over a paged latent cache for a ragged token batch, blockwise online softmax (model.md §16)",
)
register_impl(
    "paged_mla_attention",
    "pallas_gpu",
    "pallas_kernels.paged_mla:paged_mla_attention",
    platforms=("gpu",),
    reason="the Pallas Triton kernel needs the pallas_kernels package",
)
register_impl(
    "paged_mla_attention",
    "ascend",
    ascend_impl("paged_mla_attention", paged_mla_attention),
    platforms=("ascend",),
)


def dense_context(cache: np.ndarray, layer: int, block_table: np.ndarray, length: int) -> np.ndarray:
    """Host helper: the first ``length`` cached tokens of one sequence, ``[length, C + R]`` (for tests)."""
    block_size = cache.shape[2]
    needed = math.ceil(length / block_size)
    if needed > len(block_table) or np.any(np.asarray(block_table[:needed]) < 0):
        raise ValueError(
            f"block_table: {length} tokens need {needed} allocated blocks, got {list(block_table)}"
        )
    rows = np.asarray(cache[layer])[np.asarray(block_table[:needed])].reshape(-1, cache.shape[3])
    return rows[:length]
