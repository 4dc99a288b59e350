"""The synthetic byte-level tokenizer: id layout, exact size, determinism, the trainer, round trips."""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from deepinfer_jax.text import (
    MAX_SYNTHETIC_VOCAB_SIZE,
    MIN_SYNTHETIC_VOCAB_SIZE,
    SYNTHETIC_MARKER,
    SYNTHETIC_SPECIAL_TOKENS,
    Tokenizer,
    build_synthetic_tokenizer,
    synthetic,
    write_synthetic_tokenizer,
)
from deepinfer_jax.text.synthetic import CORPUS, byte_to_unicode

REPO = Path(__file__).resolve().parents[2]

# sha256 of build_synthetic_tokenizer(512) as UTF-8. An intentional change of the corpus or of the build changes
# it: regenerate with `python scripts/build_tiny_tokenizers.py --vocab-size 512` and update this value.
TINY_512_SHA256 = "2c99c9a23eb1513938b7d76fef2d697c5da5965ab1dcfcf83eb815abfd81f333"

EXPECTED_SPELLINGS = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜▁pad▁｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
    "<｜latest_reminder｜>",
    "<｜System｜>",
]


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _merges_of(json_text: str) -> list[tuple[str, str]]:
    merges = json.loads(json_text)["model"]["merges"]
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in merges]


# ------------------------------------------------------------------------------------------------ id layout


def test_named_tokens_take_ids_0_to_9(tiny_tokenizer: Tokenizer) -> None:
    assert list(SYNTHETIC_SPECIAL_TOKENS) == EXPECTED_SPELLINGS
    for token_id, spelling in enumerate(EXPECTED_SPELLINGS):
        assert tiny_tokenizer.token_to_id(spelling) == token_id
        assert tiny_tokenizer.id_to_token(token_id) == spelling
    assert (tiny_tokenizer.bos_id, tiny_tokenizer.eos_id, tiny_tokenizer.pad_id) == (0, 1, 2)
    # Flags mirror the real V4 vocabulary: BOS/EOS/pad are special, the chat markers are plain added tokens.
    assert tiny_tokenizer.special_ids == frozenset({0, 1, 2})
    added = tiny_tokenizer.backend.get_added_tokens_decoder()
    assert sorted(added) == list(range(10))


def test_byte_alphabet_matches_gpt2_convention() -> None:
    table = byte_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    # Hand-checked entries: printable bytes stand for themselves; the others count up from U+0100 in byte
    # order, so NUL is U+0100, LF (the 11th unprintable byte) U+010A, space (the 33rd) U+0120 'Ġ', DEL U+0121,
    # and the soft hyphen 0xAD, the last unprintable byte, U+0143 'Ń'.
    assert table[ord("!")] == "!" and table[ord("~")] == "~" and table[0xE9] == "é"
    assert table[0x00] == "\u0100"
    assert table[0x0A] == "Ċ"
    assert table[0x20] == "Ġ"
    assert table[0x7F] == "\u0121"
    assert table[0xAD] == "Ń"


def test_ids_10_to_265_are_the_bytes_in_order(bytes_only_tokenizer: Tokenizer) -> None:
    table = byte_to_unicode()
    for b in range(256):
        assert bytes_only_tokenizer.id_to_token(10 + b) == table[b]
    # Without merges every byte of the UTF-8 encoding is its own token: an independent check that the
    # vocabulary's byte symbols are the ones the library's pre-tokenizer produces.
    text = "Tab\there, NUL\x00, é, ß, 中文, 🙂, \x7f\n"
    assert bytes_only_tokenizer.encode(text) == [10 + b for b in text.encode("utf-8")]


