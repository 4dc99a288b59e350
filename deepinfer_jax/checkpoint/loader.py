"""Checked, tensor-by-tensor loading of checkpoint tensors into (sharded) device arrays.

The model says what it expects - a name, a shape and the acceptable dtypes for every tensor - and
:func:`load_tensors` makes the checkpoint deliver exactly that, or refuses it with **every** problem listed at
once: missing tensors, unexpected ones, wrong shapes, wrong dtypes and (on request) non-finite values, each with
its tensor name and expected-versus-found. A long list in one error beats fixing a converted checkpoint one
tensor per run; and nothing is returned half-loaded.

Tensors travel one at a time: read from the file (only that tensor's bytes), checked, placed on the device(s)
with ``jax.device_put`` and the host copy dropped before the next is read, so host memory peaks at about one
tensor beyond what is already loaded, whatever the size of the shard files.

Arrays keep their checkpoint dtype (FP8 stays FP8, UE8M0 stays UE8M0); ``ExpectedTensor.view_as`` reinterprets
the bits instead (e.g. FP8 codes as ``uint8``, which XLA:CPU slices without a copy). 64-bit tensors (such as
V4's ``int64`` ``tid2eid``) become 32-bit when JAX runs without ``jax_enable_x64``, but only if every value is
exactly representable; otherwise the tensor is reported as a problem rather than silently changed.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import jax
import ml_dtypes
import numpy as np

from deepinfer_jax.checkpoint.reader import (
    CONFIG_FILE,
    PACKED_F4_NAME,
    CheckpointError,
    CheckpointReader,
    TensorInfo,
)

__all__ = [
    "ExpectedSpec",
    "ExpectedTensor",
    "ShardingSpec",
    "check_tensors",
    "load_tensors",
    "read_config",
    "to_device",
]

_log = logging.getLogger(__name__)

ShardingSpec = jax.sharding.Sharding | Callable[[str, tuple[int, ...]], jax.sharding.Sharding] | None
"""``None`` (the default device), one sharding for every tensor, or ``(name, shape) -> sharding``."""

_FLOAT_DTYPES = frozenset(
    np.dtype(t)
    for t in (
        np.float16,
        np.float32,
        np.float64,
        np.complex64,
        ml_dtypes.bfloat16,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e5m2,
        ml_dtypes.float8_e4m3fnuz,
        ml_dtypes.float8_e5m2fnuz,
        ml_dtypes.float8_e8m0fnu,
    )
)


def dtype_from_name(name: str, *, field: str = "dtype") -> np.dtype:
    """A dtype from its name (NumPy or ``ml_dtypes``); ``float4_e2m1fn_x2`` is packed ``uint8``."""
    if not isinstance(name, str):
        raise TypeError(f"{field}: expected a dtype name (str), got {name!r} ({type(name).__name__})")
    if name == PACKED_F4_NAME:
        return np.dtype(np.uint8)
    found = getattr(ml_dtypes, name, None)
    try:
        return np.dtype(found if found is not None else name)
    except TypeError as e:
        raise ValueError(f"{field}: {name!r} is not a NumPy or ml_dtypes dtype name") from e


@dataclasses.dataclass(frozen=True)
class ExpectedTensor:
    """What the model expects of one checkpoint tensor.

    Attributes:
        shape: the expected shape; a ``None`` entry accepts any size in that dimension.
        dtypes: acceptable dtype names, e.g. ``("bfloat16", "float32")``, ``("float8_e4m3fn",)``, or
            ``("uint8", "int8", "float4_e2m1fn_x2")`` for packed E2M1 pairs (an ``F4`` tensor matches ``uint8``
            too, as it is read packed).
        optional: a missing optional tensor is not a problem (it is simply absent from the result).
        view_as: reinterpret the loaded bits as this dtype (same item size), e.g. FP8 codes as ``"uint8"``.
    """

    shape: tuple[int | None, ...]
    dtypes: tuple[str, ...]
    optional: bool = False
    view_as: str | None = None

    def __post_init__(self) -> None:
        shape = self.shape
        if isinstance(shape, int) or not isinstance(shape, Iterable):
            raise TypeError(f"shape: expected a sequence of ints, got {shape!r}")
        shape = tuple(shape)
        for d in shape:
            if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 0):
                raise ValueError(f"shape: {shape!r}: every dim must be a non-negative int or None, got {d!r}")
        dtypes = (self.dtypes,) if isinstance(self.dtypes, str) else tuple(self.dtypes)
        if not dtypes:
            raise ValueError("dtypes: expected at least one acceptable dtype name, got none")
        sizes = {dtype_from_name(d, field="dtypes").itemsize for d in dtypes}
        if not isinstance(self.optional, bool):
            raise TypeError(f"optional: expected a bool, got {self.optional!r}")
        if self.view_as is not None:
            view = dtype_from_name(self.view_as, field="view_as")
            bad = sorted(d for d in dtypes if dtype_from_name(d).itemsize != view.itemsize)
            if bad:
                raise ValueError(
                    f"view_as: {self.view_as!r} has {view.itemsize}-byte items, but dtypes {bad} do not "
                    f"(item sizes {sorted(sizes)}); a bit view needs equal item sizes"
                )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtypes", dtypes)

    def shape_matches(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.shape) and all(e is None or e == f for e, f in zip(self.shape, shape))


ExpectedSpec = ExpectedTensor | tuple[Sequence[int | None], Sequence[str] | str] | tuple[Any, ...]
"""An :class:`ExpectedTensor`, or a plain ``(shape, dtypes)`` / ``(shape, dtypes, optional)`` tuple."""


def _as_expected(name: str, spec: Any) -> ExpectedTensor:
    if isinstance(spec, ExpectedTensor):
        return spec
    if isinstance(spec, (tuple, list)) and len(spec) in (2, 3):
        try:
            return ExpectedTensor(*spec)
        except (TypeError, ValueError) as e:
            raise type(e)(f"expected[{name!r}]: {e}") from e
    raise TypeError(
        f"expected[{name!r}]: expected an ExpectedTensor or a (shape, dtypes[, optional]) tuple, got {spec!r}"
    )


def _fmt_shape(shape: Sequence[int | None]) -> str:
    return (
        "(" + ", ".join("*" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"
    )


def _ignored(name: str, ignore: Sequence[str] | Callable[[str], bool]) -> bool:
    if callable(ignore):
        return bool(ignore(name))
    bare = name[len("model.") :] if name.startswith("model.") else name
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(bare, p) for p in ignore)


def _check_ignore(ignore: Any) -> Sequence[str] | Callable[[str], bool]:
    if callable(ignore):
        return ignore
    if isinstance(ignore, str):
        return (ignore,)
    patterns = tuple(ignore)
    for p in patterns:
        if not isinstance(p, str):
            raise TypeError(f"ignore: expected glob strings or a predicate, got the item {p!r}")
    return patterns


def check_tensors(
    reader: CheckpointReader,
    expected: Mapping[str, ExpectedSpec],
    *,
    ignore: Sequence[str] | Callable[[str], bool] = (),
    unexpected: Literal["error", "log", "ignore"] = "error",
) -> tuple[dict[str, tuple[ExpectedTensor, TensorInfo]], list[str]]:
    """Match ``expected`` against the checkpoint's metadata, reading no tensor data.

    Returns ``({expected name: (spec, info)} for the tensors found, problems)``; each problem is one line that
    names its tensor. :func:`load_tensors` raises them; callers can use this for a dry run.
    """
    if not isinstance(reader, CheckpointReader):
        raise TypeError(f"reader: expected a CheckpointReader, got {type(reader).__name__}")
    if not isinstance(expected, Mapping):
        raise TypeError(f"expected: expected a mapping of tensor names, got {type(expected).__name__}")
    if unexpected not in ("error", "log", "ignore"):
        raise ValueError(f"unexpected: {unexpected!r} must be one of 'error', 'log', 'ignore'")
    ignore = _check_ignore(ignore)
    specs = {name: _as_expected(name, spec) for name, spec in expected.items()}
    problems: list[str] = []
    found: dict[str, tuple[ExpectedTensor, TensorInfo]] = {}
    claimed: dict[str, str] = {}
    for name, spec in specs.items():
        stored = reader.find(name)
        if stored is None:
            if not spec.optional:
                problems.append(
                    f"missing: {name!r} (expected shape {_fmt_shape(spec.shape)}, dtype {'|'.join(spec.dtypes)})"
                )
            continue
        if stored in claimed:
            raise ValueError(
                f"expected: {claimed[stored]!r} and {name!r} name the same stored tensor {stored!r}"
            )
        claimed[stored] = name
        info = reader.info(stored)
        ok = True
        if not spec.shape_matches(info.shape):
            problems.append(
                f"shape: {name!r}: expected {_fmt_shape(spec.shape)}, found {_fmt_shape(info.shape)} "
                f"(in {info.file})"
            )
            ok = False
        if not set(info.dtype_names) & set(spec.dtypes):
            problems.append(
                f"dtype: {name!r}: expected {'|'.join(spec.dtypes)}, found {info.dtype_names[-1]} "
                f"(stored as {info.storage_dtype or info.dtype.name} in {info.file})"
            )
            ok = False
        if ok:
            found[name] = (spec, info)
    extra = [n for n in reader.names() if n not in claimed and not _ignored(n, ignore)]
    if extra and unexpected == "error":
        problems += [
            f"unexpected: {n!r} ({_fmt_shape(reader.info(n).shape)} {reader.info(n).dtype_names[-1]} in "
            f"{reader.info(n).file})"
            for n in extra
        ]
    elif extra and unexpected == "log":
        _log.warning("checkpoint %s: %d unexpected tensor(s) not loaded: %s", reader.path, len(extra), extra)
    return found, problems


def _is_float(dtype: np.dtype) -> bool:
    return dtype in _FLOAT_DTYPES


def _non_finite(array: np.ndarray) -> int:
    if not _is_float(array.dtype) or array.size == 0:
        return 0
    return int(array.size - np.count_nonzero(np.isfinite(array)))


def narrow_for_device(name: str, array: np.ndarray) -> np.ndarray:
    """Make a 64-bit array storable by JAX without ``jax_enable_x64``: 32-bit when exact, else CheckpointError."""
    if array.dtype.itemsize != 8 or array.dtype.kind not in "iuf" or jax.config.read("jax_enable_x64"):
        return array
    target = {"i": np.int32, "u": np.uint32, "f": np.float32}[array.dtype.kind]
    with np.errstate(over="ignore", invalid="ignore"):
        narrowed = array.astype(target)
    same = np.array_equal(narrowed.astype(array.dtype), array, equal_nan=array.dtype.kind == "f")
    if not same:
        raise CheckpointError(
            f"tensor {name!r}: {array.dtype} values do not fit {np.dtype(target).name} exactly, and JAX runs "
            "without jax_enable_x64 (enable it to load this tensor unchanged)"
        )
    return narrowed


def _sharding_for(sharding: ShardingSpec, name: str, shape: tuple[int, ...]) -> jax.sharding.Sharding | None:
    if sharding is None or isinstance(sharding, jax.sharding.Sharding):
        return sharding
    result = sharding(name, shape)
    if result is not None and not isinstance(result, jax.sharding.Sharding):
        raise TypeError(
            f"sharding({name!r}, {shape}): expected a jax.sharding.Sharding or None, got {type(result).__name__}"
        )
    return result


def _check_sharding_arg(sharding: Any) -> None:
    if sharding is not None and not isinstance(sharding, jax.sharding.Sharding) and not callable(sharding):
        raise TypeError(
            f"sharding: expected None, a jax.sharding.Sharding or a (name, shape) -> Sharding callable, "
            f"got {type(sharding).__name__}"
        )


def to_device(name: str, array: np.ndarray, sharding: ShardingSpec) -> jax.Array:
    """Place one host array with its sharding, and wait until the copy is done (so the host array can go)."""
    array = narrow_for_device(name, array)
    target = _sharding_for(sharding, name, tuple(array.shape))
    out = jax.device_put(array) if target is None else jax.device_put(array, target)
    return out.block_until_ready()


def load_tensors(
    reader: CheckpointReader,
    expected: Mapping[str, ExpectedSpec],
    *,
    sharding: ShardingSpec = None,
    ignore: Sequence[str] | Callable[[str], bool] = (),
    validate_finite: bool = False,
    unexpected: Literal["error", "log", "ignore"] = "error",
    transform: Callable[[str, np.ndarray], np.ndarray] | None = None,
    defer: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    """Load the tensors ``expected`` names from ``reader``, checked, one at a time, onto the device(s).

    Args:
      reader: an open checkpoint (:func:`deepinfer_jax.checkpoint.open_checkpoint`).
      expected: ``{name: ExpectedTensor | (shape, dtypes[, optional])}``; names may be given with or without the
        ``model.`` prefix whatever the checkpoint's spelling, and the result uses the names given here.
      sharding: ``None`` (default device), a ``jax.sharding.Sharding`` for every tensor, or a callable
        ``(name, shape) -> Sharding`` (called with the final shape, after ``view_as``/``transform``).
      ignore: glob patterns (matched with and without the ``model.`` prefix, e.g. ``"vision.*"``) or a predicate
        for stored names that are skipped silently when not expected.
      validate_finite: also count NaN/inf values of every floating tensor (reads all data before returning).
      unexpected: what to do with stored tensors neither expected nor ignored: a problem (``"error"``), a
        warning in the log (``"log"``), or nothing (``"ignore"``).
      transform: ``(name, host array) -> host array``, applied after the checks and ``view_as``, before the
        transfer (a load-time conversion that must not hold more than one tensor).
      defer: ``name -> bool``: the tensors it accepts are checked against the header like the others but not
        read; each is returned as a :class:`~deepinfer_jax.checkpoint.deferred.DeferredTensor` that reads
        (with ``view_as`` and ``transform``) when converted to an array. ``reader`` must then stay open while
        they are used. Not with ``validate_finite`` (it would read them all).

    Raises:
      CheckpointError: listing every problem found, each with its tensor name; nothing is returned then.
      TypeError / ValueError: malformed arguments.
    """
    _check_sharding_arg(sharding)
    if transform is not None and not callable(transform):
        raise TypeError(f"transform: expected a callable or None, got {type(transform).__name__}")
    if defer is not None and not callable(defer):
        raise TypeError(f"defer: expected a callable or None, got {type(defer).__name__}")
    if defer is not None and validate_finite:
        raise ValueError(
            "defer: deferred tensors cannot be checked for NaN/inf at load (validate_finite=True)"
        )
    found, problems = check_tensors(reader, expected, ignore=ignore, unexpected=unexpected)
    if problems and not validate_finite:
        _raise(reader, problems)
    loaded: dict[str, Any] = {}
    deferred = {name for name in found if defer is not None and defer(name)}
    if deferred:
        from deepinfer_jax.checkpoint.deferred import DeferredSource, DeferredTensor

        source = DeferredSource(reader)

        def finish(name: str, array: np.ndarray) -> np.ndarray:
            spec = found[name][0]
            if spec.view_as is not None:
                array = array.view(dtype_from_name(spec.view_as))
            if transform is not None:
                array = transform(name, array)
            return narrow_for_device(name, array)

        for name in deferred:
            spec, info = found[name]
            dtype = dtype_from_name(spec.view_as) if spec.view_as is not None else info.dtype
            loaded[name] = DeferredTensor(source, info.name, name, info.shape, dtype, finish)
    # read_many: one tensor at a time from safetensors; orbax restores bounded batches (one call per batch).
    reading = {name: entry for name, entry in found.items() if name not in deferred}
    stream = reader.read_many([info.name for _, info in reading.values()])
    for (name, (spec, info)), (_, array) in zip(reading.items(), stream, strict=True):
        if validate_finite:
            bad = _non_finite(array)
            if bad:
                problems.append(
                    f"non-finite: {name!r}: {bad} of {array.size} values are NaN or infinite (in {info.file})"
                )
        if problems:  # with validate_finite, keep scanning for the report; load nothing more either way
            del array
            if not validate_finite:
                break
            continue
        if spec.view_as is not None:
            array = array.view(dtype_from_name(spec.view_as))
        if transform is not None:
            array = transform(name, array)
            if not isinstance(array, np.ndarray):
                raise TypeError(
                    f"transform({name!r}) returned {type(array).__name__}, expected a numpy array"
                )
        try:
            loaded[name] = to_device(name, array, sharding)
        except CheckpointError as e:
            problems.append(f"dtype: {e}")
        del array
    if problems:
        loaded.clear()
        _raise(reader, problems)
    return loaded


def _raise(reader: CheckpointReader, problems: Sequence[str]) -> None:
    raise CheckpointError(
        f"checkpoint {reader.path} does not match the model ({len(problems)} problem(s)):\n  "
        + "\n  ".join(problems),
        problems,
    )


def read_config(path: str | os.PathLike[str] | CheckpointReader) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint (a folder, a config file, or an open reader) as a dict."""
    if isinstance(path, CheckpointReader):
        if path.config_path is None:
            raise FileNotFoundError(f"checkpoint {path.path} has no {CONFIG_FILE}")
        file = path.config_path
    elif isinstance(path, (str, os.PathLike)):
        p = Path(path)
        file = p / CONFIG_FILE if p.is_dir() else p
    else:
        raise TypeError(f"path: expected a checkpoint folder, a config.json path or a reader, got {path!r}")
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no such config file")
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON: {e}") from e
    if not isinstance(doc, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(doc).__name__}")
    return doc


