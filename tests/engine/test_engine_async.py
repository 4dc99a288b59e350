"""``AsyncLLM`` on tiny-v3: streamed outputs of every kind equal the offline engine's, aborts free at once,
admission is bounded, bad input never reaches the engine, an engine failure reaches every consumer; on one
device and on a ``dp=2 x ep=2`` mesh.

The reference of every online run is ``LLM.generate`` of the same requests (same seeds) on the same engine,
inside ``AsyncLLM.exclusive()``. The engines are batch invariant, so a request's tokens cannot depend on the
requests it shared steps with online; with seeded sampling (keyed by seed and position) they must then be
exactly the offline tokens.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from deepinfer_jax.engine.async_llm import AsyncLLM, EngineDeadError, QueueFullError
from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.engine.params import RequestOutputKind, SamplingParams

K = RequestOutputKind
# 72 blocks of 16 tokens (one reserved) and 17 state slots of tiny-v3 in float32 (test_engine_chat.py's sizes).
ENGINE = dict(
    dtype="float32",
    max_num_seqs=16,
    max_num_batched_tokens=64,
    kv_cache_memory=72 * 4 * 16 * 96 * 4 + 17 * 4 * 513,
    batch_invariant=True,
)
BLOCK = {"cache.block_size": 16}


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLM(LLM("tiny-v3", **ENGINE, **BLOCK))
    yield eng
    eng.shutdown()


def _requests(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, 512, int(k)).tolist() for k in rng.integers(3, 40, n)]
    params = [
        SamplingParams(
            temperature=1.0, top_k=40, max_tokens=int(m), seed=1000 + seed * 100 + i, ignore_eos=True
        )
        for i, m in enumerate(rng.integers(4, 20, n))
    ]
    return prompts, params


def _offline(engine: AsyncLLM, prompts, params):
    with engine.exclusive() as llm:
        return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


async def _collect(engine: AsyncLLM, prompt, params, request_id):
    """Every output of one request and the (tokens, text) a consumer of its kind reconstructs."""
    outs = [o async for o in engine.generate(prompt, params, request_id)]
    if params.output_kind is K.DELTA:
        tokens = [t for o in outs for t in o.outputs[0].token_ids]
        text = "".join(o.outputs[0].text for o in outs)
    else:
        tokens, text = outs[-1].outputs[0].token_ids, outs[-1].outputs[0].text
    return outs, tokens, text


def _assert_empty(llm: LLM) -> None:
    """No request left and every block and state slot of every device free."""
    sched = llm.scheduler
    assert not sched.has_unfinished_requests()
    for dev in sched.devices:
        assert dev.blocks.num_free == dev.blocks.capacity
        assert dev.slots.num_free == dev.slots.capacity
        dev.blocks.check_consistency()


# ------------------------------------------------------------------------------------------- output kinds


def test_every_output_kind_streams_the_offline_tokens(engine):
    prompts, params = _requests(6, seed=1)
    ref = _offline(engine, prompts, params)

    async def main():
        jobs = [
            _collect(engine, p, q.replace(output_kind=kind), f"kinds-{i}-{kind.name}")
            for i, (p, q) in enumerate(zip(prompts, params))
            for kind in K
        ]
        return await asyncio.gather(*jobs)

    results = iter(asyncio.run(main()))
    for r in ref:
        want = r.outputs[0]
        for kind in K:
            outs, tokens, text = next(results)
            assert tokens == want.token_ids and text == want.text, kind
            assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
            assert outs[-1].outputs[0].finish_reason == "length"
            if kind is K.FINAL_ONLY:
                assert len(outs) == 1
            else:
                # One output per step that produced a token: as many as tokens, each holding at least one new.
                assert len(outs) == len(want.token_ids)
                if kind is K.CUMULATIVE:
                    lengths = [len(o.outputs[0].token_ids) for o in outs]
                    assert lengths == list(range(1, len(want.token_ids) + 1))
    _assert_empty(engine.llm)


def test_streamed_text_never_shows_what_a_stop_string_cuts(engine):
    """A stop string taken from the middle of a free run's text: the deltas add up to the text before it, and no
    delta ever carried a character at or after the stop string's start."""
    prompt = [5, 17, 33, 2, 90]
    free = SamplingParams(temperature=1.0, max_tokens=40, seed=77, ignore_eos=True)
    (full,) = _offline(engine, [prompt], [free])
    text = full.outputs[0].text
    stop = text[12:15]
    assert len(stop) == 3 and text.index(stop) >= 6, "pick another seed: the stop string must occur late"
    cut = text[: text.index(stop)]

    async def main():
        return await _collect(engine, prompt, free.replace(stop=[stop], output_kind=K.DELTA), "stopper")

    outs, tokens, got = asyncio.run(main())
    assert got == cut
    seen = ""
    for o in outs:
        seen += o.outputs[0].text
        assert cut.startswith(seen)
    assert outs[-1].outputs[0].finish_reason == "stop" and outs[-1].outputs[0].stop_reason == stop
    # The tokens are the free run's up to the one that completed the stop string.
    assert tokens == full.outputs[0].token_ids[: len(tokens)]


