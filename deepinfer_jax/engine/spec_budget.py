"""How many draft tokens each request verifies in a decode step: confidence-scheduled variable-length verification.

With speculative decoding every decoding request carries up to ``nextn`` draft tokens. Verifying all of them
is the simplest choice, but a draft the target model will probably reject costs a row of the forward pass and
buys nothing. The confidence head (engine spec §8.2) predicts, for draft ``k`` of a request, the probability it
is accepted given that the drafts before it were; the running product of those predictions is the probability
that the request gets *at least* ``k + 1`` drafts accepted, so it is exactly the expected number of extra
tokens that verifying draft ``k`` adds. These products (:func:`cumulative_rates`) never increase along a
request's drafts, so taking entries of one request from the front keeps them contiguous.

The step is planned on the host in two stages (:func:`plan_verify_lengths`):

1. **Budget.** Every request always runs one row (its last sampled token), so the step starts with ``n_seqs``
   rows and ``n_seqs`` expected tokens. All drafts of all requests form one queue, best expected gain first
   (ties: lower request index first, then earlier draft). Taking entries from the front one at a time, each
   prefix of the queue is a candidate step of ``bsz`` rows and ``expected`` tokens. The compiled decode
   graphs come in a few sizes, so a candidate would run the smallest graph ``G >= bsz``; its predicted time
   is the measured baseline of that graph, plus a per-row correction ``slope_ms * G`` learned online, plus
   the sampler time. The candidate with the highest ``expected / time`` wins; a later candidate must be
   strictly better, so on a tie the smaller step is kept. The budget uses the confidences of two rounds ago
   (:func:`budget_rates`), the newest estimate that is always known when the step is planned.
2. **Allocation.** The winning row count ``total_q`` is split between the requests by taking the first
   ``total_q - n_seqs`` entries of the same kind of queue built from the newest confidences on the host:
   a request verifies ``1 + (its entries taken)`` rows.

When the step overlaps the previous one, the device repeats stage 2 with confidences fresher than the host
has, keeping ``total_q`` (:func:`deepinfer_jax.engine.spec_device.reallocate`); the two use the same order, so
on equal inputs they give equal lengths.

The latency model (§8.6.3) lives here too: :class:`LatencyCurve` (graph size -> baseline ms, measured by
:func:`measure_curve`, cached on disk by :func:`save_curve` / :func:`load_curve`), :class:`SlopeEstimator`
and :class:`SamplerTimeEstimator`. This module is plain Python: the host scheduler imports it, and it never
imports JAX.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import hashlib
import json
import math
import numbers
import os
import re
import statistics
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence

__all__ = [
    "CACHE_GRACE_S",
    "DEFAULT_CACHE_TTL_S",
    "LatencyCurve",
    "SamplerTimeEstimator",
    "SlopeEstimator",
    "allocate_verify_lengths",
    "budget_rates",
    "cumulative_rates",
    "curve_cache_key",
    "draft_available",
    "is_paired",
    "load_curve",
    "measure_curve",
    "plan_verify_lengths",
    "save_curve",
]

DEFAULT_CACHE_TTL_S: float = 3600.0
"""How long a cached latency curve is read back (``DEEPINFER_DECODE_PERF_CACHE_TTL_SEC``'s default)."""

CACHE_GRACE_S: float = 7200.0
"""A cached curve older than its TTL plus this is deleted by :func:`load_curve`."""


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _positive_int(name: str, value: object) -> int:
    if not _is_int(value) or value < 1:  # type: ignore[operator]
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)  # type: ignore[call-overload]


def _nonneg_int(name: str, value: object) -> int:
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    return int(value)  # type: ignore[call-overload]


def _finite_nonneg(name: str, value: object) -> float:
    if not _is_real(value) or not math.isfinite(value) or value < 0:  # type: ignore[arg-type, operator]
        raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _probability(name: str, value: object) -> float:
    if not _is_real(value) or not (0.0 <= value <= 1.0):  # type: ignore[operator]  # also rejects NaN
        raise ValueError(f"{name}: expected a number in [0, 1], got {value!r}")
    return float(value)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------------
# The latency curve


