"""Prefix caching through ``LLM`` for V3, V4 and V4.1: hits give the tokens and logprobs of cold runs.

One float32 engine per family (16-token blocks, a cache of 40 blocks) serves every case; a *cold* run is the
same engine after ``reset_prefix_cache()``, so each case compares a hit with a computation of the whole prompt
on the same weights and compiled steps. V4 and V4.1 hits restore window-state snapshots (rings, compression
state, Engram ids, V4.1's drafter rings: V4.1 drafts with DSpark here, V3 with its MTP layer, whose cache
entries depend on the next token and so key each block with one token of lookahead).

Tolerance: a hit prefills fewer rows in other chunks than the cold run, so float32 reductions run in another
order; measured differences are at most 3e-6 in logprob, the bound is 1e-4 (tokens must be identical: no case
here has a near-tie, checked by the margin printed on failure). Batch-invariant mode must be bitwise.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from deepinfer_jax import LLM, SamplingParams

FAMILIES = ["tiny-v3", "tiny-v4", "tiny-v41"]
BLOCK = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)


@functools.cache
def engine(name: str, batch_invariant: bool = False) -> LLM:
    return LLM(
        name,
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        batch_invariant=batch_invariant,
        num_draft_tokens=None,  # the model's natural drafts: V3 MTP, V4.1 DSpark, V4 none
        enable_prefix_caching=True,
        **{"cache.block_size": BLOCK, "cache.num_blocks": 41, "cache.host_memory": 64 << 20},
    )


def _stem(llm: LLM, n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, llm.model.config.vocab_size, n).tolist()


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


def _cold(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY):
    llm.reset_prefix_cache()
    out = _run(llm, [prompt], params)[0]
    assert out.num_cached_tokens == 0
    return out


def _logprobs(out) -> np.ndarray:
    c = out.outputs[0]
    return np.array([entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids, strict=True)])


def _same(hot, cold, *, bitwise: bool = False) -> None:
    assert hot.outputs[0].token_ids == cold.outputs[0].token_ids
    a, b = _logprobs(hot), _logprobs(cold)
    if bitwise:
        assert np.array_equal(a, b), np.abs(a - b).max()
    else:
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_hits_equal_cold_runs(name: str) -> None:
    """Second requests sharing 1, 2 and 5 blocks; prompts ending on a boundary and one token after it; the
    hit lengths are what the block grain allows (a full-prompt hit computes its last block again)."""
    llm = engine(name)
    la = llm.prefix_cache.lookahead
    stem = _stem(llm, 5 * BLOCK)
    tail = _stem(llm, 3, seed=1)
    cases = {  # prompt -> cached tokens once the stem's request has run
        "1 block": (stem[: BLOCK + la] + tail, BLOCK),
        "2 blocks": (stem[: 2 * BLOCK + la] + tail, 2 * BLOCK),
        "5 blocks": (stem + tail, 5 * BLOCK),
        "on a boundary": (stem[: 3 * BLOCK], 2 * BLOCK),
        "after a boundary": (stem[: 3 * BLOCK + 1], 3 * BLOCK),
    }
    cold = {k: _cold(llm, p) for k, (p, _) in cases.items()}
    llm.reset_prefix_cache()
    _run(llm, [stem])
    for k, (prompt, cached) in cases.items():
        hot = _run(llm, [prompt])[0]
        assert hot.num_cached_tokens == cached, k
        _same(hot, cold[k])
    assert llm.last_stats.prefix_hits > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_hit_while_the_source_runs_and_after_eviction(name: str) -> None:
    """A sharer admitted one step after its source (which still prefills and decodes) reuses the blocks the
    source's first chunk wrote. Then other prompts fill the 40-block cache, the source's blocks are evicted
    (least recently freed first) to the host tier, and a request of the same prompt loads them back: still the
    cold tokens."""
    llm = engine(name)
    stem = _stem(llm, 4 * BLOCK + 5, seed=2)
    sharer = stem[: 4 * BLOCK] + _stem(llm, 2, seed=3)
    cold_source, cold_sharer = _cold(llm, stem), _cold(llm, sharer)
    llm.reset_prefix_cache()
    source, hot = _run(llm, [stem, sharer])  # 64 tokens a step: the sharer is admitted after the first chunk
    assert hot.num_cached_tokens == 4 * BLOCK - (BLOCK if llm.prefix_cache.lookahead else 0)
    _same(source, cold_source)
    _same(hot, cold_sharer)
    fillers = [_stem(llm, 3 * BLOCK + 1, seed=10 + i) for i in range(12)]
    _run(llm, fillers)
    sched = llm.scheduler.devices[0]
    assert sched.blocks.num_evictions > 0
    host_hits = sched.stats.prefix_cache_host_hits
    again = _run(llm, [stem])[0]
    assert again.num_cached_tokens == 4 * BLOCK
    assert sched.stats.prefix_cache_host_hits > host_hits  # they came back from host memory
    _same(again, cold_source)
    sched.blocks.check_consistency()


@pytest.mark.parametrize("name", FAMILIES)
def test_preempted_requests_holding_shared_blocks(name: str) -> None:
    """Four requests share a 3-block prefix and decode until the 40-block cache runs dry: preemption frees a
    request's hold on the shared blocks (they stay cached for the others and for its own recompute)."""
    llm = engine(name)
    stem = _stem(llm, 3 * BLOCK + 4, seed=4)
    prompts = [stem + _stem(llm, 2, seed=20 + i) for i in range(4)]
    params = SamplingParams(max_tokens=150, temperature=0.0, logprobs=0, ignore_eos=True)
    cold = [_cold(llm, p, params) for p in prompts]
    llm.reset_prefix_cache()
    before = llm.scheduler.stats.num_preemptions
    hot = _run(llm, prompts, params)
    assert llm.scheduler.stats.num_preemptions > before
    assert llm.last_stats.prefix_hits > 0
    for h, c in zip(hot, cold, strict=True):
        _same(h, c)


