"""Run one process to completion or timeout with bounded, capped output capture.

The rules an exec follows, whatever the isolation:

- stdout and stderr are each kept up to `max_output_bytes`; the rest is read and dropped (so a command that
  prints gigabytes costs CPU, never memory) and the stream's `*_truncated` flag is set.
- On timeout the whole process tree ends (how is the `ProcessTree`'s business: killing bubblewrap ends the
  pid namespace; without it, the process group plus every process carrying the exec's marker is killed), the
  result has `exit_code` 124 and `timed_out` True, and the call returns within the timeout plus a small slack.
- When the main process exits, the exec returns at once: whatever it left running (background jobs, `setsid`
  or double-forked daemons) is ended, so no process outlives its exec and none can hold the exec open by
  keeping stdout or stderr. A command that wants a server must start and use it within one exec (or a PTY).
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any, Protocol

from orchard.env.agent import reaper
from orchard.env.backends.base import ExecResult

TIMEOUT_EXIT_CODE = 124
"""Exit code reported for a timed-out command, as `timeout(1)` does."""

_PIPE_DRAIN_S = 2.0
"""After the tree is ended, how long to wait for the output pipes to reach EOF before closing them."""


class ProcessTree(Protocol):
    """Knows how to end every process one exec started."""

    def attach(self, pid: int) -> None:
        """Called once with the main process's pid, right after it was started."""
        ...

    def kill(self) -> None:
        """End the whole tree (the main process may or may not have exited)."""
        ...

    def cleanup(self) -> None:
        """End whatever the tree left behind after its main process exited."""
        ...

    async def settle(self, timeout_s: float) -> None:
        """Wait (at most timeout_s) until the ended processes are really gone, so that their slots in the
        pids limit are free again when the next command starts."""
        ...

    def release(self) -> None:
        """Free what `attach` acquired; the tree is not used afterwards."""
        ...


class PidfdProcess:
    """Signals the main process through a pidfd, so a recycled pid is never hit."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self._pidfd: int | None = None
        self._claimed = False

    def attach(self, pid: int) -> None:
        self.pid = pid
        reaper.claim(pid)  # its exit status is the launcher's, not for `reaper` to take
        self._claimed = True
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError:
            self._pidfd = None

    def kill_main(self) -> None:
        if self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def settle(self, timeout_s: float) -> None:
        return None

    def release(self) -> None:
        if self.pid is not None and self._claimed:
            reaper.unclaim(self.pid)
            self._claimed = False
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


async def wait_pidfd(pidfd: int, timeout_s: float | None) -> bool:
    """Wait until the process behind `pidfd` has exited (the fd turns readable); False on timeout (None:
    no timeout)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    loop.add_reader(pidfd, lambda: done.done() or done.set_result(None))
    try:
        await asyncio.wait_for(done, timeout_s)
        return True
    except asyncio.TimeoutError:
        return False
    finally:
        loop.remove_reader(pidfd)


class _Capture:
    """Keeps the first `cap` bytes of stdout (fd 1) and stderr (fd 2), counts and drops the rest."""

    def __init__(self, cap: int, loop: asyncio.AbstractEventLoop) -> None:
        self.cap = cap
        self.data = {1: bytearray(), 2: bytearray()}
        self.truncated = {1: False, 2: False}
        self.drained: asyncio.Future[None] = loop.create_future()
        self._open = {1, 2}

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        buf = self.data[fd]
        room = self.cap - len(buf)
        if room > 0:
            buf += data[:room]
        if len(data) > room:
            self.truncated[fd] = True

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self._open.discard(fd)
        if not self._open and not self.drained.done():
            self.drained.set_result(None)


