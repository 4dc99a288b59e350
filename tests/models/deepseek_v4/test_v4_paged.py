"""DeepSeek-V4's paged ragged forward (``models/deepseek_v4/paged.py``, tiny-v4) against its own full forward.

``forward_logits`` of the model equals the transformers fixtures of ``tests/data/v4`` (tests/models/deepseek_v4),
so every comparison with it here is a comparison with transformers. The tests drive ``V4PagedModel.forward``
with hand-written step schedules (fixed bucket: one compilation); the engine runs it through ``LLM`` in
tests/engine/test_engine_families.py.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_jax.cache.ragged import RaggedMeta, make_meta
from deepinfer_jax.checkpoint.model_loading import load_model
from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.models.deepseek_v4 import model as v4_model
from deepinfer_jax.models.deepseek_v4.paged import V4PagedModel
from deepinfer_jax.numerics.activation import CastPolicy

BLOCK = 16
TOKENS, ROWS, COLUMNS = 32, 4, 4  # the direct tests' bucket: 32 tokens, 4 rows, 64 positions per sequence
NUM_BLOCKS, NUM_SLOTS = 16, 6
REF_BATCH, REF_LEN = 6, 64
# Float32 throughout; the paged path sums the same terms as the full forward in another order (an online
# softmax over window, pages and sinks instead of one softmax over concatenated keys, MoE over a flat batch),
# which moves logits by a few float32 ulps per layer: 1e-6 relative measured, 2e-5 leaves margin and still
# catches any wrong key, entry or position (those move logits by percents).
RTOL = 2e-5


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-v4", "float32")


def _forward(paged):
    """The jitted forward returning every token's logits (``logit_index``, as prompt logprobs use it), so each
    schedule checks all positions of every chunk, not only the rows' last tokens (the engine tests cover the
    default)."""
    every = jnp.arange(TOKENS, dtype=jnp.int32)
    return jax.jit(
        lambda p, c, t, m: paged.forward(p, c, t, m, tile=None, logit_index=every), donate_argnums=1
    )


@pytest.fixture(scope="module")
def trimmed(model):
    """tiny-v4 cut to its first three layers (sliding, CSA r=4, HCA r=16: one of each kind) with their
    parameters, for the tests that compile a program of their own (fewer layers, shorter compiles)."""
    hf = dict(model.config.hf)
    hf.update(
        num_hidden_layers=3, layer_types=hf["layer_types"][:3], mlp_layer_types=hf["mlp_layer_types"][:3]
    )
    return SimpleNamespace(
        config=ModelConfig.from_hf(hf), params={**model.params, "layers": model.params["layers"][:3]}
    )


@pytest.fixture(scope="module")
def paged(model):
    pm = V4PagedModel.create(model, block_size=BLOCK, dtype="float32", cache_dtype="float32")
    return pm, _forward(pm)


class Sequences:
    """Host bookkeeping of a direct-test schedule: token ids, slots, block tables and progress."""

    def __init__(self, full, ids: dict[str, np.ndarray], slots: dict[str, int], tables: dict[str, list[int]]):
        """``full(ids [B, L]) -> logits [B, L, V]`` is the reference forward (the model's ``logits``)."""
        self.ids, self.slots, self.tables = ids, slots, tables
        self.done = dict.fromkeys(ids, 0)
        padded = np.zeros((REF_BATCH, REF_LEN), np.int32)
        self.ref_row = {}
        for i, (name, seq) in enumerate(ids.items()):
            padded[i, : len(seq)] = seq
            self.ref_row[name] = i
        self.reference = np.asarray(
            full(padded)
        )  # causal: padding after a sequence changes none of its logits

    def meta(self, rows: list[tuple[str, int]]):
        """Plan arrays of one step feeding ``n`` tokens of each named sequence (rows in the given order)."""
        toks, pos, seq, starts = [], [], [], [0]
        for r, (name, n) in enumerate(rows):
            a = self.done[name]
            assert 0 < n <= len(self.ids[name]) - a, (name, n)
            toks += list(self.ids[name][a : a + n])
            pos += list(range(a, a + n))
            seq += [r] * n
            starts.append(starts[-1] + n)
        assert len(toks) <= TOKENS and len(rows) <= ROWS
        pad = TOKENS - len(toks)
        toks += [0] * pad
        pos += [0] * pad
        seq += [ROWS] * pad
        starts += [starts[-1]] * (ROWS - len(rows))
        context = [self.done[name] + n for name, n in rows] + [0] * (ROWS - len(rows))
        slots = [self.slots[name] for name, _ in rows] + [-1] * (ROWS - len(rows))
        bt = np.full((ROWS, COLUMNS), -1, np.int32)
        for r, (name, _) in enumerate(rows):
            table = self.tables[name]
            bt[r, : len(table)] = table
        meta = make_meta(*(jnp.asarray(a, jnp.int32) for a in (seq, pos, starts, context, slots, bt)))
        return jnp.asarray(toks, jnp.int32), meta

    def step(self, forward, params, cache, rows: list[tuple[str, int]]):
        """Run one step and check every token's logits against the full forward at its position."""
        toks, meta = self.meta(rows)
        logits, cache = forward(params, cache, toks, meta)
        logits = np.asarray(logits)
        t = 0
        for name, n in rows:
            for p in range(self.done[name], self.done[name] + n):
                want = self.reference[self.ref_row[name], p]
                err = np.max(np.abs(logits[t] - want)) / np.max(np.abs(want))
                assert err < RTOL, f"{name} at position {p}: relative error {err:.2e}"
                t += 1
            self.done[name] += n
        return cache


def _ids(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(2, 512, n).astype(np.int32)


def test_mixed_ragged_steps_equal_the_full_forward(model, paged):
    """Prefill from 0 beside decodes, chunks cut at and inside window (16), ratio (4, 16) and page boundaries,
    padding rows and tokens, shuffled slots and blocks, then a sequence that reuses a finished one's slot and
    blocks without clearing them. Long enough (up to 60 positions: 15 CSA entries) for the indexer's top-8 to
    drop entries."""
    pm, forward = paged
    seqs = Sequences(
        model.logits,
        {"a": _ids(1, 50), "b": _ids(2, 60), "c": _ids(3, 45), "d": _ids(4, 9)},
        {"a": 3, "b": 1, "c": 3, "d": 5},
        {"a": [5, 2, 9, 11], "b": [7, 3, 14, 1], "c": [2, 9, 5], "d": [4]},
    )
    cache = pm.init_cache(NUM_BLOCKS, NUM_SLOTS)
    schedule = [
        [("a", 16), ("b", 3)],  # a: one full window / page; b inside the first CSA window
        [("b", 13), ("a", 1)],  # b reaches 16 (page and HCA boundary); a decodes at 16
        [("a", 15), ("b", 1), ("d", 9)],  # a to 32 (second page), b decodes at 16, d a whole short prompt
        [("b", 31)],  # b: 17 .. 47, three windows in one chunk, crossing a page
        [("a", 1), ("b", 1)],  # two decodes (a at 32: first position of a page)
        [("a", 17), ("b", 11)],  # a to 50, b to 60: visible CSA entries exceed index_topk
        [("c", 5)],  # c in a's slot and blocks: stale ring and pages, all masked by position
        [("c", 27)],
        [("c", 1)],
        [("c", 12)],
    ]
    for rows in schedule:
        cache = seqs.step(forward, model.params, cache, rows)
    assert seqs.done == {"a": 50, "b": 60, "c": 45, "d": 9}


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_random_chunkings_equal_the_full_forward(model, paged, data):
    pm, forward = paged
    lengths = [data.draw(st.integers(1, 60), label=f"length {i}") for i in range(3)]
    slots = data.draw(st.permutations(range(NUM_SLOTS)), label="slots")[:3]
    blocks = data.draw(st.permutations(range(1, NUM_BLOCKS)), label="blocks")
    names = ["x", "y", "z"]
    tables, used = {}, 0
    for name, n in zip(names, lengths, strict=True):
        need = -(-n // BLOCK)
        tables[name] = list(blocks[used : used + need])
        used += need
    seqs = Sequences(
        model.logits,
        {name: _ids(7 * n + i, n) for i, (name, n) in enumerate(zip(names, lengths, strict=True))},
        dict(zip(names, slots, strict=True)),
        tables,
    )
    # Stale garbage in the whole cache: every read must be masked by position, never by zeros.
    cache = jax.tree.map(
        lambda a: jnp.asarray(np.random.default_rng(a.size).standard_normal(a.shape), a.dtype),
        pm.init_cache(NUM_BLOCKS, NUM_SLOTS),
    )
    while any(seqs.done[n] < len(seqs.ids[n]) for n in names):
        rows, budget = [], TOKENS
        order = data.draw(st.permutations(names), label="row order")
        for name in order:
            left = len(seqs.ids[name]) - seqs.done[name]
            if left and budget:
                n = data.draw(st.integers(1, min(left, budget, 20)), label=f"chunk {name}")
                rows.append((name, n))
                budget -= n
        cache = seqs.step(forward, model.params, cache, rows)


def test_block_size_and_cache_dtype_are_checked(model):
    with pytest.raises(
        ValueError, match=r"block_size = 8: layer 2 \(heavily_compressed_attention\).*ratio 16"
    ):
        V4PagedModel.create(model, block_size=8, dtype="float32", cache_dtype="float32")
    with pytest.raises(ValueError, match="cache_dtype: 'fp8'"):
        V4PagedModel.create(model, block_size=16, dtype="float32", cache_dtype="fp8")


# Hand-computed bytes of tiny-v4 (head_dim 128, index_head_dim 128, window 16; layers: sliding, CSA r=4, HCA
# r=16, CSA, HCA) at block 16. Per block: CSA 4 entries x (compressed + indexer key), HCA 1 entry. Per slot: 5
# windows of 16 keys; compression state float32 [ring, 2 (kv, gate), features]: CSA 8 x 2 x 256 (plus the
# same for its indexer), HCA 16 x 2 x 128.
_STATE = 2 * (2 * 8 * 2 * 256 * 4) + 2 * (16 * 2 * 128 * 4)
LAYOUTS = {
    "float32": (2 * 4 * (512 + 512) + 2 * 512, 5 * 16 * 512 + _STATE),
    # Unquantised bfloat16 keys: half the float32 bytes.
    "bfloat16": (2 * 4 * (256 + 256) + 2 * 256, 5 * 16 * 256 + _STATE),
    # MXFP8 window 128 + 4 B, FP4 compressed 64 + 8 B (E4M3 scale per 16), MXFP4 indexer 64 + 4 B.
    "quantized": (2 * 4 * (72 + 68) + 2 * 72, 5 * 16 * 132 + _STATE),
}


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "quantized"])
def test_layout_bytes_are_the_real_cache(model, cache_dtype):
    pm = V4PagedModel.create(model, block_size=BLOCK, dtype="float32", cache_dtype=cache_dtype)
    layout = pm.layout()
    assert (layout.bytes_per_block, layout.bytes_per_slot) == LAYOUTS[cache_dtype]
    cache = jax.eval_shape(lambda: pm.init_cache(7, 3))
    total = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache))
    assert total == 7 * layout.bytes_per_block + 3 * layout.bytes_per_slot
    assert len(layout.lines) == 3 and all("B per slot" in line for line in layout.lines)


