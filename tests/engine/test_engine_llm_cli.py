"""`deepinfer-jax generate` and the package-level exports of the facade."""

from __future__ import annotations

import deepinfer_jax
from deepinfer_jax.cli import main as cli

# The engine settings of test_engine_llm.py, so the compiled steps are shared through the compilation cache.
ENGINE = [
    "--dtype=float32",
    "--max_num_seqs=16",
    "--max_num_batched_tokens=64",
    f"--kv_cache_memory={24 * 4 * 16 * 96 * 4 + 17 * 4 * 513}",
    "--set=cache.block_size=16",
]


def test_exports():
    from deepinfer_jax.engine.llm import LLM
    from deepinfer_jax.engine.params import SamplingParams

    assert deepinfer_jax.LLM is LLM and deepinfer_jax.SamplingParams is SamplingParams
    assert "generate" in cli.subcommands()


def test_generate_cli_prints_completions_and_summary(capsys):
    rc = cli.main(
        [
            "deepinfer-jax",
            "generate",
            "--model=tiny-v3",
            "--prompt=hello",
            "--prompt=a longer prompt here",
            "--max_tokens=4",
            "--ignore_eos",
            "--temperature=0",
            "--noprogress",
            *ENGINE,
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "random weights" in out
    assert "KV cache plan" in out
    assert out.count("output (") == 2 and "prompt: 'hello'" in out
    summary = out.strip().splitlines()[-1]
    assert "2 requests" in summary and "8 generated tokens" in summary and "tokens/s" in summary
    assert "compilations" in summary


def test_generate_cli_token_ids_and_errors(capsys):
    rc = cli.main(
        [
            "deepinfer-jax",
            "generate",
            "--model=tiny-v3",
            "--prompt_ids=5,6,7",
            "--max_tokens=2",
            "--temperature=0",
            "--noprogress",
            *ENGINE,
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "ids=[" in out and "prompt: [5, 6, 7]" in out
    rc = cli.main(["deepinfer-jax", "generate", "--model=tiny-v3", "--prompt_ids=5,x", *ENGINE])
    assert rc == 2 and "prompt_ids" in capsys.readouterr().err
    rc = cli.main(["deepinfer-jax", "generate", "--model=tiny-v3"])
    assert rc == 2 and "--prompt" in capsys.readouterr().err
    rc = cli.main(["deepinfer-jax", "generate", "--model=no-such-model", "--prompt=x"])
    assert rc == 2 and "no-such-model" in capsys.readouterr().err
