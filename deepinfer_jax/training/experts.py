"""Routed experts for training: every expert on every token, the unchosen ones weighted 0.

The inference path of op ``moe_experts`` (:func:`deepinfer_jax.models.common.moe.moe_experts`) loops over the
experts and runs each one's GEMM on all ``T·k`` (token, pick) rows, keeping the rows routed to it. Under
``jax.grad`` on a CPU that loop (a ``fori_loop`` with a ``cond`` per expert) is the most expensive part of a small
model's step. :class:`DenseExperts` computes the same function as one batched contraction per matrix:

    y[t] = Σ_e W[t, e] · down_e( SwiGLU(gate_e x[t], up_e x[t]) ),   W[t, e] = routing weight, 0 if e not chosen

which is ``Σ_k w[t,k] · FFN_{ids[t,k]}(x[t])`` with the sum over picks written as a sum over experts (a token's
picks are distinct experts). It costs ``E`` expert FFNs per token instead of the loop's ``E·k`` row GEMMs, and its
backward is plain einsums. Where the routing weight is applied (before or after the down projection) does not
matter for this linear map in float32; results differ from the loop by float32 reassociation only (tested).

The layout is registered with :func:`deepinfer_jax.models.common.moe.register_expert_layout`, the hook the op
provides for other expert containers; :func:`dense_experts` swaps it into an assembled parameter tree. Only
unquantised expert weights (a float-weight checkpoint) are accepted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.models.common.mlp import swiglu
from deepinfer_jax.models.common.moe import register_expert_layout

__all__ = ["DenseExperts", "dense_experts"]


@jax.tree_util.register_pytree_with_keys_class
class DenseExperts:
    """Unquantised routed-expert weights ``gate, up [E, I, H]``, ``down [E, H, I]`` (a pytree)."""

    def __init__(self, gate: jax.Array, up: jax.Array, down: jax.Array) -> None:
        self.gate, self.up, self.down = gate, up, down

    def tree_flatten_with_keys(self) -> tuple[tuple[tuple[Any, jax.Array], ...], None]:
        keys = jax.tree_util.GetAttrKey
        return ((keys("gate"), self.gate), (keys("up"), self.up), (keys("down"), self.down)), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: Any) -> DenseExperts:
        del aux
        return cls(*children)


def _dense_moe(
    x: jax.Array,
    routing: Any,
    experts: DenseExperts,
    numerics: Any,
    *,
    swiglu_limit: float | None = None,
    weight_before_down: bool = False,
    out_dtype: Any = None,
) -> jax.Array:
    del numerics, weight_before_down  # unquantised weights; the weight's place does not change a linear map
    ids, weights = routing
    num_experts = experts.gate.shape[0]
    onehot = jax.nn.one_hot(ids, num_experts, dtype=jnp.float32)  # [T, k, E]
    w = jnp.einsum("tk,tke->te", weights.astype(jnp.float32), onehot)
    xf = x.astype(jnp.float32)
    g = jnp.einsum("th,eih->tei", xf, experts.gate.astype(jnp.float32))
    u = jnp.einsum("th,eih->tei", xf, experts.up.astype(jnp.float32))
    a = swiglu(g, u, limit=swiglu_limit) * w[..., None]
    y = jnp.einsum("tei,ehi->th", a, experts.down.astype(jnp.float32))
    return y.astype(out_dtype or x.dtype)


register_expert_layout(DenseExperts, _dense_moe)


def dense_experts(params: Any) -> Any:
    """``params`` with every routed-expert dict ``{"gate", "up", "down"}`` of ``{"weight"}`` linears replaced by a
    :class:`DenseExperts` (V4.1's ``ffn.experts`` and V3's ``mlp.experts``, draft layers included).

    Raises:
        ValueError: an expert dict holds quantised weights (``scale`` / ``packed`` keys).
    """

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, Mapping):
            out = {}
            for key, value in node.items():
                if key == "experts" and isinstance(value, Mapping) and set(value) == {"gate", "up", "down"}:
                    parts = {}
                    for name, linear in value.items():
                        if set(linear) != {"weight"}:
                            raise ValueError(
                                f"dense_experts: {path}{key}.{name} has keys {sorted(linear)}; training needs "
                                "unquantised experts ({'weight'}) from a float-weight checkpoint"
                            )
                        parts[name] = linear["weight"]
                    out[key] = DenseExperts(parts["gate"], parts["up"], parts["down"])
                else:
                    out[key] = walk(value, f"{path}{key}.")
            return out
        if isinstance(node, list):
            return [walk(v, f"{path}{i}.") for i, v in enumerate(node)]
        return node

    return walk(params, "")
