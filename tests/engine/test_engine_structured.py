"""Structured outputs through ``LLM`` on tiny-v3 (random weights, the synthetic tokenizer, real llguidance):
constrained decoding is valid whatever the weights, so every output that stops must parse and validate.

One module-scoped engine; its cache is small enough that a batch of long constrained outputs preempts, so
recompute of constrained requests (their matchers keep their state) is exercised too.
"""

from __future__ import annotations

import ast
import json
import re
import threading

import jsonschema
import pytest

from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.engine.params import SamplingParams
from deepinfer_jax.engine.structured import StructuredOutputsParams as SO

# 72 blocks of 16 tokens (71 usable): room for the ~900-token prompts of chat with tools, but fewer than 16
# requests of ~85 tokens hold (6 blocks each), so the long-regex batch preempts.
BLOCK_BYTES = 4 * 16 * 96 * 4
STATE_BYTES = 17 * 4 * 513
MEMORY = 72 * BLOCK_BYTES + STATE_BYTES

_S = {"type": "string", "maxLength": 6}
_I = {"type": "integer", "minimum": -50, "maximum": 50}

SCHEMAS: list[dict] = [
    {"type": "integer", "minimum": 0, "maximum": 9},
    {"type": "boolean"},
    {"enum": ["red", "green", "blue"]},
    {"const": "fixed"},
    {"type": "string", "maxLength": 5},
    {"type": "string", "pattern": "^[a-z]{2,4}$"},
    {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
    {"type": "string", "format": "date"},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.5},
    {"type": "array", "items": _I, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 4},
    {"type": "array", "items": _S, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"x": _I}, "required": ["x"], "additionalProperties": False},
    {
        "type": "object",
        "properties": {"name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "items": _S, "maxItems": 2}},
        "required": ["ok", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "p": {
                "type": "object",
                "properties": {"q": {"enum": [1, 2, 3]}},
                "required": ["q"],
                "additionalProperties": False,
            }
        },
        "required": ["p"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"enum": ["none"]}]},
    {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
    {"oneOf": [{"const": "a"}, {"const": "b"}]},
    {
        "$defs": {
            "pt": {
                "type": "object",
                "properties": {"x": _I},
                "required": ["x"],
                "additionalProperties": False,
            }
        },
        "type": "array",
        "items": {"$ref": "#/$defs/pt"},
        "maxItems": 2,
    },
    {
        "$defs": {"color": {"enum": ["c", "m", "y", "k"]}},
        "type": "object",
        "properties": {"fg": {"$ref": "#/$defs/color"}, "bg": {"$ref": "#/$defs/color"}},
        "required": ["fg", "bg"],
        "additionalProperties": False,
    },
    {"type": "object", "properties": {}, "additionalProperties": False},
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "email": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"},
        },
        "required": ["id", "email"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3},
    {"type": "array", "items": {"anyOf": [_I, {"type": "null"}]}, "maxItems": 3},
    {
        "type": "object",
        "properties": {
            "m": {
                "type": "array",
                "items": {"type": "array", "items": {"enum": [0, 1]}, "maxItems": 2},
                "maxItems": 2,
            }
        },
        "required": ["m"],
        "additionalProperties": False,
    },
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 4},
    {"type": "string", "enum": ["yes", "no"]},
    {"type": "null"},
    {
        "type": "object",
        "properties": {
            "kind": {"const": "pt"},
            "v": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.25},
        },
        "required": ["kind", "v"],
        "additionalProperties": False,
    },
    {"type": "string", "minLength": 2, "maxLength": 3, "pattern": "^[A-Z]+$"},
]

REGEXES = {
    "date": r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "email": r"[a-z0-9]{1,8}@[a-z]{1,8}\.(com|org|net)",
    "phone": r"\+1 [0-9]{3}-[0-9]{3}-[0-9]{4}",
}

ARITH = """
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{0,2}/
"""

CHOICES = ["alpha", "beta", "gamma delta"]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(
        "tiny-v3",
        dtype="float32",
        max_num_seqs=16,
        max_num_batched_tokens=64,
        kv_cache_memory=MEMORY,
        **{"cache.block_size": 16},
    )
    yield engine
    engine.close()


def _so_params(i: int, so: SO, max_tokens: int = 80) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=1000 + i, structured_outputs=so)


FREE = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=40, max_tokens=12, seed=5, ignore_eos=True),
]


@pytest.fixture(scope="module")
def big_batch(llm):
    """Every constraint at once, with two free requests mixed in."""
    params = [_so_params(i, SO(json=s, disable_any_whitespace=i % 2 == 0)) for i, s in enumerate(SCHEMAS)]
    params += [_so_params(100 + i, SO(regex=r)) for i, r in enumerate(REGEXES.values())]
    params += [_so_params(200, SO(grammar=ARITH)), _so_params(201, SO(choice=CHOICES))]
    params += [_so_params(202, SO(json_object=True, disable_any_whitespace=True))]
    params += FREE
    prompts = [f"Answer {i}:" for i in range(len(params))]
    return params, llm.generate(prompts, params, use_tqdm=False)


