"""The service's side of a sandbox's box: start it, send it commands, restart it, kill it.

A box is one long-lived process per sandbox, run under the same bubblewrap isolation a per-command launch
gets, that starts every command of the sandbox: the compiled box (`box.c`, whose header has the protocol),
bound into the sandbox from `Isolation.box_binary`, or where there is none the same program in Python
(`orchard.env.agent.box`), run by the image's python3.
bubblewrap's namespaces are set up once per sandbox instead of once per command, which is most of what a
command used to cost. The guarantees stay those of `orchard.env.agent.process`: per-stream caps, the timeout,
and no process of an exec outliving it (the box empties its pid namespace after every command).

The box runs as the sandbox's uid, so a command can kill it (`kill -9 -1`) or the OOM killer can: bubblewrap
then ends the whole namespace, the exec in flight reports exit code 137 (as a SIGKILLed command does) with a
note on stderr, and the next exec starts a fresh box. Should a box ever fail to answer within its command's
timeout plus `_WATCHDOG_SLACK_S`, the service kills it and reports a timeout. A box runs with
`--die-with-parent`, so a service killed with SIGKILL leaves none behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import marshal
import math
import os
import resource
import socket
import struct
import subprocess
import time
from functools import lru_cache
from pathlib import Path

from orchard.env.agent import reaper
from orchard.env.agent.box_build import BOX_MOUNT
from orchard.env.agent.isolation import Isolation
from orchard.env.agent.process import TIMEOUT_EXIT_CODE, ProcessTree, validate_limits
from orchard.env.backends.base import BackendError, ExecResult

BOX_SOURCE = (Path(__file__).parent / "box.py").read_text()
"""The box program, passed to the image's python on its command line (nothing has to be mounted for it)."""

_BOOT = (
    "import _frozen_importlib_external as b, marshal, posix\n"
    "def r(n):\n"
    "    d = b''\n"
    "    while len(d) < n:\n"
    "        c = posix.read(0, n - len(d))\n"
    "        if not c:\n"
    "            raise SystemExit(1)\n"
    "        d += c\n"
    "    return d\n"
    "posix.write(1, b.MAGIC_NUMBER)\n"
    "k = r(1)\n"
    "d = r(int.from_bytes(r(4), 'big'))\n"
    "exec(marshal.loads(d) if k == b'c' else compile(d, '<orchard box>', 'exec'))\n"
)
"""The box's first lines: they say which bytecode the image's python reads, and the service sends the box
compiled (the same magic number as its own python) or as source. The program travels over the socket, not
on the command line: python decodes each argument character by character (~2 ms of CPU for the box's
40 kB), and compiling the source costs ~1.5 ms more per box."""

_MAGIC = importlib.util.MAGIC_NUMBER


@lru_cache(maxsize=4)
def _box_program(source: str, magic: bytes) -> bytes:
    """The framed program for an interpreter with bytecode `magic`: kind (c: code, s: source), length, data."""
    if magic == _MAGIC:
        kind, data = b"c", marshal.dumps(compile(source, "<orchard box>", "exec"))
    else:
        kind, data = b"s", source.encode()
    return kind + struct.pack(">I", len(data)) + data


_READY = b"OBX1"
_HEADER = struct.Struct(">iBII")
_TIMED_OUT, _OUT_TRUNC, _ERR_TRUNC, _NOT_STARTED, _ENDS = 1, 2, 4, 8, 16
MAX_REQUEST_BYTES = 1 << 30
"""The most a request may frame (argv, env, cwd and stdin together); box.c's MAX_REQUEST."""
_MAX_FAILURE = 4000
"""The most a box says about a command that could not start ("<stage>:<reason>")."""
_START_TIMEOUT_S = 20.0
_BOX_MIN_AS = 256 << 20
"""A memory (address-space) limit this large is put on the box itself too; a smaller one only on commands."""
_GRACEFUL_S = 1.0
_WATCHDOG_SLACK_S = 5.0
"""How long after a command's timeout the service stops waiting for the box (which kills by itself at the
timeout and then needs at most its 2 s settle and 2 s drain)."""
_KILLED_NOTE = (
    b"\norchard: the sandbox's command runner was killed during this command (by the command, e.g. "
    b"`kill -9 -1`, or by the OOM killer); the command's output is lost and the next command starts afresh\n"
)

_CLOSED_NOTE = b"\norchard: the command was ended because its sandbox was deleted or the service stopped\n"


