"""The DeepSeek-V4 :class:`~deepinfer_jax.models.registry.ModelFamily` (``model_type: deepseek_v4``).

``load_model(path_or_name)`` reads a V4 checkpoint under either spelling (DeepSeek-native or transformers'
``save_pretrained``) through the shared loader with :func:`.params.checkpoint_contract`, assembles it with
:func:`.params.assemble_params` and runs :func:`forward_logits` (the full forward; the incremental path is
:func:`deepinfer_jax.models.deepseek_v4.model.forward_chunk`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from deepinfer_jax.config.v4 import DeepseekV4Config
from deepinfer_jax.models.deepseek_v4 import model as v4_model
from deepinfer_jax.models.deepseek_v4.params import assemble_params, checkpoint_contract, compute_dtype
from deepinfer_jax.models.registry import ModelFamily

__all__ = ["FAMILY", "forward_logits", "init_params", "plan_for"]

IGNORED_TENSORS: tuple[str, ...] = ("mtp.*",)
"""Stored names the loader skips: the MTP draft layers (no V4 reference reads them)."""


@functools.lru_cache(maxsize=32)
def plan_for(cfg: DeepseekV4Config) -> tuple[v4_model.V4Plan, Any]:
    """``(V4Plan, LinearNumerics)`` of a config, cached (configs are frozen and hashable)."""
    return v4_model.V4Plan.from_config(cfg), v4_model.numerics_for(cfg)


def forward_logits(params: Any, cfg: DeepseekV4Config, input_ids: jax.Array) -> jax.Array:
    """Full forward without cache: ``input_ids [B, S]`` -> float32 logits ``[B, S, V]`` (``cfg`` static)."""
    plan, numerics = plan_for(cfg)
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
)
