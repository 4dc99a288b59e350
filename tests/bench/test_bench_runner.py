"""The harness end to end on tiny-v3 with a stand-in baseline: report shape, ratio arithmetic, plots."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _bench_settings import ENGINE_FIELDS

from deepinfer_jax.bench import ModelNotSupportedError, Workload, run_benchmark
from deepinfer_jax.bench.plots import PLOT_FILES, write_plots
from deepinfer_jax.bench.report import format_report, plot_point
from deepinfer_jax.bench.runner import _agreement

FAKE = Path(__file__).with_name("fake_baseline.py")


@pytest.fixture(scope="module")
def report():
    w = Workload(num_requests=3, prompt_len="5:9", output_len="3", warmup=1, repeats=2, **ENGINE_FIELDS)
    return run_benchmark(w, baseline_python=sys.executable, baseline_script=FAKE, baseline_threads=2)


def test_report_counts_the_workload(report):
    assert report["warmup"]["compile_count"] >= 1  # the warm-up compiles ...
    runs = report["engine"]["runs"]
    assert len(runs) == 2
    for run in runs:
        m = run["metrics"]
        assert run["compile_count"] == 0  # ... and the measured runs never do
        assert m["num_requests"] == 3 and m["output_tokens"] == 9  # ignore_eos: exactly 3 tokens each
        assert m["output_tokens_per_s"] == pytest.approx(9 / m["wall_seconds"])
        assert m["ttft"]["count"] == 3 and m["tpot"]["count"] == 3
        assert 0 < m["ttft"]["p50"] <= m["latency"]["max"] <= m["wall_seconds"]
        timing = run["step_timing"]
        assert timing["available"] and timing["steps"] == run["steps"] >= 3  # prefill + 2 decodes at least
        assert timing["host_seconds"] + timing["wait_seconds"] <= m["wall_seconds"]
    kv = report["kv_bytes_per_token"]
    # tiny-v3: (64 latent + 32 rope) values x 4 layers (3 + MTP); float32 cache = 4 B, production bf16 = 2 B.
    assert kv["engine_cache"] == 96 * 4 * 4 and kv["production_format"] == 96 * 2 * 3
    assert kv["production_format_with_draft_layers"] == 96 * 2 * 4


def test_ratio_is_engine_over_baseline_per_pair(report):
    base = report["baseline"]
    assert base["info"]["name"] == "fake" and base["info"]["threads"] == 2
    # The stand-in reports 0.5 s for 9 tokens: 18 tokens/s.
    assert [b["output_tokens_per_s"] for b in base["runs"]] == [18.0, 18.0]
    expected = [r["metrics"]["output_tokens_per_s"] / 18.0 for r in report["engine"]["runs"]]
    assert report["ratio"]["per_pair"] == pytest.approx(expected)
    assert report["ratio"]["output_tokens_per_s"] == pytest.approx(sum(expected) / 2)  # median of two
    assert report["ratio"]["best_runs"] == pytest.approx(max(expected))
    assert report["token_agreement"]["sequences"] == 3


def test_table_and_plots(report, tmp_path):
    table = format_report(report)
    for needle in (
        "output tokens/s",
        "TTFT ms",
        "TPOT ms",
        "KV cache, this run",
        "compilations",
        "ratio engine/baseline",
    ):
        assert needle in table
    # The two cache sizes are labelled apart: this run's unquantised float32 cache and the production format
    # with what its records hold (tiny-v3: bf16 latent records of 96 values).
    assert "B per cached token in the paged cache (float32 values, unquantised)" in table
    assert "KV cache, production" in table and "not this run's storage" in table
    assert "latent 192 B: 96 bf16 values, unquantised" in table
    paths = write_plots([plot_point(report, "a"), plot_point(report, "b")], tmp_path / "plots")
    assert [p.name for p in paths] == list(PLOT_FILES)
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000
    with pytest.raises(ValueError, match="no points"):
        write_plots([], tmp_path)


def test_agreement_counts_common_prefixes():
    a = _agreement([[1, 2, 3], [4, 5, 6], [7]], [[1, 2, 3], [4, 9, 6], [8]])
    assert a == {"identical_sequences": 1, "sequences": 3, "common_prefix_mean": pytest.approx(4 / 3)}


def test_unsupported_model_is_named(monkeypatch):
    # Every built-in family is served now, so the refusal is staged: the engine raises NotImplementedError
    # for a family without paged caches, and the harness must name the model and pass the reason on.
    def refuse(*args, **kwargs):
        raise NotImplementedError("model: the engine has no paged caches for model family 'deepseek_v9'")

    monkeypatch.setattr("deepinfer_jax.bench.runner.LLM", refuse)
    with pytest.raises(
        ModelNotSupportedError, match=r"model 'tiny-v3' is not supported by the engine yet: .*'deepseek_v9'"
    ):
        run_benchmark(Workload(model="tiny-v3", num_requests=1, prompt_len=4, output_len=2, repeats=1))


def test_tiny_v4_is_served():
    """DeepSeek-V4 builds a benchmark engine (construction only: no step is compiled)."""
    from deepinfer_jax.bench.runner import EngineBench
    from deepinfer_jax.models.deepseek_v4.paged import V4PagedModel

    w = Workload(
        model="tiny-v4",
        num_requests=1,
        prompt_len=4,
        output_len=2,
        repeats=1,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        kv_cache_memory="4MiB",
        engine_overrides={"cache.block_size": 16},
    )
    bench = EngineBench(w)
    assert isinstance(bench.llm.paged_model, V4PagedModel)
    assert bench.llm.executor.compile_count == 0


def test_step_timer_says_when_the_runner_has_no_hooks():
    from types import SimpleNamespace

    from deepinfer_jax.bench.runner import StepTimer

    timer = StepTimer()
    with timer.attach(SimpleNamespace(runner=SimpleNamespace(), scheduler=SimpleNamespace())):
        pass
    assert timer.to_dict() == {
        "available": False,
        "reason": "the engine runner exposes no schedule/dispatch/process calls",
    }


def test_mesh_run_reports_the_expert_load():
    """On a mesh with EPLB the run reports ``moe_lb`` and the re-placements, as the engine's own stats say. The
    workload is online (a request rate): the engine runs one loop on every mesh, so requests join it there too."""
    from deepinfer_jax.bench.runner import EngineBench

    w = Workload(
        model="tiny-v3",
        dtype="float32",
        num_requests=6,
        prompt_len=6,
        output_len=6,
        repeats=1,
        request_rate=500.0,
        max_num_seqs=16,
        max_num_batched_tokens=128,
        kv_cache_memory="8MiB",
        data_parallel_size=2,
        expert_parallel_size=4,
        engine_overrides={
            "cache.block_size": 16,
            "parallel.eplb_interval_steps": 2,
            "parallel.eplb_window_steps": 2,
        },
    )
    bench = EngineBench(w)
    run = bench.run()
    stats = bench.llm.last_stats
    assert run["moe"] == {
        "moe_lb": pytest.approx(stats.moe_lb),
        "eplb_rearrangements": stats.eplb_rearrangements,
    }
    assert run["moe"]["moe_lb"] >= 1.0 and run["moe"]["eplb_rearrangements"] >= 1
    assert run["online"]["request_rate"] == 500.0 and run["online"]["request_throughput"] > 0
    assert run["step_timing"].get("available", True) is not False


def test_step_timer_counts_a_decode_loops_waits_as_wait_and_its_iterations():
    """A decode-loop call's host thread waits for each iteration's callback inside the runner's processing: that
    time is wait, not host, and the call counts its iterations. A fake runner: one one-token step, then a loop
    call of 3 iterations, each arriving after a 50 ms sleep (device time) and processed with 2 ms of host work."""
    import time
    from types import SimpleNamespace

    from deepinfer_jax.bench.runner import StepTimer

    def busy(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    class Ready:
        def block_until_ready(self):
            return self

    class Loop:
        out = SimpleNamespace(payload=None)
        tokens = Ready()

        def items(self):
            for i in range(3):
                time.sleep(0.05)
                yield i

    runner = SimpleNamespace(loop_steps=0, loop_iterations=0)

    def process(plan, out):
        if plan.inputs.loop is None:
            busy(0.002)
            return
        runner.loop_steps += 1
        for _ in out.items():
            runner.loop_iterations += 1
            busy(0.002)

    runner._dispatch = lambda plan: None
    runner._process = process
    runner._finish = lambda plan, step: step
    scheduler = SimpleNamespace(schedule=lambda: None)
    llm = SimpleNamespace(runner=runner, scheduler=scheduler)
    timer = StepTimer()
    plain = SimpleNamespace(inputs=SimpleNamespace(loop=None))
    looped = SimpleNamespace(inputs=SimpleNamespace(loop=object()))
    with timer.attach(llm):
        for plan, out in ((plain, SimpleNamespace(tokens=Ready())), (looped, Loop())):
            runner._dispatch(plan)
            runner._process(plan, out)
    t = timer.to_dict()
    assert t["steps"] == 2 and t["iterations"] == 4  # one one-token step + a loop call of three iterations
    assert t["wait_seconds"] >= 3 * 0.05  # every sleep is wait ...
    assert 4 * 0.002 <= t["host_seconds"] < 0.1  # ... and host is the busy work, not the sleeps
    assert t["host_ms_per_iteration"] == pytest.approx(1e3 * t["host_seconds"] / 4)
    assert t["wait_ms_per_step"] == pytest.approx(1e3 * t["wait_seconds"] / 2)
