"""The fused sampler kernel (``pallas_kernels/sampler.py``, interpret mode) against op ``"sample"``'s reference.

Every row's token (and error flag) must be **bitwise** the reference's: the rows mix greedy and sampled rows,
each with its own seed and position, top-k = 1, a tiny top-p, top-p, top-k with top-p, min_p, penalties from a
count state, ``logit_bias``, ``allowed_token_ids`` (all but one id banned), banned and stop ids, a grammar
bitmask, an all-masked row and a NaN row (error rows), ties (greedy: lowest id; top-k cutting through equal
probabilities: ascending ids) and teacher-forced rows, in a 40-id vocabulary over tiles of 16 (the last tile
partial), plus 41 rows of random settings, half of them with logits on a 0.5 grid (many tied probabilities). The random numbers are checked to matter (other seeds draw other
tokens, which the kernel then follows too), rows are checked alone against the batch, and the kernel must lower
for CUDA to one Triton call. The op through the registry (``ops.backend = pallas_gpu`` with ``ops.interpret``)
returns the reference's whole :class:`SampleOutput`, and its ``ascend`` implementation exports as one named call.
"""

from __future__ import annotations

import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from deepinfer_jax import ops, sampling
from deepinfer_jax.engine.params import SamplingParams
from deepinfer_jax.sampling import PROMPT_FLAG, SamplingTensors
from pallas_kernels.sampler import SamplerTiles, sample_tokens

V = 40
TILES = SamplerTiles(block_v=16)  # 3 tiles, the last one partial
EOS, BANNED = 7, (2, 11)


def _rows() -> tuple[list[SamplingParams], np.ndarray]:
    """The hand-made rows and their logits, then 48 rows of random settings."""
    rng = np.random.default_rng(250)
    logits = (rng.standard_normal((64, V)) * 2.5).astype(np.float32)
    p = SamplingParams
    rows = [
        p(temperature=1.0),
        p(temperature=0.0),
        p(temperature=1.0, top_k=1),
        p(temperature=1.0, top_p=1e-6),
        p(temperature=0.8, top_p=0.6),
        p(temperature=1.3, top_k=5, top_p=0.8),
        p(temperature=0.7, min_p=0.3),
        p(temperature=1.0, repetition_penalty=1.6, presence_penalty=0.7, frequency_penalty=0.4),
        p(temperature=1.0, allowed_token_ids=[17]),  # every other id banned
        p(temperature=1.0, logit_bias={3: 4.0, 30: -100.0, 31: 2.5}),
        p(temperature=1.0),  # NaN logits: error row
        p(temperature=1.0),  # grammar bitmask allows nothing: error row
        p(temperature=1.0, top_k=3),  # grammar: even ids only
        p(temperature=1.0, top_k=3),  # 4 tied maxima: top-k cuts through the tie by ascending id
        p(temperature=0.0),  # tied maxima: the lowest id
        p(temperature=1.0, min_tokens=3, stop_token_ids=[12, 13]),  # EOS and stops masked
        p(temperature=2.0, golden_token_ids=[9]),  # teacher forcing
        p(temperature=1e-3),  # nearly greedy
        p(temperature=1.0, top_k=1),  # top-k = 1 through a 4-way tie: the lowest id
        *[p(temperature=3.0, min_p=0.6)] * 3,  # flat rows that min_p prunes hard
        p(
            temperature=1.0, top_p=0.7, allowed_token_ids=list(range(1, V, 2))
        ),  # 20 allowed ids: 2 list chunks
    ]
    logits[10, 5] = np.nan
    logits[13, [4, 9, 22, 35]] = logits[18, [4, 9, 22, 35]] = 6.0
    logits[14, [8, 20, 33]] = 9.0
    logits[32:] = np.round(logits[32:] * 2) / 2  # many equal probabilities: top-k/top-p cut through ties
    for _ in range(64 - len(rows)):
        rows.append(
            p(
                temperature=float(rng.choice([0.0, 0.5, 1.0, 2.0])),
                top_k=int(rng.choice([-1, 1, 3, 10])),
                top_p=float(rng.choice([1.0, 0.9, 0.5, 0.05])),
                min_p=float(rng.choice([0.0, 0.0, 0.1])),
                repetition_penalty=float(rng.choice([1.0, 1.2, 0.8])),
                presence_penalty=float(rng.choice([0.0, 0.5])),
                frequency_penalty=float(rng.choice([0.0, -0.3])),
            )
        )
    return rows, logits


