"""The DeepSeek-V4 :class:`~deepinfer_jax.models.registry.ModelFamily` (``model_type: deepseek_v4``).

``load_model(path_or_name)`` reads a V4 checkpoint under either spelling (DeepSeek-native or transformers'
``save_pretrained``) through the shared loader with :func:`.params.checkpoint_contract`, assembles it with
:func:`.params.assemble_params` and runs :func:`forward_logits` (the full forward; the incremental path is
:func:`deepinfer_jax.models.deepseek_v4.model.forward_chunk`).

The precision mode follows the parameters: ``load_model(path, "bfloat16")`` assembles bfloat16 weights, and
:func:`forward_logits` then runs the plan of the production mode (``params["embed"].dtype`` says which), so each
mode is one compiled forward.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config.v4 import DeepseekV4Config
from deepinfer_jax.models.deepseek_v4 import model as v4_model
from deepinfer_jax.models.deepseek_v4 import paged
from deepinfer_jax.models.deepseek_v4.axes import logical_axes
from deepinfer_jax.models.deepseek_v4.params import assemble_params, checkpoint_contract, compute_dtype
from deepinfer_jax.models.registry import ModelFamily

__all__ = ["FAMILY", "forward_logits", "init_params", "plan_for", "precision_mode"]

IGNORED_TENSORS: tuple[str, ...] = ("mtp.*",)
"""Stored names the loader skips: the MTP draft layers (no V4 reference reads them)."""


@functools.lru_cache(maxsize=32)
def plan_for(cfg: DeepseekV4Config, dtype: str = "float32") -> tuple[v4_model.V4Plan, Any]:
    """``(V4Plan, LinearNumerics)`` of a config in precision mode ``dtype``, cached (configs are hashable)."""
    return v4_model.V4Plan.from_config(cfg, dtype), v4_model.numerics_for(cfg, dtype)


def precision_mode(params: Any) -> str:
    """The precision mode parameters were assembled for: the dtype of the embedding table."""
    if not isinstance(params, dict) or "embed" not in params:
        raise TypeError(
            "params: expected the DeepSeek-V4 parameter dict (from assemble_params / init_params)"
        )
    return jnp.dtype(params["embed"].dtype).name


def forward_logits(params: Any, cfg: DeepseekV4Config, input_ids: jax.Array) -> jax.Array:
    """Full forward without cache: ``input_ids [B, S]`` -> float32 logits ``[B, S, V]`` (``cfg`` static).

    Runs the precision mode of ``params`` (:func:`precision_mode`).
    """
    plan, numerics = plan_for(cfg, precision_mode(params))
    return v4_model.forward_logits(params, input_ids, plan=plan, numerics=numerics)


def init_params(cfg: DeepseekV4Config, seed: int, dtype: Any = "float32") -> dict[str, Any]:
    """Random parameters for ``cfg``: the deterministic synthetic V4 checkpoint of ``seed``, assembled.

    ``init_params`` of the built-in ``tiny-v4`` config with the built-in seed equals loading ``tiny-v4``.
    """
    from deepinfer_jax.models.builtin import TensorRngFactory
    from deepinfer_jax.models.deepseek_v4.synthetic import generate_v4_weights

    compute_dtype(dtype)
    tensors = generate_v4_weights(cfg.hf, TensorRngFactory(seed))
    return assemble_params(cfg, {k: np.asarray(v) for k, v in tensors.items()}, dtype)


FAMILY = ModelFamily(
    name="deepseek_v4",
    expected_tensors=checkpoint_contract,
    ignore=IGNORED_TENSORS,
    assemble_params=assemble_params,
    init_params=init_params,
    forward_logits=forward_logits,
    logical_axes=logical_axes,
    cache_storage=paged.cache_storage,
    paged_model=paged.paged_model,
)
