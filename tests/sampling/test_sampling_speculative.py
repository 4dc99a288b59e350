"""Speculative decoding's drafting and acceptance rule (``deepinfer_jax.sampling.speculative``).

Hand-computed cases on a five-token vocabulary, a chi-square test that the emitted tokens follow the target
distribution (and that it catches a broken residual), bitwise batch invariance, and the draft sampler.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from _sampling_ref import Row, draw, final_probs, kept_ids, log_softmax, softmax

from deepinfer_jax.sampling import PROMPT_FLAG, SamplingTensors, random_bits, sample, split_seed
from deepinfer_jax.sampling import speculative as spec

V = 5
S, R = 8, 3  # the hand cases' shape: one compiled verify serves them all
_STATIC = ("num_logprobs", "logprobs_mode", "force_top_k", "batch_invariant")
_verify = jax.jit(spec.verify, static_argnames=_STATIC)
_draft = jax.jit(spec.draft_sample, static_argnames=("force_top_k", "batch_invariant"))
_sample = jax.jit(sample, static_argnames=("num_logprobs", "batch_invariant", "logprobs_mode"))
_bits = jax.jit(random_bits, static_argnames=("stream",))
_KEEP = math.exp(-spec.ACCEPT_PENALTY)


def _tensors(rows, seeds, positions, vocab=V, **fields):
    """SamplingTensors for a ``[S, R]`` grid of ``Row`` parameters (or a flat ``[S]`` list); ``fields`` replace
    whole leaves (``golden``)."""
    grid = np.asarray(rows, dtype=object)
    st = SamplingTensors.build(
        list(grid.reshape(-1)), list(np.reshape(seeds, -1)), np.reshape(positions, -1), vocab, mask_width=1
    )
    st = SamplingTensors(*(a.reshape(*grid.shape, *a.shape[1:]) for a in st))
    return st._replace(**{k: np.asarray(v, np.int32) for k, v in fields.items()})


def _grid(temps, **kw):
    return [[Row(temperature=t, **kw) for t in row] for row in temps]


def _seeds(n, base=1000):
    return np.repeat(np.arange(base, base + n, dtype=np.uint64)[:, None], R, axis=1)


def _positions(n, base=50):
    return np.tile(np.arange(base, base + R), (n, 1))


def _run(logits, st, drafts, draft_lp, nd, counts=None, **kw):
    out = _verify(
        np.asarray(logits, np.float32),
        st,
        counts,
        np.asarray(drafts, np.int32),
        np.asarray(draft_lp, np.float32),
        np.asarray(nd, np.int32),
        **kw,
    )
    return jax.tree.map(np.asarray, out)


def _stream_bits(seed, position, stream):
    words = np.array(split_seed(int(seed)), np.uint32)
    return int(np.asarray(_bits(words, np.int32(position), stream=stream)))


def _u(seed, position):
    """The acceptance uniform of (seed, position), computed from the bits as the module documents."""
    return (_stream_bits(seed, position, spec.ACCEPT_STREAM) >> 8) / 2.0**24


def _chi2_sf_fallback(stat, dof):
    """The chi-square survival function Q(k/2, x/2), by Q(s + 1, y) = Q(s, y) + y^s e^-y / Γ(s + 1)."""
    y = stat / 2.0
    s, q = (1.0, math.exp(-y)) if dof % 2 == 0 else (0.5, math.erfc(math.sqrt(y)))
    while s < dof / 2.0:
        q += math.exp(s * math.log(y) - y - math.lgamma(s + 1))
        s += 1.0
    return q


def _chi2_sf(stat, dof):
    """The chi-square survival function: scipy's when the venv has it."""
    try:
        from scipy.stats import chi2
    except ImportError:
        return _chi2_sf_fallback(stat, dof)
    return float(chi2.sf(stat, dof))


def _chi2_p(tokens, probs):
    counts = np.bincount(tokens, minlength=len(probs))
    expected = len(tokens) * np.asarray(probs)
    return _chi2_sf(float(np.sum((counts - expected) ** 2 / expected)), len(probs) - 1)


