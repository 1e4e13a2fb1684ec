"""An interactive terminal in a sandbox: a pseudo-terminal pair driven from asyncio.

The service keeps the PTY's master side; the sandboxed process gets the slave side as stdin, stdout, stderr
and controlling terminal. Output is read with an event-loop reader into a bounded queue: when nobody reads,
the reader pauses, the kernel's terminal buffer fills, and the program blocks on write, so an idle client
never makes the service buffer without bound.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import struct
import subprocess
import termios
from collections.abc import AsyncIterator, Callable
from typing import Any

from orchard.env.agent import reaper
from orchard.env.agent.isolation import Launch
from orchard.env.agent.process import ProcessTree, wait_pidfd

_QUEUE_CHUNKS = 64
_READ_SIZE = 65536


def _check_size(cols: int, rows: int) -> None:
    for name, v in (("cols", cols), ("rows", rows)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 65535:
            raise ValueError(f"{name} must be an int in [1, 65535], got {v!r}")


def _set_size(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class LocalPty:
    """A `PtySession` over a local pseudo-terminal; make one with `LocalPty.start`."""

    def __init__(
        self,
        master: int,
        proc: subprocess.Popen[bytes],
        tree: ProcessTree,
        on_close: Callable[[LocalPty], None] | None = None,
    ) -> None:
        self._on_close = on_close
        self._master = master
        try:
            self._pidfd: int | None = os.pidfd_open(proc.pid)
        except OSError:
            self._pidfd = None
        self._proc = proc
        self._tree = tree
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._reading = False
        self._eof = False
        self._closed = False
        self._resume_reading()

    @classmethod
    async def start(
        cls,
        launch: Launch,
        cols: int = 80,
        rows: int = 24,
        on_close: Callable[[LocalPty], None] | None = None,
    ) -> LocalPty:
        """Start `launch` on a new terminal of `cols` x `rows` characters; `on_close(session)` runs on close."""
        _check_size(cols, rows)
        master, slave = os.openpty()
        tree = launch.tree_factory()
        try:
            _set_size(slave, cols, rows)
            popen: dict[str, Any] = dict(launch.popen)
            # subprocess.Popen, not the event loop's subprocess support: uvloop runs preexec_fn before it
            # makes the child a session leader with the terminal on stdin, too early to take the terminal.
            with reaper.spawning():  # claimed (by attach) before any reaper of this process can look at it
                proc = subprocess.Popen(launch.argv, stdin=slave, stdout=slave, stderr=slave, **popen)
                tree.attach(proc.pid)
        except BaseException:
            os.close(master)
            os.close(slave)
            tree.release()
            raise
        os.close(slave)
        os.set_blocking(master, False)
        return cls(master, proc, tree, on_close)

    @property
    def pid(self) -> int:
        return self._proc.pid

    # -- reading ------------------------------------------------------------------------------------------

    def _resume_reading(self) -> None:
        if not self._reading and not self._eof and not self._closed:
            self._loop.add_reader(self._master, self._on_readable)
            self._reading = True

    def _pause_reading(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._master)
            self._reading = False

    def _on_readable(self) -> None:
        # A terminal hands out at most a line discipline's buffer (4095 bytes) per read: read on while more is
        # waiting, so a burst of output (a screenshot's frame) travels as one message, not one per 4 KiB.
        chunks: list[bytes] = []
        size, eof = 0, False
        while size < _READ_SIZE:
            try:
                data = os.read(self._master, _READ_SIZE - size)
            except BlockingIOError:
                break
            except OSError:  # EIO: every slave fd is closed, the terminal's processes are gone
                data = b""
            if not data:
                eof = True
                break
            chunks.append(data)
            size += len(data)
        if chunks:
            self._queue.put_nowait(b"".join(chunks))
        if eof:
            self._eof = True
            self._pause_reading()
            self._queue.put_nowait(None)
        elif self._queue.qsize() >= _QUEUE_CHUNKS:
            self._pause_reading()

    async def read(self) -> AsyncIterator[bytes]:
        """Output chunks until the terminal's processes have all exited (or the session is closed)."""
        while True:
            chunk = await self._queue.get()
            if chunk is None:
                self._queue.put_nowait(None)  # later readers see the end too
                return
            # What else is already queued goes with it (up to one read's size): one message instead of many.
            while len(chunk) < _READ_SIZE and not self._queue.empty():
                more = self._queue.get_nowait()
                if more is None:
                    self._queue.put_nowait(None)  # the end stays last; the next get returns it
                    break
                chunk += more
            if self._queue.qsize() < _QUEUE_CHUNKS // 2:
                self._resume_reading()
            yield chunk

    # -- writing and control ------------------------------------------------------------------------------

    async def write(self, data: bytes) -> None:
        """Send keystrokes (bytes) to the terminal."""
        if not isinstance(data, bytes | bytearray):
            raise ValueError(f"data must be bytes, got {type(data).__name__}")
        if self._closed:
            raise ValueError("the PTY session is closed")
        view = memoryview(bytes(data))
        while view:
            try:
                n = os.write(self._master, view)
            except BlockingIOError:
                await asyncio.sleep(0.005)
                continue
            except OSError as e:
                raise ValueError(f"the terminal is gone: {e.strerror}") from e
            view = view[n:]

    async def resize(self, cols: int, rows: int) -> None:
        """Change the terminal's size; its foreground process gets SIGWINCH."""
        _check_size(cols, rows)
        if not self._closed:
            _set_size(self._master, cols, rows)

    async def close(self) -> None:
        """End every process of the terminal and free it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._tree.kill()
        self._pause_reading()
        await self.wait()
        self._tree.cleanup()
        await self._tree.settle(2.0)
        self._tree.release()
        os.close(self._master)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if not self._eof:
            self._eof = True
            self._queue.put_nowait(None)
        if self._on_close is not None:
            self._on_close(self)

    async def wait(self) -> int:
        """The exit status of the terminal's main process, once it has exited."""
        while self._proc.poll() is None:
            if self._pidfd is not None:
                await wait_pidfd(self._pidfd, 1.0)
            else:
                await asyncio.sleep(0.05)
        return self._proc.returncode
