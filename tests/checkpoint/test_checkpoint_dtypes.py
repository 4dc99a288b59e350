"""A floating tensor stored in another dtype than config.json's torch_dtype: refused (naming it) or, where HF
checkpoints legitimately keep float32, accepted."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest

from deepinfer_jax.checkpoint import CheckpointError, open_checkpoint
from deepinfer_jax.checkpoint.loader import check_declared_dtypes, read_config
from deepinfer_jax.checkpoint.model_loading import load_model
from deepinfer_jax.checkpoint.reader import save_hf_checkpoint, storage_dtype_for
from deepinfer_jax.models import builtin

WEIGHT = "model.layers.0.mlp.down_proj.weight"


def _rewrite(dst: Path, change: dict[str, np.dtype], config_change: dict | None = None) -> Path:
    """tiny-v3 written again by the project's writer, with the tensors of ``change`` stored in a new dtype:
    float16 / bfloat16 swaps reuse the bits (a relabelled header), float32 converts the values."""
    src = builtin.materialize("tiny-v3")
    with open_checkpoint(src) as reader:
        config = dict(read_config(reader))
        config.update(config_change or {})
        arrays = dict(reader.read_many(reader.names()))
        infos = []
        for name in reader.names():
            info = reader.info(name)
            if name in change:
                new = np.dtype(change[name])
                a = arrays[name]
                arrays[name] = a.view(new) if new.itemsize == a.dtype.itemsize else a.astype(new)
                info = dataclasses.replace(
                    info, dtype=new, storage_dtype=storage_dtype_for(new), nbytes=arrays[name].nbytes
                )
            infos.append(info)
        return save_hf_checkpoint(dst, infos, lambda names: ((n, arrays[n]) for n in names), config)


def test_the_built_in_models_load_without_a_dtype_message(caplog):
    for name in ("tiny-v3", "tiny-v4", "tiny-v41"):
        with open_checkpoint(builtin.materialize(name)) as reader:
            declared = read_config(reader).get("torch_dtype") or read_config(reader).get("dtype")
            assert declared == "bfloat16"
            with caplog.at_level(logging.WARNING):
                assert check_declared_dtypes(reader, reader.names(), declared) == []
    assert not caplog.records


def test_a_float16_tensor_in_a_bfloat16_checkpoint_is_an_error_naming_it(tmp_path):
    import ml_dtypes

    with open_checkpoint(builtin.materialize("tiny-v3")) as reader:
        assert reader.info(WEIGHT).dtype == np.dtype(ml_dtypes.bfloat16)  # the tensor really is bf16 there
    folder = _rewrite(tmp_path / "ckpt", {WEIGHT: np.float16})
    with open_checkpoint(folder) as reader:
        assert reader.info(WEIGHT).storage_dtype == "F16"
    with pytest.raises(CheckpointError) as info:
        load_model(folder)
    message = str(info.value)
    assert f"{WEIGHT!r} is stored as float16 (F16 in model.safetensors)" in message
    assert "config.json" in message and "declares torch_dtype 'bfloat16'" in message
    assert len(info.value.problems) == 1  # only the relabelled tensor


def test_a_bfloat16_tensor_in_a_float16_checkpoint_is_an_error(tmp_path):
    others = {}
    with open_checkpoint(builtin.materialize("tiny-v3")) as reader:
        for name in reader.names():
            if reader.info(name).dtype.itemsize == 2 and name != WEIGHT:
                others[name] = np.float16
    folder = _rewrite(tmp_path / "ckpt", others, {"torch_dtype": "float16"})
    with pytest.raises(CheckpointError, match=rf"'{WEIGHT}' is stored as bfloat16 .*'float16'"):
        load_model(folder)


def test_float32_tensors_in_a_bfloat16_checkpoint(tmp_path, caplog):
    """float32 norms / router biases load silently; another float32 weight loads with a warning naming it."""
    norm, bias = "model.layers.0.input_layernorm.weight", "model.layers.1.mlp.gate.e_score_correction_bias"
    with open_checkpoint(builtin.materialize("tiny-v3")) as reader:
        assert reader.find(norm) and reader.find(bias)
    folder = _rewrite(tmp_path / "kept", {norm: np.float32})
    with caplog.at_level(logging.WARNING):
        load_model(folder)
    assert not [r for r in caplog.records if "float32" in r.getMessage()]
    folder = _rewrite(tmp_path / "wide", {WEIGHT: np.float32})
    with caplog.at_level(logging.WARNING):
        model = load_model(folder)
    (record,) = [r for r in caplog.records if "float32 tensor(s)" in r.getMessage()]
    assert f"{WEIGHT!r} is stored as float32" in record.getMessage()
    assert model.params is not None


def test_without_a_declared_dtype_both_16_bit_types_are_an_error(tmp_path):
    folder = _rewrite(tmp_path / "ckpt", {WEIGHT: np.float16}, {"torch_dtype": None})
    with (
        open_checkpoint(folder) as reader,
        pytest.raises(CheckpointError, match=rf"'{WEIGHT}' is stored as float16 .*declares no torch_dtype"),
    ):
        check_declared_dtypes(reader, reader.names(), None)