class _Pipes:
    """The command's stdin, stdout and stderr, watched by the running loop; the one owner of their fds.

    Plain readers and writers rather than the loop's pipe transports: a transport closes its fd itself, later,
    while `subprocess.Popen`'s file object would close the same fd number again when collected (uvloop),
    by then perhaps someone else's. Here each fd is closed once, by closing its file object.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, proc: subprocess.Popen[bytes], capture: _Capture,
                 stdin: bytes | None) -> None:  # fmt: skip
        self.loop = loop
        self.capture = capture
        self.readers: dict[int, tuple[int, Any]] = {}  # fd -> (1 stdout / 2 stderr, file object)
        self.writer: tuple[int, Any, memoryview] | None = None  # fd, file object, bytes still to write
        for n, pipe in ((1, proc.stdout), (2, proc.stderr)):
            fd = pipe.fileno()  # type: ignore[union-attr]
            os.set_blocking(fd, False)
            self.readers[fd] = (n, pipe)
            loop.add_reader(fd, self._readable, fd)
        if proc.stdin is not None:
            if stdin:
                fd = proc.stdin.fileno()
                os.set_blocking(fd, False)
                self.writer = (fd, proc.stdin, memoryview(stdin))
                loop.add_writer(fd, self._writable)
            else:
                proc.stdin.close()  # EOF at once

    def _readable(self, fd: int) -> None:
        n, _ = self.readers[fd]
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self.capture.pipe_data_received(n, data)
            return
        self._drop_reader(fd)
        self.capture.pipe_connection_lost(n, None)

    def _writable(self) -> None:
        assert self.writer is not None
        fd, pipe, data = self.writer
        try:
            data = data[os.write(fd, data[: 1 << 16]) :]
        except BlockingIOError:
            return
        except OSError:  # the command closed its stdin: the rest is dropped
            data = data[:0]
        self.writer = (fd, pipe, data)
        if not data:
            self._drop_writer()  # closing the pipe is the command's EOF

    def _drop_reader(self, fd: int) -> None:
        _, pipe = self.readers.pop(fd)
        self.loop.remove_reader(fd)
        pipe.close()

    def _drop_writer(self) -> None:
        assert self.writer is not None
        fd, pipe, _ = self.writer
        self.writer = None
        self.loop.remove_writer(fd)
        pipe.close()

    def close(self) -> None:
        for fd in list(self.readers):
            self._drop_reader(fd)
        if self.writer is not None:
            self._drop_writer()


def validate_limits(timeout_s: float, max_output_bytes: int) -> None:
    """Raise ValueError unless timeout_s is finite and > 0 and max_output_bytes an int >= 0."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not math.isfinite(timeout_s):
        raise ValueError(f"timeout_s must be a finite number, got {timeout_s!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if isinstance(max_output_bytes, bool) or not isinstance(max_output_bytes, int) or max_output_bytes < 0:
        raise ValueError(f"max_output_bytes must be an int >= 0, got {max_output_bytes!r}")


async def run_captured(
    argv: list[str],
    *,
    tree_factory: Callable[[], ProcessTree],
    stdin: bytes | None = None,
    timeout_s: float = 600.0,
    max_output_bytes: int = 1 << 20,
    on_start: Callable[[ProcessTree], None] | None = None,
    on_end: Callable[[ProcessTree], None] | None = None,
    **popen_kwargs: Any,
) -> ExecResult:
    """Run `argv` and capture its output under the rules of this module.

    Args:
        argv: program and arguments (argv[0] is looked up on PATH of `popen_kwargs["env"]`).
        tree_factory: makes the `ProcessTree` that ends this run's processes.
        stdin: bytes fed to the process's stdin, then closed; None gives it /dev/null.
        timeout_s: wall-clock limit in seconds (> 0).
        max_output_bytes: cap per stream in bytes (>= 0).
        on_start, on_end: called with the tree once the process runs / after it is gone (the caller's
            registry of live processes, so a sandbox delete can end them).
        popen_kwargs: passed to `subprocess.Popen` (env, cwd, user, preexec_fn, start_new_session, ...).

    Returns:
        ExecResult; exit_code is the process's status, -N if killed by signal N, 124 on timeout, 127 if the
        program could not be started.
    """
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"argv must be a non-empty list of strings, got {argv!r}")
    validate_limits(timeout_s, max_output_bytes)
    loop = asyncio.get_running_loop()
    start = time.monotonic()
    capture = _Capture(max_output_bytes, loop)
    tree = tree_factory()
    # subprocess.Popen rather than the loop's subprocess support: Popen starts the child with vfork where it
    # can (uvloop's libuv forks the whole service, ~1 ms more per command), and a pidfd tells the exit
    # without a watcher thread per child.
    with reaper.spawning():  # claimed (by attach) before any reaper of this process can look at it
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen_kwargs)  # fmt: skip
        except (FileNotFoundError, PermissionError, NotADirectoryError) as e:
            tree.release()
            return ExecResult(
                exit_code=127,
                stdout=b"",
                stderr=f"cannot run {argv[0]!r}: {e.strerror}\n".encode(),
                duration_s=time.monotonic() - start,
            )
        except BaseException:
            tree.release()
            raise
        tree.attach(proc.pid)
    pidfd = os.pidfd_open(proc.pid)
    if on_start is not None:
        on_start(tree)
    pipes: _Pipes | None = None
    timed_out = False
    try:
        pipes = _Pipes(loop, proc, capture, stdin)
        if not await wait_pidfd(pidfd, timeout_s):
            timed_out = True
            tree.kill()
            await wait_pidfd(pidfd, None)
        proc.wait()  # reaps: the pidfd said it exited
        tree.cleanup()
        await tree.settle(_PIPE_DRAIN_S)
        try:
            await asyncio.wait_for(asyncio.shield(capture.drained), _PIPE_DRAIN_S)
        except asyncio.TimeoutError:
            pass  # a process we could not see holds a pipe; stop listening rather than wait for it
    except BaseException:
        # Cancelled (client gone, service stopping): never leave the tree running.
        if proc.poll() is None:
            tree.kill()
        tree.cleanup()
        raise
    finally:
        if pipes is not None:
            pipes.close()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):  # those _Pipes did not take (it failed half-way)
            if pipe is not None:
                pipe.close()
        os.close(pidfd)
        tree.release()
        if on_end is not None:
            on_end(tree)
    code = proc.returncode
    return ExecResult(
        exit_code=TIMEOUT_EXIT_CODE if timed_out else (code if code is not None else -signal.SIGKILL),
        stdout=bytes(capture.data[1]),
        stderr=bytes(capture.data[2]),
        stdout_truncated=capture.truncated[1],
        stderr_truncated=capture.truncated[2],
        timed_out=timed_out,
        duration_s=time.monotonic() - start,
    )