# Three verification rows whose argmaxes are 2 (tied with 3), 0 and 4.
GREEDY_ROWS = np.array([[1, 0, 3, 3, -1], [5, 0, 0, 0, 0], [0, 0, 0, 0, 6]], np.float32)


def test_chi2_fallback_agrees_with_known_values():
    # Upper 5% and 1% points from standard tables.
    for stat, dof, p in [(11.0705, 5, 0.05), (15.0863, 5, 0.01), (9.2103, 2, 0.01), (3.8415, 1, 0.05)]:
        assert _chi2_sf_fallback(stat, dof) == pytest.approx(p, abs=1e-5)
        assert _chi2_sf(stat, dof) == pytest.approx(p, abs=1e-5)


def test_greedy_rows_accept_the_longest_prefix_of_argmax_drafts():
    logits = np.tile(GREEDY_ROWS[None], (S, 1, 1))
    logits[7, 1, 2] = np.nan  # sequence 7's second row is unusable
    drafts = [[2, 0], [2, 3], [3, 0], [2, 4], [-1, 0], [2, 0], [0, 0], [2, 0]]
    nd = [2, 2, 2, 1, 2, 0, 1, 2]
    out = _run(
        logits, _tensors(_grid([[0.0] * R] * S), _seeds(S), _positions(S)), drafts, np.zeros((S, 2, V)), nd
    )
    want = [
        [2, 0, 4],
        [2, 0, -1],
        [2, -1, -1],
        [2, 0, -1],
        [2, -1, -1],
        [2, -1, -1],
        [2, -1, -1],
        [2, -1, -1],
    ]
    np.testing.assert_array_equal(out.tokens, want)
    np.testing.assert_array_equal(out.num_accepted, [2, 1, 0, 1, 0, 0, 0, 1])
    # Greedy accept_prob: whether the draft is the argmax, 0 past num_drafts and on the unusable row.
    np.testing.assert_array_equal(
        out.accept_prob, [[1, 1], [1, 0], [0, 1], [1, 0], [0, 1], [0, 0], [0, 0], [1, 0]]
    )
    assert not out.ok[7, 1] and out.ok.sum() == S * R - 1
    # Each emitted token reports its log-probability in its own row (raw_logprobs); rank 1 = the argmax.
    raw = np.stack([log_softmax(r) for r in GREEDY_ROWS])
    emitted = out.tokens >= 0
    rows = np.broadcast_to(np.arange(R), (S, R))
    np.testing.assert_allclose(
        out.logprob[emitted], raw[rows[emitted], out.tokens[emitted]], rtol=1e-5, atol=1e-6
    )
    np.testing.assert_array_equal(out.rank[emitted], 1)
    assert np.all(out.logprob[~emitted] == 0) and np.all(out.rank[~emitted] == 0)


def test_golden_tokens_override_acceptance_and_the_candidate():
    logits = np.tile(GREEDY_ROWS[None], (S, 1, 1))
    temps = [[0.0] * R] * S
    temps[3] = [1.0, 0.0, 0.0]
    temps[4] = [1.0, 0.0, 0.0]
    grid = _grid(temps)
    grid[3][0] = Row(temperature=1.0, top_k=1)  # support {2}: the golden draft 0 is outside it
    golden = np.full((S, R), -1)
    golden[0, 0], golden[1, 0], golden[2, 0], golden[3, 0], golden[4, 0] = 1, 3, 4, 0, 2
    golden[5, 2] = 1  # the fresh row of a fully accepted sequence
    drafts = [[1, 0], [2, 0], [2, 0], [0, 3], [3, 0], [2, 0], [2, 0], [2, 0]]
    nd = [2, 2, 0, 1, 1, 2, 2, 2]
    st = _tensors(grid, _seeds(S), _positions(S), golden=golden)
    out = _run(logits, st, drafts, np.zeros((S, 2, V)), nd)
    want = [[1, 0, 4], [3, -1, -1], [4, -1, -1], [0, 0, -1], [2, -1, -1], [2, 0, 1], [2, 0, 4], [2, 0, 4]]
    np.testing.assert_array_equal(out.tokens, want)
    np.testing.assert_array_equal(out.num_accepted, [2, 0, 0, 1, 0, 2, 2, 2])
    # A forced token reports its own log-probability in its row.
    np.testing.assert_allclose(out.logprob[1, 0], log_softmax(GREEDY_ROWS[0])[3], rtol=1e-5)
    assert out.rank[1, 0] == 2


