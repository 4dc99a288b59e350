"""A deterministic, synthetic byte-level BPE tokenizer for the built-in tiny models.

The tiny test models need a ``tokenizer.json`` of exactly their ``vocab_size`` ids that spells the DeepSeek
special tokens at the ids real checkpoints use, so that chat encoding, stop tokens and Engram's tokenizer
compression (``spec/model.md`` §9.1) run on them unchanged. No real DeepSeek vocabulary has that size, so one is
learnt here from a small built-in corpus:

* ids 0-2: ``<｜begin▁of▁sentence｜>``, ``<｜end▁of▁sentence｜>``, ``<｜▁pad▁｜>`` (special tokens);
* ids 3-9: the chat markers ``<｜User｜>``, ``<｜Assistant｜>``, ``<think>``, ``</think>``, ``｜DSML｜``,
  ``<｜latest_reminder｜>``, ``<｜System｜>`` (added tokens that are matched in text but are not "special", exactly
  as the real V4 vocabulary flags them, so ``skip_special_tokens`` treats both alike);
* ids 10-265: the 256 byte-level symbols, in byte order, so any Unicode text can be encoded;
* the remaining ids: BPE merges learnt from :data:`CORPUS` by a small pair-counting loop.

Determinism is the point: the training loop never depends on dict or set iteration order (ties are broken on
the byte strings of the pair), and the json is serialised by the ``tokenizers`` library, whose output is ordered
by id. The same ``vocab_size`` therefore gives byte-identical json on every run and machine; the test suite pins
its sha256.

The ``tokenizers`` json schema rejects unknown fields, so the tokenizer is labelled as synthetic through its
normalizer: a ``Replace`` normalizer whose pattern and replacement are both :data:`SYNTHETIC_MARKER`. Replacing
a string by itself changes no text and no offset, yet the label is visible in the json and is how
``Tokenizer.is_synthetic`` recognises the file. No token is spent on the label, so the id layout above stays
exact.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import os
import tempfile
from collections import Counter
from pathlib import Path

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

__all__ = [
    "CORPUS",
    "MAX_SYNTHETIC_VOCAB_SIZE",
    "MIN_SYNTHETIC_VOCAB_SIZE",
    "SYNTHETIC_MARKER",
    "SYNTHETIC_SPECIAL_TOKENS",
    "build_synthetic_tokenizer",
    "byte_to_unicode",
    "write_synthetic_tokenizer",
]

SYNTHETIC_MARKER = "<｜deepinfer_jax▁synthetic▁tokenizer｜>"
"""The label carried by the normalizer of every synthetic tokenizer (see the module docstring)."""

SYNTHETIC_SPECIAL_TOKENS: tuple[str, ...] = (
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
)
"""Spellings of ids 0-9. Ids 0-2 are flagged special; ids 3-9 are added tokens that are not special."""

_NUM_SPECIAL_FLAGGED = 3
_NUM_BYTES = 256
MIN_SYNTHETIC_VOCAB_SIZE = len(SYNTHETIC_SPECIAL_TOKENS) + _NUM_BYTES
"""The smallest vocabulary: the ten named tokens and the 256 byte symbols, with no merge at all."""
MAX_SYNTHETIC_VOCAB_SIZE = 2048
"""The largest size accepted: the corpus supports a few more merges (the test suite checks that it reaches this)."""

# The training text. Original prose written for this purpose: several registers of English with capitalised,
# upper-case and accented variants of the same words (so that Engram's case/accent folding has something to
# fold), numbers in many notations, a little code, and some Chinese, Japanese and Korean. Changing it changes
# every synthetic tokenizer: regenerate the pinned hashes with scripts/build_tiny_tokenizers.py.
CORPUS = """\
The morning train to the coast was late again, so the passengers waited on the platform and talked about the
weather. The sky was grey, the wind was cold, and nobody believed the forecast that promised sunshine by noon.
THE TRAIN IS LATE. The train is late. the train is late. A late train is still a train, said the old conductor.

Our small library opens at 09:30 on weekdays and at 10:00 on Saturdays. It closes on Sundays and on public
holidays. Members may borrow up to 12 books for 21 days; a renewal adds another 14 days. The fine for a late
book is 0.25 per day, capped at 5.00 per book. In 2023 the library lent 48,517 books, 3,902 films and 611 maps.

