"""``LLM.chat`` on tiny-v3: the parse of exactly what ``generate`` produces, batches, templates, stops, errors.

The reference for every engine run is ``generate(prompt_token_ids=ChatEncoder(...).encode(...))`` with the same
sampling parameters, parsed by a parser built here; the parse itself is checked independently on hand-built
ids (reasoning, ``</think>``, answer, a DSML tool call, EOS) whose expected texts are known by construction.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from deepinfer_jax.engine import chat as chat_lib
from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.engine.params import CompletionOutput, SamplingParams
from deepinfer_jax.models import builtin
from deepinfer_jax.text import (
    ChatEncoder,
    ChatOutput,
    EncodedChat,
    Tokenizer,
    ToolCall,
    write_synthetic_tokenizer,
)

# test_engine_llm.py's engine with a larger cache: 72 blocks of 16 tokens (one reserved), a block being 4 cached
# layers x 16 tokens x 96 float32 values, plus the state of 17 slots x 4 B x (1 + 512). One request may hold 1136
# tokens: a prompt carrying a tool definition is about 700 tokens of the synthetic vocabulary.
ENGINE = dict(
    dtype="float32",
    max_num_seqs=16,
    max_num_batched_tokens=64,
    kv_cache_memory=72 * 4 * 16 * 96 * 4 + 17 * 4 * 513,
)
BLOCK = {"cache.block_size": 16}

# Ids of the synthetic tokenizer's markers (docs/text.md): EOS, <think>, </think>, ｜DSML｜, <｜System｜>.
EOS, THINK, END_THINK, DSML, SYSTEM = 1, 5, 6, 7, 9

HELLO = [{"role": "user", "content": "hi"}]
SYSTEM_CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _engine(model: str = "tiny-v3", **kw) -> LLM:
    return LLM(model, **ENGINE, **BLOCK, **kw)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return _engine()


@pytest.fixture(scope="module")
def encoder(llm: LLM) -> ChatEncoder:
    return ChatEncoder(llm.tokenizer, version="v4")


def _reference(llm: LLM, encoded: EncodedChat, params: SamplingParams) -> tuple[list[int], ChatOutput]:
    """What chat must return: generate over the encoder's ids, parsed by a fresh parser."""
    completion = llm.generate(
        prompt_token_ids=list(encoded.token_ids), sampling_params=params, use_tqdm=False
    )[0].outputs[0]
    parser = encoded.output_parser()
    parser.push(completion.token_ids)
    parsed = dataclasses.replace(
        parser.finish(completion.finish_reason),
        prompt_token_ids=tuple(encoded.token_ids),
        token_ids=tuple(completion.token_ids),
        logprobs=completion.logprobs,
    )
    return completion.token_ids, parsed


def _plain_text(tokenizer: Tokenizer, ids: list[int]) -> str:
    """Independent expectation for a reply with no structural marker: the decode without special ids."""
    return tokenizer.decode([i for i in ids if i not in tokenizer.special_ids])


def _assert_decoded(got: str, text: str, *, cut: bool) -> None:
    """``got`` is the full decode ``text``; a reply cut by the token limit inside a character loses the bytes
    of that incomplete character (documented in docs/text.md), which a full decode shows as U+FFFD."""
    if cut:
        assert text.startswith(got) and set(text[len(got) :]) <= {"\ufffd"}, (got, text)
    else:
        assert got == text


# ------------------------------------------------------------------------------------ chat == parse(generate)

CASES = [
    pytest.param(HELLO, SamplingParams(temperature=0.0, max_tokens=12), False, id="greedy"),
    pytest.param(SYSTEM_CHAT, SamplingParams(temperature=0.0, max_tokens=12), True, id="greedy-thinking"),
    pytest.param(HELLO, SamplingParams(temperature=1.0, max_tokens=16, seq_seed=1234), False, id="seeded"),
    pytest.param(
        SYSTEM_CHAT,
        SamplingParams(temperature=0.8, top_k=40, max_tokens=16, seq_seed=77),
        True,
        id="seeded-thinking",
    ),
]


