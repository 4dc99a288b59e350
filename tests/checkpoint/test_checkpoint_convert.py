"""`deepinfer-jax convert`: HF -> orbax -> HF is byte-identical per tensor; sharding, refusals, atomicity."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _checkpoint_helpers import sample_arrays, write_sharded

from deepinfer_jax.checkpoint import open_checkpoint
from deepinfer_jax.checkpoint.reader import SafetensorsReader
from deepinfer_jax.cli import main as cli


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = cli.main(["deepinfer-jax", "convert", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


def _raw_header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def assert_same_tensors(a: Path, b: Path) -> None:
    """Same names, header dtype codes and shapes, and bytes, tensor by tensor."""
    with open_checkpoint(a) as ra, open_checkpoint(b) as rb:
        assert ra.names() == rb.names()
        for name in ra.names():
            ia, ib = ra.info(name), rb.info(name)
            assert (ia.storage_dtype, ia.header_shape) == (ib.storage_dtype, ib.header_shape), name
            assert ra.read(name).tobytes() == rb.read(name).tobytes(), name


def test_round_trip_of_tiny_v41(tiny_v41, tmp_path, capsys):
    rc, out, err = run_cli(capsys, "--src", tiny_v41, "--dst", tmp_path / "orbax", "--to", "orbax")
    assert rc == 0, err
    assert "converted 701 tensors" in out
    rc, _, err = run_cli(capsys, "--src", tmp_path / "orbax", "--dst", tmp_path / "hf", "--to", "hf")
    assert rc == 0, err
    hf = tmp_path / "hf"
    assert sorted(p.name for p in hf.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    codes = {v["dtype"] for v in _raw_header(hf / "model.safetensors").values()}
    assert codes == {"BF16", "F32", "F8_E4M3", "F8_E8M0", "U8"}
    assert_same_tensors(tiny_v41, hf)
    # The raw header entries (dtype code, shape, data size) agree with the original file's too.
    src_header, dst_header = (
        _raw_header(tiny_v41 / "model.safetensors"),
        _raw_header(hf / "model.safetensors"),
    )
    for name, entry in src_header.items():
        got = dst_header[name]
        assert (got["dtype"], got["shape"]) == (entry["dtype"], entry["shape"])
        assert np.diff(got["data_offsets"]) == np.diff(entry["data_offsets"])
    assert json.loads((hf / "config.json").read_text()) == json.loads((tiny_v41 / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (hf / name).read_bytes() == (tiny_v41 / name).read_bytes()


@pytest.fixture
def sharded_src(tmp_path) -> Path:
    arrays = sample_arrays(11)
    names = sorted(arrays)
    shards = {
        f"model-0000{i + 1}-of-00002.safetensors": {n: arrays[n] for n in names[i::2]} for i in range(2)
    }
    src = tmp_path / "src"
    write_sharded(src, shards)
    (src / "config.json").write_text('{"model_type": "deepseek_v3"}')
    return src


def test_sharded_round_trip_with_reshard(sharded_src, tmp_path, capsys):
    rc, _, err = run_cli(capsys, "--src", sharded_src, "--dst", tmp_path / "o", "--to", "orbax")
    assert rc == 0, err
    rc, _, err = run_cli(
        capsys, "--src", tmp_path / "o", "--dst", tmp_path / "hf", "--to", "hf", "--max_shard_bytes", 64
    )
    assert rc == 0, err
    hf = tmp_path / "hf"
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0].startswith("model-00001-of-")
    with open_checkpoint(hf) as reader:
        assert index["metadata"]["total_size"] == sum(reader.info(n).nbytes for n in reader.names())
        for rel in shards:  # each shard is at most 64 bytes of tensors, or one bigger tensor alone
            sizes = [reader.info(n).nbytes for n, f in index["weight_map"].items() if f == rel]
            assert sum(sizes) <= 64 or len(sizes) == 1
    assert_same_tensors(sharded_src, hf)
    # HF -> HF re-shards directly too.
    rc, _, err = run_cli(capsys, "--src", hf, "--dst", tmp_path / "one", "--to", "hf")
    assert rc == 0, err
    assert (tmp_path / "one" / "model.safetensors").is_file()
    assert not (tmp_path / "one" / "model.safetensors.index.json").exists()
    assert_same_tensors(sharded_src, tmp_path / "one")


def test_f4_survives_the_round_trip(tmp_path, capsys):
    from _checkpoint_helpers import raw_safetensors

    src = tmp_path / "src"
    src.mkdir()
    raw_safetensors(
        src / "model.safetensors", {"w": ("F4", [2, 4], bytes([1, 2, 3, 4])), "s": ("U8", [1], b"\x07")}
    )
    assert run_cli(capsys, "--src", src, "--dst", tmp_path / "o", "--to", "orbax")[0] == 0
    assert run_cli(capsys, "--src", tmp_path / "o", "--dst", tmp_path / "hf", "--to", "hf")[0] == 0
    assert _raw_header(tmp_path / "hf" / "model.safetensors")["w"]["dtype"] == "F4"
    assert_same_tensors(src, tmp_path / "hf")


def test_refuses_a_non_empty_destination_unless_overwrite(sharded_src, tmp_path, capsys):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    rc, _, err = run_cli(capsys, "--src", sharded_src, "--dst", dst, "--to", "hf")
    assert rc == 1
    assert f"destination {dst} exists and is not empty" in err
    assert "pass --overwrite to replace it" in err  # the flag's spelling, not the library argument's
    assert (dst / "keep.txt").exists()
    rc, _, err = run_cli(capsys, "--src", sharded_src, "--dst", dst, "--to", "hf", "--overwrite")
    assert rc == 0, err
    assert not (dst / "keep.txt").exists()
    assert_same_tensors(sharded_src, dst)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli(capsys, "--src", sharded_src, "--dst", empty, "--to", "orbax")[0] == 0


def test_src_takes_a_built_in_model_name(tmp_path, capsys):
    """--src tiny-v3 converts the built-in model's materialized HF folder."""
    from deepinfer_jax.models import builtin

    rc, out, err = run_cli(capsys, "--src", "tiny-v3", "--dst", tmp_path / "orbax", "--to", "orbax")
    assert rc == 0, err
    assert "converted" in out and "from tiny-v3" in out
    assert_same_tensors(builtin.materialize("tiny-v3"), tmp_path / "orbax")
    rc, _, err = run_cli(capsys, "--src", "tiny-v9", "--dst", tmp_path / "x", "--to", "orbax")
    assert rc == 1 and "tiny-v9" in err


