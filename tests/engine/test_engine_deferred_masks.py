"""Deferred grammar masks (docs/structured_outputs.md, "The mask"): a constrained row is scheduled while its
previous token is still in flight; the step is dispatched in two halves, the forward half at once and the
sample half once the host has processed the step before it and filled the row's masks from the matcher.

The reference is the same engine with ``scheduler.defer_masks = False`` (the row waits for its token, one
whole step per dispatch): tokens and logprobs must be bitwise equal, greedy and seeded sampled, with and
without drafts (tiny-v3's MTP layer, whose verify-row masks are built from the drafts the step in flight left
in the pool), constrained and free requests mixed, and a cache small enough to preempt. The counter
``num_deferred_masks`` proves the rows did run with their token in flight (0 without deferral).
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

from deepinfer_jax.engine.grammar import RequestGrammar
from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.engine.params import SamplingParams
from deepinfer_jax.engine.structured import StructuredOutputsParams as SO

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{3}-[0-9]{2}"


@functools.cache
def _llm(k: int) -> LLM:
    return LLM(
        "tiny-v3",
        dtype="float32",
        num_draft_tokens=k,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        kv_cache_memory="64MiB",
        **{"cache.block_size": 16, "cache.num_blocks": 12},
    )


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=40, logprobs=1, structured_outputs=SO(json=SCHEMA)),
        SamplingParams(
            temperature=1.0, seed=11, max_tokens=16, logprobs=1, structured_outputs=SO(regex=REGEX)
        ),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1),
        SamplingParams(
            temperature=0.8,
            top_k=20,
            seed=5,
            max_tokens=12,
            logprobs=1,
            structured_outputs=SO(choice=["alpha", "beta", "gamma"]),
        ),
        SamplingParams(
            temperature=1.0, seed=3, max_tokens=40, logprobs=1, structured_outputs=SO(json=SCHEMA)
        ),
        SamplingParams(temperature=0.7, seed=9, max_tokens=10, ignore_eos=True, logprobs=1),
    ]


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(4)
    return [rng.integers(3, 500, n).tolist() for n in (3, 20, 9, 35, 1, 14)]


def _run(llm: LLM, defer: bool):
    llm.scheduler.defer_masks = defer
    st = llm.scheduler.devices[0].stats
    before = st.num_deferred_masks
    try:
        outs = llm.generate(prompt_token_ids=_prompts(), sampling_params=_params(), use_tqdm=False)
    finally:
        llm.scheduler.defer_masks = True
    got = [
        (
            list(o.outputs[0].token_ids),
            [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
            o.outputs[0].finish_reason,
        )
        for o in outs
    ]
    return got, st.num_deferred_masks - before, outs


@pytest.mark.parametrize("k", [0, 3])
def test_deferred_masks_equal_waiting_for_the_token(k):
    llm = _llm(k)
    waited, none_deferred, _ = _run(llm, defer=False)
    deferred, count, outs = _run(llm, defer=True)
    assert none_deferred == 0
    assert count > 20, count  # nearly every constrained decode row ran with its token in flight
    assert deferred == waited  # tokens, logprobs (bitwise) and finish reasons
    assert re.fullmatch(REGEX, outs[1].outputs[0].text)
    assert outs[3].outputs[0].text in ("alpha", "beta", "gamma")
    if k:
        assert sum(llm.last_stats.verified_at) > 0  # constrained rows verified drafts under per-row masks


def test_deferred_masks_without_drafts_equal_the_speculative_engine():
    """Greedy constrained output is the same whether the rows verify drafts or not (float32, tiny-v3)."""
    plain, _, _ = _run(_llm(0), defer=True)
    spec, _, _ = _run(_llm(3), defer=True)
    for i in (0, 2):  # the greedy requests (sampled ones draw from other random numbers under speculation)
        assert spec[i][0] == plain[i][0]


@pytest.mark.parametrize("k", [0, 3])
def test_preempted_constrained_requests_with_deferred_masks(k):
    """Preempted constrained requests (with drafts: recomputes that resume at their last output, whose next
    rows wait for the drafts the resumed row leaves) give valid text, deferred or not. Without drafts the
    sampled tokens are the same both ways; with drafts they need not be: waiting for tokens changes which rows
    share a step, and outside batch-invariant mode a row's drafts, their probabilities and how many of them the
    step's budget leaves it depend on its batch (each decides which random stream draws a token)."""
    llm = _llm(k)
    rx = "([a-z][0-9]){20}"
    params = [
        SamplingParams(temperature=1.0, seed=40 + i, max_tokens=50, structured_outputs=SO(regex=rx))
        for i in range(4)
    ]
    prompts = [[5 + i] * (30 + 3 * i) for i in range(4)]
    runs = []
    for defer in (False, True):
        llm.scheduler.defer_masks = defer
        try:
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        finally:
            llm.scheduler.defer_masks = True
        runs.append([list(o.outputs[0].token_ids) for o in outs])
        assert sum(o.metrics.num_preemptions for o in outs) > 0
        assert all(re.fullmatch(rx, o.outputs[0].text) for o in outs)
    if k:
        assert sum(llm.last_stats.verified_at) > 0
    else:
        assert runs[0] == runs[1]


class _Matcher:
    """A stand-in matcher: ``may_constrain`` only asks whether one exists."""

    def deep_copy(self):
        return self


@pytest.mark.parametrize(
    ("trigger", "tail", "budget", "bound", "tokens", "expected"),
    [
        ((7, 8, 9), [], None, None, 1, False),  # three trigger ids to go, one token in flight
        ((7, 8, 9), [], None, None, 3, True),  # three in flight could be the whole trigger
        ((7, 8, 9), [1, 7, 8], None, None, 1, True),  # one id to go
        ((7, 8, 9), [7], None, None, 1, False),  # two ids to go
        ((7, 8, 9), [7], None, None, 2, True),
        ((9,), [], None, None, 1, True),  # a one-id trigger can come next
        ((7, 8), [], 5, None, 1, False),  # the budget is four tokens away
        ((7, 8), [], 1, None, 1, True),  # the token in flight reaches the budget: forcing starts
        ((7, 8), [], None, 3, 1, True),  # a bound id may come any time and force the trigger
    ],
)
def test_may_constrain_before_the_trigger(trigger, tail, budget, bound, tokens, expected):
    g = RequestGrammar(_Matcher(), 4, trigger=trigger, budget=budget, bound=bound)
    for t in tail:
        assert g.accept(t) is None
    assert not g.active
    assert g.may_constrain(tokens) is expected


def test_may_constrain_once_active():
    live = RequestGrammar(_Matcher(), 4)
    assert live.active and live.may_constrain(1)
    free = RequestGrammar(None, 4, trigger=(9,), budget=8)  # a budget alone: free after the trigger
    assert free.accept(9) is None and free.active
    assert not free.may_constrain(4)
