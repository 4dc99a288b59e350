"""Per-token record sizes of the production cache formats, derived from :mod:`deepinfer_jax.numerics` layouts.

Cache kinds (``spec/model.md`` §12.3, §16; ``spec/engine.md`` §6.3):

* DeepSeek-V4 / V4.1: ``"window"`` (MXFP8 over ``head_dim``; every backbone and draft layer),
  ``"compressed"`` (FP4 with E4M3 per-16 scales over ``head_dim``, or MXFP8 when ``use_fp4_sparse_kv`` is
  false), ``"indexer"`` (MXFP4 over ``index_head_dim``).
* DeepSeek-V3: ``"latent"`` (bf16 ``[kv_lora_rank latent | qk_rope_head_dim rope]``).

The model config is duck-typed: only the attributes named in each function are read, so any object with them
(the typed config, a ``types.SimpleNamespace``) works.

**Convention for whole-model sizes.** A compressed layer of ratio ``r`` stores one record per ``r`` tokens, so
the bytes per token of a model are a rational number (V4's ratio-128 layers give quarters of a byte).
:func:`kv_bytes_per_token` returns it exactly as a :class:`fractions.Fraction` (which compares equal to an
``int`` when integral); :func:`kv_bytes_per_block` gives the integer bytes of a block of tokens (128 by
default, the reference page). Both count raw record bytes: alignment padding of pages and regions belongs to
the cache layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from deepinfer_jax.numerics.formats import (
    RecordFormat,
    compressed_record_format,
    indexer_record_format,
    latent_record_format,
    window_record_format,
)

FAMILIES = ("deepseek_v3", "deepseek_v4", "deepseek_v41")
DEFAULT_BLOCK_TOKENS = 128


def _family(model_config: Any) -> str:
    family = getattr(model_config, "family", None)
    family = str(getattr(family, "value", family))
    if family not in FAMILIES:
        raise ValueError(f"model_config.family must be one of {FAMILIES}, got {family!r}")
    return family


def _positive_int(model_config: Any, field: str) -> int:
    value = getattr(model_config, field, None)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"model_config.{field} must be an int, got {type(value).__name__} ({value!r})")
    if value < 1:
        raise ValueError(f"model_config.{field} must be >= 1, got {value}")
    return value


def cache_record_formats(model_config: Any) -> dict[str, RecordFormat]:
    """The :class:`RecordFormat` of each cache kind of the model's production formats.

    Reads ``family``; V4/V4.1: ``head_dim``, ``index_head_dim`` (kind omitted when absent or ``None``, i.e. a
    model without compressed layers), ``use_fp4_sparse_kv`` (absent or ``None`` means true); V3:
    ``kv_lora_rank``, ``qk_rope_head_dim``.
    """
    family = _family(model_config)
    if family == "deepseek_v3":
        return {
            "latent": latent_record_format(
                _positive_int(model_config, "kv_lora_rank"), _positive_int(model_config, "qk_rope_head_dim")
            )
        }
    head_dim = _positive_int(model_config, "head_dim")
    use_fp4 = getattr(model_config, "use_fp4_sparse_kv", None)
    if use_fp4 is not None and not isinstance(use_fp4, bool):
        raise TypeError(f"model_config.use_fp4_sparse_kv must be a bool, got {type(use_fp4).__name__}")
    formats = {
        "window": window_record_format(head_dim),
        "compressed": compressed_record_format(head_dim, use_fp4=use_fp4 is not False),
    }
    if getattr(model_config, "index_head_dim", None) is not None:
        formats["indexer"] = indexer_record_format(_positive_int(model_config, "index_head_dim"))
    return formats


def record_bytes(model_config: Any) -> dict[str, int]:
    """Bytes per token record of each cache kind, e.g. ``{"window": 528, "compressed": 288, "indexer": 68}``
    for the V4.1-Flash shape and ``{"latent": 1152}`` for DeepSeek-V3."""
    return {kind: fmt.record_bytes for kind, fmt in cache_record_formats(model_config).items()}


def _layer_ratios(model_config: Any) -> list[int]:
    num_layers = _positive_int(model_config, "num_hidden_layers")
    ratios = getattr(model_config, "compress_ratios", None)
    if not isinstance(ratios, Sequence) or isinstance(ratios, str):
        raise TypeError(f"model_config.compress_ratios must be a sequence of ints, got {ratios!r}")
    if len(ratios) < num_layers:
        raise ValueError(
            f"model_config.compress_ratios must have at least num_hidden_layers={num_layers} entries, "
            f"got {len(ratios)}"
        )
    out = []
    for i, r in enumerate(ratios[:num_layers]):
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"model_config.compress_ratios[{i}] must be an int >= 0, got {r!r}")
        out.append(r)
    return out


def _source_layers(model_config: Any, field: str, ratios: list[int]) -> list[int]:
    ids = getattr(model_config, field)
    if not isinstance(ids, Sequence) or isinstance(ids, str):
        raise TypeError(f"model_config.{field} must be a sequence of layer ids, got {ids!r}")
    for layer in ids:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(ratios):
            raise ValueError(f"model_config.{field} entry {layer!r} is not a layer id in [0, {len(ratios)})")
        if ratios[layer] == 0:
            raise ValueError(
                f"model_config.{field} names layer {layer}, whose compress_ratios entry is 0 (window-only)"
            )
    return list(ids)


def kv_bytes_per_token(model_config: Any, *, num_draft_layers: int = 0) -> Fraction:
    """Exact cache bytes per token of the whole model (see the module docstring for the convention).

    * V4.1 (reads ``compress_ratios``, ``num_hidden_layers``, ``kv_source_layer_ids``,
      ``index_k_source_layer_ids``): every backbone layer stores a window record per token; each KV-source
      layer of ratio ``r`` a compressed record per ``r`` tokens; each index-K source (``None`` or absent
      means the KV sources) an indexer record per ``r`` tokens. Consumers share their sources' records.
    * V4 (reads ``compress_ratios``, ``num_hidden_layers``, optional ``compress_rate_csa``): every compressed
      layer is its own source; the CSA layers (ratio ``compress_rate_csa``, else the smallest ratio present)
      also store indexer keys.
    * V3 (reads ``num_hidden_layers``): one latent record per layer per token.

    ``num_draft_layers`` adds the per-layer cache of draft/MTP layers (a window record for V4/V4.1, a latent
    record for V3); the ratio entries of draft layers are not read.
    """
    if isinstance(num_draft_layers, bool) or not isinstance(num_draft_layers, int) or num_draft_layers < 0:
        raise ValueError(f"num_draft_layers must be an int >= 0, got {num_draft_layers!r}")
    family = _family(model_config)
    sizes = record_bytes(model_config)
    if family == "deepseek_v3":
        return Fraction(
            sizes["latent"] * (_positive_int(model_config, "num_hidden_layers") + num_draft_layers)
        )

    ratios = _layer_ratios(model_config)
    total = Fraction(sizes["window"] * (len(ratios) + num_draft_layers))
    if family == "deepseek_v41":
        kv_sources = _source_layers(model_config, "kv_source_layer_ids", ratios)
        if getattr(model_config, "index_k_source_layer_ids", None) is None:
            index_sources = kv_sources
        else:
            index_sources = _source_layers(model_config, "index_k_source_layer_ids", ratios)
    else:
        kv_sources = [layer for layer, r in enumerate(ratios) if r > 0]
        csa = getattr(model_config, "compress_rate_csa", None)
        if csa is None and kv_sources:
            csa = min(ratios[layer] for layer in kv_sources)
        index_sources = [layer for layer in kv_sources if ratios[layer] == csa]
    for layer in kv_sources:
        total += Fraction(sizes["compressed"], ratios[layer])
    if index_sources and "indexer" not in sizes:
        raise ValueError("model_config.index_head_dim is required when layers store indexer keys, got None")
    for layer in index_sources:
        total += Fraction(sizes["indexer"], ratios[layer])
    return total


def kv_bytes_per_block(
    model_config: Any, block_tokens: int = DEFAULT_BLOCK_TOKENS, *, num_draft_layers: int = 0
) -> int:
    """Integer cache bytes of ``block_tokens`` consecutive tokens of one sequence (raw records, no padding).

    Raises ``ValueError`` when a compression ratio does not divide ``block_tokens`` (the block would hold a
    fractional record).
    """
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise ValueError(f"block_tokens must be a positive int, got {block_tokens!r}")
    total = kv_bytes_per_token(model_config, num_draft_layers=num_draft_layers) * block_tokens
    if total.denominator != 1:
        raise ValueError(
            f"block_tokens={block_tokens} does not hold a whole number of records for every compressed layer "
            f"(bytes per block would be {total}); use a multiple of every compression ratio"
        )
    return int(total)


_ELEMENT_NAMES = {"e4m3": "FP8 E4M3", "e2m1": "FP4 E2M1", "bf16": "bf16"}
_SCALE_NAMES = {"ue8m0": "UE8M0", "e4m3": "E4M3"}


def describe_record_formats(model_config: Any) -> dict[str, str]:
    """One line per cache kind of the production formats, saying what its bytes are: ``{"window": "132 B:
    128 B of FP8 E4M3 codes + 4 B of UE8M0 scales (one per 32)", ...}``. Quantised records carry their scales,
    so at small head dims they can be larger than an unquantised record of the same values."""
    out = {}
    for kind, fmt in cache_record_formats(model_config).items():
        element = _ELEMENT_NAMES.get(fmt.element, fmt.element)
        if fmt.scale is None:
            out[kind] = f"{fmt.record_bytes} B: {fmt.num_elements} {element} values, unquantised"
        else:
            scale = _SCALE_NAMES.get(fmt.scale, fmt.scale)
            out[kind] = (
                f"{fmt.record_bytes} B: {fmt.code_bytes} B of {element} codes + {fmt.scale_bytes} B of {scale} "
                f"scales (one per {fmt.group_size})"
            )
    return out
