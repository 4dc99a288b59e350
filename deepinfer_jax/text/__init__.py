"""Text side of the engine: tokenizers, incremental detokenization, the synthetic test tokenizer, chat encoding
(deepseek-recipe) and the streaming parser of replies.

Nothing here imports jax: tokenization runs on the host, in the engine's output-processing thread.
"""

from deepinfer_jax.text.chat import ChatEncoder, EncodedChat
from deepinfer_jax.text.detokenize import IncrementalDetokenizer
from deepinfer_jax.text.output_parser import ChatDelta, ChatOutput, ChatOutputParser, ToolCall, ToolCallDelta
from deepinfer_jax.text.synthetic import (
    MAX_SYNTHETIC_VOCAB_SIZE,
    MIN_SYNTHETIC_VOCAB_SIZE,
    SYNTHETIC_MARKER,
    SYNTHETIC_SPECIAL_TOKENS,
    build_synthetic_tokenizer,
    write_synthetic_tokenizer,
)
from deepinfer_jax.text.tokenizer import (
    DEEPSEEK_BOS_TOKEN,
    DEEPSEEK_EOS_TOKEN,
    DEEPSEEK_PAD_TOKEN,
    Tokenizer,
    load_deepseek_v4_tokenizer,
)

__all__ = [
    "DEEPSEEK_BOS_TOKEN",
    "DEEPSEEK_EOS_TOKEN",
    "DEEPSEEK_PAD_TOKEN",
    "MAX_SYNTHETIC_VOCAB_SIZE",
    "MIN_SYNTHETIC_VOCAB_SIZE",
    "SYNTHETIC_MARKER",
    "SYNTHETIC_SPECIAL_TOKENS",
    "ChatDelta",
    "ChatEncoder",
    "ChatOutput",
    "ChatOutputParser",
    "EncodedChat",
    "IncrementalDetokenizer",
    "Tokenizer",
    "ToolCall",
    "ToolCallDelta",
    "build_synthetic_tokenizer",
    "load_deepseek_v4_tokenizer",
    "write_synthetic_tokenizer",
]
