"""Structured outputs without the engine: parameter validation, the masks against llguidance's own, the sampler's
on-device unpacking, the thinking / trigger phases and the speculative draft-mask hook (real llguidance on the
tiny models' synthetic tokenizer)."""

from __future__ import annotations

import functools
import json

import jax.numpy as jnp
import llguidance
import llguidance.numpy as lnp
import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax import sampling
from deepinfer_jax.engine.grammar import (
    GrammarCompiler,
    RequestGrammar,
    bitmask_words,
    fill_masks,
    unpack_bitmask,
)
from deepinfer_jax.engine.params import SamplingParams
from deepinfer_jax.engine.structured import StructuredOutputsParams as SO
from deepinfer_jax.sampling import SamplingTensors
from deepinfer_jax.text.synthetic import build_synthetic_tokenizer
from deepinfer_jax.text.tokenizer import Tokenizer

V = 512
EOS = 1
THINK_END = 6  # the synthetic tokenizer's </think>

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["x", "yz"]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


@functools.cache
def _tok() -> Tokenizer:
    return Tokenizer.from_str(build_synthetic_tokenizer(V))


@functools.cache
def _compiler() -> GrammarCompiler:
    return GrammarCompiler(_tok(), V, (EOS,), threads=2, timeout_s=20)


def _grammar(so: SO | None, **kw) -> RequestGrammar:
    template = None if so is None else _compiler().submit(so.grammar_text()).result(timeout=20)
    return RequestGrammar.for_params(so, template, bitmask_words(V), eos=(EOS,), **kw)


def _llg_mask(so: SO, prefix: list[int]) -> np.ndarray:
    """llguidance's own mask after ``prefix``, from a matcher built here (not through the engine's classes)."""
    lt = llguidance.LLTokenizer(_tok().backend.to_str(), n_vocab=V, eos_token=EOS)
    m = llguidance.LLMatcher(lt, so.grammar_text(), log_level=0)
    assert m.consume_tokens(prefix), m.get_error()
    bm = lnp.allocate_token_bitmask(1, V)
    lnp.fill_next_token_bitmask(m, bm, 0)
    return unpack_bitmask(bm[0], V)


def _row(g: RequestGrammar) -> np.ndarray:
    out = np.zeros(bitmask_words(V), np.int32)
    g.fill(out)
    return unpack_bitmask(out, V)


# ------------------------------------------------------------------------------------------ parameters


def test_exported_and_one_constraint_per_request():
    assert deepinfer_jax.StructuredOutputsParams is SO
    with pytest.raises(
        ValueError, match="exactly one of json, regex, choice, grammar, json_object; got none"
    ):
        SO()
    with pytest.raises(ValueError, match=r"got \['json', 'regex'\]"):
        SO(json={}, regex="a")
    so = SO(json=json.dumps(SCHEMA))
    assert so.kind == "json" and so == SO(json=SCHEMA)  # dict or text: the same canonical schema
    assert SO(json_object=True).kind == "json_object"
    with pytest.raises(ValueError, match="so_args and structured_outputs both given"):
        SamplingParams(so_args={"schema_type": "regex", "schema": "a"}, structured_outputs=so)


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        ({"regex": "(a"}, ["StructuredOutputsParams.regex", "'(a'", "unclosed group"]),
        ({"json": {"type": "objectx"}}, ["StructuredOutputsParams.json", "objectx"]),
        ({"json": "{bad"}, ["StructuredOutputsParams.json", "not valid JSON"]),
        ({"json": {"$ref": "#/$defs/x"}}, ["StructuredOutputsParams.json", "/$defs/x"]),
        ({"grammar": "start: foo"}, ["StructuredOutputsParams.grammar", "foo"]),
        ({"choice": []}, ["StructuredOutputsParams.choice", "empty"]),
        ({"choice": ["a", ""]}, ["choice[1]", "empty"]),
        ({"regex": "a", "trigger_token_ids": []}, ["trigger_token_ids", "empty"]),
        ({"regex": "a", "bound_token_id": 3}, ["bound_token_id", "trigger_token_ids"]),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(kwargs, fragments):
    with pytest.raises(ValueError) as err:
        SO(**kwargs)
    for f in fragments:
        assert f in str(err.value), (f, str(err.value))


@pytest.mark.parametrize(
    "so_args, fragments",
    [
        ({"schema_type": "xml", "schema": "a"}, ["schema_type", "'xml'"]),
        ({"schema_type": "regex", "schema": "(a"}, ["so_args", "regex", "unclosed group"]),
        ({"schema_type": "json", "schema": "a", "serialized": b""}, ["serialized"]),
        ({"schema_type": "json", "schema": "a", "bound_token_ids": [1]}, ["bound_token_ids"]),
        ({"schema_type": "ebnf", "schema": ""}, ["so_args['schema']"]),
        ({"json": {}}, ["unknown key", "json"]),
        ({"schema_type": "regex", "schema": "a", "bound_token_id": 2}, ["bound_token_id", "trigger"]),
    ],
)
def test_so_args_refused(so_args, fragments):
    with pytest.raises(ValueError) as err:
        SamplingParams(so_args=so_args)
    for f in fragments:
        assert f in str(err.value), (f, str(err.value))


