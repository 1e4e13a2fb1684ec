"""The box: one long-lived process per sandbox that runs its commands, inside the sandbox's bubblewrap.

This file is a program, not a library module. The service (`orchard.env.agent.box_client`) starts the
image's own `python3 -S -I` under the sandbox's bubblewrap namespaces, as the sandbox's uid, with a few
lines of boot code that read this program from the socket; it therefore imports only C modules (`posix`
rather than `os`, `_signal` rather than `signal`; no json, no subprocess: each of those costs milliseconds of
start-up per sandbox) and keeps to syntax that Python 3.6 accepts. Nothing here runs in the service's process.

Protocol: that of the compiled box, `box.c`, whose header states it (a request is a u32 length, an op byte
and fixed fields, then blocks of NUL-terminated strings; the answers are fixed-size fields and raw bytes).
The service runs this Python box only where the compiled one cannot be built (no C compiler) or cannot
start; it sends it this file compiled (or as source, for another python's bytecode) over the socket first.

`own` are the sandbox's fixed rlimits (pids, memory): the box puts them on itself at its first command, and
then starts commands with posix_spawn (vfork; the limits are inherited), cheaper than a Python fork;
`rlimits` (the CPU limit, which depends on the timeout) or `own` it could not take force the fork path,
which sets them all in the child.

Per request the box starts the command in a session of its own (rlimits, cwd, env, stdin pipe or /dev/null),
captures stdout and stderr up to `cap` each (the rest is read and dropped), and waits for the command's main
process or the timeout. Then it SIGKILLs every other process of the pid namespace (it sees only its own
sandbox in /proc; pid 1 is bubblewrap's init), repeating until only init and the box remain, so nothing a
command started (`&`, `setsid`, double fork, `nohup`) outlives the exec or holds its output open, and the
pids limit is free for the next command. /tmp and /dev/shm are emptied, as a fresh bubblewrap would have
them. A command killed by signal N reports 128 + N, as bubblewrap relays it.
"""

import _struct as struct  # the C modules: `os` and `struct` import more Python modules (~1.5 ms)
import errno
import posix as os
import resource
import select
import time

try:
    import _signal as _sig  # the C module: `signal` itself imports enum, several ms more
except ImportError:  # pragma: no cover - interpreters without it
    import signal as _sig

_READY = b"OBX1"
_HEADER = ">iBII"
_TIMED_OUT, _OUT_TRUNC, _ERR_TRUNC, _NOT_STARTED, _ENDS = 1, 2, 4, 8, 16
_READ = 1 << 16
_DRAIN_S = 2.0
_SETTLE_S = 2.0
_SCRATCH = ("/tmp", "/dev/shm")
_SPAWN = getattr(os, "posix_spawnp", None)
_ALL_SIGNALS = sorted(
    int(n)
    for n in (_sig.valid_signals() if hasattr(_sig, "valid_signals") else range(1, 32))
    if n not in (_sig.SIGKILL, _sig.SIGSTOP)
)


def _read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _others(me):
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            pid = int(entry)
            if pid != 1 and pid != me:
                out.append(pid)
    return out


