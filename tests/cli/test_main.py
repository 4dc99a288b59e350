"""The absl command line: subcommand dispatch, help, errors, and `info`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_jax.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = cli.main(["deepinfer-jax", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_top_level_help_lists_subcommands(capsys):
    rc, out, _ = run_cli(capsys, "--help")
    assert rc == 0
    assert "usage: deepinfer-jax SUBCOMMAND" in out
    for name in cli.subcommands():
        assert name in out


def test_no_arguments_prints_usage_and_fails(capsys):
    rc, _, err = run_cli(capsys)
    assert rc == 2
    assert "usage" in err


def test_unknown_subcommand_is_a_clear_error(capsys):
    rc, _, err = run_cli(capsys, "inof")
    assert rc == 2
    assert "unknown subcommand 'inof'" in err
    assert "did you mean 'info'" in err


def test_flag_before_subcommand_is_refused(capsys):
    rc, _, err = run_cli(capsys, "--model", "tiny-v41")
    assert rc == 2
    assert "expected a subcommand" in err


def test_unknown_flag_is_a_clear_error(capsys):
    rc, _, err = run_cli(capsys, "info", "--modle", "tiny-v41")
    assert rc == 2
    assert "modle" in err
    assert "info --help" in err


def test_subcommand_help(capsys):
    rc, out, _ = run_cli(capsys, "info", "--help")
    assert rc == 0
    assert "--model" in out and "--gin_binding" in out and "--set" in out
    rc2, out2, _ = run_cli(capsys, "help", "info")
    assert rc2 == 0 and out2 == out


def test_register_subcommand_conflict():
    with pytest.raises(ValueError, match="already registered"):
        cli.register_subcommand("info", "some.other.module", "x")


def info_json(capsys, *args: str) -> dict:
    rc, out, err = run_cli(capsys, "info", "--format", "json", *args)
    assert rc == 0, err
    return json.loads(out)


def test_info_tiny_v41(capsys):
    report = info_json(capsys, "--model", "tiny-v41")
    model = report["model"]
    assert model["family"] == "deepseek_v41"
    assert model["builtin"] == "tiny-v41"
    assert "random" in model["weights"]
    # The static V4.1 layer plan (model.md §15.2): layer 2 reuses layer 1's compressed KV and top-k.
    layer2 = report["layer_plan"]["layers"][2]
    assert (layer2["src_kv"], layer2["src_idx"], layer2["ratio"]) == (1, 1, 2)
    assert report["layer_plan"]["candidate"]["consumers"] == [4, 5]
    # head_dim 128 / index_head_dim 128 in the tiny config: MXFP8 window = 128 + 4 scale bytes, FP4 compressed =
    # 64 code bytes + 8 E4M3 scales, MXFP4 indexer = 64 + 4.
    assert report["record_bytes_per_token"] == {"window": 132, "compressed": 72, "indexer": 68}
    # Labelled: these are the production formats, scales included, not this machine's float32 cache.
    assert (
        report["record_formats"]["window"]
        == "132 B: 128 B of FP8 E4M3 codes + 4 B of UE8M0 scales (one per 32)"
    )
    assert "production cache formats" in report["cache_sizes"]
    assert report["engine"]["model"]["num_hidden_layers"] == 7
    # 7 window records (132 B) + compressed records of the KV sources 1 (ratio 2), 3 and 5 (ratio 1):
    # 72/2 + 72 + 72, + indexer records of the same layers: 68/2 + 68 + 68; the 2 draft layers add a window each.
    backbone = 7 * 132 + (36 + 72 + 72) + (34 + 68 + 68)
    assert report["kv_bytes_per_token"] == {"backbone": backbone, "with_draft_layers": backbone + 2 * 132}
    # On the CPU every registered op runs its jnp reference.
    assert report["ops"]["platform"] == "cpu"
    assert {"rms_norm", "rope"} <= set(report["ops"]["selected"])
    assert all(s["backend"] == "reference" for s in report["ops"]["selected"].values())


def test_info_trained_builtin_says_its_weights_are_trained(capsys):
    model = info_json(capsys, "--model", "shakespeare-v41")["model"]
    assert model["builtin"] == "shakespeare-v41" and model["family"] == "deepseek_v41"
    assert model["weights"].startswith("trained") and "random" not in model["weights"]


def test_info_real_shape_reports_sizes_and_missing_values(capsys):
    report = info_json(capsys, "--model", str(ROOT / "configs" / "deepseek_v41_flash.yaml"))
    assert report["record_bytes_per_token"] == {"window": 528, "compressed": 288, "indexer": 68}
    assert "rope_theta" in " ".join(report["model"]["missing_fields"])
    assert report["model"]["weights"] == "none (a config file only)"
    kv = report["kv_bytes_per_token"]
    # 40 windows of 528 B; KV/index-K sources 2, 8, 14 (ratio 2) and 20 (ratio 1): 3 * 288/2 + 288 and
    # 3 * 68/2 + 68; the 3 draft layers add a window record each.
    backbone = 40 * 528 + (3 * 144 + 288) + (3 * 34 + 68)
    assert kv == {"backbone": backbone, "with_draft_layers": backbone + 3 * 528}


def test_info_overrides_have_top_priority(capsys):
    report = info_json(
        capsys,
        "--model",
        "tiny-v41",
        "--gin_binding",
        "scheduler.max_num_seqs = 4",
        "--set",
        "scheduler.max_num_seqs=8",
    )
    assert report["engine"]["scheduler"]["max_num_seqs"] == 8
    report = info_json(capsys, "--model", "tiny-v41", "--gin_binding", "scheduler.max_num_seqs = 4")
    assert report["engine"]["scheduler"]["max_num_seqs"] == 4


def test_info_bad_input_names_the_problem(capsys):
    rc, _, err = run_cli(capsys, "info", "--model", "no-such-model")
    assert rc == 2
    assert "no-such-model" in err and "tiny-v41" in err
    rc, _, err = run_cli(capsys, "info", "--model", "tiny-v41", "--set", "cache.block_size")
    assert rc == 2
    assert "NAME=VALUE" in err and "cache.block_size" in err


def test_info_lists_the_ops_of_the_model_family(capsys):
    report = info_json(capsys, "--model", "tiny-v3")
    # The V3 family registers its absorbed-MLA core and the MoE experts op when it is imported.
    assert {"mla_attention", "moe_experts", "rms_norm", "rope"} <= set(report["ops"]["selected"])


def test_info_without_model_lists_builtins(capsys):
    report = info_json(capsys)
    names = {m["name"] for m in report["builtin_models"]}
    assert names == {"tiny-v3", "tiny-v4", "tiny-v41", "shakespeare-v41", "shakespeare-v3"}
    weights = {m["name"]: m["weights"] for m in report["builtin_models"]}
    assert {n for n, w in weights.items() if w == "random"} == {"tiny-v3", "tiny-v4", "tiny-v41"}
    assert all("random" in m["description"] for m in report["builtin_models"] if m["weights"] == "random")
    assert {n for n, w in weights.items() if w == "trained"} == {"shakespeare-v41", "shakespeare-v3"}


def test_python_dash_m_entry_point():
    res = subprocess.run(
        [sys.executable, "-m", "deepinfer_jax", "info", "--model", "tiny-v3", "--format", "json"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["model"]["family"] == "deepseek_v3"


def test_console_script_is_declared():
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["deepinfer-jax"] == "deepinfer_jax.cli.main:run"
