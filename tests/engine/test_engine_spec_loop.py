"""The decode loop running speculative steps (docs/engine.md "The decode loop", docs/speculative.md): one
iteration of a ``scheduler.num_decode_steps`` loop is one speculative step (verify, accept, draft), so a row
emits 1 to ``k + 1`` tokens per iteration and the device places each iteration's row at its slot's pending
position.

The model is the trained ``shakespeare-v3`` (its MTP layer accepts about a third of its first drafts on this
text, so runs of several tokens end inside loops; random weights accept almost nothing) with ``k = 3`` drafts.
The reference is the same engine with one step per call: greedy and seeded sampled rows must give the same
tokens, stop ids, ``max_tokens``, ``min_tokens`` and stop strings must end where it ends them. Variable-length
verification re-splits a call's verify rows on the device every iteration; its greedy tokens are the same too
(its seeded sampled rows are not compared: which random stream draws a token depends on how many drafts the
row verified, which depends on the timing of the splits, as in any variable-length run).

Budgets: 4 sequences and 16 tokens per step, one compiled bucket that 4 decode rows of 1 + 3 tokens fill (the
six prompts queue, so the first calls are one-step ones and the loops start once nothing waits).
"""

from __future__ import annotations

import functools

import numpy as np

from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.engine.params import SamplingParams

K = 3
PROMPTS = [
    "ROMEO:\nBut soft, what light",
    "KING HENRY:\nOnce more unto the breach",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "HAMLET:\nTo be, or not",
    "MACBETH:\nIs this a dagger",
    "JULIET:\nO Romeo, Romeo",
]


@functools.cache
def _llm(steps: int, varlen: bool = False, interval: int = 2) -> LLM:
    return LLM(
        "shakespeare-v3",
        dtype="float32",
        num_draft_tokens=K,
        speculative_variable_length=varlen,
        max_num_seqs=4,
        max_num_batched_tokens=4 * (1 + K),  # one compiled bucket, (16, 4): decode rows fill it
        kv_cache_memory="64MiB",
        **{
            "cache.block_size": 16,
            "scheduler.num_decode_steps": steps,
            **({"scheduler.decode_stream_interval": interval} if steps > 1 else {}),
            "speculative.latency_cache_dir": None,
        },
    )


def _run(llm: LLM, params: list[SamplingParams]):
    return llm.generate(PROMPTS, params, use_tqdm=False)


@functools.cache
def _cases() -> tuple[list[SamplingParams], list]:
    """The workload and the one-step engine's outputs. A stop id and a stop string are taken from a first
    greedy run, so that they end their requests in the middle of an output."""
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    first = _run(_llm(1), [free] * len(PROMPTS))
    seq = first[2].outputs[0].token_ids
    stop_at = next(j for j in range(5, len(seq)) if seq[j] not in seq[:j])
    text = first[4].outputs[0].text
    params = [
        free,
        free.replace(max_tokens=17),
        free.replace(stop_token_ids=[seq[stop_at]]),
        SamplingParams(
            temperature=0.8, seed=11, max_tokens=20, repetition_penalty=1.2, ignore_eos=True, logprobs=1
        ),
        free.replace(stop=[text[len(text) // 2 : len(text) // 2 + 3]]),
        SamplingParams(temperature=0.0, max_tokens=20, min_tokens=6, logprobs=1),
    ]
    return params, _run(_llm(1), params)


def _same(ref, got, which) -> None:
    for i in which:
        a, b = ref[i].outputs[0], got[i].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (
            a.token_ids,
            a.text,
            a.finish_reason,
            a.stop_reason,
        ), f"request {i}"


def test_decode_loop_runs_speculative_steps():
    """Fixed length: the one-step engine's tokens (greedy, seeded with a penalty, every stop rule), logprobs
    within float32 noise; the decode steps ran as loops whose iterations emitted runs of accepted drafts; a
    second run compiles nothing."""
    params, ref = _cases()
    llm = _llm(4)
    got = _run(llm, params)
    _same(ref, got, range(len(params)))
    assert ref[2].outputs[0].finish_reason == "stop" and len(ref[2].outputs[0].token_ids) < 24
    assert ref[4].outputs[0].finish_reason == "stop" and len(ref[4].outputs[0].token_ids) < 24
    np.testing.assert_allclose(
        [e[t].logprob for t, e in zip(got[0].outputs[0].token_ids, got[0].outputs[0].logprobs)],
        [e[t].logprob for t, e in zip(ref[0].outputs[0].token_ids, ref[0].outputs[0].logprobs)],
        atol=1e-4,
    )
    dev = llm.scheduler.devices[0].stats
    assert dev.num_loop_steps > 0 and dev.num_loop_iterations > dev.num_loop_steps
    stats = llm.last_stats
    assert stats.mean_accepted_length > 1.2  # runs of accepted drafts, inside the loops
    assert stats.steps < sum(len(g.outputs[0].token_ids) for g in got) // 4
    compiled = llm.executor.compile_count
    again = _run(llm, params)
    _same(got, again, range(len(params)))
    assert llm.executor.compile_count == compiled, "the steady state must not recompile"
    # Rows that end at max_tokens inside a run stop on the device at that length (their true length, which
    # the host knows only as a lower bound while the call runs): no iteration samples past it.
    dev = llm.scheduler.devices[0].stats
    wasted = dev.num_wasted_samples
    lengths = [
        SamplingParams(temperature=0.0, max_tokens=5 + 3 * i, ignore_eos=True, logprobs=1) for i in range(6)
    ]
    ends = _run(llm, lengths)
    assert [len(o.outputs[0].token_ids) for o in ends] == [p.max_tokens for p in lengths]
    assert dev.num_wasted_samples == wasted
    assert llm.executor.compile_count == compiled


def test_decode_loop_variable_length_greedy():
    """Variable length, tokens read when each call is done: the greedy requests give the one-step engine's
    tokens while the device re-splits the verify rows every iteration."""
    params, ref = _cases()
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    llm = _llm(4, varlen=True, interval=0)
    # Without logprobs: the programs of the latency curve's start-up probes (logprobs are not compared here).
    got = _run(llm, [p.replace(logprobs=None) for p in params])
    _same(ref, got, greedy)
    assert llm.scheduler.devices[0].stats.num_loop_steps > 0
    assert llm.last_stats.mean_accepted_length > 1.2


def test_decode_loop_streams_each_speculative_iteration():
    """AsyncLLM, DELTA: the loop engine streams an output per iteration of a call (callbacks every 2
    iterations), each with the 1 to k + 1 tokens its step emitted; together they are the one-step engine's."""
    import asyncio

    from deepinfer_jax.engine.async_llm import AsyncLLM
    from deepinfer_jax.engine.params import RequestOutputKind

    params, ref = _cases()
    llm = _llm(4)
    calls = llm.scheduler.devices[0].stats.num_loop_steps
    with AsyncLLM(llm) as engine:

        async def main():
            stream = engine.generate(
                PROMPTS[0], params[0].replace(output_kind=RequestOutputKind.DELTA), "spec-loop-stream"
            )
            return [o async for o in stream]

        outs = asyncio.run(main())
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert [t for chunk in tokens for t in chunk] == list(ref[0].outputs[0].token_ids)
    assert llm.scheduler.devices[0].stats.num_loop_steps > calls
    assert all(1 <= len(chunk) <= K + 1 for chunk in tokens)
    assert len(outs) < len(ref[0].outputs[0].token_ids)  # accepted runs arrive together
