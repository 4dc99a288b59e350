"""Per-token KV-cache record codecs (``spec/model.md`` §12.3) in ``jnp``.

A record is ``uint8 [..., record_bytes]`` holding one token's vector as ``[code bytes][scale bytes]``:

=============  ==========================  =========================================  ==========
cache          format                      layout at the V4.1-Flash width             bytes
=============  ==========================  =========================================  ==========
window         MXFP8                       512 E4M3 bytes, 16 UE8M0 bytes             528
compressed     FP4 + E4M3 per 16           256 packed E2M1 bytes, 32 E4M3 bytes       288
compressed     MXFP8 (``use_fp4=False``)   as window                                  528
indexer        MXFP4                       64 packed E2M1 bytes, 4 UE8M0 bytes        68
latent (V3)    bf16, unquantised           576 little-endian bf16 values              1152
=============  ==========================  =========================================  ==========

Scale byte ``g`` always covers elements ``[g·group, (g+1)·group)``; E2M1 codes pack element ``2i`` into the
low nibble. Records are token-contiguous; the indexer cache additionally uses a *block-sectioned* page
(all tokens' code rows first, then all tokens' scale rows): see :func:`pack_page` / :func:`unpack_page`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax.numerics.codecs import dequantize_groups, quantize_groups
from deepinfer_jax.numerics.elements import as_uint8, pack_nibbles, unpack_nibbles
from deepinfer_jax.numerics.formats import (
    RecordFormat,
    bf16_record_format,
    compressed_record_format,
    fp4_e4m3_record_format,
    indexer_record_format,
    latent_record_format,
    mxfp4_record_format,
    mxfp8_record_format,
    window_record_format,
)

__all__ = [
    "RecordFormat",
    "bf16_record_format",
    "compressed_record_format",
    "decode_compressed_kv",
    "decode_indexer_k",
    "decode_page",
    "decode_records",
    "decode_window_kv",
    "encode_compressed_kv",
    "encode_indexer_k",
    "encode_page",
    "encode_records",
    "encode_window_kv",
    "fp4_e4m3_record_format",
    "indexer_record_format",
    "latent_record_format",
    "mxfp4_record_format",
    "mxfp8_record_format",
    "pack_page",
    "quantize_dequantize_records",
    "unpack_page",
    "window_record_format",
]


def _check_values(x: jax.Array, fmt: RecordFormat) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"values for {fmt.name!r} records must be floating point, got dtype {x.dtype}")
    if x.ndim == 0 or x.shape[-1] != fmt.num_elements:
        raise ValueError(
            f"values for {fmt.name!r} records must have last dimension {fmt.num_elements}, got shape {x.shape}"
        )
    return x


def _check_records(records: jax.Array, fmt: RecordFormat) -> jax.Array:
    records = as_uint8(records, "records")
    if records.ndim == 0 or records.shape[-1] != fmt.record_bytes:
        raise ValueError(
            f"{fmt.name!r} records must have last dimension {fmt.record_bytes} (record_bytes), "
            f"got shape {records.shape}"
        )
    return records


def encode_records(x: jax.Array, fmt: RecordFormat) -> jax.Array:
    """Encode ``x [..., num_elements]`` into records ``uint8 [..., record_bytes]``."""
    x = _check_values(x, fmt)
    if not fmt.quantized:
        bits = lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
        lo_hi = jnp.stack([(bits & 0xFF).astype(jnp.uint8), (bits >> 8).astype(jnp.uint8)], axis=-1)
        return lo_hi.reshape(*x.shape[:-1], fmt.record_bytes)
    q = quantize_groups(x, fmt.scheme)
    codes = pack_nibbles(q.codes) if fmt.element == "e2m1" else q.codes
    return jnp.concatenate([codes, q.scales], axis=-1)


def decode_records(records: jax.Array, fmt: RecordFormat, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Decode records ``[..., record_bytes]`` into values ``[..., num_elements]`` of ``dtype``."""
    records = _check_records(records, fmt)
    if not fmt.quantized:
        pairs = records.reshape(*records.shape[:-1], fmt.num_elements, 2).astype(jnp.uint16)
        bits = pairs[..., 0] | (pairs[..., 1] << 8)
        return lax.bitcast_convert_type(bits, jnp.bfloat16).astype(dtype)
    codes = records[..., : fmt.code_bytes]
    scales = records[..., fmt.code_bytes :]
    if fmt.element == "e2m1":
        codes = unpack_nibbles(codes)
    return dequantize_groups(codes, scales, fmt.scheme, dtype=dtype)


def quantize_dequantize_records(x: jax.Array, fmt: RecordFormat) -> jax.Array:
    """What reading ``x`` back from a cache of format ``fmt`` gives (§12.4), in ``x``'s dtype."""
    x = _check_values(x, fmt)
    return decode_records(encode_records(x, fmt), fmt, dtype=x.dtype)


# ----------------------------------------------------------------------------------------------------
# Named codecs of the V4/V4.1 caches (element count taken from the input)
# ----------------------------------------------------------------------------------------------------


