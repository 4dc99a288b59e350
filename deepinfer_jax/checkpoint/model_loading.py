"""``load_model`` and ``init_random``: from a checkpoint (or a built-in name, or a config) to a runnable model.

Loading is the same for every family and every source:

1. resolve the source: a built-in model name (``"tiny-v3"``, materialised on first use), an HF model folder
   (single or sharded safetensors) or an orbax checkpoint folder written by ``deepinfer-jax convert``;
2. parse its ``config.json`` (an unknown ``model_type`` or ``architectures`` entry is refused here, before any
   tensor is read) and pick the family (:func:`deepinfer_jax.models.registry.get_family`);
3. check the floating tensors' dtypes against ``config.json``'s ``torch_dtype``
   (:func:`deepinfer_jax.checkpoint.loader.check_declared_dtypes`), then every tensor against the family's contract and load them one at a time onto their sharding
   (:func:`deepinfer_jax.checkpoint.load_tensors`): missing, unexpected, wrongly shaped or typed tensors (and
   NaN/inf with ``validate=True``) are all reported together and nothing is returned half-loaded;
4. run the family's load-time transforms (``assemble_params``) for the precision mode.

Orbax checkpoints hold the checkpoint-form tensors, so step 4 is the same after a restore.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from deepinfer_jax.checkpoint.deferred import DeferredTensor, deferring, is_expert_tensor
from deepinfer_jax.checkpoint.loader import ShardingSpec, check_declared_dtypes, load_tensors, read_config
from deepinfer_jax.checkpoint.reader import open_checkpoint
from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.models import builtin
from deepinfer_jax.models.registry import ModelFamily, get_family
from deepinfer_jax.ops import compile_cache

__all__ = ["DTYPES", "Model", "init_random", "load_model"]

DTYPES: tuple[str, ...] = ("float32", "bfloat16")
"""Precision modes: float32 parity mode, bfloat16 production mode (ARCHITECTURE.md §8)."""


def _check_dtype(dtype: Any) -> str:
    name = str(getattr(dtype, "name", dtype))
    if name not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not a precision mode; expected one of {DTYPES}")
    return name


class Model:
    """A loaded model: its config, parameters and family, and a cached jitted full forward.

    Attributes:
      config: the parsed :class:`~deepinfer_jax.config.model.ModelConfig`.
      params: the parameter pytree (device arrays).
      family: the :class:`~deepinfer_jax.models.registry.ModelFamily`.
      dtype: the precision mode, ``"float32"`` or ``"bfloat16"``.
      path: the checkpoint folder it came from (``None`` for random parameters).
    """

    def __init__(
        self, config: ModelConfig, params: Any, family: ModelFamily, dtype: str, path: Path | None = None
    ) -> None:
        self.config = config
        self.params = params
        self.family = family
        self.dtype = _check_dtype(dtype)
        self.path = path
        self._compiled: dict[tuple[int, int], Any] = {}
        self._lock = threading.Lock()

    @property
    def compiled_shapes(self) -> tuple[tuple[int, int], ...]:
        """The ``(batch, seq)`` shapes :meth:`logits` has compiled so far (one compilation each)."""
        return tuple(self._compiled)

    def logits(self, input_ids: Any) -> np.ndarray:
        """Full forward without cache: integer ``input_ids [B, S]`` -> float32 logits ``[B, S, V]`` (NumPy).

        Each row is a sequence starting at position 0. The forward is compiled once per ``(B, S)`` and kept.
        """
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"input_ids: expected an integer array [batch, seq], got {ids.dtype} {ids.shape}"
            )
        if ids.shape[0] < 1 or ids.shape[1] < 1:
            raise ValueError(f"input_ids: batch and seq must be >= 1, got shape {ids.shape}")
        vocab = self.config.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(
                f"input_ids: token ids must be in [0, vocab_size={vocab}), got min {ids.min()} max {ids.max()}"
            )
        ids = ids.astype(np.int32)
        key = (int(ids.shape[0]), int(ids.shape[1]))
        with self._lock:
            fn = self._compiled.get(key)
            if fn is None:
                family, config = self.family, self.config
                fn = compile_cache.compile_traced(
                    lambda params, tokens: family.forward_logits(params, config, tokens),
                    (jax.tree.map(compile_cache.struct_of, self.params), compile_cache.struct_of(ids)),
                    static_key=f"forward_logits {family.name}\n{config!r}",
                )
                self._compiled[key] = fn
        return np.asarray(fn(self.params, ids))

    def __repr__(self) -> str:
        where = f" from {self.path}" if self.path is not None else ""
        return f"Model({self.family.name}, dtype={self.dtype}{where})"


def _resolve_source(path_or_name: str | os.PathLike[str]) -> Path:
    if not isinstance(path_or_name, str | os.PathLike):
        raise TypeError(
            f"path_or_name: expected a checkpoint folder or a built-in model name, got {type(path_or_name).__name__}"
        )
    path = Path(path_or_name)
    if path.exists():
        return path
    if isinstance(path_or_name, str) and builtin.is_builtin(path_or_name):
        return builtin.materialize(path_or_name)
    raise FileNotFoundError(
        f"path_or_name: {str(path_or_name)!r} is neither an existing checkpoint folder nor a built-in model "
        f"(built-in: {', '.join(builtin.list_builtin())})"
    )


def load_model(
    path_or_name: str | os.PathLike[str],
    dtype: str = "float32",
    *,
    sharding: ShardingSpec = None,
    validate: bool = False,
    defer_experts: bool = False,
) -> Model:
    """Load a model from an HF folder, an orbax checkpoint folder or a built-in name (module docstring).

    Args:
      path_or_name: the checkpoint folder, or a built-in model name such as ``"tiny-v3"``.
      dtype: ``"float32"`` (parity mode: float32 arithmetic, FP8 weights dequantised weight-only inside the
        linear) or ``"bfloat16"`` (production mode).
      sharding: where tensors go (see :func:`~deepinfer_jax.checkpoint.load_tensors`).
      validate: also refuse NaN/inf values in any floating tensor (reads every tensor fully first).
      defer_experts: leave the routed experts unread: their stacks in the result are
        :class:`~deepinfer_jax.checkpoint.deferred.ExpertStack` leaves that read an expert when a caller asks
        for its rows (:func:`~deepinfer_jax.parallel.shard_model_params` reads only the experts of this process's
        slots). Built on the device of ``sharding`` when it is a single-device sharding. Not with ``validate``.

    Raises:
      FileNotFoundError: no such folder or built-in model, or no ``config.json``.
      ConfigValueError / ConfigTypeError: a config that does not parse (unknown architecture, bad values).
      NotImplementedError: a known family whose model is not implemented.
      CheckpointError: the tensors do not match the config (every problem listed).
    """
    dtype = _check_dtype(dtype)
    if not isinstance(validate, bool):
        raise TypeError(f"validate: expected a bool, got {type(validate).__name__}")
    if not isinstance(defer_experts, bool):
        raise TypeError(f"defer_experts: expected a bool, got {type(defer_experts).__name__}")
    if defer_experts and validate:
        raise ValueError("defer_experts: deferred experts cannot be validated at load; drop validate=True")
    path = _resolve_source(path_or_name)
    reader = open_checkpoint(path)
    tensors: dict[str, Any] = {}
    try:
        hf = read_config(reader)
        source = str(reader.config_path) if reader.config_path is not None else str(path)
        cfg = ModelConfig.from_hf(hf, source=source)
        family = get_family(cfg.family)
        expected = family.expected_tensors(cfg)
        # Before any tensor is read: a tensor stored in another floating type than config.json declares.
        check_declared_dtypes(
            reader, expected, cfg.checkpoint_dtype, config_source=f"the checkpoint's config.json ({source})"
        )
        tensors = load_tensors(
            reader,
            expected,
            sharding=sharding,
            ignore=family.ignore,
            validate_finite=validate,
            defer=is_expert_tensor if defer_experts else None,
        )
    finally:
        # Deferred tensors keep the reader open (it closes when the last of them goes).
        if not any(isinstance(t, DeferredTensor) for t in tensors.values()):
            reader.close()
    if defer_experts:
        device = (
            next(iter(sharding.device_set))
            if isinstance(sharding, jax.sharding.SingleDeviceSharding)
            else None
        )
        with deferring(device):
            params = family.assemble_params(cfg, tensors, dtype)
    else:
        params = family.assemble_params(cfg, tensors, dtype)
    del tensors
    return Model(cfg, params, family, dtype, path)


def init_random(config: ModelConfig | Mapping[str, Any], seed: int, dtype: str = "float32") -> Any:
    """Random parameters for any config of a registered family (deterministic in ``seed``).

    ``config`` is a parsed :class:`ModelConfig` or a raw HF ``config.json`` dict.
    """
    if isinstance(config, Mapping):
        config = ModelConfig.from_hf(config)
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config: expected a ModelConfig or an HF config dict, got {type(config).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed: expected a non-negative int, got {seed!r}")
    return get_family(config.family).init_params(config, seed, _check_dtype(dtype))