class BoxCpu:
    """CPU seconds used in boxes that were closed gracefully, over this process's life (the box's own and
    its commands'; a box killed mid-command is not counted). bubblewrap's init does not pass its children's
    times on to the service, so this is the only account of what the sandboxes themselves cost."""

    box_s = 0.0
    commands_s = 0.0
    boxes = 0


_FAILED_BINARIES: set[str] = set()
"""Compiled boxes that could not start in this process: later sandboxes go straight to the Python box."""
_STARTED_BINARIES: set[str] = set()
"""Compiled boxes that have started in this process: a later failure of one is taken as transient."""


def compiled_box_failed(binary: str) -> bool:
    """Remember that the compiled box `binary` could not start, unless it has started before in this process
    (then the failure is the sandbox's, not the binary's); True when it is newly remembered (to log it once)."""
    if binary in _STARTED_BINARIES or binary in _FAILED_BINARIES:
        return False
    _FAILED_BINARIES.add(binary)
    return True


class BoxUnavailableError(BackendError):
    """The box could not be started (no usable python3 in the image, bubblewrap failed); callers fall back
    to starting each command with its own bubblewrap."""


class Box:
    """One sandbox's box, started on the first `run` and restarted on the next `run` after it died.

    Args:
        isolation: the sandbox's isolation (bubblewrap); the box runs under it, as its uid.
        python: run the Python box with this interpreter (a sandbox path) even if the isolation has a
            compiled box. Default: the compiled box when `isolation.box_binary` is set, else the Python box
            under `isolation.box_python()`.
    """

    def __init__(self, isolation: Isolation, python: str | None = None) -> None:
        if not isinstance(isolation, Isolation):
            raise ValueError(f"isolation must be an Isolation, got {type(isolation).__name__}")
        self.compiled = python is None and isolation.box_binary not in (None, *_FAILED_BINARIES)
        """Whether this is the compiled box (else the Python one)."""
        if not self.compiled:
            python = python or isolation.box_python()
            if python is None:
                raise BoxUnavailableError(f"the image at {isolation.rootfs!r} has no python3 for the box")
        self.isolation = isolation
        self.python = python
        self.starts = 0
        """How many times a box process was started (a restart after a death counts)."""
        self._lock = asyncio.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._tree: ProcessTree | None = None
        self._closed = False

    @property
    def pid(self) -> int | None:
        """Host pid of the outer bubblewrap process of the running box (None when none runs)."""
        return self._proc.pid if self._proc is not None else None

    # -- running commands ---------------------------------------------------------------------------------

    async def run(
        self,
        argv: list[str],
        *,
        cwd: str,
        env: dict[str, str],
        stdin: bytes | None,
        timeout_s: float,
        max_output_bytes: int,
    ) -> ExecResult:
        """Run one command in the box (rules in `orchard.env.agent.process`); one at a time per box."""
        if not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError(f"argv must be a non-empty list of strings, got {argv!r}")
        validate_limits(timeout_s, max_output_bytes)
        own, per_exec = _split_rlimits(self.isolation.command_rlimits(timeout_s))
        # bubblewrap's --chdir exports PWD; the box's commands get the same
        request = encode_run(argv, cwd=cwd, env={**env, "PWD": cwd}, stdin=stdin, timeout_s=timeout_s,
                             cap=max_output_bytes, own=own, rlimits=per_exec)  # fmt: skip
        async with self._lock:
            if self._closed:
                raise BackendError("the sandbox is being deleted")
            start = time.monotonic()
            if not self._alive():
                await self._stop()
                if not self._closed:
                    try:
                        await self._start()
                    except BoxUnavailableError:
                        if not self._closed:
                            raise
                if self._closed:
                    # closed while the box was stopped or starting (`kill` ended it half-way): the command
                    # must not start, and a box that failed for that is no reason to fall back
                    await self._stop()
                    return ExecResult(exit_code=137, stdout=b"", stderr=_CLOSED_NOTE,
                                      duration_s=time.monotonic() - start)  # fmt: skip
            sock = self._sock
            assert sock is not None
            loop = asyncio.get_running_loop()
            try:
                await loop.sock_sendall(sock, request)
                header = await asyncio.wait_for(
                    _recv_exact(loop, sock, _HEADER.size), timeout_s + _WATCHDOG_SLACK_S
                )
                code, flags, n_out, n_err = _HEADER.unpack(header)
                err_cap = _MAX_FAILURE if flags & _NOT_STARTED else max_output_bytes
                if n_out > max_output_bytes or n_err > err_cap:
                    raise BackendError(f"the box answered {n_out} + {n_err} bytes, over the cap")
                body = await asyncio.wait_for(_recv_exact(loop, sock, n_out + n_err), _WATCHDOG_SLACK_S)
                if flags & _ENDS:
                    await self._stop()  # it could not clean up after the command: the next one starts afresh
            except asyncio.TimeoutError:
                await self._stop()
                return ExecResult(exit_code=TIMEOUT_EXIT_CODE, stdout=b"", stderr=b"", timed_out=True,
                                  duration_s=time.monotonic() - start)  # fmt: skip
            except (OSError, EOFError, BackendError):
                # The box died with the command (killed by it, by the OOM killer, or by `kill`) or misbehaved.
                await self._stop()
                note = _CLOSED_NOTE if self._closed else _KILLED_NOTE
                return ExecResult(exit_code=137, stdout=b"", stderr=note, duration_s=time.monotonic() - start)
            except BaseException:
                await self._stop()  # cancelled (client gone, service stopping): the command must not go on
                raise
        stderr = body[n_out:]
        if flags & _NOT_STARTED:
            stderr = _not_started_message(stderr, argv[0], cwd)[:max_output_bytes]
        return ExecResult(
            exit_code=code,
            stdout=body[:n_out],
            stderr=stderr,
            stdout_truncated=bool(flags & _OUT_TRUNC),
            stderr_truncated=bool(flags & _ERR_TRUNC),
            timed_out=bool(flags & _TIMED_OUT),
            duration_s=time.monotonic() - start,
        )

    async def close(self) -> None:
        """Kill the box and everything in its namespace; later `run`s raise BackendError. A `run` in flight,
        also one whose box is still starting, returns exit code 137 with a note on stderr."""
        self._closed = True
        await self.kill()

    async def kill(self) -> None:
        """End the box now (a running command ends with it, exit code 137); the next `run` starts a fresh
        one. Returns once the box's namespace is gone."""
        if self._lock.locked() and self._tree is not None:
            self._tree.kill()  # a command in flight sees the box's socket close, and returns
        async with self._lock:
            await self._stop(graceful=True)

    # -- the process --------------------------------------------------------------------------------------

    async def _account(self, sock: socket.socket) -> None:
        """Add an idle box's CPU times to `BoxCpu` (skipped if it does not answer at once)."""
        if not self._alive():
            return
        try:
            own, commands = await asyncio.wait_for(_ask_times(asyncio.get_running_loop(), sock), 0.5)
        except (asyncio.TimeoutError, OSError, EOFError, struct.error):
            return
        if all(0.0 <= x < 1e7 for x in (own, commands)):  # the box runs as the sandbox: trust it little
            BoxCpu.box_s += own
            BoxCpu.commands_s += commands
            BoxCpu.boxes += 1

    def _alive(self) -> bool:
        if self._proc is None or self._sock is None:
            return False
        try:
            # the box never speaks unasked: readable between commands means EOF, i.e. it died
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    async def _start(self) -> None:
        iso = self.isolation
        argv = [BOX_MOUNT] if self.compiled else [self.python, "-S", "-I", "-c", _BOOT]
        switches_user = self.compiled and iso.privileged and iso.run_as is not None
        if switches_user:
            assert iso.run_as is not None
            argv += ["--user", f"{iso.run_as[0]}:{iso.run_as[1]}"]  # it drops to the uid itself: no setpriv
        launch = iso.launch(argv, cwd="/", env=iso.base_env(), timeout_s=None, limited=False,
                            switches_user=switches_user)  # fmt: skip
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        tree = launch.tree_factory()
        try:
            with reaper.spawning():  # claimed (by attach) before any reaper of this process can look at it
                self._proc = subprocess.Popen(launch.argv, stdin=theirs, stdout=theirs, stderr=subprocess.PIPE,
                                              **launch.popen)  # fmt: skip
                tree.attach(self._proc.pid)
        except OSError as e:
            ours.close()
            tree.release()
            raise BoxUnavailableError(f"cannot start the box: {e}") from e
        finally:
            theirs.close()
            launch.close()
        self._tree = tree
        self.starts += 1
        self._sock = ours
        ours.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            if not self.compiled:
                magic = await asyncio.wait_for(_recv_exact(loop, ours, len(_MAGIC)), _START_TIMEOUT_S)
                await loop.sock_sendall(ours, _box_program(BOX_SOURCE, magic))
            ready = await asyncio.wait_for(_recv_exact(loop, ours, len(_READY) + 4), _START_TIMEOUT_S)
            if ready[: len(_READY)] != _READY:
                raise EOFError
            if self.compiled and iso.box_binary is not None:
                _STARTED_BINARIES.add(iso.box_binary)
        except (asyncio.TimeoutError, EOFError, OSError) as e:
            err = b""
            if self._proc.stderr is not None:
                os.set_blocking(self._proc.stderr.fileno(), False)
                with contextlib.suppress(OSError, TypeError):
                    err = self._proc.stderr.read(4000) or b""
            await self._stop()
            why = err.decode(errors="replace").strip() or type(e).__name__
            raise BoxUnavailableError(f"the box did not start: {why}") from e
        finally:
            if self._proc is not None and self._proc.stderr is not None:
                self._proc.stderr.close()

    async def _stop(self, graceful: bool = False) -> None:
        """End the box and wait until its namespace is gone, so the sandbox's pids are free and nothing of
        it is left. Graceful (an idle box): its CPU times go to `BoxCpu`, then closing its socket makes it
        exit and bubblewrap follows; if that takes over `_GRACEFUL_S`, or otherwise, the outer bubblewrap is
        killed (its init and the whole namespace die with it)."""
        if graceful and self._sock is not None:
            await self._account(self._sock)
        proc, self._proc = self._proc, None
        tree, self._tree = self._tree, None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if proc is None or tree is None:
            return
        try:
            if graceful:
                await tree.settle(_GRACEFUL_S)
            tree.kill()
            await tree.settle(5.0)
        finally:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)
            tree.release()


