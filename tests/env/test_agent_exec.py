"""The exec agent with real child processes: basics, adversarial timeouts, output caps, PTYs, isolation.

Every exec test runs under bubblewrap (skipped where it cannot create namespaces) and under the process-group
fallback. After each adversarial command, /proc is scanned for the command's marker: nothing may remain.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import uvloop  # uvicorn[standard] (the env extra) installs it, and uvicorn then serves on it
from _box import box_binary, needs_compiled_box, needs_root, requires
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.env.agent import BUBBLEWRAP, PROCESS_GROUP, Isolation, Limits, SandboxAgent, Workspace
from orchard.env.agent.box_build import BOX_MOUNT
from orchard.env.agent.isolation import probe_bubblewrap
from orchard.env.agent.process import _Capture
from orchard.env.backends.base import BackendError, ExecRequest, PathEscapeError

IS_ROOT = os.geteuid() == 0
TEST_UID = 201_357
RUN_AS = (TEST_UID, TEST_UID) if IS_ROOT else None
BWRAP_PROBLEM = probe_bubblewrap(RUN_AS)
SLACK_S = 1.5
"""How much later than its timeout an exec may return (process start, kill, teardown on a loaded machine)."""

USERNS = "bubblewrap-userns"
"""bubblewrap started as the sandbox's uid in a user namespace (what a non-root service, or an image without
setpriv, gets); plain BUBBLEWRAP is root-started bubblewrap when the tests run as root."""
BOX = "bubblewrap-box"
"""Commands run through the sandbox's long-lived compiled box (one bubblewrap per sandbox), root-started as
root."""
PYBOX = "bubblewrap-pybox"
"""The same through the Python box (what a machine without a C compiler runs)."""
BOXES = (BOX, PYBOX)
needs_bwrap = requires(BWRAP_PROBLEM, "bubblewrap")
MODES = [
    pytest.param(BUBBLEWRAP, marks=needs_bwrap),
    pytest.param(BOX, marks=[needs_bwrap, needs_compiled_box]),
    pytest.param(PYBOX, marks=needs_bwrap),
    pytest.param(USERNS, marks=[needs_bwrap, pytest.mark.skipif(not IS_ROOT, reason="same as bubblewrap")]),
    PROCESS_GROUP,
]
BWRAP_MODES = [m for m in MODES if getattr(m, "values", [m])[0] != PROCESS_GROUP]
WRAPPERS = pytest.mark.parametrize("wrappers", [True, False], ids=["setpriv", "preexec"])
"""Start sandboxed processes through setpriv/prlimit exec wrappers, or a Python preexec function."""


@pytest.fixture
def workspace_dir():
    # tempfile (not tmp_path): the sandbox's uid must be able to reach the workspace, and pytest's base
    # temporary directory is private to root.
    base = tempfile.mkdtemp(prefix="orchard-agent-")
    os.chmod(base, 0o711)
    ws = os.path.join(base, "ws")
    os.mkdir(ws, 0o700)
    if IS_ROOT:
        os.chown(ws, TEST_UID, TEST_UID)
    yield ws
    shutil.rmtree(base, ignore_errors=True)


def make_agent(
    ws: str, mode: str, *, limits: Limits | None = None, network: bool = False, **kw
) -> SandboxAgent:
    workspace = Workspace(ws, uid=RUN_AS[0] if RUN_AS else None, gid=RUN_AS[1] if RUN_AS else None)
    box = mode in BOXES
    if mode == USERNS:
        mode, kw["privileged"] = BUBBLEWRAP, False
    elif mode in BOXES:
        kw["box_binary"] = box_binary() if mode == BOX else None
        mode = BUBBLEWRAP
    iso = Isolation(workspace, mode=mode, limits=limits, network=network, run_as=RUN_AS, **kw)
    agent = SandboxAgent(iso, env={"AGENT_VAR": "from-agent"}, box=box)
    assert (agent.box is not None) == box
    assert agent.box is None or agent.box.compiled == (kw.get("box_binary") is not None)
    return agent


def marker() -> str:
    """A number no other process uses, for `sleep <marker>` and the /proc scan."""
    return f"{900_000 + secrets.randbelow(99_999)}.{secrets.randbelow(10**6):06d}"


def procs_with(text: str) -> list[tuple[int, str]]:
    """Live (non-zombie) processes whose command line contains `text`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\x00", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            out.append((int(entry), cmd))
    return out


