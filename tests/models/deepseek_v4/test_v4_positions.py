"""Per-row positions in the DeepSeek-V4 forward: rows of one batch at different positions (and with right
padding) behave exactly as if each ran alone.

References: transformers' full-forward logits of the two fixture sequences (``tests/data/v4``), the JAX full forward
of each row, and each row run alone through ``forward_chunk``.

Tolerances: against transformers, the module tolerance of ``test_v4_model.py`` (1e-4: float32 reassociation
between torch and XLA, far below the fixtures' greedy and top-k margins). Between JAX runs of the same rows,
2e-5: the expressions are the same, but a batch of different size or chunking changes how XLA tiles the matmul
and softmax reductions (a few ulps of logits of magnitude ~5 per layer; measured up to 5.3e-6).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_jax.models.deepseek_v4 import compressor as comp
from deepinfer_jax.models.deepseek_v4 import model as v4_model

FIXTURE_ATOL = 1e-4
SAME_CODE_ATOL = 2e-5
CHUNK = 8  # static chunk width of the batched calls; rows use 0..CHUNK of it
PAD = 0  # token id of right padding (any id works: padded positions are ignored)


class Counted:
    """A jitted ``forward_chunk`` that counts its traces: a new trace is what a recompile needs, so a count of
    one over calls with changing ``start``/``lengths`` values shows those values are data, not program."""

    def __init__(self) -> None:
        self.traces = 0

        def traced(*args, **kwargs):
            self.traces += 1
            return v4_model.forward_chunk(*args, **kwargs)

        self.fn = jax.jit(traced, static_argnames=("plan", "numerics"))

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


@pytest.fixture(scope="module")
def batched():
    """The batched ``[2, CHUNK]`` calls of this module share one counted function (one trace in all)."""
    return Counted()


def _run(v4, fn, ids, start, state, lengths=None):
    logits, state = fn(
        v4.params,
        np.asarray(ids, np.int32),
        np.asarray(start, np.int32),
        state,
        plan=v4.plan,
        numerics=v4.numerics,
        lengths=None if lengths is None else np.asarray(lengths, np.int32),
    )
    return np.asarray(logits), state


def _stack(*states):
    """Batch-1 states side by side as one batch (every state leaf has the batch on axis 0)."""
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *states)


def _padded(rows, width):
    out = np.full((len(rows), width), PAD, np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def test_v4_decode_row_beside_prefill_rows_equals_rows_alone(v4, v4_logits, batched):
    """Row 0 decodes positions 45, 46, 47 (one real token, seven padding) while row 1 prefills 8 + 8 + 5 tokens
    from position 0, in one batch, with starts and lengths changing every call and no recompilation."""
    seq_a, seq_b = v4_logits["sequence_a"], v4_logits["sequence_b"]
    _, alone_a = v4.chunk(seq_a[None, :45], 0, v4.fresh_state())
    state = _stack(alone_a, v4.fresh_state())
    row_b_logits = []
    b_pos = 0
    for step, b_len in enumerate((8, 8, 5)):
        pos_a = 45 + step
        ids = _padded([seq_a[pos_a : pos_a + 1], seq_b[b_pos : b_pos + b_len]], CHUNK)
        logits, state = _run(v4, batched, ids, [pos_a, b_pos], state, lengths=[1, b_len])
        want_a, alone_a = v4.chunk(seq_a[None, pos_a : pos_a + 1], pos_a, alone_a)
        np.testing.assert_allclose(logits[0, 0], want_a[0, 0], atol=SAME_CODE_ATOL, rtol=0)
        np.testing.assert_allclose(logits[0, 0], v4_logits["full_logits_a"][pos_a], atol=FIXTURE_ATOL, rtol=0)
        row_b_logits.append(logits[1, :b_len])
        b_pos += b_len
    row_b = np.concatenate(row_b_logits)
    np.testing.assert_allclose(row_b, v4.full(seq_b[None, :b_pos])[0], atol=SAME_CODE_ATOL, rtol=0)
    np.testing.assert_allclose(row_b, v4_logits["full_logits_b"][:b_pos], atol=FIXTURE_ATOL, rtol=0)
    assert batched.traces == 1  # start and lengths are data: three different calls, one program


def test_v4_prompts_ending_inside_and_at_window_edge_share_a_batch(v4, v4_logits, batched):
    """Prompts of 45 (inside the 4- and 16-token windows) and 48 tokens (at their edge) prefilled in one padded
    call, then decoded in lockstep at positions 45.. and 48.. with a start vector: every row's logits are its
    transformers full-forward logits and those of the row decoded alone."""
    prompts = [v4_logits["prompt_a"], v4_logits["prompt_b"]]
    seqs = [v4_logits["sequence_a"], v4_logits["sequence_b"]]
    lens = [len(p) for p in prompts]
    assert lens == [45, 48]
    prefill = jax.jit(v4_model.forward_chunk, static_argnames=("plan", "numerics"))
    state = v4.fresh_state(2)
    logits, state = _run(v4, prefill, _padded(prompts, max(lens)), 0, state, lengths=lens)
    for row, name in enumerate("ab"):
        np.testing.assert_allclose(
            logits[row, : lens[row]], v4_logits[f"full_logits_{name}"][: lens[row]], atol=FIXTURE_ATOL, rtol=0
        )
    decode = Counted()
    steps = min(len(s) - n for s, n in zip(seqs, lens, strict=True))
    got = []
    for k in range(steps):
        pos = [n + k for n in lens]
        ids = [[seqs[0][pos[0]]], [seqs[1][pos[1]]]]
        logits, state = _run(v4, decode, ids, pos, state)
        got.append(logits[:, 0])
    got = np.stack(got, axis=1)  # [2, steps, V]
    assert decode.traces == 1
    for row, name in enumerate("ab"):
        want = v4_logits[f"full_logits_{name}"][lens[row] : lens[row] + steps]
        np.testing.assert_allclose(got[row], want, atol=FIXTURE_ATOL, rtol=0)
        alone, single = [], v4.fresh_state()
        _, single = v4.chunk(prompts[row][None], 0, single)
        for k in range(steps):
            out, single = v4.chunk(seqs[row][None, lens[row] + k : lens[row] + k + 1], lens[row] + k, single)
            alone.append(out[0, 0])
        np.testing.assert_allclose(got[row], np.stack(alone), atol=SAME_CODE_ATOL, rtol=0)


@pytest.fixture(scope="module")
def full_rows(v4, v4_logits):
    """JAX full-forward logits of the two fixture sequences (their first 53 tokens), the hypothesis reference."""
    length = len(v4_logits["sequence_a"])
    seqs = np.stack([v4_logits["sequence_a"], v4_logits["sequence_b"][:length]])
    return seqs, v4.full(seqs)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    chunks=st.tuples(
        st.lists(st.integers(0, CHUNK), min_size=1, max_size=12),
        st.lists(st.integers(0, CHUNK), min_size=1, max_size=12),
    ),
    tail=st.sampled_from([1, CHUNK]),
)
def test_v4_random_per_row_chunkings_equal_full_forward(v4, full_rows, batched, chunks, tail):
    """Each row advances by its own random chunk sizes (its first one is its prefix length; 0 = idle this call),
    then one token (token-by-token) or a full chunk at a time to the end; every real token's logits equal the
    row's full forward."""
    seqs, want = full_rows
    length = seqs.shape[1]
    plans = []
    for sizes in chunks:
        sizes, total = list(sizes), sum(sizes)
        while total < length:
            sizes.append(min(tail, length - total))
            total += sizes[-1]
        plans.append(sizes)
    state = v4.fresh_state(2)
    pos = [0, 0]
    got = [np.zeros_like(want[0]), np.zeros_like(want[1])]
    for step in range(max(len(p) for p in plans)):
        lens = [min(p[step] if step < len(p) else 0, length - pos[r]) for r, p in enumerate(plans)]
        ids = _padded([seqs[r, pos[r] : pos[r] + lens[r]] for r in range(2)], CHUNK)
        logits, state = _run(v4, batched, ids, pos, state, lengths=lens)
        for r in range(2):
            got[r][pos[r] : pos[r] + lens[r]] = logits[r, : lens[r]]
            pos[r] += lens[r]
    assert pos == [length, length]
    for r in range(2):
        np.testing.assert_allclose(got[r], want[r], atol=SAME_CODE_ATOL, rtol=0)
    assert batched.traces == 1


