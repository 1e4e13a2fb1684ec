"""Reaping the processes that sandboxes orphan, so none lingers as a zombie holding a pid.

bubblewrap's outer process exits as soon as its init in the sandbox's pid namespace has reported the
command's exit status, before that init has itself exited. The init is then an orphan, handed to the nearest
child subreaper or else to the host's pid 1, which reaps it when it gets round to it: some hosts take seconds,
and a container whose pid 1 is this service never does. Until it is reaped, the init holds a pid, and in a
user-namespace sandbox it runs as the sandbox's uid, so it counts against that uid's `RLIMIT_NPROC`: a
sandbox's own earlier commands would eat its pids limit.

The same holds for what a process-group sandbox's command leaves behind. So a process that launches
bubblewrap sandboxes, or process-group sandboxes with uids of their own, makes itself a child subreaper
(`adopt_orphans`, called by `Isolation`) and reaps what it adopts:

- the init of a pid namespace below its own (`reap_init` after a launch's namespace is gone, and a sweep
  now and then); no process this service forks itself can be that, so its exit status is nobody else's;
- zombies running as the uid of a process-group sandbox (`track_uid`; a root service gives each sandbox a
  uid of its own), the children that its commands left behind and the kill ended (`reap_orphans` after each
  such command); the main processes the agent waits for itself are claimed while it spawns them
  (`spawning`, `claim`) until it has waited for them, and never taken.

Being a subreaper is a property of the whole process. Other orphans of an embedding program (one that runs
the local backend in-process) come to it too and are not reaped here, because their exit status may be
somebody's to collect; they stay zombies until that program waits for them or exits.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Iterator

__all__ = [
    "adopt_orphans",
    "adopting",
    "claim",
    "reap_child_of_uid",
    "reap_init",
    "reap_orphans",
    "reap_soon",
    "spawning",
    "stop_adopting",
    "sweep_now_and_then",
    "track_uid",
    "unclaim",
]

_PR_SET_CHILD_SUBREAPER = 36
_SWEEP_EVERY_S = 2.0

_lock = threading.RLock()
_adopting: bool | None = None  # None: not tried yet
_claimed: collections.Counter[int] = collections.Counter()  # counted: a reused pid may be claimed twice
_tracked: set[int] = set()
_last_sweep = 0.0
_depth: int | None = None  # how many pid namespaces deep this process is


def _forget_after_fork() -> None:
    # a forked child is no subreaper (the kernel does not pass the flag on) and has none of these children;
    # the lock may have been held by a thread the child does not have
    global _lock, _adopting, _last_sweep, _depth
    _lock = threading.RLock()
    _adopting, _last_sweep, _depth = None, 0.0, None
    _claimed.clear()
    _tracked.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _set_subreaper(on: bool) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def adopt_orphans() -> bool:
    """Make this process a child subreaper, once; whether it is one. False where the kernel refuses."""
    global _adopting
    with _lock:
        if _adopting is None:
            _adopting = _set_subreaper(True)
        return _adopting


def stop_adopting() -> None:
    """Undo `adopt_orphans` (for a caller that adopted only for a moment, like the bubblewrap probe)."""
    global _adopting
    with _lock:
        if _adopting:
            _set_subreaper(False)
        _adopting = None


def adopting() -> bool:
    """Whether this process is a child subreaper (set by `adopt_orphans`)."""
    return bool(_adopting)


@contextlib.contextmanager
def spawning() -> Iterator[None]:
    """Hold off every reaper of this process while the caller starts a child and `claim`s it, so a child
    that exits at once is not taken before it is claimed."""
    with _lock:
        yield


def claim(pid: int) -> None:
    """`pid` is a child the caller will wait for itself: never reap it here (until `unclaim`)."""
    with _lock:
        _claimed[pid] += 1


def unclaim(pid: int) -> None:
    """The caller has waited for `pid` (or gives it up)."""
    with _lock:
        if _claimed.get(pid, 0) <= 1:
            _claimed.pop(pid, None)
        else:
            _claimed[pid] -= 1


def track_uid(uid: int) -> None:
    """`uid` is a process-group sandbox's own: exited children of this process that run as it are what its
    commands left behind, for `reap_orphans` to reap (claimed ones aside)."""
    if not isinstance(uid, int) or uid <= 0:
        raise ValueError(f"uid must be a positive int (a sandbox's own, not root's), got {uid!r}")
    with _lock:
        _tracked.add(uid)


def _status_field(pid: int, name: str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return line.split()[1:]
    except OSError:
        return None
    return None


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first, then ppid, ...)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _zombie_child(pid: int) -> bool:
    """Whether `pid` is an exited, unreaped child of this process (then only this process can reap it, so
    the pid cannot be reused under us)."""
    fields = _stat(pid)
    return fields is not None and fields[0] == "Z" and int(fields[1]) == os.getpid()


def _is_deeper_init(pid: int) -> bool:
    global _depth
    if _depth is None:
        _depth = len(_status_field(os.getpid(), "NSpid") or ["x"])
    nspid = _status_field(pid, "NSpid")
    return nspid is not None and len(nspid) > _depth and nspid[-1] == "1"


def _of_uid(pid: int, uids: set[int] | frozenset[int]) -> bool:
    uid = _status_field(pid, "Uid")
    return bool(uids) and uid is not None and int(uid[0]) in uids


def _reap_if(pid: int, *, init: bool, uids: set[int] | frozenset[int]) -> bool:
    """Reap `pid` if, checked under the lock, it is an exited unclaimed child of this process that is a
    deeper namespace's init (`init`) or runs as one of `uids`; whether it did."""
    with _lock:
        if pid in _claimed or not _zombie_child(pid):
            return False
        if not ((init and _is_deeper_init(pid)) or _of_uid(pid, uids)):
            return False
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return False
    return done == pid


