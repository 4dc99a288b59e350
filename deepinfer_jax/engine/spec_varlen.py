"""Variable-length verification in the engine: which drafts each decode row verifies (host side).

With ``speculative.variable_length`` the scheduler does not verify every draft. At every step it hands its
decode rows to a :class:`VerifyLengthPlanner`, which runs the budget search and the allocation of
:func:`~deepinfer_jax.engine.spec_budget.plan_verify_lengths` over

* each request's acceptance-rate estimates: the cumulative products of the confidences its drafts came with
  (the step returns them with its tokens; V3's MTP layer has no confidence head, so the confidence of a draft
  is its draft probability as log-odds through a sigmoid at ``speculative.confidence_temperature``). The budget
  uses the estimate of the round before the newest one on the host, the allocation the newest;
* the **decode latency curve** of the engine's own compiled step buckets, measured when the engine starts
  (:func:`probe_batch`: a step of each token bucket, one warm-up and five timed runs, min and max dropped) and
  cached on disk in ``speculative.latency_cache_dir`` for ``speculative.latency_cache_ttl_s``, keyed by the
  model, the buckets and the mesh; the prefill tokens already in the step shift the curve (a decode row's
  tokens join a step that holds them);
* the **forward slope**: the runner times every step (from the previous step's results, or its own dispatch,
  to its results) and records ``(time - baseline(bucket)) / bucket``; the sampler runs inside the step, so its
  time is part of the baseline (``sampler_ms = 0``).

The device keeps the host's split (DeepInfer's re-allocation with fresher confidences on the device,
:func:`deepinfer_jax.engine.spec_device.reallocate`, would move tokens between the rows of a planned ragged
batch; it is not used). This module is plain Python (the scheduler imports it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from deepinfer_jax.engine.plan import DeviceBatch, ScheduledRow
from deepinfer_jax.engine.spec_budget import LatencyCurve, SlopeEstimator, plan_verify_lengths

__all__ = ["VerifyLengthPlanner", "probe_batch"]


class VerifyLengthPlanner:
    """Chooses the drafts each decode row verifies, over a measured latency curve (module docstring)."""

    def __init__(self, curve: LatencyCurve) -> None:
        if not isinstance(curve, LatencyCurve):
            raise TypeError(f"curve: expected a LatencyCurve, got {type(curve).__name__}")
        self.curve = curve
        self.slope = SlopeEstimator()

    def plan(
        self,
        rates_budget: Sequence[Sequence[float]],
        rates_alloc: Sequence[Sequence[float]],
        num_drafts: Sequence[int],
        fixed_tokens: int,
    ) -> list[int]:
        """Drafts to verify per decode row (each at most ``num_drafts[i]``), for a step that already holds
        ``fixed_tokens`` other tokens (prefill chunks)."""
        shifted = LatencyCurve(
            tuple((size - fixed_tokens, ms) for size, ms in self.curve.points if size - fixed_tokens > 0)
        )
        if not len(shifted):
            return [0] * len(num_drafts)
        _, seqlen = plan_verify_lengths(
            rates_budget,
            rates_alloc,
            num_drafts,
            [True] * len(num_drafts),
            shifted,
            self.slope.slope_ms(),
            0.0,
        )
        return [min(q - 1, nd) for q, nd in zip(seqlen, num_drafts, strict=True)]

    def observe(self, bucket_tokens: int, step_ms: float) -> None:
        """One step's time on a bucket of the curve (steps of other sizes are ignored)."""
        if bucket_tokens in self.curve.sizes and step_ms >= 0:
            self.slope.record_on(self.curve, bucket_tokens, step_ms)


@dataclasses.dataclass(eq=False)
class _ProbeRequest:
    """A stand-in request for :func:`probe_batch`: reserved slot 0 and block 0 (the padding targets)."""

    request_id: str
    params: Any
    prompt_token_ids: np.ndarray
    block_ids: list[int]
    slot: int = 0
    seed: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        return np.zeros(max(stop - start, 0), np.int32)


def probe_batch(
    tokens: int, max_seqs: int, num_draft_tokens: int, max_blocks_per_seq: int, params: Any
) -> DeviceBatch:
    """A decode step of exactly ``tokens`` tokens for timing the bucket: as many decode rows with every draft
    as fit (at most ``max_seqs``), the rest one prefill chunk. Every row writes the reserved slot 0 and block 0,
    which no request owns, so probing leaves the engine's caches as they were."""
    width = 1 + num_draft_tokens
    rows: list[ScheduledRow] = []
    n = min(max_seqs, max(tokens // width, 1))
    if n * width < tokens and n == max_seqs:
        n -= 1  # room for the rest in one more row (with one row: all of it is that row)
    used = 0
    for i in range(n):
        length = min(width, tokens - used)
        if length <= 0:
            break
        req = _ProbeRequest(f"probe{i}", params, np.zeros(1, np.int32), [0] * max_blocks_per_seq)
        rows.append(ScheduledRow(req, 1, length, True, False, True, length - 1, False))
        used += length
    if used < tokens:
        req = _ProbeRequest(
            "probe-rest", params, np.zeros(tokens - used + 1, np.int32), [0] * max_blocks_per_seq
        )
        rows.append(ScheduledRow(req, 0, tokens - used, False, False, False))
    return DeviceBatch(tuple(rows))