# ------------------------------------------------------------------------------------------- aborts


def test_abort_frees_blocks_and_slot_at_once(engine):
    long = SamplingParams(temperature=1.0, max_tokens=400, seed=3, ignore_eos=True, output_kind=K.DELTA)
    prompt = list(range(2, 40))

    async def main():
        outs = []
        async for out in engine.generate(prompt, long, "to-abort"):
            outs.append(out)
            if len(outs) == 3:
                stats = engine.stats()
                assert stats.running == 1 and stats.cache_blocks_used >= 3  # 38 + 3 tokens in 16-token blocks
                await engine.abort("to-abort")
        return outs

    outs = asyncio.run(main())
    last = outs[-1].outputs[0]
    assert outs[-1].finished and last.finish_reason == "abort"
    # Applied between two steps, long before the 400 tokens (the exact step accounting is in
    # test_engine_scheduler_abort.py; here outputs already queued for the consumer add a few).
    assert sum(len(o.outputs[0].token_ids) for o in outs) < 30
    _assert_empty(engine.llm)
    assert engine.stats().cache_blocks_used == 0


def test_leaving_the_stream_aborts(engine):
    prompts, params = _requests(4, seed=2)
    long = [p.replace(max_tokens=300, output_kind=K.DELTA) for p in params]
    before = engine.stats().finished.get("abort", 0)

    async def consume(i):
        n = 0
        async for _ in engine.generate(prompts[i], long[i], f"leave-{i}"):
            n += 1
            if n == 2 + i:
                break  # the consumer goes away (a client that disconnected)
        return n

    async def main():
        counts = await asyncio.gather(*(consume(i) for i in range(4)))
        while engine.stats().unfinished:
            await asyncio.sleep(0.01)
        return counts

    assert asyncio.run(main()) == [2, 3, 4, 5]
    assert engine.stats().finished.get("abort", 0) == before + 4
    _assert_empty(engine.llm)


# ------------------------------------------------------------------------------------------- admission


def test_admission_is_bounded(engine):
    """max_num_seqs running + max_queued_requests waiting; past that QueueFullError at once, nothing queued."""
    prompts, params = _requests(1, seed=3)
    p = params[0].replace(output_kind=K.FINAL_ONLY)
    old = engine.max_queued_requests
    engine.max_queued_requests = 2
    limit = engine.max_running + 2
    assert limit == 18

    async def main():
        with (
            engine.exclusive()
        ):  # the engine runs nothing meanwhile, so every accepted request stays unfinished
            streams = [engine.add_request(prompts[0], p, f"bound-{i}") for i in range(limit)]
            refused = engine.stats().refused
            with pytest.raises(QueueFullError, match=r"server.max_queued_requests = 2"):
                engine.add_request(prompts[0], p, "one-too-many")
            assert engine.stats().refused == refused + 1 and engine.stats().unfinished == limit
        return [[o async for o in s] for s in streams]

    try:
        outs = asyncio.run(main())
    finally:
        engine.max_queued_requests = old
    assert all(o[-1].outputs[0].finish_reason == "length" for o in outs)
    _assert_empty(engine.llm)


@pytest.mark.parametrize(
    "prompt, params, error, match",
    [
        ([], None, ValueError, r"prompt_token_ids is empty"),
        ([3, 600], None, ValueError, r"prompt_token_ids\[1\] = 600 is outside the vocabulary \[0, 512\)"),
        ([3, 4], SamplingParams(max_tokens=2000), ValueError, r"exceeds max_model_len"),
        ({"prompt_ids": [3]}, None, ValueError, r"unknown keys \['prompt_ids'\]"),
        ([3, 4], "greedy", TypeError, r"sampling_params must be a SamplingParams"),
        (
            [3, 4],
            SamplingParams(n=2),
            ValueError,
            r"sampling_params.n = 2: AsyncLLM streams one sample per request",
        ),
    ],
    ids=["empty", "vocabulary", "too-long", "bad-dict", "bad-params", "n"],
)
def test_bad_input_never_reaches_the_engine(engine, prompt, params, error, match):
    accepted = engine.stats().accepted

    async def main():
        engine.add_request(prompt, params, "bad")

    with pytest.raises(error, match=match):
        asyncio.run(main())
    assert engine.stats().accepted == accepted and engine.stats().unfinished == 0