def box_processes(agent: SandboxAgent) -> list[int]:
    """Host pids of the agent's box process (whose ancestor is the box's outer bubblewrap), if one runs."""
    if agent.box is None or agent.box.pid is None:
        return []
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                head = BOX_MOUNT + "\x00" if agent.box.compiled else f"{agent.box.python}\x00-S\x00-I\x00-c\x00"
                if not f.read().startswith(head.encode()):
                    continue
            pid = int(entry)
            while pid > 1 and pid != agent.box.pid:
                with open(f"/proc/{pid}/stat") as f:
                    pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if pid == agent.box.pid:
            out.append(int(entry))
    return out


def procs_of_uid(uid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    with open(f"/proc/{entry}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                            out.append(int(entry))
            except OSError:
                continue
    return out


# -- basics ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@WRAPPERS
async def test_exec_basics(workspace_dir, mode, wrappers):
    agent = make_agent(workspace_dir, mode, use_exec_wrappers=wrappers)
    r = await agent.exec(ExecRequest("echo out; echo err >&2; exit 3"))
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, b"out\n", b"err\n", False)
    assert not r.stdout_truncated and not r.stderr_truncated and r.duration_s > 0

    # cwd relative to the workspace, env layering (request over agent over base), stdin
    await agent.exec(ExecRequest("mkdir -p sub/dir"))
    r = await agent.exec(
        ExecRequest("pwd; echo $AGENT_VAR $REQ_VAR; cat", cwd="sub/dir", env={"REQ_VAR": "r"}, stdin=b"fed")
    )
    lines = r.stdout.decode().splitlines()
    assert lines[0].endswith("/sub/dir") and lines[1:] == ["from-agent r", "fed"], r
    r = await agent.exec(ExecRequest("echo $AGENT_VAR", env={"AGENT_VAR": "override"}))
    assert r.stdout == b"override\n"

    # argv is not interpreted by a shell; a string is
    r = await agent.exec(ExecRequest(["printf", "%s|", "a b", "$HOME", "*"]))
    assert r.stdout == b"a b|$HOME|*|"
    r = await agent.exec(ExecRequest('printf "%s|" "$(( 6 * 7 ))"'))
    assert r.stdout == b"42|"

    # a PATH the caller sets survives the login shell's /etc/profile (argv commands get it as is)
    r = await agent.exec(
        ExecRequest("echo $PATH; env | grep -c ORCHARD_USER_PATH", env={"PATH": "/opt/x/bin"})
    )
    path, leaked = r.stdout.decode().split()
    assert path.startswith("/opt/x/bin:") and "/usr/bin" in path and leaked == "0", r
    r = await agent.exec(ExecRequest(["sh", "-c", "echo $PATH"], env={"PATH": "/opt/x/bin:/usr/bin:/bin"}))
    assert r.stdout == b"/opt/x/bin:/usr/bin:/bin\n"

    # nothing of the service's environment leaks in
    os.environ["ORCHARD_TEST_SECRET"] = "leak"
    try:
        r = await agent.exec(ExecRequest(["env"]))
    finally:
        del os.environ["ORCHARD_TEST_SECRET"]
    assert b"ORCHARD_TEST_SECRET" not in r.stdout


@pytest.mark.parametrize("mode", MODES)
async def test_exec_errors(workspace_dir, mode):
    agent = make_agent(workspace_dir, mode)
    r = await agent.exec(ExecRequest(["no-such-program-xyz"]))
    assert r.exit_code != 0 and b"no-such-program-xyz" in r.stderr
    r = await agent.exec(ExecRequest("kill -9 $$"))
    # a signal death: -9 from the process itself, 128 + 9 = 137 when bubblewrap relays it (as a shell does)
    assert r.exit_code == (-9 if mode == PROCESS_GROUP else 137)
    with pytest.raises(ValueError, match="cwd"):
        await agent.exec(ExecRequest("true", cwd="missing-dir"))
    with pytest.raises(PathEscapeError):
        await agent.exec(ExecRequest("true", cwd="../.."))
    with pytest.raises(ValueError, match="timeout_s"):
        await agent.exec(ExecRequest("true", timeout_s=0))
    with pytest.raises(ValueError, match="command"):
        await agent.exec(ExecRequest([]))
    with pytest.raises(ValueError, match="env"):
        await agent.exec(ExecRequest("true", env={"A=B": "x"}))
    with pytest.raises(ValueError, match="max_output_bytes"):
        await agent.exec(ExecRequest("true", max_output_bytes=-1))


# -- timeouts and leftovers -----------------------------------------------------------------------------

ADVERSARIAL = {
    "background": "sleep {m} & sleep {m}",
    "setsid": "setsid sleep {m} & sleep {m}",
    "double_fork": "( ( sleep {m} & ) & ) ; sleep {m}",
    "nohup": "nohup sleep {m} >/dev/null 2>&1 & sleep {m}",
    "holds_stdout": "( trap '' HUP TERM; exec sleep {m} ) & sleep {m}",
    "python_daemon": (
        "python3 -c 'import os,time\nif os.fork()==0:\n os.setsid()\n if os.fork()==0:\n  "
        'os.execvp("sleep",["sleep","{m}"])\ntime.sleep(1000)\' {m}'
    ),
}


async def assert_no_leftovers(m: str) -> None:
    # The exec returned only after its processes were killed; allow the kernel a moment to reap.
    deadline = time.monotonic() + 2.0
    while procs_with(m) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert procs_with(m) == []


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
async def test_timeout_ends_the_whole_tree(workspace_dir, mode, name):
    agent = make_agent(workspace_dir, mode)
    m = marker()
    t0 = time.monotonic()
    r = await agent.exec(ExecRequest(ADVERSARIAL[name].format(m=m), timeout_s=0.8))
    elapsed = time.monotonic() - t0
    assert r.timed_out and r.exit_code == 124, r
    assert elapsed < 0.8 + SLACK_S, elapsed
    await assert_no_leftovers(m)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "command",
    ["sleep {m} & echo done", "setsid sleep {m} & echo done", "( ( sleep {m} & ) & ); echo done"],
    ids=["background", "setsid", "double_fork"],
)
async def test_main_exit_returns_promptly_and_ends_background_children(workspace_dir, mode, command):
    """The background child keeps stdout open, but the exec returns when the main process exits."""
    agent = make_agent(workspace_dir, mode)
    m = marker()
    t0 = time.monotonic()
    r = await agent.exec(ExecRequest(command.format(m=m), timeout_s=30))
    assert (r.exit_code, r.stdout, r.timed_out) == (0, b"done\n", False)
    assert time.monotonic() - t0 < SLACK_S + 1.0
    await assert_no_leftovers(m)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("yields", [0, 1, 2, 3, 5, 8])