def encode_run(
    argv: list[str],
    *,
    cwd: str,
    env: dict[str, str],
    stdin: bytes | None,
    timeout_s: float,
    cap: int,
    own: list[tuple[int, int]],
    rlimits: list[tuple[int, int]],
) -> bytes:
    """A framed run request for a box (the format is in `box.c`'s header)."""
    if not argv:
        raise ValueError("argv must not be empty")
    if not (math.isfinite(timeout_s) and timeout_s > 0) or cap < 0:
        raise ValueError(f"timeout_s must be finite and > 0 and cap >= 0, got {timeout_s!r}, {cap!r}")
    # a cap over 4 GiB is no cap at all for one command's output kept in memory: the box keeps up to 4 GiB
    parts = [b"R", struct.pack(">dIB", float(timeout_s), min(cap, 0xFFFFFFFF), stdin is not None)]
    for pairs in (own, rlimits):
        parts.append(struct.pack(">H", len(pairs)))
        parts += [struct.pack(">IQ", which, value) for which, value in pairs]
    strings = (argv, [f"{k}={v}" for k, v in env.items()], [cwd])
    for name, block in zip(("argv", "env", "cwd"), strings, strict=True):
        data = [os.fsencode(x) for x in block]
        if any(b"\0" in x for x in data):
            raise ValueError(f"{name} must not contain NUL bytes")
        joined = b"".join(x + b"\0" for x in data)
        parts.append(struct.pack(">II", len(data), len(joined)) + joined)
    data = stdin or b""
    parts.append(struct.pack(">II", 0, len(data)))
    size = sum(map(len, parts)) + len(data)
    if size > MAX_REQUEST_BYTES:
        raise ValueError(f"stdin, env and argv of a command must total at most {MAX_REQUEST_BYTES} bytes "
                         f"in a box, got {size}")  # fmt: skip
    return b"".join([struct.pack(">I", size), *parts, data])


