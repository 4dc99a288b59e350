"""What a user asks for (:class:`SamplingParams`) and what the engine gives back (:class:`RequestOutput`).

The shapes follow vLLM's offline API, which most callers already know: one :class:`RequestOutput` per prompt,
holding :class:`CompletionOutput` records whose ``logprobs`` are lists of ``{token_id: Logprob}`` dicts.

:class:`SamplingParams` validates every field at construction (ARCHITECTURE §7, tier 1): a bad value raises
``ValueError`` or ``TypeError`` naming the field, the value and the valid range, before anything is scheduled.
Nothing is clamped or silently converted: ``max_tokens=0`` is an error (the reference engine's silent 0 -> 1 is
not ported) and ``temperature=0`` means exact argmax, not a small temperature. Checks that need the model (token
ids inside the vocabulary, lengths against ``max_model_len``) are in :func:`validate_request`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from deepinfer_jax.engine.structured import StructuredOutputsParams, from_so_args

__all__ = [
    "MAX_LOGPROBS",
    "CompletionOutput",
    "FinishReason",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "derive_seed",
    "seed_words",
    "validate_request",
]

MAX_LOGPROBS = 20
"""Most top-n alternatives ``logprobs`` / ``prompt_logprobs`` may ask for."""

_MAX_INT32 = 2**31 - 1
_SEED_LIMIT = 2**64
_MASK64_ = 2**64 - 1

FinishReason = Literal["stop", "length", "error", "abort"]
"""Why a request ended: a stop (EOS, stop id, stop string), a length limit, an error of this request alone, or an
abort by its caller (:meth:`~deepinfer_jax.engine.async_llm.AsyncLLM.abort`, a client that disconnected)."""


class RequestOutputKind(enum.Enum):
    """What the outputs streamed by :class:`~deepinfer_jax.engine.async_llm.AsyncLLM` hold (vLLM's enum).

    ``CUMULATIVE``: every output holds everything generated so far; ``DELTA``: each output holds only what is new
    since the previous one (its text, token ids and logprobs); ``FINAL_ONLY``: one output, when the request has
    finished. Offline :meth:`~deepinfer_jax.engine.llm.LLM.generate` returns final outputs whatever the kind.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


_F32_TINY = float(np.finfo(np.float32).tiny)
_F32_MAX = float(np.finfo(np.float32).max)
MAX_N = 256
"""Most samples one request may ask for (``n``); the engine also needs ``n`` free sequences on one device."""

_REMOVED = {
    "best_of": "vLLM removed best_of from SamplingParams; ask for n samples and rank them (cumulative_logprob)",
    "truncate_prompt_tokens": (
        "vLLM moved truncate_prompt_tokens out of SamplingParams: pass "
        "generate(..., tokenization_kwargs={'truncate_prompt_tokens': k})"
    ),
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(
        value, bool | np.bool_
    )


def _float(name: str, value: Any) -> float:
    if not _is_real(value):
        raise TypeError(f"SamplingParams.{name} must be a float, got {type(value).__name__} ({value!r})")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"SamplingParams.{name} = {value!r} must be finite")
    return out


def _int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise TypeError(f"SamplingParams.{name} must be an int, got {type(value).__name__} ({value!r})")
    return int(value)


def _optional_logprobs(name: str, value: Any) -> int | None:
    """vLLM's int (top-n alternatives besides the chosen token) or DeepInfer's bool (``True`` = the chosen
    token only, ``False`` = none), told apart with ``isinstance(value, bool)``."""
    if value is None or value is False or value is np.False_:
        return None
    if value is True or value is np.True_:
        return 0
    n = _int(name, value)
    if not 0 <= n <= MAX_LOGPROBS:
        raise ValueError(f"SamplingParams.{name} = {n} must be None, a bool, or in [0, {MAX_LOGPROBS}]")
    return n


def _logprobs(logprobs: Any, top_logprobs: Any) -> int | None:
    """The number of alternatives to report (``None`` = no logprobs) from vLLM's ``logprobs`` int or DeepInfer's
    ``logprobs: bool`` with ``top_logprobs: int``."""
    n = _optional_logprobs("logprobs", logprobs)
    if top_logprobs is None:
        return n
    top = _int("top_logprobs", top_logprobs)
    if not 0 <= top <= MAX_LOGPROBS:
        raise ValueError(f"SamplingParams.top_logprobs = {top} must be in [0, {MAX_LOGPROBS}]")
    if isinstance(logprobs, bool | np.bool_) or logprobs is None:
        # DeepInfer's spelling: logprobs=True (or unset) with top_logprobs=k reports k alternatives.
        if logprobs is False and top:
            raise ValueError(
                f"SamplingParams.top_logprobs = {top} needs logprobs; logprobs=False asks for none"
            )
        return top if (logprobs is not False) else None
    if n != top:
        raise ValueError(
            f"SamplingParams.logprobs = {n} and top_logprobs = {top} differ; give one (vLLM's int logprobs, or "
            "logprobs=True with top_logprobs)"
        )
    return n


def _token_list(name: str, ids: Any) -> tuple[int, ...] | None:
    if ids is None:
        return None
    if isinstance(ids, str | bytes | bytearray | Mapping) or not isinstance(ids, Iterable):
        raise TypeError(f"SamplingParams.{name} must be a list of int or None, got {type(ids).__name__}")
    out = []
    for i, value in enumerate(ids):
        if not _is_int(value):
            raise TypeError(
                f"SamplingParams.{name}[{i}] must be an int, got {type(value).__name__} ({value!r})"
            )
        if value < 0:
            raise ValueError(f"SamplingParams.{name}[{i}] = {int(value)} must be a token id >= 0")
        out.append(int(value))
    return tuple(out)


@dataclasses.dataclass(frozen=True, init=False)
class SamplingParams:
    """How to sample one request. Immutable; every field is validated at construction.

    ==========================  ======  =======================================================================
    field                       default valid values
    ==========================  ======  =======================================================================
    ``temperature``             1.0     finite, >= 0; 0 = exact argmax (lowest id on ties), no random numbers
    ``top_p``                   1.0     (0, 1]
    ``top_k``                   -1      -1 or 0 = off, else >= 1
    ``min_p``                   0.0     [0, 1], relative to the most probable token
    ``repetition_penalty``      1.0     > 0 (vLLM semantics, over prompt + output tokens)
    ``presence_penalty``        0.0     [-2, 2]
    ``frequency_penalty``       0.0     [-2, 2]
    ``max_tokens``              16      >= 1
    ``min_tokens``              0       0 <= min_tokens <= max_tokens; stops before it are deferred
    ``stop``                    None    a string or a list of non-empty strings, matched on the text
    ``stop_token_ids``          None    a list of token ids (checked against the vocabulary per request)
    ``ignore_eos``              False   bool
    ``logprobs``                None    None, 0..20 alternatives (plus the chosen token), or a bool: True = the
                                        chosen token only (with ``top_logprobs`` alternatives), False = none
    ``top_logprobs``            None    None or 0..20 (DeepInfer's spelling, with ``logprobs=True``)
    ``prompt_logprobs``         None    None, 0..20, or a bool (True = the prompt token only)
    ``golden_token_ids``        None    teacher forcing: output token ``o`` is ``golden_token_ids[o]`` (while the
                                        list lasts) and its logprob is reported; ids inside the vocabulary
    ``first_n_token_no_eos``    0       >= 0: EOS cannot be sampled as one of the first n output tokens
    ``seq_seed`` (``seed``)     None    [0, 2**64); None = derived from ``LLM(seed=)`` and the request index
    ``so_args``                 None    DeepInfer's structured-output dict (``schema_type``, ``schema``,
                                        ``trigger_token_ids``, ``bound_token_id``); stored as
                                        ``structured_outputs``
    ``structured_outputs``      None    a :class:`~deepinfer_jax.engine.structured.StructuredOutputsParams`
                                        (vLLM's shape); not together with ``so_args``
    ``thinking_token_budget``   None    >= 0: after this many reasoning tokens the end of the reasoning
                                        (``</think>``, or the structured-output trigger) is forced
    ``output_kind``             CUMUL.  a :class:`RequestOutputKind`: what an ``AsyncLLM`` stream's outputs hold
    ==========================  ======  =======================================================================

    ``stop`` and ``stop_token_ids`` are stored as tuples (``stop="x"`` becomes ``("x",)``), so that a
    ``SamplingParams`` shared by many requests can never be mutated through one of them.
    """

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    max_tokens: int
    min_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int | None
    prompt_logprobs: int | None
    golden_token_ids: tuple[int, ...] | None
    first_n_token_no_eos: int
    seq_seed: int | None
    so_args: None
    output_kind: RequestOutputKind
    structured_outputs: StructuredOutputsParams | None
    thinking_token_budget: int | None
    n: int
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    detokenize: bool
    logit_bias: tuple[tuple[int, float], ...] | None
    allowed_token_ids: tuple[int, ...] | None
    bad_words: tuple[str, ...] | None

    def __init__(
        self,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        max_tokens: int = 16,
        min_tokens: int = 0,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        seq_seed: int | None = None,
        so_args: Mapping[str, Any] | None = None,
        *,
        seed: int | None = None,
        top_logprobs: int | None = None,
        golden_token_ids: Sequence[int] | None = None,
        first_n_token_no_eos: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        n: int = 1,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        detokenize: bool = True,
        logit_bias: Mapping[int, float] | None = None,
        allowed_token_ids: Sequence[int] | None = None,
        bad_words: Sequence[str] | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
        thinking_token_budget: int | None = None,
        **removed: Any,
    ) -> None:
        for name in removed:
            if name in _REMOVED:
                raise TypeError(f"SamplingParams.{name}: {_REMOVED[name]}")
            raise TypeError(f"SamplingParams got an unexpected keyword argument {name!r}")
        values: dict[str, Any] = {}
        t = _float("temperature", temperature)
        if t < 0:
            raise ValueError(f"SamplingParams.temperature = {temperature!r} must be >= 0 (0 = greedy)")
        if t and not _F32_TINY <= t <= _F32_MAX:
            # The sampler works in float32: a smaller value would become 0 (greedy) or a denormal, a larger inf.
            raise ValueError(
                f"SamplingParams.temperature = {temperature!r} must be 0 (greedy) or in [{_F32_TINY:.4g}, "
                f"{_F32_MAX:.4g}] (float32's normal range)"
            )
        values["temperature"] = t
        p = _float("top_p", top_p)
        if not 0 < p <= 1:
            raise ValueError(f"SamplingParams.top_p = {top_p!r} must be in (0, 1]")
        values["top_p"] = p
        k = _int("top_k", top_k)
        if k < -1 or k > _MAX_INT32:
            raise ValueError(f"SamplingParams.top_k = {k} must be -1 or 0 (off) or in [1, {_MAX_INT32}]")
        values["top_k"] = k
        mp = _float("min_p", min_p)
        if not 0 <= mp <= 1:
            raise ValueError(f"SamplingParams.min_p = {min_p!r} must be in [0, 1]")
        values["min_p"] = mp
        rp = _float("repetition_penalty", repetition_penalty)
        if not _F32_TINY <= rp <= _F32_MAX:
            raise ValueError(
                f"SamplingParams.repetition_penalty = {repetition_penalty!r} must be > 0, in float32's normal range "
                f"[{_F32_TINY:.4g}, {_F32_MAX:.4g}]"
            )
        values["repetition_penalty"] = rp
        for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            v = _float(name, value)
            if not -2 <= v <= 2:
                raise ValueError(f"SamplingParams.{name} = {value!r} must be in [-2, 2]")
            values[name] = v
        if max_tokens is None:
            mt = None  # until max_model_len (resolved per request by the engine)
        else:
            mt = _int("max_tokens", max_tokens)
            if not 1 <= mt <= _MAX_INT32:
                raise ValueError(f"SamplingParams.max_tokens = {mt} must be None or in [1, {_MAX_INT32}]")
        values["max_tokens"] = mt
        mn = _int("min_tokens", min_tokens)
        if not 0 <= mn <= (_MAX_INT32 if mt is None else mt):
            raise ValueError(f"SamplingParams.min_tokens = {mn} must be in [0, max_tokens = {mt}]")
        values["min_tokens"] = mn
        values["stop"] = _stop_strings(stop)
        values["stop_token_ids"] = _stop_ids(stop_token_ids)
        if not isinstance(ignore_eos, bool | np.bool_):
            raise TypeError(f"SamplingParams.ignore_eos must be a bool, got {type(ignore_eos).__name__}")
        values["ignore_eos"] = bool(ignore_eos)
        values["logprobs"] = _logprobs(logprobs, top_logprobs)
        values["prompt_logprobs"] = _optional_logprobs("prompt_logprobs", prompt_logprobs)
        values["golden_token_ids"] = _token_list("golden_token_ids", golden_token_ids)
        nf = _int("first_n_token_no_eos", first_n_token_no_eos)
        if nf < 0:
            raise ValueError(f"SamplingParams.first_n_token_no_eos = {nf} must be >= 0")
        values["first_n_token_no_eos"] = nf
        values["seq_seed"] = _seed(seq_seed, seed)
        if structured_outputs is not None and not isinstance(structured_outputs, StructuredOutputsParams):
            raise TypeError(
                "SamplingParams.structured_outputs must be a StructuredOutputsParams or None, got "
                f"{type(structured_outputs).__name__}"
            )
        if so_args is not None:
            if structured_outputs is not None:
                raise ValueError(
                    "SamplingParams: so_args and structured_outputs both given; give one (so_args is DeepInfer's "
                    "spelling of structured_outputs)"
                )
            structured_outputs = from_so_args(so_args)
        values["structured_outputs"] = structured_outputs
        if thinking_token_budget is not None:
            budget = _int("thinking_token_budget", thinking_token_budget)
            if not 0 <= budget <= _MAX_INT32:
                raise ValueError(
                    f"SamplingParams.thinking_token_budget = {budget} must be None or in [0, {_MAX_INT32}]"
                )
            thinking_token_budget = budget
        values["thinking_token_budget"] = thinking_token_budget
        values["so_args"] = None
        if not isinstance(output_kind, RequestOutputKind):
            raise TypeError(
                f"SamplingParams.output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), got "
                f"{type(output_kind).__name__} ({output_kind!r})"
            )
        values["output_kind"] = output_kind
        nn = _int("n", n)
        if not 1 <= nn <= MAX_N:
            raise ValueError(f"SamplingParams.n = {nn} must be in [1, {MAX_N}]")
        values["n"] = nn
        for name, value in (
            ("include_stop_str_in_output", include_stop_str_in_output),
            ("skip_special_tokens", skip_special_tokens),
            ("spaces_between_special_tokens", spaces_between_special_tokens),
            ("detokenize", detokenize),
        ):
            if not isinstance(value, bool | np.bool_):
                raise TypeError(
                    f"SamplingParams.{name} must be a bool, got {type(value).__name__} ({value!r})"
                )
            values[name] = bool(value)
        if values["stop"] and not values["detokenize"]:
            raise ValueError(
                "SamplingParams.stop needs detokenize=True (stop strings are matched on the text)"
            )
        values["logit_bias"] = _logit_bias(logit_bias)
        allowed = _token_list("allowed_token_ids", allowed_token_ids)
        if allowed is not None and not allowed:
            raise ValueError(
                "SamplingParams.allowed_token_ids is empty; give at least one id, or None for all"
            )
        values["allowed_token_ids"] = None if allowed is None else tuple(sorted(set(allowed)))
        values["bad_words"] = _bad_words(bad_words)
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def seed(self) -> int | None:
        """Alias of :attr:`seq_seed`."""
        return self.seq_seed

    @property
    def greedy(self) -> bool:
        """True when tokens are the exact argmax (``temperature == 0``)."""
        return self.temperature == 0.0

    def replace(self, **changes: Any) -> SamplingParams:
        """A validated copy with ``changes`` applied (``seed=`` is accepted as the alias of ``seq_seed``)."""
        if "seed" in changes:
            if "seq_seed" in changes and changes["seq_seed"] != changes["seed"]:
                raise ValueError(
                    f"SamplingParams: seed = {changes['seed']!r} and seq_seed = {changes['seq_seed']!r} differ; "
                    "seed is an alias of seq_seed, give one"
                )
            changes["seq_seed"] = changes.pop("seed")
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"SamplingParams has no field(s) {sorted(unknown)}")
        kwargs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        kwargs.update(changes)
        return SamplingParams(**kwargs)


