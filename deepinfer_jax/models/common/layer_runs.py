"""Scanned layers: runs of decoder layers that share one structure, stacked and run with ``lax.scan``.

A model's ``params["layers"]`` is a list with one parameter tree per layer. XLA compiles every layer of an
unrolled forward separately, so the compile time of a step grows with the depth of the model (DeepSeek-V3 has 58
MoE layers of one structure). :func:`stack_layers` turns each run of at least ``min_run`` consecutive layers whose
trees have the same structure, shapes and dtypes into one :class:`LayerStack` (every leaf stacked along a new
leading axis); :func:`run_layers` runs a list of such segments, a ``lax.scan`` over each stack and a plain call for
each single layer, so a stack costs one layer's compilation however many layers it holds.

Inside a stack the layer index is a traced ``int32`` scalar (the body indexes caches with it: ``cache[layer]``
becomes a dynamic slice); outside it stays a Python int, as in the unrolled forward. The same functions run in the
same order on the same values, but XLA fuses a scan body and unrolled layers differently: float32 results differ by
reassociation only (the scanned V3 engine gives the unrolled engine's tokens, ``tests/engine/test_engine_scan.py``),
bfloat16 ones more, through XLA's excess-precision simplification (docs/engine.md, "Scanned layers").

While a training tap is collecting (:mod:`.taps`) a stack is run unrolled, layer by layer, because a tap's values
must not leave the trace of the scan body.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from deepinfer_jax.models.common import taps

__all__ = [
    "LayerStack",
    "has_stacks",
    "iter_layers",
    "run_layers",
    "stack_layers",
    "unstack_layers",
]


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """Layers ``start .. start + count - 1`` of a model, their parameter trees stacked along a leading axis."""

    params: Any
    start: int
    count: int

    def layer(self, j: int) -> Any:
        """The parameter tree of the stack's ``j``-th layer (a slice of every leaf)."""
        return jax.tree.map(lambda a: a[j], self.params)


jax.tree_util.register_dataclass(LayerStack, data_fields=["params"], meta_fields=["start", "count"])

Segment = Any  # one layer's parameter tree, or a LayerStack


def _signature(tree: Any) -> tuple[Any, ...]:
    leaves, treedef = jax.tree.flatten(tree)
    return (treedef, tuple((tuple(leaf.shape), jnp.dtype(leaf.dtype)) for leaf in leaves))


def _stack_leaf(*leaves: jax.Array) -> jax.Array:
    out = jnp.stack(leaves)
    if isinstance(leaves[0], jax.core.Tracer):  # under a trace (jax.eval_shape of a layout): no placement
        return out
    sharding = getattr(leaves[0], "sharding", None)
    if isinstance(sharding, NamedSharding):  # keep a mesh layout: the new leading axis is not sharded
        out = jax.device_put(out, NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec)))
    return out


def stack_layers(layers: Sequence[Any], *, min_run: int) -> list[Segment]:
    """``layers`` with each run of at least ``min_run`` consecutive same-structure layers as one
    :class:`LayerStack` (``min_run = 0``: none; otherwise ``min_run >= 2``). ``layers`` may already hold stacks;
    they are kept. The stacked leaves are new arrays (on the devices, and with the mesh layout, of the layers')."""
    if isinstance(min_run, bool) or not isinstance(min_run, int) or min_run < 0 or min_run == 1:
        raise ValueError(f"stack_layers: min_run = {min_run!r}; use 0 (no stacks) or an int >= 2")
    flat = unstack_layers(layers) if has_stacks(layers) else list(layers)
    if min_run == 0:
        return flat
    sigs = [_signature(tree) for tree in flat]
    out: list[Segment] = []
    i = 0
    while i < len(flat):
        j = i + 1
        while j < len(flat) and sigs[j] == sigs[i]:
            j += 1
        if j - i >= min_run:
            out.append(LayerStack(jax.tree.map(_stack_leaf, *flat[i:j]), i, j - i))
        else:
            out.extend(flat[i:j])
        i = j
    return out


def has_stacks(layers: Sequence[Segment]) -> bool:
    """Whether ``layers`` holds a :class:`LayerStack`."""
    return any(isinstance(seg, LayerStack) for seg in layers)


def iter_layers(layers: Sequence[Segment]) -> Iterator[tuple[int, Any]]:
    """``(index, parameter tree)`` of every layer in order; a stack's layers are slices of its leaves."""
    i = 0
    for seg in layers:
        if isinstance(seg, LayerStack):
            for j in range(seg.count):
                yield seg.start + j, seg.layer(j)
            i = seg.start + seg.count
        else:
            yield i, seg
            i += 1


def unstack_layers(layers: Sequence[Segment]) -> list[Any]:
    """One parameter tree per layer (the layout :func:`stack_layers` started from)."""
    return [tree for _, tree in iter_layers(layers)]


def run_layers(layers: Sequence[Segment], body: Callable[[Any, Any, Any], Any], carry: Any) -> Any:
    """Thread ``carry`` through every layer: ``carry = body(carry, layer_params, index)`` in layer order.

    A single layer's ``index`` is a Python int; inside a :class:`LayerStack` the layers run as one
    ``lax.scan`` whose ``index`` is a traced ``int32`` scalar, so ``body`` must accept either (index caches with
    it, never branch on it in Python). While :func:`~.taps.collect` is active stacks run unrolled.
    """
    unrolled = taps.collecting()
    i = 0
    for seg in layers:
        if not isinstance(seg, LayerStack):
            carry = body(carry, seg, i)
            i += 1
            continue
        if seg.start != i:
            raise ValueError(f"run_layers: a stack starts at layer {seg.start}, expected layer {i}")
        if unrolled:
            for j in range(seg.count):
                carry = body(carry, seg.layer(j), seg.start + j)
        else:
            index = jnp.arange(seg.start, seg.start + seg.count, dtype=jnp.int32)

            def step(c: Any, xs: tuple[Any, jax.Array]) -> tuple[Any, None]:
                return body(c, xs[0], xs[1]), None

            carry, _ = jax.lax.scan(step, carry, (seg.params, index))
        i += seg.count
    return carry
