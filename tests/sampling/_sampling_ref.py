"""Independent numpy reference of the sampling pipeline, written for the tests.

Nothing here imports ``deepinfer_jax``. It computes in float64 and follows the definitions rather than the
library's tricks: temperature divides the raw logits (no max subtraction), min_p compares probabilities with
``min_p · max(p)``, the top-k/top-p order comes from ``np.lexsort`` and each kept set is built id by id, and the
draw walks a Python-integer CDF.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Row:
    """One row's parameters, with the issue's defaults."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


def penalise(logits, prompt_ids, output_ids, rep, presence, frequency):
    """vLLM's penalties on one row: repetition over prompt + output, presence/frequency over the output."""
    x = np.asarray(logits, np.float64).copy()
    counts = np.bincount(np.asarray(output_ids, np.int64), minlength=x.size)[: x.size]
    seen = set(int(t) for t in prompt_ids) | set(int(t) for t in output_ids)
    for t in seen:
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    return x - frequency * counts - presence * (counts > 0)


def mask(logits, ids):
    x = np.asarray(logits, np.float64).copy()
    x[list(ids)] = -np.inf
    return x


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = np.max(x)
    return x - m - np.log(np.sum(np.exp(x - m)))


def softmax(x):
    return np.exp(log_softmax(x))


def kept_ids(logits, temperature, min_p, top_k, top_p):
    """The set of ids a sampled row keeps (stages temperature → min_p → joint top-k/top-p).

    Also returns the smallest distance of a decision to its threshold, so that callers can avoid cases a
    float32 implementation may legitimately decide the other way.
    """
    x = np.asarray(logits, np.float64)
    p = softmax(x / temperature)
    threshold = min_p * p.max()
    alive = p >= threshold
    margin = np.min(np.abs(p - threshold)) / p.max() if min_p > 0 else np.inf
    q = np.where(alive, p, 0.0)
    q = q / q.sum()
    ids = np.arange(x.size)
    order = np.lexsort((ids, -q))  # last key first: probability descending, then id ascending
    vocab = x.size
    k_on = 1 <= top_k < vocab
    kept = set()
    before = 0.0
    for position, t in enumerate(order):
        by_k = (not k_on) or position < top_k
        by_p = top_p >= 1.0 or before <= top_p
        if top_p < 1.0:
            margin = min(margin, abs(before - top_p))
        if not (by_k and by_p):
            break
        kept.add(int(t))
        before += q[t]
    return {t for t in kept if alive[t]}, margin


def final_probs(logits, temperature, keep):
    x = np.asarray(logits, np.float64) / temperature
    z = np.full_like(x, -np.inf)
    idx = sorted(keep)
    z[idx] = x[idx]
    return softmax(z)


def draw(probs, bits):
    """Fixed-point inverse CDF: weights ``floor(p · 2^31)``, target ``(bits · Σw) >> 32``, first CDF > target."""
    weights = [int(np.floor(p * 2.0**31)) for p in probs]
    total = sum(weights)
    target = (int(bits) * total) >> 32
    acc = 0
    for t, w in enumerate(weights):
        acc += w
        if acc > target:
            return t
    raise AssertionError("target beyond the total weight")


def rank_and_top(logprobs, token, n):
    """1-based rank of ``token`` and the top-n ids, ordered by log-probability desc then id asc."""
    ids = np.arange(len(logprobs))
    order = np.lexsort((ids, -np.asarray(logprobs)))
    rank = int(np.flatnonzero(order == token)[0]) + 1
    return rank, order[:n]
