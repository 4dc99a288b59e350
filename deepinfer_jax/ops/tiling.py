"""Batch-invariant tiling: per-token computations in fixed tiles of rows.

On XLA:CPU a float32 contraction's result for one row depends on the size of the array it is computed in
(row 0 of ``x[:B] @ w`` changes in its last bits with ``B``), so a request's logits would move with its batch.
Batch-invariant mode (``LLM(batch_invariant=True)``) runs every per-token computation over fixed tiles of
:data:`BATCH_INVARIANT_TILE` rows under ``lax.map``: one loop body of one shape serves every batch size, so a
row's result is bitwise the same alone and in any batch.

**Token scopes.** Some ops report per-step sums while they run -- the expert-parallel MoE counts the rows each
expert slot receives (EPLB's input) -- and need to know which of their tokens are real (padding tokens are
routed to no expert). A step opens a :func:`token_scope` with its token mask; ops read it with
:func:`current_scope` and add to its sums. Inside a tile, values traced in the loop body cannot leave it except
as outputs, so :func:`rowwise` gives the body a scope of its own (the tile's part of the mask), returns the
body's sums from the loop and adds them, summed over tiles, to the outer scope.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "BATCH_INVARIANT_TILE",
    "TokenScope",
    "current_scope",
    "rowwise",
    "rowwise_carry",
    "tile_rows",
    "tiled_map",
    "token_scope",
    "untile_rows",
]

BATCH_INVARIANT_TILE = 8
"""Rows per tile of every per-token computation in batch-invariant mode."""


@dataclasses.dataclass
class TokenScope:
    """What the ops traced inside a :func:`token_scope` share (trace time only).

    Attributes:
      valid: bool ``[N]``, the real tokens of the computation's token axis.
      sums: named int or float arrays the ops add to (:meth:`add`).
    """

    valid: jax.Array
    sums: dict[str, jax.Array] = dataclasses.field(default_factory=dict)

    def add(self, name: str, value: jax.Array) -> None:
        seen = self.sums.get(name)
        self.sums[name] = value if seen is None else seen + value


_SCOPE: contextvars.ContextVar[TokenScope | None] = contextvars.ContextVar("token_scope", default=None)


@contextlib.contextmanager
def token_scope(valid: jax.Array) -> Iterator[TokenScope]:
    """A :class:`TokenScope` over tokens ``valid [N]`` for the computations traced inside."""
    scope = TokenScope(valid)
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def current_scope() -> TokenScope | None:
    """The innermost open :class:`TokenScope`, or ``None``."""
    return _SCOPE.get()


def tiled_map(body: Callable[[Any], Any], xs: Any, tile: int, num: int) -> Any:
    """``lax.map(body, xs)`` over tiles of ``tile`` of ``num`` tokens, each run inside a :class:`TokenScope` of
    its tile when a scope over the ``num`` tokens is open (its sums are added, over tiles, to that scope)."""
    scope = current_scope()
    if scope is None or scope.valid.shape[0] != num:
        return jax.lax.map(body, xs)

    def scoped(args: tuple[jax.Array, Any]) -> tuple[Any, dict[str, jax.Array]]:
        valid, part = args
        with token_scope(valid) as inner:
            out = body(part)
        return out, inner.sums

    out, sums = jax.lax.map(scoped, (tile_rows(scope.valid, tile, False), xs))
    for name, value in sums.items():
        scope.add(name, value.sum(axis=0))
    return out


def tile_rows(a: jax.Array, tile: int, fill: Any = 0) -> jax.Array:
    """``a [N, ...]`` padded with ``fill`` to a multiple of ``tile`` rows and cut into ``[N / tile, tile, ...]``."""
    n = a.shape[0]
    padded = -(-n // tile) * tile
    a = jnp.pad(a, [(0, padded - n)] + [(0, 0)] * (a.ndim - 1), constant_values=fill)
    return a.reshape(padded // tile, tile, *a.shape[1:])


def untile_rows(a: jax.Array, n: int) -> jax.Array:
    """The inverse of :func:`tile_rows`: ``[N / tile, tile, ...]`` back to the first ``n`` rows."""
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])[:n]


def rowwise(fn: Callable[..., Any], tile: int | None, *args: jax.Array) -> Any:
    """``fn(*args)`` for row-major ``args`` (leading axis ``N``), optionally in fixed tiles of rows.

    With a tile, every contraction inside ``fn`` sees the same ``[tile, ...]`` shape whatever ``N`` is, so a
    row's result does not depend on how many other rows share the call. ``N`` is padded up to a multiple of the
    tile and the padding cut off.
    """
    if tile is None:
        return fn(*args)
    n = args[0].shape[0]
    out = tiled_map(lambda xs: fn(*xs), tuple(tile_rows(a, tile) for a in args), tile, n)
    return jax.tree.map(lambda a: untile_rows(a, n), out)


def rowwise_carry(
    fn: Callable[..., tuple[Any, Any]],
    tile: int | None,
    carry: Any,
    *args: jax.Array,
    fills: tuple[Any, ...] | None = None,
) -> tuple[Any, Any]:
    """``fn(carry, *args) -> (carry, out)`` for row-major ``args``, optionally in fixed tiles threaded through
    ``carry``.

    :func:`rowwise` for computations that also update one array -- a paged write whose per-row work must run in
    fixed tiles: with a tile, ``lax.scan`` hands each ``[tile, ...]`` part of ``args`` to ``fn`` with the carry
    the previous tile returned. The last tile's padding rows are filled with ``fills`` (one value per argument,
    default 0; e.g. ``-1`` for slots that a write skips) and their outputs cut off.
    """
    if tile is None:
        return fn(carry, *args)
    n = args[0].shape[0]
    fills = (0,) * len(args) if fills is None else fills
    if len(fills) != len(args):
        raise ValueError(f"rowwise_carry: {len(fills)} fills for {len(args)} arguments")
    tiled = tuple(tile_rows(a, tile, f) for a, f in zip(args, fills, strict=True))
    carry, out = jax.lax.scan(lambda c, xs: fn(c, *xs), carry, tiled)
    return carry, jax.tree.map(lambda a: untile_rows(a, n), out)