async def test_kill_all_during_the_launch_ends_the_command(workspace_dir, mode, yields):
    """A sandbox deleted while its command is being launched: the box still starting (yields 1-3 land in its
    handshake), the process just registered, or the exec not begun at all (0). The command never runs on."""
    agent = make_agent(workspace_dir, mode)
    m = marker()  # `sleep <m>` sleeps ~10 days: only the kill can end it
    running = asyncio.ensure_future(agent.exec(ExecRequest(f"sleep {m}", timeout_s=3600)))
    for _ in range(yields):
        await asyncio.sleep(0)
    await agent.kill_all()
    try:
        r = await asyncio.wait_for(running, 10)
    except BackendError as e:  # refused: kill_all came before the launch
        assert "being deleted" in str(e)
    else:
        # killed: 137 from a box (with its note), SIGKILL from a bubblewrap or process group per command
        assert not r.timed_out and r.exit_code in (137, -9), r
    await assert_no_leftovers(m)
    with pytest.raises(BackendError, match="being deleted"):
        await agent.exec(ExecRequest("true"))
    with pytest.raises(BackendError, match="being deleted"):
        await agent.open_pty()


@needs_root
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@WRAPPERS
async def test_fork_bomb_is_bounded_by_pids_and_fully_ended(workspace_dir, mode, wrappers):
    agent = make_agent(workspace_dir, mode, limits=Limits(pids=24, memory_mb=512), use_exec_wrappers=wrappers)
    t0 = time.monotonic()
    r = await agent.exec(ExecRequest("bomb() { bomb | bomb & }; bomb; sleep 100", timeout_s=1.5))
    assert r.timed_out and time.monotonic() - t0 < 1.5 + SLACK_S + 1.0
    assert b"Resource temporarily unavailable" in r.stderr  # forks beyond the limit failed
    # nothing of the uid is left, but for the box (which stays, waiting for the next command)
    box = box_processes(agent)
    assert len(box) == (mode in BOXES)
    deadline = time.monotonic() + 3
    while procs_of_uid(TEST_UID) != box and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert procs_of_uid(TEST_UID) == box
    # the limit held (forks failed) and the sandbox is usable right after
    r = await agent.exec(ExecRequest("echo alive"))
    assert (r.exit_code, r.stdout) == (0, b"alive\n")


