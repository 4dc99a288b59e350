"""What a benchmark runs: a :class:`Workload` (model, precision, request shapes, batching, sampling).

Prompt and output lengths are :class:`LengthDist` distributions; the prompts themselves are random token ids
drawn from a seeded generator, so a workload names its requests exactly and the engine and a baseline can be
given the same ids. Outputs ignore EOS by default, so every request generates exactly its drawn output
length and throughput numbers count the same work on both sides.

A workload with a ``request_rate`` is an *online* workload: its requests arrive over time instead of all at
once. The gaps between arrivals are drawn like vLLM's ``benchmark_serving`` draws them -- from a gamma
distribution with shape ``burstiness`` and mean ``1 / request_rate``, so ``burstiness = 1`` is a Poisson
process (exponential gaps), smaller values are burstier and larger ones more regular -- from their own seeded
generator, so adding a rate changes no prompt.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["LengthDist", "Request", "Workload", "parse_length_dist"]


@dataclasses.dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts: ``constant`` (``low``), ``uniform`` integers in ``[low, high]``, or a
    uniform ``choice`` among ``values``.

    The text forms (:func:`parse_length_dist`) are ``"32"``, ``"16:64"`` and ``"8,16,32"``.
    """

    kind: str
    low: int = 0
    high: int = 0
    values: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "uniform", "choice"):
            raise ValueError(f"LengthDist.kind: {self.kind!r} is not one of constant, uniform, choice")
        for v in (self.low, self.high, *self.values):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"LengthDist: lengths must be ints, got {type(v).__name__} ({v!r})")
        if self.kind == "choice":
            if not self.values or min(self.values) < 1:
                raise ValueError(f"LengthDist.values: expected lengths >= 1, got {self.values!r}")
        elif self.low < 1 or (self.kind == "uniform" and self.high < self.low):
            raise ValueError(f"LengthDist: expected 1 <= low <= high, got low={self.low}, high={self.high}")

    @property
    def max(self) -> int:
        return (
            max(self.values) if self.kind == "choice" else (self.high if self.kind == "uniform" else self.low)
        )

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "constant":
            return [self.low] * n
        if self.kind == "uniform":
            return [int(x) for x in rng.integers(self.low, self.high + 1, n)]
        return [int(self.values[i]) for i in rng.integers(0, len(self.values), n)]

    def __str__(self) -> str:
        if self.kind == "constant":
            return str(self.low)
        if self.kind == "uniform":
            return f"{self.low}:{self.high}"
        return ",".join(map(str, self.values))


def parse_length_dist(text: Any, field: str) -> LengthDist:
    """Parse ``"32"`` / ``32`` (constant), ``"16:64"`` (uniform, inclusive) or ``"8,16,32"`` (choice)."""
    if isinstance(text, LengthDist):
        return text
    if isinstance(text, bool) or not isinstance(text, int | str):
        raise TypeError(
            f"{field}: expected a length such as 32, '16:64' or '8,16,32', got {type(text).__name__}"
        )
    s = str(text).strip()
    try:
        if ":" in s:
            lo, hi = s.split(":")
            return LengthDist("uniform", int(lo), int(hi))
        if "," in s:
            return LengthDist("choice", values=tuple(int(x) for x in s.split(",") if x.strip()))
        return LengthDist("constant", int(s))
    except ValueError as err:
        raise ValueError(
            f"{field}: {text!r} is not a length distribution (32, '16:64' or '8,16,32'): {err}"
        ) from None


