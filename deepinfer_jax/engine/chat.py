"""``LLM.chat``: conversations in, parsed assistant turns out.

The work is split between the text layer and the engine, and this module is only the seam between them:

1. every conversation is encoded by :class:`~deepinfer_jax.text.ChatEncoder` (DeepSeek's own template through
   ``deepseek-recipe``, with its injection defence) into prompt ids;
2. the prompts run through :meth:`LLM.generate` as ordinary ``prompt_token_ids`` requests, so a chat reply is
   token for token what ``generate`` produces for the same ids, seeds included;
3. each reply's *ids* (never its text) go through the recipe's stream processor
   (:meth:`~deepinfer_jax.text.EncodedChat.output_parser`), which recognises ``</think>`` and the DSML
   tool-call tags only as the marker token ids.

Everything that can be wrong with the input - no tokenizer, a tokenizer larger than the model's vocabulary, a
message or tool the encoder refuses, a ``sampling_params`` list of the wrong length, a prompt too long for the
engine - raises ``ValueError``/``TypeError`` before any request is queued, so the ``LLM`` is untouched and
keeps working.

**Which template.** DeepSeek-V4.1 models use the V4.1 encoding (``"v41"``: the system prompt is marked with
``<｜System｜>``); every other family uses the V4 encoding (``"v4"``), the only other one the recipe has. A
caller may ask for ``"v41"`` explicitly (``chat_version="v41"``) for a model whose tokenizer carries
``<｜System｜>`` - the tiny models' synthetic tokenizers do; a tokenizer without it is refused by the encoder
with that explanation. An explicit ``"v4"`` for a V4.1 model is honoured too (the caller knows best).

**Where a turn ends.** DeepSeek's template closes the assistant turn with ``<｜end▁of▁sentence｜>``. The
engine stops at the model's ``eos_token_id``; when the tokenizer's turn-end id is not among those (a tokenizer
given separately from the checkpoint), it is added to the request's ``stop_token_ids``, so a reply always ends
where the template says the turn ends. ``ignore_eos=True`` is respected: nothing is added and the reply runs
to ``max_tokens``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from absl import logging

from deepinfer_jax.engine.params import CompletionOutput, SamplingParams
from deepinfer_jax.engine.structured import StructuredOutputsParams
from deepinfer_jax.text.chat import CHAT_VERSIONS, ChatEncoder, EncodedChat
from deepinfer_jax.text.output_parser import ChatOutput
from deepinfer_jax.text.tokenizer import DEEPSEEK_EOS_TOKEN, Tokenizer

if TYPE_CHECKING:
    from deepinfer_jax.engine.llm import LLM

__all__ = [
    "ChatVersion",
    "chat",
    "chat_encoder",
    "chat_sampling_params",
    "chat_version_for",
    "parse_chat_output",
    "split_conversations",
]

ChatVersion = Literal["v4", "v41"]

Messages = Sequence[Mapping[str, Any]]

_V41_FAMILY = "deepseek_v41"


def chat_version_for(family: str, requested: str | None = None) -> str:
    """The chat encoding for a model of ``family``: ``requested`` when given, else ``"v41"`` for DeepSeek-V4.1
    and ``"v4"`` for every other family."""
    if requested is None:
        return "v41" if family == _V41_FAMILY else "v4"
    if not isinstance(requested, str) or requested not in CHAT_VERSIONS:
        raise ValueError(
            f"chat_version={requested!r} is not supported; expected None (follow the model) or one of "
            f"{sorted(CHAT_VERSIONS)}"
        )
    return requested


@functools.lru_cache(maxsize=8)
def _cached_encoder(tokenizer: Tokenizer, version: str) -> ChatEncoder:
    # Building an encoder checks the markers and wraps the vocabulary for the recipe; do it once per
    # (tokenizer, version) rather than on every chat call.
    return ChatEncoder(tokenizer, version=version)  # type: ignore[arg-type]


def chat_encoder(tokenizer: Tokenizer | None, vocab_size: int, version: str) -> ChatEncoder:
    """The :class:`ChatEncoder` for a model's tokenizer, after checking that the model can take its ids.

    Raises ``ValueError`` when there is no tokenizer (a model folder without ``tokenizer.json``) and when the
    tokenizer has more ids than the model's vocabulary: such a tokenizer belongs to another model, and its
    high ids would be refused only later, one prompt at a time, or never be generated.
    """
    if tokenizer is None:
        raise ValueError(
            "chat: this model has no tokenizer (no tokenizer.json in its folder and none given as "
            "LLM(tokenizer=...)); chat needs one to encode conversations - give LLM(tokenizer=...) or use "
            "generate(prompt_token_ids=...)"
        )
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"chat: the tokenizer {tokenizer.source} has {tokenizer.vocab_size} ids, more than the model's "
            f"vocab_size={vocab_size}; it is not this model's tokenizer"
        )
    return _cached_encoder(tokenizer, version)


def split_conversations(messages: Any) -> list[Messages]:
    """Normalise ``messages`` (one conversation or a batch of them) to a list of conversations.

    One conversation is a list of message dicts; a batch is a list of such lists. Mixing the two is refused
    with the index of the first item that does not fit.
    """
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        raise TypeError(
            "messages: expected a list of message dicts or a list of conversations (lists of message dicts), "
            f"got {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages: the list is empty; give at least one message or one conversation")
    if isinstance(messages[0], Mapping):
        return [messages]
    conversations: list[Messages] = []
    for index, conversation in enumerate(messages):
        if isinstance(conversation, str | bytes | Mapping) or not isinstance(conversation, Sequence):
            raise TypeError(
                f"messages[{index}]: expected a conversation (a list of message dicts) like messages[0], got "
                f"{type(conversation).__name__}"
            )
        conversations.append(conversation)
    return conversations


def chat_sampling_params(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    n: int,
    turn_end_id: int,
    eos_ids: Any,
    default: SamplingParams | None = None,
) -> list[SamplingParams]:
    """One :class:`SamplingParams` per conversation, each stopping at the template's turn-end id.

    ``eos_ids`` are the ids the engine already stops at; ``turn_end_id`` is added to ``stop_token_ids`` only
    when it is not one of them and the request does not ``ignore_eos``. ``default`` is used when
    ``sampling_params`` is ``None`` (the engine's configured defaults; ``SamplingParams()`` if not given).
    """
    if sampling_params is None:
        params = [default if default is not None else SamplingParams()] * n
    elif isinstance(sampling_params, SamplingParams):
        params = [sampling_params] * n
    elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str | bytes):
        if len(sampling_params) != n:
            raise ValueError(
                f"sampling_params: {len(sampling_params)} entries for {n} conversation(s); give one "
                "SamplingParams, or a list with one per conversation"
            )
        params = list(sampling_params)
        for index, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(
                    f"sampling_params[{index}]: expected a SamplingParams, got {type(p).__name__}"
                )
    else:
        raise TypeError(
            "sampling_params: expected None, a SamplingParams or a list of them, got "
            f"{type(sampling_params).__name__}"
        )
    if turn_end_id in set(eos_ids):
        return params
    return [
        p
        if p.ignore_eos or turn_end_id in p.stop_token_ids
        else p.replace(stop_token_ids=(*p.stop_token_ids, turn_end_id))
        for p in params
    ]


def parse_chat_output(encoded: EncodedChat, completion: CompletionOutput) -> ChatOutput:
    """Parse one finished completion of ``encoded``'s prompt from its token ids.

    ``usage.completion_tokens`` is ``len(completion.token_ids)``. A request that failed at run time
    (``finish_reason="error"``) keeps what it generated, parsed, with ``finish_reason="error"``; its message is
    logged, since :class:`ChatOutput` has no field for it.
    """
    reason = completion.finish_reason
    if reason not in ("stop", "length", "error"):
        raise ValueError(
            f"completion.finish_reason={reason!r}: only finished completions ('stop', 'length', 'error') parse"
        )
    parser = encoded.output_parser()
    parser.push(completion.token_ids)
    ids = {
        "prompt_token_ids": tuple(encoded.token_ids),
        "token_ids": tuple(completion.token_ids),
        "logprobs": completion.logprobs,
    }
    if reason == "error":
        logging.warning("chat: a request failed after %d tokens: %s", parser.num_tokens, completion.error)
        return dataclasses.replace(parser.finish("stop"), finish_reason="error", **ids)
    return dataclasses.replace(parser.finish(reason), **ids)


def _generation_prompt(encoder: ChatEncoder, thinking: bool) -> tuple[int, ...]:
    """The ids the template appends to open the assistant's reply: ``<｜Assistant｜>`` and the thinking marker."""
    markers = encoder.marker_ids
    return (markers["<｜Assistant｜>"], markers["<think>" if thinking else "</think>"])


def conversation_options(
    conversation: Messages, add_generation_prompt: bool, continue_final_message: bool, where: str
) -> Messages:
    """``conversation`` as the template should see it under vLLM's ``add_generation_prompt`` /
    ``continue_final_message`` (the last assistant message becomes a ``prefix`` to continue)."""
    if not continue_final_message:
        return conversation
    last = conversation[-1] if conversation else None
    if not isinstance(last, Mapping) or last.get("role") != "assistant":
        role = last.get("role") if isinstance(last, Mapping) else None
        raise ValueError(
            f"chat: {where}continue_final_message=True needs the last message to be an assistant message to "
            f"continue; it is role {role!r}"
        )
    return [*conversation[:-1], {**last, "prefix": True}]


def chat(
    llm: LLM,
    messages: Messages | Sequence[Messages],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: bool = False,
    reasoning_effort: str | None = None,
    use_tqdm: bool = True,
    chat_version: ChatVersion | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tool_choice: str | Mapping[str, Any] | None = None,
) -> list[ChatOutput]:
    """Run one conversation or a batch of them; returns one :class:`ChatOutput` per conversation, in order.

    ``tools``, ``thinking``, ``reasoning_effort``, ``add_generation_prompt`` and ``continue_final_message``
    apply to every conversation. See :meth:`LLM.chat`.
    """
    for name, value in (
        ("add_generation_prompt", add_generation_prompt),
        ("continue_final_message", continue_final_message),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"chat: {name} must be a bool, got {type(value).__name__} ({value!r})")
    if add_generation_prompt and continue_final_message:
        raise ValueError(
            "chat: continue_final_message=True continues the last assistant message, so it cannot be combined "
            "with add_generation_prompt=True (a new assistant turn); set add_generation_prompt=False"
        )
    conversations = split_conversations(messages)
    model_config = llm.model.config
    version = chat_version_for(model_config.family, chat_version)
    encoder = chat_encoder(llm.tokenizer, model_config.vocab_size, version)
    params = chat_sampling_params(
        sampling_params,
        len(conversations),
        encoder.marker_ids[DEEPSEEK_EOS_TOKEN],
        llm.eos_token_ids,
        llm.default_sampling_params(),
    )
    encoded: list[EncodedChat] = []
    for index, conversation in enumerate(conversations):
        where = "" if len(conversations) == 1 else f"conversation {index}: "
        conversation = conversation_options(
            conversation, add_generation_prompt, continue_final_message, where
        )
        try:
            e = encoder.encode_chat(conversation, tools, thinking, reasoning_effort)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"chat: {where}{exc}") from exc
        if not add_generation_prompt and not continue_final_message:
            # The template always opens the reply; without a generation prompt the model writes that itself.
            opening = _generation_prompt(encoder, e.thinking)
            if e.token_ids[-len(opening) :] == opening:
                e = dataclasses.replace(e, token_ids=e.token_ids[: -len(opening)])
        encoded.append(e)
    tool_so = tool_call_constraint(tools, tool_choice, encoder.marker_ids.get("｜DSML｜"))
    if tool_so is not None:
        for index, p in enumerate(params):
            if p.structured_outputs is not None:
                raise ValueError(
                    f"chat: sampling_params[{index}].structured_outputs and tool_choice={tool_choice!r} both "
                    "constrain the reply; give one"
                )
        params = [p.replace(structured_outputs=tool_so) for p in params]
    if thinking:
        params = [_after_reasoning(p, encoder.marker_ids["</think>"]) for p in params]
    outputs = llm.generate(
        prompt_token_ids=[list(e.token_ids) for e in encoded], sampling_params=params, use_tqdm=use_tqdm
    )
    return [
        _with_parsed(parse_chat_output(e, out.outputs[0]), p)
        for e, out, p in zip(encoded, outputs, params, strict=True)
    ]


