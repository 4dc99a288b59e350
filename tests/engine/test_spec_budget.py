"""Confidence-scheduled verify lengths: the host budget search, the estimators, the curve cache, and the device
re-allocation against a pure-Python reference and against the host allocation."""

from __future__ import annotations

import json
import math
import os

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.engine.spec_budget import (
    CACHE_GRACE_S,
    LatencyCurve,
    SamplerTimeEstimator,
    SlopeEstimator,
    allocate_verify_lengths,
    budget_rates,
    cumulative_rates,
    curve_cache_key,
    draft_available,
    is_paired,
    load_curve,
    measure_curve,
    plan_verify_lengths,
    save_curve,
)
from deepinfer_jax.engine.spec_device import reallocate

_reallocate = jax.jit(reallocate)

# ----------------------------------------------------------------------------------------------------------
# LatencyCurve


def test_curve_lookup():
    c = LatencyCurve([(2, 10.0), (4, 12), (8, 20.0)])
    assert c.points == ((2, 10.0), (4, 12.0), (8, 20.0))
    assert c.sizes == (2, 4, 8)
    assert c.smallest_at_least(1) == (2, 10.0)
    assert c.smallest_at_least(2) == (2, 10.0)
    assert c.smallest_at_least(3) == (4, 12.0)
    assert c.smallest_at_least(8) == (8, 20.0)
    assert c.smallest_at_least(9) is None
    assert c.baseline_ms(4) == 12.0
    with pytest.raises(KeyError, match="size"):
        c.baseline_ms(3)
    assert len(LatencyCurve()) == 0
    assert LatencyCurve().smallest_at_least(1) is None
    assert LatencyCurve([(np.int64(3), np.float32(1.5))]).points == ((3, 1.5),)


@pytest.mark.parametrize(
    ("points", "match"),
    [
        ([(0, 1.0)], r"points\[0\]\.size.*0"),
        ([(2.0, 1.0)], r"points\[0\]\.size.*2\.0"),
        ([(True, 1.0)], r"points\[0\]\.size.*True"),
        ([(2, 1.0), (2, 3.0)], r"points\[1\]\.size.*strictly increasing.*2 after 2"),
        ([(4, 1.0), (2, 3.0)], r"points\[1\]\.size.*2 after 4"),
        ([(2, -1.0)], r"points\[0\]\.baseline_ms.*-1\.0"),
        ([(2, math.nan)], r"points\[0\]\.baseline_ms.*nan"),
        ([(2, math.inf)], r"points\[0\]\.baseline_ms.*inf"),
        ([(2, "1")], r"points\[0\]\.baseline_ms.*'1'"),
        ([(2,)], r"points\[0\]: expected a \(size, baseline_ms\) pair"),
    ],
)
def test_curve_validation(points, match):
    with pytest.raises(ValueError, match=match):
        LatencyCurve(points)


# ----------------------------------------------------------------------------------------------------------
# Rates helpers


def test_cumulative_rates():
    assert cumulative_rates([0.5, 0.5, 1.0]) == [0.5, 0.25, 0.25]
    assert cumulative_rates([]) == []
    assert cumulative_rates([1.0, 0.0, 0.9]) == [1.0, 0.0, 0.0]
    assert cumulative_rates(np.array([0.5, 0.75], np.float32)) == [0.5, 0.375]
    with pytest.raises(ValueError, match=r"confidences\[1\].*1\.5"):
        cumulative_rates([0.5, 1.5])
    with pytest.raises(ValueError, match=r"confidences\[0\]"):
        cumulative_rates([math.nan])


def test_budget_rates_and_flags():
    prev, cur = [0.9, 0.5], [0.7]
    assert budget_rates(prev, cur, paired=True) == [0.9, 0.5]  # the N-1 list is `cur`; N-2 is `prev`
    assert budget_rates(prev, cur, paired=False) == [0.7]  # step in flight: `cur` already is N-2
    assert is_paired(3, 3) and not is_paired(2, 3)
    assert draft_available(True, 5, 5)
    assert draft_available(False, 4, 3)  # one step in flight will produce drafts
    assert not draft_available(False, 3, 3)