@pytest.mark.parametrize("name", FAMILIES)
def test_batch_invariant_hits_are_bitwise(name: str) -> None:
    llm = engine(name, batch_invariant=True)
    stem = _stem(llm, 4 * BLOCK + 7, seed=5)
    prompt = stem[: 3 * BLOCK + 1] + _stem(llm, 4, seed=6)
    cold = _cold(llm, prompt)
    llm.reset_prefix_cache()
    _run(llm, [stem])
    hot = _run(llm, [prompt])[0]
    assert hot.num_cached_tokens == 3 * BLOCK
    _same(hot, cold, bitwise=True)


def test_requests_that_do_not_reuse() -> None:
    """Prompt logprobs and penalties compute the whole prompt (their blocks are still cached for others);
    ``enable_prefix_caching=False`` turns caching off."""
    llm = engine("tiny-v4")
    stem = _stem(llm, 3 * BLOCK + 2, seed=7)
    llm.reset_prefix_cache()
    _run(llm, [stem])
    for params in (
        SamplingParams(max_tokens=2, prompt_logprobs=0),
        SamplingParams(max_tokens=2, repetition_penalty=1.3),
        SamplingParams(max_tokens=2, presence_penalty=0.5),
    ):
        assert _run(llm, [stem], params)[0].num_cached_tokens == 0
    assert _run(llm, [stem], SamplingParams(max_tokens=2))[0].num_cached_tokens == 3 * BLOCK
    assert not LLM("tiny-v3", dtype="float32", enable_prefix_caching=False).reset_prefix_cache()


def test_hits_on_a_mesh() -> None:
    """dp = 2: each device caches the blocks and snapshots of the sequences it owns, and the router sends a
    request to the device holding its prefix (both requests of a stem go to the stem's device, against the
    load); every request gets the tokens of a cold run."""
    llm = LLM(
        "tiny-v4",
        dtype="float32",
        max_num_seqs=8,
        max_num_batched_tokens=128,
        data_parallel_size=2,
        enable_prefix_caching=True,
        **{"cache.block_size": BLOCK, "cache.num_blocks": 41},
    )
    stems = [_stem(llm, 3 * BLOCK + 2, seed=30 + i) for i in range(2)]
    prompts = [s[: 2 * BLOCK + 1 + i] for s in stems for i in range(2)]
    cold = [_cold(llm, p) for p in prompts]
    llm.reset_prefix_cache()
    _run(llm, stems)  # stem 0 on device 0, stem 1 on device 1
    hot = _run(llm, prompts)
    assert [h.num_cached_tokens for h in hot] == [2 * BLOCK] * 4
    for h, c in zip(hot, cold, strict=True):
        _same(h, c)
