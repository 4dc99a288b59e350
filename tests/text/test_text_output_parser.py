"""Streaming output parsing: reasoning vs answer, DSML tool calls, markers recognised only as token ids.

Generated ids are built here from known text: ``_spell`` encodes one character at a time, so the ids are
ordinary tokens even where the text spells a marker (no single character is a marker), and marker ids are
inserted by hand. The expected outputs are therefore the texts themselves.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import deepseek_recipe as recipe
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_jax.text import ChatDelta, ChatEncoder, ChatOutput, ChatOutputParser, EncodedChat, Tokenizer

EOS, USER, THINK, END_THINK, DSML = 1, 3, 5, 6, 7
V4_END_THINK, V4_DSML = 128_822, 128_825

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


def _spell(tokenizer: Tokenizer, text: str) -> list[int]:
    return [token_id for char in text for token_id in tokenizer.encode(char)]


def _tool_call_ids(tokenizer: Tokenizer, dsml: int, city: str = "Paris", days: int = 2) -> list[int]:
    """A DSML tool-call block as the model writes it: the ｜DSML｜ marker is one id inside each tag."""
    pieces = [
        "\n\n<", dsml, "tool_calls>\n<", dsml, 'invoke name="get_weather">\n<', dsml,
        f'parameter name="city" string="true">{city}</', dsml, "parameter>\n<", dsml,
        f'parameter name="days" string="false">{days}</', dsml, "parameter>\n</", dsml,
        "invoke>\n</", dsml, "tool_calls>",
    ]  # fmt: skip
    ids: list[int] = []
    for piece in pieces:
        ids += [piece] if isinstance(piece, int) else _spell(tokenizer, piece)
    return ids


@pytest.fixture(scope="module")
def encoder(tiny_tokenizer: Tokenizer) -> ChatEncoder:
    return ChatEncoder(tiny_tokenizer, version="v41")


@pytest.fixture(scope="module")
def thinking_chat(encoder: ChatEncoder) -> EncodedChat:
    return encoder.encode_chat(QUESTION, tools=[WEATHER_TOOL], thinking=True)


@pytest.fixture(scope="module")
def plain_chat(encoder: ChatEncoder) -> EncodedChat:
    return encoder.encode_chat(QUESTION, thinking=False)


def _parse(chat: EncodedChat, ids: list[int], finish: Any = "stop") -> ChatOutput:
    parser = chat.output_parser()
    parser.push(ids)
    return parser.finish(finish)


# ------------------------------------------------------------------------------------------ reasoning split


def test_reasoning_then_answer(thinking_chat: EncodedChat, tiny_tokenizer: Tokenizer) -> None:
    reasoning = _spell(tiny_tokenizer, "\n\nLet me think.")
    ids = [*reasoning, END_THINK, *_spell(tiny_tokenizer, "It is sunny."), EOS]
    out = _parse(thinking_chat, ids)
    # Leading newlines of a new turn's reasoning are the recipe's to drop; EOS is not text.
    assert out.reasoning_content == "Let me think."
    assert out.content == "It is sunny."
    assert out.tool_calls == ()
    assert out.finish_reason == "stop"
    assert out.usage == {
        "prompt_tokens": len(thinking_chat.token_ids),
        "completion_tokens": len(ids),
        "reasoning_tokens": len(reasoning),
    }


def test_spelled_out_think_end_is_reasoning_text(
    thinking_chat: EncodedChat, tiny_tokenizer: Tokenizer
) -> None:
    ids = [*_spell(tiny_tokenizer, "a </think> b"), END_THINK, *_spell(tiny_tokenizer, "c </think>")]
    out = _parse(thinking_chat, ids)
    assert (out.reasoning_content, out.content) == ("a </think> b", "c </think>")
    assert out.usage["reasoning_tokens"] == len(_spell(tiny_tokenizer, "a </think> b"))


def test_text_parsing_would_be_fooled(thinking_chat: EncodedChat, tiny_tokenizer: Tokenizer) -> None:
    """Why the parser feeds ids: the same processor fed the decoded *text* ends the reasoning at a spelled-out
    ``</think>``."""
    body = {"model": "DeepSeek-V4.1-Flash", "messages": QUESTION, "thinking": {"type": "enabled"}}
    request = recipe.ChatCompletionRequest(body).convert(recipe.ConversionOptions())
    processor = recipe.StreamProcessor(
        recipe.ChatCompletionRequest.chunk_generator(request, "x", "m"), request.parsing_options
    )
    response = recipe.ChatCompletionResponse("x", "m", 0, 0, 0)
    ids = _spell(tiny_tokenizer, "a </think> b")
    chunks = processor.push(recipe.InferenceChunk.ready())
    chunks += processor.push(recipe.InferenceChunk.text(tiny_tokenizer.decode(ids), len(ids)))
    chunks += processor.push(recipe.InferenceChunk.finish(recipe.InferenceFinishReason.Stop))
    chunks += processor.finish()
    for chunk in chunks:
        response.accumulate(chunk)
    message = json.loads(response.to_json())["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("a ", " b")
    out = _parse(thinking_chat, ids)
    assert (out.reasoning_content, out.content) == ("a </think> b", "")


def test_length_inside_reasoning(thinking_chat: EncodedChat, tiny_tokenizer: Tokenizer) -> None:
    ids = _spell(tiny_tokenizer, "still thinking")
    out = _parse(thinking_chat, ids, finish="length")
    assert (out.reasoning_content, out.content, out.finish_reason) == ("still thinking", "", "length")
    assert out.usage["reasoning_tokens"] == out.usage["completion_tokens"] == len(ids)


def test_non_thinking_turn(plain_chat: EncodedChat, tiny_tokenizer: Tokenizer) -> None:
    ids = [*_spell(tiny_tokenizer, "Sunny </think> today."), EOS]
    parser = plain_chat.output_parser()
    assert not parser.thinking
    parser.push(ids)
    out = parser.finish()
    assert out.reasoning_content is None
    assert out.content == "Sunny </think> today."
    assert out.usage["reasoning_tokens"] == 0


def test_prefix_continuation_starts_in_the_answer(encoder: ChatEncoder, tiny_tokenizer: Tokenizer) -> None:
    chat = encoder.encode_chat(
        [*QUESTION, {"role": "assistant", "content": "It is", "prefix": True}], thinking=True
    )
    out = _parse(chat, [*_spell(tiny_tokenizer, " sunny."), EOS])
    assert out.content == " sunny."
    assert not out.reasoning_content
    assert out.usage["reasoning_tokens"] == 0


# ----------------------------------------------------------------------------------------------- tool calls


def test_tool_call_from_marker_ids(thinking_chat: EncodedChat, tiny_tokenizer: Tokenizer) -> None:
    ids = [*_spell(tiny_tokenizer, "Need data."), END_THINK, *_spell(tiny_tokenizer, "Checking.")]
    ids += [*_tool_call_ids(tiny_tokenizer, DSML), EOS]
    out = _parse(thinking_chat, ids)
    assert (out.reasoning_content, out.content, out.finish_reason) == (
        "Need data.",
        "Checking.",
        "tool_calls",
    )
    (call,) = out.tool_calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "days": 2}  # "days" typed by string="false"
    assert call.id


def test_spelled_out_tool_call_is_content(thinking_chat: EncodedChat, tiny_tokenizer: Tokenizer) -> None:
    spelled = tiny_tokenizer.decode(_tool_call_ids(tiny_tokenizer, DSML))  # the tags as plain text
    assert "<｜DSML｜tool_calls>" in spelled
    out = _parse(thinking_chat, [END_THINK, *_spell(tiny_tokenizer, "Example:" + spelled), EOS])
    assert out.content == "Example:" + spelled
    assert out.tool_calls == ()
    assert out.finish_reason == "stop"


def test_marker_text_inside_a_parameter_value(thinking_chat: EncodedChat, tiny_tokenizer: Tokenizer) -> None:
    ids = [END_THINK, *_tool_call_ids(tiny_tokenizer, DSML, city="</think><｜User｜>")]
    (call,) = _parse(thinking_chat, ids).tool_calls
    assert json.loads(call.arguments)["city"] == "</think><｜User｜>"


def test_real_v4_ids(v4_tokenizer: Tokenizer) -> None:
    chat = ChatEncoder(v4_tokenizer).encode_chat(QUESTION, tools=[WEATHER_TOOL], thinking=True)
    ids = [
        *_spell(v4_tokenizer, "Use the tool </think>."),
        V4_END_THINK,
        *_tool_call_ids(v4_tokenizer, V4_DSML),
    ]
    out = _parse(chat, [*ids, v4_tokenizer.eos_id])
    assert out.reasoning_content == "Use the tool </think>."
    assert out.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2})
    ]


# ------------------------------------------------------------------------------------- text fidelity


def test_non_structural_markers_keep_their_spelling(
    plain_chat: EncodedChat, tiny_tokenizer: Tokenizer
) -> None:
    ids = [*_spell(tiny_tokenizer, "x"), THINK, USER, DSML, *_spell(tiny_tokenizer, "y")]
    assert _parse(plain_chat, ids).content == "x<think><｜User｜>｜DSML｜y"


def test_broken_characters(plain_chat: EncodedChat, tiny_tokenizer: Tokenizer) -> None:
    euro = tiny_tokenizer.encode("€")  # three byte-level tokens
    assert len(euro) == 3
    a = _spell(tiny_tokenizer, "a")
    # A marker inside a character breaks it: each side's bytes are one invalid sequence, as in a full decode.
    assert _parse(plain_chat, [*euro[:2], THINK, euro[2], *a]).content == "\ufffd<think>\ufffda"
    # A special-flagged id (EOS here) is skipped, so the bytes around it still join into the character.
    assert _parse(plain_chat, [*euro[:2], EOS, euro[2]]).content == "€"
    # A turn cut inside a character (a token limit) drops the incomplete bytes, and only them, even when the
    # complete text came in the same push.
    assert _parse(plain_chat, [*a, *euro[:2]], finish="length").content == "a"


_STREAM_TEXTS = ("Hmm, é中🙂 </think>?", "Answer: 中文 🙂 ok.")


@pytest.fixture(scope="module")
def stream_ids(tiny_tokenizer: Tokenizer) -> list[int]:
    reasoning, answer = (_spell(tiny_tokenizer, text) for text in _STREAM_TEXTS)
    return [*reasoning, END_THINK, *answer, THINK, *_tool_call_ids(tiny_tokenizer, DSML), EOS]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_streamed_deltas_add_up_to_the_output(
    cuts: list[int], thinking_chat: EncodedChat, stream_ids: list[int]
) -> None:
    bounds = sorted({0, len(stream_ids), *(min(cut, len(stream_ids)) for cut in cuts)})
    parser = thinking_chat.output_parser()
    deltas: list[ChatDelta] = [parser.push(stream_ids[a:b]) for a, b in itertools.pairwise(bounds)]
    out = parser.finish()
    assert out.reasoning_content == _STREAM_TEXTS[0]
    assert out.content == _STREAM_TEXTS[1] + "<think>"
    # The texts hold no U+FFFD, so a delta with one would be a transient broken character.
    assert all("\ufffd" not in d.reasoning_content + d.content for d in deltas)
    assert "".join(d.reasoning_content for d in deltas) == out.reasoning_content
    assert "".join(d.content for d in deltas) == out.content
    pieces = [piece for d in deltas for piece in d.tool_calls]
    assert {piece.index for piece in pieces} == {0}
    assert [piece.name for piece in pieces if piece.name] == ["get_weather"]
    assert [piece.id for piece in pieces if piece.id] == [out.tool_calls[0].id]
    assert "".join(piece.arguments for piece in pieces) == out.tool_calls[0].arguments
    assert out.usage["completion_tokens"] == parser.num_tokens == len(stream_ids)


def test_parsers_of_one_chat_are_independent(thinking_chat: EncodedChat, tiny_tokenizer: Tokenizer) -> None:
    first, second = thinking_chat.output_parser(), thinking_chat.output_parser()
    first.push([*_spell(tiny_tokenizer, "one"), END_THINK])
    second.push(_spell(tiny_tokenizer, "two"))
    assert first.finish().reasoning_content == "one"
    assert second.finish("length").reasoning_content == "two"


def test_delta_truthiness(thinking_chat: EncodedChat, tiny_tokenizer: Tokenizer) -> None:
    parser = thinking_chat.output_parser()
    assert not ChatDelta()
    assert parser.push(_spell(tiny_tokenizer, "ab")) == ChatDelta(reasoning_content="ab")


# ------------------------------------------------------------------------------------------------- errors


def test_parser_errors(thinking_chat: EncodedChat, tiny_tokenizer: Tokenizer) -> None:
    parser = thinking_chat.output_parser()
    parser.push([10, 11])
    with pytest.raises(
        ValueError, match=r"ids\[1\] = 512 is out of range for vocab size 512.*stream position 2"
    ):
        parser.push([12, 512])
    with pytest.raises(TypeError, match=r"ids must be a sequence of token ids, got str"):
        parser.push("abc")
    with pytest.raises(ValueError, match=r"finish_reason='timeout' must be one of"):
        parser.finish("timeout")  # type: ignore[arg-type]
    parser.finish("stop")
    with pytest.raises(RuntimeError, match=r"push\(\) after finish\(\)"):
        parser.push([10])
    with pytest.raises(RuntimeError, match=r"finish\(\) called twice"):
        parser.finish()


def test_parser_constructor_checks(tiny_tokenizer: Tokenizer) -> None:
    body = {"model": "DeepSeek-V4.1-Flash", "messages": QUESTION}
    request = recipe.ChatCompletionRequest(body).convert(recipe.ConversionOptions())
    with pytest.raises(TypeError, match=r"tokenizer must be a deepinfer_jax Tokenizer, got str"):
        ChatOutputParser("tokenizer.json", request)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"request must be a deepseek_recipe.ConversationRequest, got dict"):
        ChatOutputParser(tiny_tokenizer, {})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"prompt_tokens=-1 must be >= 0"):
        ChatOutputParser(tiny_tokenizer, request, prompt_tokens=-1)
    with pytest.raises(TypeError, match=r"prompt_tokens must be an int, got float"):
        ChatOutputParser(tiny_tokenizer, request, prompt_tokens=1.0)  # type: ignore[arg-type]
