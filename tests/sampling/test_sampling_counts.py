"""The per-slot token-count state the penalties read: updates, prompt flags, padding, resets."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from _sampling_ref import Row, log_softmax, penalise
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax import sampling
from deepinfer_jax.sampling import COUNT_MASK, PROMPT_FLAG, SamplingTensors

SLOTS, V = 4, 16
_update = jax.jit(sampling.update_token_counts)
_reset = jax.jit(sampling.reset_token_counts)


def _reference(entries, num_slots=SLOTS, vocab=V):
    """Counts from (slot, token, is_prompt) entries, by the documented encoding, skipping padding entries."""
    generated = np.zeros((num_slots, vocab), np.int64)
    in_prompt = np.zeros((num_slots, vocab), bool)
    for slot, token, prompt in entries:
        if not (0 <= slot < num_slots and 0 <= token < vocab):
            continue
        if prompt:
            in_prompt[slot, token] = True
        else:
            generated[slot, token] += 1
    return (generated | np.where(in_prompt, PROMPT_FLAG, 0)).astype(np.int32)


_entry = st.tuples(st.integers(-2, SLOTS), st.integers(-2, V + 1), st.booleans())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(_entry, min_size=8, max_size=8), min_size=1, max_size=4))
def test_update_matches_reference_over_several_steps(steps):
    # A fixed entry count per step keeps one compiled shape; padding entries (slot or token out of range,
    # including -1) are part of the generated data.
    counts = sampling.init_token_counts(SLOTS, V)
    for step in steps:
        slots, tokens, prompt = (np.array(c) for c in zip(*step))
        counts = _update(counts, slots.astype(np.int32), tokens.astype(np.int32), prompt)
    np.testing.assert_array_equal(np.asarray(counts), _reference([e for s in steps for e in s]))


def test_generated_only_update_and_split():
    counts = sampling.init_token_counts(SLOTS, V)
    counts = _update(counts, np.array([0, 0, 0, 3, -1], np.int32), np.array([5, 5, 2, 5, 5], np.int32), None)
    counts = _update(counts, np.array([0, 3, 2, 1, 1], np.int32), np.array([5, 1, 2, 9, 9], np.int32), None)
    generated, in_prompt = sampling.split_token_counts(counts)
    assert not np.asarray(in_prompt).any()
    want = np.zeros((SLOTS, V), np.int32)
    want[0, 5], want[0, 2], want[3, 5], want[3, 1], want[2, 2], want[1, 9] = 3, 1, 1, 1, 1, 2
    np.testing.assert_array_equal(np.asarray(generated), want)


def test_prompt_flag_is_idempotent_and_keeps_the_count():
    counts = sampling.init_token_counts(SLOTS, V)
    counts = _update(counts, np.array([1, 1], np.int32), np.array([7, 7], np.int32), np.array([False, False]))
    for _ in range(2):
        counts = _update(
            counts, np.array([1, 1], np.int32), np.array([7, 7], np.int32), np.array([True, True])
        )
    assert int(counts[1, 7]) == PROMPT_FLAG | 2
    assert int(counts[1, 7]) & COUNT_MASK == 2


def test_reset_zeroes_only_the_given_slots():
    counts = _update(
        sampling.init_token_counts(SLOTS, V),
        np.arange(SLOTS, dtype=np.int32),
        np.arange(SLOTS, dtype=np.int32),
        np.array([True, False, True, False]),
    )
    out = np.asarray(_reset(counts, np.array([1, -1, 2], np.int32)))
    assert out[1].sum() == 0 and out[2].sum() == 0
    assert out[0, 0] == PROMPT_FLAG and out[3, 3] == 1


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="num_slots = 0 must be >= 1"):
        sampling.init_token_counts(0, V)
    with pytest.raises(TypeError, match="vocab_size must be an int"):
        sampling.init_token_counts(2, 3.0)
    counts = sampling.init_token_counts(SLOTS, V)
    with pytest.raises(ValueError, match="same length"):
        sampling.update_token_counts(counts, np.zeros(2, np.int32), np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="is_prompt must have shape"):
        sampling.update_token_counts(counts, np.zeros(2, np.int32), np.zeros(2, np.int32), np.zeros(3, bool))
    with pytest.raises(TypeError, match="counts must be int32"):
        sampling.update_token_counts(counts.astype(np.float32), np.zeros(2, np.int32), np.zeros(2, np.int32))


def test_penalties_through_the_count_state_end_to_end():
    """Counts built by update_token_counts steer the sampler exactly as the reference penalties say."""
    rng = np.random.default_rng(0)
    vocab = V
    prompt = [3, 3, 8]
    output = [8, 1, 1, 1]
    counts = sampling.init_token_counts(2, vocab)
    counts = _update(
        counts,
        np.array([1] * 7 + [-1], np.int32),
        np.array(prompt + output + [0], np.int32),
        np.array([True] * 3 + [False] * 5),
    )
    logits = (rng.normal(size=(1, vocab))).astype(np.float32)
    logits[0, [1, 3, 8]] += 4.0  # make the penalised ids the favourites before penalties
    row = Row(temperature=0.0, repetition_penalty=2.0, presence_penalty=0.7, frequency_penalty=0.4)
    st_ = SamplingTensors.build([row], [0], [7], vocab)
    out = sampling.sample(logits, st_, counts[1:2], num_logprobs=3, logprobs_mode="processed_logprobs")
    x = penalise(logits[0], prompt, output, np.float32(2.0), np.float32(0.7), np.float32(0.4))
    assert int(out.tokens[0]) == int(np.argmax(x))
    # The processed distribution of a greedy row is the penalised one; float32 log_softmax of values below ~10:
    # a few ulps.
    np.testing.assert_allclose(np.asarray(out.top_logprobs[0]), np.sort(log_softmax(x))[::-1][:3], atol=1e-5)
