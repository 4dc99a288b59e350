"""The DeepSeek-V3 :class:`~deepinfer_jax.models.registry.ModelFamily` (``model_type: deepseek_v3``)."""

from __future__ import annotations

from deepinfer_jax.models.deepseek_v3 import paged
from deepinfer_jax.models.deepseek_v3.model import forward_logits, scan_layout
from deepinfer_jax.models.deepseek_v3.weights import (
    IGNORED_TENSORS,
    assemble_params,
    expected_tensors,
    init_params,
    logical_axes,
)
from deepinfer_jax.models.registry import ModelFamily

__all__ = ["FAMILY"]

FAMILY = ModelFamily(
    name="deepseek_v3",
    expected_tensors=expected_tensors,
    ignore=IGNORED_TENSORS,
    assemble_params=assemble_params,
    init_params=init_params,
    forward_logits=forward_logits,
    logical_axes=logical_axes,
    cache_storage=paged.cache_storage,
    paged_model=paged.paged_model,
    scan_layout=scan_layout,
)
