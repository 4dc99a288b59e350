"""Incremental detokenization: turn a stream of token ids into text deltas without ever emitting a broken
character.

A byte-level token may end in the middle of a multi-byte UTF-8 character (a CJK character or an emoji is often
two or three tokens). Decoding such a prefix yields a trailing U+FFFD that disappears once the rest of the
character arrives, so streaming the decode of every prefix would show replacement characters that the final
text does not contain.

The technique is the usual one: decode a short window of recent ids and emit only text that cannot change any
more. For a byte-level decoder (bytes joined, read as UTF-8 with one U+FFFD per invalid or incomplete
sequence), "cannot change" is exact:

* if the window's text does not end in U+FFFD, its last character is complete, so all of it is final and the
  window restarts empty (the next decode never needs the old ids);
* if it ends in U+FFFD, only that last character can still change (an incomplete sequence at the end may be
  completed or may turn out invalid); everything before it is final and is emitted now.

The window cannot grow without bound: while the text keeps ending in U+FFFD (a stream of invalid bytes, or
tokens that each split a character), the window is cut once it holds more than :data:`MAX_WINDOW` ids, keeping
the last :data:`KEEP_AFTER_CUT`. The cut is exact because UTF-8 resynchronises. Say the kept ids start at byte
``c``. A decoder starting at ``c`` reads the continuation bytes of a character that began before ``c`` as
single invalid bytes; from the end of that character on (at most three bytes after ``c``) both decoders cut
the bytes into the same units. The held-back last character can only have begun before ``c`` if every kept
byte is one of its continuation bytes, and there are at most two of those (an incomplete sequence, or a literal
U+FFFD, spans at most three bytes). Every id carries at least one byte, so with three or more kept ids the
held-back character lies where both decoders agree, and everything before it in the kept window's decode has
already been emitted; eight leave a margin. Each step therefore decodes at most ``MAX_WINDOW`` plus the newly
pushed ids: constant cost per token.

Ids that ``skip_special_tokens`` drops are filtered before they enter the window; the library removes them
before its decoder runs, so the bytes on either side join exactly as in a full decode.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from deepinfer_jax.text.tokenizer import Tokenizer

__all__ = ["KEEP_AFTER_CUT", "MAX_WINDOW", "IncrementalDetokenizer"]

REPLACEMENT_CHARACTER = "\ufffd"
MAX_WINDOW = 16
"""Most ids decoded together before the window is cut (see the module docstring)."""
KEEP_AFTER_CUT = 8
"""Ids kept when the window is cut: three suffice for exactness (module docstring); the rest is margin."""


class IncrementalDetokenizer:
    """Streams the text of a growing sequence of token ids.

    Feed ids with :meth:`push` (one or a few at a time); each call returns the text that became final. Call
    :meth:`finish` at the end of the sequence for the held-back remainder. The concatenation of every delta
    and of ``finish()`` equals ``tokenizer.decode(all_ids, skip_special_tokens=...)`` exactly, and each delta
    is the slice of that full decode at its position (so no delta shows a U+FFFD the full text does not have).

    Requires a byte-level tokenizer (every DeepSeek tokenizer is one), whose decoding the exactness argument of
    the module docstring relies on.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a deepinfer_jax Tokenizer, got {type(tokenizer).__name__}")
        if not tokenizer.is_byte_level:
            raise ValueError(
                f"tokenizer {tokenizer.source!r} does not use the byte-level decoder, which incremental "
                "detokenization requires"
            )
        if not isinstance(skip_special_tokens, bool | np.bool_):
            raise TypeError(f"skip_special_tokens must be a bool, got {type(skip_special_tokens).__name__}")
        self._tokenizer = tokenizer
        self._vocab_size = tokenizer.vocab_size
        self._skip_special_tokens = bool(skip_special_tokens)
        self._skipped = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._window: list[int] = []
        # Characters of decode(self._window) already emitted: all of it but a trailing U+FFFD.
        self._emitted = 0
        self._num_tokens = 0
        self._finished = False

    @property
    def num_tokens(self) -> int:
        """How many ids were pushed so far (skipped special ids included)."""
        return self._num_tokens

    @property
    def skip_special_tokens(self) -> bool:
        return self._skip_special_tokens

    def push(self, ids: int | Iterable[Any]) -> str:
        """Add ``ids`` (one id or an iterable of ids) and return the text that became final, possibly ``""``."""
        if self._finished:
            raise RuntimeError("push() after finish(): this detokenizer's sequence has ended")
        if type(ids) is int and 0 <= ids < self._vocab_size:
            checked = [ids]  # the engine's push: one valid id, nothing to convert
        else:
            if isinstance(ids, int | np.integer) and not isinstance(ids, bool):
                ids = [ids]
            # Indices in error messages count from the start of the stream, which is what a caller can act on.
            try:
                checked = self._tokenizer.validate_ids(ids)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{exc} (stream position {self._num_tokens} onwards)") from None
        self._num_tokens += len(checked)
        kept = [i for i in checked if i not in self._skipped]
        if not kept:
            return ""
        self._window.extend(kept)
        # After complete text the window often holds one id: its own decode, memoised by the tokenizer.
        if len(self._window) == 1:
            text = self._tokenizer.decode_one(self._window[0], skip_special_tokens=self._skip_special_tokens)
        else:
            text = self._decode(self._window)
        if not text.endswith(REPLACEMENT_CHARACTER):
            delta = text[self._emitted :]
            self._window.clear()
            self._emitted = 0
            return delta
        stable = len(text) - 1
        delta = text[self._emitted : stable]
        self._emitted = stable
        if len(self._window) > MAX_WINDOW:
            del self._window[:-KEEP_AFTER_CUT]
            # Both decodes agree from before the held-back character on (module docstring), so everything
            # but the kept window's last character has already been emitted.
            kept_text = self._decode(self._window)
            assert kept_text.endswith(REPLACEMENT_CHARACTER), "window cut lost the held-back character"
            self._emitted = len(kept_text) - 1
        return delta

    def finish(self) -> str:
        """End the sequence and return the held-back text: an incomplete trailing character becomes U+FFFD,
        exactly as in the full decode. The detokenizer accepts no more ids afterwards."""
        if self._finished:
            raise RuntimeError("finish() called twice on the same detokenizer")
        self._finished = True
        delta = self._decode(self._window)[self._emitted :] if self._window else ""
        self._window.clear()
        self._emitted = 0
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.backend.decode(ids, skip_special_tokens=self._skip_special_tokens)