def reap_init(pid: int) -> bool:
    """Reap `pid` if it is an exited child of this process and the init of a pid namespace below this
    process's (a sandbox init that bubblewrap orphaned); whether it did."""
    if not isinstance(pid, int) or pid <= 0:
        raise ValueError(f"pid must be a positive int, got {pid!r}")
    return _reap_if(pid, init=True, uids=frozenset())


def reap_child_of_uid(pid: int, uid: int) -> bool:
    """Reap `pid` if it is an exited, unclaimed child of this process running as tracked `uid`."""
    if not isinstance(pid, int) or pid <= 0:
        raise ValueError(f"pid must be a positive int, got {pid!r}")
    return uid in _tracked and _reap_if(pid, init=False, uids=frozenset((uid,)))


def _children() -> list[int]:
    me = os.getpid()
    out: list[int] = []
    found = False
    try:
        tasks = os.listdir(f"/proc/{me}/task")
    except OSError:
        tasks = []
    for tid in tasks:
        try:
            with open(f"/proc/{me}/task/{tid}/children") as f:
                found = True
                out += [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            continue
    if found:
        return out
    # a kernel without CONFIG_PROC_CHILDREN: every process's parent, from /proc/<pid>/stat
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and int(fields[1]) == me:
                out.append(int(entry))
    return out


def reap_orphans(*, wait_s: float = 0.0) -> int:
    """Reap every exited child of this process that is a sandbox init (see `reap_init`) or runs as a
    tracked uid (`track_uid`) and is not claimed; how many it reaped. With `wait_s`, keep at it for up to
    that long while an adopted init is still exiting. Nothing to do unless this process adopts orphans."""
    if not (isinstance(wait_s, (int, float)) and 0 <= wait_s < float("inf")):
        raise ValueError(f"wait_s must be a finite number >= 0, got {wait_s!r}")
    if not _adopting:
        return 0
    n = 0
    deadline = time.monotonic() + wait_s
    while True:
        exiting = False
        for pid in _children():
            if _zombie_child(pid):
                n += _reap_if(pid, init=True, uids=_tracked)
            elif wait_s > 0 and _is_deeper_init(pid):
                exiting = True
        if not exiting or time.monotonic() >= deadline:
            return n
        time.sleep(0.005)


def sweep_now_and_then() -> int:
    """`reap_orphans()` at most every couple of seconds, for what no launch reaped itself: the init of a
    cancelled exec (which stops waiting for its namespace), a left-behind child that finished exiting only
    after its exec's own sweep. How many it reaped."""
    global _last_sweep
    now = time.monotonic()
    if not _adopting or now - _last_sweep < _SWEEP_EVERY_S:
        return 0
    _last_sweep = now
    return reap_orphans()


def reap_soon(delays_s: tuple[float, ...] = (0.05, 0.5, 2.0)) -> None:
    """`reap_orphans()` after each of `delays_s` on the running event loop (none: nothing): for a launch
    that was killed and let go without waiting for its namespace (a cancelled exec)."""
    if not _adopting:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    for delay in delays_s:
        loop.call_later(delay, reap_orphans)
