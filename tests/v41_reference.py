"""Float64 NumPy pieces of the DeepSeek-V4.1 re-derivations (tests/models/deepseek_v41), written from spec/model.md.

Shared by the backbone's re-derivation (``test_v41_model.py``) and the DSpark drafter's (``test_v41_dspark.py``):
weight decoding from the checkpoint tensors ``t`` (a name -> array mapping) and the mHC mixing of §6.3.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "FP4_LUT",
    "decode_fp8",
    "decode_mxfp4",
    "f64",
    "fp4",
    "fp8",
    "hc_mix",
    "scale_values",
    "sigmoid",
]

FP4_LUT = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)
"""E2M1 code -> value (§12.1.2)."""

_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def scale_values(s: Any) -> np.ndarray:
    """UE8M0 scale bytes -> ``2 ** (byte - 127)``."""
    return np.exp2(np.asarray(s).view(np.uint8).astype(np.float64) - 127)


def decode_fp8(codes: Any, scale: Any, block: tuple[int, int] = (32, 32)) -> np.ndarray:
    """An FP8 weight (E4M3 codes, any 1-byte view) times its UE8M0 block scales (§12.1.1 / §12.1.3)."""
    values = np.asarray(codes).view(_E4M3).astype(np.float64)
    sc = np.repeat(np.repeat(scale_values(scale), block[0], axis=0), block[1], axis=1)
    return values * sc[: values.shape[0], : values.shape[1]]


def decode_mxfp4(packed: Any, scale: Any) -> np.ndarray:
    """An MXFP4 matrix: element 2i in the low nibble, one UE8M0 scale per 32 inputs (§12.1.2)."""
    packed = np.asarray(packed).view(np.uint8)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    return FP4_LUT[codes] * np.repeat(scale_values(scale), 32, axis=1)


def fp8(t: Any, name: str, block: tuple[int, int] = (32, 32)) -> np.ndarray:
    """The checkpoint's FP8 weight ``name`` (``.weight`` and ``.scale``), dequantised."""
    return decode_fp8(t[f"{name}.weight"], t[f"{name}.scale"], block)


def fp4(t: Any, name: str) -> np.ndarray:
    """The checkpoint's MXFP4 matrix ``name`` (``.weight`` and ``.scale``), dequantised."""
    return decode_mxfp4(t[f"{name}.weight"], t[f"{name}.scale"])


def f64(t: Any, name: str) -> np.ndarray:
    return np.asarray(t[name]).astype(np.float64)


def sigmoid(x: Any) -> Any:
    return 1 / (1 + np.exp(-x))


def hc_mix(R: np.ndarray, t: Any, prefix: str, cfg: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """pre, post, comb of one sub-layer for one token's streams ``R [m, H]`` (§6.3)."""
    m = cfg.hc_mult
    flat = R.reshape(-1)
    mu = (f64(t, f"{prefix}_fn") @ flat) / np.sqrt(np.mean(flat * flat) + cfg.rms_norm_eps)
    base, scale = f64(t, f"{prefix}_base"), f64(t, f"{prefix}_scale")
    pre = sigmoid(mu[:m] * scale[0] + base[:m]) + cfg.hc_eps
    post = 2 * sigmoid(mu[m : 2 * m] * scale[1] + base[m : 2 * m])
    x = (mu[2 * m :] * scale[2] + base[2 * m :]).reshape(m, m)
    x = np.exp(x - x.max(axis=1, keepdims=True))
    x = x / x.sum(axis=1, keepdims=True) + cfg.hc_eps
    x = x / (x.sum(axis=0, keepdims=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        x = x / (x.sum(axis=1, keepdims=True) + cfg.hc_eps)
        x = x / (x.sum(axis=0, keepdims=True) + cfg.hc_eps)
    return pre, post, x
