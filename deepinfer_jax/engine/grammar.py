"""Grammar-constrained decoding on the host: compiling grammars off the step's path (:class:`GrammarCompiler`) and
each request's matcher (:class:`RequestGrammar`), which fills the token bitmask of its next sample and advances
on the tokens the request accepts.

The backend is llguidance. A grammar text (:meth:`~deepinfer_jax.engine.structured.StructuredOutputsParams.
grammar_text`) is compiled once per engine in a small thread pool and kept in a cache keyed by the text; each
request then works on its own copy of the compiled matcher.

**Mask format.** One row of ``W = ceil(V / 32)`` int32 words per sampled row: token ``t`` is allowed iff bit
``t % 32`` of word ``t // 32`` is set (llguidance's layout). A row that is not constrained is all ones (-1).

**Phases of a request.** Without ``trigger_token_ids`` the grammar constrains every output token. With a
trigger, the output is free until it has produced the trigger sequence; ``bound_token_id`` or a
``thinking_token_budget`` that runs out first makes the next tokens the rest of the trigger, one forced id per
step. After the matcher has accepted EOS (or the grammar is complete and stopped) the mask is all ones.

**Speculative decoding.** :meth:`RequestGrammar.draft_masks` fills the masks of the ``k + 1`` verification rows
of ``k`` unconstrained draft tokens: it advances through the drafts while the constraint accepts them, filling
mask ``j`` after ``j`` drafts, then rolls the matcher back, so only the tokens the verification accepts
advance it for real (through :meth:`RequestGrammar.accept`).

This module needs no JAX.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from deepinfer_jax.engine.structured import StructuredOutputsParams, _llguidance

__all__ = ["GrammarCompiler", "RequestGrammar", "bitmask_words", "fill_masks", "unpack_bitmask"]


def bitmask_words(vocab_size: int) -> int:
    """``W``, the int32 words of one mask row of a ``vocab_size`` vocabulary."""
    return (int(vocab_size) + 31) // 32


def unpack_bitmask(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """One mask row as a bool ``[vocab_size]`` array (host side; the sampler does the same on the device)."""
    ids = np.arange(vocab_size)
    return ((row[ids // 32] >> (ids % 32)) & 1).astype(bool)


class GrammarCompiler:
    """Compiles grammar texts into llguidance matchers in a thread pool, with a cache keyed by the text.

    Args:
      tokenizer: the engine's :class:`~deepinfer_jax.text.Tokenizer` (its ``tokenizer.json`` builds
        llguidance's token table once, on first use).
      vocab_size: the model's vocabulary (the mask width; ids past the tokenizer's are never allowed).
      eos_token_ids: the ids that end a completed grammar.
      threads: pool size (``sampling.grammar_threads``, ``DEEPINFER_SO_BUILDER_CPUS``).
      timeout_s: how long a request waits for its grammar, from submission (``sampling.grammar_compile_timeout_s``).
      cache: keep compiled grammars (``sampling.grammar_cache``).
      cache_limit_bytes: the cache holds grammars whose texts total at most this many bytes, least recently
        used first out (<= 0: unbounded; ``sampling.grammar_cache_limit_bytes``). llguidance builds its automata
        lazily and does not report their size, so the text is what is counted.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        threads: int = 4,
        timeout_s: float = 20.0,
        cache: bool = True,
        cache_limit_bytes: int = 0,
    ) -> None:
        if threads < 1:
            raise ValueError(f"GrammarCompiler threads = {threads} must be >= 1")
        if timeout_s <= 0:
            raise ValueError(f"GrammarCompiler timeout_s = {timeout_s} must be > 0")
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.timeout_s = float(timeout_s)
        self.threads = int(threads)
        self.cache_enabled = bool(cache)
        self.cache_limit_bytes = int(cache_limit_bytes)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, concurrent.futures.Future[Any]] = collections.OrderedDict()
        self._cache_bytes = 0
        self.compiles = 0
        """Grammars compiled so far (cache misses)."""

    @property
    def words(self) -> int:
        return bitmask_words(self.vocab_size)

    @property
    def ll_tokenizer(self) -> Any:
        """llguidance's token table of the engine's tokenizer (built once, on first use)."""
        with self._lock:
            if self._ll_tokenizer is None:
                ll = _llguidance()
                eos = list(self.eos_token_ids) or None
                self._ll_tokenizer = ll.LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos
                )
            return self._ll_tokenizer

    def _compile(self, text: str) -> Any:
        matcher = _llguidance().LLMatcher(self.ll_tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def submit(self, text: str) -> concurrent.futures.Future[Any]:
        """The compiled matcher of ``text`` (a template: callers work on ``deep_copy()``s of it), as a future."""
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None and not (hit.done() and hit.exception() is not None):
                self._cache.move_to_end(text)
                return hit
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.threads, thread_name_prefix="grammar"
                )
            self.compiles += 1
            future = self._pool.submit(self._compile, text)
            if self.cache_enabled:
                if hit is not None:
                    self._cache_bytes -= len(text.encode())
                    del self._cache[text]
                self._cache[text] = future
                self._cache_bytes += len(text.encode())
                while (
                    self.cache_limit_bytes > 0 and self._cache_bytes > self.cache_limit_bytes and self._cache
                ):
                    old, _ = self._cache.popitem(last=False)
                    self._cache_bytes -= len(old.encode())
            return future

    @property
    def cache_size(self) -> int:
        """Grammars in the cache."""
        return len(self._cache)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
            self._cache.clear()
            self._cache_bytes = 0


