"""The logit pipeline stage by stage and end to end, against the float64 numpy reference in ``_sampling_ref``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _sampling_ref import (
    Row,
    draw,
    final_probs,
    kept_ids,
    log_softmax,
    mask,
    penalise,
    rank_and_top,
    softmax,
)
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from deepinfer_jax import sampling
from deepinfer_jax.engine.params import SamplingParams
from deepinfer_jax.sampling import PROMPT_FLAG, SamplingTensors

V = 40
_penalties = jax.jit(sampling.apply_penalties)
_masks = jax.jit(sampling.apply_masks)
_filter = jax.jit(sampling.filter_logits)
_sample = jax.jit(
    sampling.sample,
    static_argnames=(
        "num_logprobs",
        "batch_invariant",
        "backend",
        "logprobs_mode",
        "force_top_k",
        "sum_smaller",
    ),
)
_bits = jax.jit(sampling.random_bits)


def _encode_counts(prompt, output, vocab=V):
    """The documented count encoding, built directly: generated count | PROMPT_FLAG for prompt ids."""
    counts = np.bincount(np.asarray(output, np.int64), minlength=vocab).astype(np.int32)
    counts[np.asarray(prompt, np.int64)] |= PROMPT_FLAG
    return counts


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rep=st.floats(0.1, 3.0),
    presence=st.floats(-2.0, 2.0),
    frequency=st.floats(-2.0, 2.0),
)
def test_penalties_match_numpy(seed, rep, presence, frequency):
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=V) * 3).astype(np.float32)
    prompt = rng.integers(0, V, size=rng.integers(0, 12))
    output = rng.integers(0, V, size=rng.integers(0, 12))
    got = _penalties(
        logits, _encode_counts(prompt, output), np.float32(rep), np.float32(presence), np.float32(frequency)
    )
    want = penalise(logits, prompt, output, np.float32(rep), np.float32(presence), np.float32(frequency))
    # float32: one division or product (0.5 ulp) and two subtractions of terms up to 2 * 12 on values below ~40:
    # a few ulps of 40, i.e. under 2e-5.
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=2e-5)


def test_neutral_penalties_are_exact_identities():
    rng = np.random.default_rng(0)
    logits = (rng.normal(size=V) * 5).astype(np.float32)
    counts = _encode_counts(rng.integers(0, V, 20), rng.integers(0, V, 20))
    got = _penalties(logits, counts, np.float32(1.0), np.float32(0.0), np.float32(0.0))
    assert np.array_equal(np.asarray(got).view(np.uint32), logits.view(np.uint32))


def test_masks_set_exactly_the_listed_ids_to_minus_inf():
    logits = np.arange(V, dtype=np.float32)
    got = np.asarray(_masks(logits, np.array([3, 0, V - 1, -1, -1], np.int32)))
    np.testing.assert_array_equal(got, mask(logits, [0, 3, V - 1]))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    temperature=st.floats(0.3, 3.0),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 0.6)),
    top_k=st.integers(-1, V + 2),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
)
def test_filter_keeps_the_reference_set(seed, temperature, min_p, top_k, top_p):
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=V) * 2).astype(np.float32)
    keep, margin = kept_ids(logits, np.float32(temperature), np.float32(min_p), top_k, np.float32(top_p))
    # float32 and float64 may decide a token lying right at a threshold differently; such cases prove nothing.
    assume(margin > 1e-4)
    row = SamplingTensors.build([Row(temperature, top_p, top_k, min_p)], [0], [0], V)
    got = np.asarray(_filter(logits, row.temperature[0], row.min_p[0], row.top_k[0], row.top_p[0]))
    assert set(np.flatnonzero(np.isfinite(got)).tolist()) == keep
    kept = sorted(keep)
    want = (logits[kept].astype(np.float64) - logits.max()) / np.float32(temperature)
    # One subtraction and one division in float32 on values below ~30: relative 2 ulps.
    np.testing.assert_allclose(got[kept], want, rtol=3e-7, atol=1e-6)


def test_filter_ties_are_broken_by_ascending_id():
    logits = np.array([1.0, 2.0, 2.0, 2.0, 0.5], np.float32)
    got = np.asarray(_filter(logits, np.float32(1.0), np.float32(0.0), np.int32(2), np.float32(1.0)))
    assert np.flatnonzero(np.isfinite(got)).tolist() == [1, 2]
    # top-p: the three tied ids carry ~0.86 of the mass; top_p = 0.3 keeps ids until the mass before one exceeds it.
    got = np.asarray(_filter(logits, np.float32(1.0), np.float32(0.0), np.int32(5), np.float32(0.3)))
    assert np.flatnonzero(np.isfinite(got)).tolist() == [1, 2]


def test_top_p_boundary_is_inclusive():
    # Four equal logits: probabilities are exactly 0.25 and the masses before each id exactly 0, .25, .5, .75.
    # An id is kept when the mass before it is <= top_p, so top_p = 0.5 keeps three ids (the minimal prefix whose
    # mass exceeds 0.5), and top_p = 0.25 keeps two.
    logits = np.zeros(4, np.float32)
    for top_p, kept in ((0.5, [0, 1, 2]), (0.25, [0, 1]), (0.2, [0])):
        got = np.asarray(_filter(logits, np.float32(1.0), np.float32(0.0), np.int32(4), np.float32(top_p)))
        assert np.flatnonzero(np.isfinite(got)).tolist() == kept
    # min_p is inclusive too: p >= min_p * p_max keeps the ids at exactly the threshold.
    logits = np.array([0.0, 0.0, -1.0], np.float32)
    got = np.asarray(_filter(logits, np.float32(1.0), np.float32(1.0), np.int32(3), np.float32(1.0)))
    assert np.flatnonzero(np.isfinite(got)).tolist() == [0, 1]


_CASES = [
    Row(),
    Row(temperature=0.0),
    Row(temperature=0.7, top_k=5),
    Row(temperature=1.3, top_p=0.6),
    Row(temperature=0.9, min_p=0.2),
    Row(temperature=1.0, top_k=7, top_p=0.8, min_p=0.05),
    Row(temperature=0.0, repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.3),
    Row(temperature=1.1, repetition_penalty=0.6, presence_penalty=-1.0, frequency_penalty=1.5, top_k=10),
    Row(temperature=0.8, min_tokens=3, stop_token_ids=(4, 9)),
    Row(temperature=0.0, min_tokens=3, stop_token_ids=(4,)),
    Row(temperature=0.5, min_tokens=3, ignore_eos=True),
    Row(temperature=2.0, top_p=0.95),
]
EOS = (7,)


def _expected_reported(mode, raw, x, case, keep):
    """The reported values of one row under ``logprobs_mode`` (numpy, float64), from the raw logits ``raw``, the
    penalised and masked ``x`` and (sampled rows) the kept ids."""
    if mode == "raw_logprobs":
        return log_softmax(raw)
    if mode == "raw_logits":
        return np.asarray(raw, np.float64)
    if case.temperature == 0:
        processed = np.asarray(x, np.float64)
    else:
        scaled = (np.asarray(x, np.float64) - np.max(x)) / case.temperature
        processed = np.where(np.isin(np.arange(x.size), sorted(keep)), scaled, -np.inf)
    if mode == "processed_logits":
        return processed
    return np.maximum(log_softmax(processed), -9999.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("mode", sampling.LOGPROBS_MODES)
def test_sample_matches_numpy_end_to_end(seed, batch_invariant, mode):
    rng = np.random.default_rng(seed)
    n = len(_CASES)
    logits = (rng.normal(size=(n, V)) * 2).astype(np.float32)
    # Make EOS and the stop ids likely, so that masking them visibly changes the outcome.
    logits[:, 7] += 3.0
    logits[:, 4] += 3.0
    prompts = [rng.integers(0, V, size=6) for _ in range(n)]
    outputs = [rng.integers(0, V, size=2) for _ in range(n)]
    seeds = [int(s) for s in rng.integers(0, 2**63, size=n)]
    positions = rng.integers(0, 10_000, size=n)
    st_ = SamplingTensors.build(
        _CASES, seeds, positions, V, output_lens=[2] * n, eos_token_ids=EOS, num_rows=n + 3
    )
    counts = np.stack([_encode_counts(p, o) for p, o in zip(prompts, outputs)] + [np.zeros(V, np.int32)] * 3)
    padded = np.concatenate([logits, rng.normal(size=(3, V)).astype(np.float32)])
    out = _sample(padded, st_, counts, num_logprobs=5, batch_invariant=batch_invariant, logprobs_mode=mode)
    assert np.asarray(out.ok).all()
    bits = np.asarray(_bits(st_.seed, st_.position))

    for i, case in enumerate(_CASES):
        f32 = np.float32
        x = penalise(
            logits[i],
            prompts[i],
            outputs[i],
            f32(case.repetition_penalty),
            f32(case.presence_penalty),
            f32(case.frequency_penalty),
        )
        if case.min_tokens > 2:
            x = mask(x, set(case.stop_token_ids) | (set() if case.ignore_eos else set(EOS)))
        keep: set[int] = set()
        if case.temperature == 0:
            token = int(np.argmax(x))
        else:
            keep, margin = kept_ids(x, f32(case.temperature), f32(case.min_p), case.top_k, f32(case.top_p))
            assert margin > 1e-4, "a near-threshold case; pick another seed"
            token = draw(final_probs(x, f32(case.temperature), keep), bits[i])
            assert token in keep
        assert int(out.tokens[i]) == token, f"row {i} ({case})"
        reported = _expected_reported(mode, logits[i], x, case, keep)
        # log_softmax in float32 of values below ~20: a few ulps of 20.
        np.testing.assert_allclose(float(out.logprob[i]), reported[token], atol=2e-5)
        rank, top = rank_and_top(reported, token, 5)
        assert int(out.rank[i]) == rank
        np.testing.assert_array_equal(np.asarray(out.top_ids[i]), top)
        np.testing.assert_allclose(np.asarray(out.top_logprobs[i]), reported[top], atol=2e-5)
    # Padding rows are greedy: the argmax of their (unpenalised, unmasked) logits.
    np.testing.assert_array_equal(np.asarray(out.tokens[n:]), np.argmax(padded[n:], axis=1))


def test_greedy_is_lowest_id_argmax_and_uses_no_random_numbers():
    logits = np.array([[0.0, 3.0, 1.0, 3.0, 3.0]] * 4, np.float32)
    rows = [Row(temperature=0.0)] * 4
    outs = [
        _sample(logits, SamplingTensors.build(rows, seeds, positions, 5), num_logprobs=3)
        for seeds, positions in (([0, 1, 2, 3], [0, 0, 0, 0]), ([2**64 - 1, 5, 9, 2**40], [7, 99, 3, 12345]))
    ]
    for out in outs:
        np.testing.assert_array_equal(np.asarray(out.tokens), [1, 1, 1, 1])
        np.testing.assert_array_equal(np.asarray(out.rank), [1, 1, 1, 1])
        np.testing.assert_array_equal(np.asarray(out.top_ids), [[1, 3, 4]] * 4)
        np.testing.assert_allclose(np.asarray(out.logprob), log_softmax(logits[0])[1], rtol=1e-6)


def test_rank_counts_ties_by_ascending_id():
    # With top_k = 3 the kept set is {1, 3, 4} (tied logits, lowest ids first); every kept id shares rank order.
    logits = np.array([[0.0, 3.0, 1.0, 3.0, 3.0]], np.float32)
    seen = set()
    for position in range(64):
        st_ = SamplingTensors.build([Row(top_k=3)], [11], [position], 5)
        out = _sample(logits, st_, num_logprobs=0)
        token = int(out.tokens[0])
        seen.add(token)
        assert int(out.rank[0]) == {1: 1, 3: 2, 4: 3}[token]
    assert seen == {1, 3, 4}


def test_tiny_temperature_stays_finite_and_picks_the_argmax():
    rng = np.random.default_rng(3)
    logits = (rng.normal(size=(2, V)) * 50).astype(np.float32)
    st_ = SamplingTensors.build([Row(temperature=1e-30), Row(temperature=1e30)], [1, 2], [5, 6], V)
    out = _sample(logits, st_)
    assert np.asarray(out.ok).all()
    assert int(out.tokens[0]) == int(np.argmax(logits[0]))
    assert 0 <= int(out.tokens[1]) < V


def test_unusable_rows_are_flagged_and_do_not_disturb_the_others():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(5, V)).astype(np.float32)
    logits[1, 3] = np.nan
    logits[2, 5] = np.inf
    logits[3, :] = -np.inf
    rows = [Row(temperature=0.0)] * 4 + [Row(temperature=0.0, min_tokens=1, stop_token_ids=tuple(range(V)))]
    st_ = SamplingTensors.build(rows, [0] * 5, [0] * 5, V, mask_width=64)
    out = _sample(logits, st_, num_logprobs=2)
    np.testing.assert_array_equal(np.asarray(out.ok), [True, False, False, False, False])
    np.testing.assert_array_equal(np.asarray(out.tokens), [int(np.argmax(logits[0])), 0, 0, 0, 0])


def test_changing_parameter_values_never_recompiles():
    fn = jax.jit(sampling.sample, static_argnames=("num_logprobs", "batch_invariant", "backend"))
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(4, V)).astype(np.float32)
    counts = np.zeros((4, V), np.int32)
    sizes = []
    for case in ([Row()] * 4, _CASES[:4], _CASES[4:8], [Row(temperature=0.0)] * 4):
        st_ = jax.device_put(SamplingTensors.build(case, [1, 2, 3, 4], [9, 8, 7, 6], V, mask_width=2))
        fn(logits, st_, counts, num_logprobs=2)
        # jit wrappers of one function share their executable cache, so count growth rather than entries.
        sizes.append(fn._cache_size())
    assert sizes[1:] == sizes[:1] * 3


def test_token_logprobs_match_numpy():
    rng = np.random.default_rng(6)
    logits = (rng.normal(size=(6, V)) * 2).astype(np.float32)
    tokens = rng.integers(0, V, size=6).astype(np.int32)
    for invariant in (False, True):
        out = jax.jit(sampling.token_logprobs, static_argnames=("num_logprobs", "batch_invariant"))(
            logits, tokens, num_logprobs=4, batch_invariant=invariant
        )
        for i in range(6):
            lp = log_softmax(logits[i])
            rank, top = rank_and_top(lp, tokens[i], 4)
            # float32 log_softmax of values below ~10: a few ulps of 10.
            np.testing.assert_allclose(float(out.logprob[i]), lp[tokens[i]], atol=1e-5)
            assert int(out.rank[i]) == rank
            np.testing.assert_array_equal(np.asarray(out.top_ids[i]), top)
            np.testing.assert_allclose(np.asarray(out.top_logprobs[i]), lp[top], atol=1e-5)


def test_bad_arguments_are_refused():
    logits = np.zeros((2, V), np.float32)
    st_ = SamplingTensors.build([Row(), Row()], [0, 0], [0, 0], V)
    with pytest.raises(TypeError, match="logits must be an array, got list"):
        sampling.sample([[0.0] * V] * 2, st_)
    with pytest.raises(TypeError, match="logits must be float32"):
        sampling.sample(logits.astype(np.float16), st_)
    with pytest.raises(ValueError, match="st has 2 rows, logits has 3"):
        sampling.sample(np.zeros((3, V), np.float32), st_)
    with pytest.raises(TypeError, match="token_counts must be int32"):
        sampling.sample(logits, st_, np.zeros((2, V), np.float32))
    with pytest.raises(ValueError, match=r"num_logprobs = 21 must be in \[0, 20\]"):
        sampling.sample(logits, st_, num_logprobs=21)
    with pytest.raises(TypeError, match="batch_invariant must be a bool"):
        sampling.sample(logits, st_, batch_invariant=1)
    with pytest.raises(TypeError, match="st must be a SamplingTensors"):
        sampling.sample(logits, {"temperature": jnp.zeros(2)})
    with pytest.raises(ValueError, match="token_ids must have shape"):
        sampling.token_logprobs(logits, np.zeros(3, np.int32))


def test_sample_is_a_registered_op_with_its_reference():
    from deepinfer_jax import ops

    assert "sample" in ops.list_ops()
    assert ops.select("sample", backend="reference").backend == "reference"
    rng = np.random.default_rng(9)
    logits = rng.normal(size=(3, V)).astype(np.float32)
    st_ = SamplingTensors.build([Row(), Row(top_k=4), Row(temperature=0.0)], [1, 2, 3], [4, 5, 6], V)
    a = _sample(logits, st_, num_logprobs=2)
    b = _sample(logits, st_, num_logprobs=2, backend="reference")
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_golden_tokens_force_teacher_tokens_and_report_their_logprobs():
    """``golden``: the row emits the given token (whatever was drawn or is the argmax) and reports its
    log-probability and rank; a row without one samples normally."""
    rng = np.random.default_rng(3)
    logits = (rng.normal(size=(3, V)) * 2).astype(np.float32)
    golden = SamplingParams(temperature=0.7, golden_token_ids=[5, 9])
    rows = [golden, golden, SamplingParams(temperature=0.0)]
    st_ = SamplingTensors.build(rows, [1, 1, 1], [3, 4, 3], V, output_lens=[0, 1, 0])
    np.testing.assert_array_equal(st_.golden, [5, 9, -1])
    out = _sample(logits, st_, num_logprobs=2)
    np.testing.assert_array_equal(np.asarray(out.tokens), [5, 9, int(np.argmax(logits[2]))])
    lp = log_softmax(logits[1])
    np.testing.assert_allclose(float(out.logprob[1]), lp[9], atol=2e-5)
    assert int(out.rank[1]) == rank_and_top(lp, 9, 2)[0]
    beyond = SamplingTensors.build([golden], [1], [5], V, output_lens=[2])  # the list is used up: sample
    assert int(beyond.golden[0]) == -1


def test_force_top_k_restricts_every_row_to_its_top_k():
    """``force_top_k = 3``: ids outside each row's top 3 (ties by ascending id) are never drawn, whatever the
    temperature; the processed logprobs are a distribution over those 3."""
    logits = np.array([[0.0, 3.0, 1.0, 3.0, 3.0, 2.5, 0.5, -1.0]] * 64, np.float32)
    rows = [Row(temperature=5.0)] * 64
    st_ = SamplingTensors.build(rows, list(range(64)), list(range(64)), 8)
    out = _sample(logits, st_, num_logprobs=4, force_top_k=3, logprobs_mode="processed_logprobs")
    assert set(np.asarray(out.tokens).tolist()) == {1, 3, 4}
    kept = np.exp(np.asarray(out.top_logprobs[0][:3], np.float64))
    np.testing.assert_allclose(kept.sum(), 1.0, rtol=1e-5)
    assert float(out.top_logprobs[0][3]) == -9999.0  # outside the top-k space: the floor
    free = _sample(logits, st_, num_logprobs=0)
    assert set(np.asarray(free.tokens).tolist()) - {1, 3, 4}  # without it other ids are drawn


def test_sum_smaller_probs_is_the_inclusive_ascending_cdf():
    rng = np.random.default_rng(8)
    logits = rng.normal(size=(2, V)).astype(np.float32)
    logits[0, 3] = logits[0, 4]  # a tie: the lower id comes first in ascending order
    rows = [Row(temperature=0.0), Row(temperature=0.9, top_k=6)]
    st_ = SamplingTensors.build(rows, [2, 3], [1, 2], V)
    out = _sample(logits, st_, num_logprobs=3, sum_smaller=True)
    for i, row in enumerate(rows):
        x = np.asarray(logits[i], np.float64)
        if row.temperature == 0:
            probs = softmax(x)
        else:
            keep, _ = kept_ids(logits[i], np.float32(row.temperature), 0.0, row.top_k, 1.0)
            probs = final_probs(logits[i], np.float32(row.temperature), keep)
        ids = np.arange(V)
        for token, got in zip(
            [int(out.tokens[i]), *np.asarray(out.top_ids[i]).tolist()],
            [float(out.sum_smaller[i]), *np.asarray(out.top_sum_smaller[i]).tolist()],
        ):
            before = (probs < probs[token]) | ((probs == probs[token]) & (ids <= token))
            np.testing.assert_allclose(got, probs[before].sum(), atol=1e-5)
    off = _sample(logits, st_, num_logprobs=3)
    assert not np.asarray(off.sum_smaller).any()


def test_first_n_token_no_eos_masks_eos_for_the_first_outputs():
    p = SamplingParams(temperature=0.0, first_n_token_no_eos=2)
    st_ = SamplingTensors.build([p, p, p], [0, 0, 0], [5, 6, 7], V, output_lens=[0, 1, 2], eos_token_ids=[7])
    assert [7 in row for row in st_.masked_ids.tolist()] == [True, True, False]
