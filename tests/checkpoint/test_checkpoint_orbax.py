"""Orbax save/restore of checkpoint-form tensors: dtype fidelity, special shapes, resharding, reader interface."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from _checkpoint_helpers import sample_arrays
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from deepinfer_jax.checkpoint import (
    CheckpointError,
    OrbaxReader,
    is_orbax_checkpoint,
    load_tensors,
    open_checkpoint,
    restore_checkpoint,
    save_checkpoint,
)

CONFIG = {"model_type": "deepseek_v4", "vocab_size": 6}


def _host_arrays() -> dict[str, np.ndarray]:
    arrays = sample_arrays(7)
    arrays["packed_f4"] = np.arange(8, dtype=np.uint8).reshape(2, 4)
    arrays["empty"] = np.zeros((0, 3), ml_dtypes.bfloat16)
    arrays["u16"] = np.arange(3, dtype=np.uint16)
    arrays["model.prefixed"] = np.ones(2, np.float32)
    return arrays


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    arrays = _host_arrays()
    tok = tmp_path_factory.mktemp("src") / "tokenizer.json"
    tok.write_text('{"model": {}}')
    folder = tmp_path_factory.mktemp("orbax") / "ckpt"
    out = save_checkpoint(folder, arrays, CONFIG, storage_dtypes={"packed_f4": "F4"}, files=[tok])
    assert out == folder
    return folder, arrays


def test_layout_and_manifest(saved):
    folder, _ = saved
    assert is_orbax_checkpoint(folder)
    assert json.loads((folder / "config.json").read_text()) == CONFIG
    assert (folder / "tokenizer.json").read_text() == '{"model": {}}'
    manifest = json.loads((folder / "deepinfer_checkpoint.json").read_text())["tensors"]
    assert manifest["layers.0.attn.wq_a.scale"]["dtype"] == "F8_E8M0"
    assert manifest["packed_f4"] == {"dtype": "F4", "shape": [2, 4], "stored": True}
    assert manifest["empty"] == {"dtype": "BF16", "shape": [0, 3], "stored": False}
    assert manifest["scalar"]["shape"] == []
    assert not list(folder.parent.glob(".ckpt.*"))  # no temporaries left behind


def test_reader_gives_back_every_dtype_bit_exact(saved):
    folder, arrays = saved
    with open_checkpoint(folder) as reader:
        assert isinstance(reader, OrbaxReader)
        assert reader.names() == sorted(arrays)
        assert reader.config_path == folder / "config.json"
        assert reader.info("packed_f4").storage_dtype == "F4"
        assert reader.info("packed_f4").header_shape == (2, 8)
        got = dict(reader.read_many(reader.names()))
        assert reader.read("prefixed").tobytes() == arrays["model.prefixed"].tobytes()
    for name, want in arrays.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert got[name].tobytes() == want.tobytes(), name


def test_restore_to_device_keeps_dtypes(saved):
    folder, arrays = saved
    out = restore_checkpoint(folder)
    assert sorted(out) == sorted(arrays)
    for name, want in arrays.items():
        got = out[name]
        if want.dtype.itemsize == 8 and not jax.config.read("jax_enable_x64"):
            assert got.dtype.itemsize == 4  # narrowed losslessly (the values are small integers)
            np.testing.assert_array_equal(np.asarray(got), want)
            continue
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert np.asarray(got).tobytes() == want.tobytes(), name


def test_restore_into_a_different_sharding(tmp_path):
    mesh8 = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    mesh24 = jax.make_mesh((2, 4), ("dp", "ep"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    host = {
        "experts.w": rng.integers(0, 256, size=(8, 16, 4), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn),
        "experts.s": rng.integers(100, 140, size=(8, 4, 1), dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu),
        "norm": rng.standard_normal(16).astype(ml_dtypes.bfloat16),
    }
    saved_as = {
        "experts.w": jax.device_put(host["experts.w"], NamedSharding(mesh8, P("x"))),
        "experts.s": jax.device_put(host["experts.s"], NamedSharding(mesh8, P("x"))),
        "norm": jax.device_put(host["norm"], NamedSharding(mesh8, P())),
    }
    save_checkpoint(tmp_path / "c", saved_as, None)

    def layout(name, shape):
        return NamedSharding(mesh24, P("ep", "dp") if len(shape) == 3 else P("ep"))

    out = restore_checkpoint(tmp_path / "c", sharding=layout)
    for name, want in host.items():
        assert out[name].sharding.spec == (P("ep", "dp") if want.ndim == 3 else P("ep"))
        assert out[name].dtype == want.dtype
        assert np.asarray(out[name]).tobytes() == want.tobytes()
    # Each device holds only its slice: 8 experts over ep=4 -> 2 experts, 16 rows over dp=2 -> 8 rows.
    assert out["experts.w"].addressable_shards[0].data.shape == (2, 8, 4)
    single = restore_checkpoint(tmp_path / "c", sharding=NamedSharding(mesh24, P()), names=["model.norm"])
    assert list(single) == ["model.norm"] and single["model.norm"].sharding.spec == P()


def test_subset_and_missing_names(saved):
    folder, _ = saved
    out = restore_checkpoint(folder, names=["embed.weight", "prefixed", "scalar", "empty"])
    assert list(out) == ["embed.weight", "prefixed", "scalar", "empty"]
    assert out["scalar"].shape == () and float(out["scalar"]) == 2.5
    assert out["empty"].shape == (0, 3)
    with pytest.raises(CheckpointError, match=r"not in the checkpoint: \['nope'\]"):
        restore_checkpoint(folder, names=["embed.weight", "nope"])
    with pytest.raises(TypeError, match="single str"):
        restore_checkpoint(folder, names="embed.weight")


def test_load_tensors_reads_orbax_too(saved):
    folder, arrays = saved
    with open_checkpoint(folder) as reader:
        out = load_tensors(
            reader, {"packed_f4": ((2, 4), ("uint8",)), "prefixed": ((2,), "float32")}, unexpected="ignore"
        )
    np.testing.assert_array_equal(np.asarray(out["packed_f4"]), arrays["packed_f4"])


def test_save_refusals(tmp_path, saved):
    folder, _ = saved
    with pytest.raises(ValueError, match="exists and is not empty"):
        save_checkpoint(folder, {"a": np.zeros(1, np.float32)}, None)
    with pytest.raises(
        ValueError, match=r"storage_dtypes\['a'\]: 'BF16' does not match the array dtype float32"
    ):
        save_checkpoint(tmp_path / "x", {"a": np.zeros(1, np.float32)}, None, storage_dtypes={"a": "BF16"})
    with pytest.raises(ValueError, match=r"tensors\['a'\]: F4 is stored as packed uint8"):
        save_checkpoint(tmp_path / "x", {"a": np.zeros(1, np.int8)}, None, storage_dtypes={"a": "F4"})
    with pytest.raises(ValueError, match="storage_dtypes: 'b' is not one of the tensors"):
        save_checkpoint(tmp_path / "x", {"a": np.zeros(1, np.float32)}, None, storage_dtypes={"b": "F4"})
    with pytest.raises(TypeError, match=r"tensors\['a'\]: expected a jax.Array or numpy array, got list"):
        save_checkpoint(tmp_path / "x", {"a": [1.0]}, None)
    with pytest.raises(TypeError, match="no safetensors encoding"):
        save_checkpoint(tmp_path / "x", {"a": np.zeros(1, np.complex128)}, None)
    with pytest.raises(CheckpointError, match="both spellings"):
        save_checkpoint(tmp_path / "x", {"a": np.zeros(1), "model.a": np.zeros(1)}, None)
    assert not (tmp_path / "x").exists()


def test_overwrite_replaces_atomically(tmp_path):
    save_checkpoint(tmp_path / "c", {"a": np.zeros(2, np.float32)}, {"v": 1})
    save_checkpoint(tmp_path / "c", {"b": np.ones(3, np.int8)}, {"v": 2}, overwrite=True)
    with open_checkpoint(tmp_path / "c") as reader:
        assert reader.names() == ["b"]
    assert json.loads((tmp_path / "c" / "config.json").read_text()) == {"v": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_corrupt_manifest(tmp_path):
    save_checkpoint(tmp_path / "c", {"a": np.zeros(2, np.float32)}, None)
    (tmp_path / "c" / "deepinfer_checkpoint.json").write_text('{"format": "other"}')
    with pytest.raises(CheckpointError, match=r"deepinfer_checkpoint\.json: not a"):
        open_checkpoint(tmp_path / "c")