@dataclasses.dataclass(frozen=True)
class LatencyCurve:
    """Measured decode-step time per compiled graph size: ``points = ((size, baseline_ms), ...)``.

    Sizes are positive ints, strictly increasing; times are finite and ``>= 0``. An empty curve means "no
    measurements": verification lengths are then fixed (every request verifies all its drafts).

    >>> c = LatencyCurve([(4, 1.5), (8, 2.0)])
    >>> c.smallest_at_least(5), c.smallest_at_least(9)
    ((8, 2.0), None)
    """

    points: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        pts: list[tuple[int, float]] = []
        for i, point in enumerate(self.points):
            try:
                size, ms = point
            except (TypeError, ValueError):
                raise ValueError(f"points[{i}]: expected a (size, baseline_ms) pair, got {point!r}") from None
            size = _positive_int(f"points[{i}].size", size)
            ms = _finite_nonneg(f"points[{i}].baseline_ms", ms)
            if pts and size <= pts[-1][0]:
                raise ValueError(
                    f"points[{i}].size: sizes must be strictly increasing, got {size} after {pts[-1][0]}"
                )
            pts.append((size, ms))
        object.__setattr__(self, "points", tuple(pts))
        object.__setattr__(self, "_sizes", tuple(s for s, _ in pts))

    def __len__(self) -> int:
        return len(self.points)

    @property
    def sizes(self) -> tuple[int, ...]:
        return self._sizes  # type: ignore[attr-defined]

    def smallest_at_least(self, n: int) -> tuple[int, float] | None:
        """The point of the smallest size ``>= n``, or None when every size is below ``n``."""
        i = bisect.bisect_left(self.sizes, n)
        return self.points[i] if i < len(self.points) else None

    def baseline_ms(self, size: int) -> float:
        """The baseline of exactly this graph size (``KeyError`` if the curve has no such size)."""
        i = bisect.bisect_left(self.sizes, size)
        if i == len(self.points) or self.points[i][0] != size:
            raise KeyError(f"size: no curve point of size {size!r} (sizes {list(self.sizes)})")
        return self.points[i][1]


# ----------------------------------------------------------------------------------------------------------
# Rates and the host plan


def cumulative_rates(confidences: Iterable[float]) -> list[float]:
    """Running product of per-draft confidences: entry ``k`` is the chance drafts ``0..k`` are all accepted.

    >>> cumulative_rates([0.5, 0.5, 1.0])
    [0.5, 0.25, 0.25]
    """
    out: list[float] = []
    acc = 1.0
    for k, c in enumerate(confidences):
        acc *= _probability(f"confidences[{k}]", c)
        out.append(acc)
    return out


def is_paired(process_cnt: int, schedule_cnt: int) -> bool:
    """Whether every scheduled step of the request has been processed on the host (no step in flight)."""
    return process_cnt == schedule_cnt


def draft_available(has_draft_info: bool, schedule_cnt: int, process_cnt: int) -> bool:
    """Whether the request has drafts this round: known drafts, or one step in flight that will produce them."""
    return bool(has_draft_info) or schedule_cnt == process_cnt + 1


def budget_rates(
    prev_accept_rates: Sequence[float], accept_rates: Sequence[float], paired: bool
) -> list[float]:
    """The rate list the budget search uses: always the estimate from two rounds back.

    When no step is in flight (``paired``), the newest list (``accept_rates``) is the one round N-1 produced,
    so the N-2 estimate is the previous list; with a step in flight, the host has not yet seen round N-1's
    list, so ``accept_rates`` already is the N-2 estimate.
    """
    return list(prev_accept_rates if paired else accept_rates)


def _prepared(name: str, rates: Sequence[float], nd: int, has_draft: bool) -> list[float]:
    """Validated rate list of one request: empty -> ``nd`` pads; longer than ``nd`` -> truncated to ``nd``."""
    if len(rates) == 0:
        return [1.0 if has_draft else 0.0] * nd
    out = [_probability(f"{name}[{k}]", r) for k, r in enumerate(rates[:nd])]
    for k in range(1, len(out)):
        if out[k] > out[k - 1]:
            raise ValueError(
                f"{name}: rates must be non-increasing (cumulative products), got {out[k]!r} at {k} "
                f"after {out[k - 1]!r}"
            )
    return out


