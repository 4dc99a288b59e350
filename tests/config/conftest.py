"""Shared fixtures of the config tests: the repository's configs/ folder and fresh copies of its model dicts."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deepinfer_jax.config.loaders import read_yaml_file

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ALL_CONFIGS = ("tiny_v3", "tiny_v4", "tiny_v41", "deepseek_v3", "deepseek_v41_flash")


@pytest.fixture(scope="session")
def configs_dir() -> Path:
    return CONFIGS


@pytest.fixture(scope="session")
def _model_sections() -> dict[str, dict[str, Any]]:
    return {name: read_yaml_file(CONFIGS / f"{name}.yaml")["model"] for name in ALL_CONFIGS}


@pytest.fixture
def hf(_model_sections: dict[str, dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    """``hf("tiny_v41")`` -> a fresh, mutable copy of that yaml's ``model:`` section (an HF config.json dict)."""
    return lambda name: copy.deepcopy(_model_sections[name])


@pytest.fixture
def model_dir(tmp_path: Path) -> Callable[[dict[str, Any]], Path]:
    """Write an HF dict as ``config.json`` into a fresh checkpoint-like directory and return the directory."""
    counter = iter(range(1_000_000))

    def write(hf_dict: dict[str, Any]) -> Path:
        directory = tmp_path / f"ckpt{next(counter)}"
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(hf_dict, indent=2))
        return directory

    return write
