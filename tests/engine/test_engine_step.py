"""The jitted V3 engine step over a paged cache: greedy equality with full forwards, buckets, compile
counting."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax.engine.buckets import step_buckets
from deepinfer_jax.engine.params import SamplingParams
from deepinfer_jax.engine.plan import DeviceBatch, ScheduledRow, StepPlan, build_plan, choose_bucket
from deepinfer_jax.engine.step import StepExecutor
from deepinfer_jax.models.deepseek_v3 import model as v3_model
from deepinfer_jax.models.deepseek_v3.paged import V3PagedModel
from deepinfer_jax.parallel import make_mesh

BLOCK = 8
MAX_LEN = 48
GREEDY = SamplingParams(temperature=0.0)
ONE_DEVICE = make_mesh(1, 1)
REF_LEN = 48  # reference forwards run on right-padded [B, 48] batches: causal, so padding never changes a row


@pytest.fixture(scope="module")
def model():
    return deepinfer_jax.load_model("tiny-v3")


def _reference_greedy(
    model, prompts: list[list[int]], steps: int
) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy continuation of each prompt by repeated full forwards (no cache): tokens and per-step logits."""
    seqs = [list(p) for p in prompts]
    logits_seen: list[np.ndarray] = []
    for _ in range(steps):
        ids = np.zeros((len(seqs), REF_LEN), np.int32)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = s
        logits = model.logits(ids)
        rows = np.stack([logits[i, len(s) - 1] for i, s in enumerate(seqs)])
        logits_seen.append(rows)
        for i, s in enumerate(seqs):
            s.append(int(np.argmax(rows[i])))
    return [s[len(p) :] for s, p in zip(seqs, prompts)], logits_seen


@dataclass
class _Seq:
    """Minimal host bookkeeping for the test driver (the real scheduler lives in engine/scheduler.py); it has
    what :func:`~deepinfer_jax.engine.plan.build_plan` reads from a scheduled request."""

    slot: int
    block_ids: list[int]
    tokens: list[int]
    prompt_len: int = 0
    cached: int = 0  # tokens whose latents are in the cache
    pending: bool = False  # the last token was sampled on device and not yet given explicitly
    out: list[int] = field(default_factory=list)
    params: SamplingParams = GREEDY
    seed: int = 0

    @property
    def request_id(self) -> str:
        return f"r{self.slot}"

    @property
    def prompt_token_ids(self) -> np.ndarray:
        return np.asarray(self.tokens[: self.prompt_len], np.int32)

    def tokens_of(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.tokens[start:stop], np.int32)


class _Request:
    """A :class:`_Seq` seen as a scheduled request (``tokens`` is a method there)."""

    def __init__(self, seq: _Seq) -> None:
        self.seq = seq
        self.request_id, self.slot, self.block_ids = seq.request_id, seq.slot, seq.block_ids
        self.prompt_token_ids, self.params, self.seed, self.prompt_len = (
            seq.prompt_token_ids,
            seq.params,
            seq.seed,
            seq.prompt_len,
        )

    def tokens(self, start: int, stop: int) -> np.ndarray:
        return self.seq.tokens_of(start, stop)