# ----------------------------------------------------------------------------------------------------------
# The budget search


CURVE3 = LatencyCurve([(2, 10.0), (4, 12.0), (8, 20.0)])


def test_budget_picks_middle_graph():
    # Queue: (0.9, s0), (0.6, s0), (0.5, s1), (0.2, s1). time = baseline(G) + 0.5 * G + 1.0.
    #   bsz 2, expected 2.0: G 2, time 10 + 1 + 1 = 12 -> 0.1667
    #   bsz 3, expected 2.9: G 4, time 12 + 2 + 1 = 15 -> 0.1933
    #   bsz 4, expected 3.5: G 4, time 15             -> 0.2333  <- best
    #   bsz 5, expected 4.0: G 8, time 20 + 4 + 1 = 25 -> 0.1600
    #   bsz 6, expected 4.2: G 8, time 25             -> 0.1680
    # total_q 4: the 2 extra rows go to the queue's first two entries, both of s0.
    rates = [[0.9, 0.6], [0.5, 0.2]]
    assert plan_verify_lengths(rates, rates, [2, 2], [True, True], CURVE3, 0.5, 1.0) == (4, [3, 1])
    # The allocation uses its own list: (0.8, s1), (0.7, s1) lead it.
    alloc = [[0.1, 0.05], [0.8, 0.7]]
    assert plan_verify_lengths(rates, alloc, [2, 2], [True, True], CURVE3, 0.5, 1.0) == (4, [1, 3])


def test_budget_picks_largest_graph_when_flat():
    # Curve (2, 10), (4, 12), (8, 13), no slope or sampler time:
    #   2/10 = 0.200, 2.9/12 = 0.242, 3.5/12 = 0.292, 4.0/13 = 0.308, 4.2/13 = 0.323 <- bsz 6 (all drafts)
    curve = LatencyCurve([(2, 10.0), (4, 12.0), (8, 13.0)])
    rates = [[0.9, 0.6], [0.5, 0.2]]
    assert plan_verify_lengths(rates, rates, [2, 2], [True, True], curve, 0.0, 0.0) == (6, [3, 3])


def test_tie_keeps_smaller_bsz():
    # One request, one draft, empty list with a draft -> rate 1.0. Curve (1, 4), (2, 8):
    #   bsz 1: 1/4 = 0.25; bsz 2: 2/8 = 0.25 -> tie, the smaller bsz stays.
    curve = LatencyCurve([(1, 4.0), (2, 8.0)])
    assert plan_verify_lengths([[]], [[]], [1], [True], curve, 0.0, 0.0) == (1, [1])
    # With 1 ms of sampler time: 1/5 = 0.2 < 2/9 = 0.222 -> verify the draft.
    assert plan_verify_lengths([[]], [[]], [1], [True], curve, 0.0, 1.0) == (2, [2])


def test_empty_lists_without_drafts_pad_zero():
    # No draft info: the padded rate is 0.0, so bsz 2 has expected 1: 1/9 < 1/5.
    curve = LatencyCurve([(1, 4.0), (2, 8.0)])
    assert plan_verify_lengths([[]], [[]], [1], [False], curve, 0.0, 1.0) == (1, [1])
    # A curve whose larger graph is faster makes even a zero-rate entry worth a row: 1/5 < 1/4.
    faster = LatencyCurve([(1, 5.0), (2, 4.0)])
    assert plan_verify_lengths([[]], [[]], [1], [False], faster, 0.0, 0.0) == (2, [2])


