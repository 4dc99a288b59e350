"""Streaming parse of generated chat tokens: reasoning vs answer, DSML tool calls, finish reason and usage.

The parsing is done by ``deepseek-recipe``'s stream processor, the component DeepSeek's own serving stack
uses, so what counts as reasoning, answer or tool call is exactly DeepSeek's rule. This module is the glue
between the engine's token ids and that processor, and the one property the glue must keep is:

    ``</think>`` and the tool-call tags are recognised only when the model produced the *token id* of the
    marker, never when it spelled the marker out of ordinary byte-level tokens.

The processor has two inputs: text chunks, which it scans for the markers' spellings, and token chunks, which
it decodes itself with the vocabulary and in which it recognises a marker only by its id. Text parsing would end
the reasoning at a literal ``"</think>"`` the model wrote (say, while explaining markup) and swallow an answer
that quotes ``"<｜DSML｜tool_calls>"``. The glue therefore only ever hands the processor token ids; the tests
pin both behaviours, so a change in the recipe shows up as a failing test rather than as a security hole.

Two numbers are kept here rather than taken from the processor: ``completion_tokens`` is every id pushed, and
``reasoning_tokens`` the ids generated before the ``</think>`` id (the processor re-derives its count from the
reasoning text, which counts a spelled-out marker as one token).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import deepseek_recipe as recipe
import numpy as np

from deepinfer_jax.text.tokenizer import Tokenizer

__all__ = [
    "RECIPE_SPECIAL_TOKENS",
    "ChatDelta",
    "ChatOutput",
    "ChatOutputParser",
    "ToolCall",
    "ToolCallDelta",
    "marker_ids",
    "recipe_tokenizer",
]

RECIPE_SPECIAL_TOKENS: tuple[tuple[str, recipe.SpecialToken], ...] = (
    ("bos", recipe.SpecialToken.Bos),
    ("eos", recipe.SpecialToken.Eos),
    ("thinking_start", recipe.SpecialToken.ThinkingStart),
    ("thinking_end", recipe.SpecialToken.ThinkingEnd),
    ("system", recipe.SpecialToken.System),
    ("user", recipe.SpecialToken.User),
    ("assistant", recipe.SpecialToken.Assistant),
    ("latest_reminder", recipe.SpecialToken.LatestReminder),
    ("dsml", recipe.SpecialToken.Dsml),
    ("image", recipe.SpecialToken.Image),
    ("ref", recipe.SpecialToken.Ref),
    ("ref_end", recipe.SpecialToken.RefEnd),
    ("box", recipe.SpecialToken.Box),
    ("box_end", recipe.SpecialToken.BoxEnd),
    ("point", recipe.SpecialToken.Point),
    ("point_end", recipe.SpecialToken.PointEnd),
    ("polygon", recipe.SpecialToken.Polygon),
    ("polygon_end", recipe.SpecialToken.PolygonEnd),
)
"""Every special-token kind of ``deepseek-recipe``: its ``SpecialTokens`` keyword and its kind."""

FinishReason = Literal["stop", "length", "content_filter"]
_FINISH_REASONS: dict[str, recipe.InferenceFinishReason] = {
    "stop": recipe.InferenceFinishReason.Stop,
    "length": recipe.InferenceFinishReason.Length,
    "content_filter": recipe.InferenceFinishReason.ContentFilter,
}


def marker_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """The ids of the recipe's special tokens (default spellings) that ``tokenizer`` has as added tokens.

    Keys are the ``SpecialTokens`` keywords (``"thinking_end"``, ``"dsml"``, …). Only *added* tokens count: the
    recipe encodes a marker through the added vocabulary, and a spelling that is merely a BPE entry would be
    produced by ordinary text too.
    """
    added = {
        token.content: token_id for token_id, token in tokenizer.backend.get_added_tokens_decoder().items()
    }
    found: dict[str, int] = {}
    for name, kind in RECIPE_SPECIAL_TOKENS:
        token_id = added.get(kind.default_str())
        if token_id is not None:
            found[name] = token_id
    return found


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A tool call the model made, OpenAI style: ``arguments`` is the JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of the tool call at ``index``: the first piece carries ``id`` and ``name``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclasses.dataclass(frozen=True)
class ChatDelta:
    """What one :meth:`ChatOutputParser.push` added: text pieces and tool-call pieces, in stream order."""

    reasoning_content: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning_content or self.content or self.tool_calls)


@dataclasses.dataclass(frozen=True)
class ChatOutput:
    """The parsed assistant turn.

    ``reasoning_content`` is None when thinking mode was off. ``finish_reason`` is the protocol's reason
    (``"stop"``, ``"length"``, ``"tool_calls"``, ``"content_filter"``). ``usage`` holds ``prompt_tokens``,
    ``completion_tokens`` (every generated id, markers and EOS included) and ``reasoning_tokens`` (the ids before
    the ``</think>`` id, in thinking mode). ``parsed`` is ``json.loads(content)`` when the request was constrained
    to JSON (a schema or ``json_object``) and the content parses, else ``None``. ``LLM.chat`` also fills
    ``prompt_token_ids`` (the encoded conversation), ``token_ids`` (every generated id) and ``logprobs`` (the
    completion's, when ``SamplingParams.logprobs`` asked for them; else ``None``).
    """

    reasoning_content: str | None
    content: str
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str | None
    usage: Mapping[str, int]
    prompt_token_ids: tuple[int, ...] = ()
    token_ids: tuple[int, ...] = ()
    logprobs: Any = None
    parsed: Any = None


class ChatOutputParser:
    """Consumes the generated token ids of one assistant turn and parses them as it goes.

    Build it with :meth:`deepinfer_jax.text.EncodedChat.output_parser`, which knows the request (thinking mode,
    tools, prefix continuation) the parse depends on. Feed ids with :meth:`push`, which returns the
    :class:`ChatDelta` that became final; call :meth:`finish` with the engine's finish reason to get the
    :class:`ChatOutput`. Ids the tokenizer flags special (BOS, EOS, pad and, in V4, the reserved ids) are not
    text; they count as completion tokens. The processor decodes incrementally: invalid bytes become U+FFFD as in
    a full decode, except in the last id of a turn that ends inside a character (a token limit): that id's text
    is dropped. Not thread-safe: one parser per sequence.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        request: recipe.ConversationRequest,
        *,
        prompt_tokens: int = 0,
    ) -> None:
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a deepinfer_jax Tokenizer, got {type(tokenizer).__name__}")
        if not isinstance(request, recipe.ConversationRequest):
            raise TypeError(
                f"request must be a deepseek_recipe.ConversationRequest, got {type(request).__name__}"
            )
        if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int | np.integer):
            raise TypeError(f"prompt_tokens must be an int, got {type(prompt_tokens).__name__}")
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens={prompt_tokens} must be >= 0")
        self._tokenizer = tokenizer
        self._prompt_tokens = int(prompt_tokens)
        self._thinking_end_id = marker_ids(tokenizer).get("thinking_end")
        self._special_ids = tokenizer.special_ids

        options = request.parsing_options
        stage = options.thinking_initial_stage
        self._thinking = stage is not None
        self._counting_reasoning = stage is not None and stage.starts_in_reasoning()
        generator = recipe.ChatCompletionRequest.chunk_generator(request, "chat", "deepinfer-jax")
        self._processor = recipe.StreamProcessor(generator, options, recipe_tokenizer(tokenizer))
        self._response = recipe.ChatCompletionResponse("chat", "deepinfer-jax", 0, self._prompt_tokens, 0)
        self._num_tokens = 0
        self._reasoning_tokens = 0
        self._finished = False
        self._consume(
            self._processor.push(
                recipe.InferenceChunk.ready(
                    prompt_usage=recipe.PromptUsage(prompt_tokens=self._prompt_tokens)
                )
            )
        )

    @property
    def num_tokens(self) -> int:
        """How many ids were pushed so far."""
        return self._num_tokens

    @property
    def thinking(self) -> bool:
        """Whether the turn is parsed in thinking mode (reasoning first, then ``</think>``, then the answer)."""
        return self._thinking

    def push(self, ids: int | Iterable[Any]) -> ChatDelta:
        """Add generated ids (one id or an iterable) and return the parsed text and tool-call pieces that became
        final. Raises ``RuntimeError`` after :meth:`finish`."""
        if self._finished:
            raise RuntimeError("push() after finish(): this parser's turn has ended")
        if isinstance(ids, int | np.integer) and not isinstance(ids, bool):
            ids = [ids]
        try:
            checked = self._tokenizer.validate_ids(ids)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{exc} (stream position {self._num_tokens} onwards)") from None
        if self._counting_reasoning:
            for token_id in checked:
                if token_id == self._thinking_end_id:
                    self._counting_reasoning = False
                    break
                self._reasoning_tokens += 1
        self._num_tokens += len(checked)
        # Special-flagged ids (BOS, EOS, pad, reserved ids) are not text: the processor would print their
        # spellings. Dropping them before decoding joins the bytes around them as ``skip_special_tokens`` does.
        text_ids = [token_id for token_id in checked if token_id not in self._special_ids]
        # One chunk per id: the processor holds back a whole chunk whose decode ends inside a character and
        # drops what it holds when the turn ends, so a multi-id chunk could lose complete text before the cut.
        produced: list[Any] = []
        for token_id in text_ids:
            produced.extend(self._processor.push(recipe.InferenceChunk.tokens([token_id])))
        return self._consume(produced)

    def finish(self, finish_reason: FinishReason = "stop") -> ChatOutput:
        """End the turn and return the parsed output.

        ``finish_reason`` is why generation stopped: ``"stop"`` (EOS or a stop string), ``"length"`` (token
        limit) or ``"content_filter"``; the output's own reason may differ (``"tool_calls"``).
        """
        if self._finished:
            raise RuntimeError("finish() called twice on the same parser")
        if finish_reason not in _FINISH_REASONS:
            raise ValueError(f"finish_reason={finish_reason!r} must be one of {sorted(_FINISH_REASONS)}")
        self._finished = True
        produced = self._processor.push(recipe.InferenceChunk.finish(_FINISH_REASONS[finish_reason]))
        produced.extend(self._processor.finish())
        self._consume(produced)
        return self._output()

    # ------------------------------------------------------------------------------------------- internals

    def _consume(self, produced: list[Any]) -> ChatDelta:
        """Accumulate the processor's chunks into the response and merge their deltas into one ChatDelta."""
        reasoning: list[str] = []
        content: list[str] = []
        tool_calls: list[ToolCallDelta] = []
        for chunk in produced:
            # Read the chunk before accumulating it: accumulation consumes the Rust object.
            parsed = json.loads(chunk.to_json())
            self._response.accumulate(chunk)
            for choice in parsed.get("choices", ()):
                delta = choice.get("delta") or {}
                reasoning.append(delta.get("reasoning_content") or "")
                content.append(delta.get("content") or "")
                for call in delta.get("tool_calls") or ():
                    function = call.get("function") or {}
                    tool_calls.append(
                        ToolCallDelta(
                            index=int(call["index"]),
                            id=call.get("id"),
                            name=function.get("name"),
                            arguments=function.get("arguments") or "",
                        )
                    )
        return ChatDelta("".join(reasoning), "".join(content), tuple(tool_calls))

    def _output(self) -> ChatOutput:
        choice = json.loads(self._response.to_json())["choices"][0]
        message = choice["message"]
        reasoning = message.get("reasoning_content")
        if reasoning is None and self._thinking:
            reasoning = ""
        calls = tuple(
            ToolCall(id=call["id"], name=call["function"]["name"], arguments=call["function"]["arguments"])
            for call in message.get("tool_calls") or ()
        )
        return ChatOutput(
            reasoning_content=reasoning,
            content=message.get("content") or "",
            tool_calls=calls,
            finish_reason=choice.get("finish_reason"),
            usage={
                "prompt_tokens": self._prompt_tokens,
                "completion_tokens": self._num_tokens,
                "reasoning_tokens": self._reasoning_tokens,
            },
        )


@functools.lru_cache(maxsize=8)
def recipe_tokenizer(tokenizer: Tokenizer) -> recipe.Tokenizer:
    """The recipe's own handle on the same vocabulary (the recipe encodes and decodes with its own copy).

    Cached per :class:`Tokenizer` object: parsing the real V4 json takes about a second.
    """
    return recipe.Tokenizer.from_str(tokenizer.backend.to_str())
