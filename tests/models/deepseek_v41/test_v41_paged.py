"""The DeepSeek-V4.1 cached path (``models/deepseek_v4/paged_v41.py``) against its own full-prefix forward.

The reference for every check is ``forward_logits`` over the whole sequence (``Model.logits``), which keeps every
key of the prefix in memory; the paged path keeps window rings, C2 pending projections and Engram history in
state slots and compressed / indexer keys in pages, and must give each row's last-token logits of the full
forward at that position, whatever the chunking, the batch, the slots and the blocks.

Tolerance: both paths are float32 with the same functions; they differ only in the order of float32 sums
(matmuls of other shapes, a softmax over ``window ∪ selected`` instead of a masked softmax over the whole
prefix). Measured differences are about 1e-6 of the largest logit; the checks allow 2e-5 (20x), far below what
one wrong key, a wrong position or a different top-k selection produces (1e-2 and more).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deepinfer_jax
from deepinfer_jax.cache.plan import plan_memory
from deepinfer_jax.cache.ragged import RaggedMeta, make_meta
from deepinfer_jax.cache.record_bytes import record_bytes
from deepinfer_jax.checkpoint.model_loading import Model
from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.models.builtin import hf_config
from deepinfer_jax.models.deepseek_v4 import family_v41, v41_model
from deepinfer_jax.models.deepseek_v4.paged_v41 import V41PagedModel
from deepinfer_jax.models.registry import get_family
from deepinfer_jax.numerics.activation import CastPolicy

RTOL = 2e-5  # of the largest |logit| of the reference row (module docstring)
BLOCK = 16
T_BUCKET, S_BUCKET = 64, 4  # one compiled shape for every direct test
NUM_BLOCKS, NUM_SLOTS, MAX_BLOCKS = 96, 10, 40
SHORT, LONG = 64, 640  # the two reference shapes [*, 64] and [2, 640]


# ------------------------------------------------------------------------------------------- driver


@dataclass
class Seq:
    """One sequence of the test driver: its tokens, state slot, blocks and how many tokens are cached."""

    tokens: np.ndarray
    ref: np.ndarray  # full-forward logits [len, V]
    slot: int
    blocks: list[int]
    cached: int = 0


class Driver:
    """Runs :meth:`V41PagedModel.forward` over hand-built ragged steps padded to one bucket."""

    def __init__(self, model: Model, paged: V41PagedModel) -> None:
        self.model, self.paged = model, paged
        self.cache = paged.init_cache(NUM_BLOCKS, NUM_SLOTS)
        self.fwd = jax.jit(
            lambda params, cache, ids, meta: paged.forward(params, cache, ids, meta, tile=None),
            donate_argnums=1,
        )

    def step(self, rows: list[tuple[Seq, int]], *, pad_first: bool = False) -> list[np.ndarray]:
        """Run ``n`` new tokens of each ``(seq, n)``; returns each row's last-token logits.

        ``pad_first`` puts a padding row (slot -1, no tokens) before the real rows.
        """
        ids, pos, owner, starts, slots, ctx = [], [], [], [0], [], []
        tables = np.full((S_BUCKET, MAX_BLOCKS), -1, np.int32)
        order: list[tuple[Seq, int] | None] = ([None] if pad_first else []) + list(rows)
        for r, item in enumerate(order):
            if item is None:
                starts.append(len(ids))
                slots.append(-1)
                ctx.append(0)
                continue
            seq, n = item
            for k in range(n):
                ids.append(int(seq.tokens[seq.cached + k]))
                pos.append(seq.cached + k)
                owner.append(r)
            starts.append(len(ids))
            slots.append(seq.slot)
            ctx.append(seq.cached + n)
            tables[r, : len(seq.blocks)] = seq.blocks
        n_tok, n_row = len(ids), len(order)
        assert n_tok <= T_BUCKET and n_row <= S_BUCKET
        pad_t, pad_s = T_BUCKET - n_tok, S_BUCKET - n_row
        meta = make_meta(
            jnp.asarray(owner + [S_BUCKET] * pad_t, jnp.int32),
            jnp.asarray(pos + [0] * pad_t, jnp.int32),
            jnp.asarray(starts + [n_tok] * pad_s, jnp.int32),
            jnp.asarray(ctx + [0] * pad_s, jnp.int32),
            jnp.asarray(slots + [-1] * pad_s, jnp.int32),
            jnp.asarray(tables),
        )
        token_ids = jnp.asarray(ids + [0] * pad_t, jnp.int32)
        logits, self.cache = self.fwd(self.model.params, self.cache, token_ids, meta)
        logits = np.asarray(logits)
        out = []
        for r, item in enumerate(order):
            if item is not None:
                item[0].cached += item[1]
                out.append(logits[r])
        return out

    def check(self, rows: list[tuple[Seq, int]], **kw) -> None:
        for (seq, n), got in zip(rows, self.step(rows, **kw), strict=True):
            want = seq.ref[seq.cached - 1]
            err = np.max(np.abs(got - want)) / np.max(np.abs(want))
            assert err < RTOL, (
                f"position {seq.cached - 1} (slot {seq.slot}, chunk {n}): relative error {err:.2e}"
            )


def reference_logits(model: Model, seqs: list[np.ndarray], width: int) -> list[np.ndarray]:
    """Full-forward logits of each sequence, right-padded to ``width`` (causal: padding changes nothing)."""
    ids = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    logits = model.logits(ids)
    return [logits[i, : len(s)] for i, s in enumerate(seqs)]


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def model():
    return deepinfer_jax.load_model("tiny-v41", "float32")


@pytest.fixture(scope="module")
def driver(model):
    return Driver(
        model, V41PagedModel.create(model, block_size=BLOCK, dtype="float32", cache_dtype="float32")
    )


SHORT_LENGTHS = (60, 50, 41, 39, 23, 22, 21, 7)  # the short prompts of spec §15.4 (33, 17, 16, 15, 1) + 6


@pytest.fixture(scope="module")
def pool(model):
    """Random sequences with their full-forward logits: short ones (<= 64) and the long §15.4 ones."""
    rng = np.random.default_rng(7)
    short = [rng.integers(3, 512, n) for n in SHORT_LENGTHS]
    long = [rng.integers(3, 512, n) for n in (206, 606)]  # prompts of 200 and 600 plus 6 decode tokens
    return {
        "short": list(zip(short, reference_logits(model, short, SHORT), strict=True)),
        "long": list(zip(long, reference_logits(model, long, LONG), strict=True)),
    }


# ------------------------------------------------------------------------------------- construction


def test_layout_counts_only_owning_layers(model):
    """Bytes of tiny-v41 by hand: KV sources 1 (ratio 2), 3 and 5 (ratio 1) own compressed pages, index-K
    sources 1, 3, 5 own indexer pages; every one of the 7 layers owns a window ring of W = 16."""
    paged = V41PagedModel.create(model, block_size=BLOCK, dtype="float32", cache_dtype="float32")
    lay = paged.layout()
    entries = BLOCK // 2 + BLOCK + BLOCK  # compressed entries of one block over the owning layers
    assert lay.bytes_per_block == entries * 128 * 4 + entries * 128 * 4
    window, pending, engram = 7 * 16 * 128 * 4, 2 * 2 * 128 * 4, 2 * 4
    assert lay.bytes_per_slot == window + pending + engram
    text = "\n".join(lay.lines)
    assert "7 layers" in text and "[1, 3, 5]" in text and "C2 pending state" in text and "Engram" in text

    # The allocated cache is exactly what the layout promises.
    cache = paged.init_cache(5, 3)
    leaves = jax.tree.leaves(cache)
    paged_bytes = sum(x.nbytes for x in leaves if x.shape[0] == 5)
    slot_bytes = sum(x.nbytes for x in leaves if x.shape[0] == 3)
    assert paged_bytes == 5 * lay.bytes_per_block and slot_bytes == 3 * lay.bytes_per_slot


def test_production_layout_uses_the_record_formats(model):
    """``cache_dtype="quantized"`` stores encoded records: sizes from ``cache.record_bytes`` (MXFP8 window,
    FP4 + E4M3/16 compressed, MXFP4 indexer at head_dim 128 / index_head_dim 128)."""
    paged = V41PagedModel.create(model, block_size=BLOCK, dtype="float32", cache_dtype="quantized")
    rec = record_bytes(model.config)
    assert rec == {"window": 128 + 4, "compressed": 64 + 8, "indexer": 64 + 4}
    lay = paged.layout()
    entries = BLOCK // 2 + BLOCK + BLOCK
    assert lay.bytes_per_block == entries * (rec["compressed"] + rec["indexer"])
    assert lay.bytes_per_slot == 7 * 16 * rec["window"] + 2 * 2 * 128 * 4 + 2 * 4
    cache = paged.init_cache(4, 2)
    assert sum(x.nbytes for x in jax.tree.leaves(cache) if x.shape[0] == 4) == 4 * lay.bytes_per_block
    plan = plan_memory(lay, 10 * lay.bytes_per_block + 2 * lay.bytes_per_slot, num_slots=2)
    assert (
        plan.spec.num_blocks == 10
        and "records (window MXFP8 (e4m3 + ue8m0 scales per 32) 132 B" in plan.describe()
    )


def test_bad_arguments_are_refused(model):
    with pytest.raises(ValueError, match=r"block_size = 15: compress_ratios\[1\] = 2 must divide"):
        V41PagedModel.create(model, block_size=15, dtype="float32", cache_dtype="float32")
    with pytest.raises(TypeError, match="block_size: expected an int"):
        V41PagedModel.create(model, block_size="16", dtype="float32", cache_dtype="float32")
    with pytest.raises(ValueError, match="cache_dtype: 'fp8'"):
        V41PagedModel.create(model, block_size=16, dtype="float32", cache_dtype="fp8")
    with pytest.raises(ValueError, match="assembled in 'float32'"):
        V41PagedModel.create(model, block_size=16, dtype="bfloat16", cache_dtype="quantized")


# ------------------------------------------------------------------------------- equality with full


def test_mixed_ragged_steps_equal_the_full_forward(driver, pool):
    """Prefill from 0 beside decode rows, chunks cut at the window / page boundary (16), the C2 pair boundary
    and inside them, padding rows and tokens, scattered slots and blocks, and a slot and blocks reused by a
    later sequence without clearing."""
    (a_tok, a_ref), (b_tok, b_ref), (c_tok, c_ref) = pool["short"][:3]
    a = Seq(a_tok, a_ref, slot=7, blocks=[31, 4, 77, 12])
    b = Seq(b_tok, b_ref, slot=2, blocks=[9, 60, 3, 18])
    driver.check([(a, 16)])  # exactly one window and one page
    # b's odd chunk leaves a C2 pair open in its slot; a opens one at position 16.
    driver.check([(b, 7), (a, 1)], pad_first=True)
    driver.check([(a, 1), (b, 1)])  # both close their pair from the slot's pending state
    driver.check([(b, 25), (a, 14)])  # b crosses two pages inside the chunk; a ends one (positions 18 .. 31)
    driver.check([(a, 3), (b, 1)])
    driver.check([(b, 16), (a, 1)])  # b ends at 50 tokens
    driver.check([(a, 20)], pad_first=True)  # a: positions 36 .. 55
    for _ in range(4):
        driver.check([(a, 1)])  # a decodes to its end (60 tokens)
    # c reuses a's slot and blocks (in another order) from position 0: nothing may leak from a.
    c = Seq(c_tok, c_ref, slot=a.slot, blocks=[12, 77, 31])
    driver.check([(c, 9)])
    driver.check([(c, 32)])


def test_prompt_lengths_of_spec_15_4(driver, pool):
    """Prompts of 1, 15, 16, 17, 33, 200 and 600 tokens (C1 visible keys >> index_topk = 16 and > Bc·bs = 64),
    prefilled in chunks beside each other, then decoded one token and then 5 tokens at once (a
    verification-sized step)."""
    short = {len(t): (t, r) for t, r in pool["short"]}
    seqs = []
    slot = 1
    next_block = 1
    for prompt, (tokens, ref) in zip(
        (1, 15, 16, 17, 33, 200, 600), [short[n + 6] for n in (1, 15, 16, 17, 33)] + pool["long"], strict=True
    ):
        nb = -(-len(tokens) // BLOCK)
        seqs.append((Seq(tokens, ref, slot=slot, blocks=list(range(next_block, next_block + nb))), prompt))
        slot, next_block = slot + 1, next_block + nb
    assert next_block <= NUM_BLOCKS and slot <= NUM_SLOTS
    # Prefill: up to 4 rows a step, the budget shared out; a long prompt is cut wherever the budget ends.
    pending = list(seqs)
    while pending:
        rows, budget = [], T_BUCKET
        for seq, prompt in pending[:S_BUCKET]:
            n = min(prompt - seq.cached, max(budget // 2, 1) if len(rows) < 3 else budget)
            if n > 0 and budget > 0:
                rows.append((seq, n))
                budget -= n
        driver.check(rows)
        pending = [(s, p) for s, p in pending if s.cached < p]
    # Decode: one token, then 5 at once (a 1 + B verification-sized step with B = 4).
    for seq, _ in seqs:
        driver.check([(seq, 1)])
        driver.check([(seq, 5)])
    assert all(seq.cached == len(seq.tokens) for seq, _ in seqs)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_chunkings_equal_the_full_forward(driver, pool, data):
    """Property: any chunking of two or three sequences, interleaved in any order with any slots and blocks,
    gives every row the full forward's logits (slots and blocks are reused across examples uncleared)."""
    picks = data.draw(st.lists(st.integers(0, len(SHORT_LENGTHS) - 1), min_size=2, max_size=3, unique=True))
    slots = data.draw(st.permutations(list(range(1, NUM_SLOTS))))
    blocks = data.draw(st.permutations(list(range(1, NUM_BLOCKS))))
    seqs = []
    for i, k in enumerate(picks):
        tokens, ref = pool["short"][k]
        nb = -(-len(tokens) // BLOCK)
        seqs.append(Seq(tokens, ref, slot=slots[i], blocks=list(blocks[4 * i : 4 * i + nb])))
    while any(s.cached < len(s.tokens) for s in seqs):
        live = [s for s in seqs if s.cached < len(s.tokens)]
        order = data.draw(st.permutations(live))
        rows, budget = [], T_BUCKET
        for s in order:
            n = data.draw(st.integers(1, min(len(s.tokens) - s.cached, budget, 24)))
            rows.append((s, n))
            budget -= n
            if budget == 0:
                break
        driver.check(rows)


# ------------------------------------------------------------------------------------- a §15.3 variant


@pytest.fixture(scope="module")
def dense_model():
    """A cut of ``tiny-dense-compressed`` (§15.3: ``index_topk = 0``, no candidate blocks) with the non-shifted
    HC schedule: layer 1 (ratio 2) and layer 2 (ratio 1) own their compressed keys, layer 3 reads layer 2's;
    every compressed layer attends to all its visible entries (the online-softmax page walk).

    Its statics switch the cache round trips of spec §12.4 on (MXFP8 window keys, FP4 compressed keys) with
    float32 arithmetic otherwise, so that the production record formats are checked against the model too.
    Returns the model, those statics and sequences with their full-forward logits.
    """
    hf = copy.deepcopy(hf_config("tiny-v41"))
    hf["text_config"].update(
        num_hidden_layers=4,
        num_nextn_predict_layers=0,
        compress_ratios=[0, 2, 1, 1],
        kv_source_layer_ids=[1, 2],
        index_source_layer_ids=[1, 2],
        index_k_source_layer_ids=[1, 2],
        index_topk=0,
        candidate_source_layer_id=None,
        candidate_topk_blocks=None,
        candidate_block_size=None,
        dspark_target_layer_ids=None,
        engram_layer_ids=[0],
        engram_num_embeddings=[4062],
        engram_compressed_vocab_size=512,  # no tokenizer: the identity map
        hc_shifted=False,
    )
    cfg = ModelConfig.from_hf(hf)
    family = get_family("deepseek_v41")
    model = Model(cfg, family.init_params(cfg, 3, "float32"), family, "float32")
    base = family_v41.static_for(cfg, "float32")
    casts = CastPolicy(window_keys="mxfp8", compressed_keys="fp4_e4m3", indexer="mxfp4")
    static = dataclasses.replace(
        base, casts=casts, attention=tuple(dataclasses.replace(a, casts=casts) for a in base.attention)
    )
    rng = np.random.default_rng(1)
    tokens = [rng.integers(3, 512, n) for n in (57, 38)]
    ids = np.zeros((len(tokens), SHORT), np.int32)
    for i, t in enumerate(tokens):
        ids[i, : len(t)] = t
    ref = np.asarray(
        jax.jit(v41_model.forward_logits, static_argnames="static")(model.params, ids, static=static)
    )
    return model, static, [(t, ref[i, : len(t)]) for i, t in enumerate(tokens)]


def test_dense_compressed_nonshifted_variant_with_production_records(dense_model):
    """``cache_dtype="quantized"`` stores encoded records; what every step reads back (the writing step included)
    is exactly the round trip the model applies, so the paged path equals the full forward with those round
    trips switched on."""
    model, static, seqs = dense_model
    paged = V41PagedModel(
        static=static,
        block_size=BLOCK,
        dtype="float32",
        cache_dtype="quantized",
        head_dim=128,
        index_head_dim=128,
        use_fp4=True,
    )
    assert paged.index_k_sources == () and paged.kv_sources == (1, 2)
    drv = Driver(model, paged)
    a = Seq(*seqs[0], slot=3, blocks=[8, 2, 40, 5])
    b = Seq(*seqs[1], slot=5, blocks=[11, 1, 30])
    drv.check([(a, 21), (b, 5)])
    drv.check([(b, 16), (a, 1)], pad_first=True)
    drv.check([(a, 30), (b, 17)])
    while a.cached < len(a.tokens):
        drv.check([(a, 1)])
    window, pages = drv.cache.window[0], drv.cache.kv[0]
    assert window.dtype == jnp.uint8 and window.shape[-1] == 128 + 4  # MXFP8: 128 codes, 4 UE8M0 scales
    assert pages.dtype == jnp.uint8 and pages.shape[1:] == (
        BLOCK // 2,
        64 + 8,
    )  # FP4: 64 B codes, 8 E4M3 scales


def test_temporary_memory_does_not_gather_the_context(model):
    """Compiled (never run): 64 decode rows at 8192 positions of tiny-v41. Reading every visible compressed
    entry with its head dimension would take 64 tokens x 8192 C1 entries x 128 x 4 B = 256 MiB per layer of
    temporaries; scoring the indexer keys page by page and gathering only the top-k keeps XLA's temporary
    memory at the per-token working set: a few ``[64, 8192]`` score rows and masks (2 MiB each in float32),
    the window keys, one page, the MoE and projections (about 20 MiB measured over the 7 layers)."""
    paged = V41PagedModel.create(model, block_size=BLOCK, dtype="float32", cache_dtype="float32")
    rows, columns = 64, 512
    cache = jax.eval_shape(lambda: paged.init_cache(rows * columns + 1, rows + 1))

    def i32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    meta = RaggedMeta(
        i32(rows),
        i32(rows),
        i32(rows + 1),
        i32(rows),
        i32(rows),
        i32(rows, columns),
        jax.ShapeDtypeStruct((rows,), jnp.bool_),
        i32(rows),
        i32(rows),
        i32(rows),
    )
    forward = jax.jit(lambda p, c, ids, m: paged.forward(p, c, ids, m, tile=None), donate_argnums=1)
    analysis = forward.lower(model.params, cache, i32(rows), meta).compile().memory_analysis()
    assert analysis.temp_size_in_bytes < 40 * 2**20, analysis.temp_size_in_bytes
