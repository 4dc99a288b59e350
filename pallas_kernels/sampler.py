"""Pallas (Triton) fused sampler: the token of op ``"sample"`` (``deepinfer_jax/sampling/pipeline.py``) in one
kernel, from the float32 logits and the row's :class:`~deepinfer_jax.sampling.tensors.SamplingTensors`.

One program per row walks the row's vocabulary ``block_v`` ids at a time. Nothing of the row is ever written
back: each pass reloads the logits (and the token counts) and recomputes the per-id values, which are
elementwise and cheap, so the only state carried between tiles is a handful of scalars.

1. **edits** (per tile, in the pipeline's order and with its own stage functions): ``logit_bias`` (added entry
   by entry in list order, like the reference's scatter-add), the repetition/presence/frequency penalties from
   the count state (:func:`deepinfer_jax.sampling.pipeline.apply_penalties`), ``masked_ids``, ``allowed_ids``,
   the grammar bitmask and, when the engine sets ``force_top_k``, the row's top-k cut (found by the value search
   below over the logits' order-preserving integer keys, ties by ascending id as ``lax.top_k``);
2. **pass 1**: the error flag (a NaN or +inf raw logit, or no finite edited logit), the maximum and the argmax
   (lowest id on ties: the greedy token);
3. a sampled row (temperature > 0) then runs, without any sort: **pass 2** the softmax denominator over the
   min_p survivors of the scaled logits ``m = (x - max) / T``; when the row filters (top-k < V or top-p < 1), a
   **threshold search**: a bisection over the order-preserving integer keys of ``m`` for the smallest key whose
   first id in (scaled logit desc, id asc) order is kept -- fewer than ``k`` ids above it and their probability
   mass ``<= top_p`` --, then, only when scaled logits tie there, a bisection over the ids for the last tied id
   that is kept (the reference's cut-off ``(cut_p, cut_id)``); **pass 3** the denominator over the kept ids.
   The cut is a key of ``m``, not a probability, because every pass recomputes ``exp(m)``, and a compiler may
   round the same ``exp`` differently in different passes (XLA:CPU did, in interpret mode, and dropped a
   tied id from one pass's kept set); ``m`` is exactly rounded, so every pass keeps the same ids;
4. **the draw** exactly as :func:`deepinfer_jax.sampling.rng.categorical_from_weights`: fixed-point weights
   ``floor(p · 2^31)``, their integer total, the target ``mulhi(bits, total)`` and the count of ids whose
   inclusive integer prefix sum is ``<= target`` (tile cumsums on top of a running integer prefix). The random
   word is the reference's, ``random_bits(seed, position)``, computed by :func:`sample_tokens` with the
   reference's own code; integer prefix sums are exact, so the draw does not depend on the tile size.

**Speculative modes** (ops ``"draft_sample"`` and ``"verify"``, ``deepinfer_jax/sampling/speculative.py``), the
same passes with a different ending:

* ``draft_tokens``: the draw uses the drafting stream's word, ignores ``golden`` and penalties, and one more
  pass writes the distribution drawn from: ``m - log z`` over the kept ids (-inf elsewhere), a point mass for a
  greedy row, all -inf for an unusable row (token -1);
* ``verify_tokens``: a verify row (not its sequence's fresh row) adds one pass for the residual mass
  ``Σ max(Q - e^{-ε} P, 0)`` (``P`` read from the draft's log-probabilities) and its draft's kept scaled
  logit, accepts with the reference's test ``u < exp(min(log Q(d) - log P(d), 0))`` (acceptance stream), and
  otherwise draws from the residual (residual stream; its argmax when the residual is empty); a fresh row
  draws as ``sample`` does; a greedy row accepts exactly its argmax; a golden token decides as in the reference.

Exactness. Every elementwise stage is the reference's expression, the maximum, the argmax and every integer sum
are exact, and the row is processed alone (batch-invariant by construction). Some float sums are not the
reference's: the softmax denominators, the top-p mass and the residual mass are summed tile by tile here, where
the reference sums the whole row (and takes the top-p mass from a cumsum over the sorted row). They agree to a
few ulps; a token can differ only when the random target falls within those few ulps of a weight boundary, top-p
lies within them of a partial mass, or two different scaled logits round to the same probability at the cut
(the reference orders them as a tie, by id). On a GPU ``exp`` is also Triton's rather than XLA's.

Cost, in passes over a row's logits (each reloads the logits, and the counts of a row with a penalty): a greedy
row 1; a sampled row 4; a sampled row that filters 38 (32 bisection steps), plus ``ceil(log2 V)`` when scaled
logits tie at the cut; ``force_top_k`` adds 33 (and its own tie search) to every row; a verify row 1 more (and
reads its draft row), a draft row 1 more (and writes it). The banned and allowed id lists are compared 16 entries
at a time.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from deepinfer_jax.sampling.pipeline import apply_penalties
from deepinfer_jax.sampling.rng import fixed_point_weights, mulhi_u32, random_bits
from deepinfer_jax.sampling.speculative import (
    ACCEPT_STREAM,
    DRAFT_STREAM,
    RESIDUAL_STREAM,
    _residual_weights,
    _uniform,
)
from pallas_kernels._common import cdiv, next_pow2

__all__ = ["SamplerTiles", "draft_tokens", "sample_tokens", "verify_tokens"]

_NEG_INF = float("-inf")
_KEY_ITERS = 32  # the whole int32 range of the logits' keys
_NEG_INF_KEY = -(2**31) + 0x007FFFFF  # the key of -inf: the least key of a non-NaN float32
_BELOW_ALL_KEYS = -(2**31)  # below every non-NaN key: a cut that keeps every id
_LIST_CHUNK = 16  # list entries compared per step (banned / allowed ids)
_KERNEL_NAMES = {"sample": "sample_tokens", "draft": "draft_tokens", "verify": "verify_tokens"}


@dataclasses.dataclass(frozen=True)
class SamplerTiles:
    """``block_v`` ids per tile (a power of two >= 16); Triton's warps. Untuned (no GPU has run it yet)."""

    block_v: int = 1024
    num_warps: int = 4


