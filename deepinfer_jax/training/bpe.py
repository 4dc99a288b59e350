"""A byte-level BPE tokenizer trained on the corpus, in the layout of the project's other tokenizers.

Ids 0-9 are the DeepSeek named tokens of :data:`deepinfer_jax.text.synthetic.SYNTHETIC_SPECIAL_TOKENS` (BOS,
EOS, pad flagged *special*; the chat markers ``<｜User｜>``, ``<｜Assistant｜>``, ``<think>``, ``</think>``,
``｜DSML｜``, ``<｜latest_reminder｜>``, ``<｜System｜>`` as added tokens that are not special, as the real V4
vocabulary flags them), so ``LLM.chat`` encodes V4.1 conversations with it unchanged. Then the 256 byte-level
symbols, the merges the ``tokenizers`` library's BPE trainer learns from the training split, and as the last id
:data:`NOISE_TOKEN`, the DSpark drafter's noise token (``dspark_noise_token_id``), a special token no text
encodes to.

The result is a ``tokenizer.json`` text (``tokenizers`` serialises it ordered by id) and the matching
``tokenizer_config.json`` dict; training is deterministic for a given corpus and size (checked by the tests).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from deepinfer_jax.text.synthetic import SYNTHETIC_SPECIAL_TOKENS

__all__ = [
    "MAX_VOCAB_SIZE",
    "MIN_VOCAB_SIZE",
    "NOISE_TOKEN",
    "tokenizer_config",
    "train_bpe_tokenizer",
]

NOISE_TOKEN = "<｜dspark▁noise｜>"
"""The last id of a trained vocabulary: the token that fills a DSpark draft block after its first position."""
MIN_VOCAB_SIZE = 1024
MAX_VOCAB_SIZE = 4096
_NUM_SPECIAL_FLAGGED = 3  # BOS, EOS, pad


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int) -> str:
    """The ``tokenizer.json`` text of a byte-level BPE of exactly ``vocab_size`` ids trained on ``texts``.

    Raises:
        ValueError: ``vocab_size`` outside ``[MIN_VOCAB_SIZE, MAX_VOCAB_SIZE]``, or a corpus too small to learn
            that many merges.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size: expected an int, got {vocab_size!r}")
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"vocab_size = {vocab_size}: must be in [{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}]")
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts: expected a non-empty sequence of str")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # the noise token is added last
        special_tokens=list(SYNTHETIC_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        min_frequency=2,
    )
    tok.train_from_iterator(list(texts), trainer)
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size - 1:
        raise ValueError(
            f"vocab_size = {vocab_size}: the corpus supports only {tok.get_vocab_size() + 1} ids "
            "(too few distinct pairs for that many merges)"
        )
    # The trainer registers the named tokens as special; re-flag the chat markers as plain added tokens, the
    # way the real vocabulary has them (so skip_special_tokens keeps them), and add the noise token.
    data = json.loads(tok.to_str())
    for entry in data["added_tokens"]:
        if entry["content"] in SYNTHETIC_SPECIAL_TOKENS[_NUM_SPECIAL_FLAGGED:]:
            entry["special"] = False
    tok = Tokenizer.from_str(json.dumps(data))
    tok.add_special_tokens([AddedToken(NOISE_TOKEN, special=True, normalized=False)])
    for i, spelling in enumerate(SYNTHETIC_SPECIAL_TOKENS):
        if tok.token_to_id(spelling) != i:
            raise RuntimeError(
                f"trained tokenizer: {spelling!r} has id {tok.token_to_id(spelling)}, expected {i}"
            )
    if tok.token_to_id(NOISE_TOKEN) != vocab_size - 1 or tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained tokenizer: {tok.get_vocab_size()} ids, expected {vocab_size}")
    return tok.to_str(pretty=True)


def tokenizer_config(tokenizer_text: str, *, model_max_length: int) -> dict[str, Any]:
    """``tokenizer_config.json`` for transformers' ``AutoTokenizer``: class, BOS / EOS / pad, maximum length."""
    tok = Tokenizer.from_str(tokenizer_text)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "bos_token": tok.id_to_token(0),
        "eos_token": tok.id_to_token(1),
        "pad_token": tok.id_to_token(2),
        "model_max_length": int(model_max_length),
    }
