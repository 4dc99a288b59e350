"""Building blocks shared by the DeepSeek families: linears over checkpoint-format weights, SwiGLU MLPs, the
MoE gate and routed experts (op ``moe_experts``), embedding lookup and the LM head.

RMSNorm and RoPE/YaRN live in :mod:`deepinfer_jax.ops` (they are hot ops with backend alternatives); this
package composes ops into model pieces. Importing it registers the ``moe_experts`` op.
"""

from deepinfer_jax.models.common.embedding import embed_tokens, lm_head
from deepinfer_jax.models.common.linear import (
    LinearNumerics,
    grouped_linear,
    linear,
    linear_format,
    linear_out_features,
)
from deepinfer_jax.models.common.mlp import swiglu, swiglu_mlp
from deepinfer_jax.models.common.moe import SCORING_FUNCS, Routing, moe_experts, route, router_scores

__all__ = [
    "SCORING_FUNCS",
    "LinearNumerics",
    "Routing",
    "embed_tokens",
    "grouped_linear",
    "linear",
    "linear_format",
    "linear_out_features",
    "lm_head",
    "moe_experts",
    "route",
    "router_scores",
    "swiglu",
    "swiglu_mlp",
]