def test_production_records_equal_the_models_cache_round_trips(trimmed):
    """``cache_dtype="quantized"`` stores MXFP8 / FP4 / MXFP4 records. In float32 arithmetic with the model's
    §12.4 key round trips switched on (and nothing else), the contiguous model computes exactly what reading
    those records back gives, so the float32 tolerance applies."""
    pm = V4PagedModel.create(trimmed, block_size=BLOCK, dtype="float32", cache_dtype="quantized")
    casts = CastPolicy(window_keys="mxfp8", compressed_keys="fp4_e4m3", indexer="mxfp4")
    plan = dataclasses.replace(
        pm.plan, casts=casts, attention=tuple(dataclasses.replace(s, casts=casts) for s in pm.plan.attention)
    )
    pm = dataclasses.replace(pm, plan=plan)
    full = jax.jit(v4_model.forward_logits, static_argnames=("plan", "numerics"))
    seqs = Sequences(
        lambda ids: full(trimmed.params, jnp.asarray(ids), plan=plan, numerics=pm.numerics),
        {"a": _ids(5, 44), "b": _ids(6, 30)},
        {"a": 2, "b": 4},
        {"a": [3, 8, 6], "b": [1, 12]},
    )
    forward = _forward(pm)
    cache = pm.init_cache(NUM_BLOCKS, NUM_SLOTS)
    for rows in ([("a", 20), ("b", 7)], [("a", 1), ("b", 23)], [("a", 23)]):
        cache = seqs.step(forward, trimmed.params, cache, rows)
    assert cache.kv[0].dtype == jnp.uint8 and cache.kv[0].shape[-1] == 72  # layer 1's FP4 records