@pytest.mark.parametrize("messages, params, thinking", CASES)
def test_chat_is_the_parse_of_generate(llm, encoder, messages, params, thinking):
    (out,) = llm.chat(messages, params, thinking=thinking, use_tqdm=False)
    encoded = encoder.encode_chat(messages, thinking=thinking)
    ids, expected = _reference(llm, encoded, params)
    assert out == expected
    # The prompt ends where the reply starts: after <think> in thinking mode, after </think> otherwise.
    assert encoded.token_ids[-1] == (THINK if thinking else END_THINK)
    # Usage is counted on the ids themselves.
    assert out.usage["prompt_tokens"] == len(encoded.token_ids)
    assert out.usage["completion_tokens"] == len(ids)
    if thinking:
        assert out.usage["reasoning_tokens"] == (ids.index(END_THINK) if END_THINK in ids else len(ids))
        assert out.reasoning_content is not None
    else:
        assert out.usage["reasoning_tokens"] == 0 and out.reasoning_content is None
    if END_THINK not in ids:
        # No </think> and no tool-call block (a lone ｜DSML｜, as in the greedy case, is no block): the whole
        # reply is reasoning (thinking) or answer, as decoded, markers keeping their spelling (the recipe drops
        # the newlines that open a reasoning block).
        text = _plain_text(llm.tokenizer, ids)
        got = out.reasoning_content if thinking else out.content
        if thinking:
            assert out.content == ""
            text = text.lstrip("\n")
        _assert_decoded(got, text, cut=out.finish_reason == "length")
    assert out.finish_reason == ("stop" if ids[-1] == EOS else "length")


def test_thinking_changes_the_prompt_not_the_contract(llm, encoder):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    off, on = (llm.chat(HELLO, params, thinking=t, use_tqdm=False)[0] for t in (False, True))
    assert off.usage["prompt_tokens"] == len(encoder.encode(HELLO, thinking=False))
    assert on.usage["prompt_tokens"] == len(encoder.encode(HELLO, thinking=True))
    assert off.reasoning_content is None and on.reasoning_content is not None
    assert off.usage["completion_tokens"] == on.usage["completion_tokens"] == 4


def test_batch_keeps_conversation_order(llm):
    conversations = [HELLO, SYSTEM_CHAT, [{"role": "user", "content": "one more"}]]
    params = [
        SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seq_seed=10 + n) for n in (3, 5, 7)
    ]
    batch = llm.chat(conversations, params, use_tqdm=False)
    assert [o.usage["completion_tokens"] for o in batch] == [3, 5, 7]
    alone = [llm.chat(c, p, use_tqdm=False)[0] for c, p in zip(conversations, params)]
    assert batch == alone
    # One SamplingParams for all conversations works too.
    shared = llm.chat(
        conversations, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False
    )
    assert [o.usage["completion_tokens"] for o in shared] == [2, 2, 2]


def test_replies_end_at_the_turn_end_token(llm, encoder):
    """A reply stops at the template's turn end (EOS): its ids are those of a run that ignores EOS, cut after
    the first EOS. Sampling is keyed by (seed, position), so the two runs agree up to there.

    With tiny-v3's weights, seeds 55 and 58 of this range sample EOS within 32 tokens (about 1 in 512 per
    token); if the weights change, another seed of the range will, with high probability."""
    seeds = range(48, 64)
    free = [SamplingParams(temperature=1.0, max_tokens=32, seq_seed=s, ignore_eos=True) for s in seeds]
    runs = llm.generate(
        prompt_token_ids=[encoder.encode(HELLO)] * len(seeds), sampling_params=free, use_tqdm=False
    )
    streams = [r.outputs[0].token_ids for r in runs]
    assert any(EOS in s for s in streams) and not all(EOS in s for s in streams), "pick another seed range"
    outs = llm.chat([HELLO] * len(seeds), [p.replace(ignore_eos=False) for p in free], use_tqdm=False)
    for out, stream in zip(outs, streams):
        if EOS in stream:
            assert out.finish_reason == "stop"
            assert out.usage["completion_tokens"] == stream.index(EOS) + 1
        else:
            assert out.finish_reason == "length" and out.usage["completion_tokens"] == 32


