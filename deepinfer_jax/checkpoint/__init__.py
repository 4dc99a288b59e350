"""Checkpoints: lazy safetensors reading, checked tensor-by-tensor loading, orbax save/restore.

* :mod:`~deepinfer_jax.checkpoint.reader` -- :func:`open_checkpoint` and the :class:`CheckpointReader`
  interface (HF safetensors folders, sharded or not, and orbax folders); the safetensors header parser and the
  streaming HF writer :func:`save_hf_checkpoint`. NumPy only.
* :mod:`~deepinfer_jax.checkpoint.loader` -- :func:`load_tensors`: the model's expectations checked against the
  checkpoint (every problem reported at once), then one tensor at a time onto its sharding; :func:`read_config`.
* :mod:`~deepinfer_jax.checkpoint.orbax_io` -- :func:`save_checkpoint` / :func:`restore_checkpoint` of
  checkpoint-form tensors with orbax (FP8/UE8M0 kept), restorable into any sharding.

The loader and orbax names are imported on first access, so ``from deepinfer_jax.checkpoint import reader``
does not import JAX or orbax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from deepinfer_jax.checkpoint.reader import (
    CheckpointError,
    CheckpointReader,
    SafetensorsReader,
    TensorInfo,
    open_checkpoint,
    save_hf_checkpoint,
)

if TYPE_CHECKING:
    from deepinfer_jax.checkpoint.loader import ExpectedTensor, check_tensors, load_tensors, read_config
    from deepinfer_jax.checkpoint.orbax_io import (
        OrbaxReader,
        is_orbax_checkpoint,
        restore_checkpoint,
        save_checkpoint,
    )

_LAZY = {
    "ExpectedTensor": "loader",
    "check_tensors": "loader",
    "load_tensors": "loader",
    "read_config": "loader",
    "OrbaxReader": "orbax_io",
    "is_orbax_checkpoint": "orbax_io",
    "restore_checkpoint": "orbax_io",
    "save_checkpoint": "orbax_io",
}

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "ExpectedTensor",
    "OrbaxReader",
    "SafetensorsReader",
    "TensorInfo",
    "check_tensors",
    "is_orbax_checkpoint",
    "load_tensors",
    "open_checkpoint",
    "read_config",
    "restore_checkpoint",
    "save_checkpoint",
    "save_hf_checkpoint",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
