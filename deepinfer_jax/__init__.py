"""deepinfer_jax: a JAX/XLA inference engine for the DeepSeek model family.

``LLM``, ``SamplingParams``, ``load_model`` and ``init_random`` are importable from here; they (and JAX) are
loaded on first access, so ``import deepinfer_jax`` stays cheap for tools that only need the config or the
tokenizer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0.dev0"

_LAZY: dict[str, str] = {
    "LLM": "deepinfer_jax.engine.llm",
    "SamplingParams": "deepinfer_jax.engine.params",
    "load_model": "deepinfer_jax.checkpoint.model_loading",
    "init_random": "deepinfer_jax.checkpoint.model_loading",
}

__all__ = ["LLM", "SamplingParams", "__version__", "init_random", "load_model"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:
    from deepinfer_jax.checkpoint.model_loading import init_random, load_model
    from deepinfer_jax.engine.llm import LLM
    from deepinfer_jax.engine.params import SamplingParams
