"""Model families: what the checkpoint layer and the engine need to know about each DeepSeek architecture.

A :class:`ModelFamily` bundles the family-specific functions behind one interface, so that loading
(:mod:`deepinfer_jax.checkpoint.model_loading`), the CLI and the engine never branch on the family:

* ``expected_tensors(cfg)`` -- the checkpoint contract: HF name -> ``(shape, dtype names)``;
* ``ignore`` -- glob patterns of stored names the family skips silently;
* ``assemble_params(cfg, tensors, dtype)`` -- load-time transforms from checkpoint tensors to parameters
  (stacking experts, folding MLA's up projections, keeping FP8 weights FP8, casting to the precision mode);
* ``init_params(cfg, seed, dtype)`` -- deterministic random parameters of any config of the family;
* ``forward_logits(params, cfg, input_ids)`` -- the full forward without cache, ``[B, S] -> [B, S, V]``
  float32 (``cfg`` static under ``jax.jit``);
* ``logical_axes(params)`` -- the logical axis names of every parameter leaf (a pytree of tuples), which
  ``parallel/`` maps to mesh axes to lay the parameters out over a device mesh;
* ``cache_storage(dtype, kv_cache_dtype)`` -- the engine's cache storage in a precision mode for a
  ``kv_cache_dtype`` setting (``ValueError`` for a value the family does not support), checked before any weight
  is read;
* ``paged_model(model, block_size=, dtype=, kv_cache_dtype=)`` -- the engine's view of a loaded model
  (:class:`~deepinfer_jax.models.paged.PagedModel`: its paged caches and its forward over a ragged batch).

Families live in their own modules, each exposing ``FAMILY``; :func:`get_family` imports them lazily from a
table keyed by the HF ``model_type``, so importing this module costs nothing and a family under construction
does not break the others.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["FAMILY_MODULES", "ModelFamily", "get_family", "list_families"]


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """The family-specific functions of one DeepSeek architecture (see the module docstring)."""

    name: str
    expected_tensors: Callable[[Any], dict[str, tuple[tuple[int, ...], tuple[str, ...]]]]
    ignore: tuple[str, ...]
    assemble_params: Callable[[Any, Mapping[str, Any], str], Any]
    init_params: Callable[[Any, int, str], Any]
    forward_logits: Callable[[Any, Any, Any], Any]
    logical_axes: Callable[[Any], Any] | None = None
    cache_storage: Callable[[str, str], str] | None = None
    paged_model: Callable[..., Any] | None = None
    scan_layout: Callable[..., Any] | None = None
    """``scan_layout(params, config, min_run=n)``: the parameters with runs of same-structure layers stacked
    (:mod:`deepinfer_jax.models.common.layer_runs`), which every forward of the family also takes; ``None``: the
    family's layers always run unrolled."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"ModelFamily.name: expected a non-empty str, got {self.name!r}")
        if isinstance(self.ignore, str) or not all(isinstance(p, str) for p in self.ignore):
            raise TypeError(f"ModelFamily.ignore: expected a tuple of glob strings, got {self.ignore!r}")
        for field in ("expected_tensors", "assemble_params", "init_params", "forward_logits"):
            if not callable(getattr(self, field)):
                raise TypeError(f"ModelFamily.{field}: expected a callable, got {getattr(self, field)!r}")
        for field in ("logical_axes", "cache_storage", "paged_model", "scan_layout"):
            value = getattr(self, field)
            if value is not None and not callable(value):
                raise TypeError(f"ModelFamily.{field}: expected a callable or None, got {value!r}")

    def engine_support(self) -> tuple[Callable[[str, str], str], Callable[..., Any]]:
        """``(cache_storage, paged_model)``, or ``NotImplementedError`` for a family the engine cannot run."""
        if self.cache_storage is None or self.paged_model is None:
            raise NotImplementedError(f"model: the engine has no paged caches for model family {self.name!r}")
        return self.cache_storage, self.paged_model


FAMILY_MODULES: dict[str, str] = {
    "deepseek_v3": "deepinfer_jax.models.deepseek_v3.family",
    "deepseek_v4": "deepinfer_jax.models.deepseek_v4.family",
    "deepseek_v41": "deepinfer_jax.models.deepseek_v4.family_v41",
}
"""HF ``model_type`` -> module defining ``FAMILY``."""


def list_families() -> list[str]:
    """Known family names (HF ``model_type`` values), sorted."""
    return sorted(FAMILY_MODULES)


def get_family(name: str) -> ModelFamily:
    """The :class:`ModelFamily` of ``name`` (an HF ``model_type``: ``"deepseek_v3"``, ...).

    Raises:
      TypeError: ``name`` is not a str.
      ValueError: ``name`` is not a known family.
      NotImplementedError: the family is known but its model module does not exist (yet).
    """
    if not isinstance(name, str):
        raise TypeError(f"family: expected a str, got {type(name).__name__} {name!r}")
    module_name = FAMILY_MODULES.get(name)
    if module_name is None:
        raise ValueError(f"family: unknown model family {name!r}; known: {', '.join(list_families())}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name):
            raise NotImplementedError(
                f"model family {name!r} is not implemented yet (its module {module_name} does not exist)"
            ) from None
        raise
    family = getattr(module, "FAMILY", None)
    if not isinstance(family, ModelFamily):
        raise NotImplementedError(
            f"model family {name!r}: module {module_name} defines no FAMILY (a ModelFamily); it is not usable yet"
        )
    return family
