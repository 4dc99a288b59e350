"""XLA FFI custom calls in C++ (and CUDA): native decoders of the checkpoint weight formats.

Two handlers, built from ``dequant.cc`` by :mod:`custom_calls.ffi.build` and registered for the CPU platform:

* ``deepinfer_fp8_block_dequantize``: E4M3 codes ``[..., R, C]`` with block scales (UE8M0 bytes or float32
  ``scale_inv``) -> float32 ``[..., R, C]``;
* ``deepinfer_mxfp4_dequantize``: packed E2M1 nibbles ``[..., R, C/2]`` with UE8M0 scales ``[..., R, C/32]`` ->
  float32 ``[..., R, C]``.

They produce exactly the bytes of :mod:`deepinfer_jax.numerics.host` (the test-suite checks this bit for bit) and
serve as its optional fast path when converting or inspecting checkpoints: :func:`host_fp8_block_dequantize` and
:func:`host_mxfp4_dequantize` take and return numpy arrays and fall back to the numpy codecs when the library
cannot be built (no ``g++``). :func:`fp8_block_dequantize` and :func:`mxfp4_dequantize` are the JAX-level calls
(``jax.ffi.ffi_call``); they work under ``jit`` and ``vmap`` and export, with :func:`export_disabled_checks`.
The engine's hot path never dequantises whole weights (ARCHITECTURE.md §2); these are tools for the host.

The same handlers exist for CUDA (``dequant_cuda.cu``, built for ``sm_90a``/``sm_100a`` when ``nvcc`` is present,
registered with :func:`load_cuda`).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from custom_calls.ffi import build as _build
from deepinfer_jax.numerics import host
from deepinfer_jax.numerics.elements import as_uint8

__all__ = [
    "FP8_TARGET",
    "MXFP4_TARGET",
    "TARGETS",
    "export_disabled_checks",
    "fp8_block_dequantize",
    "host_fp8_block_dequantize",
    "host_mxfp4_dequantize",
    "load",
    "load_cuda",
    "mxfp4_dequantize",
]

FP8_TARGET = "deepinfer_fp8_block_dequantize"
MXFP4_TARGET = "deepinfer_mxfp4_dequantize"
TARGETS: tuple[str, ...] = (FP8_TARGET, MXFP4_TARGET)

# Symbol names of the handlers in the CPU and CUDA libraries, per target.
_CPU_SYMBOLS = {FP8_TARGET: "DeepinferFp8BlockDequantize", MXFP4_TARGET: "DeepinferMxfp4Dequantize"}
_CUDA_SYMBOLS = {FP8_TARGET: "DeepinferFp8BlockDequantizeCuda", MXFP4_TARGET: "DeepinferMxfp4DequantizeCuda"}

_lock = threading.Lock()
# platform -> loaded library (kept referenced: unloading it would leave XLA with dangling handler pointers)
_loaded: dict[str, tuple[Path, ctypes.CDLL]] = {}


def _register(platform: str, library: Path, symbols: dict[str, str]) -> Path:
    with _lock:
        if platform in _loaded:
            return _loaded[platform][0]
        lib = ctypes.CDLL(str(library))
        for target, symbol in symbols.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform=platform)
        _loaded[platform] = (library, lib)
        return library


def load(library: str | Path | None = None) -> Path:
    """Register the CPU handlers (once per process); builds the library first when no path is given.

    Returns the library's path. Raises ``FileNotFoundError`` when it has to be built and ``g++`` is missing.
    """
    path = Path(library) if library is not None else _build.build_cpu()
    if not path.is_file():
        raise FileNotFoundError(f"library: no such file {path}")
    return _register("cpu", path, _CPU_SYMBOLS)


def load_cuda(library: str | Path | None = None) -> Path:
    """Register the CUDA handlers (once per process); builds the library first (needs ``nvcc``) when no path
    is given. Registration works on a CPU-only jaxlib, which is enough to export programs for ``cuda``."""
    path = Path(library) if library is not None else _build.build_cuda()
    if not path.is_file():
        raise FileNotFoundError(f"library: no such file {path}")
    return _register("CUDA", path, _CUDA_SYMBOLS)


def export_disabled_checks() -> list[jax.export.DisabledSafetyCheck]:
    """The safety checks ``jax.export`` needs disabled to serialise programs that call these targets."""
    return [jax.export.DisabledSafetyCheck.custom_call(t) for t in TARGETS]


def _check_block(block: Any) -> tuple[int, int]:
    if (
        not isinstance(block, tuple | list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(f"block must be a pair of positive ints (rows, cols), got {block!r}")
    return int(block[0]), int(block[1])


def _fp8_operands(codes: Any, scale: Any, block: Any) -> tuple[jax.Array, jax.Array, tuple[int, int]]:
    b0, b1 = _check_block(block)
    codes = as_uint8(jnp.asarray(codes), "codes")
    scale = jnp.asarray(scale)
    if scale.dtype != jnp.float32:
        scale = as_uint8(scale, "scale")
    if codes.ndim < 2:
        raise ValueError(f"codes must have shape [..., rows, cols], got shape {codes.shape}")
    rows, cols = codes.shape[-2:]
    expected = (*codes.shape[:-2], -(-rows // b0), -(-cols // b1))
    if scale.shape != expected:
        raise ValueError(
            f"scale must have shape {expected} for codes of shape {codes.shape} and block {(b0, b1)}, "
            f"got {scale.shape}"
        )
    return codes, scale, (b0, b1)


def fp8_block_dequantize(codes: Any, scale: Any, *, block: Sequence[int] = (32, 32)) -> jax.Array:
    """Float32 values of an FP8 block-scaled tensor through the native handler (call :func:`load` first).

    ``codes [..., R, C]`` are E4M3 (``float8_e4m3fn`` or ``uint8``); ``scale [..., ceil(R/b0), ceil(C/b1)]`` is
    UE8M0 (``float8_e8m0fnu``/``uint8``) or float32 ``scale_inv``.
    """
    codes, scale, (b0, b1) = _fp8_operands(codes, scale, block)
    call = jax.ffi.ffi_call(
        FP8_TARGET, jax.ShapeDtypeStruct(codes.shape, jnp.float32), vmap_method="broadcast_all"
    )
    return call(codes, scale, block_rows=np.int64(b0), block_cols=np.int64(b1))


def _mxfp4_operands(packed: Any, scale: Any) -> tuple[jax.Array, jax.Array]:
    packed = as_uint8(jnp.asarray(packed), "packed")
    scale = as_uint8(jnp.asarray(scale), "scale")
    if packed.ndim < 2:
        raise ValueError(f"packed must have shape [..., rows, cols/2], got shape {packed.shape}")
    cols = packed.shape[-1] * 2
    expected = (*packed.shape[:-1], cols // 32)
    if cols % 32 or scale.shape != expected:
        raise ValueError(
            f"scale must have shape {expected} for packed of shape {packed.shape} (cols = {cols}, a multiple "
            f"of 32), got {scale.shape}"
        )
    return packed, scale


def mxfp4_dequantize(packed: Any, scale: Any) -> jax.Array:
    """Float32 values of an MXFP4 tensor (``packed [..., R, C/2]``, ``scale [..., R, C/32]``) through the native
    handler (call :func:`load` first)."""
    packed, scale = _mxfp4_operands(packed, scale)
    out = jax.ShapeDtypeStruct((*packed.shape[:-1], packed.shape[-1] * 2), jnp.float32)
    return jax.ffi.ffi_call(MXFP4_TARGET, out, vmap_method="broadcast_all")(packed, scale)


_host_fp8 = jax.jit(fp8_block_dequantize, static_argnames="block")
_host_mxfp4 = jax.jit(mxfp4_dequantize)


def _native_ready() -> bool:
    try:
        load()
    except (FileNotFoundError, RuntimeError, OSError) as e:
        logging.log_first_n(logging.WARNING, "native dequantiser unavailable, using numpy: %s", 1, e)
        return False
    return True


def host_fp8_block_dequantize(
    q: np.ndarray, scale: np.ndarray, block: tuple[int, int] = (32, 32)
) -> np.ndarray:
    """:func:`deepinfer_jax.numerics.host.dequantize_fp8_blockwise` with the native handler when it can be
    built, run on the host CPU device; same result, bit for bit."""
    block = _check_block(block)
    if not _native_ready():
        return host.dequantize_fp8_blockwise(q, scale, block)
    with jax.default_device(jax.devices("cpu")[0]):
        return np.asarray(_host_fp8(np.asarray(q), np.asarray(scale), block=block))


def host_mxfp4_dequantize(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """:func:`deepinfer_jax.numerics.host.dequantize_mxfp4` with the native handler when it can be built."""
    if not _native_ready():
        return host.dequantize_mxfp4(packed, scale)
    with jax.default_device(jax.devices("cpu")[0]):
        return np.asarray(_host_mxfp4(np.asarray(packed), np.asarray(scale)))
