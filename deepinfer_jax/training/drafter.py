"""The V4.1 DSpark drafter trained against the frozen target, and the drafters' teacher-forced quality.

**Training batch.** Windows of training text (BOS + ``seq_len`` tokens, :func:`~.loop.train_batch`) and, per
window, ``anchors`` distinct positions ``p`` drawn from ``numpy.random.default_rng([seed, step, 1])``, the last
position the target "knows". Each anchor makes one draft block ``[g, noise, …, noise]`` at ``p+1 … p+B`` with
``g = ids[p+1]``, the bonus token, read from the text (teacher forcing). The frozen backbone runs once over the
window (:func:`~deepinfer_jax.models.deepseek_v4.dspark.dspark_features`): its features give the draft layers'
context keys (:func:`~deepinfer_jax.models.deepseek_v4.dspark.context_keys`, the window ``max(0, p−W+1) … p`` of
each anchor), its logits at ``p+1+i`` the target distribution ``q_i`` for block row ``i``, which predicts the
token at ``p+2+i``. The block runs through the project's :func:`~.dspark.draft_hidden`; row ``i``'s logits are
``RMSNorm(h_i)·headᵀ + markov_embed[prev_i]·markov_headᵀ`` as in :func:`~.dspark.draft`, with the teacher-forced
``prev_i = ids[p+1+i]`` (the text's token, which is also what the target's ``q_i`` conditions on).

**Loss.** ``KL(q_i || p_i)`` per position, averaged over rows and anchors. Why the KL to the target's whole
distribution rather than the cross-entropy to the text's next token: a draft is accepted when it agrees with the
*target* (greedy: equals its argmax; sampling: with probability ``Σ_x min(p(x), q(x)) = 1 − TV(p, q)``), so the
target, not the text, is the label; the soft distribution carries more signal per position than its argmax;
and ``TV ≤ sqrt(KL / 2)`` (Pinsker), so driving the KL down drives the sampling acceptance ``1 − TV`` up. The
forward direction (``q`` first) is the cross-entropy to ``q`` up to a constant, mass-covering, and well defined
for any ``p > 0``.

**Confidence head.** ``conf_i = sigmoid([h_i ; m_i]·confᵀ)`` is fitted by binary cross-entropy to whether draft
``i`` would be accepted under greedy verification, ``argmax p_i == argmax q_i``, with ``h_i`` and ``m_i``
stop-gradient so the probe never changes the drafts. The label conditions on the text's prefix; in the engine
the prefix is the accepted drafts. :func:`dspark_quality` measures the calibration the engine's way (the §8.7
confidence error over verify rows whose target distribution conditions on the drafts themselves).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config.v41 import DeepseekV41Config
from deepinfer_jax.models.common import taps
from deepinfer_jax.training.loop import TrainSettings, train_batch
from deepinfer_jax.training.objectives import _counts, assemble

__all__ = ["DrafterSetup", "drafter_batch", "drafter_loss", "dspark_quality", "eval_anchors", "mtp_quality"]


@dataclasses.dataclass(frozen=True)
class DrafterSetup:
    """Static part of the drafter objective: the float-weight config, anchors per window, BCE weight."""

    cfg: DeepseekV41Config
    anchors: int = 8
    confidence_weight: float = 0.1


def _statics(cfg: DeepseekV41Config) -> Any:
    from deepinfer_jax.models.deepseek_v4.dspark import DSparkStatic
    from deepinfer_jax.models.deepseek_v4.family_v41 import static_for

    return DSparkStatic.from_config(cfg, static_for(cfg, "float32"))


def drafter_batch(
    tokens: np.ndarray, step: int, settings: TrainSettings, bos_id: int, *, anchors: int, block_size: int
) -> dict[str, np.ndarray]:
    """``{"ids": [B, S+1], "anchors": [B, anchors]}``: windows and distinct anchors ``p`` in ``[0, S − block]``."""
    ids = train_batch(tokens, step, settings, bos_id)
    high = settings.seq_len - block_size + 1
    if high < anchors:
        raise ValueError(
            f"seq_len = {settings.seq_len}: too short for {anchors} anchors of block {block_size}"
        )
    rng = np.random.default_rng([settings.seed, step, 1])
    p = np.stack([np.sort(rng.choice(high, anchors, replace=False)) for _ in range(ids.shape[0])])
    return {"ids": ids, "anchors": p.astype(np.int32)}


def _window_context(context: Any, p: jax.Array, window: int) -> Any:
    """The context keys of positions ``p−W+1 … p`` of each anchor (``p [R, A]``) as ``[R·A, W, D]`` rows."""
    from deepinfer_jax.models.deepseek_v4.dspark import ContextKeys

    offsets = jnp.arange(window, dtype=jnp.int32) - (window - 1)
    pos = p[..., None] + offsets  # [R, A, W]; negative before the sequence start
    index = jnp.maximum(pos, 0)
    rows, anchors = p.shape
    keys = tuple(
        jnp.take_along_axis(k[:, None, :, :], index[..., None], axis=2).reshape(rows * anchors, window, -1)
        for k in context.keys
    )
    return ContextKeys(keys=keys, positions=jnp.where(pos >= 0, pos, -1).reshape(rows * anchors, window))


def _block_logits(params: Any, h: jax.Array, prev: jax.Array, static: Any) -> tuple[jax.Array, jax.Array]:
    """Row logits ``RMSNorm(h)·headᵀ + markov_embed[prev]·markov_headᵀ`` and the Markov rows (as ``draft``)."""
    from deepinfer_jax.models.common.embedding import embed_tokens, lm_head
    from deepinfer_jax.ops import rms_norm

    last = params["mtp"][-1]
    base = lm_head(rms_norm(h, last["norm"], eps=static.attention.eps), params["head"])
    markov = embed_tokens(last["markov_embed"], prev)
    return base + lm_head(markov, last["markov_head"]), markov


def _confidence_logit(params: Any, h: jax.Array, markov: jax.Array) -> jax.Array:
    from deepinfer_jax.models.common.embedding import lm_head

    return lm_head(jnp.concatenate([h, markov.astype(h.dtype)], axis=-1), params["mtp"][-1]["confidence"])[
        ..., 0
    ]


def drafter_loss(
    trainable: Mapping[str, jax.Array],
    fixed: Mapping[str, jax.Array],
    batch: Mapping[str, jax.Array],
    *,
    setup: DrafterSetup,
) -> tuple[jax.Array, dict[str, Any]]:
    """``KL + confidence_weight · BCE`` of the drafter on one batch (module docstring); ``(loss, aux)``.

    ``aux``: ``kl``, ``bce``, ``agree`` (fraction of rows whose argmax equals the target's), ``agree_at``
    (per block position), ``expert_counts`` of the draft layers.
    """
    from deepinfer_jax.models.deepseek_v4.dspark import context_keys, draft_hidden, dspark_features

    sg = jax.lax.stop_gradient
    cfg = setup.cfg
    static = _statics(cfg)
    params = assemble(cfg, {**fixed, **trainable})
    ids, p = batch["ids"], batch["anchors"]
    rows, anchors = p.shape
    size = static.block_size
    logits, phi = dspark_features(params, ids, static=static)
    logits, phi = sg(logits), sg(phi)
    context = _window_context(context_keys(params, phi, static=static), p, static.attention.window)
    flat_p = p.reshape(-1)
    row = jnp.repeat(jnp.arange(rows, dtype=jnp.int32), anchors)
    at = flat_p[:, None] + 1 + jnp.arange(size, dtype=jnp.int32)[None, :]  # positions p+1 … p+B
    prev = ids[row[:, None], at]  # teacher forcing: g = ids[p+1], then the text's tokens
    block = jnp.concatenate([prev[:, :1], jnp.full((prev.shape[0], size - 1), static.noise_token_id)], axis=1)
    with taps.collect() as tapped:
        h = draft_hidden(params, context, block, flat_p, static=static)
    draft_logits, markov = _block_logits(params, h, prev, static)
    target = jax.nn.softmax(logits[row[:, None], at], axis=-1)  # q_i: the target at p+1+i
    log_p = jax.nn.log_softmax(draft_logits, axis=-1)
    log_t = jnp.log(jnp.where(target > 0, target, 1.0))
    kl = jnp.mean(jnp.sum(target * (log_t - log_p), axis=-1))
    agree = (jnp.argmax(draft_logits, axis=-1) == jnp.argmax(target, axis=-1)).astype(jnp.float32)
    raw = _confidence_logit(params, sg(h), sg(markov))
    label = sg(agree)
    bce = jnp.mean(jnp.maximum(raw, 0) - raw * label + jnp.log1p(jnp.exp(-jnp.abs(raw))))
    aux = {
        "kl": kl,
        "bce": bce,
        "agree": jnp.mean(agree),
        "expert_counts": _counts(tapped),
    }
    for i in range(size):
        aux[f"agree_{i + 1}"] = jnp.mean(agree[:, i])
    return kl + setup.confidence_weight * bce, aux


# ------------------------------------------------------------------------------------ quality on held-out text


def eval_anchors(windows: np.ndarray, per_window: int, block: int, seed: int) -> np.ndarray:
    """``[N, per_window]`` distinct seeded anchors ``p`` in ``[1, S − block)`` for windows ``[N, S+1]``."""
    rng = np.random.default_rng([seed, 7])
    high = windows.shape[1] - 1 - block
    return np.stack([np.sort(rng.choice(np.arange(1, high), per_window, replace=False)) for _ in windows])


def dspark_quality(
    params: Any, cfg: DeepseekV41Config, windows: np.ndarray, *, per_window: int = 4, seed: int = 0
) -> dict[str, Any]:
    """Teacher-forced quality of the DSpark drafter on held-out ``windows [N, S]`` (BOS + text).

    For ``per_window`` anchors ``p`` per window (seeded):

    * ``agree_tf[i]``: the drafts of :func:`~.dspark.draft` after the text's token ``g = ids[p+1]`` (each draft
      conditioned on the drafter's own previous drafts, as at inference) equal the target's argmax at ``p+1+i``
      on the text, positions 1-B;
    * the engine's greedy round after a text prefix: ``g`` = the target's argmax at ``p``, the drafts after it,
      then one target pass over ``[text … p, g, d_1 … d_B]``. Verify row ``j`` accepts ``d_j`` iff it is the
      target's argmax given the drafts before it (§8.4 greedy); ``accept_rate[j]`` is conditional on the earlier
      drafts being accepted, ``mean_accepted_length`` ``= 1 +`` accepted drafts per round, and
      ``confidence_error`` the §8.7 figure ``Σ_verify |accept_prob − conf| / Σ verified`` with every draft a
      verify row (verification without varlen).
    """
    from deepinfer_jax.models.deepseek_v4 import v41_model
    from deepinfer_jax.models.deepseek_v4.dspark import context_keys, draft, dspark_features

    static = _statics(cfg)
    size = static.block_size
    anchors = eval_anchors(windows, per_window, size, seed)

    @jax.jit
    def run(ids: jax.Array, p: jax.Array) -> dict[str, jax.Array]:
        logits, phi = dspark_features(params, ids, static=static)
        ctx = context_keys(params, phi, static=static)
        rows, count = p.shape
        flat = p.reshape(-1)
        row = jnp.repeat(jnp.arange(rows, dtype=jnp.int32), count)
        from deepinfer_jax.models.deepseek_v4.dspark import ContextKeys

        full = ContextKeys(
            keys=tuple(jnp.repeat(k, count, axis=0) for k in ctx.keys),
            positions=jnp.repeat(ctx.positions, count, 0),
        )
        at = flat[:, None] + 1 + jnp.arange(size, dtype=jnp.int32)[None, :]
        target_tf = jnp.argmax(logits[row[:, None], at], axis=-1)
        tf = draft(params, full, ids[row, flat + 1], flat, static=static)
        golden = jnp.argmax(logits[row, flat], axis=-1).astype(jnp.int32)
        engine = draft(params, full, golden, flat, static=static)
        seq = jnp.repeat(ids, count, axis=0)
        spliced = seq.at[jnp.arange(seq.shape[0]), flat + 1].set(golden)
        spliced = spliced.at[jnp.arange(seq.shape[0])[:, None], at + 1].set(engine.tokens)
        verify = v41_model.forward_logits(params, spliced, static=static.backbone)
        target_engine = jnp.argmax(verify[jnp.arange(seq.shape[0])[:, None], at], axis=-1)
        return {
            "tf": (tf.tokens == target_tf).astype(jnp.float32),
            "accept": (engine.tokens == target_engine).astype(jnp.float32),
            "conf": engine.confidences,
        }

    parts: dict[str, list[np.ndarray]] = {"tf": [], "accept": [], "conf": []}
    for i in range(0, windows.shape[0], 8):
        out = run(jnp.asarray(windows[i : i + 8]), jnp.asarray(anchors[i : i + 8]))
        for k in parts:
            parts[k].append(np.asarray(out[k]))
    tf, accept, conf = (np.concatenate(parts[k]) for k in ("tf", "accept", "conf"))
    prefix = np.cumprod(accept, axis=1)
    reached = np.concatenate([np.ones((accept.shape[0], 1)), prefix[:, :-1]], axis=1)
    return {
        "rounds": int(accept.shape[0]),
        "agree_tf": tf.mean(axis=0).tolist(),
        "accept_rate": (prefix.sum(axis=0) / np.maximum(reached.sum(axis=0), 1)).tolist(),
        "mean_accepted_length": float(1.0 + prefix.sum(axis=1).mean()),
        "confidence_error": float(np.abs(accept - conf).sum() / accept.size),
        "mean_confidence": conf.mean(axis=0).tolist(),
    }


def mtp_quality(
    params: Any, cfg: Any, windows: np.ndarray, *, per_window: int = 4, seed: int = 0
) -> dict[str, Any]:
    """Teacher-forced quality of V3's MTP layer on held-out ``windows [N, S]`` (BOS + text).

    ``agree_tf``: the MTP layer's argmax at ``i`` (fed ``h_i`` and the text's token ``i+1``) equals the main
    model's argmax at ``i+1`` on the text, over every position. ``accept_rate``: the engine's greedy round at
    ``per_window`` seeded anchors ``p`` -- ``g`` = the main model's argmax at ``p``, the MTP draft from ``h_p`` and
    ``g`` (the MTP layer seeing its own earlier positions, fed by the text), accepted iff it is the main model's
    argmax at ``p+1`` given ``g``.
    """
    from deepinfer_jax.models.deepseek_v3 import model as v3

    anchors = eval_anchors(windows, per_window, 1, seed)

    @jax.jit
    def run(ids: jax.Array, p: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits, hidden = v3.forward_hidden(params, cfg, ids)
        mtp_logits, _, _ = v3.mtp_forward(params, cfg, hidden[:, :-1], ids[:, 1:])
        tf = (jnp.argmax(mtp_logits, -1) == jnp.argmax(logits[:, 1:], -1)).astype(jnp.float32)
        rows, count = p.shape
        flat = p.reshape(-1)
        row = jnp.repeat(jnp.arange(rows, dtype=jnp.int32), count)
        golden = jnp.argmax(logits[row, flat], axis=-1).astype(jnp.int32)
        seq = jnp.repeat(ids, count, axis=0)
        n = jnp.arange(seq.shape[0])
        # The MTP layer attends over its own earlier positions: run it over the prefix, the text's next tokens
        # up to p and g at p (it is causal, so what follows p does not matter), and read its prediction at p.
        nexts = seq[:, 1:].at[n, flat].set(golden)
        d, _, _ = v3.mtp_forward(params, cfg, jnp.repeat(hidden[:, :-1], count, axis=0), nexts)
        d = jnp.argmax(d[n, flat], axis=-1).astype(jnp.int32)
        spliced = seq.at[n, flat + 1].set(golden).at[n, flat + 2].set(d)
        verify = v3.forward_logits(params, cfg, spliced)
        return tf, (jnp.argmax(verify[n, flat + 1], -1) == d).astype(jnp.float32)

    tfs, accepts = [], []
    for i in range(0, windows.shape[0], 8):
        tf, acc = run(jnp.asarray(windows[i : i + 8]), jnp.asarray(anchors[i : i + 8]))
        tfs.append(np.asarray(tf))
        accepts.append(np.asarray(acc))
    return {
        "agree_tf": [float(np.concatenate(tfs).mean())],
        "accept_rate": [float(np.concatenate(accepts).mean())],
        "rounds": int(sum(a.size for a in accepts)),
    }
