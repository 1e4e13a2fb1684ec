"""The embedded sandbox service: LocalBackend + SQLite state + the REST API on loopback, in one process.

    from orchard.env.embedded import serve
    with serve(tmp_dir) as (url, key):            # in this process, on a background thread
        ...
    with serve(tmp_dir, in_process=False) as svc:  # as a child process (svc.process), e.g. to kill it
        ...

`orchard env serve` runs the same thing in the foreground and prints `SANDBOX_BASE_URL=...` and
`SANDBOX_API_KEY=...` lines, the variables the clients read. Layout under `root_dir`: `state.sqlite3` (the
orchestrator's store) and `sandboxes/` (the backend's root). Restarting on the same `root_dir` keeps sandboxes.
`store="redis://host:port/db"` (`--store`) keeps the state in Redis instead, shared by every replica started
with the same URL (see `orchard.env.store.redis_store`).

Fail closed: where bubblewrap does not work the local backend falls back to process groups, which cannot block
a sandbox's network; a create with `block_network: true` is then refused (501) unless the service was started
with `allow_weak_isolation=True` (`--allow-weak-isolation`). Every sandbox reports its `isolation`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib
import ipaddress
import os
import queue
import secrets
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchard._extras import requires_extra
from orchard._uvicorn import quiet_shutdown_cancellations
from orchard.env.backends.base import Backend

API_KEY_ENV = "ORCHARD_ENV_API_KEY"
"""The key `serve(in_process=False)` hands its child (not on the command line: /proc/*/cmdline is
world-readable), and that `orchard env serve` uses when `--api-key` is not given. The service's own key, not
`orchard.env.API_KEY_ENV` (`SANDBOX_API_KEY`), the one its clients read."""
READY_PREFIX = "SANDBOX_BASE_URL="
KEY_PREFIX = "SANDBOX_API_KEY="
"""The lines the service prints once it listens: the variables the clients read (`export` them as printed)."""
BACKENDS = ("local", "local-per-command", "local-process-group")
SHARED_HELP = "name=dir: a host folder bound read-only at /.orchard-shared/<name> in every sandbox (repeatable)"


@dataclass
class EmbeddedService:
    """A running service. Unpacks as `(url, api_key)`."""

    url: str
    api_key: str
    root_dir: Path
    process: subprocess.Popen[str] | None = None
    """The child process when started with `in_process=False`."""
    output: list[str] = field(default_factory=list)
    """What the child printed (kept for diagnostics)."""

    def __iter__(self) -> Iterator[str]:
        return iter((self.url, self.api_key))


def make_backend(root_dir: Path, backend: str = "local", *, allow_weak_isolation: bool = False,
                 shared: dict[str, str] | None = None) -> Backend:
    """The backend named by `backend`: "local" (LocalBackend under `root_dir/sandboxes`, commands run by
    each sandbox's box), "local-per-command" (the same with a bubblewrap per command, `box=False`),
    "local-process-group" (the process-group fallback, without trying bubblewrap) or "module:factory", a
    callable taking the sandboxes directory. `allow_weak_isolation` and `shared` go to the LocalBackend (see
    there); a "module:factory" backend takes no `shared`."""
    sandboxes = Path(root_dir) / "sandboxes"
    if backend in BACKENDS:
        from orchard.env.backends.local import LocalBackend

        return LocalBackend(sandboxes, box=backend == "local", allow_weak_isolation=allow_weak_isolation,
                            use_bwrap=False if backend == "local-process-group" else None, shared=shared)
    module, _, attr = backend.partition(":")
    if not module or not attr:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} or 'module:factory', got {backend!r}")
    if shared:
        raise ValueError(f"shared folders need a local backend, got backend {backend!r}")
    return getattr(importlib.import_module(module), attr)(sandboxes)


def _bind(host: str, port: int) -> socket.socket:
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this; without it a response's head and body can sit 40 ms apart
    # (Nagle on our side against the client's delayed ACK) on every request.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.setblocking(False)
    return sock


def _url(sock: socket.socket, host: str) -> str:
    port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _run(main: Any) -> None:
    """`asyncio.run(main)` on uvloop when it is installed (uvicorn[standard] brings it): its loop and socket
    transports are C. uvicorn picks uvloop only when it runs the loop itself, which it does not here."""
    try:
        from uvloop import run
    except ImportError:  # uvloop absent, or older than 0.18
        run = asyncio.run
    run(main)


def _server(root_dir: Path, api_key: str, backend: str, options: dict[str, Any], log_level: str,
            allow_weak_isolation: bool, store: str = "sqlite", shared: dict[str, str] | None = None) -> Any:
    with requires_extra("env"):
        import uvicorn

    from orchard.env.orchestrator import Orchestrator
    from orchard.env.server import create_app
    from orchard.env.store import open_store

    root_dir.mkdir(parents=True, exist_ok=True)
    # Sandboxes run as their own uids and reach their workspaces by path, so the root must be searchable
    # (not listable); the state file (it holds sandboxes' env) stays the service's alone.
    os.chmod(root_dir, 0o711)
    state = root_dir / "state.sqlite3"
    if store == "sqlite":
        os.close(os.open(state, os.O_CREAT | os.O_WRONLY, 0o600))
    state_store = open_store(store, state)  # before the backend: a bad --store fails without side effects
    made = make_backend(root_dir, backend, allow_weak_isolation=allow_weak_isolation, shared=shared)
    if getattr(made, "isolation", None) == "process-group":
        print(f"WARNING: sandboxes are not isolated ({getattr(made, 'isolation_warning', '')}); "
              + ("they run as process groups on the host (--allow-weak-isolation)" if allow_weak_isolation
                 else "a sandbox with block_network=true will be refused"), file=sys.stderr, flush=True)
    orchestrator = Orchestrator(made, state_store, **options)
    app = create_app(orchestrator, [api_key])
    config = uvicorn.Config(app, log_level=log_level, access_log=False, ws="websockets-sansio",
                            timeout_keep_alive=30, backlog=4096, lifespan="on",
                            timeout_graceful_shutdown=5)  # don't wait out a long `wait: true` exec on SIGTERM
    quiet_shutdown_cancellations()
    return uvicorn.Server(config)


@contextlib.contextmanager
def serve(
    root_dir: str | Path | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    in_process: bool = True,
    backend: str = "local",
    log_level: str = "warning",
    startup_timeout_s: float = 120.0,
    allow_weak_isolation: bool = False,
    store: str = "sqlite",
    shared: dict[str, str | os.PathLike[str]] | None = None,
    **orchestrator_options: Any,
) -> Iterator[EmbeddedService]:
    """Run the embedded service for the duration of the `with` block.

    Args:
        root_dir: state and sandboxes live here; None = a temporary directory removed afterwards.
        host: interface to bind; loopback by default.
        port: 0 = any free port.
        api_key: None = a fresh random key.
        in_process: True = uvicorn on a background thread of this process; False = a child process
            (`python -m orchard.env.embedded`), stopped with SIGTERM (SIGKILL after 10 s) on exit.
        backend: "local", "local-per-command", "local-process-group" or "module:factory" (see `make_backend`).
        startup_timeout_s: how long to wait for the service to serve; 120 s by default (a child process took over
            30 s to import and start at nice 15 on a 2-core machine at load average 15).
        allow_weak_isolation: where the local backend has no bubblewrap, still create sandboxes with
            `block_network: true` (their network is not blocked; they report `isolation: "process-group"` and
            `block_network: false`). Default False: such a create is refused with 501.
        store: "sqlite" (the embedded default: `root_dir/state.sqlite3`) or a `redis://host:port/db` URL, the
            state shared by every replica given the same URL (needs the `[redis]` extra).
        shared: service-level folders, name -> host directory, bound read-only at `/.orchard-shared/<name>`
            in every sandbox (`LocalBackend`'s `shared`; `--shared name=dir`).
        orchestrator_options: keyword arguments of `Orchestrator` (e.g. `heartbeat_timeout_s=60`).
    """
    api_key = api_key or secrets.token_urlsafe(24)
    with contextlib.ExitStack() as stack:
        if root_dir is None:
            root_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="orchard-env-"))
        root = Path(root_dir)
        serve_in = _serve_thread if in_process else _serve_child
        folders = {name: os.fspath(path) for name, path in (shared or {}).items()}
        yield from serve_in(root, host, port, api_key, backend, log_level, startup_timeout_s,
                            allow_weak_isolation, store, folders, orchestrator_options)


def _serve_thread(root: Path, host: str, port: int, api_key: str, backend: str, log_level: str,
                  startup_timeout_s: float, allow_weak_isolation: bool, store: str, shared: dict[str, str],
                  options: dict[str, Any]) -> Iterator[EmbeddedService]:
    server = _server(root, api_key, backend, options, log_level, allow_weak_isolation, store, shared)
    sock = _bind(host, port)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            _run(server.serve(sockets=[sock]))
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name="orchard-env-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if failure or not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError(f"the embedded service did not start: {failure[:1] or 'timeout'}")
        time.sleep(0.01)
    try:
        yield EmbeddedService(url=_url(sock, host), api_key=api_key, root_dir=root)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def _serve_child(root: Path, host: str, port: int, api_key: str, backend: str, log_level: str,
                 startup_timeout_s: float, allow_weak_isolation: bool, store: str, shared: dict[str, str],
                 options: dict[str, Any]) -> Iterator[EmbeddedService]:
    argv = [sys.executable, "-m", "orchard.env.embedded", "--root", str(root), "--host", host, "--port",
            str(port), "--backend", backend, "--log-level", log_level, "--parent-pid", str(os.getpid()),
            "--store", store]
    if allow_weak_isolation:
        argv.append("--allow-weak-isolation")
    for name, folder in shared.items():
        argv += ["--shared", f"{name}={folder}"]
    for name, value in options.items():
        argv += ["--option", f"{name}={value}"]
    env = {**os.environ, API_KEY_ENV: api_key}  # not on the command line: /proc/*/cmdline is world-readable
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    service = EmbeddedService(url="", api_key=api_key, root_dir=root, process=process)
    try:
        service.url = _wait_ready(process, service.output, startup_timeout_s)
        yield service
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_ready(process: subprocess.Popen, output: list[str], timeout_s: float) -> str:
    """The URL the child prints once it serves, waiting at most ``timeout_s`` for it. Every line of the child's
    output is kept in ``output``, before and after (a thread drains the pipe for the child's whole life, so it never
    blocks on a full pipe, and a child that prints nothing cannot block the wait past its deadline)."""
    lines: queue.Queue[str | None] = queue.Queue()
    ready = threading.Event()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line)
            if not ready.is_set():
                lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            left = deadline - time.monotonic()
            if left <= 0:  # checked each line too: a child that keeps printing cannot hold the wait past it
                raise queue.Empty
            line = lines.get(timeout=left)
        except queue.Empty:
            raise RuntimeError(f"the embedded service did not start within {timeout_s:g} s:\n"
                               + "".join(output)) from None
        if line is None:
            raise RuntimeError("the embedded service exited before it was ready:\n" + "".join(output))
        if line.startswith(READY_PREFIX):
            ready.set()
            return parse_printed(line, READY_PREFIX)