def test_equal_rates_go_by_sequence_index():
    # Three requests, one draft of rate 0.5 each; curve (3, 3), (4, 3):
    #   bsz 3: 3/3 = 1.0; bsz 4: 3.5/3 = 1.167 <- best; bsz 5 fits no graph.
    curve = LatencyCurve([(3, 3.0), (4, 3.0)])
    rates = [[0.5], [0.5], [0.5]]
    assert plan_verify_lengths(rates, rates, [1, 1, 1], [True] * 3, curve, 0.0, 0.0) == (4, [2, 1, 1])
    alloc = [[0.5], [0.7], [0.5]]
    assert plan_verify_lengths(rates, alloc, [1, 1, 1], [True] * 3, curve, 0.0, 0.0) == (4, [1, 2, 1])
    assert allocate_verify_lengths(rates, [1, 1, 1], [True] * 3, 5) == [2, 2, 1]
    # Within one request equal rates keep draft order; across requests the lower index goes first.
    assert allocate_verify_lengths([[], [1.0]], [2, 1], [True, True], 4) == [3, 1]


def test_no_sequences_empty_curve_small_curve():
    assert plan_verify_lengths([], [], [], [], CURVE3, 0.0, 0.0) == (0, [])
    assert plan_verify_lengths([], [], [], [], LatencyCurve(), 0.0, 0.0) == (0, [])
    # No curve: fixed lengths, every draft verified (whatever the rates say).
    got = plan_verify_lengths(
        [[], [], [0.1]], [[], [], [0.1]], [2, 0, 3], [True, False, True], LatencyCurve(), 0, 0
    )
    assert got == (8, [3, 1, 4])
    # Largest graph (1) below n_seqs (2): nothing can be evaluated; verify no drafts.
    small = LatencyCurve([(1, 1.0)])
    assert plan_verify_lengths([[0.9], [0.9]], [[0.9], [0.9]], [1, 1], [True, True], small, 0.0, 0.0) == (
        2,
        [1, 1],
    )


def test_rates_truncated_to_num_drafts():
    # nd 1 but two rates: only 0.9 counts. Curve flat at 1 ms: bsz 1 -> 1, bsz 2 -> 1.9; no bsz 3 candidate
    # (it would give 2.7 if the 0.8 were kept).
    curve = LatencyCurve([(1, 1.0), (2, 1.0), (3, 1.0)])
    assert plan_verify_lengths([[0.9, 0.8]], [[0.9, 0.8]], [1], [True], curve, 0.0, 0.0) == (2, [2])
    # A non-empty list shorter than nd is used as is (no padding).
    assert plan_verify_lengths([[0.9]], [[0.9]], [3], [True], curve, 0.0, 0.0) == (2, [2])
    assert allocate_verify_lengths([[0.9]], [3], [True], 4) == [2]


def test_zero_time_counts_as_infinite_throughput():
    curve = LatencyCurve([(1, 0.0), (2, 0.0)])
    assert plan_verify_lengths([[]], [[]], [1], [True], curve, 0.0, 0.0) == (1, [1])


def test_plan_validation():
    ok = ([[0.5]], [[0.5]], [1], [True], CURVE3, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"rates_budget\[0\]: rates must be non-increasing.*0\.6"):
        plan_verify_lengths([[0.5, 0.6]], [[0.5]], [2], [True], CURVE3, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"rates_alloc\[0\]\[0\].*1\.2"):
        plan_verify_lengths([[0.5]], [[1.2]], [1], [True], CURVE3, 0.0, 0.0)
    with pytest.raises(ValueError, match="rates_alloc: expected 1 entries"):
        plan_verify_lengths(ok[0], [], *ok[2:])
    with pytest.raises(ValueError, match=r"num_drafts\[0\].*-1"):
        plan_verify_lengths(ok[0], ok[1], [-1], *ok[3:])
    with pytest.raises(ValueError, match=r"slope_ms.*-1"):
        plan_verify_lengths(*ok[:5], -1.0, 0.0)
    with pytest.raises(ValueError, match=r"sampler_ms.*nan"):
        plan_verify_lengths(*ok[:6], math.nan)
    with pytest.raises(TypeError, match="curve"):
        plan_verify_lengths(*ok[:4], [(1, 1.0)], 0.0, 0.0)


# ----------------------------------------------------------------------------------------------------------
# Estimators


