"""Logical axis names of the DeepSeek-V4 and V4.1 parameter trees (ARCHITECTURE.md §2).

``parallel/`` turns these names into mesh axes with one rules table: a routed-expert stack
``("expert", a, b)`` is split over the expert-parallel axis once laid out in physical slots, everything else
named here is replicated today (attention, mHC mixing, Engram, shared experts, heads). The names still say
what each dimension indexes, so a later rule (say, heads over a tensor-parallel axis) is a one-line change of
the table, not a walk through the model code.

One function serves both trees: V4.1 adds Engram, the fused shared-expert ``w13``, indexer key projections and
drafter (``mtp``) layers, and differs in which linears are FP8 (``{"weight", "scale"}``), MXFP4
(``{"packed", "scale"}``) or plain arrays. Linear weights are ``[out, in]``; a block-scale grid or an MXFP4 pack
has the same two axes, coarser or packed.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["logical_axes"]

_WEIGHT_LEAVES = ("weight", "scale", "packed")

# Linear [out, in] axes by (enclosing block, linear name); the block is the nearest key of _BLOCKS above the
# linear. The empty block is the top level and a layer's own entries (mtp projections, mHC mixing).
_LINEARS: dict[tuple[str, str], tuple[str, str]] = {
    ("attn", "wq_a"): ("q_lora", "embed"),
    ("attn", "wq_b"): ("q_heads", "q_lora"),
    ("attn", "wkv"): ("kv_head", "embed"),
    ("attn", "wo_a"): ("o_lora", "o_heads"),
    ("attn", "wo_b"): ("embed", "o_lora"),
    ("compressor", "wkv"): ("compress_kv", "embed"),
    ("compressor", "wgate"): ("compress_kv", "embed"),
    ("indexer", "wq_b"): ("index_q_heads", "q_lora"),
    ("indexer", "weights_proj"): ("index_heads", "embed"),
    ("indexer", "wk"): ("index_dim", "embed"),
    ("ffn", "gate"): ("expert", "embed"),  # the router: logical experts, read by every device
    ("shared", "gate"): ("moe_mlp", "embed"),
    ("shared", "up"): ("moe_mlp", "embed"),
    ("shared", "w13"): ("moe_mlp_pair", "embed"),
    ("shared", "down"): ("embed", "moe_mlp"),
    ("engram", "embed"): ("engram_rows", "engram_dim"),
    ("engram", "wkv"): ("engram_kv", "engram_in"),
    ("", "embed"): ("vocab", "embed"),
    ("", "head"): ("vocab", "embed"),
    ("", "main_proj"): ("embed", "main_in"),
    ("", "markov_embed"): ("vocab", "markov"),
    ("", "markov_head"): ("vocab", "markov"),
    ("", "confidence"): ("confidence", "confidence_in"),
}

# Non-linear leaves by (block, name).
_VECTORS: dict[tuple[str, str], tuple[str, ...]] = {
    ("attn", "q_norm"): ("q_lora",),
    ("attn", "kv_norm"): ("kv_head",),
    ("attn", "sinks"): ("heads",),
    ("compressor", "ape"): ("compress_ratio", "compress_kv"),
    ("compressor", "norm"): ("kv_head",),
    ("indexer", "k_norm"): ("index_dim",),
    ("ffn", "bias"): ("expert",),
    ("ffn", "tid2eid"): ("vocab", "expert_pick"),
    ("engram", "q_weight"): ("hc", "embed"),
    ("engram", "k_weight"): ("hc", "embed"),
    ("hc", "fn"): ("hc_mix", "hc_embed"),
    ("hc", "base"): ("hc_mix",),
    ("hc", "scale"): ("hc_scale",),
    ("", "engram_compress"): ("vocab",),
}

_BLOCKS = frozenset({"attn", "compressor", "indexer", "ffn", "shared", "engram", "experts"})
_HC_BLOCKS = frozenset({"hc_attn", "hc_ffn", "hc_head"})


def _key(entry: Any) -> str:
    return str(getattr(entry, "key", getattr(entry, "idx", entry)))


def _axes_for(keys: tuple[str, ...], ndim: int) -> tuple[str, ...]:
    where = ".".join(keys)
    names = [k for k in keys if not k.isdigit()]
    # "scale" is also the name of an mHC block's scale vector, which is no linear's block-scale grid
    is_weight = names[-1] in _WEIGHT_LEAVES and len(names) > 1 and names[-2] not in _HC_BLOCKS
    owner = names[-2] if is_weight else names[-1]
    above = names[:-2] if is_weight else names[:-1]
    if "experts" in above:  # a routed-expert stack: one [out, in] matrix (or scale grid / pack) per expert
        return ("expert", "embed", "moe_mlp") if owner == "down" else ("expert", "moe_mlp", "embed")
    block = next((k for k in reversed(above) if k in _BLOCKS or k in _HC_BLOCKS), "")
    if block in _HC_BLOCKS:
        block = "hc"
    if is_weight or (ndim == 2 and (block, owner) in _LINEARS):
        axes = _LINEARS.get((block, owner))
    else:
        axes = _VECTORS.get((block, owner))
        if axes is None and ndim == 1 and owner.endswith("norm"):  # attn_norm, ffn_norm, norm, main_norm
            axes = ("embed",)
    if axes is None:
        raise ValueError(f"logical_axes: no axis names for parameter {where} ({ndim}-D)")
    if len(axes) != ndim:
        raise ValueError(f"logical_axes: {where} has {ndim} dimensions, but its names are {axes}")
    return axes


def logical_axes(params: Any) -> Any:
    """The logical axis names of every leaf of a V4 or V4.1 parameter tree, a pytree of tuples like ``params``.

    E.g. ``embed -> ("vocab", "embed")``, a routed expert's ``gate.packed -> ("expert", "moe_mlp", "embed")``,
    the router ``ffn.gate.weight -> ("expert", "embed")``, ``hc_attn.fn -> ("hc_mix", "hc_embed")``.

    Raises:
      ValueError: a leaf this table has no names for, or whose rank differs from its names (the message
        names the parameter path).
    """

    def one(path: tuple[Any, ...], leaf: Any) -> tuple[str, ...]:
        return _axes_for(tuple(_key(p) for p in path), leaf.ndim)

    return jax.tree_util.tree_map_with_path(one, params)
