"""Per-slot rings under speculative decoding: why V4.1's rings hold ``W + B`` positions (docs/speculative.md).

A speculative step of one row writes the keys of its last token and of its ``k <= B`` drafts at positions
``b .. b + k``; only ``b .. b + a`` are kept (``a`` accepted drafts), the rest are rewritten by later steps
before anything reads them. A ring of ``R`` positions stores position ``q`` at ``q % R``, so a rejected position
``b + j`` lands where position ``b + j - R`` was. The next step starts at ``b' = b + a + 1`` and reads
``b' - W + 1 .. b' - 1`` from the ring, which is safe exactly when ``R >= W + k - 1``.

The test replays random accept/reject schedules through the engine's own ring helpers
(:func:`~deepinfer_jax.cache.ragged.history` / :func:`~deepinfer_jax.cache.ragged.ring_write`): with the rings
the V4.1 paged model builds (``W + B``) every read of a kept token sees the kept keys; with ``W`` (no margin)
a rejected draft overwrites a key that a later step reads. It also checks the sizes the model allocates: window
and draft rings ``W + B``, C2 pending rings ``r + B``, Engram history ``Nmax - 1 + B``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.cache.ragged import history, make_meta, ring_write

W, B = 16, 4


@functools.partial(jax.jit, static_argnames=("n",))
def _step(ring, values, first, *, n):
    """One row's step of ``n`` tokens from position ``first``: what each token reads, and the new ring."""
    meta = make_meta(
        jnp.zeros((n,), jnp.int32),
        first + jnp.arange(n, dtype=jnp.int32),
        jnp.array([0, n], jnp.int32),
        (first + n)[None],
        jnp.zeros((1,), jnp.int32),
        jnp.zeros((1, 1), jnp.int32),
    )
    items, present = history(ring, values, meta, W)
    return items, present, ring_write(ring, values, meta, after=items)


def _replay(ring_len: int, seed: int, k: int = B, steps: int = 40) -> int:
    """Reads of kept tokens that saw a wrong key over a random schedule (0 = every read was right)."""
    rng = np.random.default_rng(seed)
    real = lambda pos: (pos + 1).astype(np.float32)  # noqa: E731 - the key of a kept token at ``pos``
    ring = jnp.zeros((1, ring_len), jnp.float32)
    prompt = int(rng.integers(1, 3 * W))
    _, _, ring = _step(ring, jnp.asarray(real(np.arange(prompt))), jnp.int32(0), n=prompt)
    b, wrong = prompt, 0
    for _ in range(steps):
        accepted = int(rng.integers(0, k + 1))
        pos = b + np.arange(k + 1)
        values = np.where(np.arange(k + 1) <= accepted, real(pos), -7.0).astype(np.float32)
        items, present, ring = _step(ring, jnp.asarray(values), jnp.int32(b), n=k + 1)
        items, present = np.asarray(items), np.asarray(present)
        for j in range(accepted + 1):  # the kept tokens: every position they read holds its kept key
            window = pos[j] - W + 1 + np.arange(W)
            ok = ~present[j] | (items[j] == real(window))
            wrong += int((~ok).sum())
        b += accepted + 1
    return wrong


@pytest.mark.parametrize("seed", range(4))
def test_rings_of_w_plus_b_keep_every_key_a_kept_token_reads(seed):
    assert _replay(W + B, seed) == 0
    assert _replay(W + B - 1, seed) == 0  # the bound is W + k - 1: the model's W + B has one to spare


def test_rings_without_the_margin_lose_keys():
    """The same schedules with a ring of ``W``: a rejected draft overwrote a key a later step reads."""
    assert sum(_replay(W, seed) for seed in range(4)) > 0


def test_v41_paged_model_sizes_its_rings_for_the_drafts():
    from deepinfer_jax.checkpoint.model_loading import load_model
    from deepinfer_jax.models.deepseek_v4.paged_v41 import paged_model

    model = load_model("tiny-v41", "float32")
    plain = paged_model(model, block_size=16, dtype="float32")
    spec = paged_model(model, block_size=16, dtype="float32", draft_tokens=2)
    block = int(model.config.dspark_block_size)
    window = int(model.config.sliding_window)
    assert spec.ring_margin == block and plain.ring_margin == 0
    a = jax.eval_shape(lambda: plain.init_cache(3, 2))
    c = jax.eval_shape(lambda: spec.init_cache(3, 2))
    assert {w.shape[1] for w in a.window} == {window} and {w.shape[1] for w in c.window} == {window + block}
    assert len(c.draft) == model.config.num_nextn_predict_layers and not a.draft
    assert {d.shape[1] for d in c.draft} == {window + block}
    for (pa, _), (pc, _) in zip(a.state, c.state, strict=True):
        assert pc.shape[1] == pa.shape[1] + block
    if a.engram is not None:
        assert c.engram.shape[1] == a.engram.shape[1] + block
    assert spec.layout().bytes_per_slot > plain.layout().bytes_per_slot
    with pytest.raises(ValueError, match=r"num_draft_tokens = 5: .*dspark_block_size = 4"):
        paged_model(model, block_size=16, dtype="float32", draft_tokens=block + 1)