def test_slope_threshold_median_and_clamp():
    est = SlopeEstimator()
    assert est.slope_ms() == 0.0
    for _ in range(9):
        est.record(4, forward_ms=18.0, baseline_ms=10.0)  # residual (18 - 10) / 4 = 2
    assert est.slope_ms() == 0.0  # 9 < 10 samples
    est.record(4, 18.0, 10.0)
    assert est.slope_ms() == 2.0
    for _ in range(10):
        est.record_on(LatencyCurve([(2, 5.0)]), 2, 5.0 + 2 * 6.0)  # residual 6
    assert est.slope_ms() == 4.0  # median of per-size medians {2, 6}

    neg = SlopeEstimator()
    for _ in range(10):
        neg.record(8, 4.0, 12.0)  # residual -1
    assert neg.slope_ms() == 0.0
    with pytest.raises(ValueError, match="graph_size"):
        neg.record(0, 1.0, 1.0)


def test_slope_window_evicts_oldest():
    est = SlopeEstimator()
    for _ in range(10):
        est.record(2, 3.0, 1.0)  # residual 1
    for _ in range(4990):
        est.record(8, 25.0, 1.0)  # residual 3
    assert len(est) == 5000 and est.slope_ms() == 2.0  # median of {1, 3}
    est.record(8, 25.0, 1.0)  # evicts one size-2 sample: 9 left, below the threshold
    assert len(est) == 5000 and est.slope_ms() == 3.0

    small = SlopeEstimator(window=3, min_samples=2)
    for r in (10.0, 1.0, 2.0, 3.0):
        small.record(1, r, 0.0)
    assert small.slope_ms() == 2.0  # window holds 1, 2, 3


def test_sampler_time_estimator():
    est = SamplerTimeEstimator()
    assert est.estimate_ms(2) == 0.0
    for ms in (1.0, 2.0, 3.0, 4.0):
        est.record(2, ms)
    assert est.estimate_ms(2) == 0.0  # 4 own samples and 4 overall: both below 5
    est.record(3, 10.0)
    assert est.estimate_ms(2) == 3.0  # global median of 1, 2, 3, 4, 10
    assert est.estimate_ms(7) == 3.0  # never seen: global
    est.record(2, 5.0)
    assert est.estimate_ms(2) == 3.0  # own median of 1..5
    for ms in range(12):
        est.record(1, float(ms))
    assert est.estimate_ms(1) == 7.0  # last 9: 3..11
    assert est.estimate_ms(2) == 3.0
    assert est.estimate_ms(3) == 7.0  # 1 own sample: global last 9 are 3..11


# ----------------------------------------------------------------------------------------------------------
# Measuring and caching


def test_measure_curve_fake_timer():
    clock = [0.0]
    durations = {
        1: [100.0, 0.001, 0.005, 0.002, 0.003, 0.010],  # warm-up, then 5 timed (s)
        2: [100.0, 0.004, 0.004, 0.020, 0.001, 0.004],
    }
    calls = []

    def run_step(size):
        calls.append(size)
        clock[0] += durations[size].pop(0)

    curve = measure_curve(run_step, [1, 2], timer=lambda: clock[0])
    assert calls == [1] * 6 + [2] * 6
    assert curve.sizes == (1, 2)
    assert curve.points[0][1] == pytest.approx((5 + 2 + 3) / 3)  # drop 1 and 10
    assert curve.points[1][1] == pytest.approx(4.0)  # drop 1 and 20

    clock[0] = 0.0
    durations[3] = [0.002, 0.004]
    assert measure_curve(run_step, [3], warmup=0, repeats=2, timer=lambda: clock[0]).points[0][1] == (
        pytest.approx(3.0)
    )
    calls.clear()
    with pytest.raises(ValueError, match="size"):
        measure_curve(run_step, [2, 1])
    assert calls == []


