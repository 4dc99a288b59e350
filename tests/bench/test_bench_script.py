"""scripts/bench_generate.py: the recorded comparison's command for each model (nothing is run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "bench_generate.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("bench_generate", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("model_args", [["--model", "tiny-v4"], ["--model=tiny-v4"]])
def test_model_choice_keeps_the_recorded_workload(script, model_args):
    args, dry = script.bench_args([*model_args, "--repeats=1", "--dry_run", "--baseline_python=py"])
    assert dry and args[0] == "--model=tiny-v4"
    # The tiny-v3 and tiny-v4 rows of docs/benchmarks.md share this workload.
    for flag in (
        "--num_requests=16",
        "--prompt_len=32",
        "--output_len=64",
        "--dtype=float32",
        "--temperature=0",
    ):
        assert flag in args
    assert args[-2:] == ["--repeats=1", "--baseline_python=py"]  # passed on last: they override the workload
    assert sum(a.startswith("--baseline_python") for a in args) == 1  # an explicit baseline replaces the venv


def test_default_model_and_refusal(script, capsys):
    args, dry = script.bench_args([])
    assert args[0] == "--model=tiny-v3" and not dry
    with pytest.raises(ValueError, match="--model: 'tiny-v9' has no recorded comparison"):
        script.bench_args(["--model=tiny-v9"])
    assert script.main(["--model=tiny-v41", "--dry_run"]) == 2
    assert "expected one of tiny-v3, tiny-v4" in capsys.readouterr().err
    assert script.main(["--model=tiny-v4", "--dry_run"]) == 0  # prints the command, runs nothing
    assert "deepinfer-jax bench --model=tiny-v4 --dtype=float32" in capsys.readouterr().err