SAMPLED_ROW = np.array([2.0, 1.0, 0.0, -1.0, 0.5], np.float32)
TIED_ROW = np.array([0.0, 2.0, 2.0, 1.0, -1.0], np.float32)
P_HAND = np.array([0.1, 0.5, 0.2, 0.1, 0.1])


def _sampled_case():
    """Sequences 0–7: a sampled first row (temperature 1), greedy second and third rows, one draft each."""
    logits = np.tile(GREEDY_ROWS[None], (S, 1, 1))
    logits[:, 0] = SAMPLED_ROW
    logits[7, 0] = TIED_ROW
    grid = _grid([[1.0, 0.0, 0.0]] * S)
    grid[0][0] = Row(temperature=1.0, top_k=2)  # support {0, 1}
    q = softmax(SAMPLED_ROW)
    draft_p = np.zeros((S, 2, V))
    draft_p[0, 0] = [0, 0, 0, 0, 1]  # all draft mass outside the target's support
    draft_p[1, 0] = draft_p[2, 0] = 0.2
    draft_p[3:7, 0] = P_HAND
    draft_p[7, 0] = 2 * softmax(TIED_ROW)  # not a distribution: the residual is empty
    with np.errstate(divide="ignore"):
        draft_lp = np.log(draft_p)
    drafts = [[4, 0], [-1, 0], [0, 0], [1, 0], [1, 0], [1, 0], [1, 0], [-1, 0]]
    seeds = _seeds(S, base=7)
    return logits, _tensors(grid, seeds, _positions(S)), drafts, draft_lp, [1] * S, q, seeds


def test_sampled_verify_rows_by_hand():
    logits, st, drafts, draft_lp, nd, q, seeds = _sampled_case()
    out = _run(logits, st, drafts, draft_lp, nd)
    q0 = final_probs(SAMPLED_ROW, 1.0, {0, 1})

    # 0: a draft outside the target's support is always rejected; the residual is Q itself.
    assert out.num_accepted[0] == 0 and out.tokens[0, 0] in (0, 1)
    assert out.tokens[0, 0] == draw(q0, _stream_bits(seeds[0, 0], 50, spec.RESIDUAL_STREAM))
    assert out.accept_prob[0, 0] == pytest.approx(0.0, abs=1e-6)
    # Reported log-probabilities are the raw ones of the row (the default mode).
    assert out.logprob[0, 0] == pytest.approx(log_softmax(SAMPLED_ROW)[out.tokens[0, 0]], rel=1e-5)
    # 1: no draft: rejected, the candidate is drawn from max(Q - e^-ε P, 0).
    resid = np.maximum(q - _KEEP * 0.2, 0)
    assert out.num_accepted[1] == 0 and resid[out.tokens[1, 0]] > 0
    assert out.accept_prob[1, 0] == pytest.approx(1 - resid.sum(), abs=1e-6)
    bits = _stream_bits(seeds[1, 0], 50, spec.RESIDUAL_STREAM)
    assert out.tokens[1, 0] == draw(resid / resid.sum(), bits)
    # 2: Q(0) = 0.47 > P(0) = 0.2: the ratio is 1, always accepted; then the greedy fresh row's argmax.
    assert q[0] > 0.2
    np.testing.assert_array_equal(out.tokens[2], [0, 0, -1])
    assert out.accept_prob[2, 0] == pytest.approx(1 - resid.sum(), abs=1e-6)
    # 3–6: accepted iff u < Q(1) / P(1); a rejection draws from the residual.
    ratio = q[1] / P_HAND[1]
    resid = np.maximum(q - _KEEP * P_HAND, 0)
    accepted = [_u(seeds[s, 0], 50) < ratio for s in range(3, 7)]
    assert any(accepted) and not all(accepted), "the seeds should exercise both outcomes"
    for s, acc in zip(range(3, 7), accepted):
        assert out.num_accepted[s] == int(acc)
        if acc:
            np.testing.assert_array_equal(out.tokens[s], [1, 0, -1])
        else:
            assert out.tokens[s, 0] == draw(
                resid / resid.sum(), _stream_bits(seeds[s, 0], 50, spec.RESIDUAL_STREAM)
            )
            assert resid[out.tokens[s, 0]] > 0 and out.tokens[s, 1] == -1
        assert out.accept_prob[s, 0] == pytest.approx(1 - resid.sum(), abs=1e-6)
        assert out.accept_prob[s, 0] == pytest.approx(np.minimum(q, _KEEP * P_HAND).sum(), abs=1e-6)
    # 7: P = 2Q leaves no residual mass: the candidate is the lowest id of the largest logit (1, tied with 2).
    np.testing.assert_array_equal(out.tokens[7], [1, -1, -1])
    assert out.accept_prob[7, 0] == 1.0


