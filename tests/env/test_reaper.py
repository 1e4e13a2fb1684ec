"""Orphans of sandboxes are reaped: bubblewrap's inits (which it leaves to whoever adopts them) and the
left-behind children of process-group commands, so no zombie holds a pid or a sandbox uid's pids limit.
Exit statuses that belong to a launcher (claimed pids, ordinary children) are never taken."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import tempfile
import threading
import time

import pytest
from _box import needs_root, requires

from orchard.env.agent import BUBBLEWRAP, PROCESS_GROUP, Isolation, Limits, SandboxAgent, Workspace, reaper
from orchard.env.agent.isolation import probe_bubblewrap
from orchard.env.backends.base import ExecRequest

IS_ROOT = os.geteuid() == 0
TEST_UID = 201_361
RUN_AS = (TEST_UID, TEST_UID) if IS_ROOT else None
BWRAP_PROBLEM = probe_bubblewrap(RUN_AS)
needs_bwrap = requires(BWRAP_PROBLEM, "bubblewrap")


@pytest.fixture
def ws():
    base = tempfile.mkdtemp(prefix="orchard-reaper-")
    os.chmod(base, 0o711)
    path = os.path.join(base, "ws")
    os.mkdir(path, 0o700)
    if IS_ROOT:
        os.chown(path, TEST_UID, TEST_UID)
    yield path
    shutil.rmtree(base, ignore_errors=True)


def agent(ws: str, mode: str, **kw) -> SandboxAgent:
    workspace = Workspace(ws, uid=RUN_AS[0] if RUN_AS else None, gid=RUN_AS[1] if RUN_AS else None)
    return SandboxAgent(Isolation(workspace, mode=mode, run_as=RUN_AS, **kw), box=False)


def is_zombie(pid: int | str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def zombie_children() -> list[int]:
    out = []
    for path in glob.glob("/proc/self/task/*/children"):
        with open(path) as f:
            out += [int(pid) for pid in f.read().split() if is_zombie(pid)]
    return out


def zombies_of_uid(uid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid and is_zombie(entry):
                    out.append(int(entry))
            except OSError:
                continue
    return out


def exited_child(uid: int | None = None) -> int:
    """A child of this process that has exited (a zombie until waited for), as `uid` if given."""
    pid = os.fork()
    if pid == 0:
        try:
            if uid is not None:
                os.setgid(uid)
                os.setuid(uid)
        finally:
            os._exit(7)
    deadline = time.monotonic() + 5
    while pid not in zombie_children() and time.monotonic() < deadline:
        time.sleep(0.01)
    return pid


def zombie_sandbox_inits() -> set[int]:
    """Zombies that are the init of a deeper pid namespace than this process's and wait on this process or on the
    host's pid 1 (an init left over for it); not those of other services on the machine, which wait on their own."""
    depth = len(status_field(os.getpid(), "NSpid"))
    waiters = {str(os.getpid()), "1"}
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            nspid = status_field(int(entry), "NSpid")
            if len(nspid) > depth and nspid[-1] == "1" and is_zombie(entry) \
                    and set(status_field(int(entry), "PPid")) & waiters:
                out.add(int(entry))
    return out


def status_field(pid: int, name: str) -> list[str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return line.split()[1:]
    except OSError:
        pass
    return []


@needs_bwrap
@pytest.mark.parametrize("privileged", [None, False], ids=["root-started", "userns"])
async def test_bubblewrap_inits_are_reaped_after_each_command(ws, privileged):
    before = zombie_sandbox_inits()
    a = agent(ws, BUBBLEWRAP, privileged=privileged)
    assert reaper.adopting()  # a bubblewrap sandbox makes this process adopt orphans
    for _ in range(20):
        r = await a.exec(ExecRequest("true & true & wait; echo ok"))
        assert (r.exit_code, r.stdout) == (0, b"ok\n"), r
    # the outer bubblewrap exits before its init; that init came here and was reaped, so none is left over
    # for the host's pid 1 (which some hosts reap late, and a service that is pid 1 in a container never)
    assert zombie_sandbox_inits() - before == set()
    if IS_ROOT:
        assert zombies_of_uid(TEST_UID) == []


@needs_bwrap
@needs_root
async def test_earlier_commands_do_not_eat_a_user_namespace_sandboxs_pids_limit(ws):
    # In a user namespace the init runs as the sandbox's uid: each one left unreaped counted against the
    # sandbox's RLIMIT_NPROC until the host got round to it, and forks failed after a few commands.
    a = agent(ws, BUBBLEWRAP, privileged=False, limits=Limits(pids=6, memory_mb=1024))
    for i in range(12):
        r = await a.exec(ExecRequest("(true); (true); echo ok"))
        assert (r.exit_code, r.stdout, r.stderr) == (0, b"ok\n", b""), (i, r)


@needs_root
async def test_left_behind_children_of_a_process_group_command_are_reaped(ws):
    before = set(zombie_children())
    a = agent(ws, PROCESS_GROUP)
    assert reaper.adopting()
    r = await a.exec(ExecRequest("sleep 30 & sleep 30 & echo started"))
    assert (r.exit_code, r.stdout) == (0, b"started\n"), r
    # the two sleeps outlived their shell, came to this process (a subreaper) and were killed at the end
    # of the exec; their zombies are reaped, not left holding the sandbox uid's pids
    assert zombies_of_uid(TEST_UID) == []
    assert set(zombie_children()) - before == set()


@needs_root
def test_a_claimed_child_is_left_to_its_launcher():
    assert reaper.adopt_orphans()
    reaper.track_uid(TEST_UID)
    pid = exited_child(TEST_UID)
    reaper.claim(pid)
    reaper.claim(pid)  # claims count: the pid, reused, was claimed again before the first claim ended
    try:
        reaper.reap_orphans()
        reaper.unclaim(pid)
        assert not reaper.reap_child_of_uid(pid, TEST_UID)
        reaper.reap_orphans()
        assert pid in zombie_children()
    finally:
        reaper.unclaim(pid)
    reaper.reap_orphans()
    assert pid not in zombie_children()
    reaper.unclaim(pid)  # once more than claimed: nothing to undo, no error


def test_an_ordinary_child_is_never_taken():
    pid = exited_child()
    assert not reaper.reap_init(pid)  # not the init of a deeper pid namespace
    reaper.reap_orphans()  # nor of a sandbox's uid
    assert os.waitpid(pid, 0) == (pid, 7 << 8)  # its exit status is still there for its launcher


def test_a_failed_probe_leaves_the_process_as_it_was(monkeypatch):
    monkeypatch.setattr(reaper, "_adopting", None)
    assert probe_bubblewrap(bwrap="/bin/false") is not None
    assert not reaper.adopting()  # a service that falls back to process groups adopts nothing
    reaper.adopt_orphans()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="pid"):
        reaper.reap_init(0)
    with pytest.raises(ValueError, match="uid"):
        reaper.track_uid(0)
    with pytest.raises(ValueError, match="wait_s"):
        reaper.reap_orphans(wait_s=-1)


def test_a_forked_child_starts_afresh():
    reaper.adopt_orphans()
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with reaper.spawning():  # another thread holds the lock at the fork; the child will not have it
            held.set()
            done.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    try:
        pid = os.fork()
        if pid == 0:
            signal.alarm(5)  # an inherited, held lock would hang the child: end it as a failure
            reaper.claim(1234)
            reaper.unclaim(1234)
            os._exit(0 if not reaper.adopting() else 3)  # nor is it a subreaper: the kernel did not pass it on
    finally:
        done.set()
        t.join()
    assert os.waitpid(pid, 0)[1] == 0