@settings(max_examples=10, deadline=None)
@given(
    overlap=st.booleans(),
    ratio=st.sampled_from([2, 4]),
    cuts=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_v4_compress_chunk_rows_advance_independently(overlap, ratio, cuts, seed):
    """Two compressor rows fed different per-row chunk sizes (0..5 real tokens of a 5-wide padded chunk, so
    rows end inside, at the edge of, or past windows at different positions) hold exactly the state of each row
    fed alone by the scalar-start path (checked against numpy in ``test_v4_primitives.py``). Only elementwise
    and per-row reductions are involved, so the comparison is exact on the emitted entries."""
    rng = np.random.default_rng(seed)
    width, seq = 4, 5
    feats = 2 * width if overlap else width
    total = [sum(c[r] for c in cuts) for r in range(2)]
    kv, gate = rng.normal(size=(2, max(total) + seq, feats)), rng.normal(size=(2, max(total) + seq, feats))
    kwargs = dict(
        ape=jnp.asarray(rng.normal(size=(ratio, feats)), jnp.float32),
        norm_weight=jnp.asarray(1 + 0.1 * rng.normal(size=width), jnp.float32),
        norm_eps=1e-6,
        rope_freqs=jnp.asarray([0.3], jnp.float32),
        rope_dim=2,
    )
    capacity = max(total) // ratio + 1
    chunk = jax.jit(comp.compress_chunk, static_argnames=("norm_eps", "rope_dim"))
    both = comp.init_compressor_state(2, ratio, width, capacity, overlap=overlap)
    alone = [comp.init_compressor_state(1, ratio, width, capacity, overlap=overlap) for _ in range(2)]
    pos = np.zeros(2, np.int32)
    for sizes in cuts:
        lens = np.asarray(sizes, np.int32)
        # Padding columns carry random projections: they must not leak into any row's entries.
        win_kv = np.stack([kv[r, pos[r] : pos[r] + seq] for r in range(2)])
        win_gate = np.stack([gate[r, pos[r] : pos[r] + seq] for r in range(2)])
        both = chunk(
            both,
            jnp.asarray(win_kv, jnp.float32),
            jnp.asarray(win_gate, jnp.float32),
            pos,
            lengths=lens,
            **kwargs,
        )
        for r in range(2):
            if lens[r]:
                alone[r] = chunk(
                    alone[r],
                    jnp.asarray(win_kv[r : r + 1, : lens[r]], jnp.float32),
                    jnp.asarray(win_gate[r : r + 1, : lens[r]], jnp.float32),
                    jnp.int32(pos[r]),
                    **kwargs,
                )
        pos = pos + lens
    for r in range(2):
        np.testing.assert_array_equal(np.asarray(both.entries[r]), np.asarray(alone[r].entries[0]))
        done = pos[r] % ratio  # real tokens of the incomplete window; later slots are stale by contract
        np.testing.assert_array_equal(
            np.asarray(both.tail_kv[r, :done]), np.asarray(alone[r].tail_kv[0, :done])
        )
        np.testing.assert_array_equal(
            np.asarray(both.tail_gate[r, :done]), np.asarray(alone[r].tail_gate[0, :done])
        )
        np.testing.assert_array_equal(np.asarray(both.prev_kv[r]), np.asarray(alone[r].prev_kv[0]))
        np.testing.assert_array_equal(np.asarray(both.prev_gate[r]), np.asarray(alone[r].prev_gate[0]))


def test_v4_per_row_start_and_lengths_are_validated(v4):
    state = v4_model.init_state(v4.plan, 2, 16)
    ids = np.zeros((2, 4), np.int32)
    call = dict(plan=v4.plan, numerics=v4.numerics)
    with pytest.raises(ValueError, match=r"start must be a scalar or a \[2\] vector.*shape \(3,\)"):
        v4_model.forward_chunk(v4.params, ids, np.zeros(3, np.int32), state, **call)
    with pytest.raises(TypeError, match=r"start must be an int.*float32"):
        v4_model.forward_chunk(v4.params, ids, np.zeros(2, np.float32), state, **call)
    with pytest.raises(ValueError, match=r"start = \[0, -1\] must be >= 0"):
        v4_model.forward_chunk(v4.params, ids, np.asarray([0, -1], np.int32), state, **call)
    with pytest.raises(ValueError, match=r"lengths = \[5, 0\] must lie in \[0, 4\]"):
        v4_model.forward_chunk(v4.params, ids, 0, state, lengths=np.asarray([5, 0], np.int32), **call)
    # max_len 16 holds 16 // 4 + 1 = 5 CSA entries; row 1 (start 20, 4 tokens) would reach position 24.
    with pytest.raises(ValueError, match=r"positions up to 24 need 6 compressed entries in layer 1"):
        v4_model.forward_chunk(v4.params, ids, np.asarray([0, 20], np.int32), state, **call)
