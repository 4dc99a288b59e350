"""The fused sampler's draft and verify modes (``pallas_kernels/sampler.py``, interpret mode) against the
references of ops ``"draft_sample"`` and ``"verify"`` (``deepinfer_jax/sampling/speculative.py``).

The rows are test_pk_sampler.py's 64 (greedy and sampled rows, top-k / top-p / min_p, penalties from a count
state, bias, allowed ids, banned and stop ids, grammar bitmasks, an all-masked and a NaN row, ties, a
teacher-forced row) over a 40-id vocabulary in tiles of 16. Each verify row checks a draft drawn from a draft
distribution near its own, its argmax, a banned id (outside the target's support), or none; every fourth row
is a sequence's fresh row.

What must hold, and why these tolerances:

* **tokens, acceptances and error flags bitwise** the reference's. They are decided by exact integer work
  (argmax, fixed-point draw) and by comparisons of floats that the kernel computes with the reference's
  expressions; only the softmax denominators and the residual mass are summed tile by tile instead of over the
  whole row. A token could differ only if a random target fell within those few ulps of a weight boundary,
  which none of these 64 rows (nor the test's other seeds) does;
* **acceptance probabilities** ``1 - Σ residual`` within 1e-6 (a sum of at most 40 terms in [0, 1] in another
  order: a few float32 ulps of 1);
* **draft log-probabilities**: the same -inf pattern, greedy point masses exact, the rest within 4 float32 ulps
  relative (``scaled - log z`` with ``z`` summed tile by tile; measured: 1 ulp).

The random words are checked to matter (other seeds accept and draw otherwise, and the kernel follows), a row
alone equals the row in the batch, :func:`~deepinfer_jax.sampling.speculative.verify` through the registry
(``ops.backend = pallas_gpu``, interpreted) returns the reference's :class:`VerifyOutput`, and both modes export
for CUDA as one Triton call each and for Ascend as one named call each.
"""

from __future__ import annotations

import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from test_pk_sampler import BANNED, TILES, V, _case

from deepinfer_jax import ops
from deepinfer_jax.sampling import SamplingTensors
from deepinfer_jax.sampling import speculative as sp
from pallas_kernels.sampler import draft_tokens, verify_tokens

AP_TOL = 1e-6
LP_ULPS = 4


@functools.cache
def _drafts():
    """Each row's draft distribution, draft, and whether it is a fresh row."""
    logits, _, _ = _case()
    rows = logits.shape[0]
    rng = np.random.default_rng(252)
    near = np.nan_to_num(np.asarray(logits)) + rng.standard_normal((rows, V)).astype(np.float32)
    draft_lp = np.asarray(jax.nn.log_softmax(jnp.asarray(near)))
    p = np.exp(draft_lp.astype(np.float64))
    drafts = np.array([rng.choice(V, p=p[i] / p[i].sum()) for i in range(rows)], np.int32)
    drafts[1::5] = np.argmax(np.nan_to_num(np.asarray(logits), nan=-np.inf), axis=1)[1::5]
    drafts[2::9] = BANNED[0]  # outside every target's support
    drafts[::7] = -1  # no draft
    fresh = np.arange(rows) % 4 == 3
    return jnp.asarray(drafts), jnp.asarray(draft_lp), jnp.asarray(fresh)


_verify_ref = jax.jit(
    functools.partial(
        sp._verify_reference, num_logprobs=0, logprobs_mode="raw_logprobs", batch_invariant=False
    ),
    static_argnames=("force_top_k",),
)
_verify_kernel = jax.jit(
    functools.partial(verify_tokens, tiles=TILES, interpret=True), static_argnames=("force_top_k",)
)
_draft_ref = jax.jit(
    functools.partial(sp._draft_reference, batch_invariant=False), static_argnames=("force_top_k",)
)
_draft_kernel = jax.jit(
    functools.partial(draft_tokens, tiles=TILES, interpret=True), static_argnames=("force_top_k",)
)


def _check_verify(logits, st, counts, force_top_k=0):
    drafts, draft_lp, fresh = _drafts()
    want = _verify_ref(logits, st, counts, drafts, draft_lp, fresh, force_top_k=force_top_k)
    token, accept, accept_prob, ok = _verify_kernel(
        logits, st, counts, drafts, draft_lp, fresh, force_top_k=force_top_k
    )
    np.testing.assert_array_equal(np.asarray(ok), np.asarray(want.ok))
    np.testing.assert_array_equal(np.asarray(token), np.asarray(want.token))
    np.testing.assert_array_equal(np.asarray(accept), np.asarray(want.accept))
    np.testing.assert_allclose(np.asarray(accept_prob), np.asarray(want.accept_prob), rtol=0, atol=AP_TOL)
    return np.asarray(token), np.asarray(accept), np.asarray(accept_prob)


