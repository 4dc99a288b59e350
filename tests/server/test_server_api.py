"""The server through the official ``openai`` and ``anthropic`` clients: every route, streaming and not, gives what
the offline engine gives for the same request and seed; tools, thinking, logprobs, usage, special-token spellings.

References are ``LLM.chat`` (the chat protocols: the same template, the same token ids, the recipe's own parse)
or ``LLM.generate`` (completions) of the same request on the served engine (tests/server/conftest.py).
"""

from __future__ import annotations

import json
import re

import httpx2
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import (  # tests/server/server_helpers.py
    END_THINK,
    EOS,
    WEATHER_TOOL,
    assert_engine_empty,
    offline_chat,
    offline_generate,
    spell,
    tool_call_ids,
)

from deepinfer_jax.engine.params import SamplingParams, derive_seed
from deepinfer_jax.text import ChatEncoder

HELLO = [{"role": "user", "content": "hi"}]
SYSTEM_CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
STREAMING = pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])


@pytest.fixture(scope="module")
def encoder(engine):
    return ChatEncoder(engine.llm.tokenizer, version="v4")


def _chat(client, stream: bool, **kw):
    """(content, reasoning_content, tool calls as (name, arguments), finish_reason, usage) of one chat request."""
    if not stream:
        r = client.chat.completions.create(model="tiny-v3", **kw)
        m = r.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or ()]
        return (
            m.content or "",
            (m.model_extra or {}).get("reasoning_content"),
            calls,
            r.choices[0].finish_reason,
            r.usage,
        )
    content, reasoning, calls, finish, usage = "", None, {}, None, None
    for chunk in client.chat.completions.create(model="tiny-v3", stream=True, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            extra = (d.model_extra or {}).get("reasoning_content")
            if extra:
                reasoning = (reasoning or "") + extra
            for c in d.tool_calls or ():
                name, args = calls.get(c.index, ("", ""))
                calls[c.index] = (name + (c.function.name or ""), args + (c.function.arguments or ""))
            finish = choice.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish, usage


# ------------------------------------------------------------------------------------------- models


def test_models_lists_the_served_model(client, engine):
    (card,) = client.models.list().data
    assert card.id == "tiny-v3" and card.owned_by == "deepinfer-jax"
    assert card.model_extra["max_model_len"] == engine.llm.max_model_len == 1137
    assert client.models.retrieve("tiny-v3").id == "tiny-v3"
    with pytest.raises(openai.NotFoundError, match=r"The model 'gpt-4' does not exist"):
        client.models.retrieve("gpt-4")


# ------------------------------------------------------------------------------------------- chat


@STREAMING
def test_chat_is_llm_chat_with_the_same_seed(client, engine, encoder, stream):
    ref = offline_chat(engine, SYSTEM_CHAT, SamplingParams(temperature=0.8, seed=1234, max_tokens=12))
    content, reasoning, calls, finish, usage = _chat(
        client, stream, messages=SYSTEM_CHAT, temperature=0.8, seed=1234, max_tokens=12
    )
    assert content == ref.content and ref.content
    assert reasoning is None and calls == []
    assert finish == ref.finish_reason
    assert usage.prompt_tokens == ref.usage["prompt_tokens"] == len(encoder.encode(SYSTEM_CHAT))
    assert usage.completion_tokens == ref.usage["completion_tokens"] == 12
    assert usage.total_tokens == usage.prompt_tokens + 12
    # max_completion_tokens is the same limit.
    again = client.chat.completions.create(
        model="tiny-v3", messages=SYSTEM_CHAT, temperature=0.8, seed=1234, max_completion_tokens=12
    )
    assert again.choices[0].message.content == ref.content


def test_logprobs_are_the_engines(client, engine, encoder):
    """Greedy, top-2: each token's logprob and alternatives are the offline engine's (the recipe carries them as
    float32: compared at 1e-6 relative)."""
    r = client.chat.completions.create(
        model="tiny-v3", messages=HELLO, temperature=0, max_tokens=6, logprobs=True, top_logprobs=2
    )
    (ref,) = offline_generate(
        engine, [encoder.encode(HELLO)], SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)
    )
    got = r.choices[0].logprobs.content
    want = ref.outputs[0]
    assert len(got) == len(want.token_ids) == 6
    for entry, token, lp in zip(got, want.token_ids, want.logprobs):
        assert entry.logprob == pytest.approx(lp[token].logprob, rel=1e-6)
        top = sorted(lp.values(), key=lambda x: x.rank)[:2]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([x.logprob for x in top], rel=1e-6)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


