#!/usr/bin/env python3
"""Build the synthetic byte-level tokenizers of the tiny models and print their sha256.

    python scripts/build_tiny_tokenizers.py --vocab-size 512 --out DIR
    python scripts/build_tiny_tokenizers.py --vocab-size 512 --vocab-size 1024 --out DIR

Each size is written to ``DIR/synthetic-<size>/tokenizer.json`` (a directory that ``Tokenizer.from_file``
loads). Without ``--out`` nothing is written and only the hashes are printed: that is how the hash pinned in
``tests/text`` is regenerated after an intentional change of the training corpus. The built-in model registry
does not need this script; it calls ``write_synthetic_tokenizer`` itself.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

from deepinfer_jax.text.synthetic import (
    MAX_SYNTHETIC_VOCAB_SIZE,
    MIN_SYNTHETIC_VOCAB_SIZE,
    build_synthetic_tokenizer,
    write_synthetic_tokenizer,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--vocab-size",
        type=int,
        action="append",
        required=True,
        metavar="N",
        help=f"vocabulary size to build, {MIN_SYNTHETIC_VOCAB_SIZE}..{MAX_SYNTHETIC_VOCAB_SIZE} (repeatable)",
    )
    parser.add_argument("--out", type=Path, help="output directory; omit to print the hashes only")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for vocab_size in sorted(set(args.vocab_size)):
        try:
            text = build_synthetic_tokenizer(vocab_size)
        except ValueError as exc:
            parser.error(str(exc))
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        where = ""
        if args.out is not None:
            directory = args.out / f"synthetic-{vocab_size}"
            directory.mkdir(parents=True, exist_ok=True)
            where = f"  {write_synthetic_tokenizer(directory, vocab_size)}"
        print(f"vocab_size={vocab_size}  sha256={digest}{where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
