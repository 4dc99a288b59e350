"""Per-slot token statistics for the repetition, presence and frequency penalties.

The penalties need, for every sequence and every vocabulary id, whether the id occurs in the prompt (repetition
penalty, vLLM semantics: prompt *and* output) and how often it occurs in the output so far (presence and
frequency penalties: output only). Both live in one device-resident int32 array ``counts[num_slots, V]``
indexed by the sequence's state slot, so the step can update it without a host round trip:

* bits 0–29: how many times the id was generated (:data:`COUNT_MASK`);
* bit 30 (:data:`PROMPT_FLAG`): the id occurs in the prompt.

One array instead of two halves the gather the sampler does per step (``counts[seq_slots]``) and keeps the
``sample`` signature to a single optional operand. 2**30 generated copies of one id is far beyond any context
length, so the count can never spill into the flag.

All functions here are jit-able and take slot/token lists in which negative entries mean "nothing" (padding), so
the step can pass its padded bucket arrays unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "COUNT_MASK",
    "PROMPT_FLAG",
    "init_token_counts",
    "reset_token_counts",
    "split_token_counts",
    "update_token_counts",
]

PROMPT_FLAG = 1 << 30
"""Bit set in ``counts[slot, id]`` when ``id`` occurs in the prompt of the sequence in ``slot``."""

COUNT_MASK = PROMPT_FLAG - 1
"""Mask of the generated-token count in ``counts[slot, id]``."""


def init_token_counts(num_slots: int, vocab_size: int) -> jax.Array:
    """A zeroed ``int32[num_slots, vocab_size]`` count state."""
    for name, value in (("num_slots", num_slots), ("vocab_size", vocab_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"init_token_counts: {name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"init_token_counts: {name} = {value} must be >= 1")
    return jnp.zeros((num_slots, vocab_size), jnp.int32)


def _check_counts(fn: str, counts: jax.Array) -> None:
    if counts.ndim != 2 or counts.dtype != jnp.int32:
        raise TypeError(
            f"{fn}: counts must be int32 [num_slots, vocab_size], got {counts.dtype} {tuple(counts.shape)}"
        )


def _flat_indices(
    fn: str, counts: jax.Array, slots: jax.Array, tokens: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Slot and token indices with every invalid entry moved out of bounds (dropped by the scatter).

    JAX wraps negative indices like numpy does, so ``-1`` would silently address the last slot: padding entries
    are mapped past the end instead, where ``mode="drop"`` discards them.
    """
    slots = jnp.asarray(slots, jnp.int32)
    tokens = jnp.asarray(tokens, jnp.int32)
    if slots.shape != tokens.shape or slots.ndim != 1:
        raise ValueError(
            f"{fn}: slots and tokens must be 1-D arrays of the same length, got {slots.shape} and {tokens.shape}"
        )
    num_slots, vocab = counts.shape
    valid = (slots >= 0) & (slots < num_slots) & (tokens >= 0) & (tokens < vocab)
    return jnp.where(valid, slots, num_slots), jnp.where(valid, tokens, vocab)


def update_token_counts(
    counts: jax.Array, slots: jax.Array, tokens: jax.Array, is_prompt: jax.Array | None = None
) -> jax.Array:
    """Record tokens in the count state.

    Args:
      counts: int32 ``[num_slots, V]``.
      slots: int32 ``[N]`` state slot of each entry; negative = padding (ignored).
      tokens: int32 ``[N]`` token id of each entry; negative or ``>= V`` = padding (ignored).
      is_prompt: bool ``[N]`` or None. Prompt entries set :data:`PROMPT_FLAG` (idempotent: a prompt id seen
        twice is flagged once); the others add one to the generated count. ``None`` = all generated.

    Returns:
      The updated counts (donate ``counts`` to update in place).
    """
    _check_counts("update_token_counts", counts)
    rows, cols = _flat_indices("update_token_counts", counts, slots, tokens)
    if is_prompt is None:
        return counts.at[rows, cols].add(1, mode="drop")
    is_prompt = jnp.asarray(is_prompt, jnp.bool_)
    if is_prompt.shape != rows.shape:
        raise ValueError(
            f"update_token_counts: is_prompt must have shape {rows.shape}, got {is_prompt.shape}"
        )
    num_slots, vocab = counts.shape
    # Flags first, from the values gathered before any update: duplicates of one (slot, id) then all write the
    # same value, so the scatter's unspecified order among duplicates cannot matter.
    flag_rows = jnp.where(is_prompt, rows, num_slots)
    flagged = counts[jnp.minimum(rows, num_slots - 1), jnp.minimum(cols, vocab - 1)] | PROMPT_FLAG
    counts = counts.at[flag_rows, cols].set(flagged, mode="drop")
    add_rows = jnp.where(is_prompt, num_slots, rows)
    return counts.at[add_rows, cols].add(1, mode="drop")


def reset_token_counts(counts: jax.Array, slots: jax.Array) -> jax.Array:
    """Zero the rows of ``slots`` (a slot handed to a new sequence); negative entries are ignored."""
    _check_counts("reset_token_counts", counts)
    slots = jnp.asarray(slots, jnp.int32)
    if slots.ndim != 1:
        raise ValueError(f"reset_token_counts: slots must be 1-D, got shape {slots.shape}")
    num_slots = counts.shape[0]
    rows = jnp.where((slots >= 0) & (slots < num_slots), slots, num_slots)
    return counts.at[rows].set(0, mode="drop")


def split_token_counts(counts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(generated_count int32, in_prompt bool)`` views of a count array (any leading shape)."""
    return counts & COUNT_MASK, (counts & PROMPT_FLAG) != 0