def test_cache_key():
    k = curve_cache_key("m", [1, 2, 4], (1, 1, 8))
    assert len(k) == 64 and int(k, 16) >= 0
    assert k == curve_cache_key("m", (1, 2, 4), (1, 1, 8))
    assert k != curve_cache_key("m2", [1, 2, 4], (1, 1, 8))
    assert k != curve_cache_key("m", [1, 2, 8], (1, 1, 8))
    assert k != curve_cache_key("m", [1, 2, 4], (1, 2, 4))


def test_cache_round_trip_and_newest(tmp_path):
    key = curve_cache_key("m", [2, 4], (1, 1, 1))
    a, b = LatencyCurve([(2, 1.0), (4, 2.5)]), LatencyCurve([(2, 1.5), (4, 3.0)])
    path = save_curve(tmp_path / "cache", key, a, now=1000)
    name = os.path.basename(path)
    head, hexpart, stamp = name.split(".")
    assert head == key and len(hexpart) == 32 and stamp == "1000"
    assert os.listdir(tmp_path / "cache") == [name]  # no temp file left behind
    assert load_curve(tmp_path / "cache", key, ttl_s=3600, now=1500) == a
    save_curve(tmp_path / "cache", key, b, now=2000)
    assert load_curve(tmp_path / "cache", key, ttl_s=3600, now=2500) == b
    assert load_curve(tmp_path / "cache", "0" * 64, ttl_s=3600, now=2500) is None
    assert load_curve(tmp_path / "missing", key, ttl_s=3600, now=2500) is None


def test_cache_ttl_and_deletion(tmp_path):
    key = curve_cache_key("m", [2], (1,))
    other = curve_cache_key("other", [2], (1,))
    curve = LatencyCurve([(2, 1.0)])
    path = save_curve(tmp_path, key, curve, now=1000)
    other_path = save_curve(tmp_path, other, curve, now=1000)
    assert load_curve(tmp_path, key, ttl_s=3600, now=1000 + 3599) == curve
    assert load_curve(tmp_path, key, ttl_s=3600, now=1000 + 3600) is None  # not younger than the TTL
    assert os.path.exists(path)
    assert load_curve(tmp_path, key, ttl_s=3600, now=1000 + 3600 + CACHE_GRACE_S) is None
    assert os.path.exists(path)  # exactly TTL + 2 h: still kept
    assert load_curve(tmp_path, key, ttl_s=3600, now=1000 + 3600 + 7201) is None
    assert not os.path.exists(path)
    assert os.path.exists(other_path)  # another key's files are left alone


def test_cache_corrupt_files_ignored(tmp_path):
    key = curve_cache_key("m", [2], (1,))
    good = LatencyCurve([(2, 1.0)])
    save_curve(tmp_path, key, good, now=1000)
    (tmp_path / f"{key}.{'a' * 32}.2000").write_text("{not json")
    (tmp_path / f"{key}.{'b' * 32}.2001").write_text(
        json.dumps({"key": key, "unit": "ms", "points": [[2, -1]]})
    )
    (tmp_path / f"{key}.{'c' * 32}.2002").write_text(
        json.dumps({"key": "x", "unit": "ms", "points": [[2, 1]]})
    )
    (tmp_path / f"{key}.{'d' * 32}.2003").write_text(json.dumps([1, 2]))
    (tmp_path / f"{key}.{'e' * 32}.2004").write_bytes(b"\xff\xfe")
    assert load_curve(tmp_path, key, ttl_s=3600, now=2100) == good
    with pytest.raises(ValueError, match="key"):
        load_curve(tmp_path, "../x", ttl_s=3600)


# ----------------------------------------------------------------------------------------------------------
# Device re-allocation


def _reference(conf, nd, total_q, num_seqs):
    """Pure-Python §8.6.2: cumulative products, rank by (value desc, flat index asc), count per row."""
    s_rows, k_drafts = conf.shape
    entries = []
    for s in range(min(num_seqs, s_rows)):
        acc = 1.0
        for k in range(min(int(nd[s]), k_drafts)):
            acc *= float(conf[s, k])
            entries.append((-acc, s * k_drafts + k, s))
    entries.sort()
    out = [1 if s < num_seqs else 0 for s in range(s_rows)]
    for _, _, s in entries[: max(0, total_q - num_seqs)]:
        out[s] += 1
    return out


