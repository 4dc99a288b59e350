"""The baseline protocol with a stand-in script (CI has no torch), and the shipped script's failure path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from deepinfer_jax.bench import baseline as bl

FAKE = Path(__file__).with_name("fake_baseline.py")


def _setup(**kw):
    return bl.baseline_setup(
        "model", [[5, 6, 7], [9, 1]], [3, 2], batch_size=None, dtype="float32", threads=2, warmup=1, **kw
    )


def test_stand_in_baseline_round_trip():
    with bl.BaselineProcess(sys.executable, _setup(), script=FAKE) as proc:
        assert proc.info["name"] == "fake" and proc.info["threads"] == 2
        assert proc.info["setup"]["prompts"] == [[5, 6, 7], [9, 1]]  # what the harness sent arrives intact
        for _ in range(2):
            run = proc.run()
            assert run.seconds == 0.5 and run.input_tokens == 5 and run.output_tokens == 5
            assert run.output_tokens_per_s == pytest.approx(10.0)  # 5 tokens / 0.5 s
            assert run.token_ids == [[5, 5, 5], [9, 9]]


@pytest.mark.parametrize(
    ("fail", "match"),
    [("setup", "cannot load the model"), ("exit", "(?s)exited with status 3.*dying")],
)
def test_baseline_failures_at_start_are_reported(monkeypatch, fail, match):
    monkeypatch.setenv("FAKE_BASELINE_FAIL", fail)
    with pytest.raises(bl.BaselineError, match=match):
        bl.BaselineProcess(sys.executable, _setup(), script=FAKE)


def test_baseline_failure_during_a_run(monkeypatch):
    monkeypatch.setenv("FAKE_BASELINE_FAIL", "run")
    proc = bl.BaselineProcess(sys.executable, _setup(), script=FAKE)
    try:
        with pytest.raises(bl.BaselineError, match="out of memory"):
            proc.run()
    finally:
        proc.close()


def test_bad_paths_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"baseline_python: .*not an interpreter"):
        bl.BaselineProcess(tmp_path / "python", _setup(), script=FAKE)
    with pytest.raises(ValueError, match=r"baseline_script: .*does not exist"):
        bl.BaselineProcess(sys.executable, _setup(), script=tmp_path / "nope.py")


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed here")
def test_shipped_baseline_says_what_is_missing():
    # The project's own venv has no torch: the shipped script must fail cleanly through the protocol.
    with pytest.raises(bl.BaselineError, match="No module named 'torch'"):
        bl.BaselineProcess(sys.executable, _setup())


def test_shipped_baseline_batches_like_the_workload():
    spec = importlib.util.spec_from_file_location("hf_baseline", bl.DEFAULT_SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # imports no torch at module level
    setup = {"prompts": [[1], [2], [3]], "max_new_tokens": [4, 5, 6], "batch_size": 2}
    assert mod._batches(setup) == [([[1], [2]], [4, 5]), ([[3]], [6])]
    assert mod._batches({**setup, "batch_size": None}) == [([[1], [2], [3]], [4, 5, 6])]
