"""Lazy, tensor-at-a-time access to checkpoints: HF safetensors folders (read and write) and the reader interface.

A DeepSeek checkpoint is hundreds of gigabytes, so nothing here reads more than the tensor asked for. The
safetensors header of every file is parsed by this module itself (the format is an 8-byte little-endian header
length, a JSON header mapping names to ``dtype``/``shape``/``data_offsets``, then the raw little-endian bytes), and
``read(name)`` reads exactly that tensor's byte range into a fresh NumPy array. Parsing the header here, rather
than going through a framework, makes every dtype DeepSeek checkpoints use readable with NumPy and ``ml_dtypes``:

====================  ==========================  ==============================================================
safetensors dtype     array returned by ``read``  notes
====================  ==========================  ==============================================================
``F64`` ... ``BOOL``  the matching NumPy dtype     ``F64 F32 F16 I64 I32 I16 I8 U64 U32 U16 U8 BOOL C64``
``BF16``              ``ml_dtypes.bfloat16``
``F8_E4M3``           ``float8_e4m3fn``            FP8 weights
``F8_E5M2``           ``float8_e5m2``
``F8_E4M3FNUZ``       ``float8_e4m3fnuz``
``F8_E5M2FNUZ``       ``float8_e5m2fnuz``
``F8_E8M0``           ``float8_e8m0fnu``           UE8M0 block scales
``F4``                ``uint8``, last dim halved   packed E2M1 pairs, element ``2j`` in the low nibble of byte
                                                   ``j`` (the header's shape counts 4-bit elements)
====================  ==========================  ==============================================================

``F4`` is returned packed because that is how the model consumes MXFP4 expert weights (``[I, H/2]`` bytes), and
it is the same array an ``U8``-typed checkpoint of the same weights holds. ``TensorInfo.storage_dtype`` keeps the
file's dtype code, so a writer reproduces the file exactly.

Names (``spec/model.md`` §13.1): every name may carry an optional leading ``model.`` prefix. ``resolve("x")``
finds ``x`` stored as ``x`` or as ``model.x``, and ``resolve("model.x")`` finds it stored as ``x``; a checkpoint
that stores both spellings of one name is refused when it is opened, naming both.

``open_checkpoint(path)`` returns a :class:`CheckpointReader` for a folder with ``model.safetensors.index.json``
and its shards; with ``model.safetensors`` (read alone when there is no index, as transformers does: other
``*.safetensors`` files beside it are ignored, with a warning naming them); or with an unambiguous set of other
``*.safetensors`` files; and for a
folder written by :mod:`deepinfer_jax.checkpoint.orbax_io` (same interface). :func:`save_hf_checkpoint` writes
the other direction (one file, or shards plus an index above a size limit), streaming one tensor at a time.
"""

from __future__ import annotations

import abc
import dataclasses
import difflib
import itertools
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Self

import ml_dtypes
import numpy as np
from absl import logging

__all__ = [
    "AUX_FILES",
    "CONFIG_FILE",
    "INDEX_FILE",
    "MODEL_PREFIX",
    "SINGLE_FILE",
    "CheckpointError",
    "CheckpointReader",
    "SafetensorsReader",
    "TensorInfo",
    "alternate_spelling",
    "open_checkpoint",
    "save_hf_checkpoint",
    "storage_dtype_for",
]

MODEL_PREFIX = "model."
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
ORBAX_MANIFEST_FILE = "deepinfer_checkpoint.json"
"""The file that marks a folder written by :mod:`deepinfer_jax.checkpoint.orbax_io`."""
AUX_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
"""Files beside the tensors that ``convert`` carries over unchanged (the tokenizer and generation defaults)."""

# A header is JSON text; real checkpoints have a few hundred KB. The cap only guards against garbage lengths.
_MAX_HEADER_BYTES = 512 << 20