def test_reallocate_hand_case():
    conf = np.array([[0.9, 0.5], [0.8, 0.9], [0.7, 0.7], [0.3, 0.3]], np.float32)
    nd = np.array([2, 2, 1, 2], np.int32)  # row 3 is padding (num_seqs 3); row 2 has one draft
    # Entries by value: 0.9 (0,0), 0.8 (1,0), 0.72 (1,1), 0.7 (2,0), 0.45 (0,1).
    expected = {
        3: [1, 1, 1, 0],
        5: [2, 2, 1, 0],
        6: [2, 3, 1, 0],
        7: [2, 3, 2, 0],
        8: [3, 3, 2, 0],
        20: [3, 3, 2, 0],
    }
    for total_q, want in expected.items():
        got = _reallocate(conf, nd, np.int32(total_q), np.int32(3))
        assert got.dtype == np.int32 and got.tolist() == want, total_q
    # Zeros tie by flat index, and a row with no drafts never gets one.
    z = np.zeros((3, 2), np.float32)
    assert _reallocate(z, np.array([2, 0, 2], np.int32), 5, 3).tolist() == [3, 1, 1]
    assert reallocate(np.zeros((2, 0), np.float32), np.zeros(2, np.int32), 4, 1).tolist() == [1, 0]


_S, _K = 5, 3
_grid = st.integers(0, 16).map(lambda i: i / 16)  # exact in float32 and float64, with many ties


@st.composite
def _cases(draw):
    conf = np.array(draw(st.lists(_grid, min_size=_S * _K, max_size=_S * _K)), np.float32).reshape(_S, _K)
    nd = np.array(draw(st.lists(st.integers(0, _K), min_size=_S, max_size=_S)), np.int32)
    num_seqs = draw(st.integers(0, _S))
    total_q = draw(st.integers(0, _S * (_K + 1) + 2))
    return conf, nd, total_q, num_seqs


@settings(max_examples=40, deadline=None)
@given(_cases())
def test_reallocate_matches_reference(case):
    conf, nd, total_q, num_seqs = case
    got = _reallocate(conf, nd, np.int32(total_q), np.int32(num_seqs)).tolist()
    assert got == _reference(conf, nd, total_q, num_seqs)


@settings(max_examples=40, deadline=None)
@given(_cases(), st.lists(_grid, min_size=_S * _K, max_size=_S * _K))
def test_reallocate_agrees_with_host(case, budget_conf):
    conf, nd, total_q, n = case
    budget = np.array(budget_conf, np.float32).reshape(_S, _K)
    alloc = [cumulative_rates(conf[s, : nd[s]]) for s in range(n)]
    rates_budget = [cumulative_rates(budget[s, : nd[s]]) for s in range(n)]
    nds, flags = nd[:n].tolist(), [True] * n
    tq, seqlen = plan_verify_lengths(rates_budget, alloc, nds, flags, CURVE3, 0.25, 0.5)
    dev = _reallocate(conf, nd, np.int32(tq), np.int32(n)).tolist()
    assert dev[:n] == seqlen and dev[n:] == [0] * (_S - n)
    dev = _reallocate(conf, nd, np.int32(total_q), np.int32(n)).tolist()
    assert dev[:n] == allocate_verify_lengths(alloc, nds, flags, total_q)


# ------------------------------------------------------------------ device re-split and re-pack (§8.6.2)


class _Req:
    """A scheduled request as build_plan reads it: ``tokens`` known so far, ``prompt`` of them the prompt."""

    def __init__(self, slot: int, tokens: list[int], prompt: int) -> None:
        self.request_id, self.slot, self.block_ids = f"r{slot}", slot, [slot, slot + 8]
        self._tokens = np.asarray(tokens, np.int32)
        self.prompt_token_ids, self.prompt_len = self._tokens[:prompt], prompt
        from deepinfer_jax.engine.params import SamplingParams

        self.params, self.seed = SamplingParams(temperature=0.0), slot

    def tokens(self, start: int, stop: int) -> np.ndarray:
        return self._tokens[start:stop]


