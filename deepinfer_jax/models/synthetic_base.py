"""What every synthetic (random-weight) checkpoint writer shares: one named stream per tensor, stored once.

The family writers (`deepseek_v3/synthetic.py`, `deepseek_v4/synthetic.py`) subclass :class:`TensorEmitter` and
add the storage formats of their checkpoint contracts. Values are drawn with NumPy only, so the bytes of a
built-in model do not depend on the JAX version.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np

RngFactory = Callable[[str], np.random.Generator]
BF16 = np.dtype(ml_dtypes.bfloat16)


class TensorEmitter:
    """Collects named tensors; each name is drawn from its own random stream and may be written only once."""

    def __init__(self, rng_factory: RngFactory) -> None:
        self._rngs = rng_factory
        self.tensors: dict[str, np.ndarray] = {}

    def _put(self, name: str, array: np.ndarray) -> None:
        if name in self.tensors:
            raise ValueError(
                f"tensor {name!r} would be written twice; the layer plan of the config is inconsistent"
            )
        self.tensors[name] = np.ascontiguousarray(array)

    def _normal(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return self._rngs(name).standard_normal(shape, dtype=np.float32)

    def _gaussian_bf16(self, name: str, out_dim: int, in_dim: int) -> np.ndarray:
        """A Gaussian ``[out, in]`` weight scaled by ``in^-1/2`` (model.md §15.4), rounded to BF16.

        The BF16 rounding comes first, so a quantised variant of a checkpoint quantises exactly the values its
        unquantised variant stores.
        """
        return (self._normal(name, (out_dim, in_dim)) * np.float32(in_dim**-0.5)).astype(BF16)