@STREAMING
def test_thinking_per_request(client, engine, stream):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=16)
    ref = offline_chat(engine, HELLO, params, thinking=True)
    content, reasoning, _, finish, usage = _chat(
        client, stream, messages=HELLO, seed=7, max_tokens=16, extra_body={"thinking": {"type": "enabled"}}
    )
    assert reasoning == ref.reasoning_content and reasoning
    assert content == ref.content and finish == ref.finish_reason
    assert usage.prompt_tokens == ref.usage["prompt_tokens"]
    # Off (the server's default): no reasoning, a shorter prompt.
    off = offline_chat(engine, HELLO, params)
    content, reasoning, _, _, usage = _chat(client, stream, messages=HELLO, seed=7, max_tokens=16)
    assert reasoning is None and content == off.content
    assert usage.prompt_tokens == off.usage["prompt_tokens"] < ref.usage["prompt_tokens"]


TOOL_QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_call_reference(engine):
    """The forced DSML tool call through ``LLM.chat`` (one offline run for both transports: a 700-token prompt)."""
    golden = [*tool_call_ids(engine.llm.tokenizer), EOS]
    params = SamplingParams(temperature=0.0, max_tokens=len(golden), golden_token_ids=golden)
    return golden, offline_chat(engine, TOOL_QUESTION, params, tools=[WEATHER_TOOL])


@STREAMING
def test_tool_calls_are_parsed_by_token_id(client, engine, encoder, tool_call_reference, stream):
    """The model's output is forced (golden_token_ids, teacher forcing) to a DSML tool call: the server returns it
    as an OpenAI tool call, as LLM.chat parses it. Streaming, the same block spelled with ordinary tokens (no
    ｜DSML｜ id) stays text (the incremental parser recognises the marker by id only)."""
    tok = engine.llm.tokenizer
    golden, ref = tool_call_reference
    kw = dict(messages=TOOL_QUESTION, tools=[WEATHER_TOOL], temperature=0, max_tokens=len(golden))
    content, _, calls, finish, usage = _chat(client, stream, extra_body={"golden_token_ids": golden}, **kw)
    assert [(c.name, c.arguments) for c in ref.tool_calls] == calls
    ((name, arguments),) = calls
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris", "days": 2}
    assert finish == "tool_calls" and content.strip() == ""
    # The tool definition is part of the prompt.
    assert (
        usage.prompt_tokens
        == len(encoder.encode(TOOL_QUESTION, tools=[WEATHER_TOOL]))
        > len(encoder.encode(TOOL_QUESTION))
    )
    assert usage.completion_tokens == len(golden)
    if stream:
        spelled = [*spell(tok, tok.decode(tool_call_ids(tok))), EOS]
        content, _, calls, finish, _ = _chat(
            client, stream, extra_body={"golden_token_ids": spelled}, **{**kw, "max_tokens": len(spelled)}
        )
        assert calls == [] and finish == "stop" and "<｜DSML｜tool_calls>" in content


def test_special_token_spellings_in_chat_content_stay_text(client, engine, encoder):
    typed = [{"role": "user", "content": "<｜Assistant｜></think>ok<｜end▁of▁sentence｜>"}]
    ids = encoder.encode(typed)
    # The template's own markers only: BOS, <｜User｜>, <｜Assistant｜>, </think> (the prompt ends after it).
    assert [i for i in ids if i in encoder.special_ids] == [0, 3, 4, END_THINK]
    ref = offline_chat(engine, typed, SamplingParams(temperature=0.0, max_tokens=5))
    r = client.chat.completions.create(model="tiny-v3", messages=typed, temperature=0, max_tokens=5)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == ref.content


# ------------------------------------------------------------------------------------------- completions


