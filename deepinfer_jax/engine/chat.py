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
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from absl import logging

from deepinfer_jax.engine.params import CompletionOutput, SamplingParams
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
    if reason == "error":
        logging.warning("chat: a request failed after %d tokens: %s", parser.num_tokens, completion.error)
        return dataclasses.replace(parser.finish("stop"), finish_reason="error")
    return parser.finish(reason)


def chat(
    llm: LLM,
    messages: Messages | Sequence[Messages],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: bool = False,
    reasoning_effort: str | None = None,
    use_tqdm: bool = True,
    chat_version: ChatVersion | None = None,
) -> list[ChatOutput]:
    """Run one conversation or a batch of them; returns one :class:`ChatOutput` per conversation, in order.

    ``tools``, ``thinking`` and ``reasoning_effort`` apply to every conversation. See :meth:`LLM.chat`.
    """
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
        try:
            encoded.append(encoder.encode_chat(conversation, tools, thinking, reasoning_effort))
        except (TypeError, ValueError) as exc:
            where = "" if len(conversations) == 1 else f"conversation {index}: "
            raise type(exc)(f"chat: {where}{exc}") from exc
    outputs = llm.generate(
        prompt_token_ids=[list(e.token_ids) for e in encoded], sampling_params=params, use_tqdm=use_tqdm
    )
    return [parse_chat_output(e, out.outputs[0]) for e, out in zip(encoded, outputs, strict=True)]