def encode_window_kv(x: jax.Array) -> jax.Array:
    """MXFP8 window-KV records (528 B at ``head_dim`` 512) of ``x [..., head_dim]``."""
    return encode_records(x, window_record_format(jnp.shape(x)[-1]))


def decode_window_kv(records: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Values of MXFP8 window-KV records ``[..., head_dim + head_dim/32]``."""
    rb = jnp.shape(records)[-1]
    if rb % 33:
        raise ValueError(f"window-KV records must have a multiple of 33 bytes (32 codes + 1 scale), got {rb}")
    return decode_records(records, window_record_format(rb // 33 * 32), dtype)


def encode_compressed_kv(x: jax.Array, use_fp4: bool = True) -> jax.Array:
    """Compressed-KV records of ``x [..., head_dim]``: FP4/E4M3-per-16 (288 B at 512) or MXFP8 (528 B)."""
    return encode_records(x, compressed_record_format(jnp.shape(x)[-1], use_fp4))


def decode_compressed_kv(
    records: jax.Array, use_fp4: bool = True, dtype: jnp.dtype = jnp.float32
) -> jax.Array:
    """Values of compressed-KV records (``head_dim/2 + head_dim/16`` bytes, or MXFP8 when not ``use_fp4``)."""
    rb = jnp.shape(records)[-1]
    if not use_fp4:
        if rb % 33:
            raise ValueError(f"MXFP8 compressed-KV records must have a multiple of 33 bytes, got {rb}")
        return decode_records(records, compressed_record_format(rb // 33 * 32, False), dtype)
    if rb % 9:
        raise ValueError(
            f"FP4 compressed-KV records must have a multiple of 9 bytes (8 codes + 1 scale), got {rb}"
        )
    return decode_records(records, compressed_record_format(rb // 9 * 16, True), dtype)


def encode_indexer_k(x: jax.Array) -> jax.Array:
    """MXFP4 indexer-key records (68 B at ``index_head_dim`` 128) of ``x [..., index_head_dim]``."""
    return encode_records(x, indexer_record_format(jnp.shape(x)[-1]))


def decode_indexer_k(records: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Values of MXFP4 indexer-key records ``[..., index_head_dim/2 + index_head_dim/32]``."""
    rb = jnp.shape(records)[-1]
    if rb % 17:
        raise ValueError(
            f"indexer-key records must have a multiple of 17 bytes (16 codes + 1 scale), got {rb}"
        )
    return decode_records(records, indexer_record_format(rb // 17 * 32), dtype)


# ----------------------------------------------------------------------------------------------------
# Block-sectioned pages (indexer cache)
# ----------------------------------------------------------------------------------------------------


def pack_page(records: jax.Array, fmt: RecordFormat) -> jax.Array:
    """Lay the records ``[..., N, record_bytes]`` of one page out block-sectioned: ``uint8 [..., N·record_bytes]``.

    Bytes ``[0, N·code_bytes)`` hold token 0's code row, then token 1's, ...; the scale rows of all
    tokens follow in the same token order.
    """
    records = _check_records(records, fmt)
    if records.ndim < 2:
        raise ValueError(f"records must have shape [..., tokens, {fmt.record_bytes}], got {records.shape}")
    lead, n = records.shape[:-2], records.shape[-2]
    codes = records[..., : fmt.code_bytes].reshape(*lead, n * fmt.code_bytes)
    scales = records[..., fmt.code_bytes :].reshape(*lead, n * fmt.scale_bytes)
    return jnp.concatenate([codes, scales], axis=-1)


def unpack_page(page: jax.Array, fmt: RecordFormat, num_tokens: int) -> jax.Array:
    """Inverse of :func:`pack_page`: a page ``[..., num_tokens·record_bytes]`` to records ``[..., N, rb]``."""
    page = as_uint8(page, "page")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
    if page.ndim == 0 or page.shape[-1] != num_tokens * fmt.record_bytes:
        raise ValueError(
            f"a {fmt.name!r} page of {num_tokens} tokens must have last dimension "
            f"{num_tokens * fmt.record_bytes}, got shape {page.shape}"
        )
    lead = page.shape[:-1]
    split = num_tokens * fmt.code_bytes
    codes = page[..., :split].reshape(*lead, num_tokens, fmt.code_bytes)
    scales = page[..., split:].reshape(*lead, num_tokens, fmt.scale_bytes)
    return jnp.concatenate([codes, scales], axis=-1)


def encode_page(x: jax.Array, fmt: RecordFormat) -> jax.Array:
    """Encode one page of token vectors ``x [..., N, num_elements]`` into a block-sectioned page."""
    x = _check_values(x, fmt)
    if x.ndim < 2:
        raise ValueError(f"page values must have shape [..., tokens, {fmt.num_elements}], got {x.shape}")
    return pack_page(encode_records(x, fmt), fmt)


def decode_page(
    page: jax.Array, fmt: RecordFormat, num_tokens: int, dtype: jnp.dtype = jnp.float32
) -> jax.Array:
    """Decode a block-sectioned page into values ``[..., num_tokens, num_elements]``."""
    return decode_records(unpack_page(page, fmt, num_tokens), fmt, dtype)
