"""Metrics math against values worked out by hand from synthetic timestamps."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.bench.metrics import RequestTiming, distribution, run_metrics


def test_distribution_hand_computed():
    # Linear interpolation on the sorted sample [1, 2, 3, 4]: rank q/100 * (n - 1).
    # p50: rank 1.5 -> 2.5; p90: rank 2.7 -> 3 + 0.7 = 3.7; p99: rank 2.97 -> 3.97.
    d = distribution([4.0, 1.0, 3.0, 2.0])
    assert d is not None
    assert (d.count, d.mean, d.min, d.max) == (4, 2.5, 1.0, 4.0)
    # 1e-12: the interpolation is one multiply-add in float64 on small integers.
    assert d.p50 == pytest.approx(2.5, abs=1e-12)
    assert d.p90 == pytest.approx(3.7, abs=1e-12)
    assert d.p99 == pytest.approx(3.97, abs=1e-12)
    single = distribution([7.0])
    assert single is not None and single.p50 == single.p99 == 7.0
    assert distribution([]) is None
    with pytest.raises(ValueError, match="finite"):
        distribution([1.0, math.nan])


def test_request_timing_hand_computed():
    # Arrives at 10.0, first token at 10.25, 5 tokens, finishes at 10.65: TPOT = 0.4 / 4 = 0.1.
    t = RequestTiming(10.0, 10.25, 10.65, prompt_tokens=8, output_tokens=5)
    assert t.ttft == pytest.approx(0.25)
    assert t.tpot == pytest.approx(0.1)
    assert t.latency == pytest.approx(0.65)
    assert RequestTiming(0.0, 1.0, 1.0, 3, 1).tpot is None
    with pytest.raises(ValueError, match="arrival_time <= first_token_time <= finish_time"):
        RequestTiming(1.0, 0.5, 2.0, 3, 2)
    with pytest.raises(ValueError, match="output_tokens"):
        RequestTiming(0.0, 0.5, 2.0, 3, 0)


def test_run_metrics_hand_computed():
    timings = [
        # ttft 0.1, tpot (1.1 - 0.1) / 4 = 0.25, latency 1.1
        RequestTiming(0.0, 0.1, 1.1, prompt_tokens=10, output_tokens=5),
        # ttft 0.3, tpot (2.3 - 0.3) / 4 = 0.5, latency 2.3
        RequestTiming(0.0, 0.3, 2.3, prompt_tokens=30, output_tokens=5),
        # one token: no tpot; ttft 0.2, latency 0.2
        RequestTiming(0.0, 0.2, 0.2, prompt_tokens=20, output_tokens=1),
    ]
    m = run_metrics(timings, wall_seconds=2.5)
    assert (m.num_requests, m.input_tokens, m.output_tokens) == (3, 60, 11)
    assert m.input_tokens_per_s == pytest.approx(24.0)  # 60 / 2.5
    assert m.output_tokens_per_s == pytest.approx(4.4)  # 11 / 2.5
    assert m.ttft.mean == pytest.approx(0.2) and m.ttft.p50 == pytest.approx(0.2)
    assert m.tpot is not None and m.tpot.count == 2
    assert m.tpot.p50 == pytest.approx(0.375)  # midway between 0.25 and 0.5
    assert m.seq_tokens_per_s is not None
    assert sorted([m.seq_tokens_per_s.min, m.seq_tokens_per_s.max]) == pytest.approx([2.0, 4.0])  # 1 / tpot
    # End to end: 5 / 1.1, 5 / 2.3, 1 / 0.2.
    assert m.seq_e2e_tokens_per_s.max == pytest.approx(5.0)
    assert m.seq_e2e_tokens_per_s.min == pytest.approx(5 / 2.3)
    assert m.latency.max == pytest.approx(2.3)
    d = m.to_dict()
    assert d["ttft"]["p50"] == pytest.approx(0.2) and d["output_tokens"] == 11
    with pytest.raises(ValueError, match="no request timings"):
        run_metrics([], 1.0)
    with pytest.raises(ValueError, match="wall_seconds"):
        run_metrics(timings, 0.0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=50))
def test_distribution_properties(values):
    d = distribution(values)
    assert d is not None
    # Percentiles are ordered and inside the sample's range (a relative 1e-12 slack for interpolation rounding).
    eps = 1e-12 * max(1.0, d.max)
    assert d.min - eps <= d.p50 <= d.p90 + eps <= d.p99 + 2 * eps <= d.max + 3 * eps
    assert d.mean == pytest.approx(float(np.mean(np.asarray(values, np.float64))), rel=1e-12, abs=1e-9)