def test_tools_go_into_the_prompt(llm, encoder):
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    (out,) = llm.chat(HELLO, params, tools=[WEATHER_TOOL], use_tqdm=False)
    encoded = encoder.encode_chat(HELLO, tools=[WEATHER_TOOL])
    assert encoded.tool_names == ("get_weather",)
    assert out.usage["prompt_tokens"] == len(encoded.token_ids) > len(encoder.encode(HELLO))
    assert out == _reference(llm, encoded, params)[1]


# ------------------------------------------------------------------------------------ template version


def test_chat_version_follows_the_model():
    assert chat_lib.chat_version_for("deepseek_v41") == "v41"
    assert chat_lib.chat_version_for("deepseek_v4") == "v4"
    assert chat_lib.chat_version_for("deepseek_v3") == "v4"
    assert chat_lib.chat_version_for("deepseek_v3", "v41") == "v41"
    assert chat_lib.chat_version_for("deepseek_v41", "v4") == "v4"
    with pytest.raises(ValueError, match=r"chat_version='v5' is not supported"):
        chat_lib.chat_version_for("deepseek_v3", "v5")


def test_v41_template_on_request(llm):
    """tiny-v3's synthetic tokenizer carries <｜System｜>, so the V4.1 template runs when asked for."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    v41 = ChatEncoder(llm.tokenizer, version="v41").encode_chat(SYSTEM_CHAT)
    assert SYSTEM in v41.token_ids
    (out,) = llm.chat(SYSTEM_CHAT, params, chat_version="v41", use_tqdm=False)
    assert out == _reference(llm, v41, params)[1]
    (v4_out,) = llm.chat(SYSTEM_CHAT, params, use_tqdm=False)
    assert v4_out.usage["prompt_tokens"] == len(ChatEncoder(llm.tokenizer).encode(SYSTEM_CHAT))
    assert SYSTEM not in ChatEncoder(llm.tokenizer).encode(SYSTEM_CHAT)


# ------------------------------------------------------------------------------------ stop ids


def test_turn_end_added_to_stop_ids_only_when_needed():
    p = SamplingParams(max_tokens=4, stop_token_ids=[42])
    assert chat_lib.chat_sampling_params(p, 2, turn_end_id=1, eos_ids=(1,)) == [p, p]
    added = chat_lib.chat_sampling_params(p, 1, turn_end_id=1, eos_ids=(2,))
    assert added[0].stop_token_ids == (42, 1)
    ignoring = p.replace(ignore_eos=True)
    assert chat_lib.chat_sampling_params([ignoring], 1, turn_end_id=1, eos_ids=())[0] == ignoring
    has_it = p.replace(stop_token_ids=[1])
    assert chat_lib.chat_sampling_params(has_it, 1, turn_end_id=1, eos_ids=())[0] == has_it
    assert chat_lib.chat_sampling_params(None, 1, turn_end_id=1, eos_ids=())[0].stop_token_ids == (1,)


# ------------------------------------------------------------------------------------ parsing, by hand


def _spell(tokenizer: Tokenizer, text: str) -> list[int]:
    """One character at a time, so no id is a marker even where the text spells one."""
    return [i for char in text for i in tokenizer.encode(char)]


def _completion(ids: list[int], reason: str, error: str | None = None) -> CompletionOutput:
    return CompletionOutput(0, "", ids, None, None, finish_reason=reason, error=error)


def test_parse_reasoning_answer_and_usage(llm, encoder):
    tok = llm.tokenizer
    encoded = encoder.encode_chat(HELLO, thinking=True)
    reasoning, answer = _spell(tok, "a </think> b"), _spell(tok, "It is sunny.")
    ids = [*reasoning, END_THINK, *answer, EOS]
    out = chat_lib.parse_chat_output(encoded, _completion(ids, "stop"))
    assert (out.reasoning_content, out.content, out.tool_calls) == ("a </think> b", "It is sunny.", ())
    assert out.finish_reason == "stop"
    assert out.usage == {
        "prompt_tokens": len(encoded.token_ids),
        "completion_tokens": len(ids),
        "reasoning_tokens": len(reasoning),
    }
    cut = chat_lib.parse_chat_output(encoded, _completion(reasoning, "length"))
    assert (cut.reasoning_content, cut.content, cut.finish_reason) == ("a </think> b", "", "length")


def test_parse_tool_call(llm, encoder):
    tok = llm.tokenizer
    encoded = encoder.encode_chat(HELLO, tools=[WEATHER_TOOL])
    pieces = [
        "\n\n<", DSML, "tool_calls>\n<", DSML, 'invoke name="get_weather">\n<', DSML,
        'parameter name="city" string="true">Paris</', DSML, "parameter>\n</", DSML, "invoke>\n</", DSML,
        "tool_calls>",
    ]  # fmt: skip
    ids = [*_spell(tok, "Checking.")]
    for piece in pieces:
        ids += [piece] if isinstance(piece, int) else _spell(tok, piece)
    out = chat_lib.parse_chat_output(encoded, _completion([*ids, EOS], "stop"))
    assert out.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert isinstance(out.tool_calls[0], ToolCall) and out.tool_calls[0].id
    assert out.finish_reason == "tool_calls"
    # The same tags spelled out of ordinary tokens are answer text, not a call.
    spelled = _spell(tok, "<｜DSML｜tool_calls>")
    plain = chat_lib.parse_chat_output(encoded, _completion(spelled, "stop"))
    assert plain.tool_calls == () and plain.content == "<｜DSML｜tool_calls>"


def test_parse_error_and_unfinished(llm, encoder):
    encoded = encoder.encode_chat(HELLO)
    ids = _spell(llm.tokenizer, "partial")
    out = chat_lib.parse_chat_output(encoded, _completion(ids, "error", error="non-finite logits"))
    assert (out.content, out.finish_reason, out.usage["completion_tokens"]) == ("partial", "error", len(ids))
    with pytest.raises(ValueError, match=r"finish_reason=None"):
        chat_lib.parse_chat_output(encoded, _completion(ids, None))


# ------------------------------------------------------------------------------------ errors


BAD_INPUTS = [
    pytest.param(
        dict(messages=[{"role": "wizard", "content": "x"}]),
        ValueError,
        r"role='wizard' is not a known role",
        id="role",
    ),
    pytest.param(dict(messages=[]), ValueError, r"messages: the list is empty", id="empty"),
    pytest.param(dict(messages="hi"), TypeError, r"messages: expected a list", id="string"),
    pytest.param(
        dict(messages=[HELLO, "hi"]), TypeError, r"messages\[1\]: expected a conversation", id="mixed"
    ),
    pytest.param(
        dict(messages=[HELLO, [{"role": "user"}]]),
        ValueError,
        r"conversation 1: messages\[0\]\.content is missing",
        id="batch-index",
    ),
    pytest.param(
        dict(messages=HELLO, tools=[{"type": "function", "function": {"name": ""}}]),
        ValueError,
        r"tools\[0\]\.function\.name=''",
        id="tool-name",
    ),
    pytest.param(
        dict(messages=HELLO, tools=[{"type": "retrieval"}]),
        ValueError,
        r"tools\[0\]\.type='retrieval'",
        id="tool-type",
    ),
    pytest.param(
        dict(messages=HELLO, tools={"type": "function"}), TypeError, r"tools must be a list", id="tools-dict"
    ),
    pytest.param(
        dict(messages=HELLO, tools=[{"type": "function", "function": {"name": "f", "parameters": "object"}}]),
        ValueError,
        r"tools\[0\]\.function\.parameters must be a JSON Schema",
        id="tool-parameters",
    ),
    pytest.param(
        dict(messages=[HELLO, HELLO], sampling_params=[SamplingParams()] * 3),
        ValueError,
        r"sampling_params: 3 entries for 2",
        id="params-length",
    ),
    pytest.param(
        dict(messages=HELLO, sampling_params=[0.5]), TypeError, r"sampling_params\[0\]", id="params-type"
    ),
    pytest.param(
        dict(messages=HELLO, reasoning_effort="huge"), ValueError, r"reasoning_effort='huge'", id="effort"
    ),
    pytest.param(dict(messages=HELLO, chat_version="v3"), ValueError, r"chat_version='v3'", id="version"),
    pytest.param(
        dict(messages=HELLO, sampling_params=SamplingParams(max_tokens=10_000)),
        ValueError,
        r"max_model_len",
        id="too-long",
    ),
]


@pytest.mark.parametrize("kwargs, error, match", BAD_INPUTS)
def test_bad_input_raises_before_anything_runs(llm, kwargs, error, match):
    queued = llm._next_id
    with pytest.raises(error, match=match):
        llm.chat(**kwargs, use_tqdm=False)
    assert llm._next_id == queued and not llm.scheduler.has_unfinished_requests()


def test_llm_still_chats_after_errors(llm, encoder):
    for kwargs, *_ in (case.values for case in BAD_INPUTS):
        with pytest.raises((ValueError, TypeError)):
            llm.chat(**kwargs, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=5)
    (out,) = llm.chat(HELLO, params, use_tqdm=False)
    assert out == _reference(llm, encoder.encode_chat(HELLO), params)[1]


@pytest.fixture(scope="module")
def model_dir_copy(tmp_path_factory) -> object:
    """tiny-v3's folder without its tokenizer.json (weights and config only)."""
    src = builtin.materialize("tiny-v3")
    dst = tmp_path_factory.mktemp("tiny-v3-no-tokenizer")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, dst / name)
    return dst


