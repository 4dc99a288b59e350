"""load_tensors: expectations, the all-problems report, shardings, conversions, and the host-memory bound."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from _checkpoint_helpers import sample_arrays, write_arrays, write_sharded
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from deepinfer_jax.checkpoint import (
    CheckpointError,
    ExpectedTensor,
    check_tensors,
    load_tensors,
    open_checkpoint,
    read_config,
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("loader")
    arrays = sample_arrays(5)
    arrays["layers.0.attn.wq_a.weight"] = np.linspace(-2, 2, 32).astype(ml_dtypes.float8_e4m3fn).reshape(8, 4)
    arrays["layers.0.attn.wq_a.scale"] = np.array([[2.0]], dtype=ml_dtypes.float8_e8m0fnu)
    arrays["model.vision.patch"] = np.zeros(3, np.float32)
    write_arrays(folder / "model.safetensors", arrays)
    (folder / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "vocab_size": 6}))
    return folder


def _spec_of(reader):
    return {n: (reader.info(n).shape, reader.info(n).dtype_names) for n in reader.names()}


def test_loads_every_tensor_with_its_dtype(ckpt):
    with open_checkpoint(ckpt) as reader:
        out = load_tensors(reader, _spec_of(reader))
        assert sorted(out) == reader.names()
        for name, array in out.items():
            want = reader.read(name)
            if want.dtype.itemsize == 8 and not jax.config.read("jax_enable_x64"):
                assert array.dtype.itemsize == 4 and array.dtype.kind == want.dtype.kind  # narrowed, exact
                np.testing.assert_array_equal(np.asarray(array), want)
            else:
                assert array.dtype == want.dtype, name
                assert np.asarray(array).tobytes() == want.tobytes(), name


def test_names_resolve_with_either_prefix_and_results_use_the_given_name(ckpt):
    with open_checkpoint(ckpt) as reader:
        out = load_tensors(
            reader,
            {"model.embed.weight": ((6, 4), "bfloat16"), "vision.patch": ((3,), ("float32",))},
            unexpected="ignore",
        )
    assert sorted(out) == ["model.embed.weight", "vision.patch"]


def test_every_problem_is_reported_at_once(ckpt):
    with open_checkpoint(ckpt) as reader:
        expected = _spec_of(reader)
        expected["layers.0.hc_attn_fn"] = ((5, 3), ("float32",))  # wrong shape
        expected["f16"] = ((2, 3), ("bfloat16", "float32"))  # wrong dtype
        expected["layers.1.attn.wq_a.weight"] = ((8, 4), ("float8_e4m3fn",))  # missing
        expected["layers.1.optional"] = ExpectedTensor((1,), ("float32",), optional=True)  # missing, optional
        del expected["mask"]  # unexpected
        with pytest.raises(CheckpointError) as err:
            load_tensors(reader, expected)
    problems = err.value.problems
    assert len(problems) == 4, problems
    message = str(err.value)
    assert "4 problem(s)" in message
    assert "shape: 'layers.0.hc_attn_fn': expected (5, 3), found (3, 5) (in model.safetensors)" in message
    assert "dtype: 'f16': expected bfloat16|float32, found float16" in message
    assert "missing: 'layers.1.attn.wq_a.weight' (expected shape (8, 4), dtype float8_e4m3fn)" in message
    assert "unexpected: 'mask' ((3, 3) bool in model.safetensors)" in message
    assert isinstance(err.value, ValueError)


def test_non_finite_values_are_counted_with_the_other_problems(tmp_path):
    bad = np.array([1.0, np.nan, np.inf, -np.inf, 2.0], dtype=np.float32)
    scale = np.array([1.0, 2.0], dtype=ml_dtypes.float8_e8m0fnu)
    scale_bits = scale.view(np.uint8).copy()
    scale_bits[1] = 0xFF  # the E8M0 NaN code
    write_arrays(
        tmp_path / "model.safetensors",
        {"a": bad, "b": np.ones(2, ml_dtypes.bfloat16), "s": scale_bits.view(ml_dtypes.float8_e8m0fnu)},
    )
    with open_checkpoint(tmp_path) as reader:
        spec = {"a": ((5,), "float32"), "b": ((3,), "bfloat16"), "s": ((2,), "float8_e8m0fnu")}
        with pytest.raises(CheckpointError) as err:
            load_tensors(reader, spec, validate_finite=True)
        assert sorted(err.value.problems) == [
            "non-finite: 'a': 3 of 5 values are NaN or infinite (in model.safetensors)",
            "non-finite: 's': 1 of 2 values are NaN or infinite (in model.safetensors)",
            "shape: 'b': expected (3,), found (2,) (in model.safetensors)",
        ]
        # Without the check the same values load (the check is opt-in, it reads every byte).
        spec["b"] = ((2,), "bfloat16")
        out = load_tensors(reader, spec)
    assert np.isnan(np.asarray(out["a"])[1])


def test_unexpected_modes_and_ignore_patterns(ckpt, caplog):
    with open_checkpoint(ckpt) as reader:
        spec = {"embed.weight": ((6, 4), "bfloat16")}
        with pytest.raises(CheckpointError, match="unexpected: 'mask'"):
            load_tensors(reader, spec, ignore=("vision.*",))
        with caplog.at_level(logging.WARNING, logger="deepinfer_jax.checkpoint.loader"):
            out = load_tensors(reader, spec, unexpected="log", ignore=("vision.*",))
        assert list(out) == ["embed.weight"]
        assert "unexpected tensor(s) not loaded" in caplog.text and "mask" in caplog.text
        assert "vision" not in caplog.text  # ignored names are skipped silently
        everything_else = set(reader.names()) - {"embed.weight"}
        assert load_tensors(reader, spec, ignore=lambda n: n in everything_else).keys() == {"embed.weight"}
        with pytest.raises(ValueError, match="unexpected: 'loud' must be one of"):
            load_tensors(reader, spec, unexpected="loud")


def test_view_as_and_transform(ckpt):
    with open_checkpoint(ckpt) as reader:
        codes = reader.read("layers.0.attn.wq_a.weight").view(np.uint8)
        spec = {
            "layers.0.attn.wq_a.weight": ExpectedTensor((8, 4), ("float8_e4m3fn",), view_as="uint8"),
            "layers.0.attn.wq_a.scale": ((1, 1), ("float8_e8m0fnu",)),
        }
        seen = []

        def transform(name, array):
            seen.append((name, array.dtype.name))
            if name.endswith(".scale"):  # UE8M0 restored losslessly to float32 (2^(b-127))
                return array.astype(np.float32)
            return array

        out = load_tensors(reader, spec, unexpected="ignore", transform=transform)
    assert out["layers.0.attn.wq_a.weight"].dtype == np.uint8
    np.testing.assert_array_equal(np.asarray(out["layers.0.attn.wq_a.weight"]), codes)
    assert float(out["layers.0.attn.wq_a.scale"][0, 0]) == 2.0
    assert seen == [("layers.0.attn.wq_a.weight", "uint8"), ("layers.0.attn.wq_a.scale", "float8_e8m0fnu")]


def test_shardings_fixed_and_per_tensor(ckpt):
    mesh = jax.make_mesh((2, 4), ("dp", "ep"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rows = NamedSharding(mesh, P("dp", None))
    with open_checkpoint(ckpt) as reader:
        spec = {"embed.weight": ((6, 4), "bfloat16"), "layers.0.attn.wq_a.weight": ((8, 4), "float8_e4m3fn")}
        out = load_tensors(reader, spec, sharding=rows, unexpected="ignore")
        assert all(a.sharding == rows for a in out.values())
        calls = []

        def per_tensor(name, shape):
            calls.append((name, shape))
            return NamedSharding(mesh, P("ep", None) if shape[0] % 4 == 0 else P())

        out = load_tensors(reader, spec, sharding=per_tensor, unexpected="ignore")
        want = reader.read("layers.0.attn.wq_a.weight")
    assert sorted(calls) == [("embed.weight", (6, 4)), ("layers.0.attn.wq_a.weight", (8, 4))]
    assert out["layers.0.attn.wq_a.weight"].sharding.spec == P("ep", None)
    assert len(out["layers.0.attn.wq_a.weight"].addressable_shards) == 8
    assert np.asarray(out["layers.0.attn.wq_a.weight"]).tobytes() == want.tobytes()
    assert out["embed.weight"].sharding.spec == P()


@pytest.mark.skipif(jax.config.read("jax_enable_x64"), reason="64-bit values load unchanged with x64")
def test_int64_that_does_not_fit_int32_is_a_problem(tmp_path):
    write_arrays(
        tmp_path / "model.safetensors", {"ok": np.array([1, 2], np.int64), "big": np.array([1 << 40])}
    )
    with open_checkpoint(tmp_path) as reader:
        assert load_tensors(reader, {"ok": ((2,), "int64")}, unexpected="ignore")["ok"].dtype == np.int32
        with pytest.raises(CheckpointError, match="tensor 'big': int64 values do not fit int32 exactly"):
            load_tensors(reader, {"big": ((1,), "int64"), "ok": ((2,), "int64")})


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        (((2,), ()), ValueError, "dtypes: expected at least one"),
        (((2,), ("float99",)), ValueError, "'float99' is not a NumPy or ml_dtypes dtype name"),
        (((-1,), "float32"), ValueError, r"shape: \(-1,\): every dim"),
        ((3, "float32"), TypeError, "shape: expected a sequence of ints"),
        (((2,),), TypeError, r"expected\['w'\]: expected an ExpectedTensor"),
        ("nope", TypeError, r"expected\['w'\]"),
    ],
)
def test_malformed_expectations(ckpt, spec, error, message):
    with open_checkpoint(ckpt) as reader, pytest.raises(error, match=message):
        load_tensors(reader, {"w": spec})


def test_view_as_needs_equal_item_sizes_and_arguments_are_checked(ckpt):
    with pytest.raises(ValueError, match="view_as: 'uint16' has 2-byte items"):
        ExpectedTensor((2,), ("float8_e4m3fn",), view_as="uint16")
    with open_checkpoint(ckpt) as reader:
        with pytest.raises(TypeError, match="sharding: expected None"):
            load_tensors(reader, {}, sharding="dp")
        with pytest.raises(ValueError, match=r"'embed\.weight' and 'model\.embed\.weight' name the same"):
            load_tensors(
                reader, {"embed.weight": ((6, 4), "bfloat16"), "model.embed.weight": ((6, 4), "bfloat16")}
            )
        with pytest.raises(TypeError, match="reader: expected a CheckpointReader"):
            check_tensors(str(ckpt), {})


def test_wildcard_dims_and_dry_run(ckpt):
    with open_checkpoint(ckpt) as reader:
        found, problems = check_tensors(
            reader, {"embed.weight": ((None, 4), "bfloat16")}, unexpected="ignore"
        )
    assert problems == [] and found["embed.weight"][1].shape == (6, 4)


def test_read_config(ckpt, tmp_path):
    assert read_config(ckpt)["model_type"] == "deepseek_v4"
    assert read_config(ckpt / "config.json")["vocab_size"] == 6
    with open_checkpoint(ckpt) as reader:
        assert read_config(reader)["vocab_size"] == 6
    with pytest.raises(FileNotFoundError, match="no such config file"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        read_config(tmp_path)


@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc peak-RSS reset"
)
def test_host_memory_peaks_at_about_one_tensor_beyond_the_loaded_ones(tmp_path):
    """4 shards x 6 tensors of S = 4 MiB: the load may hold the loaded bytes plus about one tensor in flight.

    Reading a whole 24 MiB shard at once would overshoot the bound by more than the slack. The 8 MiB slack
    covers allocator rounding and JAX's bookkeeping (measured at about 4 MiB over the loaded bytes).
    """
    size = 1 << 20  # float32 elements: S = 4 MiB
    shards = {
        f"model-0000{i + 1}-of-00004.safetensors": {
            f"layers.{i}.w{j}": np.full(size, i * 6 + j, np.float32) for j in range(6)
        }
        for i in range(4)
    }
    write_sharded(tmp_path, shards)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    probe = Path(__file__).with_name("_memory_probe.py")
    run = subprocess.run(
        [sys.executable, str(probe), str(tmp_path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    tensor = size * 4
    assert figures["loaded"] == 24 * tensor
    assert figures["peak"] - figures["base"] <= figures["loaded"] + 2 * tensor + (8 << 20), figures
    assert figures["peak"] - figures["final"] <= 2 * tensor + (8 << 20), figures