def test_temporary_memory_does_not_gather_the_context(trimmed):
    """Compiled (never run): 64 decode rows at 8192 positions. A dense read of every visible entry with its
    head dimension would take 64 tokens x 2048 CSA entries x 128 x 4 B = 64 MiB (HCA: 16 MiB) of temporaries;
    walking pages and gathering only the top-k keeps XLA's temporary memory at the per-token working set
    (window keys, one page, 64 x 2048 indexer scores = 512 KiB, the MoE and projections: ~7 MiB measured,
    nearly all of it independent of the context). One layer of each kind (``trimmed``)."""
    pm = V4PagedModel.create(trimmed, block_size=BLOCK, dtype="float32", cache_dtype="float32")
    params = trimmed.params
    rows, columns = 64, 512
    cache = jax.eval_shape(lambda: pm.init_cache(rows * columns + 1, rows + 1))

    def i32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    t, s = rows, rows
    meta = RaggedMeta(
        i32(t),
        i32(t),
        i32(s + 1),
        i32(s),
        i32(s),
        i32(s, columns),
        jax.ShapeDtypeStruct((t,), jnp.bool_),
        i32(t),
        i32(s),
        i32(t),
    )
    forward = jax.jit(lambda p, c, ids, m: pm.forward(p, c, ids, m, tile=None), donate_argnums=1)
    analysis = forward.lower(params, cache, i32(t), meta).compile().memory_analysis()
    assert analysis.temp_size_in_bytes < 12 * 2**20, analysis.temp_size_in_bytes