@dataclasses.dataclass(frozen=True)
class Request:
    """One benchmark request: its prompt ids and the number of tokens to generate."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int


_INT_FIELDS = {
    "num_requests": 1,
    "max_num_seqs": 1,
    "max_num_batched_tokens": 1,
    "warmup": 0,
    "repeats": 1,
    "data_parallel_size": 1,
    "expert_parallel_size": 1,
}
_ARRIVAL_STREAM = 0x41525256
"""Mixed into the seed of the arrival-time generator, so arrivals are independent of the prompt draws."""


def _rate(value: Any) -> float | None:
    """``request_rate`` normalised: ``None`` (or infinity) means every request arrives at once."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in ("inf", "infinity"):
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"Workload.request_rate: expected requests per second (a float), None or inf, got "
            f"{type(value).__name__} ({value!r})"
        )
    if math.isinf(value) and value > 0:
        return None
    if not value > 0 or math.isnan(value):
        raise ValueError(f"Workload.request_rate: must be > 0 requests/s (or inf), got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class Workload:
    """An offline benchmark workload.

    Attributes:
      model: a built-in name (``tiny-v3``) or a model folder.
      dtype: ``"bfloat16"`` (production, the default, as for ``LLM`` and every command) or ``"float32"`` (parity).
      num_requests: requests per measured run.
      prompt_len, output_len: length distributions (strings such as ``"32"`` are parsed).
      batch_size: requests handed to one ``generate`` call (``None``: all at once); the baseline batches the same.
      max_num_seqs, max_num_batched_tokens: the engine's concurrency and per-step token budget.
      kv_cache_memory: the engine's cache budget (``"64MiB"``); ``None``: the engine default.
      kv_cache_dtype, max_model_len, batch_invariant: passed to ``LLM`` as they are.
      temperature, top_p, top_k: sampling (``temperature=0`` is greedy).
      ignore_eos: generate exactly the drawn output lengths.
      seed: draws the prompts and lengths, and is the engine seed.
      warmup: unmeasured runs first (compilation, caches); repeats: measured runs.
      engine_overrides: dotted engine config names passed to ``LLM`` (``{"cache.block_size": 16}``).
      request_rate: requests per second of an online run (``None`` or ``inf``: all requests at once, handed to
        one ``generate`` call per batch). With a rate, requests enter the running engine at their arrival
        times (:meth:`arrival_times`, :mod:`deepinfer_jax.bench.online`), so TTFT includes queueing.
      burstiness: the gamma shape of the gaps between arrivals (1: Poisson arrivals); only with a rate.
      data_parallel_size, expert_parallel_size: the engine's ``(dp, ep)`` mesh, passed to ``LLM``.
      num_draft_tokens, speculative_variable_length: speculative decoding, passed to ``LLM`` (``None``: the
        config's, else ``LLM``'s default).
    """

    model: str = "tiny-v3"
    dtype: str = "bfloat16"
    num_requests: int = 16
    prompt_len: LengthDist = dataclasses.field(default_factory=lambda: LengthDist("constant", 32))
    output_len: LengthDist = dataclasses.field(default_factory=lambda: LengthDist("constant", 64))
    batch_size: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_memory: str | int | None = None
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    batch_invariant: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = True
    seed: int = 0
    warmup: int = 1
    repeats: int = 3
    engine_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    request_rate: float | None = None
    burstiness: float = 1.0
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    num_draft_tokens: int | None = None
    speculative_variable_length: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise TypeError(f"Workload.model: expected a model name or folder (str), got {self.model!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"Workload.dtype: {self.dtype!r} is not one of float32, bfloat16")
        for name, low in _INT_FIELDS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Workload.{name}: expected an int, got {type(value).__name__} ({value!r})")
            if value < low:
                raise ValueError(f"Workload.{name}: must be >= {low}, got {value}")
        if self.batch_size is not None and (
            isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1
        ):
            raise ValueError(f"Workload.batch_size: expected None or an int >= 1, got {self.batch_size!r}")
        object.__setattr__(self, "prompt_len", parse_length_dist(self.prompt_len, "Workload.prompt_len"))
        object.__setattr__(self, "output_len", parse_length_dist(self.output_len, "Workload.output_len"))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"Workload.seed: expected an int >= 0, got {self.seed!r}")
        object.__setattr__(self, "engine_overrides", dict(self.engine_overrides))
        object.__setattr__(self, "request_rate", _rate(self.request_rate))
        b = self.burstiness
        if isinstance(b, bool) or not isinstance(b, int | float):
            raise TypeError(f"Workload.burstiness: expected a float, got {type(b).__name__} ({b!r})")
        if not (b > 0 and math.isfinite(b)):
            raise ValueError(f"Workload.burstiness: must be a finite number > 0, got {b!r}")
        object.__setattr__(self, "burstiness", float(b))
        if self.request_rate is not None and self.batch_size is not None:
            raise ValueError(
                f"Workload.batch_size: {self.batch_size} cannot be combined with request_rate = "
                f"{self.request_rate} (an online run admits requests one at a time as they arrive); drop one"
            )

    @property
    def online(self) -> bool:
        """True when requests arrive over time (a ``request_rate`` is set)."""
        return self.request_rate is not None

    def replace(self, **changes: Any) -> Workload:
        """A validated copy with ``changes`` applied."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"Workload: unknown field(s) {sorted(unknown)}")
        return dataclasses.replace(self, **changes)

    def requests(self, vocab_size: int) -> list[Request]:
        """The workload's requests: prompt ids uniform in ``[0, vocab_size)``, lengths from the distributions.

        Depends only on the workload and ``vocab_size``, so every run (and the baseline) sees the same requests.
        """
        rng = np.random.default_rng(self.seed)
        prompt_lens = self.prompt_len.sample(rng, self.num_requests)
        output_lens = self.output_len.sample(rng, self.num_requests)
        return [
            Request(tuple(int(t) for t in rng.integers(0, vocab_size, p)), o)
            for p, o in zip(prompt_lens, output_lens)
        ]

    def arrival_times(self) -> list[float]:
        """Arrival offsets in seconds from the start of a run, one per request, non-decreasing.

        The first request arrives at 0; each later one follows its predecessor after a gap drawn from a gamma
        distribution with shape ``burstiness`` and scale ``1 / (request_rate * burstiness)`` (mean
        ``1 / request_rate``; exponential for ``burstiness = 1``). Without a rate every offset is 0. The draw
        depends only on ``seed``, ``num_requests``, the rate and the burstiness, so every run sees the same
        arrivals.
        """
        n = self.num_requests
        if self.request_rate is None:
            return [0.0] * n
        rng = np.random.default_rng([self.seed, _ARRIVAL_STREAM])
        scale = 1.0 / (self.request_rate * self.burstiness)
        gaps = rng.gamma(self.burstiness, scale, n - 1)
        return [0.0, *(float(x) for x in np.cumsum(gaps))]

    def batches(self, requests: list[Request]) -> list[list[Request]]:
        """``requests`` cut into the groups handed to one ``generate`` call each."""
        size = self.batch_size or len(requests)
        return [requests[i : i + size] for i in range(0, len(requests), size)]

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["prompt_len"] = str(self.prompt_len)
        out["output_len"] = str(self.output_len)
        out["engine_overrides"] = dict(self.engine_overrides)
        return out