def _queue(lists: Sequence[Sequence[float]]) -> list[tuple[float, int]]:
    """All ``(rate, seq_index)`` entries, by rate descending then seq index ascending (then draft order)."""
    entries = [(r, i) for i, rates in enumerate(lists) for r in rates]
    entries.sort(key=lambda e: (-e[0], e[1]))  # stable: a request's own equal rates stay in draft order
    return entries


def _check_lengths(num_drafts: Sequence[int], **lists: Sequence[object]) -> list[int]:
    nds = [_nonneg_int(f"num_drafts[{i}]", nd) for i, nd in enumerate(num_drafts)]
    for name, values in lists.items():
        if len(values) != len(nds):
            raise ValueError(f"{name}: expected {len(nds)} entries (one per sequence), got {len(values)}")
    return nds


def allocate_verify_lengths(
    rates_alloc: Sequence[Sequence[float]],
    num_drafts: Sequence[int],
    has_draft: Sequence[bool],
    total_q: int,
) -> list[int]:
    """Split ``total_q`` rows: ``1 + (entries of request i among the first total_q - n_seqs of the queue)``.

    Rate lists are prepared as in :func:`plan_verify_lengths`. When the queue holds fewer than
    ``total_q - n_seqs`` entries every entry is taken (the lengths then sum to less than ``total_q``).
    """
    nds = _check_lengths(num_drafts, rates_alloc=rates_alloc, has_draft=has_draft)
    _nonneg_int("total_q", total_q)
    lists = [_prepared(f"rates_alloc[{i}]", rates_alloc[i], nds[i], has_draft[i]) for i in range(len(nds))]
    seqlen_q = [1] * len(nds)
    for _, i in _queue(lists)[: max(0, total_q - len(nds))]:
        seqlen_q[i] += 1
    return seqlen_q


def plan_verify_lengths(
    rates_budget: Sequence[Sequence[float]],
    rates_alloc: Sequence[Sequence[float]],
    num_drafts: Sequence[int],
    has_draft: Sequence[bool],
    curve: LatencyCurve,
    slope_ms: float,
    sampler_ms: float,
) -> tuple[int, list[int]]:
    """Choose the step's verify row count ``total_q`` and each request's ``seqlen_q`` (engine spec §8.6.1).

    ``rates_budget[i]`` / ``rates_alloc[i]``: request ``i``'s cumulative acceptance rates for the budget
    search and for the allocation (:func:`budget_rates`); each is non-increasing, in ``[0, 1]``, truncated to
    ``num_drafts[i]`` entries, and an empty list stands for ``num_drafts[i]`` entries of 1.0 when
    ``has_draft[i]`` else 0.0. ``slope_ms`` and ``sampler_ms`` are the online estimates
    (:class:`SlopeEstimator`, :class:`SamplerTimeEstimator`).

    Edge cases: no sequences gives ``(0, [])``; an empty curve gives fixed lengths ``1 + num_drafts[i]``
    (``total_q`` their sum). When even ``n_seqs`` rows fit no graph of the curve (its largest size is below
    ``n_seqs``), no candidate can be evaluated; the plan then verifies no drafts at all (``total_q =
    n_seqs``, every length 1): the fewest rows, the cheapest step whatever graph ends up running it. A
    predicted time of 0 counts as an infinite throughput, so the first such candidate wins.
    """
    nds = _check_lengths(num_drafts, rates_budget=rates_budget, rates_alloc=rates_alloc, has_draft=has_draft)
    if not isinstance(curve, LatencyCurve):
        raise TypeError(f"curve: expected a LatencyCurve, got {type(curve).__name__}")
    slope = _finite_nonneg("slope_ms", slope_ms)
    sampler = _finite_nonneg("sampler_ms", sampler_ms)
    n = len(nds)
    if n == 0:
        return 0, []
    if len(curve) == 0:
        lengths = [1 + nd for nd in nds]
        return sum(lengths), lengths

    budget_lists = [_prepared(f"rates_budget[{i}]", rates_budget[i], nds[i], has_draft[i]) for i in range(n)]
    best_bsz: int | None = None
    best_tp = -math.inf
    bsz, expected = n, float(n)
    largest = curve.sizes[-1]
    queue = _queue(budget_lists)
    for step in range(len(queue) + 1):
        if step:
            bsz += 1
            expected += queue[step - 1][0]
        if bsz > largest:
            break  # bsz only grows: no later candidate fits a graph either
        size, baseline = curve.smallest_at_least(bsz)  # type: ignore[misc]  # bsz <= largest
        t = baseline + slope * size + sampler
        tp = expected / t if t > 0 else math.inf
        if tp > best_tp:
            best_bsz, best_tp = bsz, tp
    if best_bsz is None:
        return n, [1] * n
    return best_bsz, allocate_verify_lengths(rates_alloc, nds, has_draft, best_bsz)


