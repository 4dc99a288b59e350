"""Chat encoding: DeepSeek's V4 / V4.1 prompt format, the injection defence, tokenizer checks and input errors.

Two independent references are used. Small cases are written out by hand from the published format (marker ids
of the synthetic tokenizer are fixed at 0–9). Larger cases are checked against the recipe's own rendering,
re-tokenised here with a separate ``tokenizers`` object that has *no* added vocabulary: each marker range the
recipe reports becomes its one id, every stretch of text between them is encoded with the plain BPE.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import deepseek_recipe as recipe
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from deepinfer_jax.text import ChatEncoder, EncodedChat, Tokenizer, write_synthetic_tokenizer
from deepinfer_jax.text.chat import CHAT_VERSIONS, REASONING_EFFORTS

# Ids of the synthetic tokenizer's specials (docs/text.md): fixed, so hand-written expectations can name them.
BOS, EOS, USER, ASSISTANT, THINK, END_THINK, DSML, REMINDER, SYSTEM = 0, 1, 3, 4, 5, 6, 7, 8, 9

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TOOL_TURN = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris for 2 days?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I should call the tool.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 °C"},
]
MULTI_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!  How are   you?\n\nFine?"},
    {"role": "assistant", "content": "Fine, thanks.", "reasoning_content": "A greeting."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Name three "}, {"type": "text", "text": "colours."}],
    },
]
CONVERSATIONS = {
    "single": ([{"role": "user", "content": "Hello, world"}], None),
    "multi_turn": (MULTI_TURN, None),
    "tools": (TOOL_TURN, [WEATHER_TOOL]),
    "reminder": (
        [{"role": "latest_reminder", "content": "Today is Monday."}, {"role": "user", "content": "Day?"}],
        None,
    ),
    "prefix": (
        [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,", "prefix": True}],
        None,
    ),
}


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def v4_encoder(v4_tokenizer: Tokenizer) -> ChatEncoder:
    return ChatEncoder(v4_tokenizer, version="v4")


@pytest.fixture(scope="module")
def tiny_encoders(tiny_tokenizer: Tokenizer) -> dict[str, ChatEncoder]:
    return {version: ChatEncoder(tiny_tokenizer, version=version) for version in CHAT_VERSIONS}


def _plain_backend(tokenizer: Tokenizer) -> HFTokenizer:
    """The same vocabulary with its added tokens removed: text can only become ordinary BPE tokens."""
    spec = json.loads(tokenizer.backend.to_str())
    spec["added_tokens"] = []
    return HFTokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module")
def plain_backends(v4_tokenizer: Tokenizer, tiny_tokenizer: Tokenizer) -> dict[int, HFTokenizer]:
    return {id(tok): _plain_backend(tok) for tok in (v4_tokenizer, tiny_tokenizer)}


def _recipe_render(
    encoder: ChatEncoder,
    messages: list[dict[str, Any]],
    tools: Any,
    thinking: bool,
    effort: str | None = None,
) -> recipe.RenderedPrompt:
    body: dict[str, Any] = {
        "model": CHAT_VERSIONS[encoder.version],
        "messages": messages,
        "thinking": {"type": "enabled" if thinking else "disabled"},
    }
    if tools:
        body["tools"] = tools
    if effort:
        body["reasoning_effort"] = effort
    request = recipe.ChatCompletionRequest(body).convert(recipe.ConversionOptions())
    encoding = recipe.DeepseekV41Encoding() if encoder.version == "v41" else recipe.DeepseekV4Encoding()
    return encoding.render_conversation(request.conversation)


def _retokenise(rendered: recipe.RenderedPrompt, tokenizer: Tokenizer, plain: HFTokenizer) -> list[int]:
    ids: list[int] = []
    position = 0
    prompt = rendered.prompt
    for start, end in rendered.special_ranges:
        if position < start:
            ids += plain.encode(prompt[position:start], add_special_tokens=False).ids
        marker = tokenizer.token_to_id(prompt[start:end])
        assert marker is not None, prompt[start:end]
        ids.append(marker)
        position = end
    if position < len(prompt):
        ids += plain.encode(prompt[position:], add_special_tokens=False).ids
    return ids


def _plain(tokenizer: Tokenizer, text: str) -> list[int]:
    """Plain-text ids of ``text`` (which holds no marker spelling, so the full encoder is plain here)."""
    return tokenizer.encode(text)


# ------------------------------------------------------------------------------------ hand-checked format


def test_single_turn_by_hand(tiny_encoders: dict[str, ChatEncoder], tiny_tokenizer: Tokenizer) -> None:
    hi = _plain(tiny_tokenizer, "Hi")
    messages = [{"role": "user", "content": "Hi"}]
    v4, v41 = tiny_encoders["v4"], tiny_encoders["v41"]
    # Non-thinking: the reply starts after an empty thought (</think>); thinking: it starts inside <think>.
    assert v4.encode(messages) == [BOS, USER, *hi, ASSISTANT, END_THINK]
    assert v4.encode(messages, thinking=True, reasoning_effort="low") == [BOS, USER, *hi, ASSISTANT, THINK]
    assert v41.encode(messages) == [BOS, USER, *hi, ASSISTANT, END_THINK]


def test_system_prompt_by_hand(tiny_encoders: dict[str, ChatEncoder], tiny_tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}]
    s, a = _plain(tiny_tokenizer, "S"), _plain(tiny_tokenizer, "a")
    # V4 writes the system text straight after BOS; V4.1 marks it with <｜System｜>.
    assert tiny_encoders["v4"].encode(messages) == [BOS, *s, USER, *a, ASSISTANT, END_THINK]
    assert tiny_encoders["v41"].encode(messages) == [BOS, SYSTEM, *s, USER, *a, ASSISTANT, END_THINK]


def test_multi_turn_drops_old_reasoning_by_hand(
    tiny_encoders: dict[str, ChatEncoder], tiny_tokenizer: Tokenizer
) -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "r"},
        {"role": "user", "content": "c"},
    ]
    a, b, c = (_plain(tiny_tokenizer, t) for t in "abc")
    # A finished turn keeps its answer and EOS, not its reasoning; the new reply opens <think>.
    expected = [BOS, USER, *a, ASSISTANT, END_THINK, *b, EOS, USER, *c, ASSISTANT, THINK]
    assert tiny_encoders["v4"].encode(messages, thinking=True, reasoning_effort="low") == expected


def test_tool_call_history_by_hand(tiny_encoders: dict[str, ChatEncoder], tiny_tokenizer: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": "a"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "res"},
    ]

    def text(t: str) -> list[int]:
        return _plain(tiny_tokenizer, t)

    call = [
        *text("\n\n<"), DSML, *text("tool_calls>\n<"), DSML, *text('invoke name="f">\n<'), DSML,
        *text('parameter name="x" string="false">1</'), DSML, *text("parameter>\n</"), DSML,
        *text("invoke>\n</"), DSML, *text("tool_calls>"),
    ]  # fmt: skip
    expected = [BOS, USER, *text("a"), ASSISTANT, END_THINK, *call, EOS]
    expected += [USER, *text("<tool_result>res</tool_result>"), ASSISTANT, END_THINK]
    assert tiny_encoders["v4"].encode(messages) == expected


def test_v4_known_marker_ids(v4_encoder: ChatEncoder) -> None:
    ids = v4_encoder.encode([{"role": "user", "content": "Hi"}], thinking=True, reasoning_effort="low")
    assert ids[:2] == [0, 128_803]
    assert ids[-2:] == [128_804, 128_821]
    assert v4_encoder.marker_ids["</think>"] == 128_822
    assert v4_encoder.marker_ids["｜DSML｜"] == 128_825
    assert "<｜System｜>" not in v4_encoder.marker_ids


# ------------------------------------------------------------------------------- golden against the recipe


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("which", ["v4-real", "v4-tiny", "v41-tiny"])
def test_encoding_matches_recipe_rendering_retokenised(
    name: str,
    thinking: bool,
    which: str,
    v4_encoder: ChatEncoder,
    tiny_encoders: dict[str, ChatEncoder],
    plain_backends: dict[int, HFTokenizer],
) -> None:
    encoder = v4_encoder if which == "v4-real" else tiny_encoders[which.split("-")[0]]
    messages, tools = CONVERSATIONS[name]
    encoded = encoder.encode_chat(messages, tools=tools, thinking=thinking)
    rendered = _recipe_render(encoder, messages, tools, thinking)
    assert encoded.prompt == rendered.prompt
    expected = _retokenise(rendered, encoder.tokenizer, plain_backends[id(encoder.tokenizer)])
    assert list(encoded.token_ids) == expected
    assert encoder.encode(messages, tools=tools, thinking=thinking) == expected
    assert encoder.render(messages, tools=tools, thinking=thinking) == rendered.prompt
    # Byte-level decoding is lossless, so the ids spell the rendered prompt exactly.
    assert encoder.tokenizer.decode(expected) == rendered.prompt
    assert encoded.thinking is thinking


def test_tools_are_rendered_into_the_system_prompt(v4_encoder: ChatEncoder) -> None:
    encoded = v4_encoder.encode_chat(TOOL_TURN, tools=[WEATHER_TOOL])
    assert encoded.tool_names == ("get_weather",)
    assert '"name": "get_weather"' in encoded.prompt
    assert encoded.prompt.index("## Tools") < encoded.prompt.index("<｜User｜>")
    # The historical call is written as DSML with typed parameters.
    assert '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>' in encoded.prompt


def test_thinking_and_reasoning_effort(v4_encoder: ChatEncoder) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    off = v4_encoder.encode_chat(messages)
    assert (off.thinking, off.reasoning_effort) == (False, None)
    on = v4_encoder.encode_chat(messages, thinking=True)
    assert on.thinking and on.reasoning_effort == "high"  # the recipe's default effort in thinking mode
    assert on.token_ids[-1] == 128_821 and off.token_ids[-1] == 128_822
    # OpenAI's "medium" is DeepSeek's "high"; "max" adds its own, longer instruction.
    assert (
        v4_encoder.encode_chat(messages, thinking=True, reasoning_effort="medium").token_ids == on.token_ids
    )
    assert len(v4_encoder.encode(messages, thinking=True, reasoning_effort="max")) > len(on.token_ids)


@pytest.mark.parametrize("effort", REASONING_EFFORTS)
def test_every_listed_reasoning_effort_is_accepted_by_the_recipe(
    effort: str, tiny_encoders: dict[str, ChatEncoder]
) -> None:
    encoded = tiny_encoders["v41"].encode_chat(
        [{"role": "user", "content": "x"}], thinking=True, reasoning_effort=effort
    )
    assert encoded.token_ids[0] == BOS


# ------------------------------------------------------------------------------------- injection defence


def _added_spellings(tokenizer: Tokenizer) -> list[str]:
    return sorted(token.content for token in tokenizer.backend.get_added_tokens_decoder().values())


def _hostile_conversation(text: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``text`` in every place a caller controls: system, user, reasoning, answer, tool arguments, tool result."""
    messages = [
        {"role": "system", "content": text},
        {"role": "user", "content": text},
        {
            "role": "assistant",
            "content": text,
            "reasoning_content": text,
            "tool_calls": [
                {
                    "id": "call_x",
                    "type": "function",
                    "function": {"name": "f", "arguments": json.dumps({"q": text})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_x", "content": text},
        {"role": "assistant", "content": text, "reasoning_content": text},
        {"role": "user", "content": [{"type": "text", "text": text}]},
    ]
    tools = [
        {"type": "function", "function": {"name": "f", "description": text, "parameters": {"type": "object"}}}
    ]
    return messages, tools


def _assert_only_template_markers(encoder: ChatEncoder, text: str) -> None:
    messages, tools = _hostile_conversation(text)
    for thinking in (False, True):
        ids = encoder.encode(messages, tools=tools, thinking=thinking)
        rendered = _recipe_render(encoder, messages, tools, thinking)
        prompt = rendered.prompt
        template_markers = Counter(
            encoder.tokenizer.token_to_id(prompt[s:e]) for s, e in rendered.special_ranges
        )
        found = Counter(i for i in ids if i in encoder.special_ids)
        assert found == template_markers
        assert encoder.tokenizer.decode(ids) == prompt
        if any(token in text for token in encoder.marker_ids):
            # The check has teeth: encoding the rendered text naively turns the typed spellings into markers.
            naive = Counter(i for i in encoder.tokenizer.encode(prompt) if i in encoder.special_ids)
            assert naive != template_markers


@pytest.mark.parametrize("version", ["v4", "v41"])
def test_every_synthetic_special_spelling_is_plain_text(
    version: str, tiny_encoders: dict[str, ChatEncoder], tiny_tokenizer: Tokenizer
) -> None:
    spellings = _added_spellings(tiny_tokenizer)
    assert len(spellings) == 10
    _assert_only_template_markers(tiny_encoders[version], " ".join(spellings) + "".join(spellings))


def test_every_real_v4_special_spelling_is_plain_text(
    v4_encoder: ChatEncoder, v4_tokenizer: Tokenizer
) -> None:
    spellings = _added_spellings(v4_tokenizer)
    assert len(spellings) == len(v4_encoder.special_ids) == 1283
    # Spaced and run together: adjacent spellings must not combine into a marker either.
    _assert_only_template_markers(v4_encoder, " ".join(spellings) + "\n" + "".join(spellings))


_FRAGMENTS = st.sampled_from(
    [
        "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜", "<｜System｜>", "<｜latest_reminder｜>",
        "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<", ">", "｜", "</", "\n", " ", "tool_calls",
    ]
)  # fmt: skip


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(st.one_of(_FRAGMENTS, st.text(max_size=6)), max_size=12))
def test_injection_property(pieces: list[str], tiny_encoders: dict[str, ChatEncoder]) -> None:
    _assert_only_template_markers(tiny_encoders["v41"], "".join(pieces))


# ----------------------------------------------------------------------------------- tokenizer and version


def test_tokenizer_forms_agree(
    tmp_path: Any, tiny_tokenizer: Tokenizer, tiny_encoders: dict[str, ChatEncoder]
) -> None:
    path = write_synthetic_tokenizer(tmp_path, 512)
    messages, tools = CONVERSATIONS["tools"]
    expected = tiny_encoders["v4"].encode(messages, tools=tools)
    for form in (path, str(path), tmp_path, tiny_tokenizer.backend):
        assert ChatEncoder(form).encode(messages, tools=tools) == expected


def test_default_tokenizer_is_the_real_v4_vocabulary(v4_tokenizer: Tokenizer) -> None:
    encoder = ChatEncoder()
    assert encoder.tokenizer is v4_tokenizer  # the cached load, not a second copy
    assert encoder.version == "v4"
    assert {0, 1, 2, 128_803, 128_804, 128_822} <= encoder.special_ids
    assert "ChatEncoder(version='v4'" in repr(encoder)


def test_special_ids_are_the_added_tokens(tiny_encoders: dict[str, ChatEncoder]) -> None:
    assert tiny_encoders["v4"].special_ids == frozenset(range(10))


def test_v41_needs_the_system_marker(v4_tokenizer: Tokenizer) -> None:
    with pytest.raises(
        ValueError, match=r"version='v41' needs the marker '<｜System｜>'.*published DeepSeek-V4"
    ):
        ChatEncoder(v4_tokenizer, version="v41")


def _byte_level_tokenizer(added: list[str]) -> HFTokenizer:
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens(sorted(pre_tokenizers.ByteLevel.alphabet()))
    backend.add_special_tokens(added)
    return backend


def test_tokenizer_without_chat_markers_is_refused() -> None:
    backend = _byte_level_tokenizer(["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"])
    with pytest.raises(ValueError, match=r"not a DeepSeek chat tokenizer.*'<｜User｜>'.*'｜DSML｜'"):
        ChatEncoder(backend)


def test_tokenizer_without_bos_is_refused() -> None:
    with pytest.raises(ValueError, match=r"bos_token='<｜begin▁of▁sentence｜>' is not in the vocabulary"):
        ChatEncoder(_byte_level_tokenizer(["<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]))


def test_bad_version_and_tokenizer_types(tiny_tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match=r"version='v3' is not supported; expected one of \['v4', 'v41'\]"):
        ChatEncoder(tiny_tokenizer, version="v3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"tokenizer must be None, a path.*got int"):
        ChatEncoder(42)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        ChatEncoder("no/such/tokenizer.json")


# ------------------------------------------------------------------------------------------- input errors

_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
_BAD_MESSAGES = [
    ([], ValueError, "messages is empty"),
    ([{"role": "wizard", "content": "x"}], ValueError, r"messages\[0\]\.role='wizard' is not a known role"),
    ([{"role": "user", "content": "x"}, {"content": "y"}], ValueError, r"messages\[1\] has no 'role'"),
    ([{"role": "user", "content": "x"}, "hi"], TypeError, r"messages\[1\] must be a dict"),
    ([{"role": "user"}], ValueError, r"messages\[0\]\.content is missing"),
    ([{"role": "user", "content": 3}], TypeError, r"messages\[0\]\.content must be a str or a list"),
    (
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        ValueError,
        r"messages\[0\]\.content\[0\]\.type='image_url' is not supported",
    ),
    (
        [{"role": "user", "content": [{"type": "text", "text": 1}]}],
        TypeError,
        r"content\[0\]\.text must be a str",
    ),
    (
        [{"role": "user", "content": "x", "tool_calls": [_CALL]}],
        ValueError,
        r"'tool_calls' is only valid on assistant",
    ),
    (
        [{"role": "user", "content": "x", "tool_call_id": "c"}],
        ValueError,
        r"'tool_call_id' is only valid on tool",
    ),
    ([{"role": "tool", "content": "x"}], ValueError, r"messages\[0\]\.tool_call_id=None"),
    (
        [{"role": "assistant"}],
        ValueError,
        r"messages\[0\]: an assistant message needs a content or tool_calls",
    ),
    (
        [{"role": "assistant", "content": "x", "reasoning_content": 1}],
        TypeError,
        r"reasoning_content must be a str",
    ),
    (
        [{"role": "assistant", "content": "x", "prefix": "yes"}],
        TypeError,
        r"messages\[0\]\.prefix must be a bool",
    ),
    ([{"role": "assistant", "tool_calls": "f()"}], TypeError, r"messages\[0\]\.tool_calls must be a list"),
    (
        [{"role": "assistant", "tool_calls": [{**_CALL, "id": ""}]}],
        ValueError,
        r"messages\[0\]\.tool_calls\[0\]\.id='' must be a non-empty string",
    ),
    (
        [{"role": "assistant", "tool_calls": [{**_CALL, "function": {"name": "f", "arguments": "{bad"}}]}],
        ValueError,
        r"tool_calls\[0\]\.function\.arguments='\{bad' is not valid JSON",
    ),
    (
        [{"role": "assistant", "tool_calls": [{**_CALL, "function": {"name": "f", "arguments": "[1]"}}]}],
        ValueError,
        r"function\.arguments='\[1\]' must encode a JSON object",
    ),
    (
        [{"role": "assistant", "tool_calls": [{**_CALL, "function": {"arguments": "{}"}}]}],
        ValueError,
        r"tool_calls\[0\]\.function\.name=None must be a non-empty string",
    ),
    (
        [{"role": "assistant", "tool_calls": [{**_CALL, "type": "custom"}]}],
        ValueError,
        r"tool_calls\[0\]\.type='custom' is not supported",
    ),
    # Sequencing rules are the recipe's; its message is passed on.
    (
        [{"role": "tool", "tool_call_id": "c1", "content": "x"}],
        ValueError,
        r"chat request rejected: .*role 'tool'",
    ),
    (
        [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [_CALL]}],
        ValueError,
        r"chat request rejected: .*must be followed by tool messages",
    ),
]


@pytest.mark.parametrize(("messages", "error", "pattern"), _BAD_MESSAGES)
def test_bad_messages(
    messages: Any, error: type[Exception], pattern: str, tiny_encoders: dict[str, ChatEncoder]
) -> None:
    with pytest.raises(error, match=pattern):
        tiny_encoders["v4"].encode(messages)


_USER = [{"role": "user", "content": "x"}]
_BAD_TOOLS = [
    ({"type": "function"}, TypeError, r"tools must be a list of tool definitions, got dict"),
    (["f"], TypeError, r"tools\[0\] must be a dict"),
    (
        [{"function": {"name": "f"}}],
        ValueError,
        r"tools\[0\]\.type=None is not supported; expected 'function'",
    ),
    ([{"type": "function"}], ValueError, r"tools\[0\]\.function must be a dict"),
    ([{"type": "function", "function": {"name": ""}}], ValueError, r"tools\[0\]\.function\.name='' must be"),
    (
        [{"type": "function", "function": {"name": "f", "parameters": "object"}}],
        ValueError,
        r"tools\[0\]\.function\.parameters must be a JSON Schema object",
    ),
    (
        [{"type": "function", "function": {"name": "f", "parameters": {"default": {1, 2}}}}],
        ValueError,
        r"tools\[0\]\.function\.parameters is not JSON-serialisable",
    ),
    (
        [{"type": "function", "function": {"name": "f", "description": 1}}],
        TypeError,
        r"description must be a str",
    ),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], TypeError, r"strict must be a bool"),
    ([WEATHER_TOOL, WEATHER_TOOL], ValueError, r"chat request rejected: Tool names must be unique"),
    (
        [{"type": "function", "function": {"name": "bad name"}}],
        ValueError,
        r"chat request rejected: Invalid 'tools\[0\]\.function\.name'",
    ),
]


@pytest.mark.parametrize(("tools", "error", "pattern"), _BAD_TOOLS)
def test_bad_tools(
    tools: Any, error: type[Exception], pattern: str, tiny_encoders: dict[str, ChatEncoder]
) -> None:
    with pytest.raises(error, match=pattern):
        tiny_encoders["v4"].encode(_USER, tools=tools)


def test_bad_options(tiny_encoders: dict[str, ChatEncoder]) -> None:
    encoder = tiny_encoders["v4"]
    with pytest.raises(
        ValueError, match=r"reasoning_effort='extreme' is not supported; expected None or one of"
    ):
        encoder.encode(_USER, thinking=True, reasoning_effort="extreme")
    with pytest.raises(TypeError, match=r"thinking must be a bool, got str"):
        encoder.encode(_USER, thinking="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"messages must be a list of message dicts, got str"):
        encoder.encode("hello")  # type: ignore[arg-type]


def test_encoded_chat_is_a_value(tiny_encoders: dict[str, ChatEncoder]) -> None:
    first = tiny_encoders["v4"].encode_chat(_USER)
    second = tiny_encoders["v4"].encode_chat(_USER)
    assert isinstance(first, EncodedChat)
    assert first == second
    assert "token_ids=" in repr(first) and "_request" not in repr(first)
