"""The load test's workload and its checks (deepinfer_jax/bench/load.py), without a server: every rule it checks
catches the result that breaks it, and the summary's percentiles are those of the client times given."""

from __future__ import annotations

import pytest

from deepinfer_jax.bench.http import HTTPRequest, HTTPResult
from deepinfer_jax.bench.load import LoadSpec, check_results, load_requests, load_summary, offline_params


def test_workload_is_seeded_mixed_and_bounded():
    spec = LoadSpec(requests=200, prompt_len=(3, 9), max_tokens=(2, 6), disconnect_fraction=0.25, seed=4)
    a, b = load_requests(spec), load_requests(spec)
    assert a == b and a != load_requests(LoadSpec(**{**spec.__dict__, "seed": 5}))
    assert {len(r.prompt_token_ids) for r in a} == set(range(3, 10))
    assert {r.max_tokens for r in a} == set(range(2, 7))
    assert all(2 <= t < spec.vocab for r in a for t in r.prompt_token_ids)
    cut = [r for r in a if r.disconnect_after is not None]
    assert 30 <= len(cut) <= 70  # 50 expected
    assert all(1 <= r.disconnect_after < r.max_tokens for r in cut)
    assert len({r.seed for r in a}) == 200
    p = offline_params(a[0])
    assert (p.seq_seed, p.max_tokens, p.ignore_eos, p.temperature) == (a[0].seed, a[0].max_tokens, True, 1.0)
    with pytest.raises(ValueError, match=r"max_tokens = \(3, 2\)"):
        LoadSpec(max_tokens=(3, 2))


def _result(i, tokens, *, reason="length", disconnected=False, usage=None, error=None, t0=0.0):
    return HTTPResult(
        i,
        sent=t0,
        first_token=t0 + 0.5,
        finished=t0 + 0.5 + 0.1 * (len(tokens) - 1),
        token_ids=list(tokens),
        finish_reason=None if disconnected else reason,
        usage={"prompt_tokens": 2, "completion_tokens": len(tokens)} if usage is None else usage,
        disconnected=disconnected,
        error=error,
    )


def test_every_broken_rule_is_reported():
    requests = [HTTPRequest((5, 6), 3, seed=i) for i in range(7)]
    want = [[1, 2, 3]] * 7
    results = [
        _result(0, [1, 2, 3]),  # fine
        _result(1, [1, 2], disconnected=True),  # fine: a prefix
        _result(2, [1, 9], disconnected=True),  # not a prefix
        _result(3, [1, 2, 4]),  # other tokens
        _result(4, [1, 2, 3], usage={"prompt_tokens": 2, "completion_tokens": 2}),  # usage off
        _result(5, [1, 2, 3], reason="stop"),  # wrong finish reason
        HTTPResult(6, error="not finished before the deadline"),  # lost
    ]
    check = check_results(requests, results, want)
    assert (check.complete, check.disconnected) == (1, 2)
    assert [line.split(":")[0] for line in check.problems] == [f"request {i}" for i in (2, 3, 4, 5, 6)]
    assert not check.ok
    assert check_results(requests[:2], results[:2], want[:2]).ok


def test_summary_is_of_the_completed_requests():
    results = [_result(i, [1] * (i + 2), t0=float(i)) for i in range(5)] + [
        _result(5, [1], disconnected=True)
    ]
    summary = load_summary(results, 0.0, 10.0)
    assert summary["completed"] == 5 and summary["disconnected"] == 1
    assert summary["requests_per_second"] == pytest.approx(0.5)
    assert summary["output_tokens_per_second"] == pytest.approx((2 + 3 + 4 + 5 + 6) / 10)
    assert summary["ttft_seconds"]["p50"] == pytest.approx(0.5) and summary["ttft_seconds"]["count"] == 5
    assert summary["tpot_seconds"]["p99"] == pytest.approx(0.1)