class RequestGrammar:
    """One sequence's constraint: its own matcher (or none: a ``thinking_token_budget`` alone) and its phase.

    Args:
      matcher: this sequence's llguidance matcher (a ``deep_copy`` of the compiled template), or ``None``.
      words: ``W``, the int32 words of a mask row.
      trigger: the id sequence after which the grammar applies (``None``: from the first token).
      bound: an id that forces the rest of the trigger once produced.
      budget: free tokens after which the trigger is forced (``thinking_token_budget``).
      eos: the EOS ids; once the grammar has accepted one, every token is allowed (an ``ignore_eos`` request
        runs on free).
    """

    def __init__(
        self,
        matcher: Any,
        words: int,
        *,
        trigger: Sequence[int] | None = None,
        bound: int | None = None,
        budget: int | None = None,
        eos: Sequence[int] = (),
    ) -> None:
        self.matcher = matcher
        self.eos = frozenset(int(t) for t in eos)
        self.eos_done = False
        """The grammar has accepted EOS: the mask is all ones from here on."""
        self.words = int(words)
        self.trigger = None if trigger is None else tuple(trigger)
        self.bound = bound
        self.budget = budget
        self.active = self.trigger is None
        """The grammar constrains the tokens (the trigger, if any, has been produced)."""
        self.forcing = False
        self.free_tokens = 0
        self._tail: list[int] = []

    @classmethod
    def for_params(
        cls,
        so: StructuredOutputsParams | None,
        template: Any,
        words: int,
        *,
        budget: int | None = None,
        think_end: Sequence[int] | None = None,
        eos: Sequence[int] = (),
    ) -> RequestGrammar:
        """A fresh constraint for a request: ``template`` is the compiled matcher (copied here), ``think_end``
        the trigger a ``thinking_token_budget`` forces when ``so`` names none."""
        trigger = so.trigger_token_ids if so is not None else None
        if trigger is None and budget is not None:
            trigger = think_end
        return cls(
            None if template is None else template.deep_copy(),
            words,
            trigger=trigger,
            bound=None if so is None else so.bound_token_id,
            budget=budget,
            eos=eos,
        )

    # ------------------------------------------------------------------------------------------ state

    def _progress(self) -> int:
        """How much of the trigger the free output ends with (0 ... len(trigger) - 1)."""
        assert self.trigger is not None
        for k in range(min(len(self.trigger) - 1, len(self._tail)), 0, -1):
            if tuple(self._tail[-k:]) == self.trigger[:k]:
                return k
        return 0

    def _must_force(self) -> bool:
        return self.forcing or (self.budget is not None and self.free_tokens >= self.budget)

    def _grammar_live(self) -> bool:
        return self.active and self.matcher is not None and not self.eos_done

    def constrains(self) -> bool:
        """Whether the next mask is not all ones."""
        if not self.active:
            return self._must_force()
        return self._grammar_live()

    def may_constrain(self, tokens: int) -> bool:
        """Whether the mask may not be all ones once up to ``tokens`` more tokens, still in flight, are accepted
        (a mask filled after dispatch): the grammar is live, or those tokens could start forcing the trigger
        (the budget, the bound id) or complete it."""
        if self.active:
            return self._grammar_live()
        assert self.trigger is not None
        if self._must_force() or self.bound is not None:
            return True
        if self.budget is not None and self.free_tokens + tokens >= self.budget:
            return True
        return len(self.trigger) - self._progress() <= tokens

    def fill(self, out: np.ndarray) -> bool:
        """Write the next sample's mask into ``out`` (int32 ``[W]``, C-contiguous); True when it constrains."""
        if out.dtype != np.int32 or out.shape != (self.words,) or not out.flags["C_CONTIGUOUS"]:
            raise ValueError(f"RequestGrammar.fill: out must be a contiguous int32 [{self.words}] row")
        if not self.active:
            if not self._must_force():
                out[:] = -1
                return False
            assert self.trigger is not None
            token = self.trigger[self._progress()]
            out[:] = 0
            out[token // 32] = np.int32(np.uint32(1 << (token % 32)).view(np.int32))
            return True
        if not self._grammar_live():
            out[:] = -1
            return False
        # A complete grammar (stopped matcher) allows only EOS until one is produced.
        self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        return True

    def accept(self, token: int) -> str | None:
        """Advance on an accepted output token; returns the problem when the constraint rejects it."""
        token = int(token)
        if not self.active:
            assert self.trigger is not None
            if self._must_force() and token != self.trigger[self._progress()]:
                return f"token {token} is not the forced trigger token {self.trigger[self._progress()]}"
            self.free_tokens += 1
            self._tail.append(token)
            del self._tail[: max(0, len(self._tail) - len(self.trigger))]
            if tuple(self._tail) == self.trigger:
                self.active, self.forcing, self._tail = True, False, []
            elif self.bound is not None and token == self.bound:
                self.forcing = True
            return None
        if not self._grammar_live():
            return None
        if self.matcher.is_stopped():
            if token in self.eos:
                self.eos_done = True
                return None
            return f"the grammar is complete and allows only EOS, got token {token}"
        if not self.matcher.consume_token(token):
            return f"the grammar rejects token {token}: {self.matcher.get_error() or 'not allowed here'}"
        self.eos_done = token in self.eos
        return None

    def _snapshot(self) -> tuple[Any, ...]:
        return self.active, self.forcing, self.free_tokens, list(self._tail), self.eos_done

    def _restore(self, snap: tuple[Any, ...]) -> None:
        self.active, self.forcing, self.free_tokens, tail, self.eos_done = snap
        self._tail = list(tail)

    def draft_masks(self, drafts: Sequence[int], out: np.ndarray) -> int:
        """Masks of the verification rows of ``k`` draft tokens; the constraint's state is unchanged afterwards.

        ``out`` is int32 ``[k + 1, W]``: row ``j`` is the mask of the token that follows the first ``j`` drafts
        (what verification row ``j`` samples under). The drafts are walked while the constraint accepts them;
        when draft ``m`` is rejected, rows past ``m`` are left all zeros (the verification cannot reach them).
        Returns ``m``, the drafts the constraint accepts (``k`` when all are). The matcher is rolled back by the
        tokens it consumed, so only :meth:`accept` on the verified tokens advances it for real.
        """
        k = len(drafts)
        if out.shape != (k + 1, self.words) or out.dtype != np.int32:
            raise ValueError(f"RequestGrammar.draft_masks: out must be int32 [{k + 1}, {self.words}]")
        snap = self._snapshot()
        consumed = 0
        accepted = k
        out[:] = 0
        try:
            for j, token in enumerate(drafts):
                constrained = self.fill(out[j])
                allowed = not constrained or (int(out[j, token // 32]) >> (token % 32)) & 1
                # What llguidance records (and rolls back): tokens consumed before it stopped.
                grammar_step = self._grammar_live() and not self.matcher.is_stopped()
                if not allowed or self.accept(token) is not None:
                    accepted = j
                    break
                consumed += int(grammar_step)
            else:
                self.fill(out[k])
        finally:
            if consumed and self.matcher is not None and not self.matcher.rollback(consumed):
                raise RuntimeError(
                    f"llguidance could not roll back {consumed} tokens: {self.matcher.get_error()}"
                )
            self._restore(snap)
        return accepted

    def fork(self) -> RequestGrammar:
        """An independent copy in the same state (an ``n > 1`` sample)."""
        twin = RequestGrammar(
            None if self.matcher is None else self.matcher.deep_copy(),
            self.words,
            trigger=self.trigger,
            bound=self.bound,
            budget=self.budget,
            eos=self.eos,
        )
        twin._restore(self._snapshot())
        return twin


_EXECUTOR: Any = None


def fill_masks(rows: Sequence[tuple[int, RequestGrammar]], bitmask: np.ndarray) -> None:
    """Fill ``bitmask[r]`` for every ``(r, grammar)``: the rows whose grammar constrains are computed by
    llguidance's parallel executor (native threads, without the GIL), the others (free, forced, done) here."""
    global _EXECUTOR
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or not bitmask.flags["C_CONTIGUOUS"]:
        raise ValueError("fill_masks: bitmask must be a contiguous int32 [rows, W] array")
    live = []
    for r, g in rows:
        if g._grammar_live():
            live.append((g.matcher, int(r)))
        else:
            g.fill(bitmask[r])
    if len(live) == 1:
        matcher, r = live[0]
        matcher.unsafe_compute_mask_ptr(bitmask[r].ctypes.data, bitmask[r].nbytes)
    elif live:
        if _EXECUTOR is None:
            _EXECUTOR = _llguidance().LLExecutor()
        import llguidance.numpy as lnp

        lnp.fill_next_token_bitmask_par(_EXECUTOR, live, bitmask)
