"""The device side of a speculative engine step: verification rows, acceptance, and the next drafts.

A step of an engine built with ``K = num_draft_tokens > 0`` runs here instead of the plain path of
:func:`deepinfer_jax.engine.step.device_step` (``docs/speculative.md``). For one device's tokens it

1. **places the decode rows** (``SpecInputs.shifted``): the host plans them at a guessed first position (the
   fewest tokens its in-flight steps can have emitted); the device moves them to where the slot's pending token
   really is, ``state.next_pos[slot]``, together with their context lengths and the positions their samples
   are keyed by. So the host never needs a step's accepted count to schedule the next step, and one step stays
   in flight;
2. **assembles** the tokens: ``-1`` is the slot's last sampled token, ``-2`` at offset ``j`` of a row is the
   slot's draft ``j`` from the draft pool in the state (``state.drafts``);
3. records the non-draft input tokens in the penalty counts (drafts enter only once accepted);
4. runs the **model** to its LM-head input over every token, and the LM head on each row's verification rows:
   a row with ``n`` drafts (``SpecInputs.num_drafts``) has ``n + 1`` of them, its last ``n + 1`` tokens; the
   logits of token ``j`` verify draft ``j + 1`` and the last one is the fresh row (a row without drafts is the
   plain case: its last token samples);
5. **verifies** with :func:`deepinfer_jax.sampling.speculative.verify` (the penalties of verify row ``j`` see the
   drafts before it): the accepted prefix and the bonus token;
6. **advances the state** of every sampling row: the bonus token becomes ``last_tokens``, its position
   ``next_pos``, the accepted drafts enter the counts;
7. **drafts** the next step's ``K`` tokens with the model's draft layer (V3's MTP layer): every token of the
   step is paired with the token after it (the next input token of its row; the bonus token after the last
   accepted one; the next prompt token, ``SpecInputs.next_ids``, after a prefill chunk that does not sample), the
   draft layer writes its own cache at every position, and its head at the last accepted position proposes
   draft 1. Drafts 2..K run the draft layer again, one token per row, on its own output and the previous draft
   (SGLang's NextN does the same). Drafts are drawn with the request's own sampling parameters (no penalties) and
   their distributions kept for the next verification (``state.draft_logprobs``).

Rejected positions need no rollback: their cache entries (main and draft layers) lie past the bonus token's
position and are written again, in position order, before any later token reads them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.cache.ragged import make_meta
from deepinfer_jax.engine.spec_device import repack_rows, resplit
from deepinfer_jax.models.paged import PagedModel
from deepinfer_jax.sampling import reset_token_counts, update_token_counts
from deepinfer_jax.sampling.speculative import draft_sample, verify
from deepinfer_jax.sampling.tensors import SamplingTensors

__all__ = ["DRAFT_TOKEN", "spec_device_step"]

DRAFT_TOKEN = -2
"""Token id meaning "the slot's next draft token from the draft pool" (the plan's marker for draft inputs)."""


def _rows_of(st: SamplingTensors, width: int) -> SamplingTensors:
    """Every field of ``st`` (``[S, ...]``) repeated for ``width`` verification rows: ``[S, width, ...]``."""
    return SamplingTensors(*(jnp.repeat(a[:, None], width, axis=1) for a in st))


def spec_device_step(
    params: Any,
    cache: Any,
    state: Any,
    inputs: Any,
    *,
    model: PagedModel,
    num_draft_tokens: int,
    num_logprobs: int,
    num_prompt_logprobs: int,
    batch_invariant: bool,
    sampler: Any,
    tile: int | None,
    confidence_temperature: tuple[float, ...] = (1.0,),
    stage: str = "all",
    carry: Any = None,
) -> tuple[Any, Any, Any]:
    """One device's speculative step (module docstring): ``(cache, state, outputs)``.

    ``stage="forward"`` stops after the model and the LM head and returns ``(cache, state, carry)``: the
    verification rows' logits, the prompt logprobs and (MTP drafting) the hidden states. ``stage="sample"``
    takes that ``carry``, recomputes steps 1-3 (cheap, and the same: ``state`` is the one the forward half
    returned, which it did not change) and does steps 5-7 with the plan's grammar masks, filled meanwhile.

    ``outputs`` holds ``tokens [S, K + 1]`` (the emitted tokens of each row: accepted drafts, then the bonus),
    ``num_accepted [S]``, their ``logprob`` / ``rank`` ``[S, K + 1]`` and ``top_ids`` / ``top_logprobs``
    ``[S, K + 1, n]``, ``accept_prob [S, K]``, the next drafts' ``confidences [S, K]`` (for variable-length
    verification), and ``prompt`` (or ``None``).
    """
    from deepinfer_jax.engine.step import prompt_logprobs

    k = num_draft_tokens
    spec = inputs.spec
    if spec.realloc is not None and num_prompt_logprobs < 0:  # per-token outputs keep the host's layout
        inputs = _resplit_rows(inputs, state, k)
        spec = inputs.spec
    num_seqs = inputs.seq_slots.shape[0]
    num_tokens = inputs.token_ids.shape[0]
    num_slots = state.last_tokens.shape[0]
    vocab = state.token_counts.shape[1]
    real = inputs.token_seq < num_seqs
    row = jnp.where(real, inputs.token_seq, 0)
    seq_slot = jnp.clip(inputs.seq_slots, 0, num_slots - 1)
    slot_of_token = seq_slot[row]
    starts = inputs.query_start[:-1]
    ends = inputs.query_start[1:]
    lengths = ends - starts
    nd = jnp.where(inputs.seq_slots >= 0, spec.num_drafts, 0)

    # 1. Decode rows move to the device's own position of their pending token.
    first_pos = inputs.positions[jnp.clip(starts, 0, num_tokens - 1)]
    shift = jnp.where(spec.shifted & (inputs.seq_slots >= 0), state.next_pos[seq_slot] - first_pos, 0)
    positions = jnp.where(real, inputs.positions + shift[row], 0)
    context_lens = jnp.where(inputs.seq_slots >= 0, inputs.context_lens + shift, 0)

    # 2. Each row's drafts (the slot's pool, or the test hook's forced drafts as point masses), and the tokens:
    # pending -> last sampled token, draft j -> the row's draft j.
    drafts = state.drafts[seq_slot]  # [S, K]
    draft_lps = state.draft_logprobs[seq_slot]
    if spec.forced is not None:
        forced = spec.forced >= 0
        drafts = jnp.where(forced, spec.forced, drafts)
        point = jnp.where(jax.nn.one_hot(drafts, vocab, dtype=jnp.bool_), 0.0, -jnp.inf)
        draft_lps = jnp.where(forced[..., None], point, draft_lps)
    offset = jnp.arange(num_tokens, dtype=jnp.int32) - starts[row]
    pool = drafts[row, jnp.clip(offset - 1, 0, k - 1)]
    token_ids = inputs.token_ids
    is_draft = real & (token_ids == DRAFT_TOKEN)
    token_ids = jnp.where(token_ids == -1, state.last_tokens[slot_of_token], token_ids)
    token_ids = jnp.where(is_draft, pool, token_ids)
    token_ids = jnp.where(real, token_ids, 0)

    # 3. Penalty counts: every input but the drafts, before the rows sample.
    fresh = (lengths > 0) & (first_pos == 0)
    counts = reset_token_counts(state.token_counts, jnp.where(fresh, inputs.seq_slots, -1))
    token_slots = jnp.where(real & ~is_draft, inputs.seq_slots[row], -1)
    counts = update_token_counts(counts, token_slots, token_ids, positions < inputs.prompt_lens[row])

    # 4. The model, and the LM head on every verification row.
    meta = make_meta(
        inputs.token_seq,
        positions,
        inputs.query_start,
        context_lens,
        inputs.seq_slots,
        inputs.block_tables,
        inputs.snapshots,
        inputs.replay_from,
    )
    j = jnp.arange(k + 1, dtype=jnp.int32)
    if stage == "sample":
        hidden, logits, prompt_out = carry
    else:
        hidden, cache = model.forward_hidden(params, cache, token_ids, meta, tile=tile)
        verify_index = jnp.clip(
            ends[:, None] - 1 - nd[:, None] + jnp.minimum(j[None], nd[:, None]), 0, num_tokens - 1
        )
        prompt_out = None
        if num_prompt_logprobs >= 0:
            all_logits = model.head(params, hidden, tile=tile)
            prompt_out = prompt_logprobs(
                all_logits, inputs.prompt_targets, num_prompt_logprobs, batch_invariant=batch_invariant
            )
            logits = all_logits[verify_index.reshape(-1)]
        else:
            logits = model.head(params, hidden[verify_index.reshape(-1)], tile=tile)
        logits = logits.reshape(num_seqs, k + 1, vocab)
        if stage == "forward":
            return cache, state, (hidden if model.draft_kind != "dspark" else None, logits, prompt_out)

    # 5. Verification. Row j samples the token at (its position + 1); the host keyed the last row.
    st = inputs.sampling._replace(position=inputs.sampling.position + shift)
    rows_st = _rows_of(st, k + 1)
    rows_st = rows_st._replace(position=rows_st.position - nd[:, None] + j[None])
    if spec.verify_masks is not None:  # grammar masks of each verify row (structured outputs with drafts)
        rows_st = rows_st._replace(token_bitmask=spec.verify_masks)
    used = jnp.arange(k, dtype=jnp.int32)[None] < nd[:, None]
    onehot = jax.nn.one_hot(jnp.where(used, drafts, vocab), vocab, dtype=jnp.int32)  # vocab -> all zeros
    before = jnp.concatenate([jnp.zeros_like(onehot[:, :1]), jnp.cumsum(onehot, axis=1)], axis=1)
    row_counts = counts[seq_slot][:, None] + before  # [S, K + 1, V]
    out = verify(
        logits,
        rows_st,
        row_counts,
        jnp.where(used, drafts, -1),
        draft_lps,
        nd,
        num_logprobs=num_logprobs,
        logprobs_mode=sampler.logprobs_mode,
        force_top_k=sampler.force_top_k,
        batch_invariant=batch_invariant,
    )
    accepted = out.num_accepted
    # §8.7: how far the drafts' confidences were from the acceptance probabilities the verification found.
    conf_error = jnp.sum(jnp.where(used, jnp.abs(out.accept_prob - state.draft_conf[seq_slot]), 0.0), axis=1)
    bonus = jnp.take_along_axis(out.tokens, accepted[:, None], axis=1)[:, 0]
    ok = bonus >= 0

    # 6. State of the sampling rows.
    writes = inputs.sample & (inputs.seq_slots >= 0)
    target = jnp.where(writes, inputs.seq_slots, num_slots)
    bonus_pos = context_lens - nd + accepted  # the position of the bonus token (the next pending input)
    last_tokens = state.last_tokens.at[target].set(jnp.where(ok, bonus, 0), mode="drop")
    next_pos = state.next_pos.at[target].set(bonus_pos, mode="drop")
    took = writes[:, None] & (jnp.arange(k, dtype=jnp.int32)[None] < accepted[:, None])
    counts = update_token_counts(
        counts, jnp.where(took, inputs.seq_slots[:, None], -1).reshape(-1), drafts.reshape(-1)
    )

    # 7. The next drafts.
    draft_st = st._replace(golden=jnp.full_like(st.golden, -1))
    sampling_row = writes & ok
    if model.draft_kind == "dspark":
        tokens_k, logprobs_k, confidences_k, cache = _dspark_drafts(
            params,
            cache,
            model,
            k,
            jnp.where(ok, bonus, 0),
            bonus_pos,
            jnp.where(sampling_row, inputs.seq_slots, -1),
            draft_st,
            sampler=sampler,
            batch_invariant=batch_invariant,
            tile=tile,
            confidence_temperature=confidence_temperature,
        )
    else:
        tokens_k, logprobs_k, confidences_k, cache = _mtp_drafts(
            params,
            cache,
            model,
            k,
            hidden,
            token_ids,
            inputs,
            meta,
            offset,
            row,
            real,
            lengths,
            nd,
            accepted,
            bonus,
            bonus_pos,
            sampling_row,
            draft_st,
            vocab=vocab,
            sampler=sampler,
            batch_invariant=batch_invariant,
            tile=tile,
            confidence_temperature=confidence_temperature,
        )
    new_drafts = jnp.stack(tokens_k, axis=1)
    new_logprobs = jnp.stack(logprobs_k, axis=1)
    pool_target = jnp.where(sampling_row, inputs.seq_slots, num_slots)
    state = state._replace(
        last_tokens=last_tokens,
        token_counts=counts,
        next_pos=next_pos,
        drafts=state.drafts.at[pool_target].set(new_drafts, mode="drop"),
        draft_logprobs=state.draft_logprobs.at[pool_target].set(new_logprobs, mode="drop"),
        draft_conf=state.draft_conf.at[pool_target].set(jnp.stack(confidences_k, axis=1), mode="drop"),
    )
    tokens = jnp.where(out.ok, out.tokens, -1).astype(jnp.int32)
    outputs = {
        "tokens": tokens,
        "num_accepted": jnp.where(ok, accepted, 0).astype(jnp.int32),
        "logprob": out.logprob,
        "rank": out.rank,
        "top_ids": out.top_ids,
        "top_logprobs": out.top_logprobs,
        "accept_prob": out.accept_prob,
        "confidences": jnp.stack(confidences_k, axis=1),
        "confidence_error": jnp.where(writes, conf_error, 0.0),
        "drafts": jnp.where(sampling_row[:, None], new_drafts, -1),
        "num_drafts": nd.astype(jnp.int32),
        "prompt": prompt_out,
    }
    return cache, state, outputs


def _resplit_rows(inputs: Any, state: Any, k: int) -> Any:
    """Variable-length verification's device re-allocation: the rows the host's planner split
    (``SpecInputs.realloc``) are split again with the pool's confidences, which are a step fresher than the
    host's, keeping their total; the ragged layout is re-packed for the new verify lengths (the known tokens keep
    their data, the draft slots follow them). The outputs report each row's drafts (``num_drafts``)."""
    spec = inputs.spec
    num_slots = state.draft_conf.shape[0]
    slots = jnp.clip(inputs.seq_slots, 0, num_slots - 1)
    eligible = spec.realloc & (inputs.seq_slots >= 0)
    new_nd = resplit(state.draft_conf[slots], spec.num_drafts, eligible, k)
    rp = repack_rows(
        inputs.token_ids,
        inputs.positions,
        inputs.token_seq,
        inputs.query_start,
        inputs.context_lens,
        spec.num_drafts,
        new_nd,
        draft_token=DRAFT_TOKEN,
    )
    targets = inputs.prompt_targets
    if targets is not None:
        targets = jnp.where(rp.source >= 0, targets[jnp.clip(rp.source, 0, targets.shape[0] - 1)], -1)
    moved = (new_nd - spec.num_drafts).astype(inputs.sampling.position.dtype)
    return inputs._replace(
        token_ids=rp.token_ids,
        positions=rp.positions,
        token_seq=rp.token_seq,
        query_start=rp.query_start,
        context_lens=rp.context_lens,
        prompt_targets=targets,
        sampling=inputs.sampling._replace(position=inputs.sampling.position + moved),
        spec=spec._replace(num_drafts=new_nd),
    )


def _temperature(confidence_temperature: tuple[float, ...], i: int) -> float:
    """The confidence temperature of draft position ``i`` (the last value repeats), at least ``1e-5``."""
    return max(confidence_temperature[min(i, len(confidence_temperature) - 1)], 1e-5)


def _draw(
    logits: jax.Array, draft_st: SamplingTensors, position: jax.Array, sampler: Any, batch_invariant: bool
) -> tuple[jax.Array, jax.Array]:
    """A draft token per row with the request's own sampling parameters (no penalties), keyed at
    ``position``: ``(token [S], log-distribution [S, V])``."""
    return draft_sample(
        logits,
        draft_st._replace(position=position),
        force_top_k=sampler.force_top_k,
        batch_invariant=batch_invariant,
    )


def _mtp_drafts(
    params: Any,
    cache: Any,
    model: PagedModel,
    k: int,
    hidden: jax.Array,
    token_ids: jax.Array,
    inputs: Any,
    meta: Any,
    offset: jax.Array,
    row: jax.Array,
    real: jax.Array,
    lengths: jax.Array,
    nd: jax.Array,
    accepted: jax.Array,
    bonus: jax.Array,
    bonus_pos: jax.Array,
    sampling_row: jax.Array,
    draft_st: SamplingTensors,
    *,
    vocab: int,
    sampler: Any,
    batch_invariant: bool,
    tile: int | None,
    confidence_temperature: tuple[float, ...],
) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array], Any]:
    """V3's MTP drafts: token ``t`` pairs with the token after it, the row's last accepted token with the
    bonus; drafts ``2..k`` run the MTP layer again on its own output (module docstring, step 7)."""
    num_tokens = token_ids.shape[0]
    num_seqs = inputs.seq_slots.shape[0]
    starts = inputs.query_start[:-1]
    last_valid = jnp.where(inputs.sample, lengths - 1 - nd + accepted, lengths - 1)  # per row, an offset
    after = jnp.where(inputs.sample, bonus, inputs.spec.next_ids)
    shifted_ids = jnp.concatenate([token_ids[1:], jnp.zeros((1,), token_ids.dtype)])
    next_ids = jnp.where(
        offset == last_valid[row], after[row], jnp.where(offset < last_valid[row], shifted_ids, 0)
    )
    next_ids = jnp.where(real, jnp.clip(next_ids, 0, vocab - 1), 0)
    draft_h, cache = model.draft_hidden(params, cache, hidden, next_ids, meta, tile=tile)
    h = draft_h[jnp.clip(starts + last_valid, 0, num_tokens - 1)]  # [S, H]
    tokens_k: list[jax.Array] = []
    logprobs_k: list[jax.Array] = []
    confidences_k: list[jax.Array] = []
    seq_index = jnp.arange(num_seqs, dtype=jnp.int32)
    for i in range(k):
        if i:
            # Draft i + 1: the draft layer on its own output and draft i, at the position of draft i - 1's token.
            pos = bonus_pos + i
            step_meta = make_meta(
                jnp.where(sampling_row, seq_index, num_seqs),
                jnp.where(sampling_row, pos - 1, 0),
                jnp.arange(num_seqs + 1, dtype=jnp.int32),
                jnp.where(sampling_row, pos, 0),
                inputs.seq_slots,
                inputs.block_tables,
            )
            h, cache = model.draft_hidden(params, cache, h, tokens_k[-1], step_meta, tile=tile)
        logits_i = model.draft_head(params, h, tile=tile)
        d_i, lp_i = _draw(logits_i, draft_st, bonus_pos + 1 + i, sampler, batch_invariant)
        tokens_k.append(d_i)
        logprobs_k.append(lp_i)
        # Confidence of draft i + 1: the draft head's probability of it, as log-odds through a sigmoid at the
        # position's confidence temperature (V3's MTP layer has no confidence head of its own).
        p = jnp.take_along_axis(jax.nn.log_softmax(logits_i), jnp.maximum(d_i, 0)[:, None], axis=1)[:, 0]
        odds = p - jnp.log(-jnp.expm1(jnp.minimum(p, -1e-7)))
        temp = _temperature(confidence_temperature, i)
        confidences_k.append(jnp.where(d_i >= 0, jax.nn.sigmoid(jnp.clip(odds / temp, -60.0, 60.0)), 0.0))
    return tokens_k, logprobs_k, confidences_k, cache