def _random_case(rng, rows_per_seq=R):
    n = S * rows_per_seq
    temps = rng.choice([0.0, 0.7, 1.0, 1.5], size=n)
    params = [
        Row(
            temperature=float(t),
            top_k=int(rng.choice([-1, 2, 4])),
            top_p=float(rng.choice([1.0, 0.8])),
            min_p=float(rng.choice([0.0, 0.05])),
            repetition_penalty=float(rng.choice([1.0, 1.3])),
            frequency_penalty=float(rng.choice([0.0, 0.4])),
        )
        for t in temps
    ]
    grid = np.empty((S, rows_per_seq), dtype=object)
    grid.reshape(-1)[:] = params
    seeds = rng.integers(0, 2**63, size=(S, rows_per_seq), dtype=np.uint64)
    positions = rng.integers(0, 1000, size=(S, rows_per_seq))
    golden = np.full((S, rows_per_seq), -1)
    golden[5, 0] = 3
    st = _tensors(grid, seeds, positions, golden=golden)
    logits = (rng.normal(size=(S, rows_per_seq, V)) * 2).astype(np.float32)
    counts = rng.integers(0, 3, size=(S, rows_per_seq, V)).astype(np.int32)
    counts[..., 0] |= PROMPT_FLAG
    return logits, st, counts


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_no_drafts_emits_exactly_what_sample_draws(batch_invariant):
    rng = np.random.default_rng(5)
    logits, st, counts = _random_case(rng)
    drafts = rng.integers(0, V, size=(S, R - 1))  # ignored: num_drafts = 0
    draft_lp = np.log(np.full((S, R - 1, V), 1.0 / V))
    options = dict(num_logprobs=2, logprobs_mode="processed_logprobs", batch_invariant=batch_invariant)
    out = _run(logits, st, drafts, draft_lp, np.zeros(S), counts=counts, **options)
    first = SamplingTensors(*(a[:, 0] for a in st))
    want = jax.tree.map(np.asarray, _sample(logits[:, 0], first, counts[:, 0], **options))
    assert want.ok.all()
    np.testing.assert_array_equal(out.tokens[:, 0], want.tokens)
    np.testing.assert_array_equal(out.logprob[:, 0], want.logprob)
    np.testing.assert_array_equal(out.rank[:, 0], want.rank)
    np.testing.assert_array_equal(out.top_ids[:, 0], want.top_ids)
    np.testing.assert_array_equal(out.top_logprobs[:, 0], want.top_logprobs)
    assert np.all(out.tokens[:, 1:] == -1) and np.all(out.num_accepted == 0) and np.all(out.accept_prob == 0)
    assert out.tokens[5, 0] == 3  # golden


# The statistical test: fixed target rows Q_j and draft rows P_j that differ from them a lot.
STAT_N = 20000
Q_ROWS = np.log(
    np.array([[0.4, 0.3, 0.1, 0.1, 0.05, 0.05], [0.1, 0.15, 0.3, 0.05, 0.2, 0.2], [1 / 6] * 6], np.float32)
)
P_ROWS = np.log(np.array([[0.05, 0.05, 0.1, 0.1, 0.3, 0.4], [0.3, 0.05, 0.3, 0.05, 0.2, 0.1]], np.float32))


