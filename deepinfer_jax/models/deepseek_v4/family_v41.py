"""The DeepSeek-V4.1 :class:`~deepinfer_jax.models.registry.ModelFamily` (``model_type: deepseek_v41``).

``load_model(path_or_name)`` checks a V4.1 checkpoint against :func:`.v41_params.expected_tensors` through the
shared loader (``vision.*``, ``aligner.*``, ``image_*`` and ``bias_vl`` skipped), assembles it with
:func:`.v41_params.assemble_params` (the Engram compression map from the ``tokenizer.json`` beside the config) and
runs :func:`forward_logits`, the full-prefix forward of :mod:`.v41_model`. The draft layers ``mtp.*`` are loaded
but not run.

The precision mode follows the parameters: ``load_model(path, "bfloat16")`` assembles bfloat16 weights and the
forward then uses the production-mode :class:`~.v41_model.V41Static` (``params["embed"].dtype`` says which), so
each mode is one compiled forward.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.config.v41 import DeepseekV41Config
from deepinfer_jax.models.deepseek_v4 import v41_model
from deepinfer_jax.models.deepseek_v4.axes import logical_axes
from deepinfer_jax.models.deepseek_v4.v41_params import (
    IGNORED_TENSORS,
    assemble_params,
    compute_dtype,
    engram_compression,
    expected_tensors,
    init_params,
    tokenizer_file,
)
from deepinfer_jax.models.registry import ModelFamily

__all__ = ["FAMILY", "forward_logits", "precision_mode", "static_for"]


@functools.lru_cache(maxsize=32)
def _static_cached(cfg: DeepseekV41Config, tokenizer: str | None, dtype: str) -> v41_model.V41Static:
    del tokenizer  # part of the cache key only; engram_compression finds the same file
    return v41_model.V41Static.from_config(cfg, engram_compression(cfg), dtype)


def static_for(cfg: DeepseekV41Config, dtype: str = "float32") -> v41_model.V41Static:
    """The :class:`~.v41_model.V41Static` of a config in precision mode ``dtype``, cached per (config, tokenizer
    file, mode).

    Configs compare equal whatever folder they came from, so the tokenizer file is part of the key: the Engram
    hash multipliers depend on the compressed vocabulary size it gives.
    """
    if not isinstance(cfg, DeepseekV41Config):
        raise TypeError(f"cfg: expected a DeepseekV41Config, got {type(cfg).__name__}")
    mode = jnp.dtype(compute_dtype(dtype)).name
    tokenizer = tokenizer_file(cfg)
    return _static_cached(cfg, None if tokenizer is None else str(tokenizer), mode)


def precision_mode(params: Any) -> str:
    """The precision mode parameters were assembled for: the dtype of the embedding table."""
    if not isinstance(params, dict) or "embed" not in params:
        raise TypeError(
            "params: expected the DeepSeek-V4.1 parameter dict (from assemble_params / init_params)"
        )
    return jnp.dtype(params["embed"].dtype).name


def forward_logits(params: Any, cfg: DeepseekV41Config, input_ids: jax.Array) -> jax.Array:
    """Full forward without cache: ``input_ids [B, S]`` -> float32 logits ``[B, S, V]`` (``cfg`` static).

    Runs the precision mode of ``params`` (:func:`precision_mode`).
    """
    return v41_model.forward_logits(params, input_ids, static=static_for(cfg, precision_mode(params)))


def _cache_storage(dtype: str, kv_cache_dtype: str = "auto") -> str:
    from deepinfer_jax.models.deepseek_v4 import paged_v41  # it imports this module

    return paged_v41.cache_storage(dtype, kv_cache_dtype)


def _paged_model(model: Any, **kwargs: Any) -> Any:
    from deepinfer_jax.models.deepseek_v4 import paged_v41

    return paged_v41.paged_model(model, **kwargs)


FAMILY = ModelFamily(
    name="deepseek_v41",
    expected_tensors=expected_tensors,
    ignore=IGNORED_TENSORS,
    assemble_params=assemble_params,
    init_params=init_params,
    forward_logits=forward_logits,
    logical_axes=logical_axes,
    cache_storage=_cache_storage,
    paged_model=_paged_model,
)
