"""Shared, expensive set-up of the text tests: loaded tokenizers are built once per session."""

from __future__ import annotations

import pytest

from deepinfer_jax.text import Tokenizer, build_synthetic_tokenizer, load_deepseek_v4_tokenizer

TINY_VOCAB_SIZE = 512


@pytest.fixture(scope="session")
def v4_tokenizer() -> Tokenizer:
    return load_deepseek_v4_tokenizer()


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Tokenizer:
    """The synthetic tokenizer of the tiny models (512 ids)."""
    return Tokenizer.from_str(build_synthetic_tokenizer(TINY_VOCAB_SIZE), source="synthetic-512")


@pytest.fixture(scope="session")
def bytes_only_tokenizer() -> Tokenizer:
    """The smallest synthetic tokenizer: no merges, so every non-special id is exactly one byte."""
    return Tokenizer.from_str(build_synthetic_tokenizer(266), source="synthetic-266")