# ----------------------------------------------------------------------------------------------------------
# Online estimates


class SlopeEstimator:
    """Per-row forward-time correction on top of the latency curve (engine spec §8.6.3).

    Each decode step that ran graph size ``G`` records the residual ``(forward_ms - baseline(G)) / G``. The
    last ``window`` residuals (5000, all sizes together, oldest evicted first, kept in a
    :class:`collections.deque`) are grouped by size; a size with at least ``min_samples`` (10) residuals in
    the window contributes its median (:func:`statistics.median`), and the slope is the median of those
    per-size medians, clamped at 0 (0 when no size qualifies).
    """

    def __init__(self, window: int = 5000, min_samples: int = 10) -> None:
        self.window = _positive_int("window", window)
        self.min_samples = _positive_int("min_samples", min_samples)
        self._samples: deque[tuple[int, float]] = deque()
        self._by_size: dict[int, deque[float]] = {}
        self._cached: float | None = 0.0

    def __len__(self) -> int:
        return len(self._samples)

    def record(self, graph_size: int, forward_ms: float, baseline_ms: float) -> None:
        """Add one step's measurement: the forward took ``forward_ms`` on graph ``graph_size``."""
        size = _positive_int("graph_size", graph_size)
        fwd, base = float(forward_ms), float(baseline_ms)
        if not math.isfinite(fwd) or not math.isfinite(base):
            raise ValueError(
                f"forward_ms / baseline_ms: expected finite numbers, got {forward_ms!r}, {baseline_ms!r}"
            )
        residual = (fwd - base) / size
        if len(self._samples) == self.window:
            old_size, _ = self._samples.popleft()
            old = self._by_size[old_size]
            old.popleft()
            if not old:
                del self._by_size[old_size]
        self._samples.append((size, residual))
        self._by_size.setdefault(size, deque()).append(residual)
        self._cached = None

    def record_on(self, curve: LatencyCurve, graph_size: int, forward_ms: float) -> None:
        """:meth:`record` with the baseline read from ``curve``."""
        self.record(graph_size, forward_ms, curve.baseline_ms(graph_size))

    def slope_ms(self) -> float:
        if self._cached is None:
            medians = [statistics.median(v) for v in self._by_size.values() if len(v) >= self.min_samples]
            self._cached = max(0.0, statistics.median(medians)) if medians else 0.0
        return self._cached


class SamplerTimeEstimator:
    """Sampler time per step, by number of sequences (engine spec §8.6.3).

    Keeps the last ``window`` (9) samples per ``n_seqs`` and the last ``window`` samples overall. The estimate
    for ``n_seqs`` is the median of its own samples when it has at least ``min_samples`` (5), else the median
    of the overall samples under the same rule, else 0.
    """

    def __init__(self, window: int = 9, min_samples: int = 5) -> None:
        self.window = _positive_int("window", window)
        self.min_samples = _positive_int("min_samples", min_samples)
        self._global: deque[float] = deque(maxlen=self.window)
        self._by_n: dict[int, deque[float]] = {}

    def record(self, n_seqs: int, sampler_ms: float) -> None:
        n = _nonneg_int("n_seqs", n_seqs)
        ms = float(sampler_ms)
        if not math.isfinite(ms):
            raise ValueError(f"sampler_ms: expected a finite number, got {sampler_ms!r}")
        self._global.append(ms)
        self._by_n.setdefault(n, deque(maxlen=self.window)).append(ms)

    def estimate_ms(self, n_seqs: int) -> float:
        own = self._by_n.get(n_seqs)
        if own is not None and len(own) >= self.min_samples:
            return statistics.median(own)
        if len(self._global) >= self.min_samples:
            return statistics.median(self._global)
        return 0.0