Café, cafe and CAFÉ are the same word in three spellings. A naïve reader may not notice the résumé of the
author, who lived in Zürich, then in São Paulo, then in Málaga and finally in Reykjavík. She wrote about the
façade of an old théâtre, about crème brûlée, about jalapeño peppers and about a piñata that nobody could
break. Her friend Antonín Dvořák (no relation to the composer) taught music in Łódź and later in Kraków.
Über alles liebte sie die Straße am Fluss; the Ångström unit is named after a Swede; the Señor smiled.
Élodie, Émile and Ève met at the Hôtel de Ville. Ça va? Oui, ça va très bien, merci. Qué tal? Muy bien.

Numbers appear in many forms: 1, 2, 3, 10, 100, 1000, 1,000,000 and 3.14159; -42 and +17; 7/8 and 50%; the
dates 1999-12-31 and 2024-02-29; the times 23:59:59 and 00:00:01; phone numbers such as +1 555 0100 and
020 7946 0958; version strings like v0.12.3 and 2.5.5; prices like $19.99, EUR 4.50 and £7; temperatures of
-3 °C and 98.6 °F; and ratios such as 16:9 or 4:3. Two plus two is four; 2 + 2 = 4; 12 * 12 = 144.

def count_words(text: str) -> dict[str, int]:
    \"\"\"Count how often each word occurs in the text.\"\"\"
    counts: dict[str, int] = {}
    for word in text.lower().split():
        counts[word] = counts.get(word, 0) + 1
    return counts


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value


if __name__ == "__main__":
    print(count_words("the cat and the hat"))

for (int i = 0; i < n; ++i) { total += values[i] * weights[i]; }
{"name": "tiny", "layers": 4, "hidden_size": 256, "vocab_size": 512, "tie_embeddings": false}
$ python -m pip install --upgrade package && echo "done" >> install.log

Writing clear documentation is hard. Good documentation explains why, not only how. The reader of a manual
wants to know what a function returns, what it refuses and what it costs. When the answer is not written
down, the reader reads the source code, and the source code answers how, but rarely why. Therefore, write the
why. Why was this choice made? Why is that limit there? Why does this test exist? Answers matter.

Weather report: Monday will be sunny and warm with a light breeze from the west. Tuesday brings clouds and a
chance of rain in the afternoon. Wednesday is windy; Thursday is wet; Friday is dry again. Over the weekend
temperatures fall, and in the mountains the first snow of the season may fall on Sunday night.

A recipe for bread: mix 500 g of flour, 350 ml of warm water, 10 g of salt and 7 g of dry yeast. Knead the
dough for ten minutes, until it is smooth. Let it rise for one hour, then shape it, let it rise again for
forty minutes and bake it at 230 degrees for thirty minutes. Let the bread cool before you cut it.

A short history of the lighthouse. Fishermen built the first tower in 1846 from granite blocks carried by
boat across the bay. Its lamp burned whale oil, later paraffin, and from 1921 electricity. Keepers climbed
117 steps twice each night to wind the clockwork that turned the lens. The last keeper, Margaret Olsen,
retired in 1987; automatic equipment replaced her. Today volunteers guide visitors through the workshop,
the keeper's kitchen and the narrow gallery, from which, on clear evenings, you can watch seabirds, seals,
sailing yachts and enormous container ships heading toward distant harbours.

Hardware notes: the accelerator has 132 streaming multiprocessors, 80 GiB of high-bandwidth memory and a
peak throughput of roughly 990 teraflops in bfloat16. Kernels must keep every unit busy: overlap copies
with arithmetic, avoid bank conflicts, coalesce global loads, and never synchronise inside a warp without
need. Profiling beats guessing; measure latency, bandwidth, occupancy and utilisation before optimising.

In the garden grow lavender, rosemary, thyme, basil, parsley, mint and a stubborn fig tree. Bees visit every
blossom; butterflies prefer the buddleia; a hedgehog sleeps beneath the compost heap. Gardening teaches
patience: seeds germinate slowly, frost arrives unexpectedly, snails devour lettuce overnight, and yet each
spring the orchard blooms generously, rewarding anyone who waters, prunes, weeds and waits.

Questions and answers. Who wrote the letter? The teacher wrote it. Where is the station? It is next to the
market. When does the museum open? At nine. What did you say? Nothing. How many apples are left? Three. Which
one is yours? The red one. Is it raining? Yes, it is. Are you ready? Not yet! Wait for me, please.

今天天气很好，我们去公园散步吧。图书馆在学校的北边，星期一到星期五开放。我喜欢读书，也喜欢学习新的语言。
中文、日本語和한국어都是常见的语言。这是一个用于测试的小型分词器，不是真实的词表。
こんにちは、世界。東京は大きな都市です。私は毎朝コーヒーを飲みます。ありがとうございます。
안녕하세요. 오늘은 날씨가 좋습니다. 도서관은 아홉 시에 문을 엽니다. 감사합니다.