def _statistical_run():
    vocab = Q_ROWS.shape[1]
    n, r = STAT_N, Q_ROWS.shape[0]
    seeds = np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15 % 2**63) + np.uint64(11)
    seeds = np.repeat(seeds[:, None], r, axis=1)
    positions = np.tile(np.arange(200, 200 + r), (n, 1))
    one = Row(temperature=1.0)
    grid = np.empty((n, r), dtype=object)
    grid.reshape(-1)[:] = one
    st = _tensors(grid, seeds, positions, vocab)
    draft_st = SamplingTensors(*(a[:, : r - 1].reshape(n * (r - 1), *a.shape[2:]) for a in st))
    draft_logits = np.tile(P_ROWS, (n, 1))
    drafts, draft_lp = _draft(draft_logits, draft_st)
    drafts = np.asarray(drafts).reshape(n, r - 1)
    draft_lp = np.asarray(draft_lp).reshape(n, r - 1, vocab)
    logits = np.tile(Q_ROWS[None], (n, 1, 1))
    return logits, st, drafts, draft_lp, np.full(n, r - 1, np.int32)


def _verify_stat(args):
    # A fresh function to jit each time (jit caches by function), so a monkeypatched helper is traced.
    return jax.tree.map(np.asarray, jax.jit(lambda *a: spec.verify(*a))(*args[:2], None, *args[2:]))


def test_emitted_tokens_follow_the_target_distribution():
    args = _statistical_run()
    q = softmax(Q_ROWS[0]), softmax(Q_ROWS[1])
    p = softmax(P_ROWS[0]), softmax(P_ROWS[1])
    assert _chi2_p(args[2][:, 0], p[0]) > 0.01  # the drafts follow P_0
    out = _verify_stat(args)
    assert _chi2_p(out.tokens[:, 0], q[0]) > 0.01
    first = out.num_accepted >= 1
    assert first.sum() > 5000
    assert _chi2_p(out.tokens[first, 1], q[1]) > 0.01
    both = out.num_accepted == 2  # then the fresh row's bonus token follows Q_2 (uniform)
    assert both.sum() > 2000 and _chi2_p(out.tokens[both, 2], softmax(Q_ROWS[2])) > 0.01
    # accept_prob is Σ min(Q, e^-ε P); the acceptance rate Σ min(Q, P) is within ε of it, and the observed rate
    # is within four standard errors.
    beta = np.minimum(q[0], _KEEP * p[0]).sum()
    np.testing.assert_allclose(out.accept_prob[:, 0], beta, atol=1e-5)
    assert abs(first.mean() - beta) < 4 * math.sqrt(beta * (1 - beta) / STAT_N)


def test_a_broken_residual_is_caught(monkeypatch):
    args = _statistical_run()
    monkeypatch.setattr(spec, "_residual_weights", lambda q, p: q)  # resample from Q instead of the residual
    out = _verify_stat(args)
    assert _chi2_p(out.tokens[:, 0], softmax(Q_ROWS[0])) < 1e-6


def _invariance_case(rng, n):
    rows = [
        [
            Row(
                temperature=float(rng.choice([0.0, 0.8, 1.2])),
                top_k=int(rng.choice([-1, 3])),
                top_p=float(rng.choice([1.0, 0.7])),
            )
            for _ in range(R)
        ]
        for _ in range(n)
    ]
    seeds = rng.integers(0, 2**63, size=(n, R), dtype=np.uint64)
    st = _tensors(rows, seeds, rng.integers(0, 500, size=(n, R)), 37)
    logits = (rng.normal(size=(n, R, 37)) * 2).astype(np.float32)
    draft_lp = np.stack([[log_softmax(rng.normal(size=37)) for _ in range(R - 1)] for _ in range(n)])
    drafts = rng.integers(0, 37, size=(n, R - 1))
    return logits, st, drafts, draft_lp.astype(np.float32), rng.integers(0, R, size=n)


