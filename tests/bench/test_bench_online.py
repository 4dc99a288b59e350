"""Online runs on tiny-v3: requests enter the running engine at their arrival times (continuous batching)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from _bench_settings import ENGINE_FIELDS

from deepinfer_jax.bench import EngineBench, Workload, run_benchmark
from deepinfer_jax.bench.online import run_online
from deepinfer_jax.engine.params import SamplingParams

FAKE = Path(__file__).with_name("fake_baseline.py")

# Request 0 is long; the next three arrive while it decodes: its 48 decode steps take some 0.1 s on an idle
# machine (so the arrivals at 0.02 s and 0.08 s come in time), and longer on a loaded one, whose slow prefill
# may let those two arrive before request 0's first token but then still leaves the one at 0.25 s inside. The
# last request arrives after everything else has finished, so the loop must wait for it with nothing queued or
# running.
PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5], [8, 9, 7, 9, 3], [2, 3, 8, 4, 6, 2], [6, 4, 3]]
MAX_TOKENS = [48, 6, 5, 6, 4]
OFFSETS = [0.0, 0.02, 0.08, 0.25, 2.0]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def bench():
    """One engine for the module (tiny-v3, the shared test shape), warmed up with an online run."""
    w = Workload(num_requests=4, prompt_len="4:8", output_len="6", request_rate=200.0, warmup=0, repeats=1)
    b = EngineBench(w.replace(**ENGINE_FIELDS))
    b.run(measure_steps=False)  # compiles the buckets an online run uses
    return b


@pytest.fixture(scope="module")
def runs(bench):
    params = [_greedy(n) for n in MAX_TOKENS]
    offline = bench.llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        time.sleep(seconds)

    online = run_online(bench.llm, PROMPTS, params, OFFSETS, sleep=sleep)
    return offline, online, slept


def test_later_arrivals_join_while_earlier_requests_run(runs):
    _, online, _ = runs
    m = [o.metrics for o in online.outputs]
    first = m[0]
    # Some later request was first scheduled after request 0 had its first token and before it finished: it
    # entered the running batch (continuous batching), not a new generate call after the first one.
    joined = [
        i
        for i in range(1, 4)
        if first.first_token_time < m[i].first_scheduled_time < first.finish_time  # type: ignore[operator]
    ]
    assert joined, [(x.first_scheduled_time, x.first_token_time, x.finish_time) for x in m]
    # Request 4 arrived after everything else had finished: it waited with nothing running.
    assert m[4].arrival_time > max(x.finish_time for x in m[:4])  # type: ignore[type-var]


def test_arrivals_are_stamped_on_the_engine_clock(runs):
    _, online, slept = runs
    assert online.arrivals == pytest.approx([online.start + x for x in OFFSETS], abs=1e-12)
    for o, arrival, admitted in zip(online.outputs, online.arrivals, online.admitted):
        m = o.metrics
        assert m.arrival_time == arrival  # the drawn time, not the time the loop noticed it
        # arrival <= admitted <= first scheduled <= first token <= finish, all on one clock.
        assert arrival <= admitted <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
        # TTFT contains the wait for the loop's next round.
        assert m.first_token_time - m.arrival_time >= admitted - arrival
    assert online.end >= max(o.metrics.finish_time for o in online.outputs)
    # The idle loop slept until request 4 arrived instead of spinning (at least one wait, of at most 2 s).
    assert slept and all(0.0 <= s <= 2.0 for s in slept)


def test_online_tokens_equal_the_offline_run(runs):
    offline, online, _ = runs
    # Greedy float32 on the same engine: arriving later changes the batches, never the tokens.
    assert [o.outputs[0].token_ids for o in online.outputs] == [o.outputs[0].token_ids for o in offline]
    assert [len(o.outputs[0].token_ids) for o in online.outputs] == MAX_TOKENS


def test_summary_rates(runs):
    _, online, _ = runs
    s = online.summary(25.0, 1.0)
    span = online.arrivals[-1] - online.arrivals[0]
    assert s["arrival_span_seconds"] == pytest.approx(2.0, abs=1e-9)
    assert s["drawn_request_rate"] == pytest.approx(4 / span)  # 4 gaps over the span
    admitted = online.admitted
    assert s["achieved_request_rate"] == pytest.approx(4 / (admitted[-1] - admitted[0]))
    assert s["request_throughput"] == pytest.approx(5 / online.wall_seconds)
    assert s["admission_delay"]["count"] == 5 and s["admission_delay"]["min"] >= 0.0
    assert (s["request_rate"], s["burstiness"]) == (25.0, 1.0)


def test_bench_run_reports_request_rates(bench):
    run = bench.run()
    on = run["online"]
    arrivals = bench.workload.arrival_times()
    assert on["request_rate"] == 200.0 and on["drawn_request_rate"] == pytest.approx(3 / arrivals[-1])
    assert on["achieved_request_rate"] > 0 and on["request_throughput"] == pytest.approx(
        4 / run["metrics"]["wall_seconds"]
    )
    assert run["metrics"]["output_tokens"] == 24 and len(run["token_ids"]) == 4
    assert run["step_timing"]["available"] and run["step_timing"]["steps"] == run["steps"]


def test_run_benchmark_online_summary():
    w = Workload(num_requests=3, prompt_len="5", output_len="3", request_rate=100.0, warmup=1, repeats=2)
    report = run_benchmark(w.replace(**ENGINE_FIELDS))
    s = report["engine"]["summary"]
    assert report["workload"]["request_rate"] == 100.0 and report["workload"]["burstiness"] == 1.0
    assert s["request_rate"] == 100.0 and s["achieved_request_rate"] > 0 and s["request_throughput"] > 0
    assert all("online" in r for r in report["engine"]["runs"])
    assert all(r["metrics"]["output_tokens"] == 9 for r in report["engine"]["runs"])


def test_online_input_is_refused_before_anything_runs(bench):
    p = [_greedy(2)] * 2
    with pytest.raises(
        ValueError, match=r"arrival_offsets\[1\] = 0.1: offsets must be finite, >= 0 and non-decreasing"
    ):
        run_online(bench.llm, [[1, 2], [3, 4]], p, [0.2, 0.1])
    with pytest.raises(ValueError, match=r"arrival_offsets\[1\] = inf: offsets must be finite"):
        run_online(bench.llm, [[1, 2], [3, 4]], p, [0.0, float("inf")])
    with pytest.raises(ValueError, match="arrival_offsets: 1 entries for 2 prompts"):
        run_online(bench.llm, [[1, 2], [3, 4]], p, [0.0])
    with pytest.raises(ValueError, match="request 1"):
        run_online(bench.llm, [[1, 2], [3, 10**6]], p, [0.0, 0.0])  # a token id outside the vocabulary
    assert not bench.llm.scheduler.has_unfinished_requests()  # nothing was queued


def test_baseline_and_online_workloads_do_not_mix():
    w = Workload(num_requests=2, request_rate=5.0)
    with pytest.raises(ValueError, match=r"baseline_python: .*online workload \(request_rate = 5.0"):
        run_benchmark(w, baseline_python=sys.executable, baseline_script=FAKE)