def _not_started_message(failure: bytes, program: str, cwd: str) -> bytes:
    """How a command that could not start is reported, from the box's "<stage>:<reason>" (the same words as a
    bubblewrap per command: `cannot run 'ls': No such file or directory`)."""
    stage, _, why = failure.decode("utf-8", "replace").partition(":")
    if stage == "chdir":
        return f"cannot enter {cwd!r}: {why}\n".encode("utf-8", "surrogateescape")
    return f"cannot run {program!r}: {why}\n".encode("utf-8", "surrogateescape")


async def _ask_times(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> tuple[float, float]:
    await loop.sock_sendall(sock, struct.pack(">IB", 1, ord("T")))
    return struct.unpack(">dd", await _recv_exact(loop, sock, 16))


def _split_rlimits(rlimits: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(the sandbox's fixed limits, which the box may take on itself; the rest, set per command).

    The pids limit and an address-space limit the box itself fits in are fixed for a sandbox; the CPU
    limit depends on each command's timeout."""
    own, per_exec = [], []
    for which, value in rlimits:
        fixed = which == resource.RLIMIT_NPROC or (which == resource.RLIMIT_AS and value >= _BOX_MIN_AS)
        (own if fixed else per_exec).append((which, value))
    return own, per_exec


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise EOFError("the box closed its socket")
        got += k
    return bytes(buf)