def test_flag_errors(sharded_src, tmp_path, capsys):
    rc, _, err = run_cli(capsys, "--src", sharded_src, "--dst", tmp_path / "d")
    assert rc == 2 and "--to" in err
    rc, _, err = run_cli(capsys, "--src", sharded_src, "--dst", tmp_path / "d", "--to", "gguf")
    assert rc == 2 and "gguf" in err
    rc, _, err = run_cli(capsys, "--src", tmp_path / "nope", "--dst", tmp_path / "d", "--to", "hf")
    assert rc == 1 and "does not exist" in err
    rc, _, err = run_cli(capsys, "--src", sharded_src, "--dst", sharded_src, "--to", "hf", "--overwrite")
    assert rc == 1 and "is the source folder" in err
    rc, _, _ = run_cli(
        capsys, "--src", sharded_src, "--dst", tmp_path / "d", "--to", "hf", "--max_shard_bytes", 0
    )
    assert rc == 2


def test_a_failure_midway_leaves_nothing_behind(sharded_src, tmp_path, capsys, monkeypatch):
    calls = []

    def failing_read_many(self, names):
        for name in names:
            calls.append(name)
            if len(calls) == 3:
                raise OSError("disk went away")
            yield name, self.read(name)

    monkeypatch.setattr(SafetensorsReader, "read_many", failing_read_many)
    rc, _, err = run_cli(capsys, "--src", sharded_src, "--dst", tmp_path / "d", "--to", "hf")
    assert rc == 1 and "disk went away" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_writer_refuses_a_source_that_disagrees_with_its_description(tmp_path):
    from deepinfer_jax.checkpoint import CheckpointError, save_hf_checkpoint
    from deepinfer_jax.checkpoint.reader import TensorInfo

    infos = [
        TensorInfo("a", (2,), np.dtype(np.float32), "", "F32", nbytes=8),
        TensorInfo("b", (1,), np.dtype(np.int8), "", "I8", nbytes=1),
    ]

    def wrong_dtype(names):
        yield "a", np.zeros(2, np.float16)

    def too_few(names):
        yield "a", np.zeros(2, np.float32)

    def wrong_order(names):
        yield "b", np.zeros(1, np.int8)

    for fetch, message in [
        (wrong_dtype, r"tensor 'a': source gave float16\[2\], its description says float32\[2\]"),
        (too_few, "the source gave 1 of 2 tensors"),
        (wrong_order, "the source gave tensor 'b' where 'a' belongs"),
    ]:
        with pytest.raises(CheckpointError, match=message):
            save_hf_checkpoint(tmp_path / "out", infos, fetch, None)
        assert sorted(p.name for p in tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="max_shard_bytes: expected a positive int or None, got 0"):
        save_hf_checkpoint(tmp_path / "out", infos, too_few, None, max_shard_bytes=0)
    with pytest.raises(ValueError, match="storage_dtype 'Q8' is not a safetensors dtype"):
        save_hf_checkpoint(
            tmp_path / "out", [TensorInfo("a", (1,), np.dtype(np.uint8), "", "Q8")], too_few, None
        )