@functools.cache
def _case():
    rows, logits = _rows()
    rng = np.random.default_rng(251)
    counts = rng.integers(0, 3, (len(rows), V)).astype(np.int32)
    counts |= np.where(rng.random((len(rows), V)) < 0.2, PROMPT_FLAG, 0).astype(np.int32)
    bitmask = np.full((len(rows), (V + 31) // 32), -1, np.int32)
    bitmask[11] = 0
    bitmask[12] = np.int32(0x55555555)  # even ids
    st = SamplingTensors.build(
        rows,
        seeds=[1000 + 7919 * i for i in range(len(rows))],
        positions=[3 * i + 1 for i in range(len(rows))],
        vocab_size=V,
        output_lens=[0] * len(rows),
        eos_token_ids=[EOS],
        banned_token_ids=BANNED,
        token_bitmask=bitmask,
    )
    return jnp.asarray(logits), st, jnp.asarray(counts)


_reference = jax.jit(
    functools.partial(sampling.sample, backend="reference"),
    static_argnames=("num_logprobs", "batch_invariant", "force_top_k", "logprobs_mode", "sum_smaller"),
)
_kernel = jax.jit(
    functools.partial(sample_tokens, tiles=TILES, interpret=True), static_argnames=("force_top_k",)
)


def _check(logits, st, counts, force_top_k=0):
    want = _reference(logits, st, counts, force_top_k=force_top_k)
    tokens, ok = _kernel(logits, st, counts, force_top_k=force_top_k)
    np.testing.assert_array_equal(np.asarray(ok), np.asarray(want.ok))
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want.tokens))
    return np.asarray(tokens)


def test_tokens_are_the_references():
    logits, st, counts = _case()
    tokens = _check(logits, st, counts)
    ok = np.asarray(_kernel(logits, st, counts)[1])
    assert not ok[10] and not ok[11] and ok[np.r_[0:10, 12:64]].all()
    assert tokens[8] == 17 and tokens[12] % 2 == 0 and tokens[14] == 8 and tokens[16] == 9 and tokens[18] == 4
    assert tokens[22] % 2 == 1
    assert tokens[13] in (4, 9, 22) and tokens[15] not in (EOS, 12, 13, *BANNED)


def test_force_top_k_and_no_penalties():
    logits, st, counts = _case()
    _check(logits, st, counts, force_top_k=3)
    _check(logits, st, None)


def test_the_random_numbers_decide():
    """Other seeds (or positions) draw other tokens somewhere, and the kernel follows the reference there too: a
    kernel drawing with any other random word than the reference's fails :func:`test_tokens_are_the_references`."""
    logits, st, counts = _case()
    tokens = _check(logits, st, counts)
    moved = _check(logits, st._replace(seed=np.asarray(st.seed) ^ np.uint32(1)), counts)
    later = _check(logits, st._replace(position=np.asarray(st.position) + 1), counts)
    sampled = np.asarray(st.temperature) > 0
    assert (moved != tokens)[sampled].sum() >= 5 and (later != tokens)[sampled].sum() >= 5
    assert (moved == tokens)[~sampled].all()  # greedy rows use no random number


