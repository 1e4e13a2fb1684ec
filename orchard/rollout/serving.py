"""Serve an ASGI app (the recording proxy, a model server) on the caller's running event loop.

`serve_app` runs uvicorn's ``Server.serve()`` as an asyncio task of the caller's loop, not in a thread: requests
through the app reach the engine behind it next to the caller's other rollouts (`HFEngine` batches them all
continuously). A harness program in a child process reaches the app on a loopback port.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

from orchard._extras import requires_extra
from orchard._uvicorn import quiet_shutdown_cancellations

__all__ = ["serve_app"]


def _quiet_server(app: Any, shutdown_timeout_s: int) -> Any:
    """A uvicorn server that leaves the process's signal handlers alone (Ctrl-C stays the caller's)."""
    with requires_extra("rollout"):
        import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30,
                            timeout_graceful_shutdown=shutdown_timeout_s)
    quiet_shutdown_cancellations()
    return Server(config)


@contextlib.asynccontextmanager
async def serve_app(
    app: Any, host: str = "127.0.0.1", port: int = 0, *, shutdown_timeout_s: int = 30
) -> AsyncIterator[str]:
    """Serve an ASGI app (e.g. ``RecordingProxy.app``) on the running event loop for the block; yields its URL.

    The server is an asyncio task of the caller's loop, so an engine behind the app runs on that loop too.
    ``port=0`` picks a free port. Leaving the block stops the server: requests still in flight (e.g. of a child
    that was killed) get up to ``shutdown_timeout_s`` (default 30) to finish, then are cancelled, quietly
    (`quiet_shutdown_cancellations`).
    """
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
    if isinstance(shutdown_timeout_s, bool) or not isinstance(shutdown_timeout_s, int) or shutdown_timeout_s < 1:
        raise ValueError(f"shutdown_timeout_s must be an int >= 1, got {shutdown_timeout_s!r}")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        server = _quiet_server(app, shutdown_timeout_s)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            while not server.started:
                if task.done():
                    task.result()
                    raise RuntimeError(f"the server on {host}:{port} stopped before it started")
                await asyncio.sleep(0.01)
            bound = sock.getsockname()[1]
            yield f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}"
        finally:
            server.should_exit = True
            with contextlib.suppress(Exception):
                await task