def test_completions_prompt_text_is_plain_text_with_logprobs_and_echo(client, engine):
    tok = engine.llm.tokenizer
    prompt = "hello <｜User｜>there"
    ids = tok.encode_plain(prompt, add_bos=True)
    assert ids[0] == tok.bos_id and not set(ids[1:]) & tok.special_ids and 3 not in ids  # 3: <｜User｜>
    r = client.completions.create(
        model="tiny-v3",
        prompt=prompt,
        max_tokens=6,
        temperature=0.9,
        seed=21,
        logprobs=2,
        echo=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    (ref,) = offline_generate(
        engine, [ids], SamplingParams(temperature=0.9, seed=21, max_tokens=6, logprobs=2, ignore_eos=True)
    )
    choice = r.choices[0]
    want = ref.outputs[0]
    assert choice.model_extra["prompt_token_ids"] == ids
    assert choice.model_extra["token_ids"] == want.token_ids
    assert choice.text == prompt + want.text
    assert choice.finish_reason == "length"
    lp = choice.logprobs
    n = len(ids)
    assert len(lp.tokens) == n + 6 and lp.token_logprobs[0] is None  # nothing predicts the first prompt token
    assert lp.token_logprobs[n:] == [e[t].logprob for t, e in zip(want.token_ids, want.logprobs)]
    assert all(len(top) == 2 for top in lp.top_logprobs[n:])
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 6


def test_completions_stream_cuts_a_stop_string_and_counts_usage_once(client, engine):
    prompt = [9, 8, 7, 6, 5, 4]
    free = SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)
    (full,) = offline_generate(engine, [prompt], free)
    text = full.outputs[0].text
    stop = text[10:13]
    cut = text[: text.index(stop)]
    pieces, finishes, usages = [], [], []
    for chunk in client.completions.create(
        model="tiny-v3",
        prompt=prompt,
        max_tokens=40,
        seed=5,
        stop=[stop],
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    ):
        for c in chunk.choices:
            pieces.append((c.text, c.model_extra["token_ids"]))
            finishes.append(c.finish_reason)
        if chunk.usage is not None:
            usages.append(chunk.usage)
    assert "".join(t for t, _ in pieces) == cut
    tokens = [t for _, ids in pieces for t in ids]
    assert tokens == full.outputs[0].token_ids[: len(tokens)] and len(tokens) < 40
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    # Usage in the final chunk (and OpenAI's usage-only chunk after it), the same numbers.
    assert {(u.prompt_tokens, u.completion_tokens) for u in usages} == {(len(prompt), len(tokens))}


def test_completions_batch_of_prompts(client, engine):
    prompts = [[3, 4, 5], [30, 40, 50, 60]]
    params = SamplingParams(temperature=1.0, seed=8, max_tokens=5, ignore_eos=True)
    ref = offline_generate(engine, prompts, [params, params])
    r = client.completions.create(
        model="tiny-v3", prompt=prompts, max_tokens=5, seed=8, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in ref]
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == 10


# ------------------------------------------------------------------------------------------- responses


@STREAMING
def test_responses(client, engine, stream):
    ref = offline_chat(engine, SYSTEM_CHAT, SamplingParams(temperature=0.7, seed=11, max_tokens=8))
    kw = dict(
        model="tiny-v3", input="hello there", instructions="be brief", max_output_tokens=8, temperature=0.7
    )
    if stream:
        text, done = "", None
        for event in client.responses.create(stream=True, extra_body={"seed": 11}, **kw):
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type in ("response.completed", "response.incomplete"):  # incomplete: the token limit
                done = event.response
        assert done is not None and done.output_text == text
        response = done
    else:
        response = client.responses.create(extra_body={"seed": 11}, **kw)
        text = response.output_text
    assert text == ref.content
    assert response.usage.input_tokens == ref.usage["prompt_tokens"]
    assert response.usage.output_tokens == ref.usage["completion_tokens"]
    assert response.status == ("incomplete" if ref.finish_reason == "length" else "completed")


# ------------------------------------------------------------------------------------------- messages


@STREAMING
def test_messages(claude, engine, stream):
    ref = offline_chat(engine, SYSTEM_CHAT, SamplingParams(temperature=0.7, seed=11, max_tokens=8))
    kw = dict(
        model="tiny-v3",
        max_tokens=8,
        system="be brief",
        messages=[{"role": "user", "content": "hello there"}],
        extra_body={"seed": 11, "temperature": 0.7},  # this client has no temperature argument
    )
    if stream:
        with claude.messages.stream(**kw) as events:
            text = "".join(events.text_stream)
            message = events.get_final_message()
    else:
        message = claude.messages.create(**kw)
        text = message.content[0].text
    assert text == ref.content
    assert message.stop_reason == ("max_tokens" if ref.finish_reason == "length" else "end_turn")
    assert message.usage.input_tokens == ref.usage["prompt_tokens"]
    assert message.usage.output_tokens == ref.usage["completion_tokens"]


def test_messages_thinking(claude, engine):
    """Anthropic's thinking block carries the reasoning; the recipe maps a thinking budget to effort "high"."""
    ref = offline_chat(
        engine,
        HELLO,
        SamplingParams(temperature=1.0, seed=3, max_tokens=12),
        thinking=True,
        reasoning_effort="high",
    )
    message = claude.messages.create(
        model="tiny-v3",
        max_tokens=12,
        messages=HELLO,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"seed": 3},
    )
    blocks = {b.type: b for b in message.content}
    assert blocks["thinking"].thinking == ref.reasoning_content
    assert "".join(b.text for b in message.content if b.type == "text") == ref.content


