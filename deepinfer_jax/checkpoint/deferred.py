"""Deferred reads of routed-expert tensors: a process reads only the experts its devices hold.

On a mesh the routed experts are the bulk of a DeepSeek checkpoint (for V4.1-Flash, all but a few percent of the
bytes), and each device holds only ``P / ep`` expert slots. Reading every expert on every process, and assembling
the ``[E, ...]`` stacks in memory before laying them out, would make every host read and hold the whole model.
With deferral:

* :func:`~deepinfer_jax.checkpoint.loader.load_tensors` ``(defer=...)`` checks every tensor against the
  checkpoint's headers as usual but returns a :class:`DeferredTensor` for the deferred names: shape and dtype
  known, bytes not read;
* the model families stack their experts through :func:`stack_experts`. Under :func:`deferring` (which
  :func:`~deepinfer_jax.checkpoint.model_loading.load_model` sets while it assembles) that returns an
  :class:`ExpertStack` per leaf instead of an array: expert ``e``'s leaf is built, through the family's own
  per-expert conversion, only when a caller asks for row ``e``;
* :func:`~deepinfer_jax.parallel.shard_model_params` gathers each device's slots from the stacks with
  :meth:`ExpertStack.rows`, in ``jax.make_array_from_callback``, which asks only for the shards of this process's
  devices.

So a process reads the non-expert tensors and the experts of its own slots, once per slot that holds them, and
never holds a whole ``[E, ...]`` stack. Outside :func:`deferring`, :func:`stack_experts` stacks eagerly.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "EXPERT_TENSOR",
    "DeferredSource",
    "DeferredTensor",
    "ExpertStack",
    "deferring",
    "is_expert_tensor",
    "stack_experts",
]

EXPERT_TENSOR = ".experts."
"""What a routed-expert tensor's name contains, followed by the expert index (``layers.3.ffn.experts.17.w1...``)."""


def is_expert_tensor(name: str) -> bool:
    """Whether ``name`` is one routed expert's tensor (``...experts.<index>.``); shared experts are not."""
    at = name.find(EXPERT_TENSOR)
    while at >= 0:
        rest = name[at + len(EXPERT_TENSOR) :]
        index = rest.split(".", 1)[0]
        if index.isdigit() and "." in rest:
            return True
        at = name.find(EXPERT_TENSOR, at + 1)
    return False


class DeferredSource:
    """An open checkpoint reader shared by deferred tensors; reads go through it one at a time.

    The reader stays open while any :class:`DeferredTensor` of it is alive (it is closed when this object is
    collected).
    """

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self._lock = threading.Lock()
        weakref.finalize(self, reader.close)

    def read(self, stored: str) -> np.ndarray:
        with self._lock:
            return self.reader.read(stored)


class _Shaped:
    """What an array-like that is not read yet reports: ``ndim``, ``size``, ``nbytes`` from ``shape``, ``dtype``."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


class DeferredTensor(_Shaped):
    """A checkpoint tensor whose bytes are read when it is converted to an array (``np.asarray``, ``jnp.asarray``).

    ``shape`` and ``dtype`` come from the checkpoint's header (after ``view_as``); ``finish`` applies what
    :func:`~deepinfer_jax.checkpoint.loader.load_tensors` applies to a tensor it reads (view, narrowing).
    Every conversion reads again: nothing is cached, so holding one costs nothing.
    """

    def __init__(
        self,
        source: DeferredSource,
        stored: str,
        name: str,
        shape: Sequence[int],
        dtype: Any,
        finish: Callable[[str, np.ndarray], np.ndarray],
    ) -> None:
        self.source = source
        self.stored = stored
        self.name = name
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self._finish = finish

    def read(self) -> np.ndarray:
        """The tensor's data, read now."""
        return self._finish(self.name, self.source.read(self.stored))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.read()
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"DeferredTensor({self.name!r}, shape={self.shape}, dtype={self.dtype.name})"


@dataclasses.dataclass(frozen=True)
class _Deferral:
    device: jax.Device | None


