"""Shared, session-scoped set-up of the DeepSeek-V4 tests: the transformers fixtures and the tiny-v4 model.

Loading the checkpoint and compiling the forward are the expensive parts, so they happen once per session; the
jitted functions are shared so that each (batch, length) shape compiles once.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from deepinfer_jax.config import load_model_config
from deepinfer_jax.models import builtin
from deepinfer_jax.models.deepseek_v4 import model as v4_model
from deepinfer_jax.models.deepseek_v4.params import assemble_params

DATA = Path(__file__).resolve().parents[2] / "data" / "v4"
# Incremental tests share one state capacity so that decode steps compile once.
MAX_LEN = 64


class V4Setup:
    """The tiny-v4 config, raw tensors, parameters, plan and jitted entry points."""

    def __init__(self) -> None:
        self.path = builtin.materialize("tiny-v4")
        self.config = load_model_config(self.path / "config.json")
        self.tensors: dict[str, np.ndarray] = load_file(self.path / "model.safetensors")
        self.params = assemble_params(self.config, self.tensors)
        self.plan = v4_model.V4Plan.from_config(self.config)
        self.numerics = v4_model.numerics_for(self.config)
        self._full = jax.jit(v4_model.forward_logits, static_argnames=("plan", "numerics"))
        self._chunk = jax.jit(v4_model.forward_chunk, static_argnames=("plan", "numerics"))

    def full(self, ids: np.ndarray, params: Any = None) -> np.ndarray:
        """Full-forward logits of ``ids`` with the tiny-v4 parameters (or other ones of the same structure)."""
        params = self.params if params is None else params
        return np.asarray(
            self._full(params, np.asarray(ids, np.int32), plan=self.plan, numerics=self.numerics)
        )

    def chunk(self, ids: np.ndarray, start: int, state: Any) -> tuple[np.ndarray, Any]:
        logits, state = self._chunk(
            self.params,
            np.asarray(ids, np.int32),
            np.int32(start),
            state,
            plan=self.plan,
            numerics=self.numerics,
        )
        return np.asarray(logits), state

    def fresh_state(self, batch: int = 1) -> Any:
        return v4_model.init_state(self.plan, batch, MAX_LEN)


@pytest.fixture(scope="session")
def v4() -> V4Setup:
    return V4Setup()


@pytest.fixture(scope="session")
def v4_meta() -> dict[str, Any]:
    return json.loads((DATA / "meta.json").read_text())


@pytest.fixture(scope="session")
def v4_logits() -> dict[str, np.ndarray]:
    with np.load(DATA / "logits.npz") as f:
        return dict(f)


@pytest.fixture(scope="session")
def v4_modules() -> dict[str, np.ndarray]:
    with np.load(DATA / "modules.npz") as f:
        return dict(f)


@pytest.fixture(scope="session", autouse=True)
def _same_weights_as_fixtures(v4: V4Setup, v4_meta: dict[str, Any]) -> None:
    """The fixtures were computed from the built-in weights; a changed generator must regenerate them."""
    digest = hashlib.sha256((v4.path / "model.safetensors").read_bytes()).hexdigest()
    assert digest == v4_meta["weights_sha256"], (
        "tiny-v4 weights differ from those the transformers fixtures were made with; rerun "
        "scripts/reference_fixtures/v4.py"
    )
