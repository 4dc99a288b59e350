"""`deepinfer-jax bench` and `deepinfer-jax sweep` end to end on tiny-v3 with a very small workload."""

from __future__ import annotations

import json
import sys
from pathlib import Path

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


def test_bench_refuses_unsupported_models_and_bad_input(capsys):
    rc = cli.main(["deepinfer-jax", "bench", "--model=tiny-v4", "--num_requests=1", "--repeats=1"])
    err = capsys.readouterr().err
    assert rc == 2 and "model 'tiny-v4' is not supported by the engine yet" in err
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


def test_sweep_errors(tmp_path, capsys):
    rc = cli.main(["deepinfer-jax", "sweep", f"--sweep_file={tmp_path / 'none.yaml'}"])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    gin = tmp_path / "g.gin"
    gin.write_text("cache.block_size = 16\n")
    rc = cli.main(
        ["deepinfer-jax", "sweep", f"--sweep_file={gin}", "--model=tiny-v3", "--grid=bench.repeats=2"]
    )
    assert rc == 2 and "expected a non-empty list" in capsys.readouterr().err
    rc = cli.main(["deepinfer-jax", "sweep", f"--sweep_file={gin}", "--model=tiny-v4", "--num_requests=1"])
    assert rc == 2 and "not supported by the engine yet" in capsys.readouterr().err
