"""IncrementalDetokenizer: deltas are exact slices of the full decode, never a premature U+FFFD, bounded work."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from deepinfer_jax.text import IncrementalDetokenizer, Tokenizer
from deepinfer_jax.text.detokenize import KEEP_AFTER_CUT, MAX_WINDOW
from deepinfer_jax.text.synthetic import byte_to_unicode

FFFD = "\ufffd"
SAMPLE_TEXT = "Grüße, 世界! 🙂 naïve café — こんにちは 🇯🇵\n\n  done"


def _stream(tokenizer: Tokenizer, ids: Sequence[int], chunks: Sequence[int], skip: bool) -> list[str]:
    """Feed ``ids`` in chunks of the given sizes, checking every delta against the full decode on the way."""
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    deltas: list[str] = []
    done = 0
    start = 0
    for size in chunks:
        piece = list(ids[start : start + size])
        start += size
        # A single id goes in as a Python int (the engine's per-token push, decoded through decode_one), more as a list.
        delta = detok.push(int(piece[0]) if len(piece) == 1 else piece)
        # The delta is the slice of the full decode at its position: in particular it holds a U+FFFD only
        # where the full text has one.
        assert delta == full[done : done + len(delta)]
        done += len(delta)
        deltas.append(delta)
        # Bounded look-back: the window never holds more than the cut limit plus the ids just pushed.
        assert len(detok._window) <= MAX_WINDOW + len(piece)
    assert start >= len(ids)
    deltas.append(detok.finish())
    assert "".join(deltas) == full
    assert detok.num_tokens == len(ids)
    return deltas


def _byte_ids(tokenizer: Tokenizer) -> dict[int, int]:
    """Byte value -> id of the single-byte token."""
    table = byte_to_unicode()
    ids = {b: tokenizer.token_to_id(table[b]) for b in range(256)}
    assert all(i is not None for i in ids.values())
    return ids  # type: ignore[return-value]


def _partial_ids(tokenizer: Tokenizer, limit: int) -> list[int]:
    """Ids (among the first ``limit``) of tokens whose bytes are not valid UTF-8 on their own."""
    to_byte = {ch: b for b, ch in byte_to_unicode().items()}
    out = []
    for token_id in range(limit):
        token = tokenizer.id_to_token(token_id)
        if all(ch in to_byte for ch in token):
            try:
                bytes(to_byte[ch] for ch in token).decode("utf-8")
            except UnicodeDecodeError:
                out.append(token_id)
    return out


def _id_streams(tokenizer: Tokenizer, partial: list[int], words: list[int]) -> st.SearchStrategy[list[int]]:
    byte_ids = _byte_ids(tokenizer)
    high = [byte_ids[b] for b in range(0x80, 0x100)]  # continuation and lead bytes, and never-valid ones
    markers = sorted(tokenizer.special_ids | {i for i in range(10) if i < tokenizer.vocab_size})
    one = st.one_of(
        st.integers(0, tokenizer.vocab_size - 1),
        st.sampled_from(markers),
        st.sampled_from(high),
        st.sampled_from(partial),
        st.sampled_from(words),
    )
    # Long runs of high bytes and partial tokens keep the text ending in U+FFFD, which drives window cuts.
    segment = st.one_of(st.lists(one, max_size=6), st.lists(st.sampled_from(high + partial), max_size=40))
    return st.lists(segment, max_size=6).map(lambda parts: [i for part in parts for i in part])


def _chunks(data: st.DataObject, n: int) -> list[int]:
    sizes: list[int] = []
    while sum(sizes) < n:
        sizes.append(data.draw(st.integers(1, 4)))
    return sizes


@pytest.fixture(scope="module")
def tiny_pools(tiny_tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    return _partial_ids(tiny_tokenizer, tiny_tokenizer.vocab_size), tiny_tokenizer.encode(SAMPLE_TEXT)


@pytest.fixture(scope="module")
def v4_pools(v4_tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    partial = _partial_ids(v4_tokenizer, 128_000)
    assert len(partial) > 100  # the V4 vocabulary has many tokens that end or start inside a character
    return partial, v4_tokenizer.encode(SAMPLE_TEXT)


# ------------------------------------------------------------------------------------------------ properties


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_stream_equals_full_decode_tiny(
    tiny_tokenizer: Tokenizer, tiny_pools: tuple[list[int], list[int]], data: st.DataObject, skip: bool
) -> None:
    ids = data.draw(_id_streams(tiny_tokenizer, *tiny_pools))
    _stream(tiny_tokenizer, ids, _chunks(data, len(ids)), skip)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_stream_equals_full_decode_v4(
    v4_tokenizer: Tokenizer, v4_pools: tuple[list[int], list[int]], data: st.DataObject, skip: bool
) -> None:
    ids = data.draw(_id_streams(v4_tokenizer, *v4_pools))
    _stream(v4_tokenizer, ids, _chunks(data, len(ids)), skip)


@settings(max_examples=50, deadline=None)
@given(text=st.text(max_size=60))
def test_stream_of_encoded_text_is_the_text(tiny_tokenizer: Tokenizer, text: str) -> None:
    ids = tiny_tokenizer.encode(text)
    deltas = _stream(tiny_tokenizer, ids, [1] * len(ids), skip=False)
    assert "".join(deltas) == text
    assert FFFD not in "".join(deltas) or FFFD in text


# ------------------------------------------------------------------------------------------ hand examples


def test_split_characters_are_held_back(bytes_only_tokenizer: Tokenizer) -> None:
    # With no merges every id is one byte: "中" is E4 B8 AD, "🙂" is F0 9F 99 82.
    ids = bytes_only_tokenizer.encode("a中🙂")
    assert _stream(bytes_only_tokenizer, ids, [1] * len(ids), skip=False) == [
        "a", "", "", "中", "", "", "", "🙂", "",
    ]  # fmt: skip


def test_incomplete_tail_is_flushed_as_one_replacement(bytes_only_tokenizer: Tokenizer) -> None:
    ids = bytes_only_tokenizer.encode("x中")[:-1]  # "x" then E4 B8: the character never completes
    assert _stream(bytes_only_tokenizer, ids, [1, 1, 1], skip=False) == ["x", "", "", FFFD]


def test_run_of_interrupted_lead_bytes_streams_and_stays_bounded(bytes_only_tokenizer: Tokenizer) -> None:
    # Every prefix of E4 E4 E4 ... ends in an incomplete sequence, so no token boundary is ever "clean": each
    # E4 is final (one U+FFFD) only once the next byte shows it was interrupted. Output must keep flowing
    # and the window must be cut rather than grow.
    lead = _byte_ids(bytes_only_tokenizer)[0xE4]
    deltas = _stream(bytes_only_tokenizer, [lead] * 200, [1] * 200, skip=False)
    assert deltas == ["", *[FFFD] * 199, FFFD]


def test_run_of_orphan_continuation_bytes(bytes_only_tokenizer: Tokenizer) -> None:
    cont = _byte_ids(bytes_only_tokenizer)[0x80]
    deltas = _stream(bytes_only_tokenizer, [cont] * 100, [3] * 34, skip=False)
    assert "".join(deltas) == FFFD * 100
    assert all(FFFD * 2 in d or d == FFFD or d == "" for d in deltas)


def test_character_completed_right_after_a_window_cut(bytes_only_tokenizer: Tokenizer) -> None:
    byte = _byte_ids(bytes_only_tokenizer)
    ids = [byte[0xE4]] * (MAX_WINDOW + KEEP_AFTER_CUT + 3) + [byte[0xB8], byte[0xAD]]
    deltas = _stream(bytes_only_tokenizer, ids, [1] * len(ids), skip=False)
    assert "".join(deltas) == FFFD * (len(ids) - 3) + "中"


@pytest.mark.parametrize(
    "tail",
    [
        [0xF0, 0x9F, 0x98, 0x80],  # 😀 arriving one byte at a time
        [0xE4, 0xB8, 0xAD],  # 中
        [0xEF, 0xBF, 0xBD, 0x61],  # a genuine U+FFFD, then "a"
        [0xF0, 0x9F, 0x98, 0x41],  # an emoji cut short by "A"
    ],
)
def test_window_cut_at_every_phase(bytes_only_tokenizer: Tokenizer, tail: list[int]) -> None:
    # A run of interrupted lead bytes keeps the window ending in U+FFFD, so it is cut every few pushes. Shifting
    # the run's length moves the cut across every position of a multi-byte tail, including the moment when
    # the kept ids start in the middle of the tail's character.
    byte = _byte_ids(bytes_only_tokenizer)
    for prefix in range(MAX_WINDOW + KEEP_AFTER_CUT + 4):
        ids = [byte[0xE4]] * prefix + [byte[b] for b in tail]
        _stream(bytes_only_tokenizer, ids, [1] * len(ids), skip=False)


def test_skipped_special_tokens_do_not_split_a_character(v4_tokenizer: Tokenizer) -> None:
    byte = _byte_ids(v4_tokenizer)
    ids = [byte[0xE4], 0, byte[0xB8], 128_803, byte[0xAD]]
    # The library drops BOS before joining bytes, so E4 B8 still meet; the chat marker is not special and
    # interrupts the character both ways.
    assert "".join(_stream(v4_tokenizer, ids, [1] * 5, skip=True)) == f"{FFFD}<｜User｜>{FFFD}"
    assert "".join(_stream(v4_tokenizer, ids[:3] + ids[4:], [1] * 4, skip=True)) == "中"
    kept = "".join(_stream(v4_tokenizer, ids[:3] + ids[4:], [1] * 4, skip=False))
    assert kept == f"{FFFD}<｜begin▁of▁sentence｜>{FFFD}{FFFD}"


# ------------------------------------------------------------------------------------------------ the API


def test_push_accepts_ints_and_arrays(tiny_tokenizer: Tokenizer) -> None:
    ids = tiny_tokenizer.encode("array input")
    detok = IncrementalDetokenizer(tiny_tokenizer)
    text = detok.push(ids[0]) + detok.push(np.int64(ids[1])) + detok.push(np.array(ids[2:], dtype=np.int32))
    assert text + detok.finish() == "array input"
    assert detok.num_tokens == len(ids)


def test_push_validates_ids_with_stream_position(tiny_tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tiny_tokenizer)
    detok.push([20, 21, 22])
    with pytest.raises(
        ValueError, match=r"ids\[1\] = 512 is out of range for vocab size 512.*stream position 3"
    ):
        detok.push([23, 512])
    with pytest.raises(TypeError, match=r"ids\[0\] = 'a' must be an int token id"):
        detok.push(["a"])
    with pytest.raises(TypeError, match="got bool"):
        detok.push(True)  # type: ignore[arg-type]


def test_lifecycle_errors(tiny_tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tiny_tokenizer)
    assert detok.finish() == ""
    with pytest.raises(RuntimeError, match="after finish"):
        detok.push([5])
    with pytest.raises(RuntimeError, match="twice"):
        detok.finish()


def test_constructor_validation(tiny_tokenizer: Tokenizer) -> None:
    with pytest.raises(TypeError, match="tokenizer must be a deepinfer_jax Tokenizer"):
        IncrementalDetokenizer(tiny_tokenizer.backend)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="skip_special_tokens must be a bool"):
        IncrementalDetokenizer(tiny_tokenizer, skip_special_tokens="yes")  # type: ignore[arg-type]
    vocab = {"<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1, "<｜▁pad▁｜>": 2, "a": 3}
    word_level = Tokenizer(HFTokenizer(models.WordLevel(vocab=vocab, unk_token="a")), source="word-level")
    with pytest.raises(ValueError, match="'word-level' does not use the byte-level decoder"):
        IncrementalDetokenizer(word_level)
