"""The host-to-device contract of one engine step: :class:`StepPlan`, built by :func:`build_plan` alone.

The engine always runs on a ``(dp, ep)`` mesh of ``D = dp * ep`` devices; one device is the ``(1, 1)`` mesh.
Each device's scheduler decides which tokens of which of its requests run (a :class:`DeviceBatch`, host
objects only); :func:`build_plan` turns the ``D`` batches of a step into one :class:`StepPlan`: numpy arrays
with a leading device axis, padded to one compiled ``(T tokens, S sequences)`` bucket, holding everything the
jitted step needs -- tokens, positions, block tables, slots, the sampling tensors, the prompt-logprob targets --
in :class:`StepInputs`. A device with nothing to run gets all-padding rows (a placeholder), so every device
enters every collective of the step. Later features add fields here, in one place.

Layout of device ``d``'s part. Its real sequences are rows ``0 .. n_d - 1``; the tokens of row ``s`` are
``query_start[d, s] : query_start[d, s + 1]``, in position order. Everything past the real rows is padding the
device must ignore: padding tokens belong to the sentinel row ``S`` (one past the last row, so a segment
reduction over ``S`` rows drops them), padding sequences own no tokens, no slot (``-1``) and no blocks.

One convention makes asynchronous scheduling possible: a token id of ``-1`` means "the token this sequence
sampled in the previous step". The device reads it from its own per-slot state, so step N+1 can be built and
dispatched before step N's sampled tokens have reached the host (``docs/engine.md``, "one step in flight").
Prefill tokens (prompt tokens, or the prompt and output of a request recomputed after preemption) are always
given explicitly.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from deepinfer_jax.engine.grammar import fill_masks
from deepinfer_jax.sampling.tensors import CheckedRow, SamplingTensors, check_row

__all__ = [
    "DRAFT_TOKEN",
    "LOGPROB_VARIANTS",
    "PENDING_TOKEN",
    "CacheCopies",
    "DeviceBatch",
    "LoopInputs",
    "PlanView",
    "ScheduledRow",
    "SpecInputs",
    "StepInputs",
    "StepPlan",
    "build_plan",
    "choose_bucket",
    "fill_deferred_masks",
    "logprob_variant",
]

PENDING_TOKEN = -1
"""Token id meaning "read the token this sequence sampled last step from device state"."""

DRAFT_TOKEN = -2
"""Token id meaning "the sequence's next draft token, from the device's draft pool" (speculative decoding: the
tokens after a decode row's first one)."""

LOGPROB_VARIANTS: tuple[int, ...] = (0, 5, 20)
"""Top-n widths the step is compiled for; a step reports the smallest that covers every row's ``logprobs``."""


def logprob_variant(requested: int) -> int:
    """The compiled top-n width for a step whose rows ask for at most ``requested`` alternatives."""
    for n in LOGPROB_VARIANTS:
        if requested <= n:
            return n
    raise ValueError(f"logprobs = {requested} exceeds the maximum {LOGPROB_VARIANTS[-1]}")


def choose_bucket(num_tokens: int, num_seqs: int, buckets: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The smallest ``(T, S)`` bucket with ``T >= num_tokens`` and ``S >= num_seqs``.

    "Smallest" orders by padded tokens first, then sequences: token count drives the step's cost. Raises
    ``ValueError`` when no bucket is large enough (the scheduler's budgets must match the bucket list).
    """
    best: tuple[int, int] | None = None
    for t, s in buckets:
        if t >= num_tokens and s >= num_seqs and (best is None or (t, s) < best):
            best = (int(t), int(s))
    if best is None:
        raise ValueError(
            f"no bucket holds {num_tokens} tokens and {num_seqs} sequences; buckets: {sorted(buckets)}"
        )
    return best


# ------------------------------------------------------------------------------------------ host side


class PlanRequest(Protocol):
    """What :func:`build_plan` reads from a scheduled request (the scheduler's ``Request`` provides it)."""

    request_id: str
    slot: int
    block_ids: list[int]
    prompt_token_ids: np.ndarray
    params: Any
    seed: int

    @property
    def prompt_len(self) -> int: ...

    def tokens(self, start: int, stop: int) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class ScheduledRow:
    """One row of a device's step: ``length`` tokens of ``request`` from position ``start``.

    Attributes:
      request: the scheduled request (:class:`PlanRequest`).
      start, length: the row's first position and token count.
      sample: the row samples a token from its last token (false for a prefill chunk that does not end the
        known tokens).
      pending_input: the row's first token is the one its sequence sampled last step, not yet on the host
        (:data:`PENDING_TOKEN`).
      decode: one output token fed to sample the next (the rest count as prefill).
      num_drafts: speculative decoding: the row's last ``num_drafts`` tokens are draft tokens from the device's
        pool (``length = 1 + num_drafts``), verified by the step.
      shifted: speculative decoding: the row's first position is only the host's lower bound; the device places
        it at the slot's pending token (``SpecInputs.shifted``).
    """

    request: Any
    start: int
    length: int
    sample: bool
    pending_input: bool
    decode: bool
    num_drafts: int = 0
    shifted: bool = False
    forced: tuple[int, ...] = ()
    """Test hook (``speculative.force_draft_tokens``): the draft tokens to verify instead of the drafter's."""
    pool_drafts: tuple[int, ...] = ()
    """A constrained request's drafts as the host knows them (the pool's, from its last processed step): the
    plan fills one grammar mask per verify row from them."""
    resplit: bool = False
    """Variable-length verification: the planner split this row's drafts and the device may split them again
    with fresher confidences (``SpecInputs.realloc``)."""
    resume: bool = False
    """The last row of a recompute under speculative decoding: it ends before the request's last output and
    emits that known token again (golden), so the drafter drafts after it as the run without preemption did;
    the host appends nothing."""
    iterations: int = 1
    """Decode loop (``scheduler.num_decode_steps``): the decode iterations this row may run inside the step's one
    device call (1 for every row of a plain step). Iteration ``j`` feeds the token iteration ``j - 1`` sampled at
    position ``start + j``; the host allocated the blocks for all of them."""


@dataclasses.dataclass(frozen=True, eq=False)
class DeviceBatch:
    """What one device's scheduler scheduled for a step: its rows, in row order (host objects only)."""

    rows: tuple[ScheduledRow, ...]
    block_copies: tuple[tuple[int, int], ...] = ()
    """``(source, destination)`` blocks copied at the start of the step, before any row runs (a fork's
    copy-on-write of a shared partial block)."""
    slot_copies: tuple[tuple[int, int], ...] = ()
    """``(source, destination)`` state slots cloned at the start of the step (a fork's per-sequence state, a
    prefix-cache hit's restored snapshot, the start of a new snapshot)."""
    snapshots: tuple[tuple[int, int, int], ...] = ()
    """``(row, boundary, slot)``: window-state snapshots the step writes (prefix caching, docs/prefix_cache.md)."""
    host_saves: tuple[tuple[Any, int, int], ...] = ()
    """``(host entry, block, slot)``: evicted blocks and snapshots the executor copies to the host tier before
    the step runs (``-1`` = none of that kind)."""
    host_loads: tuple[tuple[Any, int, int], ...] = ()
    """``(host entry, block, slot)``: host-tier blocks and snapshots copied back before the step runs (after
    the saves)."""

    @property
    def num_tokens(self) -> int:
        return sum(r.length for r in self.rows)

    @property
    def num_iterations(self) -> int:
        """The most decode iterations a row of this batch runs (1: a plain step)."""
        return max((r.iterations for r in self.rows), default=1)

    @property
    def num_seqs(self) -> int:
        return len(self.rows)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(r.request.request_id for r in self.rows)

    @property
    def requests(self) -> list[Any]:
        return [r.request for r in self.rows]


# ------------------------------------------------------------------------------------------ device side


class StepInputs(NamedTuple):
    """Every array one step takes, each with a leading device axis ``D`` (the jitted step's input pytree).

    Attributes:
      token_ids: int32 ``[D, T]``; :data:`PENDING_TOKEN` (-1) = the token this sequence sampled last step, read
        on the device from its state slot. Padding tokens: 0.
      positions: int32 ``[D, T]`` absolute position of each token in its sequence; padding tokens: 0.
      token_seq: int32 ``[D, T]`` row in ``[0, S)`` of the sequence owning each token; padding tokens: ``S``.
      seq_slots: int32 ``[D, S]`` state-slot id of each scheduled sequence; padding rows: -1.
      query_start: int32 ``[D, S + 1]`` token offsets of the ragged rows; padding rows own no tokens.
      context_lens: int32 ``[D, S]`` tokens in the cache for this sequence *after* this step; padding rows: 0.
      block_tables: int32 ``[D, S, max_blocks_per_seq]`` physical block ids; unused entries -1.
      sample: bool ``[D, S]`` sample a token from the last token of this row.
      prompt_lens: int32 ``[D, S]`` each row's prompt length (positions below it are prompt tokens for the
        penalties); padding rows: 0.
      sampling: the rows' :class:`~deepinfer_jax.sampling.SamplingTensors`, leaves ``[D, S, ...]``.
      prompt_targets: int32 ``[D, T]`` the next prompt token of each token whose request asked for prompt
        logprobs (``-1`` elsewhere), or ``None`` when no token of the step needs one.
      snapshots: int32 ``[D, 3, J]`` prefix caching's window-state snapshots (``(row, boundary, slot)``, slot
        ``-1`` = none; :class:`~deepinfer_jax.cache.ragged.RaggedMeta`), or ``None`` when the step takes none.
        Each snapshot's slot is also a destination of ``copies`` (the row's slot, copied before the step).
      replay_from: int32 ``[D, S]`` SWA bounded replay (``scheduler.yoco_truncation``, docs/models_v41.md): the
        first position the YOCO consumer layers of each prefill row may see, ``R = L - K`` with ``L`` the request's
        known tokens when the step is planned (``num_known``: prompt and outputs, not the token in flight, so
        every chunk of a prompt has the same bound); ``-1`` = no bound (decode rows, padding, ``R < 0``).
        ``None`` when truncation is off.

    The position of the token a row samples is ``context_lens[d, s]`` (the 0-based index of the new token in
    the request's full sequence), which is what position-keyed sampling needs.
    """

    token_ids: Any
    positions: Any
    token_seq: Any
    seq_slots: Any
    query_start: Any
    context_lens: Any
    block_tables: Any
    sample: Any
    prompt_lens: Any
    sampling: Any
    prompt_targets: Any = None
    copies: Any = None
    spec: Any = None
    snapshots: Any = None
    replay_from: Any = None
    loop: Any = None


class LoopInputs(NamedTuple):
    """What a decode-loop step needs besides the plan of its first iteration (``scheduler.num_decode_steps``,
    docs/engine.md "Decode loop"); ``StepInputs.loop`` is ``None`` for every other step.

    Attributes:
      iterations: int32 ``[D, S]`` the decode iterations each row may run (0 for padding rows): its token budget
        (``max_tokens``, ``max_model_len``), its ``min_tokens`` masking and its next window snapshot bound it.
      stop_ids: int32 ``[D, S, W]`` the ids that end each row on the device (its EOS ids unless ``ignore_eos``,
        and its ``stop_token_ids``); ``-1`` = unused entry.
      limits: int32 ``[D, S]`` the length at which each row's request ends (``max_tokens``, ``max_model_len``;
        0 for padding rows). A speculative row emits a varying number of tokens per iteration: the device stops
        it once its sequence (``next_pos + 1``, the device's own count) reaches the limit, as the host does.
      call: int32 ``[D]`` the executor's number of this call (it marks the call's host callbacks, so the host
        can drop those of a call it gave up on); 0 until the executor runs the plan.
    """

    iterations: Any
    stop_ids: Any
    limits: Any
    call: Any


class SpecInputs(NamedTuple):
    """What a speculative engine's step needs besides the plain plan (``docs/speculative.md``).

    Attributes:
      num_drafts: int32 ``[D, S]`` drafts the row verifies (its last ``num_drafts`` tokens are
        :data:`DRAFT_TOKEN`); 0 for every other row.
      shifted: bool ``[D, S]`` the row's positions, context length and sample position are the host's lower
        bound; the device adds ``next_pos[slot] - positions[first token]``.
      next_ids: int32 ``[D, S]`` the token after the row's last one when the row does not sample (the next
        prompt token of a prefill chunk: the draft layer pairs each token with its successor); -1 elsewhere.
      forced: int32 ``[D, S, K]`` draft tokens that replace the pool's (the ``speculative.force_draft_tokens``
        test hook), -1 = the pool's draft; ``None`` when the hook is off (the step then compiles without it).
      verify_masks: int32 ``[D, S, K + 1, W]`` the grammar mask of every verify row (row ``j`` after ``j``
        drafts, :meth:`~deepinfer_jax.engine.grammar.RequestGrammar.draft_masks`), or ``None`` when the step has
        no grammar mask; rows without drafts repeat their one mask.
      realloc: bool ``[D, S]`` rows whose verify length the device may split again with fresher confidences
        (variable-length verification: the rows the planner split), or ``None`` (fixed length: the step compiles
        without the re-split).
    """

    num_drafts: Any
    shifted: Any
    next_ids: Any
    forced: Any = None
    verify_masks: Any = None
    realloc: Any = None


class CacheCopies(NamedTuple):
    """The block copies and state-slot clones a step makes before it runs its rows (forks of ``n > 1``).

    Attributes:
      block_src, block_dst: int32 ``[D, Kb]`` blocks copied (every layer's entries of the block); -1 = none.
      slot_src, slot_dst: int32 ``[D, Ks]`` state slots cloned (window rings, compression state, the penalty
        counts and the last sampled token); -1 = none.

    Destinations are fresh (never a source of the same step), so the copies commute. ``Kb`` and ``Ks`` are
    powers of two (at least 1); a step without copies has ``StepInputs.copies = None``.
    """

    block_src: Any
    block_dst: Any
    slot_src: Any
    slot_dst: Any


class PlanView(NamedTuple):
    """Device ``d``'s part of a :class:`StepPlan` (numpy views; for checks, tests and debugging)."""

    token_ids: np.ndarray
    positions: np.ndarray
    token_seq: np.ndarray
    seq_slots: np.ndarray
    query_start: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    sample: np.ndarray
    prompt_lens: np.ndarray
    prompt_targets: np.ndarray | None
    num_tokens: int
    num_seqs: int
    request_ids: tuple[str, ...]

    @property
    def padded_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def padded_seqs(self) -> int:
        return int(self.seq_slots.shape[0])

    @property
    def bucket(self) -> tuple[int, int]:
        return self.padded_tokens, self.padded_seqs

    def validate(self, *, block_size: int | None = None) -> None:
        """Check every documented invariant of this device's part; raises ``ValueError`` naming the first
        broken one. With ``block_size``, also checks that every row's block table covers its context."""
        t, s, n, m = self.padded_tokens, self.padded_seqs, self.num_tokens, self.num_seqs
        qs = self.query_start
        if qs[0] != 0 or np.any(np.diff(qs) < 0) or qs[m] != n or np.any(qs[m:] != n):
            raise ValueError(f"query_start {qs.tolist()} is not a prefix sum ending at {n} tokens")
        expected_seq = np.full(t, s, np.int32)
        expected_seq[:n] = np.repeat(np.arange(m, dtype=np.int32), np.diff(qs[: m + 1]))
        if not np.array_equal(self.token_seq, expected_seq):
            raise ValueError("token_seq does not match query_start (padding tokens must point at row S)")
        if np.any(self.token_ids[:n] < DRAFT_TOKEN) or np.any(self.token_ids[n:] != 0):
            raise ValueError("token_ids: real tokens must be >= -2 and padding tokens 0")
        if np.any(self.positions[n:] != 0) or np.any(self.positions[:n] < 0):
            raise ValueError("positions: real positions must be >= 0 and padding positions 0")
        for row in range(m):
            lo, hi = int(qs[row]), int(qs[row + 1])
            if hi == lo:
                raise ValueError(f"row {row} ({self.request_ids[row]}) has no tokens")
            pos = self.positions[lo:hi]
            if np.any(np.diff(pos) != 1) or int(pos[-1]) + 1 != int(self.context_lens[row]):
                raise ValueError(
                    f"row {row} ({self.request_ids[row]}): positions {pos.tolist()} are not consecutive or do not "
                    f"end at context_lens - 1 = {int(self.context_lens[row]) - 1}"
                )
            if np.any(self.token_ids[lo + 1 : hi] == PENDING_TOKEN):
                raise ValueError(f"row {row}: only a row's first token may be pending (-1)")
            if self.token_ids[lo] == DRAFT_TOKEN:
                raise ValueError(f"row {row}: a row's first token cannot be a draft (-2)")
            if self.seq_slots[row] < 0:
                raise ValueError(f"row {row}: a real row needs a state slot, got {self.seq_slots[row]}")
            if block_size is not None:
                need = -(-int(self.context_lens[row]) // block_size)
                table = self.block_tables[row]
                if need > table.shape[0] or np.any(table[:need] < 0):
                    raise ValueError(
                        f"row {row}: block table {table[: need + 1].tolist()} does not cover "
                        f"{int(self.context_lens[row])} tokens of {block_size}-token blocks"
                    )
        if (
            np.any(self.seq_slots[m:] != -1)
            or np.any(self.context_lens[m:] != 0)
            or np.any(self.prompt_lens[m:] != 0)
        ):
            raise ValueError("padding rows must have seq_slots -1, context_lens 0 and prompt_lens 0")
        if np.any(self.block_tables[m:] != -1) or np.any(self.sample[m:]):
            raise ValueError("padding rows must have no blocks and sample nothing")
        real_slots = self.seq_slots[:m]
        if len(np.unique(real_slots)) != m:
            raise ValueError(f"seq_slots {real_slots.tolist()} repeats a slot")


@dataclasses.dataclass(frozen=True, eq=False)
class StepPlan:
    """One engine step over every device of the mesh (module docstring), built by :func:`build_plan`.

    Attributes:
      inputs: the :class:`StepInputs` (numpy, leading device axis).
      num_logprobs: the compiled top-n width covering every row's ``logprobs`` (a static variant of the step).
      num_prompt_logprobs: the compiled width covering every row's ``prompt_logprobs``; ``-1`` when
        ``inputs.prompt_targets`` is ``None`` (the step computes no prompt logprobs).
      batches: each device's :class:`DeviceBatch`, ``None`` for a device that runs a placeholder.
      mask_seconds: host time spent filling the grammar masks of this plan (structured outputs).
      deferred_masks: ``(device, row, request, drafts)`` of each constrained row whose previous token was still
        in flight when the plan was built: its masks (``inputs.sampling.token_bitmask`` and, with drafts, the
        verify rows' ``inputs.spec.verify_masks``) are filled by :func:`fill_deferred_masks` once that token
        (and the drafts it left) reached the host, while the step's forward half runs on the device.
      loop_steps: a decode-loop step (``inputs.loop`` set): the compiled bound on its iterations (the engine's
        ``scheduler.num_decode_steps``); 1 for every other step.
    """

    inputs: StepInputs
    num_logprobs: int
    num_prompt_logprobs: int
    batches: tuple[DeviceBatch | None, ...]
    mask_seconds: float = 0.0
    deferred_masks: tuple[tuple[int, int, Any, int], ...] = ()
    loop_steps: int = 1

    @property
    def num_devices(self) -> int:
        return len(self.batches)

    @property
    def padded_tokens(self) -> int:
        """``T``, the token bucket of this step."""
        return int(self.inputs.token_ids.shape[1])

    @property
    def padded_seqs(self) -> int:
        """``S``, the sequence bucket of this step."""
        return int(self.inputs.seq_slots.shape[1])

    @property
    def bucket(self) -> tuple[int, int]:
        """``(T, S)``: the compiled shape this plan runs with."""
        return self.padded_tokens, self.padded_seqs

    @property
    def max_blocks_per_seq(self) -> int:
        return int(self.inputs.block_tables.shape[2])

    @property
    def variant(self) -> tuple[int, ...]:
        """The key of the compiled step this plan needs: ``(T, S, mask width, num_logprobs, prompt width,
        logit-bias width, allowed-ids width, grammar-mask width, cache-copy widths)``."""
        st = self.inputs.sampling
        return (
            self.padded_tokens,
            self.padded_seqs,
            int(st.masked_ids.shape[2]),
            self.num_logprobs,
            self.num_prompt_logprobs,
            int(st.bias_ids.shape[2]),
            int(st.allowed_ids.shape[2]),
            int(st.token_bitmask.shape[2]),
            *(
                (-1, -1)
                if self.inputs.copies is None
                else (self.inputs.copies.block_src.shape[1], self.inputs.copies.slot_src.shape[1])
            ),
            -1 if self.inputs.snapshots is None else int(self.inputs.snapshots.shape[2]),
            *(
                (1, 0)
                if self.inputs.loop is None
                else (self.loop_steps, int(self.inputs.loop.stop_ids.shape[2]))
            ),
        )

    @property
    def num_iterations(self) -> int:
        """The most decode iterations a row of this plan runs (1: a plain step)."""
        return max((b.num_iterations for b in self.batches if b is not None), default=1)

    @property
    def num_placeholders(self) -> int:
        """Devices that run an all-padding placeholder in this step."""
        return sum(b is None for b in self.batches)

    @property
    def is_prefill(self) -> bool:
        """No device runs a decode row (one output token fed to sample the next) in this step."""
        return not any(r.decode for b in self.batches if b is not None for r in b.rows)

    def view(self, device: int = 0) -> PlanView:
        """Device ``device``'s part of the plan."""
        x, b = self.inputs, self.batches[device]
        d = device
        return PlanView(
            x.token_ids[d],
            x.positions[d],
            x.token_seq[d],
            x.seq_slots[d],
            x.query_start[d],
            x.context_lens[d],
            x.block_tables[d],
            x.sample[d],
            x.prompt_lens[d],
            None if x.prompt_targets is None else x.prompt_targets[d],
            0 if b is None else b.num_tokens,
            0 if b is None else b.num_seqs,
            () if b is None else b.request_ids,
        )

    def validate(self, *, block_size: int | None = None) -> None:
        """Check every documented invariant of every device's part; raises ``ValueError`` naming the first broken
        one (and the device). Linear in the plan's size; the scheduler's tests call it on every plan. With
        ``block_size``, also checks that every row's block table covers its context."""
        for d in range(self.num_devices):
            try:
                self.view(d).validate(block_size=block_size)
            except ValueError as err:
                raise ValueError(f"StepPlan device {d}: {err}") from None


def _checked_row(req: Any, p: Any, vocab_size: int, j: int) -> CheckedRow:
    """``req``'s sampling parameters checked for the sampler (:func:`~deepinfer_jax.sampling.tensors.check_row`),
    once per request: kept in its ``checked_sampling`` (when it has one) with the parameters object and
    vocabulary they were checked for. ``p``: the parameters the row samples with (``req.params``, or a copy
    that differs only in fields the check does not read)."""
    cached = getattr(req, "checked_sampling", None)
    if cached is not None and cached[0] is req.params and cached[1] == vocab_size:
        return cached[2]
    row = check_row(p, vocab_size, j)
    if hasattr(req, "checked_sampling"):
        req.checked_sampling = (req.params, vocab_size, row)
    return row


def _bad_word_completions(req: Any) -> list[int]:
    """The last token of every bad word whose other tokens end the output so far (vLLM's ``bad_words``): the
    ids the request's next sample must not be."""
    words = getattr(req, "bad_words_ids", ())
    if not words:
        return []
    out = list(req.output_token_ids)
    banned = set()
    for w in words:
        k = len(w) - 1
        if k <= len(out) and (k == 0 or tuple(out[-k:]) == w[:-1]):
            banned.add(w[-1])
    return sorted(banned)


def build_plan(
    batches: Sequence[DeviceBatch | None],
    *,
    buckets: Sequence[tuple[int, int]],
    max_blocks_per_seq: int,
    vocab_size: int,
    eos_token_ids: Sequence[int] = (),
    banned_token_ids: Sequence[int] = (),
    num_draft_tokens: int = 0,
    force_drafts: bool = False,
    device_resplit: bool = False,
    min_copies: tuple[int, int, int] = (0, 0, 0),
    replay_keep: int = 0,
    loop_steps: int = 1,
) -> StepPlan:
    """The :class:`StepPlan` of one step: every device's batch (``None`` = nothing to run) in one padded plan.

    The step's bucket is the smallest of ``buckets`` that holds the largest device's tokens and sequences. Every
    array is filled here, from the scheduled requests (:class:`PlanRequest`): token ids (the pending ``-1`` for
    a row whose input is still on the device), positions, rows, slots, block tables, prompt lengths, the sampling
    tensors (parameters, seeds and the positions of the tokens the rows sample) and the prompt-logprob targets.
    ``min_copies`` gives the least widths of the block copies, slot copies and snapshots (fixed widths keep one
    compiled step whatever a step copies: prefix caching with snapshots). ``replay_keep > 0`` (SWA bounded
    replay's ``K``) fills ``StepInputs.replay_from`` for every step, so the step's inputs keep one structure.
    When a row runs more than one decode iteration (:attr:`ScheduledRow.iterations`), the plan is a decode-loop
    step: ``StepInputs.loop`` holds every row's iterations and stop ids, and ``loop_steps`` (the engine's
    ``scheduler.num_decode_steps``, at least every row's iterations) is the compiled bound.
    """
    real = [b for b in batches if b is not None]
    if not real:
        raise ValueError("build_plan: every device's batch is None; a step needs at least one")
    t, s = choose_bucket(max(b.num_tokens for b in real), max(b.num_seqs for b in real), buckets)
    d = len(batches)
    token_ids = np.zeros((d, t), np.int32)
    positions = np.zeros((d, t), np.int32)
    token_seq = np.full((d, t), s, np.int32)
    seq_slots = np.full((d, s), -1, np.int32)
    query_start = np.zeros((d, s + 1), np.int32)
    context_lens = np.zeros((d, s), np.int32)
    block_tables = np.full((d, s, max_blocks_per_seq), -1, np.int32)
    sample = np.zeros((d, s), np.bool_)
    prompt_lens = np.zeros((d, s), np.int32)
    targets: np.ndarray | None = None
    speculative = num_draft_tokens > 0
    num_drafts = np.zeros((d, s), np.int32)
    shifted = np.zeros((d, s), np.bool_)
    next_ids = np.full((d, s), -1, np.int32)
    forced = np.full((d, s, num_draft_tokens), -1, np.int32) if speculative and force_drafts else None
    realloc = np.zeros((d, s), np.bool_) if speculative and device_resplit else None
    replay_from = np.full((d, s), -1, np.int32) if replay_keep > 0 else None
    params, seeds, sample_pos, output_lens, row_index, extra = [], [], [], [], [], []
    checked: list[CheckedRow] = []
    grammars: list[tuple[int, Any]] = []  # (row, the request's RequestGrammar) of sampled constrained rows
    resumed: list[tuple[int, int]] = []  # (row, the known token it emits) of resumed recomputes' last rows
    deferred: list[tuple[int, int, Any, int]] = []  # (device, row, request, drafts) of masks filled later
    wanted = prompt_wanted = 0
    for dev, batch in enumerate(batches):
        if batch is None:
            continue
        offset = 0
        # The per-row columns are gathered as lists and written once per device (a row costs a few list
        # appends, not a dozen numpy item writes).
        n = len(batch.rows)
        starts, lengths, slots, pending, tables = [], [], [], [], []
        for i, row in enumerate(batch.rows):
            req = row.request
            end = offset + row.length
            known = row.length - row.num_drafts
            if row.pending_input:
                pending.append(offset)
            else:
                token_ids[dev, offset : offset + known] = req.tokens(row.start, row.start + known)
            if row.num_drafts:
                token_ids[dev, offset + known : end] = DRAFT_TOKEN
            if speculative:
                num_drafts[dev, i] = row.num_drafts
                shifted[dev, i] = row.shifted
                if forced is not None:
                    forced[dev, i, : len(row.forced)] = row.forced
                if realloc is not None:
                    realloc[dev, i] = row.resplit
                if not row.sample:
                    after = req.tokens(row.start + row.length, row.start + row.length + 1)
                    next_ids[dev, i] = int(after[0]) if len(after) else -1
            starts.append(row.start)
            lengths.append(row.length)
            slots.append(req.slot)
            tables.append(req.block_ids)
            context = row.start + row.length
            if replay_from is not None and not row.decode and not row.num_drafts:
                # L = the tokens the host knows (not the token this step samples, which total_len already
                # counts): the same for every chunk of a prompt.
                full_len = int(getattr(req, "num_known", context))
                replay_from[dev, i] = max(full_len - replay_keep, -1)
            prompt_len = req.prompt_len
            prompt_lens[dev, i] = prompt_len
            p = req.params
            if force_drafts and getattr(p, "golden_token_ids", None) is not None:
                p = p.replace(golden_token_ids=None)  # the test hook's golden tokens are drafts, not outputs
            params.append(p)
            seeds.append(req.seed)
            checked.append(_checked_row(req, p, vocab_size, len(checked)))
            sample_pos.append(context)
            output_lens.append(max(context - prompt_len, 0))
            row_index.append(dev * s + i)
            extra.append(_bad_word_completions(req) if row.sample else ())
            grammar = getattr(req, "grammar", None)
            if row.resume:
                resumed.append((dev * s + i, int(req.tokens(context, context + 1)[0])))
            elif row.sample and grammar is not None:
                if row.pending_input:
                    # Its mask depends on the token in flight: filled after dispatch, if it can constrain.
                    if grammar.may_constrain(1 + num_draft_tokens):
                        deferred.append((dev, i, req, row.num_drafts))
                else:
                    grammars.append((dev * s + i, grammar))
            wanted = max(wanted, p.logprobs or 0)
            if p.prompt_logprobs is not None:
                pos = np.arange(row.start, row.start + row.length, dtype=np.int32)
                inside = pos + 1 < prompt_len
                if inside.any():
                    if targets is None:
                        targets = np.full((d, t), -1, np.int32)
                    nxt = req.prompt_token_ids[np.minimum(pos + 1, prompt_len - 1)]
                    targets[dev, offset:end] = np.where(inside, nxt, -1)
                    prompt_wanted = max(prompt_wanted, p.prompt_logprobs)
            offset = end
        if pending:
            token_ids[dev, pending] = PENDING_TOKEN
        length_a = np.asarray(lengths, np.int32)
        start_a = np.asarray(starts, np.int32)
        first = np.zeros(n, np.int32)
        np.cumsum(length_a[:-1], out=first[1:])
        # Row i's tokens lie at [first[i], first[i] + length[i]) and sit at positions start[i] + 0, 1, ...
        token_seq[dev, :offset] = np.repeat(np.arange(n, dtype=np.int32), length_a)
        positions[dev, :offset] = np.arange(offset, dtype=np.int32) + np.repeat(start_a - first, length_a)
        seq_slots[dev, :n] = slots
        query_start[dev, :n] = first
        query_start[dev, n:] = offset
        context_lens[dev, :n] = start_a + length_a
        sample[dev, :n] = [row.sample for row in batch.rows]
        widths = np.fromiter(map(len, tables), np.int64, n)
        filled = np.arange(max_blocks_per_seq) < widths[:, None]
        block_tables[dev, :n][filled] = np.fromiter(
            itertools.chain.from_iterable(tables), np.int32, int(widths.sum())
        )
    bitmask = None
    mask_start = time.perf_counter()
    if deferred or any(g.constrains() for _, g in grammars):
        # Filled on the host while the previous step runs on the device; unconstrained rows stay all ones.
        bitmask = np.full((d * s, (vocab_size + 31) // 32), -1, np.int32)
        fill_masks(grammars, bitmask)
    flat = SamplingTensors.build(
        params,
        seeds,
        np.asarray(sample_pos, np.int64),
        vocab_size,
        output_lens=np.asarray(output_lens, np.int64),
        eos_token_ids=eos_token_ids,
        banned_token_ids=banned_token_ids,
        num_rows=d * s,
        row_index=row_index,
        extra_masked_ids=extra,
        token_bitmask=bitmask,
        checked_rows=checked,
    )
    for index, token in resumed:
        flat.golden[index] = token
    sampling = flat.reshape_rows(d, s)
    verify_masks = None
    if speculative and bitmask is not None:
        k = num_draft_tokens
        verify_masks = np.repeat(bitmask.reshape(d, s, 1, -1), k + 1, axis=2)
        for dev, batch in enumerate(batches):
            for i, row in enumerate(() if batch is None else batch.rows):
                grammar = getattr(row.request, "grammar", None)
                if row.num_drafts and grammar is not None and row.pool_drafts:
                    out = np.zeros((row.num_drafts + 1, verify_masks.shape[-1]), np.int32)
                    grammar.draft_masks(list(row.pool_drafts[: row.num_drafts]), out)
                    verify_masks[dev, i, : row.num_drafts + 1] = out
    copies = None
    nb = max(max((len(b.block_copies) for b in real), default=0), min_copies[0])
    ns = max(max((len(b.slot_copies) for b in real), default=0), min_copies[1])
    if nb or ns:
        kb, ks = (max(1 << max(k - 1, 0).bit_length(), m) for k, m in zip((nb, ns), min_copies, strict=False))
        arrays = [np.full((d, k), -1, np.int32) for k in (kb, kb, ks, ks)]
        for dev, batch in enumerate(batches):
            if batch is None:
                continue
            for j, (src, dst) in enumerate(batch.block_copies):
                arrays[0][dev, j], arrays[1][dev, j] = src, dst
            for j, (src, dst) in enumerate(batch.slot_copies):
                arrays[2][dev, j], arrays[3][dev, j] = src, dst
        copies = CacheCopies(*arrays)
    snapshots = None
    nsnap = max(max((len(b.snapshots) for b in real), default=0), min_copies[2])
    if nsnap:
        width = max(1 << max(nsnap - 1, 0).bit_length(), min_copies[2])
        snapshots = np.full((d, 3, width), -1, np.int32)
        for dev, batch in enumerate(batches):
            for j, entry in enumerate(() if batch is None else batch.snapshots):
                snapshots[dev, :, j] = entry
    loop = None
    if any(r.iterations > 1 for b in real for r in b.rows):
        loop = _loop_inputs(batches, d, s, eos_token_ids, loop_steps)
    inputs = StepInputs(
        token_ids,
        positions,
        token_seq,
        seq_slots,
        query_start,
        context_lens,
        block_tables,
        sample,
        prompt_lens,
        sampling,
        targets,
        copies,
        SpecInputs(num_drafts, shifted, next_ids, forced, verify_masks, realloc) if speculative else None,
        snapshots,
        replay_from,
        loop,
    )
    return StepPlan(
        inputs,
        logprob_variant(wanted),
        -1 if targets is None else logprob_variant(prompt_wanted),
        tuple(batches),
        time.perf_counter() - mask_start if bitmask is not None else 0.0,
        tuple(deferred),
        loop_steps if loop is not None else 1,
    )


def _loop_inputs(
    batches: Sequence[DeviceBatch | None], d: int, s: int, eos_token_ids: Sequence[int], loop_steps: int
) -> LoopInputs:
    """The :class:`LoopInputs` of a decode-loop plan: each row's iterations and the ids that end it on the
    device (the stops the host's checks would end it at: EOS unless ``ignore_eos``, then ``stop_token_ids``)."""
    iterations = np.zeros((d, s), np.int32)
    limits = np.zeros((d, s), np.int32)
    stops: dict[tuple[int, int], list[int]] = {}
    for dev, batch in enumerate(batches):
        for i, row in enumerate(() if batch is None else batch.rows):
            if row.iterations > loop_steps:
                raise ValueError(
                    f"build_plan: a row of {row.iterations} decode iterations in a loop of loop_steps = {loop_steps}"
                )
            if not (row.decode and row.sample) and row.iterations > 1:
                raise ValueError("build_plan: only a decode row may run several decode iterations")
            iterations[dev, i] = row.iterations if row.sample else 0
            limits[dev, i] = row.request.max_total_len if row.sample else 0
            p = row.request.params
            ids = [] if p.ignore_eos else sorted(int(t) for t in eos_token_ids)
            ids += [int(t) for t in p.stop_token_ids or () if int(t) not in ids]
            stops[dev, i] = ids
    width = max(max((len(v) for v in stops.values()), default=0), 1)
    width = max(4, 1 << (width - 1).bit_length())
    stop_ids = np.full((d, s, width), -1, np.int32)
    for (dev, i), ids in stops.items():
        stop_ids[dev, i, : len(ids)] = ids
    return LoopInputs(iterations, stop_ids, limits, np.zeros((d,), np.int32))


def fill_deferred_masks(plan: StepPlan) -> None:
    """Fill the masks of ``plan``'s :attr:`~StepPlan.deferred_masks` rows in place, from each request's grammar
    as it is now (its previous tokens, and the drafts its last step left in the pool, have reached the host):
    the row's next-token mask and, for a row verifying ``n`` drafts, the ``n + 1`` verify-row masks, exactly as
    :func:`build_plan` fills them for a request whose tokens were known. A request that finished meanwhile gets
    all ones (its row's sample is discarded)."""
    if not plan.deferred_masks:
        return
    from deepinfer_jax.engine.grammar import fill_masks

    bitmask = plan.inputs.sampling.token_bitmask  # [D, S, W]
    spec = plan.inputs.spec
    verify = None if spec is None else spec.verify_masks  # [D, S, K + 1, W]
    live = [(dev, i, req, nd) for dev, i, req, nd in plan.deferred_masks if not _finished(req)]
    for dev, i, req, _ in plan.deferred_masks:
        if _finished(req):
            bitmask[dev, i] = -1
            if verify is not None:
                verify[dev, i] = -1
    rows = np.full((len(live), bitmask.shape[-1]), -1, np.int32)
    fill_masks([(j, req.grammar) for j, (_, _, req, _) in enumerate(live)], rows)
    for j, (dev, i, req, nd) in enumerate(live):
        bitmask[dev, i] = rows[j]
        if verify is None:
            continue
        verify[dev, i] = rows[j]
        if nd:
            out = np.zeros((nd + 1, bitmask.shape[-1]), np.int32)
            req.grammar.draft_masks(list(req.spec_drafts[:nd]), out)
            verify[dev, i, : nd + 1] = out


def _finished(req: Any) -> bool:
    """The request no longer runs (finished, or its grammar is gone): its row's sample is discarded."""
    status = getattr(getattr(req, "status", None), "name", "RUNNING")
    return getattr(req, "grammar", None) is None or status != "RUNNING"
