"""Sorted-dispatch routed experts: op ``"moe_grouped_experts"``, and kernel implementations of ``"moe_experts"``.

The reference ``moe_experts`` (``models/common/moe.py``) loops over experts and runs each expert's GEMM over all
rows, keeping its own: simple and memory-frugal on the CPU, but ``E`` GEMMs over every row. Accelerators want
the layout of the grouped kernels instead:

1. flatten each token's ``k`` picks to ``T·k`` rows and sort them by expert (stable, so the result does not
   depend on anything but the routing; ids outside ``[0, E)`` sort last and form no group);
2. ``a = swiglu([x·W1ᵀ | x·W3ᵀ])`` per expert group: ``mxfp4_grouped_swiglu``, one fused kernel;
3. the routing weight multiplies ``a`` (V4's reference, ``weight_before_down=True``) or the output (V3);
4. ``y = a·W2ᵀ`` per expert group: ``mxfp4_grouped_linear``;
5. un-sort with the inverse permutation and sum each token's ``k`` rows in pick order, in float32.

Step 5 sums in the same order as the reference, and every row sees exactly the reference's arithmetic (the
activation cast is per row, so duplicating a token's row ``k`` times changes nothing), so the result equals the
reference up to GEMM summation order. MXFP4 experts (V4/V4.1) go through the grouped ops, which the backend's
kernels implement; FP8 experts (V3) and unquantised experts use grouped reference GEMMs over the same sorted rows.

The function has the signature of ``moe_experts`` (``x, routing, experts, numerics, *, swiglu_limit,
weight_before_down, out_dtype``), reading ``routing`` as an ``(ids, weights)`` pair and ``numerics`` by its
``block`` / ``activation_cast`` / ``activation_block`` attributes, so this module needs nothing from
``models``. :func:`register_moe_experts_backends` registers the ``pallas_gpu`` and ``ascend`` versions as
implementations of ``moe_experts`` once that op exists (the op is defined above ``ops``, in the models layer,
so its definition site calls this function; importing ``deepinfer_jax.ops`` alone cannot see it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax.numerics import qlinear
from deepinfer_jax.ops.registry import (
    REFERENCE,
    OpRegistry,
    active_policy,
    default_registry,
    register_impl,
    register_op,
)

__all__ = [
    "ExpertLayoutImpl",
    "expert_layout_impl",
    "moe_grouped_experts",
    "moe_grouped_experts_ascend",
    "moe_grouped_experts_pallas",
    "register_expert_layout",
    "register_moe_experts_backends",
    "sort_by_expert",
]

_ROUTED_OP = "moe_experts"
_BACKENDS: dict[str, tuple[str, ...]] = {"pallas_gpu": ("gpu",), "ascend": ("ascend",)}


def sort_by_expert(ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sort flattened picks by expert: ``(order, inverse, group_sizes)``.

    ``order [R]`` lists the flat pick indices grouped by expert (stable; out-of-range ids last), ``inverse``
    undoes it, ``group_sizes int32 [E]`` counts the valid picks per expert.
    """
    flat = ids.reshape(-1).astype(jnp.int32)
    key = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    sizes = jnp.zeros((num_experts,), jnp.int32).at[key].add(1, mode="drop")
    return order, inverse, sizes


def _format(p: Mapping[str, Any]) -> str:
    keys = set(p)
    if keys == {"packed", "scale"}:
        return "mxfp4"
    if keys == {"weight", "scale"}:
        return "fp8"
    if keys == {"weight"}:
        return "dense"
    raise ValueError(
        f"moe_grouped_experts: expert weight keys {sorted(keys)} match no format; expected "
        "{'packed', 'scale'} (MXFP4), {'weight', 'scale'} (FP8) or {'weight'}"
    )


def _numerics(numerics: Any) -> tuple[tuple[int, int] | None, str, int]:
    try:
        return numerics.block, numerics.activation_cast, numerics.activation_block
    except AttributeError as e:
        raise TypeError(
            "moe_grouped_experts: numerics must have block, activation_cast and activation_block attributes "
            f"(a LinearNumerics), got {type(numerics).__name__}"
        ) from e