def _plan(rows: list[tuple[_Seq, int]], bucket: tuple[int, int], vocab: int = 512) -> StepPlan:
    """A one-device plan with ``n`` new tokens of each ``(seq, n)``; decode rows use the pending ``-1`` id."""
    batch = DeviceBatch(
        tuple(
            ScheduledRow(
                _Request(seq),
                seq.cached,
                n,
                seq.cached + n == len(seq.tokens),
                seq.pending and seq.cached == len(seq.tokens) - 1,
                False,
            )
            for seq, n in rows
        )
    )
    return build_plan([batch], buckets=[bucket], max_blocks_per_seq=MAX_LEN // BLOCK, vocab_size=vocab)


def _commit(rows: list[tuple[_Seq, int]], tokens: np.ndarray, plan: StepPlan) -> None:
    for r, (seq, n) in enumerate(rows):
        seq.cached += n
        if plan.inputs.sample[0, r]:
            seq.tokens.append(int(tokens[0, r]))
            seq.out.append(int(tokens[0, r]))
            seq.pending = True


@pytest.fixture(scope="module")
def executor(model):
    num_blocks = 40
    paged = V3PagedModel(model.config, BLOCK, "float32")
    return StepExecutor(
        model.params,
        paged,
        ONE_DEVICE,
        num_blocks=num_blocks,
        num_slots=9,
        max_blocks_per_seq=MAX_LEN // BLOCK,
        return_logits=True,
    )


PROMPTS = [
    [5, 9, 13, 2, 7, 11, 3, 4, 8, 20, 21, 22, 30],
    [100, 3],
    [7, 7, 7, 7, 7, 1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9, 9, 9],
]
NEW = 6


def test_greedy_mixed_chunks_and_decode_equals_full_forward(model, executor):
    """Chunked prefill, whole prompts and decode tokens mixed in steps equal greedy by repeated full forwards.

    Sequence 0 is prefilled in chunks of 5, 5, 3 tokens interleaved with the others' decode steps; sequence 2
    joins late. Logits of every sampled row are compared too: paged float32 attention (absorbed, online
    softmax) vs naive float32 attention differ by rounding only; 2e-4 absolute on logits of magnitude ~1 is
    ~100x that.
    """
    want, want_logits = _reference_greedy(model, PROMPTS, NEW)
    buckets = step_buckets(64, 8)
    free = iter(range(1, 40))
    seqs = [
        _Seq(
            slot=slot,
            block_ids=[next(free) for _ in range(MAX_LEN // BLOCK)],
            tokens=list(p),
            prompt_len=len(p),
        )
        for slot, p in zip((3, 1, 7), PROMPTS)
    ]
    chunks0 = [5, 5, 3]
    got_logits: list[list[np.ndarray]] = [[], [], []]
    steps = 0
    while any(len(s.out) < NEW for s in seqs):
        rows = []
        for i, s in enumerate(seqs):
            if len(s.out) >= NEW or (i == 2 and steps < 2):
                continue
            if s.cached < len(s.tokens) - (1 if s.pending else 0) or not s.pending:
                n = chunks0.pop(0) if i == 0 and chunks0 else len(s.tokens) - s.cached
            else:
                n = 1
            rows.append((s, n))
        plan = _plan(rows, choose_bucket(sum(n for _, n in rows), len(rows), buckets))
        plan.validate(block_size=BLOCK)
        out = executor.run(plan)
        tokens = np.asarray(out.tokens)
        logits = np.asarray(out.logits)[0]
        for r, (s, _) in enumerate(rows):
            if plan.inputs.sample[0, r]:
                got_logits[seqs.index(s)].append(logits[r])
        _commit(rows, tokens, plan)
        steps += 1
    for i, s in enumerate(seqs):
        assert s.out == want[i], f"sequence {i}"
        np.testing.assert_allclose(np.stack(got_logits[i]), np.stack([w[i] for w in want_logits]), atol=2e-4)
    assert executor.compile_count == len(executor.compiled_buckets) <= 2
    # Penalty statistics on device: prompt ids flagged (bit 30), every generated token fed back so far counted
    # (the last sampled token has not been an input yet).
    counts = np.asarray(executor.state.token_counts)[0]
    for s in seqs:
        want_counts = np.zeros(model.config.vocab_size, np.int64)
        want_counts[list(set(s.tokens[: s.prompt_len]))] |= 1 << 30
        np.add.at(want_counts, s.out[:-1], 1)
        np.testing.assert_array_equal(counts[s.slot], want_counts)


def test_steady_state_never_recompiles(executor):
    before = executor.compile_count
    seq = _Seq(slot=5, block_ids=list(range(34, 40)), tokens=[1, 2, 3])
    bucket = (16, 8)
    for _ in range(6):
        n = len(seq.tokens) - seq.cached
        plan = _plan([(seq, n)], bucket)
        _commit([(seq, n)], np.asarray(executor.run(plan).tokens), plan)
    assert executor.compile_count - before <= 1  # at most the bucket itself, once
    assert (16, 8) in executor.compiled_buckets


def test_paged_step_equals_contiguous_forward(model):
    """Decode logits through the step equal the contiguous-cache ``forward`` (absorbed MLA, same math)."""
    prompt = PROMPTS[0]
    cfg = model.config
    fwd = jax.jit(v3_model.forward, static_argnums=1)
    cache = v3_model.init_cache(cfg, 1, MAX_LEN)
    logits, cache = fwd(model.params, cfg, np.array([prompt], np.int32), np.arange(len(prompt))[None], cache)
    ref = [np.asarray(logits[0, -1])]
    token = int(np.argmax(ref[0]))
    num_blocks = 8
    paged = V3PagedModel(cfg, BLOCK, "float32")
    ex = StepExecutor(
        model.params,
        paged,
        ONE_DEVICE,
        num_blocks=num_blocks,
        num_slots=2,
        max_blocks_per_seq=MAX_LEN // BLOCK,
        return_logits=True,
    )
    seq = _Seq(slot=1, block_ids=[7, 3, 5, 1, 2, 4], tokens=list(prompt))
    got = []
    for k in range(4):
        n = len(seq.tokens) - seq.cached
        plan = _plan([(seq, n)], (16, 8))
        out = ex.run(plan)
        got.append(np.asarray(out.logits[0, 0]))
        _commit([(seq, n)], np.asarray(out.tokens), plan)
        if k:
            pos = len(seq.tokens) - 2
            logits, cache = fwd(model.params, cfg, np.array([[token]], np.int32), np.array([[pos]]), cache)
            ref.append(np.asarray(logits[0, -1]))
            token = int(np.argmax(ref[-1]))
    # Both paths are absorbed MLA in float32; only the softmax order differs (blockwise online vs one pass).
    np.testing.assert_allclose(np.stack(got), np.stack(ref), atol=5e-5)
    assert seq.out[:3] == [int(np.argmax(r)) for r in ref[:3]]


def test_step_buckets():
    assert step_buckets(2048, 256)[-1] == (2048, 256)
    assert step_buckets(64, 4) == ((16, 4), (64, 4))
    assert (16, 8) in step_buckets(2048, 256) and (256, 128) in step_buckets(2048, 256)
    assert all(s <= t for t, s in step_buckets(32, 64))
    # Speculative engines: a bucket that s decode rows of 1 + k tokens fill.
    assert step_buckets(256, 16, 2) == (
        (16, 8),
        (16, 16),
        (32, 8),
        (32, 16),
        (64, 8),
        (64, 16),
        (256, 8),
        (256, 16),
    )
    assert step_buckets(64, 4, 4) == step_buckets(64, 4)  # 4 x 4 = 16 is a bucket already
    with pytest.raises(ValueError, match="max_num_seqs"):
        step_buckets(16, 0)


def test_batch_invariant_logits_are_bitwise_independent_of_the_batch(model):
    """``batch_invariant``: a request's logits and tokens are bitwise the same alone and in a batch.

    Alone it runs in bucket 16; in the batch (bucket 64) it is row 1, its tokens at other offsets, while the
    other rows prefill.
    """
    cfg = model.config
    num_blocks = 40
    paged = V3PagedModel(cfg, BLOCK, "float32")
    ex = StepExecutor(
        model.params,
        paged,
        ONE_DEVICE,
        num_blocks=num_blocks,
        num_slots=9,
        max_blocks_per_seq=MAX_LEN // BLOCK,
        return_logits=True,
        batch_invariant=True,
    )
    params = SamplingParams(temperature=0.7, top_k=40, seq_seed=5)

    def run(seqs: list[_Seq], target: _Seq, steps: int, bucket: tuple[int, int]) -> list[np.ndarray]:
        seen = []
        for _ in range(steps):
            rows = [(s, len(s.tokens) - s.cached) for s in seqs]
            plan = _plan(rows, bucket, cfg.vocab_size)
            out = ex.run(plan)
            seen.append(np.asarray(out.logits[0, seqs.index(target)]))
            _commit(rows, np.asarray(out.tokens), plan)
        return seen

    prompt = PROMPTS[0][:9]
    alone = _Seq(
        slot=1, block_ids=[1, 2, 3, 4, 5, 6], tokens=list(prompt), prompt_len=9, params=params, seed=5
    )
    want = run([alone], alone, 3, (16, 8))
    other = _Seq(2, [7, 8, 9, 10, 11, 12], list(range(3, 40)), prompt_len=37, params=params, seed=5)
    again = _Seq(3, [13, 14, 15, 16, 17, 18], list(prompt), prompt_len=9, params=params, seed=5)
    third = _Seq(4, [19, 20, 21, 22, 23, 24], [9, 8], prompt_len=2, params=params, seed=5)
    got = run([other, again, third], again, 3, (64, 8))
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)  # bitwise: no tolerance
    assert again.out == alone.out


def test_bfloat16_mode_with_a_bf16_cache_tracks_float32(model):
    """Production mode (bf16 weights, activations and cache) runs through the step and stays near float32.

    bf16 keeps 8 significant bits: each rounding point is off by up to 2^-9 relative, and three layers of them
    move logits of magnitude ~1 by a few 1e-2 (measured: max 0.03 here). 0.25 absolute catches a wrong
    computation (an error of the order of the logits themselves) with a wide margin over rounding.
    """
    bf16 = deepinfer_jax.load_model("tiny-v3", "bfloat16")
    cfg = bf16.config
    num_blocks = 8
    paged = V3PagedModel(cfg, BLOCK, "bfloat16")
    ex = StepExecutor(
        bf16.params,
        paged,
        ONE_DEVICE,
        num_blocks=num_blocks,
        num_slots=2,
        max_blocks_per_seq=MAX_LEN // BLOCK,
        return_logits=True,
    )
    assert str(ex.cache.dtype) == "bfloat16"
    prompt = PROMPTS[0]
    seq = _Seq(slot=1, block_ids=[2, 4, 6, 1, 3, 5], tokens=list(prompt), prompt_len=len(prompt))
    got = []
    for _ in range(3):
        n = len(seq.tokens) - seq.cached
        plan = _plan([(seq, n)], (16, 8))
        out = ex.run(plan)
        got.append(np.asarray(out.logits[0, 0]))
        _commit([(seq, n)], np.asarray(out.tokens), plan)
    ids = np.zeros((1, REF_LEN), np.int32)
    ids[0, : len(seq.tokens)] = seq.tokens
    ref = model.logits(ids)[0, len(prompt) - 1 : len(prompt) + 2]
    err = np.abs(np.stack(got) - ref).max()
    print(f"bf16 vs float32 max logit error: {err:.4f}")
    assert err < 0.25, err


def test_packed_inputs_unpack_to_the_same_arrays():
    # The executor copies one [D, N] buffer per dtype; the step's static slices must give back every leaf exactly,
    # whatever the mix of shapes (empty widths included) and dtypes.
    from deepinfer_jax.engine.step import pack_inputs, unpack_inputs

    rng = np.random.default_rng(0)
    tree = {
        "a": rng.integers(-5, 5, (2, 3, 4)).astype(np.int32),
        "b": rng.standard_normal((2, 5)).astype(np.float32),
        "c": np.zeros((2, 3, 0), np.int32),
        "d": (rng.integers(0, 2**32, (2, 2, 2), dtype=np.uint64).astype(np.uint32), rng.random((2,)) < 0.5),
        "e": None,
        "f": rng.integers(0, 9, (2, 7)).astype(np.int32),
    }
    packed, layout = pack_inputs(tree)
    assert len(packed) == 4  # int32, float32, uint32, bool
    assert all(p.shape[0] == 2 for p in packed)
    back = jax.jit(lambda p: unpack_inputs(p, layout))(packed)
    flat, ref = jax.tree.leaves(back), jax.tree.leaves(tree)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for got, want in zip(flat, ref, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)