def _logit_bias(bias: Any) -> tuple[tuple[int, float], ...] | None:
    """vLLM's ``{token_id: bias}`` as sorted ``(id, bias)`` pairs (immutable); ids >= 0, finite biases."""
    if bias is None:
        return None
    if isinstance(bias, tuple) and all(isinstance(x, tuple) and len(x) == 2 for x in bias):
        bias = dict(bias)  # the stored form, given back by replace()
    if not isinstance(bias, Mapping):
        raise TypeError(
            f"SamplingParams.logit_bias must be a dict {{token_id: bias}}, got {type(bias).__name__}"
        )
    out = []
    for key, value in bias.items():
        token = (
            int(key) if isinstance(key, str) and key.lstrip("-").isdigit() else key
        )  # JSON keys are strings
        if not _is_int(token):
            raise TypeError(f"SamplingParams.logit_bias key {key!r} must be a token id (int)")
        if token < 0:
            raise ValueError(f"SamplingParams.logit_bias key {token} must be a token id >= 0")
        v = _float(f"logit_bias[{token}]", value)
        if abs(v) > _F32_MAX:
            raise ValueError(f"SamplingParams.logit_bias[{token}] = {value!r} does not fit float32")
        out.append((int(token), v))
    return tuple(sorted(out)) or None