# safetensors dtype code -> NumPy dtype of the stored elements (F4 is special-cased: two elements per byte).
_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "C64": np.dtype(np.complex64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "F4": np.dtype(np.uint8),
}
_CODES: dict[np.dtype, str] = {dt: code for code, dt in _DTYPES.items() if code != "F4"}
PACKED_F4 = "F4"
PACKED_F4_NAME = "float4_e2m1fn_x2"


class CheckpointError(ValueError):
    """A checkpoint is malformed, inconsistent, or does not match what the model expects.

    Attributes:
        problems: every problem found, one line each (each names its tensor and, where relevant, its file).
    """

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems: tuple[str, ...] = tuple(problems) if problems else (message,)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """What a checkpoint says about one tensor, known without reading its data.

    Attributes:
        name: the name as stored in the checkpoint (with or without ``model.``).
        shape: the shape of the array :meth:`CheckpointReader.read` returns (for ``F4``: last dim halved).
        dtype: the NumPy dtype of that array.
        file: the file (relative to the checkpoint folder) that holds the tensor.
        storage_dtype: the safetensors dtype code (``"BF16"``, ``"F8_E4M3"``, ``"F4"``, ...).
        offset: absolute byte offset of the data in ``file`` (``-1`` where the format has no such notion).
        nbytes: size of the data in bytes.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    file: str
    storage_dtype: str = ""
    offset: int = -1
    nbytes: int = 0

    @property
    def dtype_names(self) -> tuple[str, ...]:
        """Names this tensor's dtype answers to: the array dtype's name, plus ``float4_e2m1fn_x2`` for ``F4``."""
        if self.storage_dtype == PACKED_F4:
            return (self.dtype.name, PACKED_F4_NAME)
        return (self.dtype.name,)

    @property
    def header_shape(self) -> tuple[int, ...]:
        """The shape as the safetensors header writes it (``F4`` counts 4-bit elements: last dim doubled)."""
        if self.storage_dtype == PACKED_F4:
            return (*self.shape[:-1], self.shape[-1] * 2)
        return self.shape


def storage_dtype_for(dtype: Any) -> str:
    """The safetensors dtype code of a NumPy dtype; ``TypeError`` when the format has none."""
    dt = np.dtype(dtype)
    code = _CODES.get(dt.newbyteorder("="))
    if code is None:
        raise TypeError(f"dtype: {dt} has no safetensors encoding (known: {', '.join(sorted(_DTYPES))})")
    return code


def dtype_for_code(code: str) -> np.dtype:
    """The NumPy dtype a safetensors dtype code is read as (``F4``: packed ``uint8``)."""
    if code not in _DTYPES:
        raise TypeError(
            f"dtype: {code!r} is not a supported safetensors dtype (known: {', '.join(sorted(_DTYPES))})"
        )
    return _DTYPES[code]


def alternate_spelling(name: str) -> str:
    """``x`` <-> ``model.x``: the other spelling of a checkpoint name."""
    return name[len(MODEL_PREFIX) :] if name.startswith(MODEL_PREFIX) else MODEL_PREFIX + name


def _check_spellings(names: Iterable[str], where: str) -> None:
    stored = set(names)
    clashes = sorted(n for n in stored if n.startswith(MODEL_PREFIX) and n[len(MODEL_PREFIX) :] in stored)
    if clashes:
        listed = "; ".join(f"{c[len(MODEL_PREFIX) :]!r} and {c!r}" for c in clashes)
        raise CheckpointError(
            f"{where}: {len(clashes)} tensor(s) stored under both spellings (with and without the "
            f"'{MODEL_PREFIX}' prefix), which is ambiguous: {listed}",
            [f"{c[len(MODEL_PREFIX) :]!r} and {c!r} are both stored" for c in clashes],
        )


class CheckpointReader(abc.ABC):
    """Read-only, lazy access to the tensors of one checkpoint.

    Subclasses fill ``self._infos`` (stored name -> :class:`TensorInfo`) when opened and implement :meth:`read`.
    """

    format: str = ""

    def __init__(self, path: Path, infos: Mapping[str, TensorInfo], config_path: Path | None) -> None:
        _check_spellings(infos, str(path))
        self.path = path
        self._infos = dict(infos)
        self._names = sorted(self._infos)
        self.config_path = config_path
        self.closed = False

    # -- names --------------------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Every stored tensor name, sorted."""
        return list(self._names)

    def find(self, name: str) -> str | None:
        """The stored spelling of ``name`` (as given, or with the ``model.`` prefix added or removed), else None."""
        if name in self._infos:
            return name
        other = alternate_spelling(name)
        return other if other in self._infos else None

    def resolve(self, name: str) -> str:
        """Like :meth:`find`, but a missing name is a ``KeyError`` that suggests close names."""
        if not isinstance(name, str):
            raise TypeError(f"tensor name: expected a str, got {name!r} ({type(name).__name__})")
        found = self.find(name)
        if found is None:
            close = difflib.get_close_matches(name, self._names, n=3)
            hint = f" (close: {', '.join(close)})" if close else ""
            raise KeyError(f"tensor {name!r} is not in the checkpoint {self.path}{hint}")
        return found

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.find(name) is not None

    def __len__(self) -> int:
        return len(self._names)

    def info(self, name: str) -> TensorInfo:
        """Shape, dtype and location of a tensor, without reading it (either spelling of the name)."""
        return self._infos[self.resolve(name)]

    # -- data ---------------------------------------------------------------------------------------------------

    @abc.abstractmethod
    def read(self, name: str) -> np.ndarray:
        """The tensor ``name`` (either spelling) as a new host array; reads that tensor's bytes only."""

    def read_many(self, names: Sequence[str]) -> Iterator[tuple[str, np.ndarray]]:
        """``(stored name, array)`` for each of ``names``, in order; formats that batch reads override it."""
        for name in names:
            yield self.resolve(name), self.read(name)

    def close(self) -> None:
        """Release open files; subclasses holding resources extend it."""
        self.closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, {len(self)} tensors)"


