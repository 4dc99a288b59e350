"""Checkpoint-form tensors in orbax: save, restore (into any sharding), and the reader interface.

An orbax checkpoint here holds the **checkpoint-form** tensors - the names, shapes and dtypes of the HF
checkpoint, FP8 and UE8M0 included - not a model's loaded parameters: load-time transformations (fusing
experts, folding projections) run after a restore, in model code, exactly as after reading safetensors. That
keeps one loading path for both formats and makes ``convert`` a byte-exact round trip.

Layout of a folder written by :func:`save_checkpoint`::

    <path>/
        deepinfer_checkpoint.json   format tag, and per tensor its safetensors dtype code and shape
        config.json                 the model's HF config
        tensors/                    the orbax PyTree item (OCDBT): a flat dict {tensor name: array}
        tokenizer.json, ...         extra files (copied unchanged)

orbax-checkpoint 0.12.8 stores every NumPy/``ml_dtypes`` dtype the safetensors format has natively (FP8 codes,
``float8_e8m0fnu`` scales, 64-bit integers) and restores them bit for bit. Three cases need the manifest:
``F4`` tensors are stored as their packed ``uint8`` bytes (the dtype code says how to write them back), 0-d
tensors as shape ``(1,)`` (orbax turns 0-d arrays into Python scalars), and zero-size tensors not at all (orbax
refuses them; the manifest alone describes them).

Restoring into a sharding reads, per device, only the slices that device holds (orbax/tensorstore do the
slicing), so a model restores straight into its mesh layout, which need not be the one it was saved from.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from deepinfer_jax.checkpoint.loader import ShardingSpec, _check_sharding_arg, _sharding_for, to_device
from deepinfer_jax.checkpoint.reader import (
    CONFIG_FILE,
    ORBAX_MANIFEST_FILE,
    PACKED_F4,
    CheckpointError,
    CheckpointReader,
    TensorInfo,
    _check_spellings,
    dtype_for_code,
    storage_dtype_for,
    write_atomically,
)

__all__ = [
    "MANIFEST_FILE",
    "TENSORS_DIR",
    "OrbaxReader",
    "is_orbax_checkpoint",
    "restore_checkpoint",
    "save_checkpoint",
]

MANIFEST_FILE = ORBAX_MANIFEST_FILE
TENSORS_DIR = "tensors"
_FORMAT = "deepinfer_jax.orbax-checkpoint-form"
_VERSION = 1
# Bytes orbax may hold in flight while saving / restoring (its own throttle); keeps convert's memory bounded.
_CONCURRENT_GB = 4
# Tensors restored together by one orbax call when reading to the host (fewer calls, bounded memory).
_READ_BATCH_BYTES = 256 << 20


def _ocp() -> Any:
    import orbax.checkpoint as ocp  # heavy import, only when an orbax checkpoint is used

    return ocp


def _checkpointer() -> Any:
    ocp = _ocp()
    handler = ocp.PyTreeCheckpointHandler(
        save_concurrent_gb=_CONCURRENT_GB, restore_concurrent_gb=_CONCURRENT_GB
    )
    return ocp.Checkpointer(handler)


def is_orbax_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder written by :func:`save_checkpoint`."""
    return (Path(path) / MANIFEST_FILE).is_file()


def _stored_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape if shape else (1,)