def _bad_words(words: Any) -> tuple[str, ...] | None:
    if words is None:
        return None
    if isinstance(words, str) or not isinstance(words, Sequence):
        raise TypeError(f"SamplingParams.bad_words must be a list of str, got {type(words).__name__}")
    for i, w in enumerate(words):
        if not isinstance(w, str):
            raise TypeError(f"SamplingParams.bad_words[{i}] must be a str, got {type(w).__name__} ({w!r})")
        if not w.strip():
            raise ValueError(f"SamplingParams.bad_words[{i}] = {w!r} must hold a word")
    return tuple(words) or None


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, Sequence) or isinstance(items, bytes | bytearray):
        raise TypeError(
            f"SamplingParams.stop must be a str, a list of str or None, got {type(stop).__name__}"
        )
    out: list[str] = []
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise TypeError(f"SamplingParams.stop[{i}] must be a str, got {type(s).__name__} ({s!r})")
        if not s:
            raise ValueError(f"SamplingParams.stop[{i}] = '' must be a non-empty string")
        out.append(s)
    return tuple(out)


def _stop_ids(ids: Any) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, str | bytes | bytearray | Mapping) or not isinstance(ids, Iterable):
        raise TypeError(
            f"SamplingParams.stop_token_ids must be a list of int or None, got {type(ids).__name__}"
        )
    out: list[int] = []
    for i, value in enumerate(ids):
        if not _is_int(value):
            raise TypeError(
                f"SamplingParams.stop_token_ids[{i}] must be an int, got {type(value).__name__} ({value!r})"
            )
        if value < 0:
            raise ValueError(f"SamplingParams.stop_token_ids[{i}] = {int(value)} must be a token id >= 0")
        out.append(int(value))
    return tuple(out)