@dataclasses.dataclass(frozen=True)
class _Shape:
    vocab: int
    bv: int
    k_mask: int
    k_bias: int
    k_allowed: int
    words: int
    has_counts: bool
    force_top_k: int
    mode: str = "sample"  # "sample" | "draft" | "verify"

    @property
    def tiles(self) -> int:
        return cdiv(self.vocab, self.bv)

    @property
    def id_iters(self) -> int:
        return max(1, (self.vocab - 1).bit_length())


def _key(x: jax.Array) -> jax.Array:
    """An int32 key ordered like the float32 values (``-0.0 < +0.0``)."""
    b = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(b < 0, b ^ 0x7FFFFFFF, b)


def _unkey(k: jax.Array) -> jax.Array:
    """The float32 of a :func:`_key`."""
    return lax.bitcast_convert_type(jnp.where(k < 0, k ^ 0x7FFFFFFF, k), jnp.float32)


def _count(mask: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(mask, 1, 0).astype(jnp.int32))


def _bisect(pred: Any, lo: Any, hi: Any, iters: int) -> jax.Array:
    """The smallest int32 ``m`` in ``[lo, hi]`` with ``pred(m)`` (monotone, true at ``hi``)."""

    def body(_: jax.Array, c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = c
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        ok = pred(mid)
        done = lo >= hi
        return jnp.where(done | ok, lo, mid + 1), jnp.where(done | ~ok, hi, mid)

    lo, _ = lax.fori_loop(0, iters, body, (jnp.int32(lo), jnp.int32(hi)))
    return lo


def _when(pred: jax.Array, fn: Any, default: Any) -> Any:
    """``fn()`` if ``pred`` else ``default``, which must be computed values: Triton's ``scf.if`` cannot yield a
    literal, so the default travels as the conditional's operand."""
    return lax.cond(pred, lambda _: fn(), lambda d: d, default)


def _kernel(*refs: Any, s: _Shape) -> None:
    (
        logits_ref,
        counts_ref,
        temp_ref,
        top_p_ref,
        top_k_ref,
        min_p_ref,
        rep_ref,
        pres_ref,
        freq_ref,
        golden_ref,
        bits_ref,
        masked_ref,
        bias_ids_ref,
        bias_vals_ref,
        allowed_ref,
        bitmask_ref,
    ) = refs[:16]
    rest = refs[16:]
    if s.mode == "verify":
        draft_ref, dlp_ref, fresh_ref, acc_bits_ref, res_bits_ref, tok_ref, ok_ref, acc_ref, aprob_ref = rest
    elif s.mode == "draft":
        tok_ref, ok_ref, lp_ref = rest
    else:
        tok_ref, ok_ref = rest
    r = pl.program_id(0)
    vocab, bv = s.vocab, s.bv
    lane = jnp.arange(bv, dtype=jnp.int32)
    temp, top_p, top_k, min_p = temp_ref[r], top_p_ref[r], top_k_ref[r], min_p_ref[r]

    def tiles(fn: Any, init: Any) -> Any:
        return lax.fori_loop(0, s.tiles, fn, init)

    def listed(ids: jax.Array, ref: Any, width: int) -> jax.Array:
        """Whether each id is in the row's padded id list: ``[block_v, 16]`` comparisons per step, so a long
        ``allowed_token_ids`` list never becomes one huge register tile."""
        chunk = min(width, _LIST_CHUNK)

        def body(j: jax.Array, hit: jax.Array) -> jax.Array:
            entries = ref[r, j * chunk + jnp.arange(chunk, dtype=jnp.int32)]
            return jnp.maximum(hit, jnp.max(jnp.where(ids[:, None] == entries[None, :], 1, 0), axis=1))

        return lax.fori_loop(0, width // chunk, body, jnp.zeros((bv,), jnp.int32)) > 0

    def edited(t: jax.Array, force_cut: tuple[jax.Array, jax.Array] | None) -> tuple[jax.Array, ...]:
        """Tile ``t``: ids, in-vocabulary lanes, raw logits and the edited logits (-inf outside the vocabulary)."""
        ids = t * bv + lane
        valid = ids < vocab
        col = jnp.minimum(ids, vocab - 1)
        raw = logits_ref[r, col]
        x = raw
        if s.k_bias:

            def add(j: jax.Array, x: jax.Array) -> jax.Array:
                return jnp.where(ids == bias_ids_ref[r, j], x + bias_vals_ref[r, j], x)

            x = lax.fori_loop(0, s.k_bias, add, x)
        if s.has_counts:
            # neutral penalties are exact identities: a row without any reads no counts
            rep, pres, freq = rep_ref[r], pres_ref[r], freq_ref[r]
            x = _when(
                (rep != 1.0) | (pres != 0.0) | (freq != 0.0),
                lambda x=x: apply_penalties(x, counts_ref[r, col], rep, pres, freq),
                x,
            )
        if s.k_mask:
            x = jnp.where(listed(ids, masked_ref, s.k_mask), _NEG_INF, x)
        if s.k_allowed:
            x = jnp.where((allowed_ref[r, 0] < 0) | listed(ids, allowed_ref, s.k_allowed), x, _NEG_INF)
        if s.words:
            words = bitmask_ref[r, jnp.minimum(ids // 32, s.words - 1)]
            x = jnp.where(((words >> (ids % 32)) & 1) != 0, x, _NEG_INF)
        if force_cut is not None:
            key, cut_id = force_cut
            kx = _key(x)
            x = jnp.where((kx > key) | ((kx == key) & (ids <= cut_id)), x, _NEG_INF)
        return ids, valid, raw, jnp.where(valid, x, _NEG_INF)

    def tie_cut(is_tie: Any, need: jax.Array) -> jax.Array:
        """The id of the ``need``-th tied id (1-based, ascending ids): a bisection over the ids."""

        def pred(m: jax.Array) -> jax.Array:
            def f(t: jax.Array, n: jax.Array) -> jax.Array:
                ids, tie = is_tie(t)
                return n + _count(tie & (ids <= m))

            return tiles(f, jnp.int32(0)) >= need

        return _bisect(pred, 0, vocab - 1, s.id_iters)

    force_cut = None
    if s.force_top_k:
        kf = s.force_top_k

        def above(v: jax.Array) -> tuple[jax.Array, jax.Array]:
            def f(t: jax.Array, c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
                _, valid, _, x = edited(t, None)
                kx = _key(x)
                return c[0] + _count(valid & (kx > v)), c[1] + _count(valid & (kx == v))

            return tiles(f, (jnp.int32(0), jnp.int32(0)))

        imin, imax = -(2**31), 2**31 - 1
        fkey = _bisect(lambda v: above(v)[0] < kf, imin, imax, _KEY_ITERS)
        n_gt, n_eq = above(fkey)
        need = kf - n_gt  # ties kept: the first `need` ids of value `fkey`

        def tied(t: jax.Array) -> tuple[jax.Array, jax.Array]:
            ids, valid, _, x = edited(t, None)
            return ids, valid & (_key(x) == fkey)

        fid = _when(need < n_eq, lambda: tie_cut(tied, need), need * 0 + vocab)
        force_cut = (fkey, fid)

    # pass 1: error flag, maximum, argmax (lowest id on ties)
    def first(t: jax.Array, c: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        bad, finite, peak, arg = c
        _, valid, raw, x = edited(t, force_cut)
        bad = bad + _count(valid & ((raw != raw) | (raw == jnp.inf)))
        finite = finite + _count(valid & (jnp.abs(x) < jnp.inf))
        m = jnp.max(x)
        a = t * bv + jnp.argmax(x).astype(jnp.int32)
        return bad, finite, jnp.maximum(peak, m), jnp.where(m > peak, a, arg)

    init = (jnp.int32(0), jnp.int32(0), jnp.float32(_NEG_INF), jnp.int32(0))
    bad, finite, peak, argmax = tiles(first, init)
    ok = (bad == 0) & (finite > 0)
    sampled = temp > 0

    t_ = jnp.where(sampled, temp, 1.0)

    def masked(t: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Tile ``t``'s ids, in-vocabulary lanes and min_p-filtered scaled logits ``(x - max) / T``."""
        ids, valid, _, x = edited(t, force_cut)
        scaled = (x - peak) / t_
        return ids, valid, jnp.where(jnp.exp(scaled) >= min_p, scaled, _NEG_INF)

    def kept(ids: jax.Array, valid: jax.Array, m: jax.Array, ck: jax.Array, cid: jax.Array) -> jax.Array:
        """The ids the cut ``(ck, cid)`` keeps: scaled-logit key above ``ck``, or equal to it up to id ``cid``."""
        km = _key(m)
        return valid & ((km > ck) | ((km == ck) & (ids <= cid)))

    if s.mode == "verify":
        draft = draft_ref[r]
        resid = fresh_ref[r] == 0  # a verify row: a rejected draft draws from the residual
        has_draft = (draft >= 0) & (draft < vocab)

    def draw() -> tuple[jax.Array, ...]:
        """A sampled usable row: ``(token, cut key, cut id, z2, mass, draft_value)``: its draw, its filter cut
        and kept mass, and (verify) its residual mass and its draft's scaled logit (-inf when not kept)."""

        def total(keep: Any) -> jax.Array:
            def f(t: jax.Array, z: jax.Array) -> jax.Array:
                ids, valid, m = masked(t)
                e = jnp.exp(m)
                return z + jnp.sum(jnp.where(keep(ids, valid, e), e, 0.0))

            return tiles(f, jnp.float32(0.0))

        z1 = total(lambda ids, valid, e: valid)

        def cut() -> tuple[jax.Array, jax.Array, jax.Array]:
            # The cut is found over the order-preserving integer keys of the scaled logits ``m`` rather than over
            # the probabilities: each pass recomputes ``exp(m)``, which a compiler may round differently in
            # different passes (XLA:CPU did, in the interpreter), while ``m`` itself is exactly rounded. The keep
            # rule compares keys only, so every pass keeps the same ids.
            def above(v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
                def f(t: jax.Array, c: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
                    _, valid, m = masked(t)
                    km = _key(m)
                    gt = valid & (km > v)
                    p = jnp.exp(m) / z1
                    return (
                        c[0] + _count(gt),
                        c[1] + jnp.sum(jnp.where(gt, p, 0.0)),
                        c[2] + _count(valid & (km == v)),
                    )

                return tiles(f, (jnp.int32(0), jnp.float32(0.0), jnp.int32(0)))

            def kept_first(v: jax.Array) -> jax.Array:
                n, mass, _ = above(v)
                return (n < top_k) & ((top_p >= 1.0) | (mass <= top_p))

            ck = _bisect(kept_first, _NEG_INF_KEY, 0, _KEY_ITERS)  # the scaled logits are <= +0.0
            n_gt, mass_gt, n_eq = above(ck)
            c = jnp.exp(_unkey(ck)) / z1  # the cut id's probability
            # ties at c: the r-th (0-based, ascending ids) is kept while n_gt + r < k and mass_gt + r·c <= top_p
            by_mass = jnp.floor((top_p - mass_gt) / jnp.where(c > 0, c, 1.0))
            by_mass = jnp.where(top_p >= 1.0, vocab, jnp.minimum(by_mass, vocab).astype(jnp.int32))
            need = jnp.minimum(top_k - n_gt, by_mass + 1)  # how many tied ids are kept (>= 1)

            def tied(t: jax.Array) -> tuple[jax.Array, jax.Array]:
                ids, valid, m = masked(t)
                return ids, valid & (_key(m) == ck)

            cid = _when((c > 0) & (need < n_eq), lambda: tie_cut(tied, need), need * 0 + vocab)

            return ck, cid, keep_total(ck, cid)

        def keep_total(ck: jax.Array, cid: jax.Array) -> jax.Array:
            def f(t: jax.Array, z: jax.Array) -> jax.Array:
                ids, valid, m = masked(t)
                return z + jnp.sum(jnp.where(kept(ids, valid, m, ck, cid), jnp.exp(m), 0.0))

            return tiles(f, jnp.float32(0.0))

        filtering = (top_k < vocab) | (top_p < 1.0)
        no_cut = (top_k * 0 + _BELOW_ALL_KEYS, top_k * 0 + vocab, z1)  # keep every id
        c, cid, z2 = _when(filtering, cut, no_cut)

        def target_probs(t: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
            """ids, lanes, scaled logits and the target distribution ``Q`` (0 where filtered) of tile ``t``."""
            ids, valid, m = masked(t)
            keep = kept(ids, valid, m, c, cid)
            return ids, valid, jnp.where(keep, m, _NEG_INF), jnp.where(keep, jnp.exp(m) / z2, 0.0)

        bits = bits_ref[r]
        mass = draft_value = z2 * 0.0
        if s.mode == "verify":

            def residual(ids: jax.Array, valid: jax.Array, q: jax.Array) -> jax.Array:
                """``max(Q - e^{-ε} P, 0)`` of a tile, ``P`` the draft's distribution."""
                p = jnp.exp(dlp_ref[r, jnp.minimum(ids, vocab - 1)])
                return jnp.where(valid, _residual_weights(q, p), 0.0)

            def residual_mass() -> tuple[jax.Array, jax.Array]:
                def f(t: jax.Array, acc: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
                    ids, valid, kept, q = target_probs(t)
                    w = residual(ids, valid, q)
                    # the draft's lane, if kept: found with sums (at most one lane of the row matches), since
                    # XLA:CPU miscompiled a max beside this sum in the interpreted kernel's one-tile loop
                    at = (ids == draft) & (kept > _NEG_INF)
                    return (
                        acc[0] + jnp.sum(w),
                        acc[1] + _count(at),
                        acc[2] + jnp.sum(jnp.where(at, kept, 0.0)),
                    )

                mass, found, value = tiles(f, (jnp.float32(0.0), jnp.int32(0), jnp.float32(0.0)))
                return mass, jnp.where(found > 0, value, _NEG_INF)

            mass, draft_value = _when(resid, residual_mass, (mass, mass + _NEG_INF))
            denominator = jnp.where(mass > 0, mass, 1.0)
            bits = jnp.where(resid, res_bits_ref[r], bits)

        def weights(t: jax.Array) -> tuple[jax.Array, jax.Array]:
            ids, valid, _, q = target_probs(t)
            w = fixed_point_weights(q)
            if s.mode == "verify":
                rw = fixed_point_weights(residual(ids, valid, q) / denominator)
                w = jnp.where(resid, rw, w)
            return valid, w

        def weight_sum(t: jax.Array, w: jax.Array) -> jax.Array:
            return w + jnp.sum(weights(t)[1], dtype=jnp.uint32)

        target = mulhi_u32(bits, tiles(weight_sum, jnp.uint32(0)))

        def find(t: jax.Array, c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            below, n = c
            valid, w = weights(t)
            cdf = below + lax.cumsum(w, axis=0)
            return below + jnp.sum(w, dtype=jnp.uint32), n + _count(valid & (cdf <= target))

        _, index = tiles(find, (jnp.uint32(0), jnp.int32(0)))
        token = jnp.minimum(index, vocab - 1)
        if s.mode == "verify":  # an empty residual: the lowest id of the largest processed logit
            token = jnp.where(resid & (mass <= 0), argmax, token)
        return token, c, cid, z2, mass, draft_value

    zero = peak * 0.0
    no_draw = (
        argmax * 0,
        argmax * 0 + _BELOW_ALL_KEYS,
        argmax * 0 + vocab,
        zero + 1.0,
        zero,
        zero + _NEG_INF,
    )
    drawn, c, cid, z2, mass, draft_value = _when(sampled & ok, draw, no_draw)
    token = jnp.where(sampled, drawn, argmax)

    if s.mode == "sample":
        golden = golden_ref[r]
        token = jnp.where(golden >= 0, golden, token)
        tok_ref[r] = jnp.where(ok, token, 0)
    elif s.mode == "draft":  # golden ignored; the distribution the draft was drawn from is written out
        tok_ref[r] = jnp.where(ok, token, -1)
        log_z = jnp.log(z2)

        def write(t: jax.Array, carry: jax.Array) -> jax.Array:
            ids, valid, m = masked(t)
            lp = jnp.where(kept(ids, valid, m, c, cid), m - log_z, _NEG_INF)
            lp = jnp.where(sampled, lp, jnp.where(ids == token, 0.0, _NEG_INF))
            lp = jnp.where(ok, lp, _NEG_INF)
            pl_triton.store(lp_ref.at[r, jnp.where(valid, ids, vocab)], lp, mask=valid)
            return carry

        tiles(write, jnp.int32(0))
    else:  # verify
        golden = golden_ref[r]
        u = _uniform(acc_bits_ref[r])
        in_support = has_draft & (draft_value > _NEG_INF)
        log_ratio = draft_value - jnp.log(z2) - dlp_ref[r, jnp.clip(draft, 0, vocab - 1)]
        accept_sampled = in_support & (u < jnp.exp(jnp.minimum(log_ratio, 0.0)))
        hit = has_draft & (draft == argmax)
        accept = jnp.where(sampled, accept_sampled, hit)
        accept_prob = jnp.where(sampled, jnp.maximum(1.0 - mass, 0.0), hit.astype(jnp.float32))
        accept = jnp.where(golden >= 0, has_draft & (draft == golden), accept)
        candidate = jnp.where(golden >= 0, golden, token)
        accept = accept & resid & ok
        tok_ref[r] = jnp.where(ok, jnp.where(accept, draft, candidate), -1)
        acc_ref[r] = jnp.where(accept, 1, 0).astype(jnp.int32)
        aprob_ref[r] = jnp.where(ok & resid, accept_prob, 0.0)
    ok_ref[r] = jnp.where(ok, 1, 0).astype(jnp.int32)


def _padded(a: jax.Array, fill: Any) -> jax.Array:
    """``[S, K]`` padded on the right to a power of two (Triton's tensor shapes); ``K = 0`` stays 0."""
    k = a.shape[1]
    if k == 0 or k & (k - 1) == 0:
        return a
    return jnp.pad(a, ((0, 0), (0, next_pow2(k, 1) - k)), constant_values=fill)


def _launch(
    mode: str,
    logits: jax.Array,
    st: Any,
    token_counts: jax.Array | None,
    extras: tuple[jax.Array, ...],
    *,
    bits: jax.Array,
    force_top_k: int,
    tiles: SamplerTiles | None,
    interpret: bool,
) -> tuple[jax.Array, ...]:
    """One program per row of :func:`_kernel` in ``mode``; its int32/float32 outputs."""
    rows, vocab = logits.shape
    tiles = tiles or SamplerTiles()
    bv = min(next_pow2(tiles.block_v), next_pow2(vocab))
    i32, f32 = jnp.int32, jnp.float32
    masked = _padded(jnp.asarray(st.masked_ids, i32), -1)
    bias_ids = _padded(jnp.asarray(st.bias_ids, i32), -1)
    bias_vals = _padded(jnp.asarray(st.bias_values, f32), 0.0)
    allowed = _padded(jnp.asarray(st.allowed_ids, i32), -1)
    bitmask = jnp.asarray(st.token_bitmask, i32)
    shape = _Shape(
        vocab=vocab,
        bv=bv,
        k_mask=masked.shape[1],
        k_bias=bias_ids.shape[1],
        k_allowed=allowed.shape[1],
        words=bitmask.shape[1],
        has_counts=token_counts is not None,
        force_top_k=min(int(force_top_k), vocab),
        mode=mode,
    )
    dummy_i = jnp.zeros((1, 1), i32)
    args = (
        logits.astype(f32),
        dummy_i if token_counts is None else jnp.asarray(token_counts, i32),
        *(jnp.asarray(a, f32) for a in (st.temperature, st.top_p)),
        jnp.asarray(st.top_k, i32),
        *(jnp.asarray(a, f32) for a in (st.min_p, st.repetition_penalty, st.presence_penalty)),
        jnp.asarray(st.frequency_penalty, f32),
        jnp.asarray(st.golden, i32),
        bits,
        masked if shape.k_mask else dummy_i,
        bias_ids if shape.k_bias else dummy_i,
        bias_vals if shape.k_bias else jnp.zeros((1, 1), f32),
        allowed if shape.k_allowed else dummy_i,
        bitmask if shape.words else dummy_i,
        *extras,
    )
    out_shape = [jax.ShapeDtypeStruct((rows,), i32), jax.ShapeDtypeStruct((rows,), i32)]
    if mode == "verify":
        out_shape += [jax.ShapeDtypeStruct((rows,), i32), jax.ShapeDtypeStruct((rows,), f32)]
    elif mode == "draft":
        out_shape.append(jax.ShapeDtypeStruct((rows, vocab), f32))
    return pl.pallas_call(
        functools.partial(_kernel, s=shape),
        out_shape=tuple(out_shape),
        grid=(rows,),
        compiler_params=pl_triton.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret,
        name=_KERNEL_NAMES[mode],
    )(*args)


def sample_tokens(
    logits: jax.Array,
    st: Any,
    token_counts: jax.Array | None = None,
    *,
    force_top_k: int = 0,
    tiles: SamplerTiles | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The fused sampler: ``(tokens int32 [S], ok bool [S])`` of op ``"sample"`` for float32 ``logits [S, V]``.

    ``st`` is the step's :class:`~deepinfer_jax.sampling.tensors.SamplingTensors`; ``token_counts`` its count
    state (``None``: no penalties); ``force_top_k`` the engine's static setting (0 = off). The tokens are the
    reference's (module docstring for the float sums); the reported log-probabilities are not computed here.
    """
    rows = logits.shape[0]
    if rows == 0:
        return jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.bool_)
    bits = random_bits(st.seed, st.position)  # the reference's random word of each row
    tokens, ok = _launch(
        "sample",
        logits,
        st,
        token_counts,
        (),
        bits=bits,
        force_top_k=force_top_k,
        tiles=tiles,
        interpret=interpret,
    )
    return tokens, ok != 0


def draft_tokens(
    logits: jax.Array,
    st: Any,
    *,
    force_top_k: int = 0,
    tiles: SamplerTiles | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Drafting (op ``"draft_sample"``): ``(tokens int32 [S], logprobs float32 [S, V])``.

    One draft per row from its processed distribution without penalties (``st.golden`` ignored), drawn with the
    drafting stream's random word, and the log-distribution it was drawn from: ``scaled - log z`` over the kept
    ids (-inf elsewhere), a point mass for a greedy row, all -inf (and token -1) for an unusable row.
    """
    rows, vocab = logits.shape
    if rows == 0:
        return jnp.zeros((0,), jnp.int32), jnp.zeros((0, vocab), jnp.float32)
    bits = random_bits(st.seed, st.position, DRAFT_STREAM)
    tokens, _, logprobs = _launch(
        "draft", logits, st, None, (), bits=bits, force_top_k=force_top_k, tiles=tiles, interpret=interpret
    )
    return tokens, logprobs


def verify_tokens(
    logits: jax.Array,
    st: Any,
    token_counts: jax.Array | None,
    drafts: jax.Array,
    draft_logprobs: jax.Array,
    is_fresh: jax.Array,
    *,
    force_top_k: int = 0,
    tiles: SamplerTiles | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Verification rows (op ``"verify"``), one row each: ``(token, accept, accept_prob, ok)``.

    ``drafts [S]`` the draft each row checks (-1: none), ``draft_logprobs [S, V]`` the distribution it was drawn
    from, ``is_fresh [S]`` the sequence's fresh row. ``token`` is the draft if accepted, else the row's candidate
    (the residual draw, the fresh row's sample, the argmax of a greedy row, the golden token), -1 for an unusable
    row; ``accept_prob`` as :class:`~deepinfer_jax.sampling.speculative.VerifyOutput` says (0 on fresh rows).
    """
    rows = logits.shape[0]
    if rows == 0:
        z = jnp.zeros((0,), jnp.int32)
        return z, z.astype(jnp.bool_), z.astype(jnp.float32), z.astype(jnp.bool_)
    extras = (
        jnp.asarray(drafts, jnp.int32),
        jnp.asarray(draft_logprobs, jnp.float32),
        jnp.asarray(is_fresh).astype(jnp.int32),
        random_bits(st.seed, st.position, ACCEPT_STREAM),
        random_bits(st.seed, st.position, RESIDUAL_STREAM),
    )
    bits = random_bits(st.seed, st.position)  # the fresh row's draw: sample()'s own word
    token, ok, accept, accept_prob = _launch(
        "verify",
        logits,
        st,
        token_counts,
        extras,
        bits=bits,
        force_top_k=force_top_k,
        tiles=tiles,
        interpret=interpret,
    )
    return token, accept != 0, accept_prob, ok != 0