def test_text_and_dict_prompts_are_the_offline_prompts(engine):
    tok = engine.llm.tokenizer
    p = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, output_kind=K.FINAL_ONLY)
    ids = tok.encode("hello there", add_bos=True)
    (ref,) = _offline(engine, [ids], [p])

    async def main():
        a = [o async for o in engine.generate("hello there", p, "text")][-1]
        b = [o async for o in engine.generate({"prompt_token_ids": ids, "prompt": "x"}, p, "dict")][-1]
        return a, b

    a, b = asyncio.run(main())
    assert a.prompt == "hello there" and a.prompt_token_ids == ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == ref.outputs[0].token_ids
    assert b.prompt == "x"


# ------------------------------------------------------------------------------------------- the mesh


def test_mesh_streams_the_offline_tokens_and_frees_every_device():
    llm = LLM(
        "tiny-v3",
        dtype="float32",
        data_parallel_size=2,
        expert_parallel_size=2,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        kv_cache_memory="16MiB",
        batch_invariant=True,
        **{"cache.block_size": 16, "cache.num_blocks": 24},
    )
    prompts, params = _requests(6, seed=4)
    with AsyncLLM(llm) as engine:
        ref = _offline(engine, prompts, params)

        async def main():
            jobs = [
                _collect(engine, p, q.replace(output_kind=K.DELTA), f"mesh-{i}")
                for i, (p, q) in enumerate(zip(prompts, params))
            ]
            long = SamplingParams(
                temperature=1.0, max_tokens=200, seed=9, ignore_eos=True, output_kind=K.DELTA
            )

            async def aborted():
                async for _ in engine.generate(prompts[0], long, "mesh-abort"):
                    break

            results = await asyncio.gather(*jobs, aborted())
            while engine.stats().unfinished:
                await asyncio.sleep(0.01)
            return results[:-1]

        results = asyncio.run(main())
        assert {llm.scheduler.devices[d].stats.num_steps > 0 for d in range(4)} == {True}
    for (_, tokens, text), r in zip(results, ref):
        assert tokens == r.outputs[0].token_ids and text == r.outputs[0].text
    _assert_empty(llm)


# ------------------------------------------------------------------------------------------- failure


def test_a_failed_step_ends_its_requests_and_the_engine_serves_on():
    """The step raising (a bug, an XLA error): the requests of that run end with finish_reason="error" naming the
    failure, the engine recovers (LLM's own recovery: every block and slot free) and the next request gets the
    offline tokens. When the recovery fails too, every unfinished stream and every later add_request raises
    EngineDeadError naming the failure."""
    llm = LLM("tiny-v3", **ENGINE, **BLOCK)  # the module engine's settings: its compiled steps are cached
    executor = llm.executor
    calls = {"n": 0, "fail_at": 3}
    original = executor.run

    def failing(plan):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise RuntimeError("injected step failure")
        return original(plan)

    executor.run = failing
    engine = AsyncLLM(llm)
    prompts, params = _requests(3, seed=5)

    async def first_run():
        async def one(i):
            outs = [
                o
                async for o in engine.generate(
                    prompts[i], params[i].replace(max_tokens=50, output_kind=K.DELTA)
                )
            ]
            return outs[-1].outputs[0]

        return await asyncio.gather(*(one(i) for i in range(3)))

    ends = asyncio.run(first_run())
    assert [c.finish_reason for c in ends] == ["error"] * 3
    assert all("injected step failure" in c.error and "recovered" in c.error for c in ends)
    assert engine.is_running and engine.stats().step_failures == 1
    _assert_empty(llm)
    # The engine serves on: the next request gets the offline engine's tokens.
    calls["fail_at"] = -1
    (want,) = _offline(engine, prompts[:1], params[:1])
    _, got, _ = asyncio.run(_collect(engine, prompts[0], params[0], "after"))
    assert got == want.outputs[0].token_ids
    _assert_empty(llm)

    # A failure that the recovery cannot mend: the loop dies, and every consumer hears it.
    calls["n"], calls["fail_at"] = 0, 2

    def broken_recover(err):
        raise RuntimeError("the device is gone") from err

    llm._recover = broken_recover

    async def dead():
        with pytest.raises(EngineDeadError, match=r"the device is gone"):
            async for _ in engine.generate(prompts[1], params[1].replace(max_tokens=50)):
                pass
        with pytest.raises(EngineDeadError, match=r"the device is gone"):
            engine.add_request(prompts[0], params[0])

    asyncio.run(dead())
    assert not engine.is_running and isinstance(engine.error, RuntimeError)
    engine.shutdown()
