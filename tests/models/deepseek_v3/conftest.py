"""Shared, expensive set-up of the DeepSeek-V3 tests: the transformers fixtures, loaded once per session."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax.models.deepseek_v3 import model as v3_model

DATA = Path(__file__).resolve().parents[2] / "data" / "v3"
FIXTURE_MODELS = ("lora", "nolora")


class Fixture:
    """One transformers fixture: the loaded model, its reference arrays, and shared jitted functions."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.folder = DATA / name
        self.model = deepinfer_jax.load_model(self.folder)
        self.cfg = self.model.config
        self.params = self.model.params
        with np.load(self.folder / "reference.npz") as ref:
            self.ref = {k: ref[k] for k in ref.files}
        self.meta = json.loads((DATA / "meta.json").read_text())["models"][name]
        self.forward = jax.jit(v3_model.forward, static_argnums=1)
        self.hidden = jax.jit(v3_model.forward_hidden, static_argnums=1)
        self.mtp = jax.jit(v3_model.mtp_forward, static_argnums=1)


_CACHE: dict[str, Fixture] = {}


@pytest.fixture(scope="session", params=FIXTURE_MODELS)
def v3_fixture(request: Any) -> Fixture:
    name = request.param
    if name not in _CACHE:
        _CACHE[name] = Fixture(name)
    return _CACHE[name]
