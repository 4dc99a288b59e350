"""The host scheduler: which tokens of which requests run in each engine step (numpy only, never jax).

The engine runs on a ``(dp, ep)`` mesh of ``D`` devices (one device is ``D = 1``), each device an attention rank
that owns whole sequences. :class:`Scheduler` is the engine's scheduler: it routes each new request to a device
(:func:`route`), keeps one :class:`DeviceScheduler` per device, and builds each step's one
:class:`~deepinfer_jax.engine.plan.StepPlan` from what the devices scheduled. A device's policy
(DeepInfer's step-type vote and prefill-only steps are not ported):

* **Continuous batching with chunked prefill, always on.** Every step mixes decode tokens of running requests
  and prefill chunks under one token budget, ``max_num_batched_tokens`` (any value >= 1: a prompt longer than
  the budget is prefilled over several steps), and at most ``max_num_seqs`` sequences.
* **Steps fill their bucket.** A step is padded to the smallest compiled ``(tokens, sequences)`` bucket that
  holds it. When its tokens would fill less than ``min_bucket_fill`` (default half) of that bucket, its
  prefill chunks are shortened to fill the largest smaller bucket exactly, and the rest runs next step:
  padding costs as much as real tokens, and a prefill split over full steps reaches its first token sooner.
* **Running requests first, then FCFS admission.** Running requests are served in admission order, each with
  one decode token or the next chunk of an unfinished prefill; then waiting requests are admitted strictly in
  order while the budgets, a free state slot and blocks for all their known tokens allow. The first request
  that does not fit stops admission, so a long prompt is never overtaken indefinitely by short ones.
* **Preemption by recompute.** When the step's decodes need more new blocks than are free, running requests
  are preempted longest output first (ties: the latest arrival) until the rest fit: their blocks and slot are
  freed and they go to the front of the queue; later their prompt and output so far are prefilled again.
  Outputs are never lost.
* **Requests that can never fit** (their longest possible context needs more blocks than the pool or the block
  table holds) end alone with ``finish_reason="error"`` as soon as they are added; the rest keep running.
* **Stops** are checked when a step's sampled tokens arrive (:meth:`DeviceScheduler.process_outputs`): EOS (unless
  ``ignore_eos``), ``stop_token_ids``, stop strings matched on the incrementally detokenized text (so a stop
  string split across tokens is found, and it is cut from ``text``), ``max_tokens`` and ``max_model_len``.
  Before ``min_tokens`` outputs, EOS / stop ids / stop strings do not stop the request.

**Asynchronous steps.** :meth:`DeviceScheduler.schedule` never needs the previous step's tokens: a decode row whose
input token is not yet known on the host carries :data:`~deepinfer_jax.engine.plan.PENDING_TOKEN` and the device
reads the token it sampled last step from the sequence's state slot. The scheduler accounts optimistically: a
scheduled sample counts as ``pending`` until :meth:`process_outputs` delivers it. Length stops are known in
advance (a request whose pending tokens will reach ``max_tokens`` is not scheduled again), so only EOS, stop ids
and stop strings can waste one step. Steps must be processed in the order they were scheduled. Blocks of a
request that stops are freed when its stop is seen, even if a step already dispatched still writes to them: the
device runs steps in order, so a later owner's writes always land after those stale ones.

A preempted request whose sampled token is still in flight stays at the front of the queue until the token
arrives (a recompute needs every token on the host); the token is kept, since the step that sampled it ran on
the request's cache before the cache was released.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from deepinfer_jax.cache.blocks import BlockAllocator, StateSlotManager, blocks_for_tokens
from deepinfer_jax.cache.prefix import HostEntry, HostTier, PrefixBlockPool, SnapshotPool, block_keys
from deepinfer_jax.engine.grammar import GrammarCompiler, RequestGrammar, bitmask_words
from deepinfer_jax.engine.params import (
    CompletionOutput,
    FinishReason,
    Logprob,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    derive_seed,
    validate_request,
)
from deepinfer_jax.engine.plan import (
    DeviceBatch,
    ScheduledRow,
    StepPlan,
    build_plan,
    choose_bucket,
    fill_deferred_masks,
)
from deepinfer_jax.engine.spec_budget import cumulative_rates
from deepinfer_jax.text.detokenize import IncrementalDetokenizer
from deepinfer_jax.text.tokenizer import Tokenizer

__all__ = [
    "DeviceScheduler",
    "PrefixCacheOptions",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerStats",
    "route",
]


@dataclasses.dataclass(frozen=True)
class PrefixCacheOptions:
    """Prefix caching of one engine (docs/prefix_cache.md).

    Attributes:
      salt: the key of "block -1" (:func:`~deepinfer_jax.cache.prefix.prefix_salt` of everything that changes
        cache contents).
      lookahead: tokens after a block that its cache entries depend on (1 for V3 drafting with its MTP layer,
        which pairs each position with the next token; else 0).
      snapshots: the model keeps per-sequence state outside the blocks (V4, V4.1): a hit needs a snapshot of
        that state at its boundary.
      snapshot_slots: state slots kept for snapshots (the last ones of the pool).
      snapshots_per_step, copies_per_step: the fixed widths of a step's snapshots and slot copies, so that
        taking or restoring snapshots never changes the compiled step.
      host_memory, host_ttl_s: the host-memory tier of evicted blocks and snapshots (bytes per device; 0 = off)
        and how long an entry lives after it was stored or last used.
      block_bytes, slot_bytes: what one block and one snapshot take in the host tier.
      replay_keep: SWA bounded replay's ``K`` (``scheduler.yoco_truncation`` on; 0 = off). The consumer layers'
        window entries of a snapshot then depend on the bound ``R = L - K`` of the request that wrote it, so a
        hit at boundary ``h`` restores a snapshot only for a request that needs none of them (its own
        ``R' >= h``) or whose bound is the same (docs/prefix_cache.md).
    """

    salt: bytes = b""
    lookahead: int = 0
    snapshots: bool = False
    snapshot_slots: int = 0
    snapshots_per_step: int = 4
    copies_per_step: int = 8
    host_memory: int = 0
    host_ttl_s: float = 7 * 86400.0
    block_bytes: int = 0
    slot_bytes: int = 0
    replay_keep: int = 0

    def replay_bound(self, known: int) -> int:
        """The bound ``R = L - K`` of a request that knows ``known`` tokens (``-1``: none, also for ``R <= 0``,
        which bounds nothing)."""
        bound = known - self.replay_keep
        return bound if self.replay_keep and bound > 0 else -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    """Queued: not yet admitted, or preempted and waiting to be recomputed."""
    RUNNING = "running"
    """Holds a state slot and blocks; prefilling or decoding."""
    FINISHED = "finished"


class Request:
    """The scheduler's state of one request. Read its attributes; only the scheduler changes them.

    Attributes:
        request_id, prompt (text or ``None``), prompt_token_ids (int32 array), params, seed (the resolved
        64-bit sampling seed).
        output_token_ids: sampled tokens received so far.
        num_computed: tokens whose cache entries are written or being written by a dispatched step.
        pending: tokens sampled by dispatched steps whose values have not reached the host yet.
        block_ids, slot: the request's blocks (table order) and state slot (-1 when it holds none).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: np.ndarray,
        params: SamplingParams,
        *,
        seed: int,
        prompt: str | None,
        arrival_time: float,
        order: int,
        max_model_len: int,
        detokenizer: IncrementalDetokenizer | None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seed = seed
        self.checked_sampling: tuple[Any, ...] | None = None
        """build_plan's cache of the checked sampling row: (params, vocabulary size, CheckedRow)."""
        self.order = order
        self.output_token_ids: list[int] = []
        self.num_computed = 0
        self.pending = 0
        self.block_ids: list[int] = []
        self.slot = -1
        self.status = RequestStatus.WAITING
        self.max_total_len = min(len(prompt_token_ids) + params.max_tokens, max_model_len)
        self.metrics = RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(prompt_token_ids))
        self.detokenizer = detokenizer
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        # vLLM's shape: one entry per prompt token, None for the first (nothing predicts it).
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None
        )
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.bad_words_ids: tuple[tuple[int, ...], ...] = ()
        """``params.bad_words`` as token sequences (vLLM's rule: each word with and without a leading space)."""
        # n > 1: this request computes the shared prompt once and forks into n children (docs/engine.md, "n").
        self.parent: Request | None = None
        self.index = 0
        self.children: list[Request] | None = None
        self.reserved_blocks: list[int] = []
        self.reserved_slots: list[int] = []
        # Structured outputs: the constraint (engine/grammar.py) once its grammar is compiled.
        self.grammar: RequestGrammar | None = None
        self.grammar_future: concurrent.futures.Future[Any] | None = None
        self.grammar_deadline = 0.0
        self.think_end: tuple[int, ...] | None = None
        # Speculative decoding: drafts of this request's in-flight rows (each may emit up to that many more
        # tokens than the one counted in ``pending``).
        self.spec_slack = 0
        # Variable-length verification: cumulative acceptance-rate estimates of the newest drafts received, and
        # of the ones before (engine/spec_varlen.py).
        self.spec_rates: list[float] = []
        self.spec_rates_prev: list[float] = []
        # The drafts its slot's pool holds, as of its last processed step (constrained requests verify them
        # under per-row grammar masks).
        self.spec_drafts: tuple[int, ...] = ()
        # A recompute under speculative decoding resumes where the run without preemption was: its last row feeds
        # every known token but the last output and emits that output again (golden), so the drafter drafts after
        # it from the same inputs and the next step verifies the drafts the uninterrupted run verified there.
        self.resume = False
        self.resuming = 0  # such rows in flight (their token is known, so ``pending`` does not count them)
        # Prefix caching: the keys of its full blocks so far, how many of its blocks are registered, the
        # snapshots its dispatched steps write whose keys are not known yet ({blocks before the boundary: slot}),
        # and the prompt tokens its first admission found cached (vLLM's num_cached_tokens).
        self.block_keys: list[bytes] = []
        self.num_registered = 0
        self.snapshots: dict[int, int] = {}
        self.snapshot_frontier = 0  # blocks before its newest snapshot (committed or restored)
        # SWA bounded replay: the bound R = L - K its consumer layers were computed under (-1: none), fixed at
        # admission; the snapshots it writes carry it.
        self.replay_bound = -1
        self.num_cached_tokens = 0

    @property
    def is_group(self) -> bool:
        """The request of ``n > 1`` samples (a parent, before or after it forked)."""
        return self.params.n > 1 and self.parent is None

    @property
    def unforked(self) -> bool:
        """A group that has not forked yet: it computes the prompt's first ``prompt_len - 1`` tokens."""
        return self.is_group and self.children is None

    @property
    def feed_len(self) -> int:
        """Tokens the scheduler may feed it: all known ones, or an unforked group's shared prefix."""
        return self.prompt_len - 1 if self.unforked else self.sample_len

    @property
    def sample_len(self) -> int:
        """A row that ends here samples: after every token, or before the last output of a resumed recompute."""
        return self.total_len - 1 if self.resume else self.total_len

    @property
    def width(self) -> int:
        """Sequences it will occupy once forked (``n`` for an unforked group, else 1)."""
        return self.params.n if self.unforked else 1

    @property
    def needs_host_tokens(self) -> bool:
        """Its next step's masks depend on the tokens generated so far (a bad word of several tokens), so it is
        scheduled only once its previous token has reached the host."""
        return self.grammar is not None or any(len(w) > 1 for w in self.bad_words_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_known(self) -> int:
        """Tokens known on the host: the prompt and the outputs received."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def total_len(self) -> int:
        """Tokens including those still in flight."""
        return self.num_known + self.pending

    @property
    def num_output_tokens(self) -> int:
        """Outputs received and in flight (what preemption's "longest output" compares)."""
        return len(self.output_token_ids) + self.pending

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Known tokens ``[start, stop)`` of the full sequence (prompt then outputs) as int32."""
        p = self.prompt_len
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        out = np.asarray(self.output_token_ids[max(start - p, 0) : stop - p], dtype=np.int32)
        if start >= p:
            return out
        return np.concatenate([self.prompt_token_ids[start:], out])

    def all_token_ids(self) -> np.ndarray:
        """Prompt and received outputs, int32 (what repetition penalties count)."""
        return self.tokens(0, self.num_known)

    def to_output(self, *, final: bool) -> RequestOutput:
        """A :class:`RequestOutput` of the current state (copies of the lists unless ``final``); a group's holds
        one completion per sample, in sample order."""
        copy = (lambda x: x) if final else (lambda x: None if x is None else list(x))
        if self.is_group:
            samples = self.children or []
            completions = [c.completion(copy) for c in samples]
            # Samples not forked yet (a group that ended before its fork: an error or an abort) end with it.
            ended = self.status is RequestStatus.FINISHED
            completions += [
                CompletionOutput(
                    index=i,
                    text="",
                    token_ids=[],
                    cumulative_logprob=None,
                    logprobs=None,
                    finish_reason=self.finish_reason if ended else None,
                    error=self.error if ended else None,
                )
                for i in range(len(samples), self.params.n)
            ]
            metrics = dataclasses.replace(self.metrics)
            for c in samples:
                m = c.metrics
                metrics.num_generated_tokens += m.num_generated_tokens
                metrics.num_preemptions += m.num_preemptions
                if m.first_token_time is not None and (
                    metrics.first_token_time is None or m.first_token_time < metrics.first_token_time
                ):
                    metrics.first_token_time = m.first_token_time
                if m.finish_time is not None:
                    metrics.finish_time = max(metrics.finish_time or m.finish_time, m.finish_time)
            return RequestOutput(
                request_id=self.request_id,
                prompt=self.prompt,
                prompt_token_ids=self.prompt_token_ids.tolist(),
                outputs=completions,
                prompt_logprobs=copy(self.prompt_logprobs),
                metrics=metrics,
                finished=self.status is RequestStatus.FINISHED,
                num_cached_tokens=self.num_cached_tokens,
            )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids.tolist(),
            outputs=[self.completion(copy)],
            prompt_logprobs=copy(self.prompt_logprobs),
            metrics=self.metrics if final else dataclasses.replace(self.metrics),
            finished=self.status is RequestStatus.FINISHED,
            num_cached_tokens=self.num_cached_tokens,
        )

    def completion(self, copy: Callable[[Any], Any]) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=copy(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=copy(self.logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            error=self.error,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={self.prompt_len}, "
            f"outputs={len(self.output_token_ids)}+{self.pending}, computed={self.num_computed}, "
            f"blocks={len(self.block_ids)}, slot={self.slot})"
        )


@dataclasses.dataclass
class SchedulerStats:
    """Counters since construction."""

    num_steps: int = 0
    num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    """Rows that feed one output token and sample the next (the rest count as prefill tokens)."""
    num_padding_tokens: int = 0
    num_loop_steps: int = 0
    """Decode-loop steps (``num_decode_steps > 1``): steps whose rows ran several decode iterations in one call."""
    num_loop_iterations: int = 0
    """Decode iterations those steps ran (the device ends a call early once every row has stopped)."""
    num_preemptions: int = 0
    num_wasted_samples: int = 0
    """Samples discarded because their request had stopped after the step was scheduled."""
    num_masked_steps: int = 0
    """Steps with a grammar-constrained row (structured outputs; counted on device 0's stats)."""
    mask_seconds: float = 0.0
    """Host time spent filling grammar masks (counted on device 0's stats)."""
    num_deferred_masks: int = 0
    """Constrained rows scheduled while their previous token was in flight, their masks filled after the step's
    dispatch (counted on device 0's stats)."""
    num_spec_rows: int = 0
    """Speculative decoding: decode rows processed (with or without drafts left to verify)."""
    num_spec_emitted: int = 0
    """Tokens those rows emitted (accepted drafts and bonus tokens, before stops cut them)."""
    verified_at: list[int] = dataclasses.field(default_factory=list)
    """``verified_at[i]``: draft ``i + 1`` verified (summed over rows)."""
    accepted_at: list[int] = dataclasses.field(default_factory=list)
    """``accepted_at[i]``: draft ``i + 1`` accepted."""
    confidence_error_sum: float = 0.0
    """``Σ |acceptance probability - confidence|`` over the verified drafts."""
    prefix_cache_queries: int = 0
    """Prefix caching: prompt tokens looked up at admission (vLLM's ``queries``)."""
    prefix_cache_hits: int = 0
    """Prefix caching: of those, tokens found cached (the prefill they skipped)."""
    prefix_cache_host_hits: int = 0
    """Prefix caching: of those, tokens whose blocks came back from the host-memory tier."""
    num_snapshots: int = 0
    """Prefix caching: window-state snapshots written."""
    num_snapshot_restores: int = 0
    """Prefix caching: hits that restored a snapshot."""

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens verified (every position)."""
        return sum(self.verified_at)

    @property
    def num_accepted_draft_tokens(self) -> int:
        """Draft tokens accepted (every position)."""
        return sum(self.accepted_at)


def _priority(req: Request) -> tuple[int, int]:
    """Serving order of running requests (ascending) and preemption order (descending): output length, then
    arrival."""
    return req.num_output_tokens, req.order


def _positive(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"Scheduler {name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"Scheduler {name} = {value} must be >= {minimum}")
    return int(value)


class DeviceScheduler:
    """One device's scheduler over its block pool and state-slot pool; see the module docstring for the policy.

    Args:
        num_blocks: cache blocks in the pool (block 0 is reserved, so ``num_blocks - 1`` are usable).
        block_size: token positions per block.
        max_num_seqs: most sequences in one step, and most requests holding cache at once.
        max_num_batched_tokens: most tokens in one step (>= 1; chunked prefill splits longer prompts).
        max_model_len: most tokens (prompt + output) of a request.
        vocab_size: the model's vocabulary (validates prompts, stop ids and sampled tokens).
        eos_token_ids: ids that end a request unless ``ignore_eos``.
        num_state_slots: slots in the pool, slot 0 reserved (default ``max_num_seqs + 1``).
        max_blocks_per_seq: width of the block tables in plans (default: enough for ``max_model_len``).
        buckets: the compiled ``(tokens, sequences)`` shapes plans are padded to. The budgets are lowered to
            the largest bucket sizes, and a bucket holding both budgets must exist. Default: one bucket of the
            budgets.
        tokenizer: detokenizes outputs into ``text`` and decodes logprob tokens; ``None`` = ids only (``text``
            stays ``""``, and stop strings are refused).
        stream: :meth:`process_outputs` also returns a snapshot of every request that received a token.
        clock: time source of the metrics.
        min_bucket_fill: when a step's tokens fill less than this fraction of the bucket they would be padded
            to, its prefill chunks are shortened to fill a smaller bucket exactly instead (0 disables this;
            with a single bucket there is nothing smaller to fill).
        num_decode_steps: the decode loop's bound (``scheduler.num_decode_steps``): when nothing waits and every
            running request decodes plainly, one step runs up to this many decode iterations in one device call
            (:meth:`loop_ready`, docs/engine.md "Decode loop"); 1 = one token per step.
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int = 128,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        num_state_slots: int | None = None,
        max_blocks_per_seq: int | None = None,
        buckets: Sequence[tuple[int, int]] | None = None,
        tokenizer: Tokenizer | None = None,
        stream: bool = False,
        clock: Callable[[], float] = time.monotonic,
        min_bucket_fill: float = 0.5,
        grammar_compiler: GrammarCompiler | None = None,
        num_draft_tokens: int = 0,
        force_drafts: bool = False,
        verify_planner: Any = None,
        prefix_cache: PrefixCacheOptions | None = None,
        num_decode_steps: int = 1,
    ) -> None:
        self.verify_planner = verify_planner
        self.prefix_cache = prefix_cache
        self.grammar_compiler = grammar_compiler
        self.force_drafts = bool(force_drafts)
        self.defer_masks = False
        """A constrained row may be scheduled while its previous token is in flight: its grammar masks are
        filled after the step's dispatch (:attr:`StepPlan.deferred_masks`), by a runner that dispatches such a
        step in two halves (:meth:`StepExecutor.run`). Off: it waits for its token (any other driver)."""
        self.whole_drafts = False
        """A decode row verifies all the drafts it would verify alone (``num_draft_tokens``, or one less than the
        token budget) or waits for the next step, instead of verifying the fewer that the step's budget has left:
        the drafts a row verifies decide which random stream draws each of its tokens, so in batch-invariant
        mode they must not depend on the batch (LLM sets it with ``ops.batch_invariant``)."""
        self.num_draft_tokens = _positive("num_draft_tokens", num_draft_tokens, 0)
        self.num_decode_steps = _positive("num_decode_steps", num_decode_steps)
        # Positions a speculative request may write past its known tokens: the drafts of a row in flight, the
        # drafts of the next row, and the draft layer's extra positions (docs/speculative.md, "blocks").
        self.spec_margin = 3 * self.num_draft_tokens
        self.block_size = _positive("block_size", block_size)
        self.max_num_seqs = _positive("max_num_seqs", max_num_seqs)
        self.max_num_batched_tokens = _positive("max_num_batched_tokens", max_num_batched_tokens)
        self.max_model_len = _positive("max_model_len", max_model_len, 2)
        self.vocab_size = _positive("vocab_size", vocab_size)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        for t in self.eos_token_ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"Scheduler eos_token_ids: {t} is outside the vocabulary [0, {self.vocab_size})"
                )
        slots = self.max_num_seqs + 1 if num_state_slots is None else num_state_slots
        num_blocks = _positive("num_blocks", num_blocks, 2)
        slots = _positive("num_state_slots", slots, 2)
        self.snapshots: SnapshotPool | None = None
        self._snapshot_bounds: dict[bytes, int] = {}  # bounded replay: a cached snapshot's writer's bound
        if prefix_cache is None:
            self.blocks = BlockAllocator(num_blocks, self.block_size)
        else:
            self.blocks = PrefixBlockPool(num_blocks, self.block_size)
            kept = prefix_cache.snapshot_slots if prefix_cache.snapshots else 0
            if not 0 <= kept <= slots - 2:
                raise ValueError(
                    f"Scheduler prefix_cache.snapshot_slots = {kept} must leave at least one live slot of the "
                    f"{slots - 1}"
                )
            if kept:
                slots -= kept
                self.snapshots = SnapshotPool(slots, kept)
        self.host: HostTier | None = None
        if prefix_cache is not None and prefix_cache.host_memory > 0:
            self.host = HostTier(prefix_cache.host_memory, prefix_cache.host_ttl_s, clock)
        # Host-tier transfers of the step being planned, made before it runs: (entry, block, slot), -1 = none.
        self._host_saves: list[tuple[HostEntry, int, int]] = []
        self._host_loads: list[tuple[HostEntry, int, int]] = []
        self.slots = StateSlotManager(slots)
        width = blocks_for_tokens(self.max_model_len, self.block_size)
        self.max_blocks_per_seq = (
            width if max_blocks_per_seq is None else _positive("max_blocks_per_seq", max_blocks_per_seq)
        )
        if buckets is None:
            seqs = min(self.max_num_seqs, self.max_num_batched_tokens)
            buckets = [(self.max_num_batched_tokens, seqs)]
        self.buckets = self._check_buckets(buckets)
        self.token_budget = min(self.max_num_batched_tokens, max(t for t, _ in self.buckets))
        self.seq_budget = min(self.max_num_seqs, max(s for _, s in self.buckets))
        choose_bucket(self.token_budget, min(self.seq_budget, self.token_budget), self.buckets)
        if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
            raise TypeError(
                f"Scheduler tokenizer must be a Tokenizer or None, got {type(tokenizer).__name__}"
            )
        self.tokenizer = tokenizer
        self.stream = bool(stream)
        self._clock = clock
        if isinstance(min_bucket_fill, bool) or not isinstance(min_bucket_fill, int | float):
            raise TypeError(
                f"Scheduler min_bucket_fill must be a float, got {type(min_bucket_fill).__name__} "
                f"({min_bucket_fill!r})"
            )
        if not 0.0 <= min_bucket_fill <= 1.0:
            raise ValueError(f"Scheduler min_bucket_fill = {min_bucket_fill} must be in [0, 1]")
        self.min_bucket_fill = float(min_bucket_fill)
        self._requests: dict[str, Request] = {}
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._ready: list[RequestOutput] = []
        self._compiling: list[Request] = []  # structured-output requests whose grammar is not compiled yet
        self._in_flight: dict[DeviceBatch, None] = {}
        self._block_copies: list[tuple[int, int]] = []  # forks' copies, made by the next step
        self._slot_copies: list[tuple[int, int]] = []
        self._restores = 0  # prefix-cache hits of the step being planned that restore a snapshot
        self._order = 0
        self.stats = SchedulerStats()

    @staticmethod
    def _check_buckets(buckets: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
        out = []
        for i, bucket in enumerate(buckets):
            if not isinstance(bucket, tuple | list) or len(bucket) != 2:
                raise TypeError(f"Scheduler buckets[{i}] = {bucket!r} must be a (tokens, sequences) pair")
            out.append(
                (
                    _positive(f"buckets[{i}] tokens", bucket[0]),
                    _positive(f"buckets[{i}] sequences", bucket[1]),
                )
            )
        if not out:
            raise ValueError("Scheduler buckets is empty; give at least one (tokens, sequences) pair")
        return tuple(sorted(set(out)))

    # ------------------------------------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Any,
        params: SamplingParams,
        *,
        seed: int,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request (tier-1 validation first: bad input raises and nothing is queued).

        ``seed`` is the request's resolved sampling seed (``params.seq_seed`` when set; the facade derives one
        otherwise). A request whose longest possible context can never fit the cache is accepted and finished
        at once with ``finish_reason="error"``; its output comes with the next :meth:`process_outputs` or
        :meth:`take_ready_outputs`.
        """
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already queued or running")
        ids = validate_request(
            prompt_token_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )
        if params.max_tokens is None:  # vLLM's "until max_model_len"
            params = params.replace(max_tokens=self.max_model_len - len(ids))
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
            raise TypeError(f"seed must be an int, got {type(seed).__name__} ({seed!r})")
        if not 0 <= seed < 2**64:
            raise ValueError(f"seed = {seed} must be in [0, 2**64)")
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"sampling_params.stop = {list(params.stop)!r} needs a tokenizer to match text; this engine has none"
            )
        detok = None
        if self.tokenizer is not None and params.detokenize:
            # vLLM's default: special tokens (BOS/EOS/pad) do not appear in text; chat markers do.
            detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
        now = self._clock() if arrival_time is None else float(arrival_time)
        req = Request(
            request_id,
            ids,
            params,
            seed=int(seed),
            prompt=prompt,
            arrival_time=now,
            order=self._order,
            max_model_len=self.max_model_len,
            detokenizer=detok,
        )
        if params.bad_words:
            req.bad_words_ids = self._bad_words_ids(params.bad_words)
        so = params.structured_outputs
        think_end = None
        if params.thinking_token_budget is not None and (so is None or so.trigger_token_ids is None):
            end = None if self.tokenizer is None else self.tokenizer.token_to_id("</think>")
            if end is None:
                raise ValueError(
                    "sampling_params.thinking_token_budget needs the end of the reasoning: a tokenizer with a "
                    "</think> token, or structured_outputs.trigger_token_ids"
                )
            think_end = (end,)
        if so is not None:
            if self.grammar_compiler is None:
                raise ValueError(
                    "sampling_params.structured_outputs needs a grammar compiler (an engine with a tokenizer)"
                )
            req.grammar_future = self.grammar_compiler.submit(so.grammar_text())
            req.grammar_deadline = time.monotonic() + self.grammar_compiler.timeout_s
            req.think_end = think_end
        elif params.thinking_token_budget is not None:
            req.grammar = RequestGrammar.for_params(
                None,
                None,
                bitmask_words(self.vocab_size),
                budget=params.thinking_token_budget,
                think_end=think_end,
                eos=self.eos_token_ids,
            )
        self._order += 1
        # The longest context ever cached: the last token sampled never enters the cache.
        most_blocks = blocks_for_tokens(req.max_total_len - 1 + self.spec_margin, self.block_size)
        limit = min(self.blocks.capacity, self.max_blocks_per_seq)
        error = None
        if most_blocks > limit:
            error = (
                f"request {request_id!r} can never fit the cache: up to "
                f"{req.max_total_len - 1 + self.spec_margin} cached tokens "
                f"need {most_blocks} blocks of {self.block_size} tokens, but the cache holds "
                f"{self.blocks.capacity} blocks and a block table {self.max_blocks_per_seq}"
            )
        elif req.is_group:
            if params.n > min(self.max_num_seqs, self.slots.capacity):
                raise ValueError(
                    f"sampling_params.n = {params.n} exceeds the {min(self.max_num_seqs, self.slots.capacity)} "
                    "sequences one device runs at once (the n samples of a prompt run together)"
                )
            # Admission holds the shared prefix and a private copy of its last partial block for every other
            # sample (each sample's own table stays within the per-sequence limit checked above).
            prefix = blocks_for_tokens(req.prompt_len - 1, self.block_size)
            partial = (req.prompt_len - 1) % self.block_size != 0
            group_blocks = prefix + (params.n - 1 if partial else 0)
            if group_blocks > self.blocks.capacity:
                error = (
                    f"request {request_id!r} can never fit the cache: its n = {params.n} samples start with "
                    f"{group_blocks} blocks of {self.block_size} tokens (the shared prompt and a copy of its last "
                    f"partial block per extra sample), but the cache holds {self.blocks.capacity} blocks"
                )
        if error is not None:
            self._requests[request_id] = req
            self._finish(req, "error", error=error)
            self._ready.append(req.to_output(final=True))
            return
        self._requests[request_id] = req
        if req.grammar_future is not None:
            self._compiling.append(req)
        else:
            self._waiting.append(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End an unfinished request now, with ``finish_reason="abort"``; returns its final output (``None`` when
        no unfinished request has this id). Used by ``AsyncLLM.abort`` (a caller, a client that disconnected);
        :meth:`abort_all` is its counterpart for every request at once (``LLM``'s recovery after a failed run).

        Its blocks and state slot are freed at once, queued or running, even while a dispatched step still
        computes its next token: the device runs steps in order, so a later owner's writes land after that
        step's, and the step's sample is dropped when it arrives (counted in ``stats.num_wasted_samples``). A
        request with ``n`` samples ends with all of them.
        """
        req = self._requests.get(request_id)
        if req is None:
            return None
        self._finish(req, "abort")
        return req.to_output(final=True)

    def abort_all(self) -> list[str]:
        """After a failed run: forget every request and every step in flight and free every block and slot at
        once, whatever state the failure left them in. Returns the ids of the requests dropped."""
        dropped = list(self._requests)
        for req in self._requests.values():
            req.status = RequestStatus.FINISHED
            req.finish_reason = "abort"
            req.block_ids, req.slot = [], -1
        self._requests.clear()
        self._waiting.clear()
        self._running.clear()
        self._ready.clear()
        self._compiling.clear()
        self._in_flight.clear()
        self._block_copies.clear()
        self._slot_copies.clear()
        self.blocks.reset()
        self.slots.reset()
        if self.snapshots is not None:
            self.snapshots.reset()
        if self.host is not None:
            self.host.reset()
        self._host_saves.clear()
        self._host_loads.clear()
        self._restores = 0
        return dropped

    def _bad_words_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's tokenization of ``bad_words``: each word without and with a leading space (the latter only when it
        is another token sequence of the same length)."""
        if self.tokenizer is None:
            raise ValueError(
                "sampling_params.bad_words needs a tokenizer to tokenize the words; this engine has none"
            )
        out: list[tuple[int, ...]] = []
        for i, word in enumerate(words):
            plain = tuple(self.tokenizer.encode(word.lstrip()))
            if not plain:
                raise ValueError(f"sampling_params.bad_words[{i}] = {word!r} tokenizes to no token")
            out.append(plain)
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip()))
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        for w in out:
            for t in w:
                if not 0 <= t < self.vocab_size:
                    raise ValueError(f"sampling_params.bad_words: token {t} is outside the vocabulary")
        return tuple(dict.fromkeys(out))

    def get_request(self, request_id: str) -> Request:
        """The state of an unfinished request (``KeyError`` once it has finished)."""
        return self._requests[request_id]

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued or running, or a finished one has not been reported yet."""
        return bool(self._waiting or self._running or self._ready or self._compiling)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_in_flight(self) -> int:
        """Plans scheduled and not yet processed."""
        return len(self._in_flight)

    # ------------------------------------------------------------------------------------------- schedule

    @property
    def num_compiling(self) -> int:
        """Structured-output requests waiting for their grammar."""
        return len(self._compiling)

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar is compiled (in arrival order); end alone those whose compile failed
        or ran past the timeout. Never blocks."""
        if not self._compiling:
            return
        now = time.monotonic()
        still: list[Request] = []
        for req in self._compiling:
            future = req.grammar_future
            assert future is not None
            if future.done():
                err = future.exception()
                if err is None:
                    so = req.params.structured_outputs
                    req.grammar = RequestGrammar.for_params(
                        so,
                        future.result(),
                        bitmask_words(self.vocab_size),
                        budget=req.params.thinking_token_budget,
                        think_end=req.think_end,
                        eos=self.eos_token_ids,
                    )
                    req.grammar_future = None
                    self._waiting.append(req)
                    continue
                problem = f"its grammar does not compile: {err}"
            elif now >= req.grammar_deadline:
                problem = (
                    f"its grammar did not compile within sampling.grammar_compile_timeout_s = "
                    f"{self.grammar_compiler.timeout_s if self.grammar_compiler else 0:g} s"
                )
            else:
                still.append(req)
                continue
            req.grammar_future = None
            self._finish(req, "error", error=f"request {req.request_id!r}: {problem}")
            self._ready.append(req.to_output(final=True))
        self._compiling = still

    def wait_for_grammars(self, timeout: float) -> None:
        """Block until a pending grammar compile finishes, its deadline passes, or ``timeout`` seconds (for a
        loop with nothing else to do)."""
        if not self._compiling:
            return
        first = min(r.grammar_deadline for r in self._compiling)
        wait = max(0.0, min(timeout, first - time.monotonic()))
        futures = [r.grammar_future for r in self._compiling if r.grammar_future is not None]
        concurrent.futures.wait(futures, timeout=wait, return_when=concurrent.futures.FIRST_COMPLETED)

    def schedule(self, loop_steps: int = 1) -> DeviceBatch | None:
        """This device's rows of the next step, or ``None`` when nothing can run now (everything waits for
        in-flight tokens or a grammar compile, or there is no work). ``loop_steps > 1``: the step is a decode loop
        of at most that many iterations (the engine's scheduler decides it, :meth:`loop_ready`): every plain
        decode row gets its :attr:`~deepinfer_jax.engine.plan.ScheduledRow.iterations` and the blocks for them."""
        self._admit_compiled()
        if self.snapshots is not None:
            self.snapshots.begin_step()  # the slots this step restores are pinned from here on
        for req in list(self._running):
            if req.unforked and req.num_computed == req.feed_len:
                self._fork(req)
        rows, tokens_left = self._schedule_running(loop_steps)

        while self._waiting and tokens_left > 0 and len(rows) < self.seq_budget:
            req = self._waiting[0]
            if self._num_sequences() + req.width > self.max_num_seqs:
                break
            if req.pending:
                break  # a recompute needs every token on the host; strict FCFS waits for it
            # A recompute with outputs resumes at its last output (Request.resume) when the engine drafts.
            req.resume = bool(self.num_draft_tokens) and len(req.output_token_ids) > 0
            hit, loaded, restore = self._lookup(req)
            if isinstance(restore, int) and self._restores >= self._max_restores():
                break  # the step's slot copies are full; it is admitted next step
            start = (len(hit) + len(loaded)) * self.block_size
            need = self.blocks.blocks_for(req.feed_len + self._draft_extra(True)) - len(hit)
            # Cached blocks nobody owns count as free until this request takes them.
            taken = sum(self.blocks.is_evictable(b) for b in hit) if hit else 0
            # An unforked group also reserves its other samples' slots and copies of its partial last block.
            spare = req.params.n - 1 if req.unforked and req.feed_len % self.block_size else 0
            if need + spare + taken > self.blocks.num_free or self.slots.num_free < req.width:
                break
            self._waiting.popleft()
            self._count_lookup(req, start)
            if self.prefix_cache is not None:
                req.replay_bound = self.prefix_cache.replay_bound(req.num_known)
            if hit:
                self.blocks.acquire(hit)
            req.block_ids = hit + self.blocks.allocate(need)
            req.slot = self.slots.allocate_one()
            self.stats.prefix_cache_host_hits += len(loaded) * self.block_size
            for entry, block in zip(loaded, req.block_ids[len(hit) :], strict=False):
                # Copied back from the host before the step runs; cached again under its key at once.
                self._host_loads.append((entry, block, -1))
                self.blocks.register(block, entry.key)  # type: ignore[attr-defined]
            req.num_registered = len(hit) + len(loaded)
            req.snapshot_frontier = start // self.block_size if restore is not None else 0
            if isinstance(restore, HostEntry):
                self._host_loads.append((restore, -1, req.slot))
                self.stats.num_snapshot_restores += 1
            elif restore is not None:
                self._slot_copies.append((restore, req.slot))
                self._restores += 1
                self.stats.num_snapshot_restores += 1
            if req.unforked:
                req.reserved_blocks = self.blocks.allocate(spare)
                req.reserved_slots = self.slots.allocate(req.width - 1)
            req.status = RequestStatus.RUNNING
            req.num_computed = start
            self._running.append(req)
            q = min(req.feed_len - start, tokens_left)
            if q == 0:  # an unforked group of a one-token prompt: nothing is shared, it forks at once
                self._fork(req)
                continue
            sample = start + q == req.sample_len
            rows.append(ScheduledRow(req, start, q, sample, False, False, resume=sample and req.resume))
            tokens_left -= q

        if not rows:
            return None
        return self._commit(self._fill_bucket(rows))

    # ------------------------------------------------------------------------------------ prefix caching

    def _reuses(self, req: Request) -> bool:
        """Whether ``req`` may start from cached blocks. Not with prompt logprobs (every prompt token's logits are
        wanted) nor with repetition / presence / frequency penalties: their per-slot token counts cover the tokens
        the slot computed, and a restored slot's counts are another request's."""
        if self.prefix_cache is None:
            return False
        p = req.params
        return (
            p.prompt_logprobs is None
            and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0
        )

    def _keys(self, req: Request, count: int) -> list[bytes]:
        """The keys of ``req``'s first ``count`` full blocks (as far as its known tokens reach), made once."""
        opts = self.prefix_cache
        assert opts is not None
        have = len(req.block_keys)
        if count > have and (have + 1) * self.block_size + opts.lookahead <= req.num_known:
            req.block_keys += block_keys(
                req.tokens(0, min(req.num_known, count * self.block_size + opts.lookahead)),
                self.block_size,
                salt=opts.salt,
                first=have,
                previous=req.block_keys[-1] if have else None,
                lookahead=opts.lookahead,
                count=count - have,
            )
        return req.block_keys[:count]

    def _lookup(self, req: Request) -> tuple[list[int], list[HostEntry], int | HostEntry | None]:
        """Where ``req``'s hit comes from: the cached device blocks it starts from, the host-tier blocks that
        follow them, and the snapshot to restore (a snapshot slot, a host-tier entry, or ``None``: none needed).

        The hit covers the longest cached chain of its full blocks that leaves at least one token to compute
        (the last one must be sampled from); a model with per-sequence state also needs a snapshot at the hit's
        boundary, so the hit steps back to the last boundary that has one."""
        if not self._reuses(req) or req.feed_len <= self.block_size:
            return [], [], None
        limit = (req.feed_len - 1) // self.block_size
        keys = self._keys(req, limit)
        blocks = self.blocks.lookup(keys)  # type: ignore[attr-defined]
        host: list[HostEntry] = []
        if self.host is not None:
            while len(blocks) + len(host) < len(keys):
                entry = self.host.get("block", keys[len(blocks) + len(host)])
                if entry is None:
                    break
                host.append(entry)
        n = len(blocks) + len(host)
        if self.prefix_cache is not None and self.prefix_cache.snapshots:
            pool = self.snapshots
            bound = self.prefix_cache.replay_bound(req.num_known)
            restore: int | HostEntry | None = None
            while n:
                key = keys[n - 1]
                if self._snapshot_usable(key, n * self.block_size, bound):
                    restore = None if pool is None else pool.get(key)
                    if restore is None and self.host is not None:
                        restore = self.host.get("state", key)
                    if restore is not None:
                        break
                n -= 1
            if not n:
                return [], [], None
            if isinstance(restore, int):
                assert pool is not None
                restore = pool.restore(keys[n - 1])
            return blocks[:n], host[: max(n - len(blocks), 0)], restore
        return blocks, host, None

    def cached_prefix(self, prompt_token_ids: Any) -> int:
        """Prompt tokens a request of these ids would find cached here now (device blocks, then the host tier;
        for a model with per-sequence state up to the last boundary with a snapshot). Changes nothing: the
        router's look (:meth:`Scheduler.add_request`)."""
        opts = self.prefix_cache
        ids = np.asarray(prompt_token_ids, dtype=np.int32)
        if opts is None or len(ids) <= self.block_size:
            return 0
        limit = (len(ids) - 1) // self.block_size
        keys = block_keys(
            ids[: limit * self.block_size + opts.lookahead],
            self.block_size,
            salt=opts.salt,
            lookahead=opts.lookahead,
            count=limit,
        )
        n = len(self.blocks.lookup(keys))  # type: ignore[attr-defined]
        if self.host is not None:
            while n < len(keys) and self.host.contains("block", keys[n]):
                n += 1
        if opts.snapshots:
            bound = opts.replay_bound(len(ids))
            while n and not (
                self._snapshot_usable(keys[n - 1], n * self.block_size, bound)
                and (
                    (self.snapshots is not None and self.snapshots.get(keys[n - 1]) is not None)
                    or (self.host is not None and self.host.contains("state", keys[n - 1]))
                )
            ):
                n -= 1
        return n * self.block_size

    def _snapshot_usable(self, key: bytes, boundary: int, bound: int) -> bool:
        """Whether the snapshot cached at ``boundary`` under ``key`` (if any) serves a request of replay bound
        ``bound``. Without bounded replay, always. With it, the consumer layers' window entries of a snapshot
        were computed under its writer's bound ``R_s`` (entries before ``R_s`` were never written, and the
        ones after depend on it): a request whose own bound is at or past the boundary reads none of them (its
        consumer rows and windows start at ``R' >= h``), and one with ``R' == R_s`` reads exactly what it would
        have computed; any other steps back."""
        opts = self.prefix_cache
        if opts is None or not opts.replay_keep or bound >= boundary:
            return True
        return self._snapshot_bounds.get(key) == bound

    def _count_lookup(self, req: Request, hit_tokens: int) -> None:
        if self.prefix_cache is None:
            return
        if req.metrics.first_scheduled_time is None:
            req.num_cached_tokens = hit_tokens
        self.stats.prefix_cache_queries += req.feed_len
        self.stats.prefix_cache_hits += hit_tokens

    def _max_restores(self) -> int:
        opts = self.prefix_cache
        assert opts is not None
        return max(opts.copies_per_step - opts.snapshots_per_step, 1)

    def _cache_blocks(self, req: Request) -> None:
        """Register ``req``'s full blocks whose tokens are known and whose cache entries a dispatched step
        writes, and cache the snapshots whose boundary keys are now known."""
        if self.prefix_cache is None or not req.block_ids:
            return
        done = min(req.num_computed, req.num_known - self.prefix_cache.lookahead) // self.block_size
        done = min(done, len(req.block_ids))
        if done > req.num_registered:
            keys = self._keys(req, done)
            done = len(keys)
            for i in range(req.num_registered, done):
                self.blocks.register(req.block_ids[i], keys[i])  # type: ignore[attr-defined]
            req.num_registered = done
        if req.snapshots and self.snapshots is not None:
            for n in sorted(n for n in req.snapshots if n <= req.num_registered):
                key = req.block_keys[n - 1]
                if self.snapshots.commit(req.snapshots.pop(n), key) and self.prefix_cache.replay_keep:
                    self._remember_bound(key, req.replay_bound)
                if n > req.snapshot_frontier:
                    # The sequence's newest snapshot supersedes its older one, which goes first when slots run out.
                    if req.snapshot_frontier:
                        self.snapshots.demote(req.block_keys[req.snapshot_frontier - 1])
                    req.snapshot_frontier = n
                else:
                    self.snapshots.demote(req.block_keys[n - 1])

    def _remember_bound(self, key: bytes, bound: int) -> None:
        """Record the replay bound of the snapshot just cached under ``key``; the record outlives the slot while
        the host tier may hold the snapshot, and records of snapshots held nowhere are pruned now and then."""
        self._snapshot_bounds[key] = bound
        live = (0 if self.snapshots is None else self.snapshots.size) + (
            0 if self.host is None else len(self.host)
        )
        if len(self._snapshot_bounds) > 2 * live + 64:
            self._snapshot_bounds = {
                k: b
                for k, b in self._snapshot_bounds.items()
                if (self.snapshots is not None and self.snapshots.get(k) is not None)
                or (self.host is not None and self.host.contains("state", k))
            }

    def _drop_snapshots(self, req: Request) -> None:
        """Free the snapshot slots whose boundary keys never became known (the request ended or was preempted
        before its tokens arrived)."""
        if req.snapshots and self.snapshots is not None:
            for slot in req.snapshots.values():
                self.snapshots.release(slot)
        req.snapshots = {}

    def _plan_snapshots(self, rows: Sequence[ScheduledRow]) -> list[tuple[int, int, int]]:
        """The window-state snapshots this step writes: for rows whose positions the host knows (not a
        speculative decode row, which the device places itself), at the block boundaries they pass, the
        last boundary of each row first, at most ``snapshots_per_step``. A boundary already cached with a
        snapshot is skipped."""
        opts, pool = self.prefix_cache, self.snapshots
        if opts is None or pool is None:
            return []
        bs = self.block_size
        wanted: list[list[tuple[int, int]]] = []
        for i, row in enumerate(rows):
            req = row.request
            end = row.start + row.length - row.num_drafts
            if row.shifted or row.num_drafts or end < bs:
                wanted.append([])
                continue
            known = [] if row.pending_input else self._keys(req, end // bs)
            mine = []
            for h in range(end // bs * bs, row.start, -bs):
                n = h // bs
                if n <= len(known) and pool.get(known[n - 1]) is not None:
                    continue
                mine.append((i, h))
            wanted.append(mine)
        out: list[tuple[int, int, int]] = []
        depth = 0
        while len(out) < opts.snapshots_per_step and any(depth < len(w) for w in wanted):
            for mine in wanted:
                if depth < len(mine) and len(out) < opts.snapshots_per_step:
                    i, h = mine[depth]
                    slot = pool.take()
                    if slot is None:
                        return out
                    out.append((i, h, slot))
            depth += 1
        return out

    def _sync_evictions(self) -> None:
        """Blocks the pool evicted take their snapshots with them (a hit needs the blocks before the snapshot);
        with a host tier, both go there, and so do snapshots evicted from their pool. The saves read the device
        before the step that reuses the block or slot runs."""
        evicted = self.blocks.evicted  # type: ignore[attr-defined]
        states: list[tuple[bytes, int]] = []
        if self.snapshots is not None:
            states = self.snapshots.evicted + self.snapshots.discard([k for k, _ in evicted])
            self.snapshots.evicted = []
        if self.host is not None:
            opts = self.prefix_cache
            assert opts is not None
            for key, block in evicted:
                entry = self.host.put("block", key, opts.block_bytes)
                if entry is not None:
                    self._host_saves.append((entry, block, -1))
            for key, slot in states:
                entry = self.host.put("state", key, opts.slot_bytes)
                if entry is not None:
                    self._host_saves.append((entry, -1, slot))
        evicted.clear()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and snapshot (``LLM.reset_prefix_cache``); False without prefix caching."""
        if self.prefix_cache is None:
            return False
        self.blocks.clear_cache()  # type: ignore[attr-defined]
        self.blocks.evicted.clear()  # type: ignore[attr-defined]
        if self.snapshots is not None:
            self.snapshots.clear()
        if self.host is not None:
            self.host.reset()
        self._snapshot_bounds.clear()
        for req in self._running:
            req.num_registered = len(req.block_ids)  # their blocks stay theirs, unregistered
            self._drop_snapshots(req)
        return True

    def _draft_extra(self, sample: bool) -> int:
        """Positions past a sampling row's context that its draft layer writes (drafts 2..K)."""
        return max(self.num_draft_tokens - 1, 0) if sample else 0

    def _tokens_held(self, req: Request, end: int, sample: bool) -> int:
        """Positions ``req`` may have written once a row ending at host position ``end`` has run: its in-flight
        drafts may put the row further, and a sampling row's draft layer writes past it. Never more than the
        ``max_total_len - 1 + spec_margin`` positions admission sized the request for: a row's true length never
        passes ``max_total_len + K`` (a decode loop stops a row on the device at ``max_total_len``; one step
        emits at most ``K + 1`` tokens), and a step writes at most ``2K - 1`` positions past its row's pending
        token."""
        held = end + req.spec_slack + self._draft_extra(sample)
        if self.num_draft_tokens:
            held = min(held, req.max_total_len - 1 + self.spec_margin)
        return held

    def _slack(self, row: ScheduledRow) -> int:
        """The most positions an iteration of ``row`` may put its request past the host's lower bound: its drafts,
        or ``K`` for a row the device may split again (variable length gives it up to ``K``)."""
        return self.num_draft_tokens if row.resplit else row.num_drafts

    def _advance(self, num_drafts: int) -> int:
        """The most positions a decode-loop row moves per iteration: its pending token and its drafts (every
        iteration feeds the same number), or ``K + 1`` under variable length, where the device's re-split may
        give a row with drafts up to ``K``."""
        if not num_drafts:
            return 1
        return 1 + (self.num_draft_tokens if self.verify_planner is not None else num_drafts)

    def _speculates(self, req: Request) -> bool:
        """Whether ``req``'s decode rows verify drafts. A constrained request does once its previous tokens (and
        so its drafts) are on the host: one grammar mask per verify row. Not while its next sample depends on
        exact host state the drafts would change: a multi-token bad word, teacher forcing, or ``min_tokens`` not
        yet reached (the EOS mask depends on the output count)."""
        if not self.num_draft_tokens:
            return False
        if req.grammar is not None and not any(len(w) > 1 for w in req.bad_words_ids):
            # One grammar mask per verify row, from the drafts known on the host: those of its last processed
            # step, or (deferred masks) those the step in flight leaves in its pool, known before the masks are.
            if req.pending:
                return self.defer_masks and not self._forced_drafts(req)
            return len(req.spec_drafts) > 0 or self._forced_drafts(req)
        if req.needs_host_tokens:
            return False
        p = req.params
        if getattr(p, "golden_token_ids", None) is not None:
            return self.force_drafts
        return len(req.output_token_ids) >= p.min_tokens

    def _needs_host_tokens(self, req: Request) -> bool:
        """Whether ``req`` is scheduled only once its previous tokens are on the host (:attr:`Request.needs_host_tokens`);
        a grammar alone does not need it when masks may be deferred."""
        if self.defer_masks and not any(len(w) > 1 for w in req.bad_words_ids):
            return False
        return req.needs_host_tokens

    def _forced_drafts(self, req: Request) -> bool:
        """The ``speculative.force_draft_tokens`` test hook applies: the request's golden tokens are its drafts."""
        return self.force_drafts and getattr(req.params, "golden_token_ids", None) is not None

    def _num_sequences(self) -> int:
        return sum(r.width for r in self._running)

    def _fork(self, parent: Request) -> None:
        """Turn a group whose shared prefix (the prompt but its last token) is computed, or scheduled, into its
        ``n`` samples. They share the prefix's full blocks (one more owner each); the last partial block is
        copied for every sample but the first, and the parent's state slot is cloned into the slots it
        reserved (copies made on the device before the next step's rows run). Sample ``i`` draws with
        ``derive_seed(parent seed, i)`` and starts at the prompt's last token."""
        n, m = parent.params.n, parent.feed_len
        full = m // self.block_size
        shared, last = parent.block_ids[:full], parent.block_ids[full:]
        slots = [parent.slot, *parent.reserved_slots]
        spare = list(parent.reserved_blocks)
        params = parent.params.replace(n=1, prompt_logprobs=None)
        children = []
        for i in range(n):
            child = Request(
                f"{parent.request_id}#{i}",
                parent.prompt_token_ids,
                params,
                seed=derive_seed(parent.seed, i),
                prompt=parent.prompt,
                arrival_time=parent.metrics.arrival_time,
                order=parent.order,
                max_model_len=self.max_model_len,
                detokenizer=None
                if parent.detokenizer is None
                else IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens),
            )
            child.parent, child.index = parent, i
            child.replay_bound = parent.replay_bound
            child.bad_words_ids = parent.bad_words_ids
            child.grammar = None if parent.grammar is None else parent.grammar.fork()
            child.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
            child.status = RequestStatus.RUNNING
            child.num_computed = m
            child.slot = slots[i]
            if i == 0:
                child.block_ids = list(shared) + list(last)
            else:
                self.blocks.share(shared)
                own = [spare.pop()] if last else []
                if last:
                    self._block_copies.append((last[0], own[0]))
                child.block_ids = list(shared) + own
                self._slot_copies.append((slots[0], slots[i]))
            children.append(child)
        parent.children = children
        parent.block_ids, parent.slot, parent.reserved_blocks, parent.reserved_slots = [], -1, [], []
        at = self._running.index(parent)
        self._running[at : at + 1] = children

    def _fill_bucket(self, rows: list[ScheduledRow]) -> list[ScheduledRow]:
        """Cut the step's prefill tokens to a bucket they fill, when the bucket they need is mostly padding.

        The step's tokens are padded up to the smallest bucket that holds them, and a padded token costs what
        a real one costs. When the real tokens fill less than ``min_bucket_fill`` of that bucket, the step is
        cut instead to the largest smaller bucket it can fill exactly: prefill tokens are taken off the end
        (the latest rows first; decode rows are never cut, and at least one prefill token stays, so prefills
        always progress) and run in a later step, where they join that step's decodes. A row that loses all
        its tokens leaves the step; its request stays admitted (it holds its blocks and slot) and, being
        running, is served before any new admission next step, so FCFS holds.
        """
        num_tokens = sum(r.length for r in rows)
        padded, _ = choose_bucket(num_tokens, len(rows), self.buckets)
        if num_tokens >= self.min_bucket_fill * padded:
            return rows
        # A target must keep at least one prefill token: decodes alone could otherwise fill the smaller bucket
        # step after step and starve a waiting prefill.
        fixed = sum(r.length for r in rows if r.decode)
        for target in sorted({t for t, _ in self.buckets if fixed < t < num_tokens}, reverse=True):
            kept = self._trim_rows(rows, num_tokens - target)
            if choose_bucket(target, len(kept), self.buckets)[0] != target:
                continue  # no bucket of exactly these tokens holds the remaining rows
            return kept
        return rows

    @staticmethod
    def _trim_rows(rows: list[ScheduledRow], excess: int) -> list[ScheduledRow]:
        """New rows with ``excess`` prefill tokens taken off the end (rows left with none are omitted)."""
        out: list[ScheduledRow] = []
        for row in reversed(rows):
            cut = 0 if row.decode else min(excess, row.length)
            excess -= cut
            if cut == row.length:
                continue
            if cut:
                # A shortened chunk ends before the sequence's last known token, so it samples nothing.
                row = dataclasses.replace(row, length=row.length - cut, sample=False, resume=False)
            out.append(row)
        out.reverse()
        return out

    def loop_ready(self) -> bool:
        """Whether this device's next step may be a decode loop (``num_decode_steps > 1``): nothing waits for
        admission or a grammar compile (a waiting request joins at the next step, so its TTFT is never held back
        by a loop), and every running request decodes plainly (:meth:`_loopable`). Vacuously true for a device
        without requests."""
        if self.num_decode_steps <= 1 or self._waiting or self._compiling:
            return False
        return all(self._loopable(req) for req in self._running)

    def _loopable(self, req: Request) -> bool:
        """``req``'s next row is a plain decode whose inputs the device can advance alone: past its prompt, one
        token to feed, no grammar, no multi-token bad word, no golden tokens, not a resumed recompute."""
        return (
            not req.resume
            and not req.resuming
            and not req.unforked
            and req.grammar is None
            and not req.needs_host_tokens
            and req.params.golden_token_ids is None
            and req.num_computed >= req.prompt_len
            and req.feed_len - req.num_computed == 1
        )

    def _loop_iterations(self, req: Request, start: int, loop_steps: int, speculates: bool = False) -> int:
        """The decode iterations ``req``'s row at ``start`` may run in a loop of ``loop_steps``: at most its
        tokens left, no further than its ``min_tokens`` masking holds unchanged (the plan's masks are built once
        for the call), and no window snapshot after the first iteration (those are planned for it alone; a
        speculative row, which the device places itself, takes none)."""
        n = min(loop_steps, req.max_total_len - req.total_len)
        outputs = start + 1 - req.prompt_len  # outputs before the row's first sample
        if outputs < req.params.min_tokens:
            n = min(n, req.params.min_tokens - outputs)
        if self.snapshots is not None and not speculates:
            bs = self.block_size
            boundary = ((start + 1) // bs + 1) * bs  # the first block boundary after the first iteration
            n = min(n, boundary - start - 1)
        return max(n, 1)

    def _schedule_running(self, loop_steps: int = 1) -> tuple[list[ScheduledRow], int]:
        """Rows of the running requests (admission order, within the budgets) and the tokens left.

        The rows are first planned without allocating. If their new blocks exceed the free ones, the running
        request with the longest output (ties: the latest arrival) is preempted, whether or not it had a row,
        and the rows are planned again. Only decodes need new blocks (admission allocates blocks for every
        known token), and a lone request always fits (requests that cannot are refused when added), so this
        ends with at least one row whenever a request runs.
        """
        while True:
            rows: list[ScheduledRow] = []
            tokens_left = self.token_budget
            new_blocks = 0
            for req in self._running:
                if tokens_left == 0 or len(rows) == self.seq_budget:
                    break
                # Tokens still to feed: the rest of a prefill, or the one token whose cache entry the next
                # decode writes (pending when it was sampled by a step not yet processed).
                speculates = self._speculates(req)
                exact = self._needs_host_tokens(req) or self._forced_drafts(req)
                if req.pending and (exact or (req.spec_slack and not speculates)):
                    continue  # its masks (or its exact position) need the tokens still in flight
                if req.resuming and (exact or req.grammar is not None):
                    continue  # its masks (or exact drafts) need the drafts its resumed row leaves in the pool
                start = req.num_computed
                q = min(req.feed_len - start, tokens_left)
                if q <= 0:
                    continue
                sample = start + q == req.sample_len
                if sample and req.total_len >= req.max_total_len:
                    continue  # its in-flight tokens complete it; stopping is certain
                resume = sample and req.resume
                decode = sample and q == 1 and start >= req.prompt_len and not resume
                nd = 0
                if decode and speculates:
                    nd = min(self.num_draft_tokens, tokens_left - 1)
                    if self.whole_drafts and nd < min(self.num_draft_tokens, self.token_budget - 1):
                        continue  # the budget left would cut its drafts: it runs next step with all of them
                iterations = 1
                if loop_steps > 1 and decode and self._loopable(req):
                    iterations = self._loop_iterations(req, start, loop_steps, speculates=nd > 0)
                need = self._tokens_held(req, start + q + nd + (iterations - 1) * self._advance(nd), sample)
                new_blocks += max(0, self.blocks.blocks_for(need) - len(req.block_ids))
                forced: tuple[int, ...] = ()
                pool: tuple[int, ...] = ()
                if nd and req.grammar is not None and not req.pending:
                    pool = req.spec_drafts[:nd]
                    nd = len(pool)
                if nd and self._forced_drafts(req):
                    # The test hook verifies the golden tokens that remain (fewer drafts near their end).
                    n = len(req.output_token_ids)
                    forced = tuple(int(t) for t in req.params.golden_token_ids[n : n + nd])
                    nd = len(forced)
                    pool = forced if req.grammar is not None else ()
                rows.append(
                    ScheduledRow(
                        req,
                        start,
                        q + nd,
                        sample,
                        req.pending > 0,
                        decode,
                        nd,
                        decode and bool(self.num_draft_tokens),
                        forced,
                        pool,
                        resume=resume,
                        iterations=iterations,
                    )
                )
                tokens_left -= q + nd
            if new_blocks <= self.blocks.num_free:
                break
            if loop_steps > 1:
                loop_steps = 1  # the loop's blocks ahead do not fit: one iteration, before preempting anyone
                continue
            self._preempt(max(self._running, key=_priority))
        for row in rows:
            end = row.start + row.length + (row.iterations - 1) * self._advance(row.num_drafts)
            need = self._tokens_held(row.request, end, row.sample)
            missing = self.blocks.blocks_for(need) - len(row.request.block_ids)
            if missing > 0:
                row.request.block_ids.extend(self.blocks.allocate(missing))
        if self.verify_planner is not None:
            rows, tokens_left = self._plan_verify_lengths(rows, tokens_left)
        return rows, tokens_left

    def _plan_verify_lengths(
        self, rows: list[ScheduledRow], tokens_left: int
    ) -> tuple[list[ScheduledRow], int]:
        """Variable-length verification: the planner cuts each decode row's drafts to the ones worth verifying
        (the blocks stay allocated for all of them; the next steps use them)."""
        spec = [i for i, r in enumerate(rows) if r.num_drafts and not r.forced]
        if not spec:
            return rows, tokens_left
        chosen = set(spec)
        fixed = sum(r.length for i, r in enumerate(rows) if i not in chosen)
        reqs = [rows[i].request for i in spec]
        budget = [r.spec_rates_prev if r.pending == 0 else r.spec_rates for r in reqs]
        drafts = self.verify_planner.plan(
            budget, [r.spec_rates for r in reqs], [rows[i].num_drafts for i in spec], fixed
        )
        out = list(rows)
        for i, nd in zip(spec, drafts, strict=True):
            row = rows[i]
            tokens_left += row.num_drafts - nd
            # The device splits these rows' total again with the pool's fresher confidences (SpecInputs.realloc),
            # except a constrained row's: its grammar masks are built here for exactly nd drafts.
            resplit = getattr(row.request, "grammar", None) is None
            out[i] = dataclasses.replace(
                row, length=row.length - row.num_drafts + nd, num_drafts=nd, resplit=resplit
            )
        return out, tokens_left

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_computed = 0
        self._running.remove(req)
        self._waiting.appendleft(req)
        req.metrics.num_preemptions += 1
        self.stats.num_preemptions += 1

    def _release(self, req: Request) -> None:
        self._cache_blocks(req)
        self._drop_snapshots(req)
        req.num_registered = 0
        if req.block_ids:
            self.blocks.free(reversed(req.block_ids))
            req.block_ids = []
        if req.reserved_blocks:
            self.blocks.free(req.reserved_blocks)
            req.reserved_blocks = []
        if req.slot >= 0:
            self.slots.free([req.slot])
            req.slot = -1
        if req.reserved_slots:
            self.slots.free(req.reserved_slots)
            req.reserved_slots = []

    def _commit(self, rows: list[ScheduledRow]) -> DeviceBatch:
        """Account the step's rows (tokens now computed, samples now pending) and keep the batch in flight."""
        now = self._clock()
        for row in rows:
            req = row.request
            # A row with drafts computes its first token for certain; the accepted drafts are added when its
            # outputs arrive (process_outputs), so num_computed stays a lower bound while it is in flight.
            # A decode-loop row feeds one more token per iteration after its first.
            req.num_computed += row.length - row.num_drafts + row.iterations - 1
            req.spec_slack += self._slack(row) * row.iterations
            if row.resume:
                req.resume = False  # its token is known: the next row decodes it
                req.resuming += 1
            elif row.sample:
                req.pending += row.iterations
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            if row.decode:
                self.stats.num_decode_tokens += row.iterations
            else:
                self.stats.num_prefill_tokens += row.length
        if self.prefix_cache is not None:
            self._sync_evictions()
        snapshots = self._plan_snapshots(rows)
        if snapshots:
            # A snapshot starts as a copy of the row's slot as the step begins (a slot restored or cloned by
            # this step begins as its source), to which the step adds the row's newest window items.
            begins = {dst: src for src, dst in self._slot_copies}
            for i, h, slot in snapshots:
                req = rows[i].request
                self._slot_copies.append((begins.get(req.slot, req.slot), slot))
                req.snapshots[h // self.block_size] = slot
            self.stats.num_snapshots += len(snapshots)
        if self.prefix_cache is not None:
            self._sync_evictions()  # the snapshots' slots may have evicted older snapshots
            for row in rows:
                self._cache_blocks(row.request)
        batch = DeviceBatch(
            tuple(rows),
            tuple(self._block_copies),
            tuple(self._slot_copies),
            tuple(snapshots),
            tuple(self._host_saves),
            tuple(self._host_loads),
        )
        self._block_copies.clear()
        self._slot_copies.clear()
        self._host_saves.clear()
        self._host_loads.clear()
        self._restores = 0
        self._in_flight[batch] = None
        self.stats.num_steps += 1
        if batch.num_iterations > 1:
            self.stats.num_loop_steps += 1
        self.stats.num_scheduled_tokens += batch.num_tokens
        return batch

    # ------------------------------------------------------------------------------------ process outputs

    def process_outputs(
        self,
        batch: DeviceBatch,
        sampled_tokens: Any,
        *,
        logprob: Any = None,
        rank: Any = None,
        top_ids: Any = None,
        top_logprobs: Any = None,
        prompt_logprobs: tuple[Any, Any, Any, Any] | None = None,
        sum_smaller: Any = None,
        top_sum_smaller: Any = None,
        num_accepted: Any = None,
        confidences: Any = None,
        confidence_error: Any = None,
        drafts: Any = None,
        num_drafts: Any = None,
        iteration: int = 0,
        last: bool = True,
        alive: Any = None,
    ) -> list[RequestOutput]:
        """Take the sampled tokens of ``batch`` (the oldest unprocessed one), apply stops, free what finished.

        A decode-loop batch (:attr:`~deepinfer_jax.engine.plan.DeviceBatch.num_iterations` > 1) is processed one
        iteration at a time, in order: ``iteration`` is its index, ``last`` says it is the call's final one (the
        device ends the loop early once every row stopped), and ``alive [S]`` marks the rows that sampled in it
        (a row the device stopped samples no more; the host must have ended it at the same token). The batch
        leaves the in-flight queue with its last iteration.

        ``sampled_tokens`` is ``[S]`` (or at least ``[num_seqs]``), one per row; rows with ``sample`` false are
        ignored. ``logprob`` / ``rank`` (``[S]``) and ``top_ids`` / ``top_logprobs`` (``[S, n]``) are the
        sampler's logprob outputs, needed when a request asked for ``logprobs``. ``prompt_logprobs`` is the
        step's per-token ``(logprob [T], rank [T], top_ids [T, n], top_logprobs [T, n])`` of the next prompt
        token, needed when a row of the batch computes prompt tokens of a request that asked for
        ``prompt_logprobs`` (a recomputed prompt keeps the entries it already has). A token outside the vocabulary
        (what a sampler reports for a row without a finite logit) ends that request with an error.

        Returns the requests that finished (and, with ``stream``, snapshots of those that advanced), followed by
        requests finished outside a step (see :meth:`take_ready_outputs`).
        """
        if not self._in_flight:
            raise ValueError("process_outputs: no step is in flight")
        oldest = next(iter(self._in_flight))
        if batch is not oldest:
            raise ValueError("process_outputs: steps must be processed in the order they were scheduled")
        # A batch whose rows all run one iteration may still be part of a loop step (another device's rows loop):
        # its later iterations have nothing for it.
        looped = batch.num_iterations > 1
        if last:
            del self._in_flight[batch]
        if looped:
            self.stats.num_loop_iterations += 1
        live = None if alive is None else np.asarray(alive)
        tokens = np.asarray(sampled_tokens)
        if tokens.ndim == 2:  # speculative: [S, K + 1] emitted tokens per row, num_accepted [S]
            if num_accepted is None:
                raise ValueError("process_outputs: [S, K + 1] sampled_tokens need num_accepted [S]")
            accepted = np.asarray(num_accepted)
        else:
            accepted = None
        if tokens.ndim not in (1, 2) or tokens.shape[0] < batch.num_seqs:
            raise ValueError(f"sampled_tokens has shape {tokens.shape}, expected at least [{batch.num_seqs}]")
        arrays = {
            name: None if value is None else np.asarray(value)
            for name, value in (
                ("logprob", logprob),
                ("rank", rank),
                ("top_ids", top_ids),
                ("top_logprobs", top_logprobs),
                ("sum_smaller", sum_smaller),
                ("top_sum_smaller", top_sum_smaller),
            )
        }
        now = self._clock()
        finished: list[RequestOutput] = []
        streamed: list[RequestOutput] = []
        offset = 0
        for i, row in enumerate(batch.rows):
            req = row.request
            if (
                iteration == 0
                and req.prompt_logprobs is not None
                and req.status is not RequestStatus.FINISHED
            ):
                self._record_prompt_logprobs(req, row, offset, prompt_logprobs)
            offset += row.length
            if not row.sample or iteration >= row.iterations:
                continue
            if row.resume:
                # A resumed recompute's row re-emitted its last output (golden): nothing to append, only the
                # drafts it left in the pool.
                req.resuming -= 1
                if req.status is RequestStatus.RUNNING:
                    self._take_drafts(req, i, drafts, confidences)
                    self._cache_blocks(req)
                continue
            if req.status is RequestStatus.FINISHED:
                if live is None or live[i]:  # a row the decode loop had stopped sampled nothing
                    self.stats.num_wasted_samples += 1
                continue
            if live is not None and not live[i]:
                self._loop_mismatch(req, iteration, row.iterations - iteration)
                finished.extend(o for o in (self._final_output(req),) if o is not None)
                continue
            req.pending -= 1
            self._take_drafts(req, i, drafts, confidences)
            # The drafts the row verified: the device's split (variable length re-splits on the device), else ours.
            verified = row.num_drafts if num_drafts is None else int(num_drafts[i])
            if confidence_error is not None and verified:
                self.stats.confidence_error_sum += float(confidence_error[i])
            if accepted is None:
                self._append_token(req, int(tokens[i]), i, arrays, now)
            else:
                self._append_run(req, row, tokens[i], int(accepted[i]), i, arrays, now, verified)
            if req.status is RequestStatus.RUNNING:
                self._cache_blocks(req)
            if req.status is RequestStatus.FINISHED:
                done = self._final_output(req)
                if done is not None:
                    finished.append(done)
            elif self.stream:
                streamed.append((req.parent or req).to_output(final=False))
        if looped and last:
            # Iterations the device did not run (it ended the call once every row had stopped): a row planned
            # for them must have been ended by the host too.
            for row in batch.rows:
                req = row.request
                missing = row.iterations - iteration - 1 if row.sample else 0
                if missing > 0 and req.status is not RequestStatus.FINISHED:
                    self._loop_mismatch(req, iteration + 1, missing)
                    finished.extend(o for o in (self._final_output(req),) if o is not None)
        return finished + streamed + self.take_ready_outputs()

    def _loop_mismatch(self, req: Request, iteration: int, missing: int) -> None:
        """The device stopped ``req``'s decode-loop row before ``iteration`` but the host's stop checks did not end
        it: its outputs would miss ``missing`` tokens, so it ends with an error (never silently short)."""
        req.pending = max(req.pending - missing, 0)
        self._finish(
            req,
            "error",
            error=(
                f"request {req.request_id!r}: the decode loop stopped it on the device at iteration {iteration} "
                f"after token {req.output_token_ids[-1] if req.output_token_ids else None}, but the host's stop "
                "checks did not"
            ),
        )

    def _take_drafts(self, req: Request, i: int, drafts: Any, confidences: Any) -> None:
        """What the host keeps of the drafts row ``i`` left in ``req``'s pool: the tokens of a constrained request
        (it verifies host-known drafts) and the confidences the variable-length planner reads."""
        if drafts is not None and req.grammar is not None:
            req.spec_drafts = tuple(int(t) for t in drafts[i] if t >= 0)
        if confidences is not None and self.verify_planner is not None:
            req.spec_rates_prev = req.spec_rates
            req.spec_rates = cumulative_rates(np.clip(np.asarray(confidences[i], np.float64), 0.0, 1.0))

    def _append_run(
        self,
        req: Request,
        row: ScheduledRow,
        emitted: np.ndarray,
        accepted: int,
        i: int,
        arrays: dict[str, np.ndarray | None],
        now: float,
        verified: int | None = None,
    ) -> None:
        """A speculative row's tokens: its ``accepted`` drafts, then the bonus token, each through the stop
        checks in order; the tokens after a stop are dropped. ``verified``: the drafts the row verified on the
        device (default: the planned ``row.num_drafts``)."""
        nd = row.num_drafts if verified is None else verified
        req.spec_slack -= self._slack(row)
        accepted = min(max(accepted, 0), nd)
        if row.decode:  # every decode row of a speculative engine, also one left without drafts
            st = self.stats
            k = self.num_draft_tokens
            if len(st.verified_at) < k:
                st.verified_at.extend([0] * (k - len(st.verified_at)))
                st.accepted_at.extend([0] * (k - len(st.accepted_at)))
            for j in range(nd):
                st.verified_at[j] += 1
                st.accepted_at[j] += j < accepted
            st.num_spec_rows += 1
            st.num_spec_emitted += accepted + 1
        if req.status is RequestStatus.RUNNING:
            req.num_computed += accepted  # the accepted drafts' cache entries are the sequence's
        for j in range(accepted + 1):
            view = {name: None if a is None else a[:, j] for name, a in arrays.items()}
            self._append_token(req, int(emitted[j]), i, view, now)
            if req.status is RequestStatus.FINISHED:
                return

    def take_ready_outputs(self) -> list[RequestOutput]:
        """Outputs of requests that finished outside a step (those that can never fit the cache)."""
        ready, self._ready = self._ready, []
        return ready

    def _final_output(self, req: Request) -> RequestOutput | None:
        """The final output once ``req`` finished: its own, or its group's when it was the group's last running
        sample (``None`` while siblings still run)."""
        parent = req.parent
        if parent is None:
            return req.to_output(final=True)
        if parent.status is RequestStatus.FINISHED:
            return None  # the group ended already (aborted)
        if any(c.status is not RequestStatus.FINISHED for c in parent.children or ()):
            return None
        parent.status = RequestStatus.FINISHED
        parent.finish_reason = req.finish_reason
        parent.metrics.finish_time = self._clock()
        self._requests.pop(parent.request_id, None)
        return parent.to_output(final=True)

    def _append_token(
        self, req: Request, token: int, row: int, arrays: dict[str, np.ndarray | None], now: float
    ) -> None:
        if not 0 <= token < self.vocab_size:
            self._finish(
                req,
                "error",
                error=(
                    f"request {req.request_id!r}: the sampler returned token {token}, outside the vocabulary "
                    f"[0, {self.vocab_size}) (a logit row without a finite value)"
                ),
            )
            return
        params = req.params
        req.output_token_ids.append(token)
        n = len(req.output_token_ids)
        req.metrics.num_generated_tokens = n
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        if req.logprobs is not None:
            req.logprobs.append(self._logprob_entry(req, token, row, arrays))
        if req.grammar is not None:
            problem = req.grammar.accept(token)
            if problem is not None:
                self._finish(req, "error", error=f"request {req.request_id!r}: {problem}")
                return
        stops_allowed = n >= params.min_tokens
        if stops_allowed and not params.ignore_eos and token in self.eos_token_ids:
            self._finish(req, "stop")
            return
        if stops_allowed and token in params.stop_token_ids:
            self._finish(req, "stop", stop_reason=token)
            return
        if req.detokenizer is not None:
            delta = req.detokenizer.push(token)
            if delta:
                before = len(req.text)
                req.text += delta
                if params.stop and stops_allowed and self._match_stop_string(req, before):
                    return
        if n >= params.max_tokens or req.num_known >= self.max_model_len:
            self._finish(req, "length")

    def _match_stop_string(self, req: Request, before: int) -> bool:
        """Search the new text (and the overlap a stop string can span) for the earliest stop string."""
        best: tuple[int, str] | None = None
        for stop in req.params.stop:
            idx = req.text.find(stop, max(0, before - len(stop) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return False
        keep = best[0] + len(best[1]) if req.params.include_stop_str_in_output else best[0]
        req.text = req.text[:keep]
        self._finish(req, "stop", stop_reason=best[1], flush_text=False)
        return True

    def _logprob_entry(
        self, req: Request, token: int, row: int, arrays: dict[str, np.ndarray | None]
    ) -> dict[int, Logprob]:
        lp, rk = arrays["logprob"], arrays["rank"]
        if lp is None:
            raise ValueError(
                f"request {req.request_id!r} asked for logprobs, but process_outputs got no logprob array"
            )
        value = float(lp[row])
        smaller, top_smaller = arrays["sum_smaller"], arrays["top_sum_smaller"]
        entry = {
            token: Logprob(
                value,
                None if rk is None else int(rk[row]),
                self._decode_one(token, req),
                None if smaller is None else float(smaller[row]),
            )
        }
        assert req.cumulative_logprob is not None
        req.cumulative_logprob += value
        n = req.params.logprobs or 0
        ids, lps = arrays["top_ids"], arrays["top_logprobs"]
        if n:
            if ids is None or lps is None or ids.shape[-1] < n:
                raise ValueError(
                    f"request {req.request_id!r} asked for {n} top logprobs; process_outputs got "
                    f"{None if ids is None else ids.shape[-1]}"
                )
            for j in range(n):
                alt = int(ids[row, j])
                if alt not in entry:
                    below = None if top_smaller is None else float(top_smaller[row, j])
                    entry[alt] = Logprob(float(lps[row, j]), j + 1, self._decode_one(alt, req), below)
        return entry

    def _record_prompt_logprobs(
        self, req: Request, row: ScheduledRow, offset: int, arrays: tuple[Any, Any, Any, Any] | None
    ) -> None:
        assert req.prompt_logprobs is not None
        targets = [
            (offset + k, p + 1)
            for k, p in enumerate(range(row.start, row.start + row.length))
            if p + 1 < req.prompt_len and req.prompt_logprobs[p + 1] is None
        ]
        if not targets:
            return
        if arrays is None:
            raise ValueError(
                f"request {req.request_id!r} asked for prompt_logprobs, but process_outputs got none"
            )
        lp, rk, ids, lps = (np.asarray(a) for a in arrays)
        n = req.params.prompt_logprobs or 0
        if ids.shape[-1] < n:
            raise ValueError(
                f"request {req.request_id!r} asked for {n} prompt logprobs; process_outputs got {ids.shape[-1]}"
            )
        for t, target_pos in targets:
            token = int(req.prompt_token_ids[target_pos])
            entry = {token: Logprob(float(lp[t]), int(rk[t]), self._decode_one(token, req))}
            for j in range(n):
                alt = int(ids[t, j])
                if alt not in entry:
                    entry[alt] = Logprob(float(lps[t, j]), j + 1, self._decode_one(alt, req))
            req.prompt_logprobs[target_pos] = entry

    def _decode_one(self, token: int, req: Request | None = None) -> str | None:
        if self.tokenizer is None or (req is not None and not req.params.detokenize):
            return None
        return self.tokenizer.decode([token])

    def _finish(
        self,
        req: Request,
        reason: FinishReason,
        *,
        stop_reason: str | int | None = None,
        error: str | None = None,
        flush_text: bool = True,
    ) -> None:
        if req.detokenizer is not None:
            rest = req.detokenizer.finish()
            if flush_text:
                req.text += rest
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.error = error
        req.metrics.finish_time = self._clock()
        self._release(req)
        if req in self._running:
            self._running.remove(req)
        elif req in self._waiting:
            self._waiting.remove(req)
        elif req in self._compiling:
            self._compiling.remove(req)
        self._requests.pop(req.request_id, None)
        for child in req.children or ():
            if child.status is not RequestStatus.FINISHED:
                self._finish(child, reason, error=error)


# ------------------------------------------------------------------------------------ the engine's scheduler


def route(loads: Sequence[tuple[int, int]]) -> int:
    """The device a new request goes to: fewest sequences, then fewest tokens, then the lowest index.

    ``loads[d]`` is ``(unfinished sequences, tokens they hold)`` of device ``d``.
    """
    if not loads:
        raise ValueError("route: loads is empty; expected one (sequences, tokens) pair per device")
    return min(range(len(loads)), key=lambda d: (loads[d][0], loads[d][1], d))


def _every_device(name: str) -> property:
    """A boolean switch of :class:`Scheduler` that is the same switch of every :class:`DeviceScheduler`."""

    def get(self: Scheduler) -> bool:
        return getattr(self.devices[0], name)

    def put(self: Scheduler, value: bool) -> None:
        for s in self.devices:
            setattr(s, name, bool(value))

    return property(get, put, doc=f":attr:`DeviceScheduler.{name}` of every device.")


class Scheduler:
    """The engine's scheduler: one :class:`DeviceScheduler` per device of the mesh, a router, and the step plans.

    Every device of the ``(dp, ep)`` mesh owns whole sequences and their caches, so each device gets its own
    :class:`DeviceScheduler` (block pool, state slots, step budgets); one device is the case ``num_devices=1``.
    A new request goes to the device with the fewest unfinished sequences, then the fewest tokens held by them,
    then the lowest index (:func:`route`): the decision depends only on the order of requests and of finished
    outputs, never on time or hashing, so every process of a multi-process run makes the same one.
    :meth:`schedule` asks every device for its rows and builds the step's one
    :class:`~deepinfer_jax.engine.plan.StepPlan` (:func:`~deepinfer_jax.engine.plan.build_plan`);
    :meth:`process_outputs` hands each device its slice of the step's results.

    Args:
      num_devices: devices of the mesh (``dp * ep``), device ``d`` at ``(d // ep, d % ep)``.
      banned_token_ids: ids never sampled (``sampling.banned_token_ids``), masked in every row of every step.
      **device_args: the :class:`DeviceScheduler` arguments of every device (budgets are per device).
    """

    def __init__(
        self, *, num_devices: int = 1, banned_token_ids: Sequence[int] = (), **device_args: Any
    ) -> None:
        num_devices = _positive("num_devices", num_devices)
        self.devices: tuple[DeviceScheduler, ...] = tuple(
            DeviceScheduler(**device_args) for _ in range(num_devices)
        )
        first = self.devices[0]
        self.block_size = first.block_size
        self.max_blocks_per_seq = first.max_blocks_per_seq
        self.buckets = first.buckets
        self.vocab_size = first.vocab_size
        self.max_model_len = first.max_model_len
        self.tokenizer = first.tokenizer
        self.eos_token_ids = tuple(sorted(first.eos_token_ids))
        self.banned_token_ids = tuple(int(t) for t in banned_token_ids)
        self.num_draft_tokens = first.num_draft_tokens
        self.num_decode_steps = first.num_decode_steps
        self.force_drafts = first.force_drafts
        self.replay_keep = 0  # SWA bounded replay's K (LLM sets it when scheduler.yoco_truncation is on)
        self._assigned: list[dict[str, None]] = [{} for _ in self.devices]  # insertion-ordered request ids
        self._owner: dict[str, int] = {}
        # The loads as of the last change that went through this object (a batch of add_request calls between
        # two steps updates it incrementally instead of walking every request once per add); None: recompute.
        self._loads: list[list[int]] | None = None
        opts = first.prefix_cache
        # With snapshots every step carries slot copies and snapshots of fixed widths: taking or restoring one
        # never changes the compiled step.
        self._min_copies = (
            (1, opts.copies_per_step, opts.snapshots_per_step)
            if opts is not None and first.snapshots is not None
            else (0, 0, 0)
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and snapshot on every device (False: prefix caching is off)."""
        return all([s.reset_prefix_cache() for s in self.devices])

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    # ---------------------------------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Any,
        params: SamplingParams,
        *,
        seed: int,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> int:
        """Route a request to a device and queue it there (:meth:`DeviceScheduler.add_request`); returns the
        device."""
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already queued or running")
        loads = self.loads()
        device = route(loads)
        if self.num_devices > 1 and self.devices[0].prefix_cache is not None:
            device = self._prefix_route(prompt_token_ids, loads, device)
        sched = self.devices[device]
        sched.add_request(
            request_id, prompt_token_ids, params, seed=seed, prompt=prompt, arrival_time=arrival_time
        )
        try:
            tokens = sched.get_request(request_id).total_len
        except KeyError:  # it can never fit the cache and finished at once: it holds nothing
            return device
        self._assigned[device][request_id] = None
        self._owner[request_id] = device
        if self._loads is not None:
            self._loads[device][0] += 1
            self._loads[device][1] += tokens
        return device

    def _prefix_route(self, prompt_token_ids: Any, loads: Sequence[tuple[int, int]], device: int) -> int:
        """With prefix caching the router prefers the device that has the longest cached prefix of the prompt,
        unless it runs ``max_num_seqs // 2`` (at least 1) more sequences than the least loaded device (then the
        load wins: a hit does not pay for queueing behind a full device). Ties keep :func:`route`'s order.
        Deterministic: every process's schedulers hold the same caches."""
        try:
            ids = np.asarray(prompt_token_ids, dtype=np.int64)
        except (TypeError, ValueError):
            return device  # add_request refuses it with its own message
        if ids.ndim != 1 or not len(ids) or ids.min() < 0 or ids.max() >= self.vocab_size:
            return device
        slack = max(self.devices[0].max_num_seqs // 2, 1)
        least = min(seqs for seqs, _ in loads)
        hits = [
            s.cached_prefix(ids) if loads[d][0] - least < slack else 0 for d, s in enumerate(self.devices)
        ]
        best = max(hits)
        if best == 0 or hits[device] == best:
            return device
        return min((d for d in range(self.num_devices) if hits[d] == best), key=lambda d: (*loads[d], d))

    def loads(self) -> list[tuple[int, int]]:
        """``(unfinished sequences, tokens they hold)`` per device, the router's input.

        Tokens are the prompt and the outputs so far, in-flight samples included: what the sequences hold in
        the device's cache, or will hold once admitted.
        """
        if self._loads is None:
            self._loads = [self._device_load(d) for d in range(self.num_devices)]
        return [(seqs, tokens) for seqs, tokens in self._loads]

    def _device_load(self, device: int) -> list[int]:
        sched, assigned = self.devices[device], self._assigned[device]
        tokens = 0
        for rid in list(assigned):
            try:
                tokens += sched.get_request(rid).total_len
            except KeyError:  # finished: it no longer loads the device
                del assigned[rid]
                self._owner.pop(rid, None)
        return [len(assigned), tokens]

    def device_of(self, request_id: str) -> int:
        """The device an unfinished request was routed to (``KeyError`` once it has finished)."""
        return self._owner[request_id]

    def get_request(self, request_id: str) -> Request:
        """The state of an unfinished request (``KeyError`` once it has finished)."""
        return self.devices[self._owner[request_id]].get_request(request_id)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End an unfinished request now and free its blocks and slot (:meth:`DeviceScheduler.abort`); returns its
        final output, ``finish_reason="abort"`` (``None`` when no unfinished request has this id)."""
        device = self._owner.pop(request_id, None)
        if device is None:
            return None
        self._assigned[device].pop(request_id, None)
        self._loads = None
        return self.devices[device].abort(request_id)

    def abort_all(self) -> list[str]:
        """Every device's :meth:`DeviceScheduler.abort_all`: nothing queued, running or in flight afterwards."""
        dropped = [rid for s in self.devices for rid in s.abort_all()]
        for assigned in self._assigned:
            assigned.clear()
        self._owner.clear()
        self._loads = None
        return dropped

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued or running, or a finished one has not been reported yet."""
        return any(s.has_unfinished_requests() for s in self.devices)

    def take_ready_outputs(self) -> list[RequestOutput]:
        """Outputs of requests that finished outside a step (those that can never fit the cache)."""
        return [o for s in self.devices for o in s.take_ready_outputs()]

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.devices)

    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self.devices)

    @property
    def num_in_flight(self) -> int:
        """Steps scheduled and not yet processed."""
        return max(s.num_in_flight for s in self.devices)

    @property
    def num_compiling(self) -> int:
        """Structured-output requests waiting for their grammar, on every device."""
        return sum(s.num_compiling for s in self.devices)

    @property
    def stats(self) -> SchedulerStats:
        """Every device's counters summed (``num_steps`` counts device batches)."""
        total = SchedulerStats()
        for s in self.devices:
            for f in dataclasses.fields(SchedulerStats):
                mine, theirs = getattr(total, f.name), getattr(s.stats, f.name)
                if isinstance(mine, list):  # per draft position: summed elementwise
                    width = max(len(mine), len(theirs))
                    mine = [sum(v[i] for v in (mine, theirs) if i < len(v)) for i in range(width)]
                    setattr(total, f.name, mine)
                else:
                    setattr(total, f.name, mine + theirs)
        return total

    # ---------------------------------------------------------------------------------------- steps

    def schedule(self) -> StepPlan | None:
        """The next step over every device (:class:`~deepinfer_jax.engine.plan.StepPlan`), or ``None`` when no
        device can run anything now."""
        self._loads = None  # scheduling changes what the requests hold (in-flight samples)
        # A decode loop only when every device can run one: a device with a waiting request or a prefill chunk
        # would otherwise wait for the other devices' iterations.
        k = self.num_decode_steps
        loop = k if k > 1 and all(s.loop_ready() for s in self.devices) else 1
        batches = tuple(s.schedule(loop) for s in self.devices)
        while (
            all(b is None for b in batches)
            and not any(s.num_in_flight for s in self.devices)
            and any(s.num_compiling for s in self.devices)
            and not any(s._ready for s in self.devices)
        ):
            # Nothing runs and nothing is in flight: wait (off the device's path) for a grammar to compile.
            for s in self.devices:
                s.wait_for_grammars(0.05)
            batches = tuple(s.schedule() for s in self.devices)
        if all(b is None for b in batches):
            return None
        plan = build_plan(
            batches,
            buckets=self.buckets,
            max_blocks_per_seq=self.max_blocks_per_seq,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            banned_token_ids=self.banned_token_ids,
            num_draft_tokens=self.num_draft_tokens,
            force_drafts=self.force_drafts,
            device_resplit=self.devices[0].verify_planner is not None,
            min_copies=self._min_copies,
            replay_keep=self.replay_keep,
            loop_steps=loop,
        )
        if plan.mask_seconds:
            self.devices[0].stats.num_masked_steps += 1
            self.devices[0].stats.mask_seconds += plan.mask_seconds
        for s, b in zip(self.devices, batches, strict=True):
            s.stats.num_padding_tokens += plan.padded_tokens - (0 if b is None else b.num_tokens)
        return plan

    whole_drafts = _every_device("whole_drafts")
    defer_masks = _every_device("defer_masks")

    def fill_deferred_masks(self, plan: StepPlan) -> None:
        """Fill ``plan``'s deferred grammar masks (:func:`~deepinfer_jax.engine.plan.fill_deferred_masks`) now that
        the step before it has been processed; the time counts as mask time."""
        if not plan.deferred_masks:
            return
        start = time.perf_counter()
        fill_deferred_masks(plan)
        st = self.devices[0].stats
        st.mask_seconds += time.perf_counter() - start
        st.num_deferred_masks += len(plan.deferred_masks)

    def observe_step(self, plan: StepPlan, step_ms: float) -> None:
        """A finished step's time (the runner's measurement): the verify-length planner's forward slope."""
        planner = self.devices[0].verify_planner
        if planner is not None:
            planner.observe(plan.padded_tokens, step_ms)

    def process_outputs(
        self, plan: StepPlan, sampled_tokens: Any, *, iteration: int = 0, last: bool = True, **arrays: Any
    ) -> list[RequestOutput]:
        """Hand each device its slice of ``plan``'s results and return the requests that finished.

        ``sampled_tokens`` and the keyword arrays of :meth:`DeviceScheduler.process_outputs` (``logprob``, ``rank``,
        ``top_ids``, ``top_logprobs``, the ``prompt_logprobs`` tuple, a decode loop's ``alive``) come with a leading
        device axis ``D``; ``iteration`` and ``last`` (a decode loop's iteration) are the same for every device.
        """
        self._loads = None
        out: list[RequestOutput] = []
        for d, batch in enumerate(plan.batches):
            if batch is not None:
                part = {
                    k: None if v is None else tuple(a[d] for a in v) if isinstance(v, tuple) else v[d]
                    for k, v in arrays.items()
                }
                out.extend(
                    self.devices[d].process_outputs(
                        batch, sampled_tokens[d], iteration=iteration, last=last, **part
                    )
                )
        return out