def test_a_row_alone_equals_the_row_in_the_batch():
    logits, st, counts = _case()
    tokens = np.asarray(_kernel(logits, st, counts)[0])
    for i in range(0, 64, 3):
        one = jax.tree.map(lambda a, i=i: a[i : i + 1], st)
        alone = _kernel(logits[i : i + 1], one, counts[i : i + 1])[0]
        assert int(alone[0]) == tokens[i], i


def _interpreted_selection():
    cfg = types.SimpleNamespace(backend="pallas_gpu", overrides={}, strict=True, interpret=True)
    return ops.resolve_selection(cfg)


def test_the_op_through_the_registry_returns_the_references_output():
    """The batch-invariant row map, processed log-probabilities and ``sum_smaller`` (the reference's
    ``processed_logits`` in jnp around the kernel); the engine's default (vmap, raw log-probabilities) is
    tests/engine/test_engine_kernels.py's."""
    logits, st, counts = _case()
    selection = _interpreted_selection()
    chosen = selection.select("sample")
    assert chosen.backend == "pallas_gpu" and not chosen.fell_back
    kw = dict(num_logprobs=3, batch_invariant=True, logprobs_mode="processed_logprobs", sum_smaller=True)
    got = jax.jit(ops.bind_selection(functools.partial(sampling.sample, **kw), selection))(logits, st, counts)
    want = _reference(logits, st, counts, **kw)
    for name, a, b in zip(want._fields, got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_exports_for_cuda_as_one_triton_call(triton_calls):
    s = jax.ShapeDtypeStruct
    rows, vocab = 64, 129280  # DeepSeek-V3's vocabulary, 64 decode rows
    fields = SamplingTensors.build([], [], [], vocab, num_rows=rows, mask_width=8)
    st = SamplingTensors(*(s(a.shape, a.dtype) for a in fields))
    st = st._replace(
        bias_ids=s((rows, 4), jnp.int32),
        bias_values=s((rows, 4), jnp.float32),
        allowed_ids=s((rows, 2), jnp.int32),
        token_bitmask=s((rows, (vocab + 31) // 32), jnp.int32),
    )
    logits, counts = s((rows, vocab), jnp.float32), s((rows, vocab), jnp.int32)
    assert triton_calls(lambda x, t, c: sample_tokens(x, t, c, force_top_k=50), logits, st, counts) == 1
    cfg = types.SimpleNamespace(backend="pallas_gpu", overrides={}, strict=True, interpret=False)
    selection = ops.resolve_selection(cfg, platform="gpu")
    op = ops.bind_selection(functools.partial(sampling.sample, num_logprobs=5), selection)
    assert triton_calls(op, logits, st, counts) == 1


def test_exports_for_ascend_as_one_named_call():
    from custom_calls.ascend.lowerings import target_name

    s = jax.ShapeDtypeStruct
    fields = SamplingTensors.build([], [], [], V, num_rows=4, mask_width=2)
    st = SamplingTensors(*(s(a.shape, a.dtype) for a in fields))
    selection = ops.resolve_selection(None, backend="ascend", strict=True, platform="ascend")
    op = ops.bind_selection(functools.partial(sampling.sample, num_logprobs=2, force_top_k=3), selection)
    target = target_name("sample")
    exported = export.export(
        jax.jit(op), platforms=["ascend"], disabled_checks=[export.DisabledSafetyCheck.custom_call(target)]
    )(s((4, V), jnp.float32), st, s((4, V), jnp.int32))
    text = exported.mlir_module()
    assert re.findall(r"stablehlo\.custom_call @([\w.$]+)\(", text) == [target]
    config = text[text.index(f"@{target}(") :].split("\n")[0]
    assert "num_logprobs = 2" in config and "force_top_k = 3" in config
    # elsewhere the named call runs the reference, the SamplingTensors fields in their places
    logits, st_, counts = _case()
    got = jax.jit(op)(logits, st_, counts)
    want = _reference(logits, st_, counts, num_logprobs=2, force_top_k=3)
    for name, a, b in zip(want._fields, got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
