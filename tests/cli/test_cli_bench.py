"""`deepinfer-jax bench` and `deepinfer-jax sweep` end to end on tiny-v3 with a very small workload."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from deepinfer_jax.cli import main as cli

FAKE_BASELINE = Path(__file__).parents[1] / "bench" / "fake_baseline.py"
# The engine shape of tests/engine/test_engine_llm_cli.py, so the compiled steps come from the shared cache.
KV_CACHE_MEMORY = 24 * 4 * 16 * 96 * 4 + 17 * 4 * 513
ENGINE = [
    "--model=tiny-v3",
    "--dtype=float32",
    "--max_num_seqs=16",
    "--max_num_batched_tokens=64",
    f"--kv_cache_memory={KV_CACHE_MEMORY}",
    "--set=cache.block_size=16",
]
SMALL = ["--num_requests=2", "--prompt_len=4:6", "--output_len=3", "--warmup=1", "--repeats=1"]


def test_subcommands_are_registered():
    assert {"bench", "sweep"} <= set(cli.subcommands())


def test_bench_with_stand_in_baseline_writes_json_table_and_plots(tmp_path, capsys):
    out_json = tmp_path / "r" / "bench.json"
    rc = cli.main(
        [
            "deepinfer-jax",
            "bench",
            *ENGINE,
            *SMALL,
            f"--baseline_python={sys.executable}",
            f"--baseline_script={FAKE_BASELINE}",
            "--baseline_threads=2",
            f"--output={out_json}",
            f"--plot_dir={tmp_path / 'plots'}",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    for needle in (
        "output tokens/s",
        "TTFT ms",
        "tokens/s per sequence",
        "ratio engine/baseline",
        "(2 threads)",
    ):
        assert needle in out
    report = json.loads(out_json.read_text())
    assert report["workload"]["num_requests"] == 2 and report["baseline"]["info"]["name"] == "fake"
    assert report["engine"]["runs"][0]["metrics"]["output_tokens"] == 6
    assert report["ratio"]["per_pair"][0] > 0
    for name in ("throughput_vs_per_user.png", "prefill_vs_latency.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 0


def _refuse_every_model(monkeypatch):
    """Stage an unsupported model (every built-in family is served): the engine raises NotImplementedError."""

    def refuse(*args, **kwargs):
        raise NotImplementedError("model: the engine has no paged caches for model family 'deepseek_v9'")

    monkeypatch.setattr("deepinfer_jax.bench.runner.LLM", refuse)


def test_bench_refuses_unsupported_models_and_bad_input(capsys, monkeypatch):
    with monkeypatch.context() as m:
        _refuse_every_model(m)
        rc = cli.main(["deepinfer-jax", "bench", "--model=tiny-v3", "--num_requests=1", "--repeats=1"])
    err = capsys.readouterr().err
    assert rc == 2 and "model 'tiny-v3' is not supported by the engine yet" in err and "deepseek_v9" in err
    rc = cli.main(["deepinfer-jax", "bench", "--model=tiny-v3", "--prompt_len=abc"])
    assert rc == 2 and "prompt_len: 'abc' is not a length distribution" in capsys.readouterr().err
    rc = cli.main(["deepinfer-jax", "bench"])
    assert rc == 2 and "--model is required" in capsys.readouterr().err
    rc = cli.main(["deepinfer-jax", "bench", "--model=tiny-v3", "--baseline_script=x.py"])
    assert rc == 2 and "--baseline_python" in capsys.readouterr().err


def test_sweep_writes_one_line_per_point_and_plots(tmp_path, capsys):
    gin = tmp_path / "base.gin"
    gin.write_text('engine.dtype = "float32"\ncache.block_size = 16\nscheduler.max_num_batched_tokens = 64\n')
    out_jsonl = tmp_path / "sweep.jsonl"
    rc = cli.main(
        [
            "deepinfer-jax",
            "sweep",
            f"--sweep_file={gin}",
            "--model=tiny-v3",
            f"--kv_cache_memory={KV_CACHE_MEMORY}",
            *SMALL,
            "--grid=scheduler.max_num_seqs=[1, 16]",
            f"--output={out_jsonl}",
            f"--plot_dir={tmp_path / 'plots'}",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0, err
    lines = [json.loads(line) for line in out_jsonl.read_text().splitlines()]
    assert [line["values"] for line in lines] == [
        {"scheduler.max_num_seqs": 1},
        {"scheduler.max_num_seqs": 16},
    ]
    assert [line["workload"]["max_num_seqs"] for line in lines] == [1, 16]
    assert all(line["summary"]["output_tokens_per_s"] > 0 and line["sweep"] == "base" for line in lines)
    assert (tmp_path / "plots" / "throughput_vs_per_user.png").stat().st_size > 0
    assert (tmp_path / "plots" / "prefill_vs_latency.png").stat().st_size > 0


def test_sweep_errors(tmp_path, capsys, monkeypatch):
    rc = cli.main(["deepinfer-jax", "sweep", f"--sweep_file={tmp_path / 'none.yaml'}"])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    gin = tmp_path / "g.gin"
    gin.write_text("cache.block_size = 16\n")
    rc = cli.main(
        ["deepinfer-jax", "sweep", f"--sweep_file={gin}", "--model=tiny-v3", "--grid=bench.repeats=2"]
    )
    assert rc == 2 and "expected a non-empty list" in capsys.readouterr().err
    _refuse_every_model(monkeypatch)
    rc = cli.main(["deepinfer-jax", "sweep", f"--sweep_file={gin}", "--model=tiny-v3", "--num_requests=1"])
    assert rc == 2 and "not supported by the engine yet" in capsys.readouterr().err


def test_bench_online_flags_are_parsed_and_recorded(tmp_path, capsys):
    out_json = tmp_path / "online.json"
    rc = cli.main(
        [
            "deepinfer-jax",
            "bench",
            *ENGINE,
            *SMALL,
            "--request_rate=50",
            "--burstiness=0.5",
            "--data_parallel_size=1",
            "--expert_parallel_size=1",
            f"--output={out_json}",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "request rate           target 50/s (burstiness 0.5)" in out
    report = json.loads(out_json.read_text())
    w = report["workload"]
    assert (w["request_rate"], w["burstiness"], w["data_parallel_size"], w["expert_parallel_size"]) == (
        50.0,
        0.5,
        1,
        1,
    )
    run = report["engine"]["runs"][0]
    assert run["online"]["request_rate"] == 50.0 and run["online"]["achieved_request_rate"] > 0
    assert report["engine"]["summary"]["request_throughput"] > 0
    # inf is today's behaviour: everything at once, through generate.
    rc = cli.main(["deepinfer-jax", "bench", *ENGINE, *SMALL, "--request_rate=inf", f"--output={out_json}"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads(out_json.read_text())
    assert report["workload"]["request_rate"] is None and "online" not in report["engine"]["runs"][0]


def test_bench_refuses_bad_rates_and_a_baseline_with_a_rate(capsys):
    rc = cli.main(["deepinfer-jax", "bench", "--model=tiny-v3", "--request_rate=0"])
    assert rc == 2 and "Workload.request_rate: must be > 0" in capsys.readouterr().err
    rc = cli.main(["deepinfer-jax", "bench", "--model=tiny-v3", "--request_rate=2", "--batch_size=4"])
    assert rc == 2 and "cannot be combined with request_rate" in capsys.readouterr().err
    rc = cli.main(
        [
            "deepinfer-jax",
            "bench",
            "--model=tiny-v3",
            "--request_rate=2",
            f"--baseline_python={sys.executable}",
            f"--baseline_script={FAKE_BASELINE}",
        ]
    )
    assert rc == 2 and "cannot be compared with an online workload" in capsys.readouterr().err


def test_bench_passes_the_mesh_to_the_engine_and_says_when_it_is_refused(monkeypatch, capsys):
    from deepinfer_jax.bench import runner

    seen = {}

    def refusing_llm(model, **kwargs):
        seen.update(kwargs, model=model)
        raise NotImplementedError("the engine runs on one device so far")

    monkeypatch.setattr(runner, "LLM", refusing_llm)
    rc = cli.main(
        ["deepinfer-jax", "bench", *ENGINE, *SMALL, "--data_parallel_size=2", "--expert_parallel_size=4"]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert (
        "model 'tiny-v3' on a mesh of data_parallel_size=2 x expert_parallel_size=4 is not supported by the "
        "engine yet: the engine runs on one device so far"
    ) in err
    assert (seen["data_parallel_size"], seen["expert_parallel_size"], seen["model"]) == (2, 4, "tiny-v3")


def test_bench_on_a_two_device_mesh(tmp_path, capsys):
    # The test suite has 8 virtual CPU devices: a dp=2 engine really runs, and the report records its mesh.
    out_json = tmp_path / "mesh.json"
    rc = cli.main(
        [
            "deepinfer-jax",
            "bench",
            *[
                f"--kv_cache_memory={2 * KV_CACHE_MEMORY}" if a.startswith("--kv_cache") else a
                for a in ENGINE
            ],
            "--num_requests=4",
            "--prompt_len=4:6",
            "--output_len=3",
            "--warmup=0",
            "--repeats=1",
            "--data_parallel_size=2",
            f"--output={out_json}",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "data_parallel_size 2 x expert_parallel_size 1" in out
    report = json.loads(out_json.read_text())
    assert report["workload"]["data_parallel_size"] == 2
    run = report["engine"]["runs"][0]
    assert run["metrics"]["output_tokens"] == 12  # 4 requests x 3 tokens, whichever device served them
    assert run["step_timing"]["available"]  # the per-device schedulers are timed too


def test_sweep_grids_over_request_rate_and_mesh(tmp_path, capsys):
    gin = tmp_path / "base.gin"
    gin.write_text(
        'engine.dtype = "float32"\ncache.block_size = 16\nscheduler.max_num_batched_tokens = 64\n'
        "scheduler.max_num_seqs = 16\n"
    )
    out_jsonl = tmp_path / "sweep.jsonl"
    rc = cli.main(
        [
            "deepinfer-jax",
            "sweep",
            f"--sweep_file={gin}",
            "--model=tiny-v3",
            f"--kv_cache_memory={KV_CACHE_MEMORY}",
            *SMALL,
            "--expert_parallel_size=1",
            "--grid=bench.request_rate=[100.0, .inf]",
            f"--output={out_jsonl}",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0, err
    # Strict JSON: no Infinity token, the .inf grid value is written as a string.
    lines = [json.loads(line, parse_constant=pytest.fail) for line in out_jsonl.read_text().splitlines()]
    assert [line["values"]["bench.request_rate"] for line in lines] == [100.0, "inf"]
    assert [line["workload"]["request_rate"] for line in lines] == [100.0, None]
    assert (
        lines[0]["summary"]["achieved_request_rate"] > 0
        and "achieved_request_rate" not in lines[1]["summary"]
    )
    assert all(line["workload"]["expert_parallel_size"] == 1 for line in lines)
