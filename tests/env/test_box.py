"""The box: one long-lived isolated process per sandbox that runs its commands.

The exec rules themselves (timeouts that end setsid / double-forked trees, caps, fork bombs, isolation) run
for the box in test_agent_exec.py (mode "bubblewrap-box"). Here: the box gives the same results as a
bubblewrap per command, restarts after it is killed, leaves nothing behind after delete, close or a SIGKILLed
service, keeps sandboxes apart and concurrent, and copes with a box that misbehaves.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from _box import IS_ROOT, box_binary, lacking, needs_compiled_box, requires

from orchard.env.agent import BUBBLEWRAP, Isolation, Limits, SandboxAgent, Workspace, box_build, box_client
from orchard.env.agent.box_build import BOX_MOUNT
from orchard.env.agent.isolation import probe_bubblewrap
from orchard.env.backends.base import BackendError, ExecRequest, SandboxNotFoundError, SandboxSpec
from orchard.env.backends.local import LocalBackend

TEST_UID = 201_359
RUN_AS = (TEST_UID, TEST_UID) if IS_ROOT else None
BWRAP_PROBLEM = probe_bubblewrap(RUN_AS)
needs_bwrap = requires(BWRAP_PROBLEM, "bubblewrap")
PRIVILEGED = pytest.mark.parametrize("privileged", [None, False], ids=["root-started", "userns"])
"""bubblewrap started as root (the command drops to the uid inside) or as the uid in a user namespace."""
KINDS = pytest.mark.parametrize("kind", [pytest.param("compiled", marks=needs_compiled_box), "python"])
"""The compiled box (box.c) or the Python one (box.py): the same program, the same results."""


@pytest.fixture
def base_dir():
    # tempfile (not tmp_path): the sandbox's uid must be able to reach the workspace
    base = tempfile.mkdtemp(prefix="orchard-box-")
    os.chmod(base, 0o711)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def make_agent(
    base: str, *, box: bool, privileged: bool | None = None, kind: str = "python", binary: str | None = None, **kw
) -> SandboxAgent:
    """An agent on `base`/ws; `kind` "compiled" binds `binary` (default: the tests' compiled box)."""
    ws = os.path.join(base, "ws")
    if not os.path.isdir(ws):
        os.mkdir(ws, 0o700)
        if IS_ROOT:
            os.chown(ws, TEST_UID, TEST_UID)
    workspace = Workspace(ws, uid=RUN_AS[0] if RUN_AS else None, gid=RUN_AS[1] if RUN_AS else None)
    binary = (binary or box_binary()) if box and kind == "compiled" else None
    iso = Isolation(workspace, mode=BUBBLEWRAP, run_as=RUN_AS, privileged=privileged, box_binary=binary, **kw)
    agent = SandboxAgent(iso, env={"AGENT_VAR": "from-agent"}, box=box)
    assert agent.box is None or agent.box.compiled == (kind == "compiled")
    return agent


def box_head(box: box_client.Box) -> bytes:
    """How the box process's command line starts."""
    return BOX_MOUNT.encode() + b"\0" if box.compiled else box.python.encode() + b"\0"


def live_pids() -> set[int]:
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        out.add(int(entry))
            except OSError:
                continue
    return out


def descendants(root: int) -> set[int]:
    """Live descendants of host pid `root` (root included while it lives)."""
    parent = {}
    for pid in live_pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent[pid] = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    out = {root} if root in parent else set()
    grew = True
    while grew:
        new = {p for p, pp in parent.items() if pp in out and p not in out}
        out |= new
        grew = bool(new)
    return out


async def gone(pids: set[int], timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while pids & live_pids() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return not pids & live_pids()


# -- same results as a bubblewrap per command ------------------------------------------------------------

SAME = [
    ExecRequest("echo out; echo err >&2; exit 3"),
    ExecRequest("kill -9 $$"),
    ExecRequest("kill -TERM $$"),
    ExecRequest(["cat"], stdin=b"line one\nline two\n"),
    ExecRequest(["cat"], stdin=b""),
    ExecRequest("cat; echo after", stdin=None),
    ExecRequest("echo $AGENT_VAR $REQ_VAR; pwd; echo $HOME $USER", env={"REQ_VAR": "from-request"}),
    ExecRequest("pwd; ls", cwd="sub"),
    ExecRequest("printf 12345", max_output_bytes=5),
    ExecRequest("printf 123456; printf abcdef >&2", max_output_bytes=5),
    ExecRequest("head -c 300000 /dev/zero | tr '\\0' x", max_output_bytes=100_000),
    ExecRequest("printf x", max_output_bytes=0),
    ExecRequest("echo a cap over 4 GiB", max_output_bytes=1 << 33),  # kept as 4 GiB - 1 by the box
    ExecRequest("yes | head -n 3"),  # SIGPIPE has its default action again in the command
    ExecRequest("ulimit -v; ulimit -t"),  # (ulimit -u is one higher in a box: the box is one of the uid's)
    ExecRequest("ls /tmp /dev/shm; echo $(hostname)"),
    ExecRequest(["env"], env={"PATH": "/usr/bin:/bin"}),
]


@needs_bwrap
@KINDS
@PRIVILEGED
@pytest.mark.parametrize(
    "limits",
    [Limits(pids=64, memory_mb=1024), Limits(pids=64, memory_mb=128, cpu=1.0)],
    ids=["spawned", "forked"],  # fixed limits only: posix_spawn; a CPU limit or a small memory: a fork
)
async def test_box_gives_the_same_results_as_a_bubblewrap_per_command(base_dir, kind, privileged, limits):
    box = make_agent(base_dir, box=True, privileged=privileged, limits=limits, kind=kind)
    fresh = make_agent(base_dir, box=False, privileged=privileged, limits=limits)
    await box.write_file("sub/f.txt", b"x")
    assert box.box is not None and fresh.box is None
    for request in SAME:
        a, b = await box.exec(request), await fresh.exec(request)
        assert (a.exit_code, a.stdout, a.stderr, a.stdout_truncated, a.stderr_truncated, a.timed_out) == (
            b.exit_code, b.stdout, b.stderr, b.stdout_truncated, b.stderr_truncated, b.timed_out
        ), request  # fmt: skip
    assert box.box.starts == 1  # one box served every command
    await box.kill_all()


@needs_bwrap
@KINDS
@pytest.mark.parametrize("cpu", [None, 1.0], ids=["spawned", "forked"])
async def test_missing_program_and_cwd_report_127(base_dir, kind, cpu):
    agent = make_agent(base_dir, box=True, limits=Limits(cpu=cpu), kind=kind)
    r = await agent.exec(ExecRequest(["no-such-program-xyz"]))
    assert r.exit_code == 127 and r.stderr == b"cannot run 'no-such-program-xyz': No such file or directory\n"
    r = await agent.exec(ExecRequest(["true"], cwd="/no/such/dir"))
    assert r.exit_code == 127 and r.stderr == b"cannot enter '/no/such/dir': No such file or directory\n", r
    # quoted as Python's repr quotes, and capped like any stderr
    r = await agent.exec(ExecRequest(["it's-not-there"]))
    assert r.stderr == b'cannot run "it\'s-not-there": No such file or directory\n', r
    r = await agent.exec(ExecRequest(["no-such-program-xyz"], max_output_bytes=10))
    assert (r.exit_code, r.stderr) == (127, b"cannot run"), r
    # the program is looked up on the command's PATH, not the box's
    r = await agent.exec(ExecRequest(["ls", "-d", "/"], env={"PATH": "/nowhere"}))
    assert r.exit_code == 127 and b"cannot run 'ls'" in r.stderr, r
    await agent.kill_all()


@needs_bwrap
@KINDS
async def test_each_command_gets_an_empty_tmp(base_dir, kind):
    agent = make_agent(base_dir, box=True, kind=kind)
    r = await agent.exec(ExecRequest("mkdir -p /tmp/a/b && echo 1 > /tmp/a/b/f && echo 2 > /dev/shm/g && ls /tmp"))
    assert (r.exit_code, r.stdout) == (0, b"a\n"), r
    r = await agent.exec(ExecRequest("ls -A /tmp /dev/shm"))
    assert r.stdout == b"/dev/shm:\n\n/tmp:\n", r
    await agent.kill_all()


@needs_bwrap
@KINDS
async def test_scratch_space_a_box_cannot_empty_gets_a_fresh_box(base_dir, kind):
    agent = make_agent(base_dir, box=True, kind=kind)
    # a directory its owner made read-only: its file cannot be unlinked by the same uid
    r = await agent.exec(ExecRequest("mkdir /tmp/ro && touch /tmp/ro/f && chmod 555 /tmp/ro && echo made"))
    assert (r.exit_code, r.stdout) == (0, b"made\n"), r
    r = await agent.exec(ExecRequest("ls -A /tmp"))
    assert (r.exit_code, r.stdout, agent.box.starts) == (0, b"", 2), r  # a fresh box, a fresh /tmp
    # a tree deeper than PATH_MAX (4096 bytes of "d/"), which recursion or nftw cannot walk
    deep = "import os\nos.chdir('/dev/shm')\nfor _ in range(2100):\n    os.mkdir('d')\n    os.chdir('d')\n"
    r = await agent.exec(ExecRequest(["python3", "-c", deep]))
    assert r.exit_code == 0, r
    r = await agent.exec(ExecRequest("ls -A /tmp /dev/shm; echo alive"))
    assert r.stdout == b"/dev/shm:\n\n/tmp:\nalive\n", r
    await agent.kill_all()


@needs_bwrap
@KINDS
async def test_commands_start_with_every_signal_at_its_default(base_dir, kind):
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a service started under nohup, say
    try:
        agent = make_agent(base_dir, box=True, kind=kind)
        r = await agent.exec(ExecRequest("grep -E '^Sig(Ign|Blk)' /proc/self/status"))
    finally:
        signal.signal(signal.SIGHUP, previous)
    blocked, ignored = (int(x, 16) for x in r.stdout.split()[1::2])
    # signals 32 and 33 are glibc's own (below SIGRTMIN): posix_spawn, which the Python box uses, leaves them
    # ignored in the child, and no program can use them
    assert blocked == 0 and ignored & ~(0b11 << 31) == 0, r
    await agent.kill_all()


@needs_bwrap
@KINDS
async def test_a_request_over_the_box_limit_is_refused(base_dir, kind, monkeypatch):
    monkeypatch.setattr(box_client, "MAX_REQUEST_BYTES", 4096)
    agent = make_agent(base_dir, box=True, kind=kind)
    with pytest.raises(ValueError, match="at most 4096 bytes"):
        await agent.exec(ExecRequest(["cat"], stdin=b"x" * 5000))
    r = await agent.exec(ExecRequest(["cat"], stdin=b"x" * 3000))
    assert (r.exit_code, len(r.stdout)) == (0, 3000), r
    await agent.kill_all()


@needs_bwrap
@KINDS
async def test_memory_limit_applies_to_commands_not_the_box(base_dir, kind):
    agent = make_agent(base_dir, box=True, limits=Limits(memory_mb=64), kind=kind)
    r = await agent.exec(ExecRequest(["python3", "-c", "b = bytearray(200 << 20)"]))
    assert r.exit_code != 0 and b"MemoryError" in r.stderr, r
    r = await agent.exec(ExecRequest(["bash", "-c", "echo $((6 * 7))"]))
    assert r.stdout == b"42\n", r
    await agent.kill_all()


# -- restarts --------------------------------------------------------------------------------------------


@needs_bwrap
@KINDS
@PRIVILEGED
async def test_box_killed_between_commands_restarts_transparently(base_dir, kind, privileged):
    agent = make_agent(base_dir, box=True, privileged=privileged, kind=kind)
    r = await agent.exec(ExecRequest("echo one"))
    assert r.stdout == b"one\n"
    box = agent.box
    assert box is not None and box.starts == 1
    first = descendants(box.pid)  # outer bubblewrap, its init, the box
    assert len(first) == 3, first
    # the OOM killer (or anything else) kills the box itself while it waits
    inner = [p for p in first if Path(f"/proc/{p}/cmdline").read_bytes().startswith(box_head(box))]
    assert len(inner) == 1
    # the box runs as the sandbox's uid with no capability in any set (the compiled box started by a
    # root bubblewrap drops to it by itself, setpriv does it for the Python box)
    status = dict(line.split(":", 1) for line in Path(f"/proc/{inner[0]}/status").read_text().splitlines())
    if IS_ROOT:
        assert status["Uid"].split() == [str(TEST_UID)] * 4 and status["Gid"].split() == [str(TEST_UID)] * 4
        assert status["Groups"].split() in ([], [str(TEST_UID)]), status["Groups"]
    caps = [status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")]
    assert caps == ["0000000000000000"] * 5 and status["NoNewPrivs"].strip() == "1", status
    os.kill(inner[0], signal.SIGKILL)
    assert await gone(first)  # bubblewrap ends the namespace when the box dies
    r = await agent.exec(ExecRequest("echo two"))
    assert (r.exit_code, r.stdout) == (0, b"two\n") and box.starts == 2
    await agent.kill_all()
    assert await gone(descendants(box.pid) | first)


@needs_bwrap
@KINDS
async def test_command_that_kills_the_box_gets_137_and_the_next_command_runs(base_dir, kind):
    agent = make_agent(base_dir, box=True, kind=kind)
    r = await agent.exec(ExecRequest("echo before; kill -9 -1; sleep 5", timeout_s=10))
    assert r.exit_code == 137 and b"command runner was killed" in r.stderr and not r.timed_out, r
    r = await agent.exec(ExecRequest("echo after"))
    assert (r.exit_code, r.stdout) == (0, b"after\n") and agent.box.starts == 2
    await agent.kill_all()


@needs_bwrap
async def test_box_that_cannot_start_falls_back_to_a_bubblewrap_per_command(base_dir):
    agent = make_agent(base_dir, box=True)
    agent._box = box_client.Box(agent.isolation, python="/bin/false")  # an interpreter that dies at once
    r = await agent.exec(ExecRequest("echo still works"))
    assert (r.exit_code, r.stdout) == (0, b"still works\n") and agent.box is None
    empty = tempfile.mkdtemp(dir=base_dir)  # an image without python3: no box from the start
    assert make_agent(base_dir, box=True, rootfs=empty).box is None


@needs_bwrap
async def test_box_compiles_its_source_when_the_image_python_cannot_read_the_bytecode(base_dir, monkeypatch):
    sent = []
    real = box_client._box_program

    def program(source: str, magic: bytes) -> bytes:
        sent.append(real(source, magic)[:1])  # what the service would send this python
        return real(source, b"\0\0\0\0")  # what it sends a python whose bytecode differs: the source

    monkeypatch.setattr(box_client, "_box_program", program)
    agent = make_agent(base_dir, box=True)
    r = await agent.exec(ExecRequest("echo compiled"))
    assert (r.exit_code, r.stdout, agent.box.starts) == (0, b"compiled\n", 1), r
    assert sent == [b"c"]  # the image's python (the host's here) does read the service's bytecode
    await agent.kill_all()


# -- a box that misbehaves ---------------------------------------------------------------------------------

_HELLO = "import os, struct, time\nos.write(1, b'OBX1' + struct.pack('>I', os.getpid()))\nos.read(0, 1 << 20)\n"
_HANGS = _HELLO + "time.sleep(1000)\n"
_LIES = _HELLO + "os.write(1, struct.pack('>iBII', 0, 0, 1 << 30, 0))\ntime.sleep(1000)\n"


@needs_bwrap
async def test_watchdog_kills_a_box_that_never_answers(base_dir, monkeypatch):
    monkeypatch.setattr(box_client, "BOX_SOURCE", _HANGS)
    monkeypatch.setattr(box_client, "_WATCHDOG_SLACK_S", 0.5)
    agent = make_agent(base_dir, box=True)
    t0 = time.monotonic()
    r = await agent.exec(ExecRequest("true", timeout_s=0.5))
    assert r.timed_out and r.exit_code == 124 and time.monotonic() - t0 < 5, r
    assert agent.box.pid is None  # killed, restarted by the next command
    await agent.kill_all()


@needs_bwrap
async def test_an_answer_over_the_cap_is_refused(base_dir, monkeypatch):
    monkeypatch.setattr(box_client, "BOX_SOURCE", _LIES)
    agent = make_agent(base_dir, box=True)
    r = await agent.exec(ExecRequest("true", max_output_bytes=1000))
    assert r.exit_code == 137 and r.stdout == b"" and agent.box.pid is None, r
    await agent.kill_all()


# -- lifecycle in the backend ------------------------------------------------------------------------------


def uid_procs(uid: int) -> set[int]:
    return {p for p in live_pids() if os.path.exists(f"/proc/{p}") and _uid(p) == uid}


def _uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


@needs_bwrap
async def test_delete_and_close_leave_no_process(base_dir):
    b = LocalBackend(os.path.join(base_dir, "sb"))
    compiled = box_build.compiled_box() is not None
    assert b.health()["commands_run_by"] == ("a compiled box per sandbox" if compiled else "a Python box per sandbox")
    await asyncio.gather(*(b.create(f"s{i}", SandboxSpec()) for i in range(3)))
    for i in range(3):
        assert (await b.exec(f"s{i}", ExecRequest("echo ok"))).stdout == b"ok\n"
    trees = {i: descendants(b._agents[f"s{i}"].box.pid) for i in range(3)}
    assert all(len(t) == 3 for t in trees.values()), trees
    closed = b.health()["box_cpu_s"]["boxes_closed"]
    await b.delete("s0")
    assert await gone(trees[0])
    assert b.health()["box_cpu_s"]["boxes_closed"] == closed + 1  # an idle box reports its CPU, then exits
    assert not trees[1] - live_pids()  # the others' boxes are untouched
    await b.close()
    assert await gone(trees[1] | trees[2])
    if IS_ROOT:
        assert all(uid_procs(u) == set() for u in b._load_uids().values())


@needs_bwrap
async def test_an_exec_that_arrives_while_the_sandbox_is_deleted_is_refused(base_dir):
    b = LocalBackend(os.path.join(base_dir, "sb"))
    await b.create("d", SandboxSpec())
    assert (await b.exec("d", ExecRequest("echo ok"))).stdout == b"ok\n"  # its box runs: the delete waits for it
    box = descendants(b._agents["d"].box.pid)
    deleting = asyncio.ensure_future(b.delete("d"))
    await asyncio.sleep(0)  # the delete is ending the box; the sandbox's directory is still there
    assert not deleting.done()
    with pytest.raises(BackendError, match="being deleted"):
        await asyncio.wait_for(b.exec("d", ExecRequest("sleep 1000")), 10)
    await deleting
    assert await gone(box)
    with pytest.raises(SandboxNotFoundError):
        await b.exec("d", ExecRequest("true"))
    await b.close()


@needs_bwrap
async def test_sandboxes_run_concurrently_in_boxes_of_their_own(base_dir):
    b = LocalBackend(os.path.join(base_dir, "sb"), limits=Limits(pids=32))
    n = 6
    await asyncio.gather(*(b.create(f"c{i}", SandboxSpec()) for i in range(n)))
    stamp = "date +%s.%N; sleep 2; date +%s.%N"
    results = await asyncio.gather(*(b.exec(f"c{i}", ExecRequest(stamp)) for i in range(n)))
    spans = [tuple(float(x) for x in r.stdout.split()[:2]) for r in results]
    # every command's run overlaps every other's: none waited for another sandbox's box
    assert max(s for s, _ in spans) < min(e for _, e in spans), spans
    boxes = {b._agents[f"c{i}"].box.pid for i in range(n)}
    assert len(boxes) == n and None not in boxes
    # two commands at once in one sandbox are taken one after the other, both complete
    r1, r2 = await asyncio.gather(b.exec("c0", ExecRequest("echo a")), b.exec("c0", ExecRequest("echo b")))
    assert (r1.stdout, r2.stdout) == (b"a\n", b"b\n")
    await b.close()


@needs_bwrap
async def test_boxes_of_a_killed_service_die_with_it(base_dir):
    root = os.path.join(base_dir, "sb")
    script = (
        "import asyncio, os\n"
        "from orchard.env.backends.local import LocalBackend\n"
        "from orchard.env.backends.base import BackendError, ExecRequest, SandboxNotFoundError, SandboxSpec\n"
        "async def main():\n"
        f"    b = LocalBackend({root!r})\n"
        "    for i in range(2):\n"
        "        await b.create(f'v{i}', SandboxSpec())\n"
        "        await b.exec(f'v{i}', ExecRequest('true'))\n"
        "    print(*(b._agents[f'v{i}'].box.pid for i in range(2)), flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, proc.stderr.read()  # type: ignore[union-attr]
        trees = set().union(*(descendants(int(p)) for p in line.split()))
        assert len(trees) == 6, trees  # two boxes: bubblewrap, its init, the box each
    finally:
        proc.kill()
        proc.wait()
    assert await gone(trees)


# -- the compiled box ------------------------------------------------------------------------------------


@needs_bwrap
@needs_compiled_box
async def test_compiled_box_runs_in_an_image_without_python(base_dir):
    empty = tempfile.mkdtemp(dir=base_dir)  # no python3, no shell: only the bound box runs there
    agent = make_agent(base_dir, box=True, rootfs=empty, kind="compiled")
    assert agent.box is not None
    r = await agent.exec(ExecRequest(["true"], cwd="/"))
    # the answer comes from the box: it started, looked the program up on PATH and found nothing
    assert (r.exit_code, r.stderr) == (127, b"cannot run 'true': No such file or directory\n"), r
    assert agent.box.starts == 1 and agent.box.pid is not None
    await agent.kill_all()


@needs_bwrap
@needs_compiled_box
async def test_compiled_box_ends_on_a_malformed_request_and_the_next_command_runs(base_dir, monkeypatch):
    agent = make_agent(base_dir, box=True, kind="compiled")
    assert (await agent.exec(ExecRequest("echo one"))).stdout == b"one\n"
    real = box_client.encode_run

    def garbled(*args, **kw):
        frame = real(*args, **kw)
        return frame[:5] + b"\xff" * 8 + frame[13:]  # a NaN timeout: the box refuses it and exits

    monkeypatch.setattr(box_client, "encode_run", garbled)
    r = await agent.exec(ExecRequest("echo two"))
    assert r.exit_code == 137 and b"command runner was killed" in r.stderr, r
    monkeypatch.setattr(box_client, "encode_run", real)
    r = await agent.exec(ExecRequest("echo three"))
    assert (r.exit_code, r.stdout, agent.box.starts) == (0, b"three\n", 2), r
    await agent.kill_all()


def test_encode_run_refuses_what_a_box_cannot_carry():
    ok = dict(cwd="/", env={}, stdin=None, timeout_s=1.0, cap=10, own=[], rlimits=[])
    with pytest.raises(ValueError, match="argv"):
        box_client.encode_run([], **ok)
    with pytest.raises(ValueError, match="argv must not contain NUL"):
        box_client.encode_run(["a\0b"], **ok)
    with pytest.raises(ValueError, match="env must not contain NUL"):
        box_client.encode_run(["a"], **{**ok, "env": {"X": "1\0"}})
    with pytest.raises(ValueError, match="timeout_s"):
        box_client.encode_run(["a"], **{**ok, "timeout_s": float("nan")})
    frame = box_client.encode_run(["echo", "hi"], **{**ok, "stdin": b"in", "own": [(6, 7)]})
    # u32 length, op, f64 timeout, u32 cap, u8 stdin, 2 rlimit lists, 4 blocks of (count, size, data)
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4 and frame[4:5] == b"R"
    assert len(frame) == 4 + 1 + 13 + (2 + 12) + 2 + (8 + 8) + 8 + (8 + 2) + (8 + 2)  # 8: "echo\0hi\0"


@needs_compiled_box
def test_compiled_box_is_built_once_and_cached(tmp_path, monkeypatch):
    first = box_build.compiled_box(tmp_path)
    assert first is not None and os.access(first, os.X_OK) and os.path.dirname(first) == str(tmp_path)
    stamp = os.stat(first).st_mtime_ns, os.stat(first).st_ino
    monkeypatch.setattr(box_build, "_built", {})  # a new process: the file is found, not rebuilt
    assert box_build.compiled_box(tmp_path) == first
    assert (os.stat(first).st_mtime_ns, os.stat(first).st_ino) == stamp
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(first)]  # no temporary files left
    copy = box_build.install_box(tmp_path / "reachable", first)
    assert copy is not None and os.stat(copy).st_mode & 0o777 == 0o755
    assert Path(copy).read_bytes() == Path(first).read_bytes()
    with pytest.raises(ValueError, match="binary"):
        box_build.install_box(tmp_path / "reachable", str(tmp_path / "missing"))


@needs_compiled_box
def test_a_cache_others_can_write_is_not_trusted(tmp_path, monkeypatch):
    # a cached binary starts as root in a root service's sandboxes: one anybody could have replaced is rebuilt
    monkeypatch.setattr(box_build, "_built", {})
    first = Path(box_build.compiled_box(tmp_path))
    first.write_bytes(b"#!/bin/sh\necho planted\n")
    first.chmod(0o777)
    monkeypatch.setattr(box_build, "_built", {})
    again = Path(box_build.compiled_box(tmp_path))
    assert again == first and again.read_bytes()[:4] == b"\x7fELF" and again.stat().st_mode & 0o777 == 0o755
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setattr(box_build, "_built", {})
    elsewhere = Path(box_build.compiled_box(shared))
    assert elsewhere.parent != shared and os.listdir(shared) == []  # built in a private directory instead
    assert (elsewhere.parent.stat().st_mode & 0o777) == 0o700


@needs_compiled_box
def test_an_installed_copy_with_other_bytes_is_replaced(tmp_path):
    binary = box_binary()
    target = tmp_path / "box" / os.path.basename(binary)
    target.parent.mkdir()
    target.write_bytes(b"x" * os.path.getsize(binary))  # same size, other bytes
    assert box_build.install_box(tmp_path / "box", binary) == str(target)
    assert target.read_bytes() == Path(binary).read_bytes()
    assert (target.parent.stat().st_mode & 0o777) == 0o711


@needs_compiled_box
def test_temporary_files_of_a_killed_build_or_copy_are_removed(tmp_path, monkeypatch):
    old, fresh = tmp_path / ".box-killedbuild", tmp_path / ".box-buildingnow"
    for p in (old, fresh):
        p.write_bytes(b"half a binary")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    monkeypatch.setattr(box_build, "_built", {})
    built = box_build.compiled_box(tmp_path)
    # the hour-old one was left by a killed build; the fresh one may be a concurrent builder's
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(built), fresh.name])
    reachable = tmp_path / "reachable"
    reachable.mkdir()
    (reachable / ".box-killedcopy").write_bytes(b"half a copy")
    os.utime(reachable / ".box-killedcopy", (time.time() - 3600, time.time() - 3600))
    box_build.install_box(reachable, built)
    assert os.listdir(reachable) == [os.path.basename(built)]


def test_box_source_compiles_without_warnings(tmp_path):
    compiler = box_build.find_compiler()
    if compiler is None:
        lacking("a C compiler", "none found")
    done = subprocess.run([*compiler, *box_build.FLAGS, "-Werror", "-o", str(tmp_path / "box"), str(box_build.BOX_C)],
                          capture_output=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()


def test_a_failing_compiler_gives_no_compiled_box(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(box_build, "_built", {})
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")
    assert box_build.compiled_box(tmp_path) is None
    assert "Python box" in caplog.text and os.listdir(tmp_path) == []


@needs_bwrap
async def test_without_a_compiler_the_backend_runs_the_python_box(base_dir, monkeypatch):
    monkeypatch.setattr(box_build, "_built", {})
    monkeypatch.setattr(box_build, "find_compiler", lambda: None)
    b = LocalBackend(os.path.join(base_dir, "sb"))
    assert b.box_binary is None and b.health()["commands_run_by"] == "a Python box per sandbox"
    await b.create("p", SandboxSpec())
    assert (await b.exec("p", ExecRequest("echo py"))).stdout == b"py\n"
    assert not b._agents["p"].box.compiled
    await b.close()


@needs_bwrap
async def test_a_compiled_box_that_cannot_start_falls_back_to_the_python_box(base_dir):
    broken = os.path.join(base_dir, "not-a-program")
    Path(broken).write_bytes(b"\x7fELF garbage")  # executable bits, but exec fails (ENOEXEC)
    os.chmod(broken, 0o755)
    agent = make_agent(base_dir, box=True, kind="compiled", binary=broken)
    assert agent.box is not None and agent.box.compiled
    r = await agent.exec(ExecRequest("echo via python"))
    assert (r.exit_code, r.stdout) == (0, b"via python\n"), r
    assert agent.box is not None and not agent.box.compiled and agent.box.starts == 1
    await agent.kill_all()
    # later sandboxes with the same binary go straight to the Python box
    again = SandboxAgent(agent.isolation, box=True)
    assert again.box is not None and not again.box.compiled
    await again.kill_all()


@needs_compiled_box
@pytest.mark.parametrize(
    "args, why",
    [(["--user", "0:0"], b"non-root"), (["--user", "12"], b"UID:GID"), (["--user", "x:1"], b"UID:GID"),
     (["extra"], b"usage"), ([], b"pid namespace")],
)  # fmt: skip
def test_compiled_box_refuses_a_bad_command_line(args, why):
    done = subprocess.run([box_binary(), *args], stdin=subprocess.DEVNULL, capture_output=True, timeout=10)
    assert done.returncode == 3 and why in done.stderr and done.stdout == b"", done


def test_switches_user_needs_an_unlimited_launch(base_dir):
    agent = make_agent(base_dir, box=False)
    with pytest.raises(ValueError, match="switches_user"):
        agent.isolation.launch(["true"], cwd="/", env={}, timeout_s=None, switches_user=True)


@needs_bwrap
@needs_compiled_box
async def test_a_compiled_box_that_started_before_is_not_given_up_for_one_failure(base_dir):
    binary = os.path.join(base_dir, "box")
    shutil.copyfile(box_binary(), binary)
    os.chmod(binary, 0o755)
    agent = make_agent(base_dir, box=True, kind="compiled", binary=binary)  # a copy the test can break
    assert (await agent.exec(ExecRequest("echo one"))).stdout == b"one\n" and agent.box.compiled
    await agent.box.kill()
    os.chmod(binary, 0)  # the restart fails (exec refused) ...
    r = await agent.exec(ExecRequest("echo two"))
    assert (r.exit_code, r.stdout) == (0, b"two\n") and not agent.box.compiled  # ... this sandbox goes on
    os.chmod(binary, 0o755)
    assert box_client.Box(agent.isolation).compiled  # a transient failure: later sandboxes keep the binary
    await agent.kill_all()