def test_verify_rows_are_the_references():
    logits, st, counts = _case()
    drafts, _, fresh = (np.asarray(a) for a in _drafts())
    token, accept, accept_prob = _check_verify(logits, st, counts)
    verify_rows = ~fresh & (drafts >= 0)
    # both outcomes occur often enough that a wrong rule shows
    assert accept[verify_rows].sum() >= 10 and (~accept[verify_rows]).sum() >= 10
    assert not accept[fresh].any() and not accept[drafts < 0].any()
    assert not accept[drafts == BANNED[0]].any()  # outside the support: always rejected
    assert (accept_prob[fresh] == 0).all()
    assert token[10] == -1 and token[11] == -1  # the error rows
    rejected = verify_rows & ~accept & (np.asarray(st.golden) < 0)
    assert (token[rejected] != drafts[rejected]).any()  # residual draws avoid the draft's mass


def test_verify_with_force_top_k_and_without_penalties():
    logits, st, counts = _case()
    _check_verify(logits, st, counts, force_top_k=3)
    _check_verify(logits, st, None)


def test_verify_random_numbers_decide():
    """Other seeds accept and draw otherwise on sampled rows, and the kernel follows the reference there: a
    kernel using any other acceptance or residual word than the reference's fails."""
    logits, st, counts = _case()
    token, accept, _ = _check_verify(logits, st, counts)
    sampled = np.asarray(st.temperature) > 0
    flips = draws = 0
    for word in (5, 9, 17):
        moved_token, moved_accept, _ = _check_verify(
            logits, st._replace(seed=np.asarray(st.seed) ^ np.uint32(word)), counts
        )
        flips += (moved_accept != accept)[sampled].sum()
        draws += (moved_token != token)[sampled].sum()
        assert (moved_token == token)[~sampled].all()
    assert flips >= 3 and draws >= 15


def test_a_verify_row_alone_equals_the_row_in_the_batch():
    logits, st, counts = _case()
    drafts, draft_lp, fresh = _drafts()
    token = np.asarray(_verify_kernel(logits, st, counts, drafts, draft_lp, fresh)[0])
    for i in range(0, 64, 5):
        one = jax.tree.map(lambda a, i=i: a[i : i + 1], st)
        s = slice(i, i + 1)
        alone = _verify_kernel(logits[s], one, counts[s], drafts[s], draft_lp[s], fresh[s])[0]
        assert int(alone[0]) == token[i], i


@pytest.mark.parametrize("force_top_k", [0, 3])
def test_draft_tokens_and_distributions_are_the_references(force_top_k):
    logits, st, _ = _case()
    want_tok, want_lp = (np.asarray(a) for a in _draft_ref(logits, st, force_top_k=force_top_k))
    got_tok, got_lp = (np.asarray(a) for a in _draft_kernel(logits, st, force_top_k=force_top_k))
    np.testing.assert_array_equal(got_tok, want_tok)
    assert got_tok[10] == -1 and got_tok[11] == -1  # the error rows draft nothing
    np.testing.assert_array_equal(np.isneginf(got_lp), np.isneginf(want_lp))
    finite = np.isfinite(want_lp)
    greedy = np.asarray(st.temperature) <= 0
    np.testing.assert_array_equal(got_lp[greedy], want_lp[greedy])  # point masses: 0 and -inf exactly
    ulp = np.spacing(np.abs(want_lp[finite]).astype(np.float32))
    assert (np.abs(got_lp[finite] - want_lp[finite]) <= LP_ULPS * np.maximum(ulp, 2.0**-24)).all()
    assert finite.sum() > 90  # sampled rows keep many ids (force_top_k = 3: at most 3 each)


def _interpreted_selection():
    cfg = types.SimpleNamespace(backend="pallas_gpu", overrides={}, strict=True, interpret=True)
    return ops.resolve_selection(cfg)