def test_json_schemas_stop_and_validate(big_batch):
    _, outs = big_batch
    assert len(SCHEMAS) >= 30
    stopped = 0
    for schema, out in zip(SCHEMAS, outs[: len(SCHEMAS)], strict=True):
        c = out.outputs[0]
        assert c.finish_reason in ("stop", "length"), c.error
        if c.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(c.text), schema)
    assert stopped >= 0.9 * len(SCHEMAS), stopped


def test_regex_grammar_choice_and_json_object(big_batch):
    _, outs = big_batch
    rest = outs[len(SCHEMAS) :]
    for (name, rx), out in zip(REGEXES.items(), rest[:3], strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and re.fullmatch(rx, c.text), (name, c.text)
    arith = rest[3].outputs[0]
    assert arith.finish_reason in ("stop", "length")
    if arith.finish_reason == "stop":
        tree = ast.parse(arith.text, mode="eval")  # an independent parser of the same arithmetic
        ops = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
        assert all(isinstance(n, ops) for n in ast.walk(tree)), arith.text
    else:  # a random model may nest or chain forever: every prefix is still a prefix of the language
        assert re.fullmatch(r"[0-9+\-*/()]+", arith.text), arith.text
    choice = rest[4].outputs[0]
    assert choice.finish_reason == "stop" and choice.text in CHOICES
    obj = rest[5].outputs[0]
    if obj.finish_reason == "stop":
        json.loads(obj.text)


def test_free_requests_in_a_mixed_batch_get_their_unconstrained_tokens(llm, big_batch):
    _, outs = big_batch
    alone = llm.generate([f"Answer {len(outs) - 2 + i}:" for i in range(2)], FREE, use_tqdm=False)
    for mixed, ref in zip(outs[-2:], alone, strict=True):
        assert mixed.outputs[0].token_ids == ref.outputs[0].token_ids


def test_constrained_requests_are_preempted_and_replayed(llm):
    rx = "([a-z][0-9]){40}"  # ~80 tokens: the synthetic vocabulary merges letter runs, not letter-digit pairs
    params = [_so_params(300 + i, SO(regex=rx), max_tokens=100) for i in range(16)]
    outs = llm.generate([f"long {i}" for i in range(16)], params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for o in outs:
        assert o.outputs[0].finish_reason == "stop" and re.fullmatch(rx, o.outputs[0].text)


def test_compiled_grammars_are_cached(llm):
    before = llm.grammar_compiler.compiles
    p = _so_params(7, SO(regex="[ab]{3}"), max_tokens=8)
    outs = llm.generate(["x", "y"], [p, p], use_tqdm=False)
    assert llm.grammar_compiler.compiles == before + 1
    assert all(re.fullmatch("[ab]{3}", o.outputs[0].text) for o in outs)


def test_n_samples_each_follow_the_grammar(llm):
    p = SamplingParams(
        temperature=1.0, max_tokens=20, seed=3, n=3, structured_outputs=SO(regex="[a-z]{2}[0-9]")
    )
    (out,) = llm.generate(["n:"], p, use_tqdm=False)
    assert len(out.outputs) == 3
    assert all(c.finish_reason == "stop" and re.fullmatch("[a-z]{2}[0-9]", c.text) for c in out.outputs)


def test_so_args_run_like_structured_outputs(llm):
    a = SamplingParams(temperature=0.0, max_tokens=20, so_args={"schema_type": "regex", "schema": "[0-9]{4}"})
    b = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=SO(regex="[0-9]{4}"))
    oa, ob = llm.generate(["q", "q"], [a, b], use_tqdm=False)
    assert oa.outputs[0].token_ids == ob.outputs[0].token_ids
    assert re.fullmatch("[0-9]{4}", oa.outputs[0].text)


def test_a_rejected_token_ends_only_that_request(llm):
    """Teacher forcing a token the grammar forbids: the matcher rejects it, that request ends with an error
    naming it and the problem, and the rest finish normally."""
    letter = llm.tokenizer.encode("a")[0]
    bad = SamplingParams(
        temperature=0.0, max_tokens=6, golden_token_ids=[letter], structured_outputs=SO(regex="[0-9]+")
    )
    good = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ob, og = llm.generate(["p", "p"], [bad, good], use_tqdm=False)
    assert ob.outputs[0].finish_reason == "error"
    assert ob.request_id in ob.outputs[0].error and "rejects token" in ob.outputs[0].error
    assert og.outputs[0].finish_reason == "length" and len(og.outputs[0].token_ids) == 6


def test_compile_timeout_ends_only_that_request(llm):
    """A grammar still queued for compilation past ``grammar_compile_timeout_s`` ends that request alone; the
    free request runs meanwhile."""
    compiler = llm.grammar_compiler
    saved = compiler.timeout_s
    release = threading.Event()
    compiler.timeout_s = 0.5
    compiler.submit("warm")  # make sure the pool exists
    blockers = [compiler._pool.submit(release.wait, 10) for _ in range(compiler.threads)]
    try:
        slow = _so_params(9, SO(regex="[0-9]{1,2}z"), max_tokens=8)
        free = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        os_, of = llm.generate(["p", "p"], [slow, free], use_tqdm=False)
    finally:
        release.set()
        compiler.timeout_s = saved
        for b in blockers:
            b.result()
    assert os_.outputs[0].finish_reason == "error" and "did not compile" in os_.outputs[0].error
    assert of.outputs[0].finish_reason == "length"
    ok = llm.generate(["p"], _so_params(9, SO(regex="[0-9]{1,2}z"), max_tokens=8), use_tqdm=False)
    assert re.fullmatch("[0-9]{1,2}z", ok[0].outputs[0].text)  # the same LLM keeps working


def test_bad_grammar_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match=r"StructuredOutputsParams.regex = '\[a' is not a valid regex"):
        SamplingParams(structured_outputs=SO(regex="[a"))
    p = SamplingParams(structured_outputs=SO(regex="a", trigger_token_ids=[10**6]))
    with pytest.raises(
        ValueError, match=r"request 1: sampling_params.structured_outputs.trigger_token_ids\[0\]"
    ):
        llm.generate(["a", "b"], [SamplingParams(), p], use_tqdm=False)
    assert not llm.scheduler.has_unfinished_requests()