def _grouped_dense(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """Unquantised grouped GEMM over sorted rows: a loop over experts, each keeping its own row range."""
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    rows = jnp.arange(x.shape[0], dtype=jnp.int32)[:, None]

    def body(e, y):
        mine = (rows >= starts[e]) & (rows < ends[e])

        def run(y):
            we = lax.dynamic_index_in_dim(w, e, axis=0, keepdims=False)
            part = lax.dot_general(
                x,
                we.astype(x.dtype),
                (((1,), (1,)), ((), ())),
                precision=lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32,
            )
            return jnp.where(mine, part, y)

        return lax.cond(sizes[e] > 0, run, lambda y: y, y)

    return lax.fori_loop(0, w.shape[0], body, jnp.zeros((x.shape[0], w.shape[1]), jnp.float32))


ExpertLayoutImpl = Callable[..., jax.Array]
"""An implementation of op ``moe_experts`` for one container type of expert weights (same signature as the op)."""

_EXPERT_LAYOUTS: dict[type, ExpertLayoutImpl] = {}


def register_expert_layout(layout: type, impl: ExpertLayoutImpl) -> None:
    """Make every implementation of op ``moe_experts`` hand experts of container type ``layout`` to ``impl``.

    Model code passes ``p["experts"]`` to the op without looking inside. A layer whose routed experts were laid
    out in another way (e.g. :class:`deepinfer_jax.parallel.SlotExperts`: physical slots sharded over an
    expert-parallel mesh, plus the slot placement) arrives as a container of its own type, and whichever backend
    the registry selected (reference loop, Pallas, Ascend) forwards the call, unchanged, to the implementation
    registered for that type. Layers above ``ops`` (``parallel``) register their layouts at import, so the
    dependency direction is kept. Registering a type twice replaces its implementation (module reloads).
    """
    if not isinstance(layout, type):
        raise TypeError(f"register_expert_layout: layout must be a class, got {type(layout).__name__}")
    if not callable(impl):
        raise TypeError(f"register_expert_layout: impl must be callable, got {type(impl).__name__}")
    _EXPERT_LAYOUTS[layout] = impl


def expert_layout_impl(experts: Any) -> ExpertLayoutImpl | None:
    """The registered implementation for the container type of ``experts`` (``None``: plain weight dicts)."""
    return _EXPERT_LAYOUTS.get(type(experts))


def _select(
    name: str, backend: str, platform: str | None, registry: OpRegistry, interpret: bool = False
) -> Callable[..., Any]:
    if interpret and backend == "pallas_gpu":  # Pallas interpret mode runs the GPU kernels anywhere
        return functools.partial(
            registry.select(name, backend=backend, platform="gpu", strict=True).fn, interpret=True
        )
    if platform is None:
        # The platform the active op selection chose for (a CPU host exporting a step for CUDA selects for
        # "gpu"), else jax.default_backend().
        platform = getattr(active_policy(), "platform", None)
    return registry.select(name, backend=backend, platform=platform).fn


def moe_grouped_experts(
    x: jax.Array,
    routing: Any,
    experts: Mapping[str, Mapping[str, jax.Array]],
    numerics: Any,
    *,
    swiglu_limit: float | None = None,
    weight_before_down: bool = False,
    out_dtype: Any = None,
    backend: str = REFERENCE,
    platform: str | None = None,
    registry: OpRegistry | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Routed-expert output ``Σ_k w[t,k] · FFN_{ids[t,k]}(x[t])`` by sorted dispatch (module docstring).

    ``backend`` / ``platform`` choose the implementations of the grouped ops it calls (the reference by
    default); the registered kernel versions of this op fix them. ``interpret`` runs ``pallas_gpu`` kernels with
    the Pallas interpreter (any platform).
    """
    reg = registry or default_registry
    if x.ndim != 2:
        raise ValueError(f"moe_grouped_experts: x must be [tokens, hidden], got shape {x.shape}")
    missing = {"gate", "up", "down"} - set(experts)
    if missing:
        raise ValueError(
            f"moe_grouped_experts: expert weights lack {sorted(missing)}; got keys {sorted(experts)}"
        )
    ids, weights = routing
    if ids.ndim != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
        raise ValueError(
            f"moe_grouped_experts: routing ids {ids.shape} / weights {weights.shape} must be [{x.shape[0]}, k]"
        )
    block, cast, cast_block = _numerics(numerics)
    fmts = {name: _format(experts[name]) for name in ("gate", "up", "down")}
    if len(set(fmts.values())) != 1:
        raise ValueError(f"moe_grouped_experts: gate/up/down weights mix formats {fmts}")
    fmt = fmts["gate"]
    gate, up, down = experts["gate"], experts["up"], experts["down"]
    num_experts = (gate["packed"] if fmt == "mxfp4" else gate["weight"]).shape[0]
    num_tokens, top_k = ids.shape

    order, inverse, sizes = sort_by_expert(ids, num_experts)
    rows = jnp.take(x, order // top_k, axis=0)
    w_sorted = jnp.take(weights.reshape(-1).astype(jnp.float32), order)[:, None]

    if fmt == "mxfp4":
        if cast not in ("none", "mxfp8"):
            raise ValueError(
                f"moe_grouped_experts: MXFP4 experts take activation_cast 'none' or 'mxfp8', got {cast!r}"
            )
        fused = _select("mxfp4_grouped_swiglu", backend, platform, reg, interpret)
        a = fused(
            rows,
            gate["packed"],
            gate["scale"],
            up["packed"],
            up["scale"],
            sizes,
            limit=swiglu_limit,
            activation_cast=cast,
            out_dtype=jnp.float32,
        )
    else:
        g, u = (_first_gemm(rows, p, sizes, fmt, block, cast, cast_block) for p in (gate, up))
        act = _select("swiglu", backend, platform, reg, interpret)
        a = act(jnp.concatenate([g, u], axis=-1), limit=swiglu_limit, out_dtype=jnp.float32)
    if weight_before_down:
        a = a * w_sorted
    a = a.astype(x.dtype)
    if fmt == "mxfp4":
        grouped = _select("mxfp4_grouped_linear", backend, platform, reg, interpret)
        y = grouped(a, down["packed"], down["scale"], sizes, activation_cast=cast, out_dtype=jnp.float32)
    else:
        y = _first_gemm(a, down, sizes, fmt, block, cast, cast_block)
    if not weight_before_down:
        y = y * w_sorted
    y = jnp.take(y, inverse, axis=0).reshape(num_tokens, top_k, -1).sum(axis=1)
    return y.astype(out_dtype or x.dtype)


def _first_gemm(rows, p, sizes, fmt, block, cast, cast_block) -> jax.Array:
    """A grouped reference GEMM for the non-MXFP4 expert formats (float32 result)."""
    if fmt == "dense":
        return _grouped_dense(rows, p["weight"], sizes)
    if block is None:
        raise ValueError(
            "moe_grouped_experts: FP8 experts need numerics.block (the checkpoint's weight block)"
        )
    return qlinear.grouped_fp8_linear(
        rows,
        p["weight"],
        p["scale"],
        group_sizes=sizes,
        block=block,
        activation_cast=cast,
        activation_block=cast_block,
        out_dtype=jnp.float32,
    )


def moe_grouped_experts_pallas(
    x: jax.Array,
    routing: Any,
    experts: Mapping[str, Mapping[str, jax.Array]],
    numerics: Any,
    *,
    interpret: bool = False,
    **kwargs: Any,
) -> jax.Array:
    """:func:`moe_grouped_experts` over the ``pallas_gpu`` grouped kernels (selected on the current platform, or
    run by the Pallas interpreter with ``interpret=True``)."""
    layout_impl = expert_layout_impl(experts)
    if layout_impl is not None:
        return layout_impl(x, routing, experts, numerics, **kwargs)
    return moe_grouped_experts(
        x, routing, experts, numerics, backend="pallas_gpu", interpret=interpret, **kwargs
    )


def moe_grouped_experts_ascend(
    x: jax.Array, routing: Any, experts: Mapping[str, Mapping[str, jax.Array]], numerics: Any, **kwargs: Any
) -> jax.Array:
    """:func:`moe_grouped_experts` over the ``ascend`` lowerings (selected for the ``ascend`` platform)."""
    layout_impl = expert_layout_impl(experts)
    if layout_impl is not None:
        return layout_impl(x, routing, experts, numerics, **kwargs)
    return moe_grouped_experts(x, routing, experts, numerics, backend="ascend", platform="ascend", **kwargs)


_TARGETS = {
    "pallas_gpu": "deepinfer_jax.ops.moe_kernels:moe_grouped_experts_pallas",
    "ascend": "deepinfer_jax.ops.moe_kernels:moe_grouped_experts_ascend",
}


def register_moe_experts_backends(registry: OpRegistry | None = None) -> list[str]:
    """Register the ``pallas_gpu`` and ``ascend`` sorted-dispatch versions as implementations of ``moe_experts``.

    Idempotent; returns the backends it added. Does nothing (returns ``[]``) while ``moe_experts`` is not
    registered, so it is safe to call from anywhere, and is meant to be called right after the op's
    ``register_op``.
    """
    reg = registry or default_registry
    if _ROUTED_OP not in reg.list_ops():
        return []
    added = []
    for backend, platforms in _BACKENDS.items():
        if backend in reg.backends_for(_ROUTED_OP):
            continue
        reg.register_impl(
            _ROUTED_OP,
            backend,
            _TARGETS[backend],
            platforms=platforms,
            reason=f"sorted-dispatch experts over the {backend} grouped kernels",
        )
        added.append(backend)
    return added


register_op(
    "moe_grouped_experts",
    moe_grouped_experts,
    doc="routed experts by sorted dispatch: sort rows by expert, grouped SwiGLU GEMM, grouped GEMM, unsort (§8.2)",
)
for _backend, _platforms in _BACKENDS.items():
    register_impl(
        "moe_grouped_experts",
        _backend,
        _TARGETS[_backend],
        platforms=_platforms,
        reason=f"sorted-dispatch experts over the {_backend} grouped kernels",
    )
register_moe_experts_backends()