Symbols and emoji: arrows → ← ↑ ↓, check marks ✓ ✗, the euro sign €, the degree sign °, plus-minus ±,
ellipsis …, quotes “like this” and ‘like that’, a long dash — and a short one –, and faces 🙂 😀 🚀 🎉.
Mixed case: Hello, HELLO, hello; World, WORLD, world; Model, MODEL, model; Token, TOKEN, token; Data, DATA.
The end of the text is near. The END. The end.
"""


def byte_to_unicode() -> dict[int, str]:
    """The byte-level alphabet: the printable character that stands for each byte in a byte-level vocabulary.

    This is the GPT-2 convention that the ``tokenizers`` ``ByteLevel`` pre-tokenizer and decoder implement:
    bytes that are printable, non-space Latin-1 characters stand for themselves, and the remaining 68 bytes
    are given the code points from U+0100 upwards, in byte order. The trainer needs the explicit map because
    merges are learnt on byte-level symbols while ties are broken on the bytes they stand for.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    next_code = 0x100
    for b in range(_NUM_BYTES):
        if b not in table:
            table[b] = chr(next_code)
            next_code += 1
    return dict(sorted(table.items()))


@functools.cache
def _byte_level() -> tuple[dict[int, str], dict[str, int]]:
    encoder = byte_to_unicode()
    # The library's own alphabet must be the one assumed here; a mismatch would silently make the merges
    # unreachable, so it is checked once rather than trusted.
    if set(encoder.values()) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise RuntimeError("the tokenizers ByteLevel alphabet differs from the GPT-2 byte-level convention")
    return encoder, {ch: b for b, ch in encoder.items()}


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _learn_merges(corpus: str, num_merges: int) -> list[tuple[str, str]]:
    """Learn up to ``num_merges`` BPE merges on the byte-level pre-tokens of ``corpus``.

    Each round merges the most frequent adjacent pair of symbols, counted over the distinct pre-tokens weighted
    by their frequency. Ties go to the pair whose (left bytes, right bytes) sort first, so the result depends
    only on the corpus. Pair counts are updated incrementally (only the words containing the merged pair are
    revisited) and the best pair is kept in a heap with lazy deletion, which keeps a few thousand merges fast.
    Fewer merges are returned when every pre-token has become a single symbol.
    """
    _, decoder = _byte_level()
    piece_counts = Counter(piece for piece, _ in _pre_tokenizer().pre_tokenize_str(corpus))
    # Sorted so that word indices, and with them every intermediate structure, are independent of input order.
    words = [list(piece) for piece in sorted(piece_counts)]
    freqs = [piece_counts[piece] for piece in sorted(piece_counts)]

    symbol_bytes: dict[str, bytes] = {}

    def as_bytes(symbol: str) -> bytes:
        if symbol not in symbol_bytes:
            symbol_bytes[symbol] = bytes(decoder[ch] for ch in symbol)
        return symbol_bytes[symbol]

    pair_counts: Counter[tuple[str, str]] = Counter()
    pair_words: dict[tuple[str, str], set[int]] = {}
    for index, (word, freq) in enumerate(zip(words, freqs)):
        for pair in itertools.pairwise(word):
            pair_counts[pair] += freq
            pair_words.setdefault(pair, set()).add(index)

    heap: list[tuple[int, bytes, bytes, str, str]] = []

    def push(pair: tuple[str, str]) -> None:
        count = pair_counts[pair]
        if count > 0:
            heapq.heappush(heap, (-count, as_bytes(pair[0]), as_bytes(pair[1]), pair[0], pair[1]))

    for pair in sorted(pair_counts):
        push(pair)

    merges: list[tuple[str, str]] = []
    while heap and len(merges) < num_merges:
        neg_count, _, _, left, right = heapq.heappop(heap)
        pair = (left, right)
        if pair_counts[pair] != -neg_count:
            continue  # stale entry: the count changed after it was pushed, a fresh entry exists
        merges.append(pair)
        merged = left + right
        touched: set[tuple[str, str]] = set()
        for index in sorted(pair_words.pop(pair, ())):
            word, freq = words[index], freqs[index]
            for old in itertools.pairwise(word):
                pair_counts[old] -= freq
                touched.add(old)
            rebuilt: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == left and word[i + 1] == right:
                    rebuilt.append(merged)
                    i += 2
                else:
                    rebuilt.append(word[i])
                    i += 1
            words[index] = rebuilt
            for new in itertools.pairwise(rebuilt):
                pair_counts[new] += freq
                pair_words.setdefault(new, set()).add(index)
                touched.add(new)
        for changed in sorted(touched):
            if pair_counts[changed] <= 0:
                del pair_counts[changed]
                pair_words.pop(changed, None)
            else:
                push(changed)
    return merges


