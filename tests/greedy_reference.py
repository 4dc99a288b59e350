"""The engine tests' token reference: greedy decoding by repeated full forwards of the model."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["greedy_reference"]


def greedy_reference(model: Any, prompt: list[int], n: int, length: int) -> list[int]:
    """``n`` greedy tokens after ``prompt``, each the argmax of a full forward ``model.logits`` over the sequence
    so far, right-padded to ``length`` tokens (the forward is causal, so the padding never changes a position)."""
    seq = list(prompt)
    for _ in range(n):
        ids = np.zeros((1, length), np.int32)
        ids[0, : len(seq)] = seq
        seq.append(int(np.argmax(model.logits(ids)[0, len(seq) - 1])))
    return seq[len(prompt) :]
