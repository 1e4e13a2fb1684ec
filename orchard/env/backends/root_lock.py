"""One service per sandbox root: an exclusive lock on `<root>/.lock` while a `LocalBackend` on the root lives.

The local backend keeps the books of its sandboxes' processes (their boxes, running commands) in memory. Two
services on one root would each keep their own: a delete through one left the other's processes alive, and once
the id was made again, the other ran its commands in the deleted workspace. So the second is refused
(`RootInUseError`) rather than half-served. Several replicas of the service share a backend that is not bound
to one machine (Kubernetes), never a local root.

The lock is flock(2) on a file under the root: the kernel drops it when its process ends, however it ends
(SIGKILL too), so a restarted service never finds a stale lock. Its file says which process holds it. Backends in
one process share the lock (one service's: a test, a recipe beside its own service): it is counted, and
released when the last of them closes. Its descriptor is not inherited by the processes a backend starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading

from orchard.env.backends.base import BackendError

LOCK_FILE = ".lock"
"""The lock's file under the root (a dot name: never taken for a sandbox)."""

_held: dict[str, tuple[int, int]] = {}  # real root path -> (descriptor, backends of this process holding it)
_guard = threading.Lock()


class RootInUseError(BackendError):
    """Another process serves sandboxes from this root."""


def acquire(root: str) -> str:
    """Take the root's lock for this process (again, if it already holds it); returns the key to `release`.

    Raises:
        RootInUseError: another process holds it; the message names the root and, when known, that process.
    """
    key = os.path.realpath(root)
    with _guard:
        if key in _held:
            fd, count = _held[key]
            _held[key] = (fd, count + 1)
            return key
        fd = os.open(os.path.join(key, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            who = f"pid {holder}" if holder.isdigit() else "another process"
            raise RootInUseError(
                f"sandbox root {root} is in use by another service ({who}): two services on one root would each "
                "track only their own sandboxes' processes. Stop that one first, or give this one a root of its "
                "own; replicas of one service share a Kubernetes backend, not a local root") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held[key] = (fd, 1)
        return key


def release(key: str) -> None:
    """Give back one hold of `acquire(...)`'s key; the lock goes with the last."""
    with _guard:
        fd, count = _held.pop(key, (-1, 0))
        if count > 1:
            _held[key] = (fd, count - 1)
        elif fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)  # the flock ends with the last descriptor of its open file
