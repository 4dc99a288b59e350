"""The safetensors reader: dtypes, lazy reads, name resolution, shards and header validation."""

from __future__ import annotations

import json
from pathlib import Path

import hypothesis.extra.numpy as hnp
import ml_dtypes
import numpy as np
import pytest
from _checkpoint_helpers import CODES, raw_safetensors, sample_arrays, write_arrays, write_sharded
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.checkpoint import CheckpointError, SafetensorsReader, open_checkpoint
from deepinfer_jax.checkpoint.reader import TensorInfo, alternate_spelling, storage_dtype_for


def test_every_dtype_reads_back_bit_exact(tmp_path):
    arrays = sample_arrays()
    write_arrays(tmp_path / "model.safetensors", arrays)
    with open_checkpoint(tmp_path) as reader:
        assert isinstance(reader, SafetensorsReader)
        assert reader.names() == sorted(arrays)
        for name, want in arrays.items():
            info = reader.info(name)
            assert (info.shape, info.dtype, info.file) == (want.shape, want.dtype, "model.safetensors")
            assert info.storage_dtype == CODES[want.dtype]
            got = reader.read(name)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.tobytes() == want.tobytes(), name


def test_agrees_with_the_safetensors_library(tmp_path):
    """An independent reader (the Rust safetensors library) sees the same values in a file written by another
    writer (the built-in models' one)."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    from deepinfer_jax.models.builtin import write_safetensors

    plain = {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"}
    arrays = {k: v for k, v in sample_arrays(1).items() if v.dtype.name in plain}
    write_safetensors(tmp_path / "model.safetensors", arrays)
    theirs = safetensors_numpy.load_file(str(tmp_path / "model.safetensors"))
    with open_checkpoint(tmp_path / "model.safetensors") as reader:
        for name in arrays:
            np.testing.assert_array_equal(reader.read(name), theirs[name])


def test_f4_is_read_as_packed_pairs(tmp_path):
    # Header shape counts 4-bit elements: [2, 4] E2M1 values are 4 bytes, read as uint8 [2, 2].
    data = bytes([0x21, 0x43, 0x65, 0x87])
    raw_safetensors(tmp_path / "model.safetensors", {"w": ("F4", [2, 4], data)})
    with open_checkpoint(tmp_path) as reader:
        info = reader.info("w")
        assert info.shape == (2, 2) and info.dtype == np.uint8 and info.header_shape == (2, 4)
        assert info.dtype_names == ("uint8", "float4_e2m1fn_x2")
        got = reader.read("w")
    np.testing.assert_array_equal(got, [[0x21, 0x43], [0x65, 0x87]])
    # Low nibble first: element 0 of row 0 is code 1 (E2M1 0.5), element 1 is code 2 (1.0).
    low = (got & 0x0F).view(ml_dtypes.float4_e2m1fn)
    high = (got >> 4).view(ml_dtypes.float4_e2m1fn)
    assert float(low[0, 0]) == 0.5 and float(high[0, 0]) == 1.0


def test_info_needs_no_data_and_read_reads_only_its_bytes(tmp_path):
    big = np.arange(1 << 16, dtype=np.float32)
    small = np.arange(4, dtype=np.int32)
    write_arrays(tmp_path / "model.safetensors", {"big": big, "small": small})
    with open_checkpoint(tmp_path) as reader:
        assert reader.info("big").nbytes == big.nbytes
        handle = reader._handle("model.safetensors")
        requested = []
        real_readinto = handle.readinto

        class Spy:
            def seek(self, pos):
                return handle.seek(pos)

            def readinto(self, buf):
                requested.append(len(buf))
                return real_readinto(buf)

            def close(self):
                handle.close()

        reader._handles["model.safetensors"] = Spy()
        np.testing.assert_array_equal(reader.read("small"), small)
    assert requested == [small.nbytes]


def test_prefix_resolution_both_ways(tmp_path):
    write_arrays(
        tmp_path / "model.safetensors",
        {"model.layers.0.w": np.zeros(2, np.float32), "head.weight": np.ones(2, np.float32)},
    )
    with open_checkpoint(tmp_path) as reader:
        assert reader.resolve("layers.0.w") == "model.layers.0.w"
        assert reader.resolve("model.layers.0.w") == "model.layers.0.w"
        assert reader.resolve("model.head.weight") == "head.weight"
        assert "model.head.weight" in reader and "layers.0.w" in reader and "nope" not in reader
        np.testing.assert_array_equal(reader.read("model.head.weight"), [1, 1])
        with pytest.raises(KeyError, match=r"'head\.weigth'.*close: head\.weight"):
            reader.resolve("head.weigth")
    assert alternate_spelling("x") == "model.x" and alternate_spelling("model.x") == "x"


def test_both_spellings_of_one_name_are_an_error(tmp_path):
    write_arrays(
        tmp_path / "model.safetensors",
        {"norm.weight": np.zeros(2, np.float32), "model.norm.weight": np.zeros(2)},
    )
    with pytest.raises(CheckpointError, match=r"'norm\.weight' and 'model\.norm\.weight'"):
        open_checkpoint(tmp_path)


def _three_shards(folder: Path, *, index: bool = True) -> dict[str, np.ndarray]:
    arrays = sample_arrays(2)
    names = sorted(arrays)
    shards = {
        f"model-0000{i + 1}-of-00003.safetensors": {n: arrays[n] for n in names[i::3]} for i in range(3)
    }
    write_sharded(folder, shards, index=index)
    return arrays


@pytest.mark.parametrize("index", [True, False], ids=["index", "no-index"])
def test_sharded_checkpoint(tmp_path, index):
    arrays = _three_shards(tmp_path, index=index)
    (tmp_path / "config.json").write_text("{}")
    with open_checkpoint(tmp_path) as reader:
        assert reader.names() == sorted(arrays)
        assert len({reader.info(n).file for n in reader.names()}) == 3
        assert reader.config_path == tmp_path / "config.json"
        for name, want in arrays.items():
            assert reader.read(name).tobytes() == want.tobytes()


def test_index_naming_a_missing_shard(tmp_path):
    _three_shards(tmp_path)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match=r"index\.json: shard 'model-00002-of-00003\.safetensors' \(of tensor"
    ):
        open_checkpoint(tmp_path)


def test_index_that_disagrees_with_its_shards(tmp_path):
    _three_shards(tmp_path)
    doc = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    moved = sorted(doc["weight_map"])[0]
    doc["weight_map"][moved] = "model-00003-of-00003.safetensors"
    dropped = sorted(doc["weight_map"])[1]
    del doc["weight_map"][dropped]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(tmp_path)
    problems = err.value.problems
    assert any(moved in p and "does not hold it" in p for p in problems)
    assert any(dropped in p and "not listed" in p for p in problems)


def test_index_pointing_outside_the_folder(tmp_path):
    write_arrays(tmp_path / "outside.safetensors", {"w": np.zeros(1, np.float32)})
    (tmp_path / "ckpt").mkdir()
    doc = {"weight_map": {"w": "../outside.safetensors"}}
    (tmp_path / "ckpt" / "model.safetensors.index.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        open_checkpoint(tmp_path / "ckpt")


def test_unindexed_files_holding_the_same_tensor_are_ambiguous(tmp_path):
    write_arrays(tmp_path / "a.safetensors", {"w": np.zeros(1, np.float32)})
    write_arrays(tmp_path / "b.safetensors", {"w": np.ones(1, np.float32)})
    with pytest.raises(CheckpointError, match=r"'w' is stored in both a\.safetensors and b\.safetensors"):
        open_checkpoint(tmp_path)


def test_model_safetensors_is_read_alone_without_an_index(tmp_path, caplog):
    """As transformers: with ``model.safetensors`` and no index, other ``*.safetensors`` files beside it are not
    part of the checkpoint (a leftover ``consolidated.safetensors``, an adapter); the reader says which it
    ignored, and their tensors are not found."""
    write_arrays(tmp_path / "model.safetensors", {"w": np.ones(3, np.float32)})
    write_arrays(
        tmp_path / "adapter.safetensors", {"w": np.zeros(3, np.float32), "extra": np.ones(2, np.int8)}
    )
    with caplog.at_level("WARNING"), open_checkpoint(tmp_path) as reader:
        assert reader.names() == ["w"] and reader.info("w").file == "model.safetensors"
        np.testing.assert_array_equal(reader.read("w"), np.ones(3, np.float32))
    assert "ignoring adapter.safetensors" in caplog.text
    (tmp_path / "model.safetensors").unlink()
    with open_checkpoint(tmp_path) as reader:  # without model.safetensors the other file is the checkpoint
        assert reader.names() == ["extra", "w"]


def test_empty_folder_and_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        open_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_checkpoint(tmp_path / "nope")
    with pytest.raises(TypeError, match="path: expected"):
        open_checkpoint(3)


F32 = np.arange(4, dtype=np.float32).tobytes()


@pytest.mark.parametrize(
    ("entries", "kwargs", "message"),
    [
        ({"w": ("F32", [4], F32)}, {"header_len": 1 << 40}, "header length"),
        ({"w": ("F33", [4], F32)}, {}, r"tensor 'w': dtype 'F33' is not supported"),
        (
            {"w": ("F32", [4], F32)},
            {"offsets": {"w": [0, 64]}},
            r"tensor 'w': data_offsets \[0, 64\] out of range",
        ),
        (
            {"w": ("F32", [5], F32)},
            {},
            r"tensor 'w': data_offsets \[0, 16\] span 16 bytes, but shape \[5\] x F32",
        ),
        ({"w": ("F32", [-4], F32)}, {}, r"tensor 'w': shape must be a list of non-negative ints"),
        ({"w": ("F32", [4], F32)}, {"offsets": {"w": [0]}}, r"tensor 'w': data_offsets must be"),
        ({"w": ("F4", [3, 3], b"\x00" * 4)}, {}, r"tensor 'w': F4 packs two elements per byte"),
        (
            {"a": ("F32", [2], F32[:8]), "b": ("F32", [2], F32[8:])},
            {"offsets": {"b": [4, 12]}},
            r"tensors 'a' and 'b' overlap",
        ),
        ({"w": ("F32", [4], F32)}, {"header_extra": {"v": 3}}, r"tensor 'v': header entry must be an object"),
    ],
    ids=[
        "header-length",
        "dtype",
        "offsets-range",
        "size",
        "shape",
        "offsets-form",
        "f4-odd",
        "overlap",
        "entry",
    ],
)
def test_header_validation_names_file_and_tensor(tmp_path, entries, kwargs, message):
    raw_safetensors(tmp_path / "model.safetensors", entries, **kwargs)
    with pytest.raises(CheckpointError, match=message) as err:
        open_checkpoint(tmp_path)
    assert "model.safetensors" in str(err.value)


def test_header_that_is_not_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes((8).to_bytes(8, "little") + b"not json")
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: the safetensors header is not valid JSON"
    ):
        open_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="too short"):
        open_checkpoint(tmp_path)


def test_closed_reader_refuses_reads(tmp_path):
    write_arrays(tmp_path / "model.safetensors", {"w": np.zeros(1, np.float32)})
    reader = open_checkpoint(tmp_path)
    reader.close()
    with pytest.raises(ValueError, match="closed"):
        reader.read("w")


def test_memmap_matches_read(tmp_path):
    arrays = sample_arrays(3)
    write_arrays(tmp_path / "model.safetensors", arrays)
    with open_checkpoint(tmp_path) as reader:
        for name in arrays:
            mapped = reader.memmap(name)
            assert mapped.shape == arrays[name].shape and mapped.dtype == arrays[name].dtype
            assert np.asarray(mapped).tobytes() == reader.read(name).tobytes()


def test_storage_dtype_codes():
    assert storage_dtype_for(ml_dtypes.float8_e8m0fnu) == "F8_E8M0"
    assert storage_dtype_for(">f4") == "F32"
    with pytest.raises(TypeError, match="no safetensors encoding"):
        storage_dtype_for(np.complex128)
    assert TensorInfo("x", (2,), np.dtype(np.uint8), "f", "F4").header_shape == (4,)


_DTYPES = [np.dtype(d) for d in CODES]


@settings(max_examples=25, deadline=None)
@given(
    st.dictionaries(
        st.from_regex(r"(model\.)?[a-z]{1,3}(\.[0-9])?", fullmatch=True),
        st.sampled_from(_DTYPES).flatmap(
            lambda dt: hnp.arrays(
                np.uint8, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3)
            ).map(
                lambda a: np.frombuffer(np.repeat(a.reshape(-1), dt.itemsize).tobytes(), dt).reshape(a.shape)
            )
        ),
        max_size=5,
    )
)
def test_property_round_trip(tmp_path_factory, arrays):
    stripped = {n.removeprefix("model.") for n in arrays}
    folder = tmp_path_factory.mktemp("prop")
    write_arrays(folder / "x.safetensors", arrays)
    if len(stripped) < len(arrays):  # both spellings present
        with pytest.raises(CheckpointError, match="both spellings"):
            open_checkpoint(folder)
        return
    if not arrays:
        return
    with open_checkpoint(folder) as reader:
        for name, want in arrays.items():
            got = reader.read(alternate_spelling(name))
            assert got.shape == want.shape and got.dtype == want.dtype
            assert got.tobytes() == want.tobytes()
