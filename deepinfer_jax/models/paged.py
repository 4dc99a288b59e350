"""What a model family provides to the engine step: its paged caches, their size, and a forward over a ragged batch.

The engine step (:mod:`deepinfer_jax.engine.step`) is family-agnostic: it resolves pending token ids, keeps the
penalty counts, samples and advances the per-slot state. Everything that depends on the model goes through a
:class:`PagedModel` -- a frozen, hashable object (a static argument of the jitted step) that says

* how much device memory one cache block (all layers) and one state slot take (:meth:`PagedModel.layout`), so
  the memory planner (:func:`~deepinfer_jax.cache.plan.plan_memory`) can size the block pool;
* how to build the zeroed cache pytree for ``num_blocks`` blocks and ``num_slots`` state slots
  (:meth:`PagedModel.init_cache`); the step donates it, so every update is in place;
* how to run the model over one flat ragged batch (:meth:`PagedModel.forward`): token ids ``[T]`` plus the
  step's :class:`~deepinfer_jax.cache.ragged.RaggedMeta`, returning float32 logits of each row's last token and
  the updated cache.

Each family's paged model lives with the family (``models/deepseek_v3/paged.py``, ``models/deepseek_v4/paged.py``,
``models/deepseek_v4/paged_v41.py``) and is built by its :class:`~deepinfer_jax.models.registry.ModelFamily`
(``paged_model``), so the engine never branches on the family.
"""

from __future__ import annotations

import abc
from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.cache.plan import CacheLayout
from deepinfer_jax.cache.ragged import RaggedMeta

__all__ = ["CacheLayout", "PagedModel", "zeros"]


class PagedModel(abc.ABC):
    """A model family as the engine step runs it (module docstring). Subclasses are frozen dataclasses."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Width of the logits."""

    @abc.abstractmethod
    def layout(self) -> CacheLayout:
        """Bytes per block and per state slot."""

    @abc.abstractmethod
    def init_cache(self, num_blocks: int, num_slots: int, sharding: Any = None) -> Any:
        """A zeroed cache pytree for ``num_blocks`` blocks (block 0 reserved) and ``num_slots`` state slots."""

    @abc.abstractmethod
    def forward(
        self,
        params: Any,
        cache: Any,
        token_ids: jax.Array,
        meta: RaggedMeta,
        *,
        tile: int | None,
        logit_index: jax.Array | None = None,
    ) -> tuple[jax.Array, Any]:
        """Run ``token_ids [T]`` (concrete ids) through the model: ``(logits float32 [N, V], cache)``.

        ``logit_index`` (int32 ``[N]``) names the tokens whose logits are returned; the default,
        ``meta.last_token()``, is each row's last token (``N = S``). Prompt logprobs pass every token
        (``arange(T)``). With ``tile`` every per-token computation runs in fixed tiles of that many tokens
        (batch-invariant mode, :mod:`deepinfer_jax.ops.tiling`).
        """


def zeros(shape: tuple[int, ...], dtype: Any, sharding: Any = None) -> jax.Array:
    """A zeroed device array, optionally created directly with ``sharding``."""
    if sharding is None:
        return jnp.zeros(shape, dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
