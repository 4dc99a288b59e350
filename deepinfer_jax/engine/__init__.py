"""The inference engine: request parameters and outputs, the host scheduler, the jitted step and the facade.

Layering inside the package follows the step of ARCHITECTURE §4: :mod:`~deepinfer_jax.engine.params` (the
validated user objects and the result records), :mod:`~deepinfer_jax.engine.plan` (the numpy description of one
step that crosses from host to device), :mod:`~deepinfer_jax.engine.scheduler` (admission, chunked prefill,
decode batching, preemption and stop checks; numpy only, never jax), then the device side and the facade built
on them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer_jax._lazy import lazy_exports

# Exported lazily: the facade pulls in JAX, which the numpy-only scheduler side must not import.
_LAZY: dict[str, str] = {
    "LLM": "deepinfer_jax.engine.llm",
    "SamplingParams": "deepinfer_jax.engine.params",
    "RequestOutput": "deepinfer_jax.engine.params",
    "CompletionOutput": "deepinfer_jax.engine.params",
    "Logprob": "deepinfer_jax.engine.params",
    "RequestMetrics": "deepinfer_jax.engine.params",
}

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput", "SamplingParams"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)


if TYPE_CHECKING:
    from deepinfer_jax.engine.llm import LLM
    from deepinfer_jax.engine.params import (
        CompletionOutput,
        Logprob,
        RequestMetrics,
        RequestOutput,
        SamplingParams,
    )
