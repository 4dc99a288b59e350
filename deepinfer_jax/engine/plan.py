"""The host-to-device contract of one engine step: :class:`StepPlan`.

The scheduler (host, numpy) describes each step as a flat, ragged token batch already padded to one of the
compiled ``(tokens, sequences)`` buckets, so that the jitted step function sees a small fixed set of shapes and
never recompiles in the steady state (ARCHITECTURE §4).

Layout. The real sequences of the step are rows ``0 .. num_seqs - 1``; the tokens of row ``s`` are
``query_start[s] : query_start[s + 1]`` of the token arrays, in position order. Everything past the real rows is
padding the device must ignore: padding tokens belong to the sentinel row ``S`` (one past the last row, so a
segment reduction over ``S`` rows drops them), padding sequences own no tokens, no slot (``-1``) and no blocks.

One convention makes asynchronous scheduling possible: a token id of ``-1`` means "the token this sequence
sampled in the previous step". The device reads it from its own per-slot state, so step N+1 can be built and
dispatched before step N's sampled tokens have reached the host (spec/engine.md §5). Prefill tokens (prompt
tokens, or the prompt and output of a request recomputed after preemption) are always given explicitly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["PENDING_TOKEN", "StepPlan", "choose_bucket"]

PENDING_TOKEN = -1
"""Token id meaning "read the token this sequence sampled last step from device state"."""


def _check_array(name: str, value: object, dtype: type, shape: tuple[int, ...]) -> None:
    if not isinstance(value, np.ndarray):
        raise TypeError(f"StepPlan.{name} must be a numpy array, got {type(value).__name__}")
    if value.dtype != dtype:
        raise TypeError(f"StepPlan.{name} must have dtype {np.dtype(dtype).name}, got {value.dtype}")
    if value.shape != shape:
        raise ValueError(f"StepPlan.{name} has shape {value.shape}, expected {shape}")


@dataclasses.dataclass(frozen=True, eq=False)
class StepPlan:
    """One engine step, numpy only, already padded to a bucket of ``T`` tokens and ``S`` sequences.

    Attributes:
        token_ids: int32 ``[T]``; :data:`PENDING_TOKEN` (-1) = the token this sequence sampled last step,
            read on the device from its state slot. Padding tokens: 0.
        positions: int32 ``[T]`` absolute position of each token in its sequence; padding tokens: 0.
        token_seq: int32 ``[T]`` row in ``[0, S)`` of the sequence owning each token; padding tokens: ``S``.
        seq_slots: int32 ``[S]`` state-slot id of each scheduled sequence; padding rows: -1.
        query_start: int32 ``[S + 1]`` token offsets of the ragged rows (``query_start[0] == 0``); padding rows
            own no tokens, so ``query_start[s] == num_tokens`` for every ``s >= num_seqs``.
        context_lens: int32 ``[S]`` tokens in the cache for this sequence *after* this step (the cached prefix
            plus this step's tokens); padding rows: 0.
        block_tables: int32 ``[S, max_blocks_per_seq]`` physical block ids; unused entries -1.
        sample: bool ``[S]`` sample a token from the last token of this row in this step (false for prefill
            chunks that do not end the prompt, and for padding rows).
        num_tokens: real (unpadded) tokens.
        num_seqs: real (unpadded) sequences.
        request_ids: request id of each real row, in row order.

    The position of the token a row samples is ``context_lens[s]`` (the 0-based index of the new token in the
    request's full sequence), which is what position-keyed sampling needs.
    """

    token_ids: np.ndarray
    positions: np.ndarray
    token_seq: np.ndarray
    seq_slots: np.ndarray
    query_start: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    sample: np.ndarray
    num_tokens: int
    num_seqs: int
    request_ids: tuple[str, ...]

    def __post_init__(self) -> None:
        # Shapes and dtypes only (O(1) per array): a plan with a wrong shape would silently trigger a new
        # compilation or a shape error deep inside jit, far from the bug. Content checks live in validate().
        if not isinstance(self.token_ids, np.ndarray) or self.token_ids.ndim != 1:
            raise TypeError("StepPlan.token_ids must be a 1-D numpy array")
        if not isinstance(self.seq_slots, np.ndarray) or self.seq_slots.ndim != 1:
            raise TypeError("StepPlan.seq_slots must be a 1-D numpy array")
        t = self.token_ids.shape[0]
        s = self.seq_slots.shape[0]
        if t < 1 or s < 1:
            raise ValueError(f"StepPlan needs at least one token and one sequence row, got T={t}, S={s}")
        if not isinstance(self.block_tables, np.ndarray) or self.block_tables.ndim != 2:
            raise TypeError("StepPlan.block_tables must be a 2-D numpy array")
        width = self.block_tables.shape[1]
        _check_array("token_ids", self.token_ids, np.int32, (t,))
        _check_array("positions", self.positions, np.int32, (t,))
        _check_array("token_seq", self.token_seq, np.int32, (t,))
        _check_array("seq_slots", self.seq_slots, np.int32, (s,))
        _check_array("query_start", self.query_start, np.int32, (s + 1,))
        _check_array("context_lens", self.context_lens, np.int32, (s,))
        _check_array("block_tables", self.block_tables, np.int32, (s, width))
        _check_array("sample", self.sample, np.bool_, (s,))
        for name, value, limit in (("num_tokens", self.num_tokens, t), ("num_seqs", self.num_seqs, s)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise TypeError(f"StepPlan.{name} must be an int, got {type(value).__name__}")
            if not 0 <= value <= limit:
                raise ValueError(f"StepPlan.{name} = {value} must be in [0, {limit}]")
        if len(self.request_ids) != self.num_seqs:
            raise ValueError(
                f"StepPlan.request_ids has {len(self.request_ids)} entries, expected num_seqs = {self.num_seqs}"
            )

    @property
    def padded_tokens(self) -> int:
        """``T``, the token bucket of this step."""
        return int(self.token_ids.shape[0])

    @property
    def padded_seqs(self) -> int:
        """``S``, the sequence bucket of this step."""
        return int(self.seq_slots.shape[0])

    @property
    def bucket(self) -> tuple[int, int]:
        """``(T, S)``: the compiled shape this plan runs with."""
        return self.padded_tokens, self.padded_seqs

    @property
    def max_blocks_per_seq(self) -> int:
        return int(self.block_tables.shape[1])

    def validate(self, *, block_size: int | None = None) -> None:
        """Check every documented invariant of the contents; raises ``ValueError`` naming the first broken one.

        Linear in the plan's size; the scheduler's tests call it on every plan, the engine may call it in a
        debug mode. With ``block_size``, also checks that every row's block table covers its context.
        """
        t, s, n, m = self.padded_tokens, self.padded_seqs, self.num_tokens, self.num_seqs
        qs = self.query_start
        if qs[0] != 0 or np.any(np.diff(qs) < 0) or qs[m] != n or np.any(qs[m:] != n):
            raise ValueError(f"StepPlan.query_start {qs.tolist()} is not a prefix sum ending at {n} tokens")
        expected_seq = np.full(t, s, np.int32)
        expected_seq[:n] = np.repeat(np.arange(m, dtype=np.int32), np.diff(qs[: m + 1]))
        if not np.array_equal(self.token_seq, expected_seq):
            raise ValueError(
                "StepPlan.token_seq does not match query_start (padding tokens must point at row S)"
            )
        if np.any(self.token_ids[:n] < PENDING_TOKEN) or np.any(self.token_ids[n:] != 0):
            raise ValueError("StepPlan.token_ids: real tokens must be >= -1 and padding tokens 0")
        if np.any(self.positions[n:] != 0) or np.any(self.positions[:n] < 0):
            raise ValueError("StepPlan.positions: real positions must be >= 0 and padding positions 0")
        for row in range(m):
            lo, hi = int(qs[row]), int(qs[row + 1])
            if hi == lo:
                raise ValueError(f"StepPlan row {row} ({self.request_ids[row]}) has no tokens")
            pos = self.positions[lo:hi]
            if np.any(np.diff(pos) != 1) or int(pos[-1]) + 1 != int(self.context_lens[row]):
                raise ValueError(
                    f"StepPlan row {row} ({self.request_ids[row]}): positions {pos.tolist()} are not consecutive "
                    f"or do not end at context_lens - 1 = {int(self.context_lens[row]) - 1}"
                )
            if np.any(self.token_ids[lo : hi - 1] == PENDING_TOKEN):
                raise ValueError(f"StepPlan row {row}: only a row's first token may be pending (-1)")
            if self.seq_slots[row] < 0:
                raise ValueError(
                    f"StepPlan row {row}: a real row needs a state slot, got {self.seq_slots[row]}"
                )
            if block_size is not None:
                need = -(-int(self.context_lens[row]) // block_size)
                table = self.block_tables[row]
                if need > table.shape[0] or np.any(table[:need] < 0):
                    raise ValueError(
                        f"StepPlan row {row}: block table {table[: need + 1].tolist()} does not cover "
                        f"{int(self.context_lens[row])} tokens of {block_size}-token blocks"
                    )
        if np.any(self.seq_slots[m:] != -1) or np.any(self.context_lens[m:] != 0):
            raise ValueError("StepPlan padding rows must have seq_slots -1 and context_lens 0")
        if np.any(self.block_tables[m:] != -1) or np.any(self.sample[m:]):
            raise ValueError("StepPlan padding rows must have no blocks and sample nothing")
        real_slots = self.seq_slots[:m]
        if len(np.unique(real_slots)) != m:
            raise ValueError(f"StepPlan.seq_slots {real_slots.tolist()} repeats a slot")


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