def test_verify_and_draft_through_the_registry_return_the_references_outputs():
    """The public functions with ``ops.backend = pallas_gpu`` (interpreted): the prefix rule, the reported values
    (processed log-probabilities, 2 alternatives, the batch-invariant row map) around the kernel's tokens."""
    logits, st, counts = _case()
    seqs, rows = 16, 4
    drafts, draft_lp, _ = _drafts()
    shaped = SamplingTensors(*(jnp.asarray(a).reshape(seqs, rows, *a.shape[1:]) for a in st))
    args = (
        logits.reshape(seqs, rows, V),
        shaped,
        counts.reshape(seqs, rows, V),
        drafts.reshape(seqs, rows)[:, : rows - 1],
        draft_lp.reshape(seqs, rows, V)[:, : rows - 1],
        jnp.asarray(np.arange(seqs) % rows, jnp.int32),
    )
    kw = dict(num_logprobs=2, logprobs_mode="processed_logprobs", batch_invariant=True)
    selection = _interpreted_selection()
    for op in ("verify", "draft_sample"):
        chosen = selection.select(op)
        assert chosen.backend == "pallas_gpu" and not chosen.fell_back, op
    got = jax.jit(ops.bind_selection(functools.partial(sp.verify, **kw), selection))(*args)
    want = jax.jit(functools.partial(sp.verify, **kw))(*args)
    for name, a, b in zip(want._fields, got, want, strict=True):
        if name == "accept_prob":
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=AP_TOL)
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    assert np.asarray(want.num_accepted).sum() >= 3
    got_d = jax.jit(ops.bind_selection(sp.draft_sample, selection))(logits, st)
    np.testing.assert_array_equal(np.asarray(got_d[0]), np.asarray(_draft_ref(logits, st, force_top_k=0)[0]))


def _abstract_rows(rows: int, vocab: int):
    s = jax.ShapeDtypeStruct
    fields = SamplingTensors.build([], [], [], vocab, num_rows=rows, mask_width=8)
    return SamplingTensors(*(s(a.shape, a.dtype) for a in fields))._replace(
        token_bitmask=s((rows, (vocab + 31) // 32), jnp.int32)
    )


def test_draft_and_verify_export_for_cuda_as_one_triton_call_each(triton_calls):
    s = jax.ShapeDtypeStruct
    seqs, k, vocab = 16, 4, 129280  # 16 sequences verifying 4 drafts each, DeepSeek's vocabulary
    rows = seqs * (k + 1)
    st = _abstract_rows(rows, vocab)
    logits, counts = s((rows, vocab), jnp.float32), s((rows, vocab), jnp.int32)
    flat = (s((rows,), jnp.int32), s((rows, vocab), jnp.float32), s((rows,), jnp.bool_))
    assert (
        triton_calls(lambda x, t, c, d, lp, f: verify_tokens(x, t, c, d, lp, f), logits, st, counts, *flat)
        == 1
    )
    assert triton_calls(lambda x, t: draft_tokens(x, t, force_top_k=8), logits, st) == 1
    cfg = types.SimpleNamespace(backend="pallas_gpu", overrides={}, strict=True, interpret=False)
    selection = ops.resolve_selection(cfg, platform="gpu")
    shaped = SamplingTensors(*(s((seqs, k + 1, *a.shape[1:]), a.dtype) for a in st))
    op = ops.bind_selection(functools.partial(sp.verify, num_logprobs=1), selection)
    verify_args = (
        s((seqs, k + 1, vocab), jnp.float32),
        shaped,
        s((seqs, k + 1, vocab), jnp.int32),
        s((seqs, k), jnp.int32),
        s((seqs, k, vocab), jnp.float32),
        s((seqs,), jnp.int32),
    )
    assert triton_calls(op, *verify_args) == 1
    assert triton_calls(ops.bind_selection(sp.draft_sample, selection), logits, st) == 1


@pytest.mark.parametrize("op", ["verify", "draft_sample"])
def test_draft_and_verify_export_for_ascend_as_one_named_call(op):
    from custom_calls.ascend.lowerings import target_name

    s = jax.ShapeDtypeStruct
    seqs, k = 2, 3
    st = _abstract_rows(seqs * (k + 1), V)
    selection = ops.resolve_selection(None, backend="ascend", strict=True, platform="ascend")
    if op == "verify":
        fn = functools.partial(sp.verify, num_logprobs=2, force_top_k=3)
        shaped = SamplingTensors(*(s((seqs, k + 1, *a.shape[1:]), a.dtype) for a in st))
        args = (
            s((seqs, k + 1, V), jnp.float32),
            shaped,
            s((seqs, k + 1, V), jnp.int32),
            s((seqs, k), jnp.int32),
            s((seqs, k, V), jnp.float32),
            s((seqs,), jnp.int32),
        )
    else:
        fn = functools.partial(sp.draft_sample, force_top_k=3)
        args = (s((seqs * (k + 1), V), jnp.float32), st)
    target = target_name(op)
    exported = export.export(
        jax.jit(ops.bind_selection(fn, selection)),
        platforms=["ascend"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(target)],
    )(*args)
    text = exported.mlir_module()
    assert re.findall(r"stablehlo\.custom_call @([\w.$]+)\(", text) == [target]
    assert "force_top_k = 3" in text[text.index(f"@{target}(") :].split("\n")[0]