def _parse_option(text: str) -> tuple[str, Any]:
    name, sep, raw = text.partition("=")
    if not sep or not name.isidentifier():
        raise ValueError(f"--option must be name=value, got {text!r}")
    value: Any = raw
    for cast in (int, float):
        with contextlib.suppress(ValueError):
            value = cast(raw)
            break
    if raw == "None":
        value = None
    return name, value


def parse_shared(items: list[str]) -> dict[str, str]:
    """``--shared name=dir`` values as the `shared` mapping of `serve` (ValueError for one without ``=``)."""
    shared = {}
    for item in items:
        name, sep, folder = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--shared must be name=dir, got {item!r}")
        shared[name] = folder
    return shared


def parse_printed(line: str, prefix: str) -> str:
    """The value of a `NAME=value` line the service printed (`prefix` is "NAME="; the value is shell-quoted
    where it needs to be, so that the line can be exported as is)."""
    if not line.startswith(prefix):
        raise ValueError(f"line must start with {prefix!r}, got {line!r}")
    words = shlex.split(line[len(prefix):])
    return words[0] if words else ""


def run_forever(root_dir: str | Path, *, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                backend: str = "local", log_level: str = "warning", parent_pid: int | None = None,
                allow_weak_isolation: bool = False, store: str = "sqlite", shared: dict[str, str] | None = None,
                **orchestrator_options: Any) -> None:
    """Serve in the foreground until SIGINT/SIGTERM; first prints `SANDBOX_BASE_URL=...` and
    `SANDBOX_API_KEY=...` lines (what `orchard env serve` shows: the variables the clients read, quoted for a
    shell where they need to be). `allow_weak_isolation`, `store`, `shared`: see `serve`.

    With ``parent_pid``, also shut down (gracefully: sandboxes' processes are ended) once this process is no
    longer that process's child — the parent died, even by SIGKILL, which leaves it no chance to stop us.
    """
    api_key = api_key or secrets.token_urlsafe(24)
    if not _is_loopback(host):
        print(f"WARNING: binding {host}, not loopback: anyone who can reach it and holds the key can run "
              "commands in its sandboxes", file=sys.stderr, flush=True)
    server = _server(Path(root_dir), api_key, backend, orchestrator_options, log_level, allow_weak_isolation,
                     store, shared)
    sock = _bind(host, port)
    # What exists now (modules, the app, its schemas) lives as long as the process: leaving it out of the
    # garbage collector's full passes saves ~2 % of the CPU per request. Not in `serve()`'s thread: that
    # process is the caller's.
    gc.collect()
    gc.freeze()

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:
            print(f"{READY_PREFIX}{shlex.quote(_url(sock, host))}", flush=True)
            print(f"{KEY_PREFIX}{shlex.quote(api_key)}", flush=True)
        while parent_pid is not None and not task.done():
            if os.getppid() != parent_pid:  # re-parented: the process that started us is gone
                server.should_exit = True
                break
            await asyncio.sleep(0.5)
        await task

    _run(main())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchard.env.embedded", description=__doc__)
    parser.add_argument("--root", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--backend", default="local")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--store", default="sqlite", help="sqlite, or redis://host:port/db")
    parser.add_argument("--option", action="append", default=[], help="Orchestrator keyword, name=value")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit when this process is no longer our parent (serve() passes its own pid)")
    parser.add_argument("--allow-weak-isolation", action="store_true",
                        help="create block_network sandboxes even without bubblewrap (their network is open)")
    parser.add_argument("--shared", action="append", default=[], help=SHARED_HELP)
    args = parser.parse_args(argv)
    options = dict(_parse_option(o) for o in args.option)
    shared = parse_shared(args.shared)
    run_forever(args.root, host=args.host, port=args.port, api_key=os.environ.get(API_KEY_ENV),
                backend=args.backend, log_level=args.log_level, parent_pid=args.parent_pid,
                allow_weak_isolation=args.allow_weak_isolation, store=args.store, shared=shared, **options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