_DEFERRAL: contextvars.ContextVar[_Deferral | None] = contextvars.ContextVar("expert_deferral", default=None)


@contextlib.contextmanager
def deferring(device: jax.Device | None = None) -> Iterator[None]:
    """Within this block :func:`stack_experts` returns :class:`ExpertStack` leaves; their rows are built later on
    ``device`` (``None``: the default device of the caller then)."""
    token = _DEFERRAL.set(_Deferral(device))
    try:
        yield
    finally:
        _DEFERRAL.reset(token)


class _ExpertRows:
    """The per-expert builds shared by the leaves of one :func:`stack_experts` call.

    The family's conversion builds every leaf of an expert at once (an FP8 weight with its scale). A build asked
    for one leaf keeps the others until they are asked for, so reading every leaf of a stack in turn (as the
    layout does, slot by slot) reads each expert's tensors once per slot holding it, not once per leaf.
    """

    def __init__(self, one: Callable[[int], Mapping[str, Any]], device: jax.Device | None) -> None:
        self._one = one
        self._device = device
        self._kept: dict[tuple[int, str], list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def get(self, expert: int, key: str) -> np.ndarray:
        with self._lock:
            kept = self._kept.get((expert, key))
            if kept:
                out = kept.pop()
                if not kept:
                    del self._kept[(expert, key)]
                return out
            ctx = jax.default_device(self._device) if self._device is not None else contextlib.nullcontext()
            with ctx:
                built = {k: np.asarray(v) for k, v in self._one(expert).items()}
            for k, v in built.items():
                if k != key:  # one kept copy per build: an expert in two slots is asked for twice per leaf
                    self._kept.setdefault((expert, k), []).append(v)
            return built[key]


class ExpertStack(_Shaped):
    """One leaf of a routed-expert stack ``[E, ...]`` whose rows are built on demand (module docstring).

    Attributes:
      shape, dtype: the stack's, as the eager stack would have them (from expert 0, built at creation).
    """

    def __init__(self, count: int, key: str, rows: _ExpertRows, first: Any) -> None:
        self.count = int(count)
        self.key = key
        self._rows = rows
        self.shape = (self.count, *first.shape)
        self.dtype = np.dtype(first.dtype)

    def row(self, expert: int) -> np.ndarray:
        """Expert ``expert``'s leaf, built by the family's per-expert conversion (reads its tensors, unless
        building another leaf of the same expert already did)."""
        if not 0 <= expert < self.count:
            raise IndexError(f"expert {expert} is outside [0, {self.count})")
        return self._rows.get(expert, self.key)

    def rows(self, experts: Sequence[int] | np.ndarray) -> np.ndarray:
        """The leaves of ``experts`` stacked ``[len(experts), ...]`` (an expert listed twice is built twice)."""
        idx = np.asarray(experts, np.int64).reshape(-1)
        if idx.size == 0:
            return np.empty((0, *self.shape[1:]), self.dtype)
        return np.stack([self.row(int(e)) for e in idx])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.rows(np.arange(self.count))
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"ExpertStack({self.key!r}, shape={self.shape}, dtype={self.dtype.name})"


def stack_experts(count: int, one: Callable[[int], Mapping[str, Any]]) -> dict[str, Any]:
    """Per-expert leaves ``one(e)`` (``e`` in ``0 .. count-1``, each a mapping of equal keys) stacked ``[E, ...]``.

    Eager (``jnp.stack``, traceable) unless :func:`deferring` is active, which gives an :class:`ExpertStack` per
    key instead; building it reads expert 0 once, for the shapes and dtypes.
    """
    deferral = _DEFERRAL.get()
    if deferral is None:
        parts = [one(e) for e in range(count)]
        return {k: jnp.stack([p[k] for p in parts]) for k in parts[0]}
    first = one(0)
    rows = _ExpertRows(one, deferral.device)
    return {k: ExpertStack(count, k, rows, first[k]) for k in first}
