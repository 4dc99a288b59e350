"""Language-model quality of a text, measured through the engine: bits per character, perplexity, tokens/s.

:func:`evaluate_text` tokenises the text (no special tokens), cuts the ids into chunks of at most
``chunk_tokens`` tokens, prefixes each chunk with BOS and asks the engine for the prompt log-probabilities
(``LLM.generate(..., SamplingParams(max_tokens=1, prompt_logprobs=0))``): the log-probability of every chunk
token given BOS and the chunk tokens before it, computed by the engine's own prefill over its paged caches, in its
precision mode and cache formats. Each chunk starts with no context but BOS, so a chunk's first tokens are
predicted from little context; shorter chunks therefore measure a little worse.

* ``bits_per_char = −Σ log2 p(token) / characters``, characters counted in the text the scored tokens decode to
  (the whole text: chunks cover it without gaps or overlap), so that tokenizers of different vocabularies compare;
* ``perplexity = exp(−Σ ln p / tokens)`` per token of this tokenizer;
* ``tokens_per_s``: scored tokens over the wall time of the ``generate`` calls (prefill dominated).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

__all__ = ["TextScore", "evaluate_text"]


@dataclasses.dataclass(frozen=True)
class TextScore:
    """The result of :func:`evaluate_text`."""

    characters: int
    tokens: int
    chunks: int
    chunk_tokens: int
    nats: float
    seconds: float

    @property
    def bits_per_char(self) -> float:
        return self.nats / math.log(2.0) / self.characters

    @property
    def perplexity(self) -> float:
        return math.exp(self.nats / self.tokens)

    @property
    def nats_per_token(self) -> float:
        return self.nats / self.tokens

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "bits_per_char": self.bits_per_char,
            "perplexity": self.perplexity,
            "nats_per_token": self.nats_per_token,
            "tokens_per_s": self.tokens_per_s,
        }


def evaluate_text(
    llm: Any, text: str, *, chunk_tokens: int | None = None, batch: int = 16, use_tqdm: bool = False
) -> TextScore:
    """Score ``text`` with ``llm`` (a :class:`deepinfer_jax.LLM` with a tokenizer); see the module docstring.

    ``chunk_tokens`` defaults to ``llm.max_model_len − 2`` (a chunk plus its BOS and the one generated token must
    fit); ``batch`` chunks go to the engine per ``generate`` call.

    Raises:
        ValueError: an empty text, a model without a tokenizer, or ``chunk_tokens`` outside
            ``[1, max_model_len − 2]``.
    """
    from deepinfer_jax.engine.params import SamplingParams

    if not isinstance(text, str) or not text:
        raise ValueError("text: expected a non-empty str")
    tok = llm.tokenizer
    if tok is None:
        raise ValueError("llm: the model has no tokenizer.json; bits per character need one")
    limit = llm.max_model_len - 2
    if chunk_tokens is None:
        chunk_tokens = limit
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or not 1 <= chunk_tokens <= limit:
        raise ValueError(
            f"chunk_tokens: {chunk_tokens!r}; must be an int in [1, max_model_len - 2 = {limit}] (BOS and the "
            "generated token share the request's max_model_len)"
        )
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch: {batch!r}; must be an int >= 1")
    ids = tok.encode(text)
    if not ids:
        raise ValueError("text: encodes to no token")
    chunks = [ids[i : i + chunk_tokens] for i in range(0, len(ids), chunk_tokens)]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    nats, scored, seconds = 0.0, 0, 0.0
    for start in range(0, len(chunks), batch):
        group = [[tok.bos_id, *chunk] for chunk in chunks[start : start + batch]]
        t0 = time.perf_counter()
        outputs = llm.generate(prompt_token_ids=group, sampling_params=params, use_tqdm=use_tqdm)
        seconds += time.perf_counter() - t0
        for prompt, out in zip(group, outputs, strict=True):
            entries = out.prompt_logprobs
            if entries is None or len(entries) != len(prompt):
                raise RuntimeError("the engine returned no prompt log-probabilities for a chunk")
            for token, entry in zip(prompt[1:], entries[1:], strict=True):
                nats -= entry[token].logprob
                scored += 1
    characters = len(tok.decode(ids))
    return TextScore(
        characters=characters,
        tokens=scored,
        chunks=len(chunks),
        chunk_tokens=chunk_tokens,
        nats=nats,
        seconds=seconds,
    )