def test_batch_invariant_rows_are_bitwise_equal_alone_and_in_a_batch():
    rng = np.random.default_rng(9)
    batch = _invariance_case(rng, 7)
    place = 3
    alone = jax.tree.map(lambda a: a[place : place + 1], batch)
    got = [_run(*case, num_logprobs=3, batch_invariant=True) for case in (alone, batch)]
    for a, b in zip(got[0], got[1]):
        np.testing.assert_array_equal(a.view(np.uint8), b[place : place + 1].view(np.uint8))
    flat = [SamplingTensors(*(x[:, 0] for x in case[1])) for case in (alone, batch)]
    drafted = [
        jax.tree.map(np.asarray, _draft(case[0][:, 0], f, batch_invariant=True))
        for case, f in zip((alone, batch), flat)
    ]
    for a, b in zip(*drafted):
        np.testing.assert_array_equal(a.view(np.uint8), b[place : place + 1].view(np.uint8))


def test_draft_sample_greedy_and_sampled_rows():
    vocab = 7
    rng = np.random.default_rng(3)
    logits = (rng.normal(size=(6, vocab)) * 2).astype(np.float32)
    logits[0, [1, 4]] = 9.0  # a greedy tie: the lowest id wins
    params = [
        Row(temperature=0.0),
        Row(temperature=0.0),
        Row(temperature=1.0),
        Row(temperature=0.6, top_k=3),
        Row(temperature=1.3, top_p=0.7),
        Row(temperature=0.9, min_p=0.1),
    ]
    seeds = [int(s) for s in rng.integers(0, 2**63, size=6, dtype=np.uint64)]
    positions = rng.integers(0, 100, size=6)
    st = SamplingTensors.build(params, seeds, positions, vocab, mask_width=1)
    st = st._replace(golden=np.full(6, 2, np.int32))  # ignored by drafting
    tokens, lps = jax.tree.map(np.asarray, _draft(logits, st))
    for i, p in enumerate(params):
        if p.temperature == 0:
            assert tokens[i] == np.argmax(logits[i])
            want = np.full(vocab, -np.inf)
            want[tokens[i]] = 0.0
            np.testing.assert_array_equal(lps[i], want)
            continue
        keep, _ = kept_ids(logits[i], p.temperature, p.min_p, p.top_k, p.top_p)
        probs = final_probs(logits[i], p.temperature, keep)
        with np.errstate(divide="ignore"):
            np.testing.assert_allclose(lps[i], np.log(probs), rtol=1e-5, atol=1e-6)
        assert tokens[i] in keep
        assert tokens[i] == draw(probs, _stream_bits(seeds[i], positions[i], spec.DRAFT_STREAM))
    assert tokens[0] == 1


def test_bad_arguments_are_refused():
    logits = np.zeros((2, 3, V), np.float32)
    st = _tensors(_grid([[1.0] * 3] * 2), _seeds(2), _positions(2))
    good = (
        logits,
        st,
        None,
        np.zeros((2, 2), np.int32),
        np.zeros((2, 2, V), np.float32),
        np.zeros(2, np.int32),
    )
    with pytest.raises(TypeError, match="drafts must be int32"):
        spec.verify(*good[:3], np.zeros((2, 3), np.int32), *good[4:])
    with pytest.raises(TypeError, match="draft_logprobs must be float32"):
        spec.verify(*good[:4], np.zeros((2, 2, V), np.float64), good[5])
    with pytest.raises(ValueError, match="st has rows"):
        spec.verify(logits[:1], *good[1:])
    with pytest.raises(ValueError, match="logprobs_mode"):
        spec.verify(*good, logprobs_mode="nope")
    with pytest.raises(TypeError, match="logits must be float32"):
        spec.draft_sample(np.zeros((2, V), np.float64), SamplingTensors(*(a[:, 0] for a in st)))
    assert (spec.RESIDUAL_STREAM, spec.ACCEPT_STREAM, spec.DRAFT_STREAM, spec.ACCEPT_PENALTY) == (
        1,
        2,
        3,
        5e-5,
    )