_DECLARED_FLOATS = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "half": "float16"}

KEPT_IN_FLOAT32 = (
    "*norm.weight",
    "*norm.bias",
    "*.bias",
    "*e_score_correction_bias",
    "*scale_inv",
    "*_scale",
    "*.scale",
    "*attn_sink*",
    "*.gate.weight",
    "*.gate.bias*",
    "*hc_*_fn",
    "*hc_*_base",
    "*compressor.ape",
)
"""Tensors that HF checkpoints legitimately store in float32 whatever their ``torch_dtype`` (glob patterns):
normalisation weights and biases, the router's gate, its biases and ``e_score_correction_bias``, attention sinks,
the DeepSeek-V4 / V4.1 hyper-connection mixers (``hc_*_fn``, ``hc_*_base``) and compressor position biases
(``compressor.ape``), and the dequantisation scales that come with FP8 / FP4 weights (``weight_scale_inv``,
``*_scale``)."""


def check_declared_dtypes(
    reader: CheckpointReader, names: Iterable[str], torch_dtype: Any, *, config_source: str = "config.json"
) -> list[str]:
    """Check the floating tensors of ``names`` against the checkpoint's declared ``torch_dtype``.

    A 16-bit floating tensor of the other 16-bit type (a float16 tensor in a bfloat16 checkpoint, or the
    reverse), or a 16-bit tensor in a float32 checkpoint, is a :class:`CheckpointError` naming every such tensor:
    its values were written in another format than the one the checkpoint declares, so they are not the
    checkpoint's weights (a relabelled header gives other tokens silently). A float32 tensor in a 16-bit checkpoint
    is accepted: silently when it is one HF checkpoints keep in float32 (:data:`KEPT_IN_FLOAT32`), else with a
    warning naming it (it widens the checkpoint but loses nothing). Quantised codes (FP8, FP4, integers) are not
    floating tensors and are not checked here. Without a declared ``torch_dtype`` (or with one that is not a
    floating dtype name), 16-bit tensors of both types in one checkpoint are the error.

    Returns the float32 tensors outside :data:`KEPT_IN_FLOAT32` (one line each), which it logs as one warning.
    """
    declared = _DECLARED_FLOATS.get(str(torch_dtype).removeprefix("torch.")) if torch_dtype else None
    infos = [reader.info(stored) for stored in (reader.find(n) for n in names) if stored is not None]
    floats = [i for i in infos if i.dtype.name in _DECLARED_FLOATS.values()]
    problems: list[str] = []
    warned: list[str] = []
    where = f"{config_source} declares torch_dtype {declared!r}"
    if declared is None:
        sixteen = {i.dtype.name for i in floats if i.dtype.itemsize == 2}
        if len(sixteen) > 1:
            counts = {d: sum(i.dtype.name == d for i in floats) for d in sixteen}
            minority = min(counts, key=lambda d: (counts[d], d))
            majority = max(counts, key=lambda d: (counts[d], d))
            problems += [
                f"dtype: {i.name!r} is stored as {minority} ({i.storage_dtype} in {i.file}) while "
                f"{counts[majority]} other tensor(s) are {majority} and {config_source} declares no torch_dtype; "
                "a checkpoint holds one 16-bit floating type"
                for i in floats
                if i.dtype.name == minority
            ]
    else:
        for i in floats:
            stored = i.dtype.name
            if stored == declared:
                continue
            if stored == "float32":
                if not _ignored(i.name, KEPT_IN_FLOAT32):
                    warned.append(f"{i.name!r} is stored as float32 ({i.file}) but {where}")
                continue
            problems.append(
                f"dtype: {i.name!r} is stored as {stored} ({i.storage_dtype} in {i.file}) but {where} and the "
                f"model reads {declared} tensors; the header does not describe the checkpoint's weights "
                "(re-export the tensor in the declared dtype, or fix torch_dtype)"
            )
    if warned:
        shown = "; ".join(warned[:4]) + (f"; and {len(warned) - 4} more" if len(warned) > 4 else "")
        _log.warning(
            "checkpoint %s: %d float32 tensor(s) where HF checkpoints keep the declared dtype, loaded as they are: %s",
            reader.path,
            len(warned),
            shown,
        )
    if problems:
        _raise(reader, problems)
    return warned