# ---------------------------------------------------------------------------------------------------------------
# safetensors


def _parse_header(path: Path, rel: str) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header; every error names the file (and the tensor)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(
                f"{path}: {size} bytes is too short for a safetensors file (no header length)"
            )
        n = int.from_bytes(head, "little")
        if n > size - 8 or n > _MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{path}: header length {n} exceeds the file ({size} bytes) or the limit {_MAX_HEADER_BYTES}; "
                "not a safetensors file, or a truncated one"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: the safetensors header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{path}: the safetensors header must be a JSON object, got {type(header).__name__}"
        )
    data_start = 8 + n
    data_size = size - data_start
    infos: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: header entry must be an object, got {entry!r}")
        code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if code not in _DTYPES:
            raise CheckpointError(
                f"{where}: dtype {code!r} is not supported (supported: {', '.join(sorted(_DTYPES))})"
            )
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise CheckpointError(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise CheckpointError(f"{where}: data_offsets must be [begin, end] ints, got {offsets!r}")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            raise CheckpointError(
                f"{where}: data_offsets [{begin}, {end}] out of range: the data section has {data_size} bytes"
            )
        numel = math.prod(shape)
        dtype = _DTYPES[code]
        if code == PACKED_F4:
            if not shape or shape[-1] % 2:
                raise CheckpointError(
                    f"{where}: F4 packs two elements per byte, so the last dim must be even; shape {shape}"
                )
            expected_bytes = numel // 2
            array_shape = (*shape[:-1], shape[-1] // 2)
        else:
            expected_bytes = numel * dtype.itemsize
            array_shape = tuple(shape)
        if end - begin != expected_bytes:
            raise CheckpointError(
                f"{where}: data_offsets [{begin}, {end}] span {end - begin} bytes, but shape {shape} x {code} "
                f"needs {expected_bytes}"
            )
        infos[name] = TensorInfo(name, array_shape, dtype, rel, code, data_start + begin, end - begin)
        spans.append((begin, end, name))
    spans.sort()
    for (_, prev_end, prev), (begin, end, name) in itertools.pairwise(spans):
        if begin < prev_end and end > begin:
            raise CheckpointError(f"{path}: tensors {prev!r} and {name!r} overlap in the data section")
    return infos


class SafetensorsReader(CheckpointReader):
    """A Hugging Face checkpoint folder: one ``.safetensors`` file, or an index and its shards."""

    format = "safetensors"

    def __init__(self, path: Path, files: Sequence[str], weight_map: Mapping[str, str] | None = None) -> None:
        infos: dict[str, TensorInfo] = {}
        owner: dict[str, str] = {}
        for rel in files:
            for name, info in _parse_header(path / rel, rel).items():
                if name in infos:
                    raise CheckpointError(
                        f"{path}: tensor {name!r} is stored in both {owner[name]} and {rel}; "
                        f"write a {INDEX_FILE} that says which one to use",
                        [f"{name!r} in {owner[name]} and {rel}"],
                    )
                infos[name] = info
                owner[name] = rel
        if weight_map is not None:
            problems = [
                f"{name!r}: {INDEX_FILE} maps it to {rel}, which does not hold it"
                for name, rel in sorted(weight_map.items())
                if owner.get(name) != rel
            ]
            problems += [
                f"{name!r}: stored in {owner[name]} but not listed in {INDEX_FILE}"
                for name in sorted(set(infos) - set(weight_map))
            ]
            if problems:
                raise CheckpointError(
                    f"{path}: {INDEX_FILE} does not match its shards ({len(problems)} problem(s)):\n  "
                    + "\n  ".join(problems),
                    problems,
                )
        config = path / CONFIG_FILE
        super().__init__(path, infos, config if config.is_file() else None)
        self.files = tuple(files)
        self._handles: dict[str, BinaryIO] = {}

    def _handle(self, rel: str) -> BinaryIO:
        if self.closed:
            raise ValueError(f"checkpoint reader for {self.path} is closed")
        handle = self._handles.get(rel)
        if handle is None:
            handle = self._handles[rel] = open(self.path / rel, "rb")  # noqa: SIM115 (closed in close())
        return handle

    def read(self, name: str) -> np.ndarray:
        info = self.info(name)
        out = np.empty(info.shape, dtype=info.dtype)
        if info.nbytes:
            handle = self._handle(info.file)
            handle.seek(info.offset)
            got = handle.readinto(memoryview(out.reshape(-1).view(np.uint8)))
            if got != info.nbytes:
                raise CheckpointError(
                    f"{self.path / info.file}: tensor {info.name!r}: read {got} of {info.nbytes} bytes "
                    "(the file changed or is truncated)"
                )
        if sys_big_endian() and info.dtype.itemsize > 1:
            out = out.byteswap().view(out.dtype)
        return out

    def memmap(self, name: str) -> np.ndarray:
        """A read-only memory map of one tensor: its pages load on access, and the OS may drop them again."""
        info = self.info(name)
        if info.nbytes == 0 or sys_big_endian():
            return self.read(name)
        mapped = np.memmap(
            self.path / info.file,
            dtype=info.dtype,
            mode="r",
            offset=info.offset,
            shape=(math.prod(info.shape),),
        )
        return mapped.reshape(info.shape)  # (np.memmap turns shape () into (1,))

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
        super().close()


def sys_big_endian() -> bool:
    """Whether this machine is big-endian (safetensors data is little-endian)."""
    return np.little_endian is False


def _open_safetensors(path: Path) -> SafetensorsReader:
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path}: expected a checkpoint folder or a .safetensors file")
        reader = SafetensorsReader(path.parent, [path.name])
        return reader
    index = path / INDEX_FILE
    if not index.is_file():
        others = sorted(p.name for p in path.glob("*.safetensors.index.json"))
        if len(others) == 1:
            index = path / others[0]
        elif len(others) > 1:
            raise CheckpointError(f"{path}: several index files ({', '.join(others)}) and no {INDEX_FILE}")
    if index.is_file():
        try:
            doc = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index}: cannot read the index: {e}") from e
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(
                f"{index}: 'weight_map' must be an object mapping tensor names to file names"
            )
        files = sorted(set(weight_map.values()))
        problems = []
        for rel in files:
            shard = (path / rel).resolve()
            first = next(n for n, f in sorted(weight_map.items()) if f == rel)
            if path.resolve() not in shard.parents:
                problems.append(f"shard {rel!r} (of tensor {first!r}) lies outside the checkpoint folder")
            elif not shard.is_file():
                problems.append(f"shard {rel!r} (of tensor {first!r} and others) does not exist")
        if problems:
            raise CheckpointError(f"{index}: " + "; ".join(problems), problems)
        return SafetensorsReader(path, files, weight_map)
    files = sorted(p.name for p in path.glob("*.safetensors") if p.is_file())
    if not files:
        raise CheckpointError(f"{path}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors files")
    if SINGLE_FILE in files and len(files) > 1:
        # As transformers: without an index, model.safetensors is the checkpoint; other files are not read.
        ignored = [f for f in files if f != SINGLE_FILE]
        logging.warning(
            "%s: reading %s only (there is no %s); ignoring %s",
            path,
            SINGLE_FILE,
            INDEX_FILE,
            ", ".join(ignored),
        )
        files = [SINGLE_FILE]
    return SafetensorsReader(path, files)