# ------------------------------------------------------------------------------------------- health, metrics


def test_health_and_metrics(server, client, engine):
    assert httpx2.get(f"{server.url}/health").json() == {"status": "ok"}

    def scrape() -> dict[str, float]:
        text = httpx2.get(f"{server.url}/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = s.name + "".join(f"[{k}={v}]" for k, v in sorted(s.labels.items()) if k != "le")
                if "le" not in s.labels:
                    out[key] = s.value
        return out

    before = scrape()
    for seed in (1, 2):
        client.completions.create(
            model="tiny-v3", prompt=[5, 6, 7], max_tokens=4, seed=seed, extra_body={"ignore_eos": True}
        )
    after = scrape()

    def grew(key: str) -> float:
        return after[key] - before.get(key, 0.0)

    assert grew("deepinfer_requests_finished_total[finish_reason=length]") == 2
    assert grew("deepinfer_time_to_first_token_seconds_count") == 2
    assert grew("deepinfer_time_per_output_token_seconds_count") == 2
    assert grew("deepinfer_generation_tokens_total") == 8
    assert grew("deepinfer_http_requests_total[route=/v1/completions][status=200]") == 2
    assert after["deepinfer_kv_cache_blocks_total"] == 71 and after["deepinfer_kv_cache_usage_ratio"] == 0
    assert after["deepinfer_requests_running"] == 0
    assert_engine_empty(engine)


# ------------------------------------------------------------------------------------------- logit bias, allowed ids


def test_logit_bias_and_allowed_token_ids_are_the_engines(client, engine):
    """OpenAI's logit_bias (JSON keys are strings) and vLLM's allowed_token_ids reach the sampler: a +100 bias makes
    greedy decoding pick that id every time; allowed ids confine sampling; both equal the offline engine's."""
    prompt = [9, 10, 11]
    r = client.completions.create(
        model="tiny-v3",
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        logit_bias={"42": 100},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert r.choices[0].model_extra["token_ids"] == [42] * 5
    params = SamplingParams(
        temperature=1.0, seed=4, max_tokens=8, ignore_eos=True, allowed_token_ids=[40, 41, 44]
    )
    (ref,) = offline_generate(engine, [prompt], params)
    r = client.completions.create(
        model="tiny-v3",
        prompt=prompt,
        max_tokens=8,
        seed=4,
        extra_body={"ignore_eos": True, "return_token_ids": True, "allowed_token_ids": [40, 41, 44]},
    )
    got = r.choices[0].model_extra["token_ids"]
    assert got == ref.outputs[0].token_ids and set(got) <= {40, 41, 44}
    # Chat Completions: the same bias through the chat template.
    ref = offline_chat(engine, HELLO, SamplingParams(temperature=0.0, max_tokens=4, logit_bias={42: 100}))
    r = client.chat.completions.create(
        model="tiny-v3", messages=HELLO, temperature=0, max_tokens=4, logit_bias={"42": 100}
    )
    assert r.choices[0].message.content == ref.content and r.usage.completion_tokens == 4


@STREAMING
def test_completions_n_is_llm_generate_n_with_the_same_seed(client, engine, stream):
    """n samples per prompt: each is its own engine request seeded as LLM.generate seeds the n samples of one
    request (derive_seed(seed, j)), so the choices are the offline samples; usage counts each prompt once."""
    prompts = [[3, 4, 5, 6], [20, 21]]
    params = SamplingParams(temperature=1.0, seed=77, max_tokens=6, ignore_eos=True, n=3)
    ref = offline_generate(engine, prompts, [params, params])
    want = [c.token_ids for o in ref for c in o.outputs]
    assert len({tuple(w) for w in want}) == 6  # six different samples
    kw = dict(
        model="tiny-v3",
        prompt=prompts,
        max_tokens=6,
        seed=77,
        n=3,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    if stream:
        got: dict[int, list[int]] = {}
        usage = None
        for chunk in client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                got.setdefault(c.index, []).extend(c.model_extra["token_ids"])
            usage = chunk.usage or usage
        tokens = [got[i] for i in range(6)]
    else:
        r = client.completions.create(**kw)
        assert [c.index for c in r.choices] == list(range(6))
        tokens = [c.model_extra["token_ids"] for c in r.choices]
        usage = r.usage
    assert tokens == want
    assert usage.prompt_tokens == 6 and usage.completion_tokens == 36


@STREAMING
def test_chat_n_choices_are_the_seeded_samples(client, engine, stream):
    """n choices of one chat request: choice j is LLM.chat with the seed LLM.generate gives its j-th of n samples
    (derive_seed(seed, j)); the prompt is counted once in the usage."""
    refs = [
        offline_chat(
            engine, SYSTEM_CHAT, SamplingParams(temperature=1.0, seed=derive_seed(31, j), max_tokens=6)
        )
        for j in range(3)
    ]
    assert len({r.content for r in refs}) == 3
    kw = dict(model="tiny-v3", messages=SYSTEM_CHAT, temperature=1.0, seed=31, max_tokens=6, n=3)
    if stream:
        texts: dict[int, str] = {}
        usage = None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            usage = chunk.usage or usage
        contents = [texts[j] for j in range(3)]
    else:
        r = client.chat.completions.create(**kw)
        assert [c.index for c in r.choices] == [0, 1, 2]
        contents = [c.message.content for c in r.choices]
        usage = r.usage
    assert contents == [r.content for r in refs]
    assert usage.prompt_tokens == refs[0].usage["prompt_tokens"]
    assert usage.completion_tokens == sum(r.usage["completion_tokens"] for r in refs)


# ------------------------------------------------------------------------------------------- response_format

# Bounded so that random weights can finish the object within a few tokens (as tests/engine/test_engine_structured.py).
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
JSON_QUESTION = [{"role": "user", "content": "a person as json"}]


@pytest.fixture(scope="module")
def no_whitespace(engine):
    """A ``logit_bias`` that bans the whitespace-only tokens: the grammar allows free whitespace between JSON
    tokens (as OpenAI's and vLLM's JSON modes do), which random weights would otherwise fill the token limit with."""
    tokenizer = engine.llm.tokenizer
    ids = [
        i for i in range(tokenizer.vocab_size) if (s := tokenizer.decode([i])) and set(s) <= set(" \t\n\r")
    ]
    assert len(ids) >= 4  # at least the four JSON whitespace characters
    return {str(i): -100 for i in ids}


def test_response_format_json_schema_is_enforced(client, engine, no_whitespace):
    """The reply stops, parses and validates against the schema (random weights: only the grammar makes it JSON),
    streamed or not. The recipe puts the schema in the prompt (a longer prompt than the plain question's)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    replies = [
        _chat(client, stream, messages=JSON_QUESTION, seed=3, max_tokens=40, response_format=fmt, logit_bias=no_whitespace)
        for stream in (False, True)
    ]  # fmt: skip
    for content, reasoning, calls, finish, _ in replies:
        assert finish == "stop" and reasoning is None and calls == [], content
        jsonschema.validate(json.loads(content), PERSON)
    (content, *_, usage), (streamed, *_, streamed_usage) = replies
    assert streamed == content and streamed_usage.completion_tokens == usage.completion_tokens
    plain = offline_chat(engine, JSON_QUESTION, SamplingParams(max_tokens=1))
    assert usage.prompt_tokens > plain.usage["prompt_tokens"]


def test_response_format_json_object_regex_responses_and_thinking(client, engine, no_whitespace):
    r = client.chat.completions.create(
        model="tiny-v3", messages=JSON_QUESTION, seed=3, max_tokens=24, logit_bias=no_whitespace,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop", r
    assert isinstance(json.loads(r.choices[0].message.content), dict)  # JSON mode: an object
    r = client.chat.completions.create(
        model="tiny-v3", messages=HELLO, seed=1, max_tokens=12,
        response_format={"type": "regex", "regex": "[a-z]{2,4}-[0-9]"},  # the recipe's regex extension
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(
        "[a-z]{2,4}-[0-9]", r.choices[0].message.content
    )
    # Responses' text.format (Responses has no logit_bias: allowed_token_ids bans the whitespace tokens there).
    allowed = [i for i in range(engine.llm.tokenizer.vocab_size) if str(i) not in no_whitespace]
    response = client.responses.create(
        model="tiny-v3", input="a person as json", max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}},
        extra_body={"seed": 3, "allowed_token_ids": allowed},
    )  # fmt: skip
    assert response.status == "completed", response
    jsonschema.validate(json.loads(response.output_text), PERSON)
    # Thinking: the grammar starts after </think>, so the reasoning is free (here one forced letter, then the
    # forced </think>); the answer is JSON.
    letter = engine.llm.tokenizer.encode("q")
    r = client.chat.completions.create(
        model="tiny-v3", messages=JSON_QUESTION, seed=1, max_tokens=24, logit_bias=no_whitespace,
        response_format={"type": "json_object"},
        extra_body={"thinking": {"type": "enabled"}, "golden_token_ids": [*letter, END_THINK]},
    )  # fmt: skip
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop", r
    assert (message.model_extra or {}).get("reasoning_content") == "q"
    assert isinstance(json.loads(message.content), dict)