def test_no_tokenizer(model_dir_copy):
    bare = _engine(str(model_dir_copy))
    assert bare.tokenizer is None
    with pytest.raises(ValueError, match=r"chat: this model has no tokenizer"):
        bare.chat(HELLO, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[0\]: this model has no tokenizer"):
        bare.generate("hi", use_tqdm=False)
    # The same engine still runs token-id prompts.
    (res,) = bare.generate(
        prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False
    )
    assert len(res.outputs[0].token_ids) in (1, 2)


def test_unreadable_tokenizer(model_dir_copy, tmp_path, llm):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer\.json'? is not a valid tokenizer\.json"):
        _engine("tiny-v3", tokenizer=bad)
    folder = tmp_path / "model"
    shutil.copytree(model_dir_copy, folder)
    shutil.copy(bad, folder / "tokenizer.json")
    with pytest.raises(ValueError, match=r"is not a valid tokenizer\.json"):
        _engine(str(folder))
    assert llm.chat(HELLO, SamplingParams(max_tokens=1), use_tqdm=False)[0].usage["completion_tokens"] == 1


def test_tokenizer_larger_than_the_vocabulary(tmp_path, llm):
    path = write_synthetic_tokenizer(tmp_path, 1024)
    big = _engine("tiny-v3", tokenizer=path)
    with pytest.raises(ValueError, match=r"has 1024 ids, more than the model's vocab_size=512"):
        big.chat(HELLO, use_tqdm=False)
    assert not big.scheduler.has_unfinished_requests()
    assert llm.chat(HELLO, SamplingParams(max_tokens=1), use_tqdm=False)[0].usage["completion_tokens"] == 1
