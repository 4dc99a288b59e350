"""Config errors name the user-facing key and where its value came from: a checkpoint's declared dtype is
config.json's torch_dtype / dtype, never the engine's dtype setting of the same name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deepinfer_jax.config import load_config
from deepinfer_jax.models import builtin


def _copy(name: str, tmp_path: Path, **changes) -> Path:
    folder = tmp_path / name
    shutil.copytree(builtin.materialize(name), folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_bad_torch_dtype_names_config_json_not_the_engine_dtype(tmp_path):
    folder = _copy("tiny-v3", tmp_path, torch_dtype="float8")
    with pytest.raises(ValueError) as info:
        load_config(str(folder), env={}, overrides={"dtype": "float32"})
    message = str(info.value)
    assert message.startswith("torch_dtype = 'float8' (config.json's dtype of the checkpoint's unquantised")
    assert str(folder / "config.json") in message
    assert "set by override dtype" not in message  # the engine's dtype override did not set it


def test_a_v41_dtype_names_its_key(tmp_path):
    folder = _copy("tiny-v41", tmp_path, dtype="float32")
    with pytest.raises(ValueError) as info:
        load_config(str(folder), env={}, overrides={"dtype": "bfloat16"})
    message = str(info.value)
    assert message.startswith(
        "dtype = 'float32' (config.json's dtype of the checkpoint's unquantised tensors"
    )
    assert "V4.1 checkpoint's unquantised tensors are 'bfloat16'" in message
    assert "[set by" not in message


def test_sources_are_still_named_when_they_set_the_value(tmp_path):
    folder = _copy("tiny-v3", tmp_path)
    with pytest.raises(ValueError, match=r"torch_dtype = 'int4' .*\[set by override model\.torch_dtype\]"):
        load_config(str(folder), env={}, overrides={"model.torch_dtype": "int4"})
    # The engine's own dtype: its override is the source.
    with pytest.raises(ValueError, match=r"dtype = 'float16'.*\[set by override dtype\]"):
        load_config(str(folder), env={}, overrides={"dtype": "float16"})