def _seed(seq_seed: Any, seed: Any) -> int | None:
    if seed is not None and seq_seed is not None and seed != seq_seed:
        raise ValueError(
            f"SamplingParams: seed = {seed!r} and seq_seed = {seq_seed!r} differ; seed is an alias of seq_seed, "
            "give one"
        )
    value = seq_seed if seq_seed is not None else seed
    if value is None:
        return None
    name = "seq_seed" if seq_seed is not None else "seed"
    if not _is_int(value):
        raise TypeError(
            f"SamplingParams.{name} must be an int or None, got {type(value).__name__} ({value!r})"
        )
    value = int(value)
    if not 0 <= value < _SEED_LIMIT:
        raise ValueError(f"SamplingParams.{name} = {value} must be in [0, 2**64)")
    return value


def derive_seed(seed: int, index: int) -> int:
    """The sampling seed of request ``index`` of a ``generate`` call when it gives no ``seq_seed``.

    A SplitMix64 finaliser over ``(seed, index)``: distinct requests get unrelated 64-bit seeds, and the same
    ``LLM(seed=)`` and batch reproduce them exactly.
    """
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64_
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64_
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64_
    return z ^ (z >> 31)


def seed_words(seed: int) -> tuple[int, int]:
    """A 64-bit seed as ``(low, high)`` uint32 words, the form the device-side RNG carries (no uint64 on
    accelerators without x64)."""
    if not _is_int(seed) or not 0 <= seed < _SEED_LIMIT:
        raise ValueError(f"seed = {seed!r} must be an int in [0, 2**64)")
    seed = int(seed)
    return seed & 0xFFFFFFFF, seed >> 32