def _lark(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def tool_call_constraint(
    tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any, dsml_id: int | None
) -> StructuredOutputsParams | None:
    """The grammar of ``tool_choice``'s DSML tool-call block (``None`` when the reply stays free).

    The block is the template's: ``<｜DSML｜tool_calls>``, then per call ``<｜DSML｜invoke name="...">`` with one
    ``<｜DSML｜parameter name="..." string="true|false">`` per argument (string arguments as text without ``<``,
    the others as compact JSON following their schema; a string's ``maxLength`` bounds it), in the schema's property order, required ones always and the
    others optionally. ``"required"`` allows one or more calls of any given tool, a named function one call of it.
    """
    if tool_choice is None or tool_choice == "auto":
        return None
    if not tools:
        raise ValueError(f"chat: tool_choice={tool_choice!r} needs tools")
    if dsml_id is None:
        raise ValueError("chat: tool_choice needs a tokenizer with the ｜DSML｜ marker")
    by_name: dict[str, Mapping[str, Any]] = {}
    for t in tools:
        fn = t.get("function", t) if isinstance(t, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"chat: tool {t!r} has no function name")
        by_name[fn["name"]] = fn.get("parameters") or {"type": "object", "properties": {}}
    if tool_choice == "required":
        names, many = list(by_name), True
    elif isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in by_name:
            raise ValueError(
                f"chat: tool_choice names function {name!r}, which is not among the tools {list(by_name)}"
            )
        names, many = [name], False
    else:
        raise ValueError(
            f"chat: tool_choice={tool_choice!r} must be None, 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}"
        )
    d = "dsml"
    rules = [
        f'start: "\\n\\n<" {d} "tool_calls>\\n" {"calls+" if many else "calls"} "</" {d} "tool_calls>"',
        f"{d}: <[{int(dsml_id)}]>",
        "calls: " + " | ".join(f"call_{i}" for i in range(len(names))),
    ]
    for i, name in enumerate(names):
        schema = by_name[name]
        props = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        parts = []
        for j, (pname, pschema) in enumerate(props.items()):
            is_str = isinstance(pschema, Mapping) and pschema.get("type") == "string"
            head = f'"<" {d} ' + _lark(f'parameter name="{pname}" string="{"true" if is_str else "false"}">')
            rules.append(f'param_{i}_{j}: {head} value_{i}_{j} "</" {d} ' + _lark("parameter>\n"))
            if is_str:
                most = pschema.get("maxLength")
                rules.append(f"value_{i}_{j}: /[^<]{{0,{int(most)}}}/" if most else f"value_{i}_{j}: /[^<]*/")
            else:
                compact = {
                    **pschema,
                    "x-guidance": {"whitespace_flexible": False},
                }  # JSON without free spaces
                rules.append(f"value_{i}_{j}: %json " + json.dumps(compact))
            parts.append(f"param_{i}_{j}" + ("" if pname in required else "?"))
        invoke = _lark(f'invoke name="{name}">\n')
        rules.append(f'call_{i}: "<" {d} {invoke} {" ".join(parts)} "</" {d} ' + _lark("invoke>\n"))
    return StructuredOutputsParams(grammar="\n".join(rules))


def _after_reasoning(params: SamplingParams, think_end: int) -> SamplingParams:
    """In thinking mode a grammar applies to the answer: after the model's ``</think>`` id (a trigger on the
    id, never on text), unless the request names its own trigger."""
    so = params.structured_outputs
    if so is None or so.trigger_token_ids is not None:
        return params
    return params.replace(structured_outputs=so.with_trigger((think_end,)))


def _with_parsed(out: ChatOutput, params: SamplingParams) -> ChatOutput:
    """``ChatOutput.parsed``: the JSON value of a JSON-constrained answer (``None`` if it does not parse)."""
    so = params.structured_outputs
    if so is None or so.kind not in ("json", "json_object"):
        return out
    try:
        value = json.loads(out.content)
    except ValueError:
        return out
    return dataclasses.replace(out, parsed=value)