@pytest.mark.parametrize(
    "vocab_size", [MIN_SYNTHETIC_VOCAB_SIZE, 267, 300, 512, 1000, MAX_SYNTHETIC_VOCAB_SIZE]
)
def test_vocab_has_exactly_the_requested_size(vocab_size: int) -> None:
    text = build_synthetic_tokenizer(vocab_size)
    tokenizer = Tokenizer.from_str(text)  # also checks that ids are contiguous
    assert tokenizer.vocab_size == vocab_size
    assert tokenizer.backend.get_vocab_size(with_added_tokens=True) == vocab_size
    merges = _merges_of(text)
    assert len(merges) == vocab_size - MIN_SYNTHETIC_VOCAB_SIZE
    # Merge k creates id 266 + k, spelled as the concatenation of its two parts.
    for k, (left, right) in enumerate(merges):
        assert tokenizer.token_to_id(left + right) == MIN_SYNTHETIC_VOCAB_SIZE + k


def test_smaller_vocab_merges_are_a_prefix_of_larger_ones() -> None:
    small, large = _merges_of(build_synthetic_tokenizer(300)), _merges_of(build_synthetic_tokenizer(512))
    assert large[: len(small)] == small


def test_corpus_supports_the_largest_size() -> None:
    assert len(synthetic._all_merges()) >= MAX_SYNTHETIC_VOCAB_SIZE - MIN_SYNTHETIC_VOCAB_SIZE


def test_merges_fold_case_and_accent_variants(tiny_tokenizer: Tokenizer) -> None:
    # Engram's tokenizer compression is tested on this vocabulary; it needs tokens that differ only by case.
    pieces = {tiny_tokenizer.decode([i]) for i in range(tiny_tokenizer.vocab_size)}
    assert {" the", " The"} <= pieces
    assert "é" in pieces


# -------------------------------------------------------------------------------------------- determinism


def test_build_is_byte_identical_and_pinned() -> None:
    first = build_synthetic_tokenizer.__wrapped__(512)
    synthetic._all_merges.cache_clear()  # learn the merges again rather than reuse them
    second = build_synthetic_tokenizer.__wrapped__(512)
    assert first.encode("utf-8") == second.encode("utf-8")
    assert _sha256(first) == TINY_512_SHA256
    assert build_synthetic_tokenizer(512) == first


def test_build_does_not_depend_on_hash_seed() -> None:
    # str hashing is randomised per process; a fresh interpreter with another seed must give the same bytes.
    code = (
        "import hashlib, deepinfer_jax.text as t; "
        "print(hashlib.sha256(t.build_synthetic_tokenizer(512).encode()).hexdigest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == TINY_512_SHA256


# --------------------------------------------------------------------------------------------- the trainer


def _naive_bpe(corpus: str, num_merges: int) -> list[tuple[str, str]]:
    """Reference BPE: recount every pair each round, take the most frequent, ties to the smaller bytes."""
    to_byte = {ch: b for b, ch in byte_to_unicode().items()}

    def key(pair: tuple[str, str]) -> tuple[bytes, bytes]:
        return bytes(to_byte[c] for c in pair[0]), bytes(to_byte[c] for c in pair[1])

    pieces = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True).pre_tokenize_str(corpus)
    words = Counter(tuple(piece) for piece, _ in pieces)
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        counts: Counter[tuple[str, str]] = Counter()
        for word, freq in words.items():
            for pair in itertools.pairwise(word):
                counts[pair] += freq
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], *key(p)))
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for word, freq in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if word[i : i + 2] == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += freq
        words = merged
    return merges


def test_trainer_hand_computed_tie_break() -> None:
    # Pre-tokens: "ab", " ab", " ab", " ba". Round 1: (a,b) x3. Round 2: (Ġ,ab) x2. Round 3 ties (Ġ,b) with
    # (b,a), one each: by bytes b" " < b"b" so (Ġ,b) wins, although "Ġ" (U+0120) sorts after "b" as a character.
    assert synthetic._learn_merges("ab ab ab ba", 10) == [("a", "b"), ("Ġ", "ab"), ("Ġ", "b"), ("Ġb", "a")]


def test_trainer_matches_naive_reference_to_exhaustion() -> None:
    corpus = "Café cafe CAFE café! 12 123 1234 — 中文中文 中 the The THE then thence ab ba aab bba\n\n  x"
    learnt = synthetic._learn_merges(corpus, 10_000)
    assert learnt == _naive_bpe(corpus, 10_000)


