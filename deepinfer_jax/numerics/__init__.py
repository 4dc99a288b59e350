"""Quantised number formats of the DeepSeek models: codes, scales, codecs, records and a reference linear.

Submodules:

* :mod:`~deepinfer_jax.numerics.formats` -- constants and layout descriptions (:class:`QuantScheme`,
  :class:`RecordFormat`); no JAX.
* :mod:`~deepinfer_jax.numerics.elements` -- E4M3/E2M1/UE8M0 element codes and nibble packing (``jnp``).
* :mod:`~deepinfer_jax.numerics.scales` -- the power-of-two, E4M3-per-16 and float32 scale rules (``jnp``).
* :mod:`~deepinfer_jax.numerics.codecs` -- group and block-scaled weight codecs (``jnp``).
* :mod:`~deepinfer_jax.numerics.kv_records` -- per-token KV records and block-sectioned pages (``jnp``).
* :mod:`~deepinfer_jax.numerics.activation` -- the activation round trips and :class:`CastPolicy` (``jnp``).
* :mod:`~deepinfer_jax.numerics.qlinear` -- tile-by-tile quantised linear layers (``jnp``).
* :mod:`~deepinfer_jax.numerics.host` -- ``numpy``/``ml_dtypes`` twins for offline use; no JAX.

The names below are importable from the package directly. The JAX-backed ones are loaded on first access, so
``import deepinfer_jax.numerics.host`` (or the format descriptions) never pulls in JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from deepinfer_jax.numerics.formats import (
    E2M1_MAX,
    E4M3_MAX,
    FP4_E4M3_16,
    MXFP4,
    MXFP8,
    QuantScheme,
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

_LAZY: dict[str, str] = {
    # codecs
    "QuantizedGroups": "codecs",
    "quantize_groups": "codecs",
    "dequantize_groups": "codecs",
    "quantize_dequantize_groups": "codecs",
    "quantize_fp8_blockwise": "codecs",
    "dequantize_fp8_blockwise": "codecs",
    "quantize_mxfp4": "codecs",
    "dequantize_mxfp4": "codecs",
    # kv records
    "encode_records": "kv_records",
    "decode_records": "kv_records",
    "quantize_dequantize_records": "kv_records",
    "encode_window_kv": "kv_records",
    "decode_window_kv": "kv_records",
    "encode_compressed_kv": "kv_records",
    "decode_compressed_kv": "kv_records",
    "encode_indexer_k": "kv_records",
    "decode_indexer_k": "kv_records",
    "pack_page": "kv_records",
    "unpack_page": "kv_records",
    "encode_page": "kv_records",
    "decode_page": "kv_records",
    # activation casts
    "CastPolicy": "activation",
    "activation_cast": "activation",
    "kv_cast": "activation",
    "mxfp8_cast": "activation",
    "mxfp4_cast": "activation",
    "fp4_e4m3_cast": "activation",
    "fp8_token_block_cast": "activation",
    # quantised linear
    "fp8_linear": "qlinear",
    "mxfp4_linear": "qlinear",
    "grouped_fp8_linear": "qlinear",
    "grouped_mxfp4_linear": "qlinear",
}

__all__ = [
    "E2M1_MAX",
    "E4M3_MAX",
    "FP4_E4M3_16",
    "MXFP4",
    "MXFP8",
    "CastPolicy",
    "QuantScheme",
    "QuantizedGroups",
    "RecordFormat",
    "activation_cast",
    "bf16_record_format",
    "compressed_record_format",
    "decode_compressed_kv",
    "decode_indexer_k",
    "decode_page",
    "decode_records",
    "decode_window_kv",
    "dequantize_fp8_blockwise",
    "dequantize_groups",
    "dequantize_mxfp4",
    "encode_compressed_kv",
    "encode_indexer_k",
    "encode_page",
    "encode_records",
    "encode_window_kv",
    "fp4_e4m3_cast",
    "fp4_e4m3_record_format",
    "fp8_linear",
    "fp8_token_block_cast",
    "grouped_fp8_linear",
    "grouped_mxfp4_linear",
    "indexer_record_format",
    "kv_cast",
    "latent_record_format",
    "mxfp4_cast",
    "mxfp4_linear",
    "mxfp4_record_format",
    "mxfp8_cast",
    "mxfp8_record_format",
    "pack_page",
    "quantize_dequantize_groups",
    "quantize_dequantize_records",
    "quantize_fp8_blockwise",
    "quantize_groups",
    "quantize_mxfp4",
    "unpack_page",
    "window_record_format",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:
    from deepinfer_jax.numerics.activation import (
        CastPolicy,
        activation_cast,
        fp4_e4m3_cast,
        fp8_token_block_cast,
        kv_cast,
        mxfp4_cast,
        mxfp8_cast,
    )
    from deepinfer_jax.numerics.codecs import (
        QuantizedGroups,
        dequantize_fp8_blockwise,
        dequantize_groups,
        dequantize_mxfp4,
        quantize_dequantize_groups,
        quantize_fp8_blockwise,
        quantize_groups,
        quantize_mxfp4,
    )
    from deepinfer_jax.numerics.kv_records import (
        decode_compressed_kv,
        decode_indexer_k,
        decode_page,
        decode_records,
        decode_window_kv,
        encode_compressed_kv,
        encode_indexer_k,
        encode_page,
        encode_records,
        encode_window_kv,
        pack_page,
        quantize_dequantize_records,
        unpack_page,
    )
    from deepinfer_jax.numerics.qlinear import (
        fp8_linear,
        grouped_fp8_linear,
        grouped_mxfp4_linear,
        mxfp4_linear,
    )