def validate_request(
    prompt_token_ids: Any,
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    index: int | None = None,
) -> np.ndarray:
    """Check one request against the model and return its prompt as a fresh int32 array.

    Refuses (``ValueError``/``TypeError``, naming the field and, with ``index``, the request's position in the
    batch): a prompt that is not a 1-D sequence of ints, an empty prompt, token ids outside ``[0, vocab_size)``,
    ``stop_token_ids`` outside the vocabulary, a prompt of ``max_model_len`` tokens or more, and
    ``len(prompt) + max_tokens > max_model_len`` (the request could not finish within the model length).
    """
    where = f"request {index}: " if index is not None else ""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"{where}sampling_params must be a SamplingParams, got {type(params).__name__}")
    if isinstance(prompt_token_ids, str | bytes | bytearray | Mapping):
        raise TypeError(
            f"{where}prompt_token_ids must be a sequence of ints, got {type(prompt_token_ids).__name__}"
        )
    if isinstance(prompt_token_ids, np.ndarray):
        arr = prompt_token_ids
        if arr.ndim != 1:
            raise ValueError(f"{where}prompt_token_ids must be 1-D, got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{where}prompt_token_ids must hold ints, got dtype {arr.dtype}")
    else:
        if not isinstance(prompt_token_ids, Iterable):
            raise TypeError(
                f"{where}prompt_token_ids must be a sequence of ints, got {type(prompt_token_ids).__name__}"
            )
        items = list(prompt_token_ids)
        for i, v in enumerate(items):
            if not _is_int(v):
                raise TypeError(
                    f"{where}prompt_token_ids[{i}] = {v!r} must be an int, got {type(v).__name__}"
                )
        arr = np.asarray(items, dtype=np.int64)
    if arr.size == 0:
        raise ValueError(f"{where}prompt_token_ids is empty; a prompt needs at least one token")
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{where}prompt_token_ids[{i}] = {int(arr[i])} is outside the vocabulary [0, {vocab_size})"
        )
    for name in ("stop_token_ids", "golden_token_ids", "allowed_token_ids"):
        for i, token in enumerate(getattr(params, name) or ()):
            if token >= vocab_size:
                raise ValueError(
                    f"{where}sampling_params.{name}[{i}] = {token} is outside the vocabulary [0, {vocab_size})"
                )
    so = params.structured_outputs
    if so is not None:
        for i, token in enumerate(so.trigger_token_ids or ()):
            if token >= vocab_size:
                raise ValueError(
                    f"{where}sampling_params.structured_outputs.trigger_token_ids[{i}] = {token} is outside the "
                    f"vocabulary [0, {vocab_size})"
                )
        if so.bound_token_id is not None and so.bound_token_id >= vocab_size:
            raise ValueError(
                f"{where}sampling_params.structured_outputs.bound_token_id = {so.bound_token_id} is outside the "
                f"vocabulary [0, {vocab_size})"
            )
    for token, _ in params.logit_bias or ():
        if token >= vocab_size:
            raise ValueError(
                f"{where}sampling_params.logit_bias key {token} is outside the vocabulary [0, {vocab_size})"
            )
    n = int(arr.size)
    if n >= max_model_len:
        raise ValueError(
            f"{where}prompt has {n} tokens; it must be shorter than max_model_len = {max_model_len} to leave "
            "room for an output token"
        )
    if params.max_tokens is None and params.min_tokens > max_model_len - n:
        raise ValueError(
            f"{where}sampling_params.min_tokens = {params.min_tokens} exceeds the {max_model_len - n} tokens "
            f"max_tokens=None leaves after a prompt of {n} tokens (max_model_len = {max_model_len})"
        )
    if params.max_tokens is not None and n + params.max_tokens > max_model_len:
        raise ValueError(
            f"{where}prompt length {n} + sampling_params.max_tokens {params.max_tokens} = "
            f"{n + params.max_tokens} exceeds max_model_len = {max_model_len}"
        )
    return arr.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Logprob:
    """Log-probability of one token (vLLM's shape).

    ``logprob`` is what ``LLM(logprobs_mode=)`` names (default vLLM's ``"raw_logprobs"``: the log-softmax of the
    model's raw logits); ``rank`` is 1 for the most probable token; ``decoded_token`` is the token's own text
    (``None`` without a tokenizer); ``sum_smaller_probs`` (with ``sampling.compute_sum_smaller_probs``) is the
    inclusive CDF of the token in the distribution it was sampled from, tokens ordered by ascending probability
    and ties by ascending id (``None`` otherwise).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None
    sum_smaller_probs: float | None = None


@dataclasses.dataclass
class RequestMetrics:
    """Timings (seconds of the engine's clock, ``time.monotonic`` by default) and token counts of a request.

    ``first_scheduled_time`` / ``first_token_time`` / ``finish_time`` stay ``None`` until the event happens;
    ``num_preemptions`` counts recomputes forced by a full cache.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0


@dataclasses.dataclass
class CompletionOutput:
    """One generated sequence of a request.

    Attributes:
        index: the sample's index within its request (0 … n - 1; 0 when n = 1).
        text: detokenized output, stop string and stopping special token excluded (``""`` without a tokenizer).
        token_ids: every generated id, the one that triggered a stop included.
        cumulative_logprob: sum of the chosen tokens' logprobs when ``logprobs`` was requested, else ``None``.
        logprobs: one ``{token_id: Logprob}`` per output token (the chosen token and the top-n alternatives)
            when requested, else ``None``.
        finish_reason: ``"stop"``, ``"length"``, ``"error"``, ``"abort"`` (ended by its caller), or ``None``
            while running.
        stop_reason: the stop string or stop token id that ended it (``None`` for EOS, length and errors).
        error: the message when ``finish_reason == "error"``.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """The result (or a streamed snapshot) of one request, vLLM's shape.

    ``prompt`` is the prompt text when the request was given as text, else ``None``; ``prompt_logprobs`` holds
    one entry per prompt token (``None`` for the first) when requested.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    metrics: RequestMetrics
    finished: bool = False
    num_cached_tokens: int = 0
    """Prompt tokens its first admission found in the prefix cache (vLLM's field; docs/prefix_cache.md)."""