def test_trainer_matches_naive_reference_on_the_corpus() -> None:
    assert _merges_of(build_synthetic_tokenizer(MIN_SYNTHETIC_VOCAB_SIZE + 100)) == _naive_bpe(CORPUS, 100)


# ------------------------------------------------------------------------------------------- round trips


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_any_text_round_trips(tiny_tokenizer: Tokenizer, text: str) -> None:
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text)) == text


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=8), st.sampled_from(EXPECTED_SPELLINGS)), max_size=8).map("".join))
def test_text_with_named_tokens_round_trips(tiny_tokenizer: Tokenizer, text: str) -> None:
    ids = tiny_tokenizer.encode(text, add_bos=True)
    assert ids[0] == 0
    assert tiny_tokenizer.decode(ids) == "<｜begin▁of▁sentence｜>" + text


def test_named_tokens_encode_as_single_ids(tiny_tokenizer: Tokenizer) -> None:
    ids = tiny_tokenizer.encode("<｜System｜>sys<｜User｜>hi<｜Assistant｜><think>x</think>｜DSML｜")
    for token_id in (9, 3, 4, 5, 6, 7):
        assert token_id in ids
    assert ids[0] == 9


# ------------------------------------------------------------------------------------------ labelling, io


def test_synthetic_label(tiny_tokenizer: Tokenizer, v4_tokenizer: Tokenizer) -> None:
    assert tiny_tokenizer.is_synthetic
    assert not v4_tokenizer.is_synthetic
    normalizer = json.loads(build_synthetic_tokenizer(512))["normalizer"]
    assert normalizer == {
        "type": "Replace",
        "pattern": {"String": SYNTHETIC_MARKER},
        "content": SYNTHETIC_MARKER,
    }
    assert "synthetic" in repr(tiny_tokenizer)
    # The marker normalizer changes no text, the marker string itself included.
    marked = f"a{SYNTHETIC_MARKER}b"
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(marked)) == marked


def test_write_to_directory_and_file(tmp_path: Path) -> None:
    written = write_synthetic_tokenizer(tmp_path, 300)
    assert written == tmp_path / "tokenizer.json"
    assert written.read_bytes() == build_synthetic_tokenizer(300).encode("utf-8")
    loaded = Tokenizer.from_file(tmp_path)
    assert loaded.vocab_size == 300 and loaded.is_synthetic

    named = write_synthetic_tokenizer(str(tmp_path / "other.json"), 512)
    assert _sha256(named.read_text(encoding="utf-8")) == TINY_512_SHA256
    # The atomic write leaves no temporary file behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.json", "tokenizer.json"]


def test_write_refuses_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        write_synthetic_tokenizer(tmp_path / "missing" / "tokenizer.json", 512)
    with pytest.raises(TypeError, match="path"):
        write_synthetic_tokenizer(3, 512)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [MIN_SYNTHETIC_VOCAB_SIZE - 1, MAX_SYNTHETIC_VOCAB_SIZE + 1, 0, -5])
def test_vocab_size_out_of_range(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"vocab_size={bad} .*\[266, 2048\]"):
        build_synthetic_tokenizer(bad)


@pytest.mark.parametrize("bad", ["512", 512.0, True, None])
def test_vocab_size_wrong_type(bad: object) -> None:
    with pytest.raises(TypeError, match="vocab_size must be an int"):
        build_synthetic_tokenizer(bad)  # type: ignore[arg-type]


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "build_tiny_tokenizers", REPO / "scripts" / "build_tiny_tokenizers.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_writes_each_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = _load_script()
    assert script.main(["--vocab-size", "512", "--vocab-size", "300", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"vocab_size=512  sha256={TINY_512_SHA256}" in out
    for size in (300, 512):
        file = tmp_path / f"synthetic-{size}" / "tokenizer.json"
        assert file.read_bytes() == build_synthetic_tokenizer(size).encode("utf-8")


def test_script_refuses_bad_size(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _load_script().main(["--vocab-size", "100"])
    assert exc.value.code == 2
    assert "vocab_size=100" in capsys.readouterr().err
