"""The per-row sampling parameters of one step as arrays: :class:`SamplingTensors`.

The scheduler knows each request's :class:`~deepinfer_jax.engine.params.SamplingParams`; the jitted step needs
them as fixed-shape arrays, one row per sampled sequence, padded to the step's sequence bucket.
:meth:`SamplingTensors.build` does that conversion on the host, in numpy, once per step, and normalises every
"off" spelling into one neutral value per field (top-k off = the vocabulary size, top-p off = 1.0, ...) so the
device code needs no special cases.

This module sits below the engine and never imports it: a request's parameters are read by attribute name from
any object providing the fields of :data:`ROW_FIELDS` (the engine's ``SamplingParams`` does).

Masks. The ids a row must never produce *in this step* are given as a short padded list ``masked_ids[S, K]``
rather than a ``[S, V]`` boolean mask (hundreds of bytes per step instead of megabytes): the engine-wide banned
ids, plus — while a request has produced fewer than ``min_tokens`` tokens — its EOS ids (unless ``ignore_eos``)
and its ``stop_token_ids`` (vLLM's semantics of ``min_tokens``). ``K`` is rounded up to a power of two so that
varying stop lists cost at most a handful of compiled variants. The ids a caller bans for one step only (vLLM's
``bad_words``, which depend on the tokens generated so far) join the same list (``extra_masked_ids``).

``logit_bias`` (``{id: bias}``) and ``allowed_token_ids`` travel the same way, as padded ``[S, K]`` lists whose
width is a power of two (0 when no row of the step uses them, so steps without them pay nothing).

Grammar masks (structured outputs) are a packed token bitmask ``[S, W]``, ``W = ceil(V / 32)`` int32 words,
token ``t`` allowed iff bit ``t % 32`` of word ``t // 32`` is set; ``W = 0`` when no row of the step is
constrained, and an unconstrained row of a constrained step is all ones.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["ROW_FIELDS", "CheckedRow", "SamplingTensors", "check_row", "split_seed"]

ROW_FIELDS: tuple[str, ...] = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
)
"""Attributes :meth:`SamplingTensors.build` reads from each request's parameters (``golden_token_ids`` and
``first_n_token_no_eos`` too, when an object has them)."""

_MAX_POSITION = 2**31 - 1
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)
_U32 = 0xFFFFFFFF


def split_seed(seed: int) -> tuple[int, int]:
    """Split a seed in ``[0, 2**64)`` into its ``(lo, hi)`` uint32 words (host side).

    Raises:
      TypeError: ``seed`` is not an int (bools are refused: ``True`` is no seed anyone meant).
      ValueError: ``seed`` is outside ``[0, 2**64)``.
    """
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise TypeError(f"seed must be an int in [0, 2**64), got {type(seed).__name__} {seed!r}")
    seed = int(seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed = {seed} is outside [0, 2**64)")
    return seed & _U32, seed >> 32


class SamplingTensors(NamedTuple):
    """Per-row sampling parameters of one step, every field an array with leading axis ``S`` (rows).

    Built on the host with numpy by :meth:`build`; a ``NamedTuple``, so it is a pytree that the jitted step takes
    as it is (and this module needs no JAX: the host scheduler imports it). Padding rows are greedy with no penalty and no mask, so they cost nothing and draw nothing.

    Attributes:
      temperature: float32 ``[S]``; 0 = greedy (exact argmax).
      top_p: float32 ``[S]`` in (0, 1]; 1 = off.
      top_k: int32 ``[S]`` in [1, V]; V = off.
      min_p: float32 ``[S]`` in [0, 1]; 0 = off.
      repetition_penalty: float32 ``[S]`` > 0; 1 = off.
      presence_penalty: float32 ``[S]`` in [-2, 2]; 0 = off.
      frequency_penalty: float32 ``[S]`` in [-2, 2]; 0 = off.
      seed: uint32 ``[S, 2]`` the ``(lo, hi)`` words of each row's 64-bit seed.
      position: int32 ``[S]`` 0-based position of the token this row samples.
      masked_ids: int32 ``[S, K]`` ids whose logit is -inf this step; -1 = unused entry.
      golden: int32 ``[S]`` the token the row must emit (teacher forcing: ``golden_token_ids``), -1 = sample.
      bias_ids, bias_values: int32 / float32 ``[S, Kb]`` ``logit_bias`` entries added to the raw logits; -1 =
        unused entry (``Kb = 0`` when no row has a bias).
      allowed_ids: int32 ``[S, Ka]`` ``allowed_token_ids``: a row whose first entry is >= 0 may only produce
        these ids; -1 = unused entry (``Ka = 0`` when no row restricts).
      token_bitmask: int32 ``[S, W]`` grammar masks (``W = 0`` when no row is constrained; all ones = free).
    """

    temperature: Any
    top_p: Any
    top_k: Any
    min_p: Any
    repetition_penalty: Any
    presence_penalty: Any
    frequency_penalty: Any
    seed: Any
    position: Any
    masked_ids: Any
    golden: Any
    bias_ids: Any
    bias_values: Any
    allowed_ids: Any
    token_bitmask: Any

    @property
    def num_rows(self) -> int:
        """``S``, the number of rows including padding (the leading axis)."""
        return int(self.temperature.shape[0])

    def reshape_rows(self, *shape: int) -> SamplingTensors:
        """The same tensors with the leading row axis reshaped to ``shape`` (e.g. ``(devices, rows)``)."""
        return SamplingTensors(*(a.reshape(*shape, *a.shape[1:]) for a in self))

    @classmethod
    def build(
        cls,
        params_list: Sequence[Any],
        seeds: Sequence[int],
        positions: Sequence[int] | np.ndarray,
        vocab_size: int,
        *,
        output_lens: Sequence[int] | np.ndarray | None = None,
        eos_token_ids: Sequence[int] = (),
        banned_token_ids: Sequence[int] = (),
        num_rows: int | None = None,
        mask_width: int | None = None,
        row_index: Sequence[int] | None = None,
        extra_masked_ids: Sequence[Sequence[int]] | None = None,
        token_bitmask: np.ndarray | None = None,
        checked_rows: Sequence[CheckedRow | None] | None = None,
    ) -> SamplingTensors:
        """Convert the parameters of the rows sampled in one step to padded numpy arrays.

        Args:
          params_list: one object per real row with the attributes of :data:`ROW_FIELDS`.
          seeds: each row's resolved 64-bit seed in ``[0, 2**64)`` (the engine derives one for requests
            without ``seq_seed``).
          positions: 0-based position of the token each row samples (its sequence length after the step).
          vocab_size: ``V``, the width of the logits.
          output_lens: tokens each row has generated so far (for ``min_tokens``); default all 0.
          eos_token_ids: the model's EOS ids, masked before ``min_tokens`` unless a row has ``ignore_eos``.
          banned_token_ids: ids masked in every real row (the engine-wide blacklist).
          num_rows: pad to this many rows (the step's sequence bucket); default ``len(params_list)``.
          mask_width: ``K``, the width of ``masked_ids``; default the smallest power of two that fits.
          row_index: the row of each entry of ``params_list`` among the ``num_rows`` (distinct, in
            ``[0, num_rows)``); default the first ``len(params_list)`` rows. The other rows are padding.
          extra_masked_ids: per entry of ``params_list``, more ids to mask in this step only (``bad_words``).
          token_bitmask: int32 ``[num_rows, ceil(V / 32)]`` grammar masks by row (not by entry), or ``None``
            for a step without a constrained row.
          checked_rows: per entry of ``params_list``, its :func:`check_row` result for this ``vocab_size``,
            kept by the caller from an earlier step (an engine checks a request's parameters once, not
            once per step); ``None`` entries (or ``None``) are checked here.

        Raises:
          TypeError / ValueError: a malformed argument, or a parameter outside its range; the message names the
            field, the row index, the value and the limit.
        """
        n = len(params_list)
        vocab = _positive_int("vocab_size", vocab_size)
        rows = n if num_rows is None else _positive_int("num_rows", num_rows, allow_zero=True)
        if rows < n:
            raise ValueError(f"SamplingTensors.build: num_rows = {rows} is smaller than the {n} rows given")
        seeds = list(seeds)
        if len(seeds) != n:
            raise ValueError(f"SamplingTensors.build: seeds has {len(seeds)} entries for {n} rows")
        if checked_rows is not None and len(checked_rows) != n:
            raise ValueError(
                f"SamplingTensors.build: checked_rows has {len(checked_rows)} entries for {n} rows"
            )
        pos = _int_column("positions", positions, n, lo=0, hi=_MAX_POSITION)
        outs = (
            np.zeros(n, np.int64) if output_lens is None else _int_column("output_lens", output_lens, n, lo=0)
        )
        eos = _id_list("eos_token_ids", eos_token_ids, vocab)
        banned = _id_list("banned_token_ids", banned_token_ids, vocab)
        if row_index is None:
            where = np.arange(n)
        else:
            where = _int_column("row_index", row_index, n, lo=0, hi=max(rows - 1, 0))
            if n and np.bincount(where, minlength=rows).max() > 1:
                raise ValueError("SamplingTensors.build: row_index repeats a row")

        out = _neutral(rows, vocab)
        masks: list[list[int]] = []
        # Rows sharing one parameters object (a batch generated with one SamplingParams) are checked once.
        checked: dict[int, CheckedRow] = {}
        found: list[CheckedRow] = []
        words: list[tuple[int, int]] = []
        biases: list[tuple[int, list[int], list[float]]] = []
        allows: list[tuple[int, list[int]]] = []
        out_list = outs.tolist()
        for j, p in enumerate(params_list):
            row = None if checked_rows is None else checked_rows[j]
            if row is None:
                row = checked.get(id(p))
                if row is None:
                    row = checked[id(p)] = check_row(p, vocab, j)
            found.append(row)
            try:
                words.append(split_seed(seeds[j]))
            except (TypeError, ValueError) as err:
                raise type(err)(f"SamplingTensors.build: seeds[{j}]: {err}") from None
            done = out_list[j]
            extra_ids = None if extra_masked_ids is None else extra_masked_ids[j]
            if banned or done < row.min_tokens or done < row.no_eos_until or extra_ids:
                row_mask = set(banned)
                if done < row.min_tokens:
                    row_mask.update(row.stops)
                    if not p.ignore_eos:
                        row_mask.update(eos)
                if done < row.no_eos_until:
                    row_mask.update(eos)
                if extra_ids:
                    row_mask.update(_id_list(f"params_list[{j}].bad_words", extra_ids, vocab))
                masks.append(sorted(row_mask))
            else:
                masks.append([])
            i = int(where[j])
            if row.bias is not None:
                biases.append((i, *row.bias))
            if row.allowed is not None:
                allows.append((i, row.allowed))
            golden = getattr(p, "golden_token_ids", None)
            if golden is not None and done < len(golden):
                token = _id_list(f"params_list[{j}].golden_token_ids", (golden[done],), vocab)[0]
                out["golden"][i] = token
        if n:
            values = np.array([r.values for r in found], np.float64)  # [n, 7]
            for c, name in enumerate(_VALUE_FIELDS):
                out[name][where] = values[:, c]
            out["seed"][where] = np.array(words, np.uint32)
            out["position"][where] = pos

        needed = max((len(m) for m in masks), default=0)
        if mask_width is None:
            width = 1 << max(needed - 1, 0).bit_length()
        else:
            width = _positive_int("mask_width", mask_width)
            if width < needed:
                raise ValueError(
                    f"SamplingTensors.build: mask_width = {width} is smaller than the {needed} ids row "
                    f"{int(where[[len(m) for m in masks].index(needed)])} must mask"
                )
        masked = np.full((rows, width), -1, np.int32)
        for j, m in enumerate(masks):
            if m:
                masked[where[j], : len(m)] = m
        kb = _width(max((len(b[1]) for b in biases), default=0))
        bias_ids = np.full((rows, kb), -1, np.int32)
        bias_values = np.zeros((rows, kb), np.float32)
        for i, ids, values in biases:
            bias_ids[i, : len(ids)] = ids
            bias_values[i, : len(ids)] = values
        ka = _width(max((len(a[1]) for a in allows), default=0))
        allowed_ids = np.full((rows, ka), -1, np.int32)
        for i, ids in allows:
            allowed_ids[i, : len(ids)] = ids
        if token_bitmask is None:
            bitmask = np.zeros((rows, 0), np.int32)
        else:
            bitmask = np.asarray(token_bitmask)
            words = (vocab + 31) // 32
            if bitmask.dtype != np.int32 or bitmask.shape != (rows, words):
                raise ValueError(
                    f"SamplingTensors.build: token_bitmask must be int32 [{rows}, {words}], got "
                    f"{bitmask.dtype} {bitmask.shape}"
                )
        return cls(
            masked_ids=masked,
            bias_ids=bias_ids,
            bias_values=bias_values,
            allowed_ids=allowed_ids,
            token_bitmask=bitmask,
            **out,
        )


def _width(needed: int) -> int:
    """0 for nothing, else the smallest power of two that holds ``needed`` entries."""
    return 0 if needed == 0 else 1 << (needed - 1).bit_length()


class CheckedRow(NamedTuple):
    """One request's sampling parameters, checked and converted for one vocabulary (:func:`check_row`).

    Attributes:
      values: the device values of :data:`_VALUE_FIELDS`, in order (top-k off as the vocabulary size).
      min_tokens: tokens before EOS and the stop ids may be sampled.
      no_eos_until: ``first_n_token_no_eos`` (0 when the object has none).
      stops: the stop ids.
      bias: ``logit_bias`` as (ids, values), or ``None``.
      allowed: ``allowed_token_ids``, or ``None``.
    """

    values: tuple[float, ...]
    min_tokens: int
    no_eos_until: int
    stops: list[int]
    bias: tuple[list[int], list[float]] | None
    allowed: list[int] | None


def check_row(p: Any, vocab: int, j: int = 0) -> CheckedRow:
    """The checked parameters of a row with parameters ``p`` (``j``: its index, for the error messages). Raises
    as :meth:`SamplingTensors.build` does."""
    missing = [f for f in ROW_FIELDS if not hasattr(p, f)]
    if missing:
        raise TypeError(
            f"SamplingTensors.build: params_list[{j}] ({type(p).__name__}) lacks attribute(s) {missing}"
        )
    field = f"params_list[{j}]"
    temp = _real(f"{field}.temperature", p.temperature, lo=0.0)
    if 0.0 < temp < _FLOAT32_TINY:
        raise ValueError(
            f"SamplingTensors.build: {field}.temperature = {temp!r} is below float32's smallest normal "
            f"{_FLOAT32_TINY:.3g}; use 0 for greedy"
        )
    top_p = _real(f"{field}.top_p", p.top_p, lo=0.0, lo_open=True, hi=1.0)
    k = _integer(f"{field}.top_k", p.top_k, lo=-1)
    min_p = _real(f"{field}.min_p", p.min_p, lo=0.0, hi=1.0)
    rep = _real(f"{field}.repetition_penalty", p.repetition_penalty, lo=0.0, lo_open=True)
    pres = _real(f"{field}.presence_penalty", p.presence_penalty, lo=-2.0, hi=2.0)
    freq = _real(f"{field}.frequency_penalty", p.frequency_penalty, lo=-2.0, hi=2.0)
    min_tokens = _integer(f"{field}.min_tokens", p.min_tokens, lo=0)
    if not isinstance(p.ignore_eos, bool | np.bool_):
        raise TypeError(
            f"SamplingTensors.build: {field}.ignore_eos must be a bool, got {type(p.ignore_eos).__name__}"
        )
    stops = _id_list(f"{field}.stop_token_ids", p.stop_token_ids or (), vocab)
    pairs = getattr(p, "logit_bias", None)
    bias = None
    if pairs:
        bias = (_id_list(f"{field}.logit_bias", [t for t, _ in pairs], vocab), [float(b) for _, b in pairs])
    ids = getattr(p, "allowed_token_ids", None)
    allowed = _id_list(f"{field}.allowed_token_ids", ids, vocab) if ids else None
    k = vocab if k <= 0 else min(k, vocab)
    no_eos = int(getattr(p, "first_n_token_no_eos", 0) or 0)
    return CheckedRow((temp, top_p, k, min_p, rep, pres, freq), min_tokens, no_eos, stops, bias, allowed)


_VALUE_FIELDS = ROW_FIELDS[:7]
"""The fields of :attr:`CheckedRow.values`, in order (the per-row float and int columns)."""


def _neutral(rows: int, vocab: int) -> dict[str, np.ndarray]:
    """Arrays of ``rows`` padding rows: greedy, no filter, no penalty, seed 0, position 0."""
    return {
        "temperature": np.zeros(rows, np.float32),
        "top_p": np.ones(rows, np.float32),
        "top_k": np.full(rows, vocab, np.int32),
        "min_p": np.zeros(rows, np.float32),
        "repetition_penalty": np.ones(rows, np.float32),
        "presence_penalty": np.zeros(rows, np.float32),
        "frequency_penalty": np.zeros(rows, np.float32),
        "seed": np.zeros((rows, 2), np.uint32),
        "position": np.zeros(rows, np.int32),
        "golden": np.full(rows, -1, np.int32),
    }


def _positive_int(name: str, value: Any, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"SamplingTensors.build: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < (0 if allow_zero else 1):
        raise ValueError(f"SamplingTensors.build: {name} = {value} must be >= {0 if allow_zero else 1}")
    return int(value)


def _integer(name: str, value: Any, *, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"SamplingTensors.build: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < lo:
        raise ValueError(f"SamplingTensors.build: {name} = {value} must be >= {lo}")
    return int(value)


def _real(name: str, value: Any, *, lo: float, hi: float = math.inf, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"SamplingTensors.build: {name} must be a real number, got {type(value).__name__}")
    v = float(value)
    below = v <= lo if lo_open else v < lo
    if not math.isfinite(v) or below or v > hi:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{']' if math.isfinite(hi) else ')'}"
        raise ValueError(f"SamplingTensors.build: {name} = {value!r} is outside {interval}")
    return v


def _int_column(name: str, values: Any, n: int, *, lo: int, hi: int | None = None) -> np.ndarray:
    arr = np.asarray(values)
    if arr.shape != (n,):
        raise ValueError(
            f"SamplingTensors.build: {name} must have {n} entries (one per row), got shape {arr.shape}"
        )
    if n and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"SamplingTensors.build: {name} must hold ints, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr < lo) | (arr > (hi if hi is not None else np.iinfo(np.int64).max)))
    if bad.size:
        i = int(bad[0])
        limit = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"SamplingTensors.build: {name}[{i}] = {arr[i]} must be {limit}")
    return arr


def _id_list(name: str, ids: Any, vocab: int) -> list[int]:
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence | np.ndarray):
        raise TypeError(f"SamplingTensors.build: {name} must be a sequence of ints, got {type(ids).__name__}")
    out = []
    for j, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"SamplingTensors.build: {name}[{j}] must be an int, got {type(t).__name__}")
        if not 0 <= t < vocab:
            raise ValueError(
                f"SamplingTensors.build: {name}[{j}] = {t} is outside the vocabulary [0, {vocab})"
            )
        out.append(int(t))
    return out
