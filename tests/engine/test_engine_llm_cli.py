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
    assert "KV cache plan" not in out  # printed with --verbose only
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


def test_generate_cli_sampling_flags_reach_the_engine(capsys):
    """--n, --seed, --logprobs, --stop_token_ids and --verbose: the samples and logprobs LLM.generate gives for
    the SamplingParams those flags describe, and the cache plan printed."""
    from deepinfer_jax.engine.llm import LLM
    from deepinfer_jax.engine.params import SamplingParams

    flags = ["--n=2", "--seed=3", "--logprobs=1", "--max_tokens=3", "--ignore_eos", "--stop_token_ids=[7]"]
    head = ["deepinfer-jax", "generate", "--model=tiny-v3", "--prompt_ids=5,6,7", "--noprogress", "--verbose"]
    rc = cli.main([*head, *flags, *ENGINE])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "KV cache plan" in out
    llm = LLM(
        "tiny-v3",
        dtype="float32",
        max_num_seqs=16,
        max_num_batched_tokens=64,
        kv_cache_memory=24 * 4 * 16 * 96 * 4 + 17 * 4 * 513,
        **{"cache.block_size": 16},
    )
    params = SamplingParams(n=2, seed=3, logprobs=1, max_tokens=3, ignore_eos=True, stop_token_ids=[7])
    (want,) = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params, use_tqdm=False)
    assert len(want.outputs) == 2
    for c in want.outputs:
        assert f"[0.{c.index}] output ({c.finish_reason}): {c.text!r} ids={list(c.token_ids)}" in out
        shown = " ".join(f"{t}:{e[t].logprob:.4f}" for t, e in zip(c.token_ids, c.logprobs, strict=True))
        assert f"[0.{c.index}] logprobs: {shown}" in out


def _generate_ids(capsys, *extra: str) -> tuple[list[str], str]:
    rc = cli.main(
        [
            "deepinfer-jax",
            "generate",
            "--model=tiny-v3",
            "--prompt_ids=5,6,7",
            "--prompt_ids=9,10,11,12,13",
            "--prompt_ids=40",
            "--max_tokens=4",
            "--ignore_eos",
            "--temperature=0",
            "--noprogress",
            "--dtype=float32",
            "--set=cache.block_size=16",
            *extra,
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    return [line.split(" ids=")[1] for line in out.splitlines() if " ids=" in line], out


def test_generate_cli_on_a_mesh_with_eplb(capsys):
    """--data_parallel_size / --expert_parallel_size run the mesh engine (EPLB through --set): the greedy ids of
    the one-device engine, the mesh on the summary line."""
    want, _ = _generate_ids(
        capsys, "--max_num_seqs=4", "--max_num_batched_tokens=16", "--kv_cache_memory=8MiB"
    )
    got, out = _generate_ids(
        capsys,
        "--data_parallel_size=2",
        "--expert_parallel_size=4",
        "--max_num_seqs=16",
        "--max_num_batched_tokens=256",
        "--kv_cache_memory=8MiB",
        "--set=parallel.eplb_interval_steps=2",
        "--set=parallel.eplb_window_steps=2",
        "--verbose",
    )
    assert got == want and len(got) == 3
    assert "mesh: dp=2 x ep=4 = 8 devices" in out
    assert "on 8 devices (dp=2 x ep=4, " in out and "expert re-placements" in out
    rc = cli.main(
        [
            "deepinfer-jax",
            "generate",
            "--model=tiny-v3",
            "--prompt_ids=5",
            "--data_parallel_size=4",
            "--expert_parallel_size=4",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "= 16 devices, but only 8 cpu device(s)" in err
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=16" in err


def test_generate_cli_structured_outputs(capsys, tmp_path):
    import ast
    import json
    import re

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"enum": ["on", "off"]}))
    args = ["deepinfer-jax", "generate", "--model=tiny-v3", "--prompt=x", "--max_tokens=12", "--noprogress"]
    rc = cli.main([*args, "--regex=[0-9]{3}", *ENGINE])
    out, err = capsys.readouterr()
    assert rc == 0, err
    text = ast.literal_eval(re.search(r"output \(stop\): ('.*?') ids=", out).group(1))
    assert re.fullmatch("[0-9]{3}", text)
    rc = cli.main([*args, f"--json_schema={schema}", *ENGINE])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert re.search(r"output \(stop\): '\"(on|off)\"'", out), out
    rc = cli.main([*args, "--regex=a", "--choice=a,b", *ENGINE])
    assert rc == 2 and "at most one of" in capsys.readouterr().err
    rc = cli.main([*args, "--regex=(a", *ENGINE])
    assert rc == 2 and "not a valid regex" in capsys.readouterr().err
    rc = cli.main([*args, f"--grammar={tmp_path / 'missing.lark'}", *ENGINE])
    assert rc == 2 and "missing.lark" in capsys.readouterr().err