def _dspark_drafts(
    params: Any,
    cache: Any,
    model: Any,
    k: int,
    bonus: jax.Array,
    bonus_pos: jax.Array,
    slots: jax.Array,
    draft_st: SamplingTensors,
    *,
    sampler: Any,
    batch_invariant: bool,
    tile: int | None,
    confidence_temperature: tuple[float, ...],
) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array], Any]:
    """V4.1's DSpark drafts: the block ``[bonus, noise, …]`` at the positions after the last accepted token,
    over the context keys the backbone wrote this step and before (``V41PagedModel.dspark_block``); drafts are
    drawn one after the other, row ``i`` with the Markov term of the token before it and its confidence from
    the drafter's confidence head at the position's temperature. The block always has the drafter's own size
    ``B``; the step keeps its first ``k`` drafts."""
    h = model.dspark_block(params, cache, bonus, bonus_pos - 1, slots, tile=tile)  # [S, B, H]
    tokens_k: list[jax.Array] = []
    logprobs_k: list[jax.Array] = []
    confidences_k: list[jax.Array] = []
    prev = bonus
    for i in range(k):
        logits_i, raw = model.dspark_logits(params, h[:, i], prev, tile=tile)
        d_i, lp_i = _draw(logits_i, draft_st, bonus_pos + 1 + i, sampler, batch_invariant)
        conf = jax.nn.sigmoid(jnp.clip(raw / _temperature(confidence_temperature, i), -60.0, 60.0))
        tokens_k.append(d_i)
        logprobs_k.append(lp_i)
        confidences_k.append(jnp.where(d_i >= 0, conf, 0.0))
        prev = jnp.maximum(d_i, 0)
    return tokens_k, logprobs_k, confidences_k, cache
