"""Batch-invariant mode: every row's results are bitwise identical whatever the batch size and the row's place.

On XLA:CPU a vectorised reduction may change with the batch shape, so only the ``lax.map`` path promises this;
the check is therefore bitwise (``view(uint32)``), on every output, for B = 1..33 and permuted rows.
"""

from __future__ import annotations

import concurrent.futures
import os

import jax
import numpy as np
import pytest
from _sampling_ref import Row

from deepinfer_jax import sampling
from deepinfer_jax.sampling import PROMPT_FLAG, SamplingTensors

V = 257  # odd: no vector-width-aligned rows
N_LOGPROBS = 6
_sample = jax.jit(sampling.sample, static_argnames=("num_logprobs", "batch_invariant", "backend"))

# The rows whose results are tracked: greedy with penalties, plain sampling, each filter, a min_tokens mask.
PROBES = [
    Row(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
    Row(temperature=1.0),
    Row(temperature=0.7, top_k=12, top_p=0.85),
    Row(temperature=1.4, min_p=0.05, repetition_penalty=0.8, frequency_penalty=-0.5),
    Row(temperature=0.9, top_p=0.5, min_tokens=4, stop_token_ids=(5, 6)),
]


def _row_data(rng, row):
    logits = (rng.normal(size=V) * 3).astype(np.float32)
    counts = np.zeros(V, np.int32)
    np.add.at(counts, rng.integers(0, V, size=20), 1)
    counts[rng.integers(0, V, size=10)] |= PROMPT_FLAG
    return row, logits, counts, int(rng.integers(0, 2**64, dtype=np.uint64)), int(rng.integers(0, 5000))


@pytest.fixture(scope="module")
def probes():
    rng = np.random.default_rng(123)
    return [_row_data(rng, row) for row in PROBES]


def _filler(rng):
    row = Row(
        temperature=float(rng.choice([0.0, 0.5, 1.0, 2.0])),
        top_k=int(rng.choice([-1, 3, 50])),
        top_p=float(rng.choice([1.0, 0.7])),
        repetition_penalty=float(rng.choice([1.0, 1.5])),
    )
    return _row_data(rng, row)


def _args(rows):
    params, logits, counts, seeds, positions = zip(*rows)
    st = SamplingTensors.build(
        list(params),
        list(seeds),
        list(positions),
        V,
        output_lens=[1] * len(rows),
        eos_token_ids=[0],
        mask_width=4,
    )
    return np.stack(logits), st, np.stack(counts)


def _run(rows, batch_invariant=True):
    out = _sample(*_args(rows), num_logprobs=N_LOGPROBS, batch_invariant=batch_invariant)
    return jax.tree.map(np.asarray, out)


def _compile_all(batches):
    """Compile the batch-invariant sampler for every batch in ``batches`` concurrently.

    One executable per batch size is the point of the test, and XLA compiles outside the GIL: two threads
    roughly halve the wall time on a 2-core machine.
    """
    jitted = jax.jit(sampling.sample, static_argnames=("num_logprobs", "batch_invariant"))

    def compile_one(rows):
        return jitted.lower(*_args(rows), num_logprobs=N_LOGPROBS, batch_invariant=True).compile()

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        return list(pool.map(compile_one, batches))


def _row_bits(out, i):
    """Row ``i`` of every output as raw bits, so that -0.0 vs 0.0 or NaN payloads would count as differences."""
    return [np.ascontiguousarray(field[i]).view(np.uint8).tobytes() for field in out]


def test_rows_are_bitwise_identical_for_every_batch_size_and_place(probes):
    alone = [_row_bits(_run([p]), 0) for p in probes]
    rng = np.random.default_rng(7)
    batches, where = [], []
    for batch in range(1, 34):
        rows = [_filler(rng) for _ in range(batch)]
        # Probes go to random distinct places (as many as fit), the rest of the batch is random other requests.
        places = rng.permutation(batch)[: len(probes)]
        for probe, place in zip(probes, places):
            rows[place] = probe
        batches.append(rows)
        where.append(places)
    for rows, places, compiled in zip(batches, where, _compile_all(batches)):
        batch = len(rows)
        out = jax.tree.map(np.asarray, compiled(*_args(rows)))
        assert np.asarray(out.ok).all()
        for k, place in enumerate(places):
            assert _row_bits(out, place) == alone[k], f"probe {k} at row {place} of a batch of {batch}"


def test_permuting_the_batch_permutes_the_results_bitwise(probes):
    rng = np.random.default_rng(8)
    rows = [_filler(rng) for _ in range(11)] + list(probes)
    perm = rng.permutation(len(rows))
    out = _run(rows)
    shuffled = _run([rows[i] for i in perm])
    for j, i in enumerate(perm):
        assert _row_bits(shuffled, j) == _row_bits(out, i)


def test_default_mode_agrees_with_invariant_mode_on_tokens(probes):
    # Not bitwise (vectorised reductions may round differently) but the same tokens away from near-ties.
    rows = list(probes)
    a, b = _run(rows, batch_invariant=False), _run(rows, batch_invariant=True)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.top_ids, b.top_ids)
    # Same float32 formula, possibly another summation order over 257 terms: a few ulps of values below ~20.
    np.testing.assert_allclose(a.logprob, b.logprob, atol=1e-5)
