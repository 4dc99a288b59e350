"""The OpenAI- and Anthropic-compatible HTTP server (``deepinfer-jax serve``, docs/serving.md).

Needs the ``serve`` extra (FastAPI, uvicorn): ``pip install deepinfer_jax[serve]``.

* :mod:`~deepinfer_jax.server.runtime`: :class:`Server` (the engine thread and uvicorn on a bound socket);
* :mod:`~deepinfer_jax.server.app`: the routes, authentication and body limits;
* :mod:`~deepinfer_jax.server.protocols`: Chat Completions, Responses and Messages through ``deepseek-recipe``;
* :mod:`~deepinfer_jax.server.completions`: legacy ``/v1/completions``;
* :mod:`~deepinfer_jax.server.metrics`: ``/metrics``;
* :mod:`~deepinfer_jax.server.errors`: the error bodies;
* :mod:`~deepinfer_jax.server.loadtest`: concurrent streaming clients against a running server.
"""

from __future__ import annotations

from deepinfer_jax.server.app import build_app
from deepinfer_jax.server.runtime import Server

__all__ = ["Server", "build_app"]
