"""How a sandbox's processes are isolated and limited: bubblewrap, or a process-group fallback.

**Bubblewrap** (the default where it works). Every process started for the sandbox (by default only its
box, `orchard.env.agent.box_client`, which then starts the sandbox's commands; a PTY, or every command with
`box=False`) runs as

    bwrap --unshare-user --unshare-pid --unshare-net --unshare-ipc --unshare-uts --die-with-parent
          --new-session --tmpfs / <the image's top-level entries, read-only> --tmpfs <service dir>
          --bind <home> /home --ro-bind <passwd> /etc/passwd --ro-bind <group> /etc/group
          [--ro-bind <shared folder> /.orchard-shared/<name> ...] [--ro-bind <compiled box> /.orchard-box] --proc /proc --dev /dev --tmpfs /tmp
          --bind <workspace> <mount> --remount-ro / --chdir <cwd> -- <command>

started as the sandbox's own non-root uid (when the service is root, each sandbox gets a uid of its own, so
the processes of one sandbox cannot signal or read another's). When the service is root and the image has
setpriv and prlimit, bubblewrap is instead started as root without the user namespace and the command drops
to the sandbox's uid inside (`privileged`, see `Isolation`): same isolation, half the CPU per command. The new root is a read-only tmpfs with the
image's top-level directories bound read-only on it (binding "/" itself would leave no place for the
workspace's mount point), a fresh /proc, /dev and /tmp, the workspace read-write at its mount point, and
the service's sandbox directory hidden under an empty tmpfs. `--unshare-net` leaves only a loopback device:
no network unless the sandbox was created with `network=True`. Each command gets its own pid namespace whose
init is bubblewrap's; killing the outer bubblewrap process kills that init (`--die-with-parent`) and the
kernel then kills every process in the namespace, however it detached (`setsid`, double fork, `nohup`).

**Limits** are rlimits, set before bubblewrap starts and inherited by everything in the sandbox:
`RLIMIT_NPROC` = pids (+2 for bubblewrap's own two processes; threads count as processes; counted per uid,
so it is only set when the service is root and each sandbox has a uid of its own), `RLIMIT_AS` = memory_mb
per process (address space, not resident memory: a whole-sandbox memory cap needs cgroups), `RLIMIT_CPU` =
ceil(cpu x timeout) CPU seconds per process for an exec (a core limit spread over the command's wall-clock
budget; PTY sessions have no CPU limit). cgroups are not used: on the machines this was built on only
cgroup v1 is mounted and the service cannot assume it may create groups; rlimits work for any non-root uid.
The uid switch and the rlimits are done by the host's `setpriv` and `prlimit` (util-linux) as exec wrappers
in front of bubblewrap when both exist (the child can then be spawned with vfork, which is cheaper in a
large service process), else by a Python preexec function; PTYs always use the latter.

**Process-group fallback** (no bubblewrap, or user namespaces disabled). Commands run directly on the host,
as the sandbox's uid when the service is root, in a new session, with the same rlimits and an environment
marker `ORCHARD_EXEC_MARK=<random>`. A timeout (or the main process's exit) kills the process group and then
every process whose environment carries the marker, until none is left, which also ends `setsid` and
double-forked children. This is weaker isolation: the host file system is visible with the uid's own rights,
the network is shared, and a process that clears its environment and leaves the group escapes. The backend
logs a warning when it falls back and reports `isolation = "process-group"`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import math
import os
import resource
import secrets
import shutil
import signal
import subprocess
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import PurePosixPath
from typing import Any

from orchard.env.agent import reaper
from orchard.env.agent.box_build import BOX_MOUNT
from orchard.env.agent.files import Workspace
from orchard.env.agent.process import PidfdProcess, ProcessTree, wait_pidfd

BUBBLEWRAP = "bubblewrap"
PROCESS_GROUP = "process-group"
ISOLATION_MODES = (BUBBLEWRAP, PROCESS_GROUP)

MARK_VAR = "ORCHARD_EXEC_MARK"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_BWRAP_OWN_PROCESSES = 2
_SPECIAL_TOP = frozenset({"proc", "dev", "tmp"})
_BOX_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")


@dataclass(frozen=True)
class Limits:
    """Resource limits of a sandbox; None means unlimited.

    Attributes:
        pids: processes (and threads) the sandbox may have at once. Default 256.
        memory_mb: address space per process in MiB (RLIMIT_AS). Default 4096.
        cpu: CPU cores; an exec may use ceil(cpu x timeout_s) CPU seconds per process. Default None.
    """

    pids: int | None = 256
    memory_mb: int | None = 4096
    cpu: float | None = None

    def __post_init__(self) -> None:
        for name in ("pids", "memory_mb"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        c = self.cpu
        if c is not None and (
            isinstance(c, bool) or not isinstance(c, int | float) or not math.isfinite(c) or c <= 0
        ):
            raise ValueError(f"cpu must be a positive finite number or None, got {c!r}")


def probe_bubblewrap(
    run_as: tuple[int, int] | None = None, bwrap: str | None = None, *, privileged: bool = False
) -> str | None:
    """Check that bubblewrap can create the namespaces a sandbox needs.

    Args:
        run_as: (uid, gid) the sandbox runs as (honoured when the caller is root).
        bwrap: the executable (default: found on PATH).
        privileged: probe the root-started variant (bubblewrap as root, the command dropping to `run_as`
            with the host's setpriv) instead of bubblewrap started as `run_as` in a user namespace.

    Returns:
        None when it works, otherwise the reason it does not (for the fallback warning).
    """
    exe = bwrap or shutil.which("bwrap")
    if exe is None:
        return "bwrap is not installed"
    if privileged:
        tools = rootfs_tools("/")
        if os.geteuid() != 0 or run_as is None or tools is None:
            return "root-started bubblewrap needs root, a sandbox uid, and setpriv and prlimit"
        inner = [tools[0], f"--reuid={run_as[0]}", f"--regid={run_as[1]}", "--clear-groups", "--"]
    else:
        inner = []
    argv = [exe, *([] if privileged else ["--unshare-user"]), "--unshare-pid", "--unshare-net",
            "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--new-session", "--tmpfs", "/",
            *_top_level_args("/"), "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--remount-ro", "/",
            "--", *inner, "true"]  # fmt: skip
    kwargs: dict[str, Any] = {}
    if run_as is not None and os.geteuid() == 0 and not privileged:
        kwargs.update(user=run_as[0], group=run_as[1], extra_groups=[])
    # the probe's sandbox init, like every other, comes to this process and is reaped here; the process
    # stays a subreaper only if it was one before (an Isolation makes it one when it needs to be)
    was_adopting = reaper.adopting()
    reaper.adopt_orphans()
    try:
        r = subprocess.run(
            argv, capture_output=True, timeout=30, cwd="/", env={"PATH": DEFAULT_PATH}, **kwargs
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"bwrap could not run: {e}"
    finally:
        reaper.reap_orphans(wait_s=1.0)
        if not was_adopting:
            reaper.stop_adopting()
    if r.returncode != 0:
        return f"bwrap failed (exit {r.returncode}): {r.stderr.decode(errors='replace').strip()}"
    return None


@lru_cache(maxsize=64)
def _top_level_args(rootfs: str) -> tuple[str, ...]:
    """bwrap arguments that recreate the image's top level read-only on a tmpfs root.

    Computed once per root file system per process: a directory added to the top of an image later is not
    seen by sandboxes until the service restarts.
    """
    args: list[str] = []
    for name in sorted(os.listdir(rootfs)):
        if name in _SPECIAL_TOP:
            continue
        src = os.path.join(rootfs, name)
        dst = "/" + name
        if os.path.islink(src):
            args += ["--symlink", os.readlink(src), dst]
        else:
            args += ["--ro-bind", src, dst]
    return tuple(args)


@lru_cache(maxsize=16)
def _host_program(name: str) -> str | None:
    """`shutil.which(name)` on the service's PATH, looked up once per process (an Isolation is made for every
    sandbox, and each lookup stats every PATH directory)."""
    return shutil.which(name)


@lru_cache(maxsize=64)
def rootfs_tools(rootfs: str) -> tuple[str, str] | None:
    """Sandbox paths of `setpriv` and `prlimit` in the image, or None if it lacks either."""
    found = []
    for tool in ("setpriv", "prlimit"):
        for d in ("usr/bin", "bin", "usr/sbin", "sbin"):
            if os.path.lexists(os.path.join(rootfs, d, tool)):
                found.append(f"/{d}/{tool}")
                break
        else:
            return None
    return found[0], found[1]


def _children(pid: int) -> list[int]:
    """The child pids of the single-threaded process `pid` (none where the kernel lacks
    CONFIG_PROC_CHILDREN, which the common distributions' kernels have)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


class BubblewrapTree(PidfdProcess):
    """Killing the outer bubblewrap and its child, the namespace's init, kills every process in the sandbox.

    bubblewrap exits when the command does, and its init dies with it (--die-with-parent); the kernel then
    kills the rest of the namespace. `settle` waits for the init to be gone, which only happens once every
    other process of the namespace has been reaped: bubblewrap reports the init's pid on `--info-fd`. The
    outer bubblewrap does not wait for its init, so the init ends as an orphan of this process (a child
    subreaper, see `reaper`), which reaps it here.
    """

    def __init__(self, info_fd: int) -> None:
        super().__init__()
        self._info_fd = info_fd
        self._init: int | None = None
        self._init_reaped = False

    def kill(self) -> None:
        # Killed in its first milliseconds (a sandbox deleted while the command starts), the outer bubblewrap
        # may have cloned the init, which sets --die-with-parent only a moment later: killed alone, it would
        # leave the init, and the command, running. So it is stopped first (it clones no more; its children's
        # pids stay theirs), its children are killed, then it.
        if self._pidfd is not None and self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGSTOP)
            for child in _children(self.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(child, signal.SIGKILL)
        self.kill_main()

    def cleanup(self) -> None:
        return None

    def _init_pid(self) -> int | None:
        if self._init is not None:
            return self._init
        try:
            raw = os.read(self._info_fd, 4096)
        except OSError:
            return None
        try:
            self._init = int(json.loads(raw)["child-pid"])
        except (ValueError, KeyError, TypeError):
            return None
        return self._init

    async def settle(self, timeout_s: float) -> None:
        pid = self._init_pid()
        if pid is None or self._init_reaped:
            return
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return  # already gone
        try:
            exited = await wait_pidfd(pidfd, timeout_s)
        finally:
            os.close(pidfd)
        if exited:
            self._init_reaped = reaper.reap_init(pid)
        reaper.sweep_now_and_then()

    def release(self) -> None:
        super().release()
        if self._init is None:
            reaper.reap_soon()  # `settle` was skipped (a cancelled exec): the init is still dying
        elif not self._init_reaped:
            self._init_reaped = reaper.reap_init(self._init)
        if self._info_fd >= 0:
            os.close(self._info_fd)
            self._info_fd = -1


_REAP_KILLED_S = 0.5
"""How long a process-group exec waits for the processes it killed to be reaped (they die in milliseconds)."""


class MarkedGroupTree(PidfdProcess):
    """The process group plus every process whose environment carries this exec's marker."""

    def __init__(self, mark: str, uid: int | None) -> None:
        super().__init__()
        self.needle = f"\x00{MARK_VAR}={mark}\x00".encode()
        self.uid = uid
        self._killed: set[int] = set()

    def kill(self) -> None:
        self.kill_main()
        self.cleanup()

    def cleanup(self) -> None:
        if self.pid is not None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        kill_marked(self.needle, self.uid, self._killed)

    async def settle(self, timeout_s: float) -> None:
        # Killed processes cannot fork any more, so repeated passes reach a fixed point even under a fork
        # bomb; a child forked during the previous pass is caught by the next.
        deadline = time.monotonic() + timeout_s
        while kill_marked(self.needle, self.uid, self._killed) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        if self.uid is not None and reaper.adopting():
            # What was killed came to this process (see `reaper`); one stops being seen as marked before it
            # has finished exiting, so wait (briefly) until each is reaped or gone.
            deadline = time.monotonic() + min(timeout_s, _REAP_KILLED_S)
            while True:
                self._killed = {p for p in self._killed
                                if not reaper.reap_child_of_uid(p, self.uid) and os.path.exists(f"/proc/{p}")}  # fmt: skip
                if not self._killed or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(0.005)
        reaper.reap_orphans()  # and what ended by itself after its shell did


def marker_needle(prefix: str) -> bytes:
    """What the environment of every process launched with `mark_prefix=prefix` contains."""
    return f"\x00{MARK_VAR}={prefix}".encode()


def kill_marked(needle: bytes, uid: int | None, killed: set[int] | None = None) -> int:
    """SIGKILL every live process (of `uid`, if given) whose environment contains `needle`; the count. Their
    pids are added to `killed`, if given."""
    n = 0
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            if uid is not None and os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in b"\x00" + env:
            try:
                os.kill(int(entry), signal.SIGKILL)
                n += 1
                if killed is not None:
                    killed.add(int(entry))
            except (ProcessLookupError, PermissionError):
                pass
    return n


@dataclass(frozen=True)
class Launch:
    """What `run_captured` or a PTY needs to start one sandboxed process; `close()` it once started."""

    argv: list[str]
    popen: dict[str, Any]
    tree_factory: Callable[[], ProcessTree]
    fds: tuple[int, ...] = ()
    """Descriptors passed to the child (the workspace's directory fd), owned by this launch."""

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass


class Isolation:
    """Turns a command into a sandboxed launch for one sandbox.

    Args:
        workspace: the sandbox's workspace (its `mount` is where processes see it).
        mode: BUBBLEWRAP or PROCESS_GROUP.
        rootfs: host directory used as the sandbox's root file system ("/" = the host's), bubblewrap only.
        network: share the host's network (bubblewrap only; the fallback always shares it).
        limits: the sandbox's `Limits`.
        run_as: (uid, gid) the processes run as; only honoured when the service is root.
        hide: host directories covered by an empty tmpfs inside the sandbox (e.g. the service's state).
        bwrap: path of the bwrap executable (default: found on PATH).
        home: a host directory holding the sandbox's home `sandbox/`, bound read-write at /home (so HOME is
            /home/sandbox, kept across commands and outside the workspace, and the host's /home is hidden);
            None makes the workspace the home.
        ro_files: (host file, sandbox path) pairs bound read-only over the image (e.g. an /etc/passwd that
            names the sandbox's uid); bubblewrap only.
        ro_dirs: (host directory, sandbox path) pairs bound read-only (the backend's shared folders); the
            sandbox path must lie where the image's top level has nothing; bubblewrap only.
        privileged: with bubblewrap, a root service and a sandbox uid: start bubblewrap as root (no user
            namespace; about half the CPU per command) and drop to the sandbox uid inside with the image's
            own setpriv and prlimit (`no_new_privs` and nosuid mounts keep set-uid programs inert). None
            (default) does so when the image has both tools, False never does.
        mark_prefix: starts the fallback's environment marker, so that a restarted service can find the
            processes its predecessor left (`kill_marked(marker_needle(prefix), None)`).
        use_exec_wrappers: switch uid and set rlimits with the host's `setpriv` and `prlimit` (util-linux)
            when both exist, else (or when False, and always for a PTY) in a Python preexec function.
        box_binary: host path of the compiled box (`orchard.env.agent.box_build`), bound read-only at
            `BOX_MOUNT` in the sandbox so the box runs without the image's python3; bubblewrap only. Its
            directories must be searchable by the sandbox's uid.
    """

    def __init__(
        self,
        workspace: Workspace,
        *,
        mode: str = BUBBLEWRAP,
        rootfs: str = "/",
        network: bool = False,
        limits: Limits | None = None,
        run_as: tuple[int, int] | None = None,
        hide: tuple[str, ...] = (),
        bwrap: str | None = None,
        use_exec_wrappers: bool = True,
        mark_prefix: str = "",
        home: str | None = None,
        ro_files: tuple[tuple[str, str], ...] = (),
        ro_dirs: tuple[tuple[str, str], ...] = (),
        privileged: bool | None = None,
        box_binary: str | None = None,
    ) -> None:
        if mode not in ISOLATION_MODES:
            raise ValueError(f"mode must be one of {ISOLATION_MODES}, got {mode!r}")
        if not os.path.isdir(rootfs):
            raise ValueError(f"rootfs must be an existing directory, got {rootfs!r}")
        self.workspace = workspace
        self.mode = mode
        self.rootfs = os.path.abspath(rootfs)
        self.network = bool(network)
        self.limits = limits or Limits()
        self.run_as = run_as if os.geteuid() == 0 else None
        self.hide = tuple(h for h in hide if _visible_in_rootfs(h, self.rootfs))
        if not isinstance(mark_prefix, str) or not all(c.isalnum() or c in "-_" for c in mark_prefix):
            raise ValueError(f"mark_prefix must be letters, digits, '-' or '_', got {mark_prefix!r}")
        self.mark_prefix = mark_prefix
        if home is not None and not os.path.isdir(os.path.join(home, "sandbox")):
            raise ValueError(f"home must be a directory holding 'sandbox/', got {home!r}")
        self.home = home
        for src, dst in ro_files:
            if not os.path.isfile(src) or not dst.startswith("/"):
                raise ValueError(f"ro_files needs (existing file, absolute path) pairs, got {(src, dst)!r}")
        self.ro_files = tuple(ro_files)
        for src, dst in ro_dirs:
            if not os.path.isdir(src) or not dst.startswith("/"):
                raise ValueError(f"ro_dirs needs (existing directory, absolute path) pairs, got {(src, dst)!r}")
        self.ro_dirs = tuple(ro_dirs)
        if box_binary is not None and not (os.path.isfile(box_binary) and os.access(box_binary, os.X_OK)):
            raise ValueError(f"box_binary must be an executable file, got {box_binary!r}")
        self.box_binary = box_binary if mode == BUBBLEWRAP else None
        self._inner_tools: tuple[str, str] | None = None
        if mode == BUBBLEWRAP and self.run_as is not None and privileged is not False:
            self._inner_tools = rootfs_tools(self.rootfs)
            if privileged is True and self._inner_tools is None:
                raise ValueError(f"privileged=True needs setpriv and prlimit in the image at {self.rootfs!r}")
        self.privileged = self._inner_tools is not None
        if mode == PROCESS_GROUP and self.run_as is not None:
            reaper.track_uid(self.run_as[0])
        if mode == BUBBLEWRAP or self.run_as is not None:
            reaper.adopt_orphans()  # the orphans of sandboxes are this process's to reap (see `reaper`)
        self.bwrap = bwrap or _host_program("bwrap") or "bwrap"
        self._prefix: list[str] | None = None
        tools = (_host_program("setpriv"), _host_program("prlimit")) if use_exec_wrappers else (None, None)
        self._tools: tuple[str, str] | None = tools if None not in tools else None  # type: ignore[assignment]

    # -- paths --------------------------------------------------------------------------------------------

    def resolve_cwd(self, cwd: str | None) -> str:
        """The directory a command starts in, as the sandbox sees it.

        None is the workspace mount; a relative path is taken from there and may not leave it
        (PathEscapeError). A path inside the workspace must be an existing directory (ValueError otherwise);
        an absolute path elsewhere (e.g. /tmp) is passed through.
        """
        mount = self.workspace.mount
        if cwd is None or cwd == "":
            return mount
        if not isinstance(cwd, str) or "\x00" in cwd:
            raise ValueError(f"cwd must be a string without NUL bytes, got {cwd!r}")
        if not cwd.startswith("/"):
            rel = self.workspace.relative(cwd)  # a relative cwd must stay in the workspace
        else:
            p = PurePosixPath(os.path.normpath(cwd))
            if not self.workspace.in_workspace(str(p)):
                return str(p)  # elsewhere in the sandbox's own (read-only or scratch) file system
            rel = self.workspace.relative(str(p))
        host = os.path.join(self.workspace.root, rel)
        if not os.path.isdir(host):
            raise ValueError(f"cwd {cwd!r} is not a directory in the workspace")
        return mount if rel == "." else f"{mount}/{rel}"

    def host_path(self, sandbox_path: str) -> str:
        """The host path of a sandbox path (identity outside the workspace)."""
        mount = PurePosixPath(self.workspace.mount)
        p = PurePosixPath(sandbox_path)
        if p == mount:
            return self.workspace.root
        if mount in p.parents:
            return os.path.join(self.workspace.root, str(p.relative_to(mount)))
        return sandbox_path

    # -- launching ----------------------------------------------------------------------------------------

    def base_env(self) -> dict[str, str]:
        """Environment every sandboxed process starts from (nothing of the service's own leaks in)."""
        if self.home is None:
            home = self.workspace.mount if self.mode == BUBBLEWRAP else self.workspace.root
        else:
            home = "/home/sandbox" if self.mode == BUBBLEWRAP else os.path.join(self.home, "sandbox")
        return {"PATH": DEFAULT_PATH, "HOME": home, "LANG": "C.UTF-8", "USER": "sandbox"}

    def launch(
        self,
        argv: list[str],
        *,
        cwd: str,
        env: dict[str, str],
        timeout_s: float | None,
        tty: bool = False,
        limited: bool = True,
        switches_user: bool = False,
    ) -> Launch:
        """A launch of `argv` in the sandbox.

        Args:
            argv: the command, as it should run inside the sandbox.
            cwd: sandbox path from `resolve_cwd`.
            env: the complete environment of the command.
            timeout_s: the command's time budget (sets the CPU rlimit when `limits.cpu` is set), None for none.
            tty: the process's stdin is a terminal that should become its controlling terminal.
            limited: apply the sandbox's rlimits to the process; False for the box, which applies them to
                each command it starts (`command_rlimits`) instead.
            switches_user: `argv` drops to the sandbox's uid by itself, as `setpriv` would (the compiled box's
                `--user`); a root-started bubblewrap then runs it without setpriv. Needs `limited=False`.
        """
        if switches_user and limited:
            raise ValueError("switches_user needs limited=False (nothing would apply the rlimits)")
        popen: dict[str, Any] = {"env": dict(env), "start_new_session": True}
        if self._inner_tools is not None:
            return self._launch_privileged(argv, popen, cwd=cwd, timeout_s=timeout_s, tty=tty, limited=limited,
                                           switches_user=switches_user)  # fmt: skip
        extra = _BWRAP_OWN_PROCESSES if self.mode == BUBBLEWRAP else 0
        rlimits = _rlimits(self.limits, timeout_s, extra_pids=extra, per_uid=self.run_as is not None) if limited else []
        wrap: list[str] = []
        if tty or self._tools is None:
            # The uid switch happens here rather than through Popen's user=/group=, which uvloop (the event
            # loop uvicorn picks when installed) does not accept.
            popen["preexec_fn"] = _child_preexec(rlimits, ctty=tty, run_as=self.run_as)
        else:
            # setpriv and prlimit from util-linux do the same work as exec wrappers: without a Python
            # preexec function the child can be started with vfork, several milliseconds cheaper per
            # command in a large service process.
            setpriv, prlimit = self._tools
            if self.run_as is not None:
                uid, gid = self.run_as
                wrap += [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
            if rlimits:
                wrap += [prlimit, *(f"--{_PRLIMIT_NAMES[w]}={v}" for w, v in rlimits), "--"]
        if self.mode == BUBBLEWRAP:
            popen["cwd"] = "/"
            # bubblewrap runs as the sandbox's uid and binds the workspace by path: every directory above it
            # must be searchable by that uid (the local backend checks this at start).
            info_r, info_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            popen["pass_fds"] = (info_w,)
            full = [*wrap, *self._bwrap_prefix(tty), "--info-fd", str(info_w),
                    "--bind", self.workspace.root, self.workspace.mount,
                    "--remount-ro", "/", "--chdir", cwd, "--", *argv]  # fmt: skip
            return Launch(full, popen, lambda: BubblewrapTree(info_r), (info_w,))
        mark = self.mark_prefix + secrets.token_hex(8)
        popen["env"][MARK_VAR] = mark
        popen["cwd"] = self.host_path(cwd)
        uid = self.run_as[0] if self.run_as is not None else None
        return Launch([*wrap, *argv], popen, lambda: MarkedGroupTree(mark, uid))

    def command_rlimits(self, timeout_s: float | None) -> list[tuple[int, int]]:
        """The (resource, value) rlimits the box sets on each command it starts: those of `launch`, with one
        more process in the pids limit for the box itself (it runs as the sandbox's uid)."""
        own = 1 if self._inner_tools is not None else _BWRAP_OWN_PROCESSES + 1
        return _rlimits(self.limits, timeout_s, extra_pids=own, per_uid=self.run_as is not None)

    def box_python(self) -> str | None:
        """Sandbox path of a python3 in the image to run the box with, or None if it has none."""
        if self.mode != BUBBLEWRAP:
            return None
        for path in _BOX_PYTHONS:
            if os.path.lexists(os.path.join(self.rootfs, path.lstrip("/"))):
                return path
        return None

    def _launch_privileged(
        self,
        argv: list[str],
        popen: dict[str, Any],
        *,
        cwd: str,
        timeout_s: float | None,
        tty: bool,
        limited: bool = True,
        switches_user: bool = False,
    ) -> Launch:
        """bubblewrap started as root; inside, setpriv and prlimit drop to the sandbox's uid and limits (or
        `argv` itself does, `switches_user`).

        bubblewrap's own processes are root's, so the uid's RLIMIT_NPROC counts the command's alone.
        """
        assert self._inner_tools is not None and self.run_as is not None
        setpriv, prlimit = self._inner_tools
        uid, gid = self.run_as
        rlimits = _rlimits(self.limits, timeout_s, extra_pids=0, per_uid=True) if limited else []
        inner = [] if switches_user else [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                                          "--inh-caps=-all", "--bounding-set=-all", "--"]  # fmt: skip
        if rlimits:
            inner += [prlimit, *(f"--{_PRLIMIT_NAMES[w]}={v}" for w, v in rlimits), "--"]
        if tty:
            popen["preexec_fn"] = _child_preexec([], ctty=True, run_as=None)
        popen["cwd"] = "/"
        info_r, info_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        popen["pass_fds"] = (info_w,)
        full = [*self._bwrap_prefix(tty), "--info-fd", str(info_w),
                "--bind", self.workspace.root, self.workspace.mount,
                "--remount-ro", "/", "--chdir", cwd, "--", *inner, *argv]  # fmt: skip
        return Launch(full, popen, lambda: BubblewrapTree(info_r), (info_w,))

    def _bwrap_prefix(self, tty: bool) -> list[str]:
        if self._prefix is None:
            userns = [] if self.privileged else ["--unshare-user"]
            args = [self.bwrap, *userns, "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                    "--hostname", "sandbox", "--die-with-parent"]  # fmt: skip
            if not self.network:
                args.append("--unshare-net")
            args += ["--tmpfs", "/", *_top_level_args(self.rootfs)]
            for h in self.hide:
                args += ["--tmpfs", h]
            if self.home is not None:
                args += ["--bind", self.home, "/home"]
            for src, dst in self.ro_files:
                args += ["--ro-bind", src, dst]
            for src, dst in self.ro_dirs:
                # the mount point's parents would be bubblewrap's (root's 0700 when started as root)
                args += ["--perms", "0755", "--dir", os.path.dirname(dst), "--ro-bind", src, dst]
            if self.box_binary is not None:
                args += ["--ro-bind", self.box_binary, BOX_MOUNT]
            # sticky and world-writable, as on a normal system (a root-started bubblewrap would make them
            # root's 0755 and unwritable for the sandbox's uid)
            args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp",
                     "--perms", "1777", "--tmpfs", "/dev/shm"]  # fmt: skip
            self._prefix = args
        # A non-terminal command gets its own session so it cannot inject input into the service's terminal
        # (TIOCSTI); a PTY session keeps the session whose controlling terminal is its PTY.
        return self._prefix if tty else [*self._prefix, "--new-session"]


def _visible_in_rootfs(path: str, rootfs: str) -> bool:
    """Whether a host directory shows up inside a sandbox built on `rootfs` (and so must be hidden).

    It does when it lies in a bound top-level directory and every directory on the way is traversable by
    others (the sandbox's uid is neither owner nor group of the service's directories).
    """
    if rootfs != "/" or not os.path.isabs(path) or not os.path.isdir(path):
        return False
    parts = PurePosixPath(os.path.abspath(path)).parts
    if len(parts) < 2 or parts[1] in _SPECIAL_TOP:
        return False
    return all(os.stat(os.path.join(*parts[:i])).st_mode & 0o001 for i in range(2, len(parts)))


_PRLIMIT_NAMES = {resource.RLIMIT_NPROC: "nproc", resource.RLIMIT_AS: "as", resource.RLIMIT_CPU: "cpu"}


def _rlimits(
    limits: Limits, timeout_s: float | None, *, extra_pids: int, per_uid: bool
) -> list[tuple[int, int]]:
    """The (resource, value) pairs a sandboxed process gets, soft = hard.

    RLIMIT_NPROC is only set when the sandbox has a uid of its own (`per_uid`): it counts every process of
    the uid, so for a service running as an ordinary user it would count the user's other processes too.
    """
    rl: list[tuple[int, int]] = []
    if limits.pids is not None and per_uid:
        rl.append((resource.RLIMIT_NPROC, limits.pids + extra_pids))
    if limits.memory_mb is not None:
        rl.append((resource.RLIMIT_AS, limits.memory_mb << 20))
    if limits.cpu is not None and timeout_s is not None:
        rl.append((resource.RLIMIT_CPU, max(1, math.ceil(limits.cpu * timeout_s))))
    return rl


def _child_preexec(
    rlimits: list[tuple[int, int]], *, ctty: bool, run_as: tuple[int, int] | None
) -> Callable[[], None]:
    """A function run in the child between fork and exec: every signal back to its default disposition, drop to
    `run_as`, apply the rlimits, and take stdin as controlling terminal if `ctty`.

    The defaults matter because an ignored signal stays ignored across exec: a service started in the background
    of a shell without job control ignores SIGINT and SIGQUIT, and without the reset a terminal's Ctrl-C would
    not stop the sandbox's foreground command (the compiled box and `box.py` reset them for execs the same way).
    """

    def preexec() -> None:
        for signum in signal.valid_signals():
            if signum not in (signal.SIGKILL, signal.SIGSTOP):
                with contextlib.suppress(OSError, ValueError):
                    signal.signal(signum, signal.SIG_DFL)
        if run_as is not None:
            os.setgroups([])
            os.setgid(run_as[1])
            os.setuid(run_as[0])
        for which, value in rlimits:
            resource.setrlimit(which, (value, value))
        if ctty:
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    return preexec
