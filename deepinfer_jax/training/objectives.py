"""Training objectives, each a pure function of float32 checkpoint tensors (``{HF name: array}``).

Every loss assembles the tensors with the family's own ``assemble_params`` (float-weight config, float32 mode),
swaps the routed experts into :class:`~.experts.DenseExperts` and runs the family's own forward, collecting the
forward's taps (:mod:`deepinfer_jax.models.common.taps`). So ``jax.grad`` goes through the project's model code,
and the gradients come back keyed by tensor name.

* :func:`lm_loss` -- next-token cross-entropy (nats per token) of ``ids[:, 1:]`` given ``ids[:, :-1]``, plus
  - V4.1: the **indexer distillation** term. ``jax.grad`` gives the sparse indexer no gradient (its top-k is a
    discrete choice), so -- as DeepSeek-V3.2 trains its lightning indexer -- each index-source layer's indexer
    distribution ``softmax_j I(p, j)`` over the visible compressed keys is fitted to the layer's own attention
    distribution over those keys (all of them, summed over heads and renormalised) by ``KL(target || indexer)``.
    The target and the indexer's inputs are stop-gradient, so the term trains the indexer's weights only
    (``indexer.wq_b``, ``weights_proj``, ``wk``, ``k_norm``) and never moves the language model.
  - V3: the **MTP loss** of the V3 paper, ``λ · CE(MTP logits at i, token i+2)`` with ``D = 1`` MTP module fed the
    main model's post-final-norm hidden ``h_i`` and the embedding of token ``i+1``; gradients flow into the main
    model, which shares the embedding and the output head with the MTP module.
* :func:`drafter_loss` -- the V4.1 DSpark drafter against the frozen target (module :mod:`.drafter`).

The router biases are not trained by gradient (they only steer selection, ``noaux_tc``): the losses return each
MoE layer's expert counts (``aux["expert_counts"]``), and :func:`balance_biases` applies the auxiliary-loss-free
update of the V3 paper, ``b_e += γ · sign(mean load − load_e)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.models.common import taps
from deepinfer_jax.training.experts import dense_experts

__all__ = [
    "LMSetup",
    "assemble",
    "balance_biases",
    "cross_entropy",
    "lm_loss",
    "router_bias_names",
]


_MASKED = -1e30


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Mean ``-log softmax(logits)[target]`` in nats (over ``mask`` when given)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if mask is None:
        return jnp.mean(nll)
    mask = mask.astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


@dataclasses.dataclass(frozen=True)
class LMSetup:
    """The static part of a model's training objective (hashable: a ``jax.jit`` static argument).

    Attributes:
        cfg: the float-weight config (no ``quantization_config``), read from a folder that holds the tokenizer.
        indexer_weight: weight of the V4.1 indexer distillation term (0 disables it).
        mtp_weight: ``λ`` of V3's MTP loss (0 disables it).
    """

    cfg: ModelConfig
    indexer_weight: float = 0.0
    mtp_weight: float = 0.0

    @property
    def family(self) -> str:
        return self.cfg.MODEL_TYPE


def router_bias_names(cfg: ModelConfig) -> list[str]:
    """The router-bias tensors in the order the forward records its MoE layers (backbone, then MTP / draft)."""
    if cfg.MODEL_TYPE == "deepseek_v41":
        names = [f"layers.{layer}.ffn.gate.bias" for layer in range(cfg.num_hidden_layers)]
        return names + [f"mtp.{i}.ffn.gate.bias" for i in range(cfg.num_nextn_predict_layers)]
    layers = range(cfg.first_k_dense_replace, cfg.num_layers_total)
    return [f"model.layers.{layer}.mlp.gate.e_score_correction_bias" for layer in layers]


def assemble(cfg: ModelConfig, tensors: Mapping[str, jax.Array]) -> Any:
    """The float32 parameter tree of ``tensors`` (V3's tied MTP copies filled in), experts as DenseExperts."""
    from deepinfer_jax.models.registry import get_family
    from deepinfer_jax.training.weights import tied_tensors

    full = dict(tensors)
    for copy, original in tied_tensors(cfg).items():
        full[copy] = full[original]
    return dense_experts(get_family(cfg.MODEL_TYPE).assemble_params(cfg, full, "float32"))


def _counts(tapped: list[tuple[str, dict[str, Any]]]) -> list[jax.Array]:
    out = []
    for kind, values in tapped:
        if kind == "moe_routing":
            onehot = jax.nn.one_hot(values["ids"].reshape(-1), values["num_experts"], dtype=jnp.float32)
            out.append(jax.lax.stop_gradient(jnp.sum(onehot, axis=0)))
    return out


def _indexer_kl(params: Any, tapped: list[tuple[str, dict[str, Any]]], static: Any) -> jax.Array:
    """Mean ``KL(attention || indexer)`` over the index-source layers (module docstring)."""
    from deepinfer_jax.models.deepseek_v4.compressor import visible_entries
    from deepinfer_jax.models.deepseek_v4.v41_compressor import indexer_keys, indexer_query, indexer_scores

    sg = jax.lax.stop_gradient
    by_layer = {values["layer"]: values for kind, values in tapped if kind == "v41_attention"}
    terms = []
    for lp in static.plan.layers:
        if not lp.is_index_source:
            continue
        tap, spec = by_layer[lp.layer], static.attention[lp.layer]
        source = by_layer[lp.index_k_source]
        ik = params["layers"][lp.index_k_source]["attn"]["indexer"]
        ip = params["layers"][lp.layer]["attn"]["indexer"]
        b, s = tap["x_hat"].shape[:2]
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        freqs = spec.freqs()
        ki = indexer_keys(
            sg(source["pre_rope"]),
            ik["wk"],
            ik["k_norm"],
            ratio=spec.ratio,
            eps=spec.eps,
            rope_freqs=freqs,
            rope_dim=spec.rope_dim,
        )
        qi, wi = indexer_query(
            sg(tap["q_latent"]),
            sg(tap["x_hat"]),
            ip["wq_b"],
            ip["weights_proj"],
            positions,
            n_heads=spec.index_heads,
            rope_freqs=freqs,
            rope_dim=spec.rope_dim,
            numerics=static.numerics,
            ratio=spec.ratio,
        )
        scores = indexer_scores(qi, ki, wi, score_dtype=jnp.float32)  # [B, S, N]
        keys = sg(tap["compressed_keys"]).astype(jnp.float32)
        visible = visible_entries(positions, spec.ratio, keys.shape[1])  # [B, S, N]
        logits = jnp.einsum("bshd,bnd->bshn", sg(tap["queries"]).astype(jnp.float32), keys)
        # Finite fill values (not -inf): a query that sees no compressed key yet (p < r - 1) must not put a NaN
        # into the backward pass; such rows are dropped from the mean.
        logits = jnp.where(visible[:, :, None, :], logits * spec.head_dim**-0.5, _MASKED)
        rows = jnp.any(visible, axis=-1)  # queries with at least one visible compressed key
        target = jnp.where(visible, jnp.mean(jax.nn.softmax(logits, axis=-1), axis=2), 0.0)
        log_q = jax.nn.log_softmax(jnp.where(visible, scores, _MASKED), axis=-1)
        log_t = jnp.log(jnp.where(target > 0, target, 1.0))
        kl = jnp.sum(jnp.where(visible, target * (log_t - log_q), 0.0), axis=-1)
        terms.append(jnp.sum(jnp.where(rows, kl, 0.0)) / jnp.maximum(jnp.sum(rows), 1))
    return jnp.mean(jnp.stack(terms)) if terms else jnp.float32(0.0)


def lm_loss(
    trainable: Mapping[str, jax.Array],
    fixed: Mapping[str, jax.Array],
    ids: jax.Array,
    *,
    setup: LMSetup,
    mtp_weight: Any = None,
) -> tuple[jax.Array, dict[str, Any]]:
    """The backbone objective on ``ids [B, S+1]`` (``ids[:, 0]`` is BOS): ``(loss, aux)``.

    ``mtp_weight`` (may be traced) overrides ``setup.mtp_weight`` as ``λ`` (the V3 paper lowers it late in
    training); the MTP term is computed when ``setup.mtp_weight > 0``.

    ``aux``: ``ce`` (main next-token loss), ``indexer_kl`` (V4.1), ``mtp_ce`` (V3), ``expert_counts``
    (one ``[E]`` array per MoE layer, :func:`router_bias_names` order).
    """
    cfg = setup.cfg
    params = assemble(cfg, {**fixed, **trainable})
    inputs, targets = ids[:, :-1], ids[:, 1:]
    aux: dict[str, Any] = {}
    if setup.family == "deepseek_v41":
        from deepinfer_jax.models.deepseek_v4 import v41_model
        from deepinfer_jax.models.deepseek_v4.family_v41 import static_for

        static = static_for(cfg, "float32")
        with taps.collect() as tapped:
            logits = v41_model.forward_logits(params, inputs, static=static)
        ce = cross_entropy(logits, targets)
        loss = ce
        if setup.indexer_weight:
            aux["indexer_kl"] = _indexer_kl(params, tapped, static)
            loss = loss + setup.indexer_weight * aux["indexer_kl"]
    else:
        from deepinfer_jax.models.deepseek_v3 import model as v3

        with taps.collect() as tapped:
            logits, hidden = v3.forward_hidden(params, cfg, inputs)
            ce = cross_entropy(logits, targets)
            loss = ce
            if setup.mtp_weight and cfg.num_nextn_predict_layers:
                mtp_logits, _, _ = v3.mtp_forward(params, cfg, hidden[:, :-1], inputs[:, 1:])
                aux["mtp_ce"] = cross_entropy(mtp_logits, targets[:, 1:])
                weight = setup.mtp_weight if mtp_weight is None else mtp_weight
                loss = loss + weight * aux["mtp_ce"]
    aux["ce"] = ce
    aux["expert_counts"] = _counts(tapped)
    return loss, aux


def balance_biases(
    biases: Mapping[str, jax.Array], counts: list[jax.Array], names: list[str], rate: float
) -> dict[str, jax.Array]:
    """The auxiliary-loss-free balance step: ``b_e += rate · sign(mean(load) − load_e)`` per MoE layer.

    ``counts`` are the expert counts of the layers named ``names`` (in that order); layers without counts
    (e.g. draft layers during backbone training) keep their bias.
    """
    out = dict(biases)
    for name, count in zip(names, counts):
        load = count.astype(jnp.float32)
        out[name] = biases[name] + jnp.float32(rate) * jnp.sign(jnp.mean(load) - load)
    return out
