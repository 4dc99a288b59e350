"""Sweep files (configs/sweeps/) and the frozen containers behind the tree."""

from __future__ import annotations

import json
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.config import FrozenMapping, freeze, load_config, load_sweep, thaw


def test_example_sweep_expands_and_every_point_loads(configs_dir):
    spec = load_sweep(configs_dir / "sweeps" / "tiny_v41_draft_length.yaml")
    points = spec.points()
    assert [p.name for p in points] == [
        f"speculative.num_draft_tokens={n},scheduler.max_num_seqs={s}" for n in (0, 2, 4) for s in (1, 8)
    ]
    for point in points:
        cfg = spec.load_point(point, env={})
        assert cfg.num_draft_tokens == point.overrides["speculative.num_draft_tokens"]
        assert cfg.scheduler.max_num_seqs == point.overrides["scheduler.max_num_seqs"]
        # From cpu_parity.gin and the sweep's fixed overrides.
        assert (cfg.dtype, cfg.max_model_len, cfg.cache.block_size) == ("float32", 512, 64)
        assert cfg.sampling.temperature == 0.0


def test_example_gin_file_applies_to_every_model(configs_dir):
    for name in ("tiny_v3", "tiny_v4", "tiny_v41"):
        cfg = load_config(
            configs_dir / f"{name}.yaml", gin_files=[configs_dir / "sweeps" / "cpu_parity.gin"], env={}
        )
        assert cfg.dtype == "float32" and cfg.scheduler.max_num_batched_tokens == 512


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("model: ../x.yaml\ngird: {}\n", "unknown key 'gird'"),
        ("grid: {cache.block_size: [64]}\n", "give 'model' or 'yaml'"),
        ("model: m.yaml\ngrid: {cache.block_size: []}\n", "non-empty list"),
        ("model: m.yaml\ngrid: {cache.blocksize: [64]}\n", "unknown field 'cache.blocksize'"),
        ("model: m.yaml\noverrides: {foo: 1}\n", "unknown setting 'foo'"),
    ],
)
def test_bad_sweep_files(tmp_path, text, expected):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        load_sweep(path)
    assert expected in str(info.value) and "s.yaml" in str(info.value)


def test_sweep_without_grid_is_one_base_point(tmp_path, configs_dir):
    path = tmp_path / "s.yaml"
    path.write_text(f"model: {configs_dir / 'tiny_v3.yaml'}\n")
    (point,) = load_sweep(path).points()
    assert point.name == "base" and dict(point.overrides) == {}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=60, deadline=None)
@given(json_values)
def test_freeze_thaw_round_trip_and_hashability(value):
    frozen = freeze(value)
    hash(frozen)  # every frozen JSON value is hashable
    assert thaw(frozen) == value
    assert json.loads(json.dumps(thaw(frozen))) == json.loads(json.dumps(value))
    assert pickle.loads(pickle.dumps(frozen)) == frozen


def test_frozen_mapping_is_read_only_and_equal_to_dicts():
    source = {"a": [1, 2], "b": {"c": 3}}
    frozen = freeze(source)
    source["a"].append(9)  # later changes to the original do not reach the frozen copy
    assert frozen == {"a": (1, 2), "b": {"c": 3}}
    assert frozen == FrozenMapping({"b": FrozenMapping({"c": 3}), "a": (1, 2)})
    assert hash(frozen) == hash(FrozenMapping({"b": FrozenMapping({"c": 3}), "a": (1, 2)}))
    with pytest.raises(TypeError):
        frozen["a"] = 1  # type: ignore[index]
    assert list(frozen) == ["a", "b"]  # insertion order is kept (config.json key order)
