"""DeepSeekMoE: the router (gate) with pluggable scoring, and the routed-expert compute (op ``moe_experts``).

Gate (model.md §8.1 for V4/V4.1, §16 for V3), for router logits ``z = x · gate.weightᵀ`` in float32:

1. scores ``s_e``: ``sigmoid(z_e)`` (V3) or ``sqrt(softplus(z_e))`` (V4/V4.1; softplus is the identity above
   20, as in the reference);
2. selection scores ``s_e + bias_e``: the correction bias (V3 ``e_score_correction_bias``, V4 ``gate.bias``)
   steers *which* experts are picked but never enters the weights;
3. optional group limit (V3): experts split into ``n_group`` contiguous groups, a group's score is the sum of
   its two best selection scores, only the ``topk_group`` best groups stay eligible;
4. top-``k`` by selection score (ties: the lower index wins, ``lax.top_k``'s order);
5. weights: the *unbiased* scores of the chosen experts, divided by their sum ``+ 1e-20`` when
   ``norm_topk_prob``, times ``routed_scaling_factor``.

Externally given expert ids (V4's hash-routed layers, ``tid2eid[token]``) replace steps 2-4; the weights are
still the chosen experts' scores, normalised and scaled.

Experts: each token's ``k`` (token, expert) pairs are flattened to rows, pushed through the grouped SwiGLU
(:func:`~deepinfer_jax.models.common.linear.grouped_linear`, one GEMM per expert that received rows), weighted
and summed back per token. The routing weight multiplies either the down projection's output (V3, as
transformers does) or the activation before it (V4's reference); the two agree exactly in float32 and differ
only through the production activation rounding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax.models.common.linear import LinearNumerics, LinearParams, grouped_linear
from deepinfer_jax.models.common.mlp import swiglu
from deepinfer_jax.ops.moe_kernels import (
    ExpertLayoutImpl,
    expert_layout_impl,
    register_expert_layout,
    register_moe_experts_backends,
)
from deepinfer_jax.ops.registry import register_op

__all__ = [
    "SCORING_FUNCS",
    "ExpertLayoutImpl",
    "Routing",
    "moe_experts",
    "register_expert_layout",
    "route",
    "router_scores",
]

ScoringFunc = Literal["sigmoid", "sqrtsoftplus"]
SCORING_FUNCS: tuple[str, ...] = ("sigmoid", "sqrtsoftplus")
_SOFTPLUS_THRESHOLD = 20.0
_NORM_EPS = 1e-20


class Routing(NamedTuple):
    """Per token: the chosen experts ``ids int32 [T, k]`` and their weights ``weights float32 [T, k]``."""

    ids: jax.Array
    weights: jax.Array


def router_scores(logits: jax.Array, scoring: str) -> jax.Array:
    """Float32 expert scores from router logits (step 1 of the module docstring)."""
    z = logits.astype(jnp.float32)
    if scoring == "sigmoid":
        return jax.nn.sigmoid(z)
    if scoring == "sqrtsoftplus":
        soft = jnp.where(z > _SOFTPLUS_THRESHOLD, z, jnp.log1p(jnp.exp(jnp.minimum(z, _SOFTPLUS_THRESHOLD))))
        return jnp.sqrt(soft)
    raise ValueError(f"scoring: {scoring!r} is not one of {SCORING_FUNCS}")


def _check_count(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"route: {name} must be an int, got {type(value).__name__} {value!r}")
    if not low <= value <= high:
        raise ValueError(f"route: {name} = {value} is outside [{low}, {high}]")
    return value


def route(
    logits: jax.Array,
    *,
    scoring: str,
    top_k: int,
    bias: jax.Array | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    expert_ids: jax.Array | None = None,
) -> Routing:
    """Choose ``top_k`` experts per token and their weights from router logits ``[T, E]`` (module docstring).

    Args:
      logits: router logits ``[T, E]`` (computed in float32 by the caller).
      scoring: ``"sigmoid"`` (V3) or ``"sqrtsoftplus"`` (V4/V4.1).
      top_k: experts per token.
      bias: ``[E]`` selection-only correction bias, or None.
      n_group, topk_group: group limit (both or neither); ``E`` must divide into ``n_group`` groups.
      norm_topk_prob: renormalise the chosen scores to sum to 1 (plus 1e-20 in the denominator).
      routed_scaling_factor: final multiplier of the weights.
      expert_ids: ``int [T, top_k]`` ids chosen elsewhere (hash routing); skips selection.
    """
    if logits.ndim != 2:
        raise ValueError(f"route: logits must be [tokens, experts], got shape {logits.shape}")
    num_tokens, num_experts = logits.shape
    top_k = _check_count("top_k", top_k, 1, num_experts)
    scores = router_scores(logits, scoring)
    if expert_ids is not None:
        ids = jnp.asarray(expert_ids)
        if not jnp.issubdtype(ids.dtype, jnp.integer) or ids.shape != (num_tokens, top_k):
            raise ValueError(
                f"route: expert_ids must be integers of shape ({num_tokens}, {top_k}), got {ids.dtype} {ids.shape}"
            )
        ids = ids.astype(jnp.int32)
    else:
        choice = scores
        if bias is not None:
            if bias.shape != (num_experts,):
                raise ValueError(f"route: bias must have shape ({num_experts},), got {bias.shape}")
            choice = choice + bias.astype(jnp.float32)
        if (n_group is None) != (topk_group is None):
            raise ValueError(
                f"route: n_group = {n_group!r} and topk_group = {topk_group!r}: set both or neither"
            )
        if n_group is not None and n_group > 1:
            n_group = _check_count("n_group", n_group, 1, num_experts)
            if num_experts % n_group:
                raise ValueError(f"route: n_group = {n_group} does not divide the {num_experts} experts")
            topk_group = _check_count("topk_group", topk_group, 1, n_group)
            per_group = num_experts // n_group
            grouped = choice.reshape(num_tokens, n_group, per_group)
            group_score = lax.top_k(grouped, min(2, per_group))[0].sum(axis=-1)
            _, keep = lax.top_k(group_score, topk_group)
            group_mask = (
                jnp.zeros((num_tokens, n_group), bool).at[jnp.arange(num_tokens)[:, None], keep].set(True)
            )
            eligible = jnp.repeat(group_mask, per_group, axis=1)
            choice = jnp.where(eligible, choice, -jnp.inf)
        _, ids = lax.top_k(choice, top_k)
        ids = ids.astype(jnp.int32)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + jnp.float32(_NORM_EPS))
    weights = weights * jnp.float32(routed_scaling_factor)
    return Routing(ids=ids, weights=weights)


def moe_experts(
    x: jax.Array,
    routing: Routing,
    experts: Mapping[str, LinearParams],
    numerics: LinearNumerics,
    *,
    swiglu_limit: float | None = None,
    weight_before_down: bool = False,
    out_dtype: Any = None,
) -> jax.Array:
    """Routed-expert output ``Σ_k w[t,k] · FFN_{ids[t,k]}(x[t])`` for ``x [T, H]`` -> ``[T, H]``.

    Reference implementation of op ``"moe_experts"``. ``experts`` holds grouped linear weights
    ``{"gate": [E, I, H], "up": [E, I, H], "down": [E, H, I]}`` in any format of
    :mod:`~deepinfer_jax.models.common.linear`. Each of the ``T·k`` (token, expert) rows is computed once, by
    its expert's GEMM only; the weighted sum over a token's ``k`` rows runs in float32 and is rounded once to
    ``out_dtype`` (default ``x.dtype``). Rows with an id outside ``[0, E)`` contribute nothing.

    ``experts`` of a type given to :func:`register_expert_layout` (expert-parallel slot layouts) go to that
    type's implementation instead, with the same arguments.
    """
    layout_impl = expert_layout_impl(experts)
    if layout_impl is not None:
        return layout_impl(
            x,
            routing,
            experts,
            numerics,
            swiglu_limit=swiglu_limit,
            weight_before_down=weight_before_down,
            out_dtype=out_dtype,
        )
    if x.ndim != 2:
        raise ValueError(f"moe_experts: x must be [tokens, hidden], got shape {x.shape}")
    missing = {"gate", "up", "down"} - set(experts)
    if missing:
        raise ValueError(f"moe_experts: expert weights lack {sorted(missing)}; got keys {sorted(experts)}")
    ids, weights = routing
    num_tokens, top_k = ids.shape
    if num_tokens != x.shape[0] or weights.shape != ids.shape:
        raise ValueError(
            f"moe_experts: routing ids {ids.shape} / weights {weights.shape} do not match x {x.shape}"
        )
    rows = jnp.repeat(x, top_k, axis=0)  # row t*k + j is token t's j-th pick
    flat_ids = ids.reshape(-1)
    flat_w = weights.reshape(-1, 1).astype(jnp.float32)
    g = grouped_linear(rows, experts["gate"], flat_ids, numerics, out_dtype=jnp.float32)
    u = grouped_linear(rows, experts["up"], flat_ids, numerics, out_dtype=jnp.float32)
    a = swiglu(g, u, limit=swiglu_limit)
    if weight_before_down:
        a = a * flat_w
    y = grouped_linear(a.astype(x.dtype), experts["down"], flat_ids, numerics, out_dtype=jnp.float32)
    if not weight_before_down:
        y = y * flat_w
    return y.reshape(num_tokens, top_k, -1).sum(axis=1).astype(out_dtype or x.dtype)


register_op(
    "moe_experts",
    moe_experts,
    doc="routed SwiGLU experts, one grouped GEMM per expert with rows, weighted sum per token (model.md §8.2)",
)
# Accelerator backends of this op (sorted dispatch over the Pallas / CuteDSL / Ascend grouped GEMMs) attach to it
# here, because the op itself is defined at the models level.
register_moe_experts_backends()
