"""Loading bench sweeps: grids over engine names and workload fields, validation before anything runs."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from deepinfer_jax import config as config_lib
from deepinfer_jax.bench import Workload
from deepinfer_jax.bench.sweep import load_bench_sweep

SHIPPED = Path(__file__).parents[2] / "deepinfer_jax" / "bench" / "sweeps" / "tiny_v3_batching.yaml"


def _write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_yaml_sweep_points_and_mapping(tmp_path):
    (tmp_path / "base.gin").write_text("scheduler.max_num_batched_tokens = 128\ncache.block_size = 16\n")
    path = _write(
        tmp_path,
        """
        name: demo
        model: tiny-v3
        gin_files: [base.gin]
        overrides: {sampling.temperature: 0.5}
        bench: {num_requests: 4, output_len: 8}
        grid:
          scheduler.max_num_seqs: [1, 4]
          bench.prompt_len: [16, 32, 48]
        """,
    )
    sweep = load_bench_sweep(path, base=Workload(), explicit={"repeats": 1})
    assert sweep.name == "demo" and len(sweep.points) == 6
    first, last = sweep.points[0], sweep.points[-1]
    assert first.name == "scheduler.max_num_seqs=1,bench.prompt_len=16"  # the first axis varies slowest
    assert sweep.points[1].values == {"scheduler.max_num_seqs": 1, "bench.prompt_len": 32}
    w = last.workload
    assert (w.model, w.max_num_seqs, str(w.prompt_len), w.num_requests, w.repeats) == (
        "tiny-v3",
        4,
        "48",
        4,
        1,
    )
    assert str(w.output_len) == "8" and w.temperature == 0.5  # the bench section; sampling.* -> workload
    assert w.max_num_batched_tokens == 128  # gin setting that is an LLM argument
    assert w.engine_overrides == {"cache.block_size": 16}  # the rest stays an engine override


def test_shipped_sweep_loads():
    sweep = load_bench_sweep(SHIPPED, base=Workload())
    assert len(sweep.points) == 6
    assert {p.workload.max_num_seqs for p in sweep.points} == {1, 4, 16}
    assert all(p.workload.dtype == "float32" for p in sweep.points)


def test_gin_sweep_with_extra_grid(tmp_path):
    gin = tmp_path / "p.gin"
    gin.write_text('engine.dtype = "float32"\nscheduler.max_num_seqs = 2\n')
    sweep = load_bench_sweep(gin, base=Workload(), model="tiny-v3", extra_grid={"bench.output_len": [2, 3]})
    assert [str(p.workload.output_len) for p in sweep.points] == ["2", "3"]
    assert all(p.workload.max_num_seqs == 2 and p.workload.dtype == "float32" for p in sweep.points)
    with pytest.raises(ValueError, match="a gin sweep needs --model"):
        load_bench_sweep(gin, base=Workload())


@pytest.mark.parametrize(
    ("text", "error", "match"),
    [
        (
            "model: tiny-v3\nbench: {prompt_length: 3}\n",
            ValueError,
            "'prompt_length' is not a workload field",
        ),
        ("model: tiny-v3\ngrid: {bench.nope: [1]}\n", ValueError, "'nope' is not a workload field"),
        ("model: tiny-v3\ngrid: {scheduler.max_num_seqs: []}\n", ValueError, "non-empty list"),
        ("model: tiny-v3\ngrid: {scheduler.no_such: [1]}\n", config_lib.ConfigValueError, "no_such"),
        ("model: tiny-v3\ngrid: {scheduler.max_num_seqs: [0]}\n", ValueError, "max_num_seqs"),
        ("model: nowhere\n", ValueError, "'.*nowhere' is neither a built-in model"),
        ("grid: {}\n", ValueError, "give 'model'"),
    ],
)
def test_bad_sweeps_fail_before_running(tmp_path, text, error, match):
    path = _write(tmp_path, text)
    with pytest.raises(error, match=match) as info:
        load_bench_sweep(path, base=Workload())
    if error is config_lib.ConfigValueError:
        assert str(path) in str(info.value)  # the user's file is named, not a temporary copy


def test_wrong_file_kind(tmp_path):
    with pytest.raises(ValueError, match=r"must be a \.yaml, \.yml or \.gin file"):
        load_bench_sweep(_write(tmp_path, "x", "s.txt"), base=Workload())
    with pytest.raises(ValueError, match="does not exist"):
        load_bench_sweep(tmp_path / "missing.yaml", base=Workload())


def test_request_rate_and_mesh_axes(tmp_path):
    path = _write(
        tmp_path,
        """
        model: tiny-v3
        bench: {num_requests: 4, burstiness: 0.5}
        grid:
          parallel.data_parallel_size: [1, 2]
          bench.request_rate: [10, .inf]
        """,
    )
    sweep = load_bench_sweep(path, base=Workload(), explicit={"expert_parallel_size": 2})
    got = [(p.workload.data_parallel_size, p.workload.request_rate) for p in sweep.points]
    assert got == [(1, 10.0), (1, None), (2, 10.0), (2, None)]  # .inf: all requests at once
    # The mesh sizes are LLM arguments (workload fields), never engine overrides.
    assert all(p.workload.engine_overrides == {} for p in sweep.points)
    assert all(p.workload.burstiness == 0.5 and p.workload.expert_parallel_size == 2 for p in sweep.points)
    bad = _write(tmp_path, "model: tiny-v3\ngrid: {bench.request_rate: [-1]}\n", "bad.yaml")
    with pytest.raises(ValueError, match=r"bad\.yaml, point .*: Workload\.request_rate: must be > 0"):
        load_bench_sweep(bad, base=Workload())
