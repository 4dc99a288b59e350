"""Taps: intermediate values a model function offers to whoever traces it, for training-time objectives.

Training needs a few values that the forward computes but does not return -- the routing choices of every MoE
layer (for the auxiliary-loss-free balance of the router biases) and the V4.1 indexer's inputs with the
attention's queries and compressed keys (for the indexer's distillation loss). Model functions call
:func:`record` at those points; it does nothing unless a :func:`collect` block is active, so inference (the
engine, ``load_model``) traces and computes exactly what it did before.

Inside ``with collect() as taps:`` every :func:`record` appends ``(kind, values)`` to ``taps`` in call order (the
layer order of the forward). The values are whatever the traced function holds -- tracers when the forward runs
under ``jax.jit`` / ``jax.grad`` -- so the collecting function must use them inside the same trace (return them,
or compute a loss from them), never keep them past it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

__all__ = ["collect", "collecting", "record"]

_ACTIVE: contextvars.ContextVar[list[tuple[str, dict[str, Any]]] | None] = contextvars.ContextVar(
    "deepinfer_jax_taps", default=None
)


def record(kind: str, **values: Any) -> None:
    """Offer ``values`` under ``kind`` to the active :func:`collect` block; a no-op without one."""
    sink = _ACTIVE.get()
    if sink is not None:
        sink.append((kind, values))


def collecting() -> bool:
    """Whether a :func:`collect` block is active (a forward that would record inside a ``lax.scan`` runs unrolled
    then, :mod:`.layer_runs`)."""
    return _ACTIVE.get() is not None


@contextlib.contextmanager
def collect() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """Collect every :func:`record` made inside the block, in call order (nested blocks collect separately)."""
    sink: list[tuple[str, dict[str, Any]]] = []
    token = _ACTIVE.set(sink)
    try:
        yield sink
    finally:
        _ACTIVE.reset(token)
