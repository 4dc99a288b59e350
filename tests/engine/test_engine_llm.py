"""The LLM facade on tiny-v3: construction, seeds, logprobs and text, input validation, folders without a tokenizer.

What the engine computes (batch vs alone, greedy vs full forwards, preemption, stops, prompt logprobs) is checked
for every family on one device and on a mesh in tests/engine/test_engine_families.py.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from deepinfer_jax.engine.llm import LLM, derive_seed
from deepinfer_jax.engine.params import SamplingParams
from deepinfer_jax.models import builtin

# 24 blocks of 16 tokens (one reserved): one block is 4 cached layers x 16 tokens x 96 float32 values = 24576
# B, the per-slot state 17 slots x 4 B x (1 + 512) = 34884 B. 23 usable blocks hold 368 tokens, fewer than the
# 16-request batch below needs at its peak, so the scheduler must preempt.
BLOCK_BYTES = 4 * 16 * 96 * 4
STATE_BYTES = 17 * 4 * 513
MEMORY = 24 * BLOCK_BYTES + STATE_BYTES
REF_LEN = 64


def _engine(**kw):
    return LLM(
        "tiny-v3",
        dtype="float32",
        max_num_seqs=16,
        max_num_batched_tokens=64,
        kv_cache_memory=MEMORY,
        **{"cache.block_size": 16},
        **kw,
    )


@pytest.fixture(scope="module")
def llm():
    return _engine()


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    lengths = [3, 17, 40, 1, 9, 25, 33, 5, 12, 2, 48, 7, 20, 15, 30, 4]
    return [rng.integers(2, 512, n).tolist() for n in lengths]


def _params() -> list[SamplingParams]:
    out = []
    for i in range(16):
        if i % 2:
            out.append(SamplingParams(temperature=0.0, max_tokens=6 + i % 5, ignore_eos=True))
        else:
            out.append(SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_tokens=6, seq_seed=100 + i))
    return out


@pytest.fixture(scope="module")
def batch_outputs(llm):
    return llm.generate(prompt_token_ids=_prompts(), sampling_params=_params(), use_tqdm=False)


def test_construction_plans_the_cache(llm):
    spec = llm.memory_plan.spec
    assert spec.num_blocks == 24 and spec.block_size == 16 and spec.dtype == "float32"
    assert llm.max_model_len == 23 * 16 + 1  # capped: what one request can cache, plus the last sampled token
    assert "24 (23 usable" in llm.memory_plan.describe()


def test_seq_seed_reproducible_and_derived_seeds(llm):
    p = SamplingParams(temperature=1.0, max_tokens=8, seq_seed=7, ignore_eos=True)
    a = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=p, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=p, use_tqdm=False)[0].outputs[0].token_ids
    c = (
        llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=p.replace(seq_seed=8), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    assert a == b and a != c
    # Without seq_seed: seeds come from LLM(seed=) and the index, so a rerun of the same batch is identical.
    q = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    runs = [
        [
            o.outputs[0].token_ids
            for o in llm.generate(prompt_token_ids=[[9, 9], [9, 9]], sampling_params=q, use_tqdm=False)
        ]
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1]
    assert derive_seed(0, 0) != derive_seed(0, 1) != derive_seed(1, 0)
    assert all(0 <= derive_seed(s, i) < 2**64 for s in (0, 2**64 - 1) for i in (0, 5))


def test_logprobs_and_text(llm):
    out = llm.generate(
        ["hello world"],
        SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )[0]
    c = out.outputs[0]
    assert out.prompt == "hello world" and len(c.token_ids) == 4 and isinstance(c.text, str)
    assert len(c.logprobs) == 4
    for token, entry in zip(c.token_ids, c.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the most probable token
        assert 3 <= len(entry) <= 4
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
    assert out.metrics.first_token_time is not None and out.metrics.num_generated_tokens == 4


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"prompt_token_ids": [[]]}, ValueError, "empty"),
        ({"prompts": [""]}, ValueError, r"prompts\[0\]"),
        ({"prompt_token_ids": [[1, 2], [3, 512]]}, ValueError, r"request 1: prompt_token_ids\[1\] = 512"),
        ({"prompt_token_ids": [[1, -2]]}, ValueError, "outside the vocabulary"),
        ({"prompt_token_ids": [list(range(2, 402))]}, ValueError, "max_model_len"),
        (
            {"prompt_token_ids": [[1] * 300], "sampling_params": SamplingParams(max_tokens=100)},
            ValueError,
            "max_tokens",
        ),
        (
            {"prompt_token_ids": [[1], [2]], "sampling_params": [SamplingParams()]},
            ValueError,
            "sampling_params",
        ),
        (
            {"prompt_token_ids": [[1]], "sampling_params": [{"temperature": 0}]},
            TypeError,
            r"sampling_params\[0\]",
        ),
        ({"prompt_token_ids": [[1.5]]}, TypeError, "must be an int"),
        ({"prompts": [3]}, TypeError, r"prompts\[0\]"),
        ({}, ValueError, "both None"),
    ],
)
def test_tier1_errors_leave_the_engine_intact(llm, batch_outputs, kwargs, error, match):
    with pytest.raises(error, match=match):
        llm.generate(use_tqdm=False, **kwargs)
    assert not llm.scheduler.has_unfinished_requests()


def test_still_correct_after_errors(llm, batch_outputs):
    with pytest.raises(ValueError):
        llm.generate(prompt_token_ids=[[1, 2], []], use_tqdm=False)
    again = llm.generate(prompt_token_ids=_prompts()[:3], sampling_params=_params()[:3], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in batch_outputs[:3]]


def test_construction_errors(tmp_path):
    with pytest.raises(ValueError, match="model"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM("tiny-v4", dtype="float32", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="max_model_len"):
        _engine(max_model_len=1000)
    with pytest.raises(
        ValueError, match=r"max_model_len: 4096 tokens exceed the model's max_position_embeddings = 2048"
    ):
        LLM("tiny-v3", max_model_len=4096)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM("tiny-v3", dtype="float32", kv_cache_memory="1KiB")
    with pytest.raises(TypeError, match="max_num_seqs"):
        LLM("tiny-v3", max_num_seqs="8")
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM("tiny-v3", data_parallel_size=16)  # 16 devices asked, 8 exist
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM("tiny-v3", **{"scheduler.max_num_seqs": 4})
    with pytest.raises(ValueError, match=r"model\.vocab_size"):
        LLM("tiny-v3", **{"model.vocab_size": 4})
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM("tiny-v3", kv_cache_dtype="fp4")


def test_model_folder_without_tokenizer(tmp_path, llm):
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(builtin.materialize("tiny-v3"), folder)
    (folder / "tokenizer.json").unlink()
    bare = LLM(
        str(folder),
        dtype="float32",
        max_num_seqs=16,
        max_num_batched_tokens=64,
        kv_cache_memory=MEMORY,
        **{"cache.block_size": 16},
    )
    assert bare.tokenizer is None and bare.eos_token_ids == (1,)
    with pytest.raises(ValueError, match="tokenizer"):
        bare.generate(["hi"], use_tqdm=False)
    p = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    out = bare.generate(prompt_token_ids=[[4, 5, 6]], sampling_params=p, use_tqdm=False)[0].outputs[0]
    want = llm.generate(prompt_token_ids=[[4, 5, 6]], sampling_params=p, use_tqdm=False)[0].outputs[0]
    assert out.text == "" and out.token_ids == want.token_ids


def test_min_bucket_fill_reaches_the_scheduler_and_is_validated():
    from deepinfer_jax.config.errors import ConfigValueError

    assert _engine(**{"scheduler.min_bucket_fill": 0.0}).scheduler.devices[0].min_bucket_fill == 0.0
    with pytest.raises(ConfigValueError, match=r"scheduler\.min_bucket_fill"):
        _engine(**{"scheduler.min_bucket_fill": 1.5})