# -- output ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_output_is_capped_per_stream(workspace_dir, mode):
    agent = make_agent(workspace_dir, mode)
    cap = 100_000
    r = await agent.exec(ExecRequest("head -c 5000000 /dev/zero; echo tail >&2", max_output_bytes=cap))
    assert r.exit_code == 0 and r.stdout == b"\x00" * cap and r.stdout_truncated
    assert r.stderr == b"tail\n" and not r.stderr_truncated
    r = await agent.exec(ExecRequest("printf 12345", max_output_bytes=5))  # exactly at the cap
    assert r.stdout == b"12345" and not r.stdout_truncated
    r = await agent.exec(ExecRequest("printf 123456", max_output_bytes=5))
    assert r.stdout == b"12345" and r.stdout_truncated
    r = await agent.exec(ExecRequest("cat /dev/zero", timeout_s=0.5, max_output_bytes=cap))
    assert r.timed_out and r.exit_code == 124 and len(r.stdout) == cap and r.stdout_truncated
    big = os.urandom(3_000_000)
    r = await agent.exec(ExecRequest(["cat"], stdin=big, max_output_bytes=len(big)))
    assert r.stdout == big and not r.stdout_truncated


@pytest.mark.slow
async def test_huge_output_keeps_memory_bounded(workspace_dir):
    """256 MiB through the capture in a fresh interpreter: its peak RSS stays far below the output size.

    The peak is VmHWM, the high-water mark of the interpreter's own address space. Not ``ru_maxrss``: Linux
    carries the pre-exec image's peak into it, so in a child of pytest it reports pytest's own peak (hundreds
    of MiB once torch tests have run), whatever the capture does.
    """
    code = (
        "import asyncio, sys\n"
        "from orchard.env.agent import Isolation, SandboxAgent, Workspace\n"
        "from orchard.env.backends.base import ExecRequest\n"
        f"agent = SandboxAgent(Isolation(Workspace({workspace_dir!r}), mode='process-group'))\n"
        "r = asyncio.run(agent.exec(ExecRequest('head -c 268435456 /dev/zero', max_output_bytes=1 << 20)))\n"
        "assert r.exit_code == 0 and r.stdout_truncated and len(r.stdout) == 1 << 20, r.exit_code\n"
        "print(next(line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM:')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    peak_mib = int(out.stdout.strip()) / 1024  # VmHWM is in kB
    assert peak_mib < 128, peak_mib  # the output was 256 MiB; the capture keeps 1 MiB plus 256 KiB reads


# -- PTY ------------------------------------------------------------------------------------------------


async def read_until(pty, needle: bytes, timeout_s: float = 10.0) -> bytes:
    buf = b""
    it = pty.read().__aiter__()
    deadline = time.monotonic() + timeout_s
    while needle not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{needle!r} not seen in {buf!r}")
        try:
            buf += await asyncio.wait_for(it.__anext__(), left)
        except StopAsyncIteration:
            break
    return buf


@pytest.mark.parametrize("mode", MODES)
async def test_pty_echo_resize_close(workspace_dir, mode):
    agent = make_agent(workspace_dir, mode)
    pty = await agent.open_pty(cols=80, rows=24)
    try:
        await pty.write(b"stty size; echo $((6*7))x\n")
        out = await read_until(pty, b"42x")
        assert b"24 80" in out
        await pty.resize(cols=132, rows=50)
        await pty.write(b"stty size\n")
        assert b"50 132" in await read_until(pty, b"50 132")
        with pytest.raises(ValueError, match="cols"):
            await pty.resize(cols=0, rows=10)
        m = marker()
        await pty.write(f"setsid sleep {m} &\n".encode())
        await asyncio.sleep(0.3)
    finally:
        await pty.close()
    await assert_no_leftovers(m)
    await pty.close()  # idempotent


@pytest.mark.parametrize("mode", MODES)
async def test_pty_command_runs_to_eof(workspace_dir, mode):
    agent = make_agent(workspace_dir, mode)
    pty = await agent.open_pty("printf 'hello from pty'; exit 3")
    chunks = [c async for c in pty.read()]
    assert b"hello from pty" in b"".join(chunks)
    assert await pty.wait() in (3,)
    await pty.close()


@pytest.mark.parametrize("mode", MODES)
async def test_pty_burst_arrives_in_few_messages(workspace_dir, mode):
    agent = make_agent(workspace_dir, mode)
    pty = await agent.open_pty("head -c 60000 /dev/zero | tr '\\0' x; exit 0")
    assert await pty.wait() == 0  # the burst is written; the reader has queued what it saw meanwhile
    chunks = [c async for c in pty.read()]
    await pty.close()
    assert b"".join(chunks) == b"x" * 60000
    # A terminal read returns at most 4095 bytes: 60,000 bytes were >= 15 messages, one per read. Reading on while
    # more waits, and sending what is queued together (up to 64 KiB), makes them 1, or 2-3 if the burst was still
    # arriving when the first message left.
    assert len(chunks) <= 3, [len(c) for c in chunks]


# -- isolation (bubblewrap) -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", BWRAP_MODES)
async def test_isolation_uid_readonly_host_writable_workspace(workspace_dir, mode):
    agent = make_agent(workspace_dir, mode, hide=(os.path.dirname(workspace_dir),))
    assert agent.isolation.privileged == (IS_ROOT and mode in (BUBBLEWRAP, *BOXES))
    # no privilege to gain: no capabilities, set-uid programs inert
    r = await agent.exec(ExecRequest("grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs)' /proc/self/status"))
    assert r.stdout.split()[1::2] == [b"0000000000000000"] * 5 + [b"1"], r
    r = await agent.exec(ExecRequest("id -u; id -g"))
    uid, gid = (int(x) for x in r.stdout.split())
    assert uid != 0 and gid != 0
    if IS_ROOT:
        assert (uid, gid) == (TEST_UID, TEST_UID)
    r = await agent.exec(ExecRequest("touch /usr/orchard-x; echo x > /etc/orchard-x"))
    assert r.exit_code != 0 and r.stderr.count(b"Read-only file system") == 2, r
    r = await agent.exec(ExecRequest("echo data > made.txt && mkdir d && echo ok > /tmp/t && cat /tmp/t"))
    assert r.exit_code == 0 and r.stdout == b"ok\n", r
    st = os.stat(os.path.join(workspace_dir, "made.txt"))
    assert st.st_uid == (TEST_UID if IS_ROOT else os.geteuid())
    # a fresh /tmp: a file the host has in /tmp is not there; the service's directory is hidden
    r = await agent.exec(ExecRequest(["ls", "-a", os.path.dirname(workspace_dir)]))
    assert r.stdout.split() in ([], [b".", b".."]), r
    # its own pid namespace: only bubblewrap's init, (the box,) bash, ls and grep
    r = await agent.exec(ExecRequest("ls /proc | grep -c '^[0-9]'"))
    assert int(r.stdout) <= 4 + (mode in BOXES), r


@pytest.mark.parametrize("mode", BWRAP_MODES)
async def test_no_network_unless_asked(workspace_dir, mode):
    accepted: list[int] = []

    async def on_conn(reader, writer):
        accepted.append(1)
        writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    probe = f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected"
    try:
        r = await make_agent(workspace_dir, mode).exec(ExecRequest(probe, timeout_s=10))
        assert r.exit_code != 0 and b"connected" not in r.stdout, r
        assert accepted == []
        r = await make_agent(workspace_dir, mode, network=True).exec(ExecRequest(probe, timeout_s=10))
        assert r.exit_code == 0 and r.stdout == b"connected\n", r
        await asyncio.sleep(0.1)
        assert accepted == [1]
    finally:
        server.close()
        await server.wait_closed()


@needs_bwrap
@WRAPPERS
async def test_memory_limit(workspace_dir, wrappers):
    agent = make_agent(workspace_dir, BUBBLEWRAP, limits=Limits(memory_mb=256), use_exec_wrappers=wrappers)
    r = await agent.exec(ExecRequest(["python3", "-c", "b = bytearray(600 << 20); print('allocated')"]))
    assert r.exit_code != 0 and b"MemoryError" in r.stderr, r
    r = await agent.exec(ExecRequest(["python3", "-c", "b = bytearray(50 << 20); print('allocated')"]))
    assert r.stdout == b"allocated\n", r


@pytest.mark.parametrize("mode", MODES)
async def test_apply_patch_and_malicious_paths(workspace_dir, mode):
    agent = make_agent(workspace_dir, mode)
    await agent.write_file("src/a.py", b"x = 1\n")
    good = "--- a/src/a.py\n+++ b/src/a.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
    r = await agent.apply_patch(good)
    assert r.exit_code == 0, r
    assert await agent.read_file("src/a.py") == b"x = 2\n"
    target = os.path.join(os.path.dirname(workspace_dir), "escaped.txt")
    evil = "--- /dev/null\n+++ b/../escaped.txt\n@@ -0,0 +1 @@\n+pwned\n"
    r = await agent.apply_patch(evil)
    assert r.exit_code != 0 and not os.path.exists(target), r
    shell = "--- /dev/null\n+++ b/$(touch pwned).txt\n@@ -0,0 +1 @@\n+x\n"
    await agent.apply_patch(shell)  # a file with that odd name may appear; no command may run
    assert not os.path.exists(os.path.join(workspace_dir, "pwned"))
    with pytest.raises(ValueError, match="patch"):
        await agent.apply_patch("  ")


@pytest.mark.parametrize("mode", MODES)
@WRAPPERS
def test_under_uvloop(workspace_dir, mode, wrappers):
    """uvicorn runs the service on uvloop when it is installed; its subprocess support differs."""
    m = marker()

    async def scenario() -> None:
        agent = make_agent(workspace_dir, mode, use_exec_wrappers=wrappers)
        r = await agent.exec(ExecRequest("echo $((1 + 2)); id -u", stdin=b"x"))
        assert r.exit_code == 0 and r.stdout.split()[0] == b"3", r
        if IS_ROOT:
            assert int(r.stdout.split()[1]) == TEST_UID
        r = await agent.exec(ExecRequest(f"setsid sleep {m} & sleep {m}", timeout_s=0.8))
        assert r.timed_out and r.exit_code == 124
        pty = await agent.open_pty()
        try:
            await pty.write(b"echo $((3 * 5))q\n")
            await read_until(pty, b"15q")
        finally:
            await pty.close()
        await assert_no_leftovers(m)

    uvloop.run(scenario())


@settings(max_examples=200, deadline=None)
@given(
    cap=st.integers(min_value=0, max_value=300),
    chunks=st.lists(st.tuples(st.sampled_from([1, 2]), st.binary(max_size=120)), max_size=12),
)
def test_capture_keeps_exactly_the_prefix(cap, chunks):
    """Property: whatever the chunking, each stream keeps its first `cap` bytes and is flagged truncated
    exactly when it produced more."""
    loop = asyncio.new_event_loop()
    try:
        capture = _Capture(cap, loop)
        for fd, data in chunks:
            capture.pipe_data_received(fd, data)
        for fd in (1, 2):
            full = b"".join(d for f, d in chunks if f == fd)
            assert bytes(capture.data[fd]) == full[:cap]
            assert capture.truncated[fd] == (len(full) > cap)
    finally:
        loop.close()


def test_limits_validation():
    assert Limits() == Limits(pids=256, memory_mb=4096, cpu=None)
    for kw in (
        {"pids": 0},
        {"pids": 1.5},
        {"memory_mb": -1},
        {"cpu": 0},
        {"cpu": float("nan")},
        {"pids": True},
    ):
        with pytest.raises(ValueError, match=next(iter(kw))):
            Limits(**kw)
