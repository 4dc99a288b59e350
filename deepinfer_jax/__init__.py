"""deepinfer_jax: a JAX/XLA inference engine for the DeepSeek model family.

``LLM``, ``SamplingParams``, ``load_model`` and ``init_random`` are importable from here; they (and JAX) are
loaded on first access, so ``import deepinfer_jax`` stays cheap for tools that only need the config or the
tokenizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer_jax._lazy import lazy_exports

__version__ = "0.1.0.dev0"

_LAZY: dict[str, str] = {
    "LLM": "deepinfer_jax.engine.llm",
    "SamplingParams": "deepinfer_jax.engine.params",
    "load_model": "deepinfer_jax.checkpoint.model_loading",
    "init_random": "deepinfer_jax.checkpoint.model_loading",
}

__all__ = ["LLM", "SamplingParams", "__version__", "init_random", "load_model"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)


if TYPE_CHECKING:
    from deepinfer_jax.checkpoint.model_loading import init_random, load_model
    from deepinfer_jax.engine.llm import LLM
    from deepinfer_jax.engine.params import SamplingParams
