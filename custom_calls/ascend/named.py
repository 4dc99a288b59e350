"""Any op as one named Ascend custom call: ``deepinfer.ascend.<op>`` on ``"ascend"``, its reference elsewhere.

:mod:`custom_calls.ascend.lowerings` writes one primitive per weight-side op by hand. The attention-side ops have
many more arguments (optional arrays, formats, tile-free static settings), so this module builds the primitive
from the op's **reference function**, which the op's definition site passes in (``custom_calls`` imports nothing
above ``numerics``):

* the arguments are bound to the reference's signature; array arguments become the custom call's operands, in
  signature order (``None`` arrays are left out), every other argument becomes a typed-FFI attribute named after
  its parameter: ints, floats, bools and strings as they are, ``None`` as the string ``"none"``, dtypes by name;
* the results are the reference's (one array or a tuple), shapes from ``jax.eval_shape`` of the reference;
* on every platform but ``"ascend"`` the primitive lowers to the reference itself, so the same program runs on a
  CPU and a multi-platform export carries both.

The attributes each target receives are therefore exactly the op's documented keyword arguments (docs/backends.md
lists them per target). Nothing here executes on Ascend hardware: the exported StableHLO is the hand-off format.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import mlir

from custom_calls.ascend.lowerings import target_name
from custom_calls.ascend.platform import PLATFORM, register_ascend_platform

__all__ = ["NAMED_OPS", "call", "targets"]

#: The ops :func:`call` has built a primitive for (op name -> target), filled as they are first used.
NAMED_OPS: dict[str, str] = {}

_lock = threading.Lock()
_prims: dict[str, Primitive] = {}

register_ascend_platform()


def _is_array(v: Any) -> bool:
    return isinstance(v, jax.Array | np.ndarray) or hasattr(v, "__jax_array__")


def _attribute(v: Any) -> Any:
    if v is None:
        return "none"
    if isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, np.dtype) or (isinstance(v, type) and issubclass(v, np.generic)):
        return np.dtype(v).name
    try:
        return np.dtype(v).name  # jnp.bfloat16 and friends
    except TypeError:
        raise TypeError(f"cannot pass {type(v).__name__} {v!r} as an Ascend custom-call attribute") from None


def _primitive(op: str) -> Primitive:
    with _lock:
        prim = _prims.get(op)
        if prim is not None:
            return prim
        prim = Primitive(f"deepinfer_ascend_named_{op}")
        prim.multiple_results = True
        prim.def_impl(lambda *a, **p: dispatch.apply_primitive(prim, *a, **p))
        prim.def_abstract_eval(lambda *_, out_avals, **__: out_avals)

        def reference_lowering(
            ctx: Any, *operands: Any, reference: Any, layout: Any, statics: Any, **_: Any
        ) -> Any:
            def run(*arrays: Any) -> list[Any]:
                out = reference(**_rebuild(arrays, layout, statics))
                return list(jax.tree.leaves(out))

            return mlir.lower_fun(run, multiple_results=True)(ctx, *operands)

        def ascend_lowering(ctx: Any, *operands: Any, statics: Any, **_: Any) -> Any:
            attrs = {name: _attribute(v) for name, v in statics}
            return jax.ffi.ffi_lowering(target_name(op))(ctx, *operands, **attrs)

        mlir.register_lowering(prim, reference_lowering)
        mlir.register_lowering(prim, ascend_lowering, platform=PLATFORM)
        _prims[op] = prim
        NAMED_OPS[op] = target_name(op)
        return prim


def _rebuild(arrays: Any, layout: tuple[tuple[str, bool], ...], statics: tuple[tuple[str, Any], ...]) -> dict:
    """Keyword arguments of the reference from the operands and the static attributes."""
    kwargs: dict[str, Any] = dict(statics)
    it = iter(arrays)
    for name, present in layout:
        kwargs[name] = next(it) if present else None
    return kwargs


def call(op: str, reference: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``reference(*args, **kwargs)`` as the named custom call ``deepinfer.ascend.<op>`` (module docstring)."""
    bound = inspect.signature(reference).bind(*args, **kwargs)
    bound.apply_defaults()
    layout, arrays, statics = [], [], []
    for name, value in bound.arguments.items():
        if _is_array(value):
            layout.append((name, True))
            arrays.append(jax.numpy.asarray(value))
        elif value is None and name in _array_params(reference):
            layout.append((name, False))
        else:
            statics.append((name, value))
    for _, value in statics:
        _attribute(value)  # refuse unsupported attributes at the call, not at lowering
    out_shape = jax.eval_shape(lambda *a: reference(**_rebuild(a, tuple(layout), tuple(statics))), *arrays)
    leaves, tree = jax.tree.flatten(out_shape)
    avals = tuple(jax.core.ShapedArray(s.shape, s.dtype) for s in leaves)
    out = _primitive(op).bind(
        *arrays, reference=reference, layout=tuple(layout), statics=tuple(statics), out_avals=avals
    )
    return jax.tree.unflatten(tree, out)


def _array_params(reference: Callable[..., Any]) -> set[str]:
    """Parameters that take arrays (positional ones): ``None`` there means "absent array", not an attribute."""
    return {
        p.name
        for p in inspect.signature(reference).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    }


def targets(ops: Any) -> tuple[str, ...]:
    """The custom-call targets of ``ops`` (names)."""
    return tuple(target_name(op) for op in ops)