def test_chat_thinking_constrains_only_the_answer(llm):
    schema = {"type": "object", "properties": {"v": _I}, "required": ["v"], "additionalProperties": False}
    so = SO(json=schema, disable_any_whitespace=True)
    params = [
        SamplingParams(temperature=1.0, max_tokens=20, seed=s, thinking_token_budget=6, structured_outputs=so)
        for s in range(3)
    ]
    outs = llm.chat(
        [[{"role": "user", "content": f"give v {i}"}] for i in range(3)],
        params,
        thinking=True,
        use_tqdm=False,
    )
    for out in outs:
        assert out.finish_reason == "stop", out
        assert out.reasoning_content is not None and out.usage["reasoning_tokens"] <= 6
        jsonschema.validate(out.parsed, schema)
        assert out.parsed == json.loads(out.content)
    # The reasoning is free: it is not JSON (with these seeds it contains other characters).
    assert any(not out.reasoning_content.startswith("{") for out in outs)


def test_thinking_budget_without_grammar_forces_the_end_of_reasoning(llm):
    p = SamplingParams(temperature=1.0, max_tokens=20, seed=4, thinking_token_budget=3, ignore_eos=True)
    (out,) = llm.chat([{"role": "user", "content": "hi"}], p, thinking=True, use_tqdm=False)
    assert out.usage["reasoning_tokens"] <= 3 and out.usage["completion_tokens"] == 20


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather of a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 8},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "add numbers",
            "parameters": {
                "type": "object",
                "properties": {"xs": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3}},
                "required": ["xs"],
            },
        },
    },
]


def test_tool_choice_constrains_the_dsml_tool_calls(llm):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    conv = [[{"role": "user", "content": f"call {i}"}] for i in range(3)]
    params = [SamplingParams(temperature=1.0, max_tokens=200, seed=20 + i) for i in range(3)]
    named = {"type": "function", "function": {"name": "add"}}
    for choice in ("required", named):
        outs = llm.chat(conv, params, tools=TOOLS, tool_choice=choice, use_tqdm=False)
        for out in outs:
            if choice == "required" and out.finish_reason == "length":
                # "required" allows any number of calls, and random weights may keep calling: the calls that
                # completed before the limit still follow their schemas.
                calls = out.tool_calls[:-1]
            else:
                assert out.finish_reason == "tool_calls", out
                calls = out.tool_calls
                assert calls and (choice == "required" or len(calls) == 1)
            for call in calls:
                assert call.name in schemas and (choice == "required" or call.name == "add")
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        assert sum(o.finish_reason == "tool_calls" for o in outs) >= 2
    with pytest.raises(ValueError, match="not among the tools"):
        llm.chat(conv[0], tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}})
    with pytest.raises(ValueError, match="tool_choice='none' must be"):
        llm.chat(conv[0], tools=TOOLS, tool_choice="none")