def save_checkpoint(
    path: str | os.PathLike[str],
    tensors: Mapping[str, jax.Array | np.ndarray],
    config: Mapping[str, Any] | None,
    *,
    storage_dtypes: Mapping[str, str] | None = None,
    files: Iterable[str | os.PathLike[str]] = (),
    overwrite: bool = False,
) -> Path:
    """Save checkpoint-form ``tensors`` and ``config`` as an orbax checkpoint folder at ``path`` (atomically).

    Args:
      path: the folder to create; an existing non-empty folder is refused unless ``overwrite``.
      tensors: ``{checkpoint name: array}``; ``jax.Array`` (any sharding: each device writes its shards) or host
        arrays (``np.memmap`` included, read as orbax writes).
      config: the HF ``config.json`` dict (``None``: no config file).
      storage_dtypes: safetensors dtype codes for tensors whose array dtype does not say it; only ``"F4"``
        (packed E2M1 pairs held as ``uint8``, as :class:`~deepinfer_jax.checkpoint.reader.SafetensorsReader`
        reads them) needs it.
      files: extra files copied into the folder unchanged (the tokenizer, ...).
      overwrite: replace an existing folder.

    Returns the folder.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors: expected a mapping of names to arrays, got {type(tensors).__name__}")
    storage_dtypes = dict(storage_dtypes or {})
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"config: expected a dict (the HF config.json) or None, got {type(config).__name__}")
    for name in storage_dtypes:
        if name not in tensors:
            raise ValueError(f"storage_dtypes: {name!r} is not one of the tensors")
    manifest: dict[str, dict[str, Any]] = {}
    item: dict[str, Any] = {}
    for name, array in tensors.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"tensors: names must be non-empty str, got {name!r}")
        if not isinstance(array, (np.ndarray, jax.Array)):
            raise TypeError(
                f"tensors[{name!r}]: expected a jax.Array or numpy array, got {type(array).__name__}"
            )
        dtype = np.dtype(array.dtype)
        code = storage_dtypes.get(name) or storage_dtype_for(dtype)
        if code == PACKED_F4:
            if dtype != np.uint8 or not array.shape:
                raise ValueError(
                    f"tensors[{name!r}]: F4 is stored as packed uint8 pairs with at least one dim, got "
                    f"{dtype}{list(array.shape)}"
                )
        elif storage_dtype_for(dtype) != code:
            raise ValueError(f"storage_dtypes[{name!r}]: {code!r} does not match the array dtype {dtype}")
        shape = tuple(int(d) for d in array.shape)
        stored = math.prod(shape) > 0
        manifest[name] = {"dtype": code, "shape": list(shape), "stored": stored}
        if stored:
            item[name] = array.reshape(_stored_shape(shape)) if not shape else array
    _check_spellings(manifest, "tensors")
    files = [Path(f) for f in files]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"files: {f} is not a file")
        if f.name in (MANIFEST_FILE, CONFIG_FILE, TENSORS_DIR):
            raise ValueError(f"files: {f.name!r} is a name the checkpoint layout reserves")

    def build(tmp: Path) -> None:
        ocp = _ocp()
        if item:
            _checkpointer().save(tmp / TENSORS_DIR, args=ocp.args.PyTreeSave(item))
        if config is not None:
            _write_json(tmp / CONFIG_FILE, dict(config))
        for f in files:
            (tmp / f.name).write_bytes(f.read_bytes())
        _write_json(tmp / MANIFEST_FILE, {"format": _FORMAT, "version": _VERSION, "tensors": manifest})

    return write_atomically(path, build, overwrite=overwrite)


def _write_json(path: Path, doc: Any) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _read_manifest(path: Path) -> dict[str, TensorInfo]:
    file = path / MANIFEST_FILE
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: cannot read the manifest: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT or not isinstance(doc.get("tensors"), dict):
        raise CheckpointError(f"{file}: not a {_FORMAT} manifest")
    if doc.get("version") != _VERSION:
        raise CheckpointError(
            f"{file}: manifest version {doc.get('version')!r}; this reader knows {_VERSION}"
        )
    infos: dict[str, TensorInfo] = {}
    for name, entry in doc["tensors"].items():
        try:
            code, shape, stored = entry["dtype"], tuple(entry["shape"]), entry["stored"]
            dtype = dtype_for_code(code)
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{file}: tensor {name!r}: malformed entry {entry!r} ({e})") from e
        nbytes = math.prod(shape) * dtype.itemsize
        infos[name] = TensorInfo(name, shape, dtype, TENSORS_DIR if stored else "", code, -1, nbytes)
    if any(i.file for i in infos.values()) and not (path / TENSORS_DIR).is_dir():
        raise CheckpointError(f"{path}: the manifest lists stored tensors but {TENSORS_DIR}/ is missing")
    return infos


class OrbaxReader(CheckpointReader):
    """A folder written by :func:`save_checkpoint`, read one tensor (or one batch) at a time to the host."""

    format = "orbax"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        config = p / CONFIG_FILE
        super().__init__(p, _read_manifest(p), config if config.is_file() else None)

    def read(self, name: str) -> np.ndarray:
        return next(self.read_many([name]))[1]

    def read_many(self, names: Sequence[str]) -> Iterator[tuple[str, np.ndarray]]:
        infos = [self.info(n) for n in names]
        batch: list[TensorInfo] = []
        size = 0
        for info in infos:
            if batch and size + info.nbytes > _READ_BATCH_BYTES:
                yield from self._restore_host(batch)
                batch, size = [], 0
            batch.append(info)
            size += info.nbytes
        if batch:
            yield from self._restore_host(batch)

    def _restore_host(self, infos: Sequence[TensorInfo]) -> Iterator[tuple[str, np.ndarray]]:
        ocp = _ocp()
        stored = [i for i in infos if i.file]
        restored: dict[str, np.ndarray] = {}
        if stored:
            item = {i.name: np.empty(_stored_shape(i.shape), i.dtype) for i in stored}
            restore_args = {i.name: ocp.RestoreArgs(restore_type=np.ndarray) for i in stored}
            restored = _restore(self.path, item, restore_args)
            del item
        for info in infos:
            array = restored.pop(info.name) if info.file else np.empty(info.shape, info.dtype)
            yield info.name, _check_restored(self.path, info, np.asarray(array).reshape(info.shape))


def _restore(path: Path, item: dict[str, Any], restore_args: dict[str, Any]) -> dict[str, Any]:
    ocp = _ocp()
    args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    try:
        return _checkpointer().restore(path / TENSORS_DIR, args=args)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise CheckpointError(f"{path}: orbax cannot restore {sorted(item)[:5]}...: {e}") from e


def _check_restored(path: Path, info: TensorInfo, array: Any) -> Any:
    if np.dtype(array.dtype) != info.dtype or tuple(array.shape) != info.shape:
        raise CheckpointError(
            f"{path}: tensor {info.name!r}: orbax restored {array.dtype}{list(array.shape)}, the manifest says "
            f"{info.dtype}{list(info.shape)}"
        )
    return array


def restore_checkpoint(
    path: str | os.PathLike[str],
    *,
    sharding: ShardingSpec = None,
    names: Iterable[str] | None = None,
) -> dict[str, jax.Array]:
    """Restore tensors of a :func:`save_checkpoint` folder straight into device arrays.

    Args:
      path: the folder.
      sharding: ``None`` (default device), one ``jax.sharding.Sharding``, or ``(name, shape) -> Sharding``; any
        layout works, whatever the checkpoint was saved from.
      names: restore only these (either spelling of the ``model.`` prefix; the result uses the names given);
        ``None`` restores everything under the stored names.

    64-bit tensors follow :func:`~deepinfer_jax.checkpoint.loader.load_tensors`: 32-bit when JAX runs without
    ``jax_enable_x64`` and the values fit exactly, else a ``CheckpointError``.
    """
    _check_sharding_arg(sharding)
    reader = OrbaxReader(path)
    if names is None:
        wanted = {n: n for n in reader.names()}
    else:
        if isinstance(names, str):
            raise TypeError("names: expected an iterable of tensor names, got a single str")
        wanted = {}
        missing = []
        for n in names:
            stored = reader.find(n)
            if stored is None:
                missing.append(n)
            else:
                wanted[n] = stored
        if missing:
            raise CheckpointError(f"{reader.path}: tensor(s) not in the checkpoint: {missing}", missing)
    ocp = _ocp()
    x64 = jax.config.read("jax_enable_x64")
    out: dict[str, jax.Array] = {}
    item: dict[str, Any] = {}
    restore_args: dict[str, Any] = {}
    host: list[str] = []
    for key, stored in wanted.items():
        info = reader.info(stored)
        if not info.file or (info.dtype.itemsize == 8 and not x64):
            host.append(key)  # zero-size, or narrowed on the host first
            continue
        target = _sharding_for(sharding, key, info.shape)
        if target is None:
            target = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        item[stored] = jax.ShapeDtypeStruct(_stored_shape(info.shape), info.dtype, sharding=target)
        restore_args[stored] = ocp.ArrayRestoreArgs(sharding=target, global_shape=_stored_shape(info.shape))
    restored = _restore(reader.path, item, restore_args) if item else {}
    for key, stored in wanted.items():
        if key in host:
            continue
        info = reader.info(stored)
        array = restored.pop(stored)
        if not info.shape:
            array = array.reshape(())
        out[key] = _check_restored(reader.path, info, array)
    for key, (stored, array) in zip(host, reader.read_many([wanted[k] for k in host]), strict=True):
        out[key] = to_device(stored, array, sharding if not callable(sharding) else _named(sharding, key))
    return {k: out[k] for k in wanted}


def _named(sharding: Any, key: str) -> Any:
    """Call a per-name sharding function with the caller's spelling of the name."""
    return lambda _name, shape: sharding(key, shape)