def _spec_plan(rows, drafts: list[int]):
    """One device's plan of ``rows`` (``(request, start, known tokens, decode)``), decode rows with ``drafts``."""
    from deepinfer_jax.engine.plan import DeviceBatch, ScheduledRow, build_plan

    it = iter(drafts)
    batch = []
    for req, start, known, decode in rows:
        nd = next(it) if decode else 0
        batch.append(
            ScheduledRow(req, start, known + nd, True, decode, decode, num_drafts=nd, shifted=decode)
        )
    return build_plan(
        [DeviceBatch(tuple(batch))],
        buckets=[(32, 8)],
        max_blocks_per_seq=2,
        vocab_size=64,
        num_draft_tokens=3,
        device_resplit=True,
    )


def test_repack_rows_equals_the_plan_of_the_new_split():
    """Re-packing a step for new verify lengths gives exactly the arrays the host builds for those lengths:
    known tokens keep their ids and positions, draft slots follow, later rows (a prefill chunk between two
    decode rows) move, padding stays padding."""
    from deepinfer_jax.engine.spec_device import repack_rows
    from deepinfer_jax.engine.spec_step import DRAFT_TOKEN

    rows = [
        (_Req(1, list(range(10, 20)), 6), 9, 1, True),  # decode: token 9 pending, drafts after
        (_Req(2, list(range(30, 42)), 12), 4, 5, False),  # a prefill chunk of 5 prompt tokens
        (_Req(3, list(range(50, 58)), 3), 7, 1, True),
        (_Req(4, list(range(60, 64)), 2), 3, 1, True),
    ]
    old, new = [2, 0, 3], [0, 3, 2]
    a, b = _spec_plan(rows, old), _spec_plan(rows, new)
    ia, ib = a.inputs, b.inputs
    nd_old = np.asarray(ia.spec.num_drafts[0])
    nd_new = nd_old.copy()
    nd_new[[0, 2, 3]] = new
    rp = repack_rows(
        ia.token_ids[0],
        ia.positions[0],
        ia.token_seq[0],
        ia.query_start[0],
        ia.context_lens[0],
        nd_old,
        nd_new,
        draft_token=DRAFT_TOKEN,
    )
    np.testing.assert_array_equal(rp.token_ids, ib.token_ids[0])
    np.testing.assert_array_equal(rp.positions, ib.positions[0])
    np.testing.assert_array_equal(rp.token_seq, ib.token_seq[0])
    np.testing.assert_array_equal(rp.query_start, ib.query_start[0])
    np.testing.assert_array_equal(rp.context_lens, ib.context_lens[0])
    np.testing.assert_array_equal(np.asarray(ib.spec.num_drafts[0]), nd_new)
    assert np.asarray(ia.spec.realloc[0]).tolist() == [False] * 8  # rows the planner did not split


def test_resplit_keeps_the_total_and_follows_fresh_confidences():
    """Hand case: eligible rows 0, 1 and 3 hold 1 + 2 + 0 = 3 planned drafts; the fresh cumulative confidences
    rank row 3's first two drafts (0.9, 0.81) and row 1's first (0.8) highest, so the split becomes 0 / 1 / - / 2;
    row 2 (not eligible) keeps its 3 drafts."""
    from deepinfer_jax.engine.spec_device import resplit

    conf = np.array(
        [[0.5, 0.5, 0.5], [0.8, 0.1, 0.9], [1.0, 1.0, 1.0], [0.9, 0.9, 0.1]], np.float32
    )  # row 3 cumulative: 0.9, 0.81, 0.081
    planned = np.array([1, 2, 3, 0], np.int32)
    eligible = np.array([True, True, False, True])
    got = np.asarray(resplit(conf, planned, eligible, 3))
    assert got.tolist() == [0, 1, 3, 2]
    assert got[eligible].sum() == planned[eligible].sum()