def test_so_args_map_onto_structured_outputs():
    p = SamplingParams(
        so_args={"schema_type": "json", "schema": json.dumps(SCHEMA), "trigger_token_ids": [6]}
    )
    assert p.so_args is None and p.structured_outputs.kind == "json"
    assert p.structured_outputs.trigger_token_ids == (6,) and p.structured_outputs.disable_any_whitespace
    ebnf = SamplingParams(so_args={"schema_type": "ebnf", "schema": 'start: "a" | "b"'})
    assert ebnf.structured_outputs.grammar == 'start: "a" | "b"'
    assert p.replace(max_tokens=3).structured_outputs == p.structured_outputs


# ------------------------------------------------------------------------------------------ masks


@pytest.mark.parametrize(
    "so, text",
    [
        (SO(json=SCHEMA, disable_any_whitespace=True), '{"a":42,"b":"yz"}'),
        (SO(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"), "2024-01-31"),
        (SO(choice=["yes", "no way"]), "no way"),
        (SO(grammar='start: "(" start ")" | "x"'), "((x))"),
    ],
)
def test_masks_equal_llguidance_along_a_valid_output(so, text):
    ids = _tok().encode(text)
    g = _grammar(so)
    for k in range(len(ids) + 1):
        mine = _row(g)
        np.testing.assert_array_equal(mine, _llg_mask(so, ids[:k]))
        assert 0 < mine.sum() < V  # a real constraint: some ids allowed, most not
        if k < len(ids):
            assert mine[ids[k]] and g.accept(ids[k]) is None
    assert np.flatnonzero(_row(g)).tolist() == [EOS]  # complete: only EOS
    assert g.accept(EOS) is None and g.eos_done and _row(g).all() and not g.constrains()


def test_a_rejected_token_is_reported():
    g = _grammar(SO(regex="[0-9]+"))
    problem = g.accept(_tok().encode("a")[0])
    assert problem is not None and "rejects token" in problem


def test_sampler_applies_the_bitmask_before_temperature():
    """The jitted sampler unpacks the words on the device: draws and the greedy row land on ids llguidance
    allows, the processed logprob of each drawn id is the log-softmax over the allowed ids only (the mask comes
    before temperature), and a free row of the same step (all ones) is untouched."""
    so = SO(json=SCHEMA, disable_any_whitespace=True)
    g = _grammar(so)
    for t in _tok().encode('{"a":4'):
        assert g.accept(t) is None
    allowed = _llg_mask(so, _tok().encode('{"a":4'))
    rows, temp = 16, 0.7
    bm = np.full((rows, bitmask_words(V)), -1, np.int32)
    for r in range(rows - 1):
        g.fill(bm[r])
    rng = np.random.default_rng(0)
    logits = np.tile(rng.normal(size=(1, V)).astype(np.float32) * 3, (rows, 1))
    params = [SamplingParams(temperature=temp)] * (rows - 2) + [SamplingParams(temperature=0.0)] * 2
    st = SamplingTensors.build(params, list(range(rows)), [3] * rows, V, token_bitmask=bm)
    out = sampling.sample(jnp.asarray(logits), st, logprobs_mode="processed_logprobs", num_logprobs=20)
    tokens, lps = np.asarray(out.tokens), np.asarray(out.logprob)
    assert allowed[tokens[: rows - 1]].all()
    x = np.where(allowed, logits[0], -np.inf)
    assert tokens[rows - 2] == int(np.argmax(x))  # greedy, constrained
    assert tokens[rows - 1] == int(np.argmax(logits[0])) and not allowed[tokens[rows - 1]]  # greedy, free row
    scaled = (x - x.max()) / temp
    ref = scaled - np.log(np.exp(scaled[allowed]).sum())
    # float32 log-softmax over <= 512 ids: a few ulps of values of magnitude ~10.
    np.testing.assert_allclose(lps[: rows - 2], ref[tokens[: rows - 2]], rtol=1e-5, atol=1e-5)
    top = np.asarray(out.top_ids)[0]
    k = min(20, int(allowed.sum()))
    assert set(top[:k].tolist()) == set(np.argsort(-x)[:k].tolist())
    assert len(set(tokens[: rows - 2].tolist())) > 1  # the draws really vary by seed


def test_compile_cache_by_text_and_failures():
    c = GrammarCompiler(_tok(), V, (EOS,), threads=1, timeout_s=5, cache_limit_bytes=0)
    text = SO(regex="ab+").grammar_text()
    f1, f2 = c.submit(text), c.submit(text)
    assert f1 is f2 and c.compiles == 1 and c.cache_size == 1
    off = GrammarCompiler(_tok(), V, (EOS,), threads=1, timeout_s=5, cache=False)
    assert off.submit(text) is not off.submit(text) and off.compiles == 2 and off.cache_size == 0
    small = GrammarCompiler(
        _tok(), V, (EOS,), threads=1, timeout_s=5, cache_limit_bytes=len(text.encode()) + 1
    )
    small.submit(text)
    small.submit(SO(regex="cd+").grammar_text())
    assert small.cache_size == 1  # the older one was evicted
    bad = c.submit('{"grammars": [{"lark_grammar": "start: foo"}]}')
    with pytest.raises(ValueError, match="foo"):
        bad.result(timeout=5)
    for x in (c, off, small):
        x.close()


# ------------------------------------------------------------------------------------------ phases


def test_trigger_frees_the_reasoning_then_constrains():
    so = SO(choice=["ok"]).with_trigger((THINK_END,))
    g = _grammar(so)
    for t in (40, 41, 42):
        assert _row(g).all() and not g.constrains()
        assert g.accept(t) is None
    assert g.accept(THINK_END) is None and g.active
    np.testing.assert_array_equal(_row(g), _llg_mask(SO(choice=["ok"]), []))


def test_thinking_budget_forces_the_trigger():
    g = _grammar(SO(regex="[0-9]").with_trigger((7, THINK_END)), budget=2)
    assert g.accept(40) is None and _row(g).all()
    assert g.accept(41) is None
    assert np.flatnonzero(_row(g)).tolist() == [7]
    assert "forced trigger" in g.accept(8)
    g = _grammar(SO(regex="[0-9]").with_trigger((7, THINK_END)), budget=2)
    for t in (40, 41, 7):
        assert g.accept(t) is None
    assert np.flatnonzero(_row(g)).tolist() == [THINK_END]
    assert g.accept(THINK_END) is None and g.active
    np.testing.assert_array_equal(_row(g), _llg_mask(SO(regex="[0-9]"), []))
    # A budget alone (no grammar) forces </think> and then leaves the output free.
    free = _grammar(None, budget=1, think_end=(THINK_END,))
    assert free.accept(50) is None and np.flatnonzero(_row(free)).tolist() == [THINK_END]
    assert free.accept(THINK_END) is None and _row(free).all() and not free.constrains()


def test_bound_token_forces_the_trigger():
    g = _grammar(SO(regex="x").with_trigger((7, THINK_END), bound_token_id=9))
    assert g.accept(40) is None and _row(g).all()
    assert g.accept(9) is None
    assert np.flatnonzero(_row(g)).tolist() == [7]


# ------------------------------------------------------------------------------------------ speculative


def _sequential_masks(so: SO, prefix: list[int], drafts: list[int], **kw) -> tuple[np.ndarray, int]:
    """The reference: a fresh constraint advanced for real through each accepted draft, one mask per row."""
    g = _grammar(so, **kw)
    for t in prefix:
        assert g.accept(t) is None
    rows = np.zeros((len(drafts) + 1, bitmask_words(V)), np.int32)
    for j, t in enumerate(drafts):
        constrained = g.fill(rows[j])
        if (constrained and not unpack_bitmask(rows[j], V)[t]) or g.accept(t) is not None:
            return rows, j
    g.fill(rows[len(drafts)])
    return rows, len(drafts)


@pytest.mark.parametrize(
    "so, prefix_text, draft_text, kw",
    [
        (SO(json=SCHEMA, disable_any_whitespace=True), '{"a":', '42,"b":"x"}', {}),
        (SO(json=SCHEMA, disable_any_whitespace=True), '{"a":', "4q", {}),  # rejected mid-way
        (SO(regex="[0-9]{3}"), "", "123", {}),  # reaches the end: EOS-only row
        (SO(regex="[0-9]{2}").with_trigger((THINK_END,)), "", "ab", {}),  # free drafts before the trigger
    ],
)
def test_draft_masks_equal_sequential_and_roll_back(so, prefix_text, draft_text, kw):
    tok = _tok()
    prefix, drafts = tok.encode(prefix_text) if prefix_text else [], tok.encode(draft_text)
    g = _grammar(so, **kw)
    for t in prefix:
        assert g.accept(t) is None
    before = _row(g)
    out = np.zeros((len(drafts) + 1, bitmask_words(V)), np.int32)
    accepted = g.draft_masks(drafts, out)
    want, want_accepted = _sequential_masks(so, prefix, drafts, **kw)
    assert accepted == want_accepted
    np.testing.assert_array_equal(out[: accepted + 1], want[: accepted + 1])
    assert not out[accepted + 1 :].any()
    # Rolled back: the same mask as before, and the real path still accepts the drafts.
    np.testing.assert_array_equal(_row(g), before)
    for t in drafts[:accepted]:
        assert g.accept(t) is None


def test_draft_masks_through_eos_and_against_llguidance_drafts():
    so = SO(regex="[0-9]{2}")
    tok = _tok()
    drafts = [*tok.encode("12"), EOS, 50]
    g = _grammar(so)
    out = np.zeros((len(drafts) + 1, bitmask_words(V)), np.int32)
    accepted = g.draft_masks(drafts, out)
    assert accepted == len(drafts)  # after EOS every token is allowed (extra tokens stay legal)
    assert unpack_bitmask(out[len(drafts) - 1], V).all()
    assert not g.eos_done
    np.testing.assert_array_equal(_row(g), _llg_mask(so, []))  # rolled back to the start
    # llguidance's own speculative fill agrees on the rows before EOS.
    lt = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=V, eos_token=EOS)
    m = llguidance.LLMatcher(lt, so.grammar_text(), log_level=0)
    k = len(tok.encode("12"))
    theirs = lnp.allocate_token_bitmask(k + 1, V)
    lnp.fill_next_token_bitmask_par_with_draft_tokens(
        llguidance.LLExecutor(), [(m, 0, tok.encode("12"))], theirs
    )
    np.testing.assert_array_equal(out[: k + 1], theirs)


def test_fill_masks_in_parallel_equals_one_by_one():
    """The plan's mask fill (llguidance's parallel executor for the constraining rows) gives each row what its
    own ``fill`` gives: grammar rows at different states, a free row before its trigger, a forced row."""
    tok = _tok()
    grammars = []
    for text in ('{"a":', '{"a":4', "", '{"a":42,"b":"y'):
        g = _grammar(SO(json=SCHEMA, disable_any_whitespace=True))
        for t in tok.encode(text) if text else []:
            assert g.accept(t) is None
        grammars.append(g)
    grammars.append(_grammar(SO(regex="x").with_trigger((THINK_END,))))
    grammars.append(_grammar(SO(regex="x").with_trigger((7, THINK_END)), budget=0))
    rows = [(2 * i, g) for i, g in enumerate(grammars)]
    out = np.zeros((2 * len(grammars), bitmask_words(V)), np.int32)
    fill_masks(rows, out)
    for r, g in rows:
        np.testing.assert_array_equal(unpack_bitmask(out[r], V), _row(g))
    assert not out[1::2].any()  # rows without a grammar are left alone


def test_scheduler_plans_masks_only_for_constrained_steps():
    """The plan carries a [S, W] bitmask only when a sampled row is constrained (a step without one is the
    zero-width variant); the constrained row's mask is llguidance's, a free row of the same step is all ones, and
    a constrained request waits for its in-flight token while the free one keeps one step in flight."""
    from deepinfer_jax.engine.scheduler import Scheduler

    sched = Scheduler(
        num_blocks=16,
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=64,
        vocab_size=V,
        eos_token_ids=(EOS,),
        tokenizer=_tok(),
        grammar_compiler=_compiler(),
    )
    so = SO(regex="[0-9]{2}")
    sched.add_request("free", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), seed=1)
    sched.add_request("so", [5, 6], SamplingParams(max_tokens=4, structured_outputs=so), seed=2)
    sched.devices[0].wait_for_grammars(10)  # compiled in the pool; the next schedule() admits it
    plan = sched.schedule()
    words = bitmask_words(V)
    bm = plan.inputs.sampling.token_bitmask
    assert bm.shape == (1, plan.padded_seqs, words) and plan.variant[7] == words
    rows = {r.request.request_id: i for i, r in enumerate(plan.batches[0].rows)}
    np.testing.assert_array_equal(unpack_bitmask(bm[0, rows["so"]], V), _llg_mask(so, []))
    assert unpack_bitmask(bm[0, rows["free"]], V).all()
    second = sched.schedule()  # step 1 in flight: only the free request runs, unmasked
    assert [r.request.request_id for r in second.batches[0].rows] == ["free"]
    assert second.inputs.sampling.token_bitmask.shape[2] == 0 and second.variant[7] == 0
    digit = _tok().encode("4")[0]
    tokens = np.zeros((1, plan.padded_seqs), np.int32)
    tokens[0, rows["so"]], tokens[0, rows["free"]] = digit, 50
    sched.process_outputs(plan, tokens)
    third = sched.schedule()
    rows3 = {r.request.request_id: i for i, r in enumerate(third.batches[0].rows)}
    assert "so" in rows3
    np.testing.assert_array_equal(
        unpack_bitmask(third.inputs.sampling.token_bitmask[0, rows3["so"]], V), _llg_mask(so, [digit])
    )
