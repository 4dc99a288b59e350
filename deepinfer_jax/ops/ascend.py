"""The ``ascend`` implementation of any op: its reference as one named custom call (``deepinfer.ascend.<op>``).

``ascend_impl(op, reference)`` is what an op's definition site registers for the ``ascend`` platform. The
returned function imports :mod:`custom_calls.ascend.named` only when called (lazily, by backend), binds its
arguments to the reference's signature and emits the custom call: array arguments become operands, the others
typed-FFI attributes named after their parameters. Elsewhere than on ``"ascend"`` the call lowers to the reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["ascend_impl"]


def ascend_impl(op: str, reference: Callable[..., Any]) -> Callable[..., Any]:
    """A function with ``reference``'s signature that lowers to ``deepinfer.ascend.<op>`` on ``"ascend"``."""

    @functools.wraps(reference)
    def impl(*args: Any, **kwargs: Any) -> Any:
        from custom_calls.ascend import named

        return named.call(op, reference, *args, **kwargs)

    impl.__name__ = f"{op}_ascend"
    impl.__qualname__ = impl.__name__
    return impl