def open_checkpoint(path: str | os.PathLike[str]) -> CheckpointReader:
    """Open the checkpoint at ``path`` (an HF folder, a ``.safetensors`` file, or an orbax_io folder)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a checkpoint folder path, got {type(path).__name__}")
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {p} does not exist")
    if p.is_dir() and (p / ORBAX_MANIFEST_FILE).is_file():
        from deepinfer_jax.checkpoint import orbax_io  # lazy: JAX and orbax are heavy imports

        return orbax_io.OrbaxReader(p)
    return _open_safetensors(p)


# ---------------------------------------------------------------------------------------------------------------
# Writing


def _shard_plan(infos: Sequence[TensorInfo], max_shard_bytes: int | None) -> list[list[TensorInfo]]:
    """Greedy, name-ordered shards of at most ``max_shard_bytes`` (a bigger tensor gets a shard of its own)."""
    shards: list[list[TensorInfo]] = [[]]
    size = 0
    for info in infos:
        if max_shard_bytes is not None and shards[-1] and size + info.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(info)
        size += info.nbytes
    return shards


def _write_shard(
    path: Path,
    infos: Sequence[TensorInfo],
    fetch: Callable[[Sequence[str]], Iterator[tuple[str, np.ndarray]]],
    metadata: Mapping[str, str],
) -> None:
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for info in infos:
        header[info.name] = {
            "dtype": info.storage_dtype,
            "shape": list(info.header_shape),
            "data_offsets": [offset, offset + info.nbytes],
        }
        offset += info.nbytes
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        written = 0
        for name, array in fetch([info.name for info in infos]):
            if written >= len(infos) or name != infos[written].name:
                want = infos[written].name if written < len(infos) else "nothing more"
                raise CheckpointError(f"{path}: the source gave tensor {name!r} where {want!r} belongs")
            info = infos[written]
            written += 1
            array = np.asarray(array)
            if not array.flags.c_contiguous:  # (np.ascontiguousarray would turn a 0-d array into 1-d)
                array = array.copy(order="C")
            if array.dtype != info.dtype or array.shape != info.shape:
                raise CheckpointError(
                    f"{path}: tensor {name!r}: source gave {array.dtype}{list(array.shape)}, its description "
                    f"says {info.dtype}{list(info.shape)}"
                )
            if sys_big_endian() and array.dtype.itemsize > 1:
                array = array.byteswap()
            f.write(memoryview(array.reshape(-1).view(np.uint8)))
        if written != len(infos):
            raise CheckpointError(f"{path}: the source gave {written} of {len(infos)} tensors")
        f.flush()
        os.fsync(f.fileno())


def save_hf_checkpoint(
    dst: str | os.PathLike[str],
    infos: Sequence[TensorInfo],
    fetch: Callable[[Sequence[str]], Iterator[tuple[str, np.ndarray]]],
    config: Mapping[str, Any] | None,
    *,
    max_shard_bytes: int | None = None,
    files: Iterable[str | os.PathLike[str]] = (),
    overwrite: bool = False,
) -> Path:
    """Write an HF checkpoint folder at ``dst``, atomically (built beside it, then renamed into place).

    Args:
      dst: the folder to create. An existing non-empty folder is refused unless ``overwrite``.
      infos: the tensors to write (name, array shape and dtype, ``storage_dtype``); written in name order.
      fetch: ``names -> iterator of (name, array)`` in that order (e.g. ``reader.read_many``); called once per
        shard, and each array is written as it arrives, so only what ``fetch`` buffers is in flight.
      config: written as ``config.json`` (sorted keys) when given.
      max_shard_bytes: above this many tensor bytes, write ``model-0000i-of-0000n.safetensors`` shards and
        ``model.safetensors.index.json``; ``None`` writes one ``model.safetensors``.
      files: extra files copied into the folder (e.g. the tokenizer).
      overwrite: replace an existing non-empty ``dst``.
    """
    if max_shard_bytes is not None and (
        isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1
    ):
        raise ValueError(f"max_shard_bytes: expected a positive int or None, got {max_shard_bytes!r}")
    ordered = sorted(infos, key=lambda i: i.name)
    names = [i.name for i in ordered]
    if len(set(names)) != len(names):
        raise ValueError("infos: tensor names must be unique")
    _check_spellings(names, "infos")
    for info in ordered:
        if info.storage_dtype not in _DTYPES:
            raise ValueError(
                f"tensor {info.name!r}: storage_dtype {info.storage_dtype!r} is not a safetensors dtype"
            )

    def build(tmp: Path) -> None:
        shards = _shard_plan(ordered, max_shard_bytes)
        if len(shards) == 1:
            _write_shard(tmp / SINGLE_FILE, shards[0], fetch, {"format": "pt"})
        else:
            n = len(shards)
            weight_map: dict[str, str] = {}
            for i, shard in enumerate(shards, 1):
                rel = f"model-{i:05d}-of-{n:05d}.safetensors"
                _write_shard(tmp / rel, shard, fetch, {"format": "pt"})
                weight_map.update({info.name: rel for info in shard})
            index = {"metadata": {"total_size": sum(i.nbytes for i in ordered)}, "weight_map": weight_map}
            _write_text(tmp / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True) + "\n")
        if config is not None:
            _write_text(tmp / CONFIG_FILE, json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
        for extra in files:
            shutil.copyfile(extra, tmp / Path(extra).name)

    return write_atomically(dst, build, overwrite=overwrite)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def check_destination(dst: Path, *, overwrite: bool) -> None:
    """Refuse an existing file, or an existing non-empty folder unless ``overwrite``."""
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"destination {dst} exists and is not a folder")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise ValueError(f"destination {dst} exists and is not empty (pass overwrite to replace it)")


def write_atomically(
    dst: str | os.PathLike[str], build: Callable[[Path], None], *, overwrite: bool = False
) -> Path:
    """Run ``build(tmp)`` on a temporary folder beside ``dst``, then rename it to ``dst``.

    A reader of ``dst`` never sees a half-written folder: either the old content or the complete new one. On any
    failure the temporary folder is removed and ``dst`` is left untouched.
    """
    target = Path(dst)
    check_destination(target, overwrite=overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build(tmp)
        if target.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, trash / target.name)
            os.replace(tmp, target)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
