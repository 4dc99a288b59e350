"""Running the server: an :class:`~deepinfer_jax.engine.async_llm.AsyncLLM` and uvicorn on a bound socket.

:class:`Server` binds its socket when it is built (so ``port=0`` gives a free port that is known at once), then
runs either in the foreground (:meth:`Server.serve_forever`, the command line: Ctrl-C or SIGTERM drains and
exits) or in a background thread (:meth:`Server.start` / :meth:`Server.stop`, tests and the load test).

**Draining.** On shutdown the server stops accepting connections, lets the requests in progress finish for up to
``drain_timeout_s`` (uvicorn's graceful shutdown: responses being streamed go on), then cancels what is left --
which aborts those requests in the engine -- and stops the engine thread.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

import uvicorn

from deepinfer_jax.engine.async_llm import AsyncLLM
from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.server.app import build_app

__all__ = ["Server", "bind"]


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port=0``: a free one), IPv4 or IPv6 as ``host`` resolves."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    if not infos:
        raise ValueError(f"host {host!r} does not resolve to an address")
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class Server:
    """An OpenAI- and Anthropic-compatible server over ``llm``.

    Args:
      llm: the engine to serve, or an :class:`AsyncLLM` already running over one (several servers -- say, with
        and without an API key -- can share it; then :meth:`stop` leaves it running).
      served_model_name: the model name the server reports and accepts (default: ``llm.config.served_model_name``,
        else ``model_name``).
      model_name: the name to fall back on (the ``--model`` value).
      host, port, max_queued_requests, max_request_body_bytes, drain_timeout_s, default_thinking: default to the
        ``server`` config section of ``llm``.
      api_key: the key every route but ``/health`` needs (``None``: no authentication).
      log_level: uvicorn's log level.
    """

    def __init__(
        self,
        llm: LLM | AsyncLLM,
        *,
        served_model_name: str | None = None,
        model_name: str = "model",
        host: str | None = None,
        port: int | None = None,
        api_key: str | None = None,
        max_queued_requests: int | None = None,
        max_request_body_bytes: int | None = None,
        drain_timeout_s: float | None = None,
        default_thinking: bool | None = None,
        log_level: str = "warning",
    ) -> None:
        shared = isinstance(llm, AsyncLLM)
        if shared and max_queued_requests is not None:
            raise ValueError("max_queued_requests belongs to the shared AsyncLLM; set it there")
        base = llm.llm if isinstance(llm, AsyncLLM) else llm
        config = base.config.server
        self.host = config.host if host is None else host
        self.drain_timeout_s = config.drain_timeout_s if drain_timeout_s is None else float(drain_timeout_s)
        self.served_model_name = served_model_name or base.config.served_model_name or model_name
        self.sock = bind(self.host, config.port if port is None else port)
        self.port: int = self.sock.getsockname()[1]
        self._owns_engine = not shared
        try:
            self.engine = (
                llm if isinstance(llm, AsyncLLM) else AsyncLLM(llm, max_queued_requests=max_queued_requests)
            )
            self.app = build_app(
                self.engine,
                served_model_name=self.served_model_name,
                api_key=api_key,
                max_request_body_bytes=max_request_body_bytes,
                default_thinking=default_thinking,
            )
        except BaseException:
            self.sock.close()
            if self._owns_engine and getattr(self, "engine", None) is not None:
                self.engine.shutdown()
            raise
        self.uvicorn = uvicorn.Server(
            uvicorn.Config(
                self.app,
                log_level=log_level,
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=self.drain_timeout_s,  # type: ignore[arg-type]
            )
        )
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL (``http://HOST:PORT``); clients add ``/v1``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # ------------------------------------------------------------------------------------------- foreground

    def serve_forever(self, on_ready: Any = None) -> None:
        """Serve until Ctrl-C / SIGTERM, then drain (see the module docstring); ``on_ready()`` runs once the
        server accepts connections."""
        if on_ready is not None:
            self._on_started(on_ready)
        try:
            self.uvicorn.run(sockets=[self.sock])
        except KeyboardInterrupt:  # uvicorn re-raises the signal it handled once it has shut down
            pass
        finally:
            if self._owns_engine:
                self.engine.shutdown(timeout=self.drain_timeout_s)

    def _on_started(self, callback: Any) -> None:
        def wait() -> None:
            while not self.uvicorn.started and not self.uvicorn.should_exit:
                time.sleep(0.02)
            if self.uvicorn.started:
                callback()

        threading.Thread(target=wait, name="deepinfer-ready", daemon=True).start()

    # ------------------------------------------------------------------------------------------- background

    def start(self, timeout: float = 60.0) -> Server:
        """Serve from a background thread; returns once connections are accepted."""
        if self._thread is not None:
            raise RuntimeError("Server.start: already started")
        self._thread = threading.Thread(
            target=self.uvicorn.run, kwargs={"sockets": [self.sock]}, name="deepinfer-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Drain and stop a background server (and its engine thread). Idempotent."""
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(OSError):
            self.sock.close()
        if self._owns_engine:
            self.engine.shutdown(timeout=self.drain_timeout_s)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