@functools.cache
def _all_merges() -> tuple[tuple[str, str], ...]:
    """Every merge the corpus supports, in training order; a smaller vocabulary uses a prefix of them."""
    return tuple(_learn_merges(CORPUS, num_merges=1 << 30))


def _check_vocab_size(vocab_size: object) -> int:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__} ({vocab_size!r})")
    if not MIN_SYNTHETIC_VOCAB_SIZE <= vocab_size <= MAX_SYNTHETIC_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is outside the supported range "
            f"[{MIN_SYNTHETIC_VOCAB_SIZE}, {MAX_SYNTHETIC_VOCAB_SIZE}] of the synthetic tokenizer "
            f"({len(SYNTHETIC_SPECIAL_TOKENS)} named tokens + {_NUM_BYTES} bytes + merges learnt from the corpus)"
        )
    return vocab_size


@functools.cache
def build_synthetic_tokenizer(vocab_size: int) -> str:
    """Return the ``tokenizer.json`` text of the synthetic tokenizer with exactly ``vocab_size`` ids.

    The text is byte-identical for a given ``vocab_size`` on every run and machine (with the pinned
    ``tokenizers`` version), and a smaller vocabulary's merges are a prefix of a larger one's.
    """
    vocab_size = _check_vocab_size(vocab_size)
    merges = _all_merges()
    num_merges = vocab_size - MIN_SYNTHETIC_VOCAB_SIZE
    if num_merges > len(merges):
        # Guarded by the test suite (the corpus must reach MAX_SYNTHETIC_VOCAB_SIZE); reaching it means the
        # corpus was shortened without lowering the limit.
        raise RuntimeError(
            f"vocab_size={vocab_size} needs {num_merges} merges but the built-in corpus supports only "
            f"{len(merges)}"
        )
    encoder, _ = _byte_level()
    vocab: dict[str, int] = {}
    for token in SYNTHETIC_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    for b in range(_NUM_BYTES):
        vocab[encoder[b]] = len(vocab)
    for left, right in merges[:num_merges]:
        merged = left + right
        if merged in vocab:
            # A merge may not respell an existing token, or two ids would share one string.
            raise RuntimeError(f"merge {left!r} + {right!r} respells existing token {merged!r}")
        vocab[merged] = len(vocab)

    tokenizer = _HFTokenizer(models.BPE(vocab=vocab, merges=list(merges[:num_merges])))
    tokenizer.normalizer = normalizers.Replace(SYNTHETIC_MARKER, SYNTHETIC_MARKER)
    tokenizer.pre_tokenizer = _pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # The named tokens already have their ids in the model vocabulary; registering them as added tokens makes
    # encode() match them as whole units in text instead of splitting them into bytes.
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t in SYNTHETIC_SPECIAL_TOKENS[:_NUM_SPECIAL_FLAGGED]
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t in SYNTHETIC_SPECIAL_TOKENS[_NUM_SPECIAL_FLAGGED:]
        ]
    )
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(
            f"synthetic tokenizer has {tokenizer.get_vocab_size(with_added_tokens=True)} ids, "
            f"expected {vocab_size}"
        )
    return tokenizer.to_str(pretty=True)


def write_synthetic_tokenizer(path: str | os.PathLike[str], vocab_size: int) -> Path:
    """Write the synthetic ``tokenizer.json`` for ``vocab_size`` and return the file's path.

    ``path`` is the file to write, or an existing directory (then ``<path>/tokenizer.json`` is written). The
    file is written to a temporary name and renamed into place, so a concurrent reader (another test worker
    materialising the same model) never sees a partial file. The bytes are exactly
    ``build_synthetic_tokenizer(vocab_size)`` encoded as UTF-8.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__} ({path!r})")
    target = Path(path)
    if target.is_dir():
        target = target / "tokenizer.json"
    data = build_synthetic_tokenizer(vocab_size).encode("utf-8")
    if not target.parent.is_dir():
        raise ValueError(f"path={str(target)!r}: parent directory {str(target.parent)!r} does not exist")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return target
