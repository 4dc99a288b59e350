"""Workload description: length distributions, deterministic requests, batching, refused values."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.bench.workload import LengthDist, Workload, parse_length_dist


def test_parse_length_dist_forms():
    assert parse_length_dist(32, "f") == LengthDist("constant", 32)
    assert parse_length_dist("32", "f") == LengthDist("constant", 32)
    assert parse_length_dist("16:64", "f") == LengthDist("uniform", 16, 64)
    assert parse_length_dist("8, 16,32", "f") == LengthDist("choice", values=(8, 16, 32))
    assert str(LengthDist("uniform", 16, 64)) == "16:64" and LengthDist("uniform", 16, 64).max == 64
    with pytest.raises(ValueError, match="prompt_len: 'x' is not a length distribution"):
        parse_length_dist("x", "prompt_len")
    with pytest.raises(ValueError, match="low <= high"):
        parse_length_dist("9:3", "f")
    with pytest.raises(ValueError, match="low <= high"):
        parse_length_dist("0", "f")
    with pytest.raises(TypeError, match="output_len: expected a length"):
        parse_length_dist(1.5, "output_len")


def test_sampled_lengths_stay_in_range():
    rng = np.random.default_rng(1)
    u = LengthDist("uniform", 3, 5).sample(rng, 200)
    assert set(u) == {3, 4, 5}
    c = LengthDist("choice", values=(8, 32)).sample(rng, 50)
    assert set(c) <= {8, 32}


def test_requests_are_deterministic_and_follow_the_workload():
    w = Workload(num_requests=5, prompt_len="4:9", output_len="2,3", seed=7)
    a, b = w.requests(100), w.requests(100)
    assert a == b
    assert all(4 <= len(r.prompt_token_ids) <= 9 and r.max_tokens in (2, 3) for r in a)
    assert all(0 <= t < 100 for r in a for t in r.prompt_token_ids)
    assert w.replace(seed=8).requests(100) != a
    assert [len(x) for x in w.replace(batch_size=2).batches(a)] == [2, 2, 1]
    assert [len(x) for x in w.batches(a)] == [5]
    d = w.to_dict()
    assert d["prompt_len"] == "4:9" and d["output_len"] == "2,3" and d["num_requests"] == 5


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"num_requests": 0}, ValueError, "Workload.num_requests: must be >= 1, got 0"),
        ({"repeats": 1.5}, TypeError, "Workload.repeats: expected an int"),
        ({"dtype": "float16"}, ValueError, "Workload.dtype: 'float16'"),
        ({"batch_size": 0}, ValueError, "Workload.batch_size"),
        ({"seed": -1}, ValueError, "Workload.seed"),
        ({"warmup": -1}, ValueError, "Workload.warmup: must be >= 0"),
    ],
)
def test_workload_refuses_bad_values(changes, error, match):
    with pytest.raises(error, match=match):
        Workload(**changes)


def test_replace_refuses_unknown_fields():
    with pytest.raises(ValueError, match="unknown field"):
        Workload().replace(prompt_length=3)


# ------------------------------------------------------------------------------------------ request rates


def test_without_a_rate_everything_arrives_at_once():
    w = Workload(num_requests=4)
    assert not w.online and w.arrival_times() == [0.0] * 4
    for inf in (float("inf"), "inf", None):
        assert Workload(request_rate=inf).request_rate is None  # inf means "all at once", as today
    assert Workload(request_rate=3).request_rate == 3.0 and Workload(request_rate=3).online


def test_poisson_arrivals_follow_the_rate():
    rate, n = 4.0, 4001
    w = Workload(num_requests=n, request_rate=rate, seed=3)
    t = np.asarray(w.arrival_times())
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0) and len(t) == n
    assert w.arrival_times() == t.tolist()  # deterministic: the same draw every call
    gaps = np.diff(t)
    # Exponential gaps of mean 1/rate = 0.25 s: the sample mean of 4000 gaps has a standard error of
    # 0.25 / sqrt(4000) = 0.004; 5 standard errors (0.02) bound a correct draw and catch a wrong scale (e.g.
    # rate used as the mean, or a gamma scale of 1/rate with burstiness != 1).
    assert abs(gaps.mean() - 0.25) < 0.02
    # Memorylessness, independent of how the draw is made: P(gap > mean) = e^-1 = 0.368; its standard error
    # over 4000 gaps is sqrt(0.368 * 0.632 / 4000) = 0.0076, so 5 standard errors is 0.038.
    assert abs(np.mean(gaps > 0.25) - np.exp(-1.0)) < 0.038
    # Exponential: coefficient of variation 1 (std == mean); 0.1 is several standard errors wide here.
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.1


def test_burstiness_changes_the_spread_not_the_rate():
    n = 4001
    for burstiness in (0.25, 4.0):
        w = Workload(num_requests=n, request_rate=10.0, burstiness=burstiness, seed=1)
        gaps = np.diff(w.arrival_times())
        # Gamma(shape k, scale 1/(rate k)): mean 1/rate = 0.1 s whatever k; coefficient of variation 1/sqrt(k)
        # (2 for k = 0.25: burstier; 0.5 for k = 4: more regular). Over 200 seeds the standard errors at k = 0.25
        # are 0.003 (mean) and 0.05 (CV): the tolerances are about 5 of them, and smaller ones at k = 4.
        assert abs(gaps.mean() - 0.1) < 0.015
        assert abs(gaps.std() / gaps.mean() - 1.0 / np.sqrt(burstiness)) < 0.12 / np.sqrt(burstiness)


def test_a_rate_changes_no_prompt():
    w = Workload(num_requests=6, prompt_len="4:9", output_len="2,3", seed=5)
    assert w.replace(request_rate=2.0).requests(100) == w.requests(100)
    assert w.replace(request_rate=2.0, seed=6).arrival_times() != w.replace(request_rate=2.0).arrival_times()
    d = w.replace(request_rate=2.0, burstiness=0.5, data_parallel_size=2).to_dict()
    assert (d["request_rate"], d["burstiness"], d["data_parallel_size"], d["expert_parallel_size"]) == (
        2.0,
        0.5,
        2,
        1,
    )


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 50),
    rate=st.floats(1e-3, 1e4),
    burstiness=st.floats(0.05, 20.0),
    seed=st.integers(0, 2**32),
)
def test_arrivals_are_ordered_and_reproducible(n, rate, burstiness, seed):
    w = Workload(num_requests=n, request_rate=rate, burstiness=burstiness, seed=seed)
    t = w.arrival_times()
    assert len(t) == n and t[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(t))
    assert t == Workload(num_requests=n, request_rate=rate, burstiness=burstiness, seed=seed).arrival_times()


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"request_rate": 0}, ValueError, r"Workload.request_rate: must be > 0 requests/s \(or inf\), got 0"),
        ({"request_rate": -2.0}, ValueError, "Workload.request_rate: must be > 0"),
        ({"request_rate": float("nan")}, ValueError, "Workload.request_rate: must be > 0"),
        ({"request_rate": "fast"}, TypeError, "Workload.request_rate: expected requests per second"),
        ({"request_rate": True}, TypeError, "Workload.request_rate: expected requests per second"),
        ({"burstiness": 0.0}, ValueError, "Workload.burstiness: must be a finite number > 0, got 0.0"),
        ({"burstiness": float("inf")}, ValueError, "Workload.burstiness"),
        ({"burstiness": "1"}, TypeError, "Workload.burstiness: expected a float"),
        (
            {"request_rate": 2.0, "batch_size": 4},
            ValueError,
            "Workload.batch_size: 4 cannot be combined with request_rate = 2.0",
        ),
        ({"data_parallel_size": 0}, ValueError, "Workload.data_parallel_size: must be >= 1, got 0"),
        ({"expert_parallel_size": 2.0}, TypeError, "Workload.expert_parallel_size: expected an int"),
    ],
)
def test_rates_and_mesh_sizes_are_validated(changes, error, match):
    with pytest.raises(error, match=match):
        Workload(**changes)
