"""The short list of compiled ``(tokens, sequences)`` shapes of the engine step.

Every step is padded up to one bucket (:func:`deepinfer_jax.engine.plan.choose_bucket`), so the jitted step
sees a handful of shapes, each compiled once when it is first needed. The list is a small grid: token counts
16 / 64 / 256 / ``max_num_batched_tokens`` against sequence counts 8 / 32 / 128 / ``max_num_seqs``, trimmed to
the budgets, with ``S <= T`` (every real sequence of a step brings at least one token, so a bucket with more
rows than tokens is never the smallest fit). Few buckets keep compile time down on a 2-core machine (each one
used compiles once, a few seconds on CPU). The price would be padding: a prefill of 512 tokens padded to a
2048 budget does four times the work. The scheduler avoids it instead of a denser grid: when a step fills less
than half of its bucket, it cuts the step's prefill chunks to fill a smaller bucket exactly
(``Scheduler(min_bucket_fill=)``), so a step wastes at most half its bucket, and a decode step of a few
sequences at most the ``T = 16`` bucket. docs/engine.md records the measurements behind this choice.
"""

from __future__ import annotations

__all__ = ["SEQ_BUCKETS", "TOKEN_BUCKETS", "step_buckets"]

TOKEN_BUCKETS: tuple[int, ...] = (16, 64, 256)
"""Token counts compiled below ``max_num_batched_tokens`` (which is always a bucket itself)."""

SEQ_BUCKETS: tuple[int, ...] = (8, 32, 128)
"""Sequence counts compiled below ``max_num_seqs`` (which is always a bucket itself)."""


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def step_buckets(
    max_num_batched_tokens: int, max_num_seqs: int, decode_width: int = 1
) -> tuple[tuple[int, int], ...]:
    """All ``(T, S)`` buckets for these budgets, sorted; the largest holds both budgets (``S <= T``).

    ``decode_width`` is the tokens of one decode row: ``1 + k`` with ``k`` draft tokens. Speculative engines
    also compile ``T = s * decode_width`` (above the smallest token bucket) for every sequence count ``s`` of the
    grid, so a decode step of ``s`` rows with drafts runs in a bucket it fills (``16 x (1 + 1)`` tokens would
    otherwise pad to 64).

    >>> step_buckets(64, 4)
    ((16, 4), (64, 4))
    >>> step_buckets(300, 40)[-1]
    (300, 40)
    """
    max_tokens = _positive("max_num_batched_tokens", max_num_batched_tokens)
    max_seqs = _positive("max_num_seqs", max_num_seqs)
    width = _positive("decode_width", decode_width)
    seqs = sorted({s for s in SEQ_BUCKETS if s < max_seqs} | {max_seqs})
    decode = {s * width for s in seqs if width > 1 and TOKEN_BUCKETS[0] < s * width < max_tokens}
    tokens = sorted({t for t in TOKEN_BUCKETS if t < max_tokens} | decode | {max_tokens})
    out = {(t, min(s, t)) for t in tokens for s in seqs}
    return tuple(sorted(out))