# ----------------------------------------------------------------------------------------------------------
# Measuring and caching the curve


def measure_curve(
    run_step: Callable[[int], None],
    sizes: Sequence[int],
    *,
    warmup: int = 1,
    repeats: int = 5,
    timer: Callable[[], float] = time.perf_counter,
) -> LatencyCurve:
    """Time ``run_step(size)`` for each size: ``warmup`` untimed calls, then ``repeats`` timed ones.

    The baseline is the trimmed mean in ms: the fastest and the slowest timed call are dropped and the rest
    averaged (with fewer than 3 repeats nothing is dropped). ``run_step`` must return only once its work is
    done (block on the result, plus any barrier across the expert-parallel group the caller wants in the
    measurement); averaging across that group is the caller's part too. ``timer`` returns seconds.
    """
    LatencyCurve([(s, 0.0) for s in sizes])  # validate the sizes before spending time
    _nonneg_int("warmup", warmup)
    _positive_int("repeats", repeats)
    points = []
    for size in sizes:
        for _ in range(warmup):
            run_step(size)
        times = []
        for _ in range(repeats):
            t0 = timer()
            run_step(size)
            times.append((timer() - t0) * 1000.0)
        if len(times) >= 3:
            times = sorted(times)[1:-1]
        points.append((size, sum(times) / len(times)))
    return LatencyCurve(points)


_KEY_RE = re.compile(r"[0-9A-Za-z_-]+")


def curve_cache_key(model: str, sizes: Sequence[int], mesh: tuple[int, ...]) -> str:
    """sha256 hex digest of the canonical JSON of ``{model, sizes, mesh, unit: "ms"}``.

    ``mesh`` is the parallel layout the curve was measured on (e.g. ``(dp, cp, ep)`` sizes).
    """
    doc = {
        "model": str(model),
        "sizes": [int(s) for s in sizes],
        "mesh": [int(m) for m in mesh],
        "unit": "ms",
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(f"key: expected letters, digits, '_' or '-' only, got {key!r}")
    return key


def save_curve(
    directory: str | os.PathLike[str], key: str, curve: LatencyCurve, *, now: float | None = None
) -> str:
    """Write ``curve`` as ``<directory>/<key>.<uuid4 hex>.<unix seconds>``; return the path.

    The JSON is written to a temporary file in the same folder and moved into place with :func:`os.replace`,
    so a reader sees either no file or a whole one.
    """
    _check_key(key)
    stamp = int(time.time() if now is None else now)
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(os.fspath(directory), f"{key}.{uuid.uuid4().hex}.{stamp}")
    doc = {"key": key, "unit": "ms", "created": stamp, "points": [[s, ms] for s, ms in curve.points]}
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{key}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return final


def _read_curve(path: str, key: str) -> LatencyCurve | None:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or doc.get("key") != key or doc.get("unit") != "ms":
            return None
        points = doc["points"]
        if not isinstance(points, list):
            return None
        return LatencyCurve([tuple(p) for p in points])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_curve(
    directory: str | os.PathLike[str], key: str, *, ttl_s: float, now: float | None = None
) -> LatencyCurve | None:
    """The newest readable cached curve of ``key`` younger than ``ttl_s`` seconds, or None.

    Files of this key older than ``ttl_s + CACHE_GRACE_S`` (two hours) are deleted on the way. Unreadable or
    malformed files are skipped (the next newest is tried); a missing folder is an empty cache.
    """
    _check_key(key)
    ttl = _finite_nonneg("ttl_s", ttl_s)
    t_now = time.time() if now is None else float(now)
    name_re = re.compile(re.escape(key) + r"\.[0-9a-f]{32}\.(\d+)")
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    fresh: list[tuple[int, str]] = []
    for name in names:
        m = name_re.fullmatch(name)
        if m is None:
            continue
        stamp = int(m.group(1))
        age = t_now - stamp
        if age > ttl + CACHE_GRACE_S:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
        elif age < ttl:
            fresh.append((stamp, name))
    for _, name in sorted(fresh, reverse=True):
        curve = _read_curve(os.path.join(directory, name), key)
        if curve is not None:
            return curve
    return None
