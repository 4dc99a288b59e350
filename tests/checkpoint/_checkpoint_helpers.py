"""Helpers for the checkpoint tests: a hand-rolled safetensors writer and small synthetic checkpoints.

The writer below is deliberately independent of the package's own (``deepinfer_jax.checkpoint.reader``): it
lays out the format from its description (8-byte little-endian header length, JSON header, raw bytes), and can
write malformed files on purpose, so reader bugs cannot cancel out against writer bugs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

CODES = {
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int16): "I16",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2",
    np.dtype(ml_dtypes.float8_e8m0fnu): "F8_E8M0",
}


def raw_safetensors(
    path: Path,
    entries: Mapping[str, tuple[str, list[int], bytes]],
    *,
    header_extra: Mapping[str, Any] | None = None,
    offsets: Mapping[str, list[int]] | None = None,
    header_len: int | None = None,
) -> None:
    """Write ``{name: (dtype code, header shape, data bytes)}``; ``offsets``/``header_len`` may lie on purpose."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs = []
    pos = 0
    for name, (code, shape, data) in entries.items():
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [pos, pos + len(data)]}
        if offsets and name in offsets:
            header[name]["data_offsets"] = offsets[name]
        pos += len(data)
        blobs.append(data)
    header.update(header_extra or {})
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write((len(text) if header_len is None else header_len).to_bytes(8, "little"))
        f.write(text)
        for b in blobs:
            f.write(b)


def write_arrays(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """A valid safetensors file of NumPy arrays (little-endian machine assumed, as in CI)."""
    raw_safetensors(
        path,
        {n: (CODES[a.dtype], list(a.shape), np.ascontiguousarray(a).tobytes()) for n, a in arrays.items()},
    )


def write_sharded(
    folder: Path, shards: Mapping[str, Mapping[str, np.ndarray]], *, index: bool = True
) -> None:
    """Shard files ``{file name: arrays}`` plus (optionally) a ``model.safetensors.index.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for rel, arrays in shards.items():
        write_arrays(folder / rel, arrays)
        weight_map.update(dict.fromkeys(arrays, rel))
    if index:
        doc = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(doc))


def sample_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """One small tensor of every dtype DeepSeek checkpoints use, with random bit patterns."""
    rng = np.random.default_rng(seed)

    def bits(dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        dt = np.dtype(dtype)
        return rng.integers(0, 256, size=(*shape, dt.itemsize), dtype=np.uint8).view(dt).reshape(shape)

    return {
        "embed.weight": rng.standard_normal((6, 4)).astype(ml_dtypes.bfloat16),
        "layers.0.attn.wq_a.weight": bits(ml_dtypes.float8_e4m3fn, (8, 4)),
        "layers.0.attn.wq_a.scale": bits(ml_dtypes.float8_e8m0fnu, (1, 1)),
        "layers.0.ffn.experts.0.w1.weight": bits(np.uint8, (4, 2)),
        "layers.0.hc_attn_fn": rng.standard_normal((3, 5)).astype(np.float32),
        "layers.0.ffn.gate.tid2eid": rng.integers(0, 4, size=(6, 2)).astype(np.int64),
        "f16": rng.standard_normal((2, 3)).astype(np.float16),
        "f64": rng.standard_normal((3,)).astype(np.float32).astype(np.float64),  # float32-exact
        "i32": rng.integers(-9, 9, size=(2, 2)).astype(np.int32),
        "i16": rng.integers(-9, 9, size=(2,)).astype(np.int16),
        "i8": rng.integers(-9, 9, size=(5,)).astype(np.int8),
        "mask": rng.integers(0, 2, size=(3, 3)).astype(np.bool_),
        "e5m2": bits(ml_dtypes.float8_e5m2, (2, 2)),
        "scalar": np.array(2.5, dtype=np.float32),
    }
