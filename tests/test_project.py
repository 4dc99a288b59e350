"""Project-level invariants: exact pins, the lock file, the set-up script's interpreter search, the layout."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LOCK = {
    line.split("==")[0].lower().replace("_", "-"): line.split("==")[1].strip()
    for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines()
    if "==" in line and not line.startswith("#")
}


def _requirements() -> list[str]:
    project = PYPROJECT["project"]
    reqs = list(project["dependencies"])
    for group in project["optional-dependencies"].values():
        reqs += group
    return reqs


def test_python_range_is_312_only():
    assert PYPROJECT["project"]["requires-python"] == ">=3.12,<3.13"


@pytest.mark.parametrize("req", _requirements())
def test_every_dependency_is_pinned_exactly(req):
    assert re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][A-Za-z0-9.]*", req), f"{req!r} is not an exact pin"


@pytest.mark.parametrize("req", [r for r in _requirements() if not r.startswith("jax-cuda")])
def test_lock_file_agrees_with_pins(req):
    # The cuda extra is never installed on the CPU machines the lock file is made on.
    name, version = req.split("==")
    key = name.lower().replace("_", "-")
    assert key in LOCK, f"{name} missing from requirements/lock.txt"
    assert LOCK[key] == version, f"{name}: pyproject pins {version}, lock has {LOCK[key]}"


def test_no_placeholder_packages_and_core_pins():
    names = {r.split("==")[0].lower() for r in _requirements()}
    assert not names & {"pallas", "mlir"}, "pallas ships with jax and MLIR with jaxlib"
    assert {"jax==0.12.0.1", "jaxlib==0.12.0.1", "flax==0.12.12", "orbax-checkpoint==0.12.8"} <= set(
        _requirements()
    )
    assert "gin-config==0.5.0" in _requirements()
    assert PYPROJECT["project"]["optional-dependencies"]["nvidia"] == ["nvidia-cutlass-dsl==4.8.1"]


def test_installed_versions_match_lock():
    from importlib.metadata import version

    for dist in ("jax", "jaxlib", "flax", "numpy", "tokenizers", "safetensors"):
        assert version(dist) == LOCK[dist], dist


def test_no_empty_or_stub_modules():
    """A module exists because it has content: no empty files, no functions whose whole body is `pass`."""
    for path in (ROOT / "deepinfer_jax").rglob("*.py"):
        tree = ast.parse(path.read_text())
        if path.name != "__init__.py":
            assert tree.body, f"{path.relative_to(ROOT)} is empty"
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = [
                    n
                    for n in node.body
                    if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
                ]
                assert not (len(body) == 1 and isinstance(body[0], ast.Pass)), (
                    f"{path.relative_to(ROOT)}:{node.lineno} {node.name} is a pass-bodied stub"
                )
    for init in (ROOT / "deepinfer_jax").rglob("__init__.py"):
        siblings = [p for p in init.parent.iterdir() if p.name != "__init__.py" and p.name != "__pycache__"]
        assert siblings or init.read_text().strip(), f"{init.parent.relative_to(ROOT)} is an empty package"


def _fake_python_env(tmp_path: Path, *, shim_works: bool, with_pyenv: bool) -> dict[str, str]:
    """A PATH holding only a fake `python3.12` (working or a failing shim) and optionally a fake `pyenv`."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "python3.12"
    if shim_works:
        shim.symlink_to(sys.executable)
    else:
        shim.write_text("#!/bin/sh\necho 'pyenv: python3.12: command not found' >&2\nexit 127\n")
        shim.chmod(0o755)
    if with_pyenv:
        root = tmp_path / "pyenv"
        for version in ("3.12.0", "3.12.7"):
            (root / "versions" / version / "bin").mkdir(parents=True)
            (root / "versions" / version / "bin" / "python").symlink_to(sys.executable)
        (root / "versions" / "3.11.7" / "bin").mkdir(parents=True)
        pyenv = bindir / "pyenv"
        pyenv.write_text(f'#!/bin/sh\n[ "$1" = root ] && echo {root}\n')
        pyenv.chmod(0o755)
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("bash", "sort", "ls", "dirname", "cat", "sha256sum", "cut", "grep", "env", "sh"):
        found = shutil.which(tool)
        if found:
            (tools / tool).symlink_to(found)
    return {"PATH": f"{bindir}{os.pathsep}{tools}", "HOME": str(tmp_path)}


def _print_python(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup"), "--print-python"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        executable=shutil.which("bash"),
    )


def test_setup_uses_working_python312(tmp_path):
    res = _print_python(_fake_python_env(tmp_path, shim_works=True, with_pyenv=True))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(tmp_path / "bin" / "python3.12")


def test_setup_skips_failing_shim_and_takes_newest_pyenv_312(tmp_path):
    res = _print_python(_fake_python_env(tmp_path, shim_works=False, with_pyenv=True))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(tmp_path / "pyenv" / "versions" / "3.12.7" / "bin" / "python")


def test_setup_without_python312_says_what_to_install(tmp_path):
    res = _print_python(_fake_python_env(tmp_path, shim_works=False, with_pyenv=False))
    assert res.returncode == 1
    assert "no working Python 3.12" in res.stderr


def test_readme_has_exactly_the_two_quick_start_commands():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = [
        line.split("#")[0].strip()
        for block in section.split("```")[1::2]
        for line in block.splitlines()[1:]
        if line.strip()
    ]
    assert commands == ["scripts/demo", "scripts/test"]
    assert "scripts/test" in (ROOT / ".ci" / "run").read_text()
