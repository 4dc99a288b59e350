"""Fixtures shared by the checkpoint tests (helpers live in ``_checkpoint_helpers.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_v41() -> Path:
    from deepinfer_jax.models import builtin

    return builtin.materialize("tiny-v41")