def _end_all_others(me, wait_s):
    """SIGKILL every process of the namespace but init and the box until none is left (or `wait_s` passed).

    Killed processes cannot fork, so repeated passes reach the empty set even under a fork bomb; a pid stays
    listed until init has reaped it, so an empty list also means the pids limit is free again."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = _others(me)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        if time.monotonic() > deadline:
            return
        select.select([], [], [], 0.001)


def _empty_dir(path):
    """Empty `path` without recursion; returns whether it is empty now (see box.c's empty_dir)."""
    stack, dirs = [path], []
    while stack:
        d = stack.pop()
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                    dirs.append(entry.path)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass
    for d in reversed(dirs):
        try:
            os.rmdir(d)
        except OSError:
            pass
    try:
        return not os.listdir(path)
    except OSError:
        return False


def _execvpe(name, argv, env):
    """os.execvpe's lookup: each directory of the command's PATH (default /bin:/usr/bin) in turn; the first
    error other than "not there" wins."""
    if "/" in name:
        os.execve(name, argv, env)
    first = last = None
    for d in env.get("PATH", "/bin:/usr/bin").split(":"):
        try:
            os.execve((d or ".") + "/" + name, argv, env)
        except OSError as e:
            last = e
            if first is None and e.errno not in (errno.ENOENT, errno.ENOTDIR):
                first = e
    raise first or last


def _child(req, stdin_r, out_w, err_w, report_w):
    """Between fork and exec: never returns."""
    stage = "start"
    try:
        os.setsid()
        # Every signal back to its default (Python ignores SIGPIPE and SIGXFSZ; the service may have been
        # started with others ignored), as the compiled box does.
        for signum in _ALL_SIGNALS:
            try:
                _sig.signal(signum, _sig.SIG_DFL)
            except (OSError, ValueError):
                pass
        os.dup2(stdin_r, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        for which, value in list(req["own"]) + list(req["rlimits"]):
            resource.setrlimit(which, (value, value))
        stage = "chdir"
        os.chdir(req["cwd"])
        stage = "exec"
        argv = req["argv"]
        _execvpe(argv[0], argv, req["env"])
    except OSError as e:
        msg = f"{stage}:{e.strerror or e}"
        try:
            os.write(report_w, msg.encode("utf-8", "replace")[:4000])
        except OSError:
            pass
    except BaseException:
        pass
    os._exit(127)


def _status_code(status):
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _own_limits(req, state):
    """Put the sandbox's fixed rlimits (`own`: pids, memory) on the box itself at its first command, so
    that commands inherit them and can be started with posix_spawn (vfork) rather than a Python fork.
    Returns whether this request can be spawned that way."""
    own = list(req["own"])
    if "own" not in state:
        try:
            for which, value in own:
                resource.setrlimit(which, (value, value))
            state["own"] = own
        except (OSError, ValueError):
            state["own"] = None
    return _SPAWN is not None and not req["rlimits"] and state["own"] == own


def _spawn(req, stdin_r, out_w, err_w):
    """posix_spawn the command in a session of its own; (pid, None) or (None, "stage:reason")."""
    try:
        os.chdir(req["cwd"])
    except OSError as e:
        return None, f"chdir:{e.strerror or e}"
    env = req["env"]
    # posix_spawnp looks the program up on the caller's PATH: make it the command's, as execvp would
    if "PATH" in env:
        os.putenv("PATH", env["PATH"])
    else:
        os.unsetenv("PATH")
    dup2 = os.POSIX_SPAWN_DUP2
    actions = [(dup2, stdin_r, 0), (dup2, out_w, 1), (dup2, err_w, 2)]
    sigdef = _ALL_SIGNALS
    argv = req["argv"]
    try:
        return _SPAWN(argv[0], argv, env, file_actions=actions, setsid=True, setsigdef=sigdef), None
    except OSError as e:
        return None, f"exec:{e.strerror or e}"


def _run(req, me, wake_r, state):
    cap = req["cap"]
    data = req["stdin"]
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    if data is None:
        stdin_r, stdin_w = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC), -1
    else:
        stdin_r, stdin_w = os.pipe()
    if _own_limits(req, state):
        pid, failure = _spawn(req, stdin_r, out_w, err_w)
        failure = failure.encode("utf-8", "replace") if failure else b""
    else:
        report_r, report_w = os.pipe()
        try:
            pid = os.fork()
        except OSError as e:
            pid, failure = None, f"start:{e.strerror or e}".encode("utf-8", "replace")
        if pid == 0:
            _child(req, stdin_r, out_w, err_w, report_w)
        os.close(report_w)
        if pid is not None:
            failure = _read_all(report_r)
        os.close(report_r)
    for fd in (stdin_r, out_w, err_w):
        os.close(fd)
    if pid is None:
        if stdin_w >= 0:
            os.close(stdin_w)
        os.close(out_r)
        os.close(err_r)
        return _not_started(failure, 0)
    kept = {out_r: bytearray(), err_r: bytearray()}
    truncated = {out_r: False, err_r: False}
    poller = select.poll()
    for fd in (out_r, err_r, wake_r):
        poller.register(fd, select.POLLIN)
    pending = memoryview(data) if data else None
    if stdin_w >= 0:
        if pending:
            os.set_blocking(stdin_w, False)
            poller.register(stdin_w, select.POLLOUT)
        else:
            os.close(stdin_w)
            stdin_w = -1
    open_fds = {out_r, err_r}

    def read_from(fd):
        try:
            chunk = os.read(fd, _READ)
        except BlockingIOError:
            return
        if not chunk:
            poller.unregister(fd)
            open_fds.discard(fd)
            return
        buf = kept[fd]
        room = cap - len(buf)
        if room > 0:
            buf += chunk[:room]
        if len(chunk) > room:
            truncated[fd] = True

    deadline = time.monotonic() + req["timeout"]
    status = None
    timed_out = False
    while status is None:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
            break
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for fd, _ in poller.poll(max(1, int(left * 1000) + 1)):
            if fd == wake_r:
                try:
                    os.read(wake_r, 512)
                except OSError:
                    pass
            elif fd == stdin_w:
                try:
                    n = os.write(stdin_w, pending[:_READ])
                except BlockingIOError:
                    continue
                except OSError:  # the command closed its stdin
                    n = len(pending)
                pending = pending[n:]
                if not pending:
                    poller.unregister(stdin_w)
                    os.close(stdin_w)
                    stdin_w = -1
            else:
                read_from(fd)
    if status is None:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
        status = os.waitpid(pid, 0)[1]
    if stdin_w >= 0:
        os.close(stdin_w)
    _end_all_others(me, _SETTLE_S)
    drain_until = time.monotonic() + _DRAIN_S
    while open_fds:
        left = drain_until - time.monotonic()
        if left <= 0:
            break
        for fd, _ in poller.poll(int(left * 1000) + 1):
            if fd in open_fds:
                read_from(fd)
            elif fd == wake_r:
                os.read(wake_r, 512)
    os.close(out_r)
    os.close(err_r)
    state["clean"] = all([_empty_dir(path) for path in _SCRATCH])
    flags = (_TIMED_OUT if timed_out else 0) | (_OUT_TRUNC if truncated[out_r] else 0)
    flags |= (_ERR_TRUNC if truncated[err_r] else 0) | (0 if state["clean"] else _ENDS)
    out, err = bytes(kept[out_r]), bytes(kept[err_r])
    if failure:
        return _not_started(failure, flags)
    return (124 if timed_out else _status_code(status)), flags, out, err


def _not_started(failure, flags):
    """127 with "<stage>:<reason>" on stderr, whatever the cap; the service words the message."""
    return 127, flags | _NOT_STARTED, b"", failure[:4000]


def _read_all(fd):
    out = b""
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            return out
        out += chunk


def _text(b):
    return b.decode("utf-8", "surrogateescape")


def _decode(buf):
    """A run request (see box.c) as a dict: argv, cwd, env, stdin (bytes or None), timeout, cap, own,
    rlimits."""
    if buf[:1] != b"R":
        raise SystemExit(2)
    timeout, cap, has_stdin = struct.unpack_from(">dIB", buf, 1)
    pos = 14
    limits = []
    for _ in range(2):
        (n,) = struct.unpack_from(">H", buf, pos)
        pos += 2
        pairs = []
        for _ in range(n):
            pairs.append(struct.unpack_from(">IQ", buf, pos))
            pos += 12
        limits.append(pairs)
    blocks = []
    for _ in range(4):
        count, size = struct.unpack_from(">II", buf, pos)
        pos += 8
        block = buf[pos : pos + size]
        pos += size
        blocks.append(block.split(b"\0")[:count] if count else block)
    argv, env, cwd, data = blocks
    env = dict(_text(e).partition("=")[::2] for e in env)
    return {"argv": [_text(a) for a in argv], "cwd": _text(cwd[0]), "env": env,
            "stdin": data if has_stdin else None, "timeout": timeout, "cap": cap, "own": limits[0],
            "rlimits": limits[1]}  # fmt: skip


def main():
    me = os.getpid()
    os.closerange(3, 1 << 16)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    _sig.signal(_sig.SIGCHLD, lambda signum, frame: None)
    _sig.set_wakeup_fd(wake_w)
    state = {}
    _write_all(1, _READY + struct.pack(">I", me))
    devnull = os.open("/dev/null", os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    while True:
        try:
            (size,) = struct.unpack(">I", _read_exact(0, 4))
            buf = _read_exact(0, size)
        except EOFError:
            return
        if buf[:1] == b"T":
            # getrusage, not os.times(): the latter counts in 10 ms ticks, less than a box may use in all
            own = resource.getrusage(resource.RUSAGE_SELF)
            kids = resource.getrusage(resource.RUSAGE_CHILDREN)
            _write_all(1, struct.pack(">dd", own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime))
            continue
        state["clean"] = True
        code, flags, out, err = _run(_decode(buf), me, wake_r, state)
        _write_all(1, struct.pack(_HEADER, code, flags, len(out), len(err)) + out + err)
        if not state["clean"]:
            return  # scratch space not emptied: the next command gets a fresh namespace


if __name__ == "__main__":
    main()
