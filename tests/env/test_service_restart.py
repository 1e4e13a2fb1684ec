"""An orchestrator killed with SIGKILL and restarted on the same state: the real service as a child
process, the real backend, real HTTP."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time

import pytest

from orchard.env import NotFoundError, SandboxClient
from orchard.env.backends.base import SandboxSpec
from orchard.env.backends.local import LocalBackend
from orchard.env.embedded import serve


@pytest.fixture
def root():
    path = tempfile.mkdtemp(prefix="orchard-env-restart-")  # parents traversable by sandbox uids
    os.chmod(path, 0o711)  # sandbox uids walk through it to their workspaces
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
def test_sigkill_then_restart_keeps_sandboxes_reaps_expired_marks_lost_jobs(root):
    key = "restart-key"
    with serve(root, api_key=key, in_process=False) as svc:
        client = SandboxClient(svc.url, key, auto_cleanup=False)
        keep = client.create(sandbox_id="keep")
        keep.upload("/workspace/state.txt", b"written before the crash")
        client.create(sandbox_id="short-ttl", ttl_seconds=1.5)
        client.create(sandbox_id="idle", heartbeat_timeout=1.5)
        done = keep.exec("echo finished-before-the-crash")
        running = keep.exec("sleep 30", wait=False)
        while client.get_job(running.job_id).status != "running":
            time.sleep(0.02)
        svc.process.send_signal(signal.SIGKILL)
        assert svc.process.wait(timeout=10) == -signal.SIGKILL
        client.close()

    time.sleep(1.6)  # short-ttl and idle expire while no orchestrator runs
    orphan_backend = LocalBackend(f"{root}/sandboxes")  # a sandbox the store never heard of
    asyncio.run(orphan_backend.create("orphan", SandboxSpec()))
    asyncio.run(orphan_backend.close())  # frees the root for the service (one service per root)

    with serve(root, api_key=key, in_process=False) as svc, SandboxClient(svc.url, key) as client:
        live = {s["sandbox_id"] for s in client.list_sandboxes()}
        assert live == {"keep"}
        keep = client.sandbox("keep")
        assert keep.download("state.txt") == b"written before the crash"
        assert keep.exec("echo alive").stdout == "alive\n"
        assert client.get_job(done.job_id).stdout == "finished-before-the-crash\n"  # finished jobs persist
        lost = client.get_job(running.job_id)
        assert lost.status == "failed" and lost.error.startswith("lost:") and lost.exit_code is None
        for gone in ("short-ttl", "idle"):
            with pytest.raises(NotFoundError):
                client.sandbox(gone)
        assert asyncio.run(orphan_backend.list_ids()) == ["keep"]  # expired and orphan sandboxes destroyed
        keep.delete()


def test_child_service_exits_when_its_parent_is_sigkilled(root):
    """A recipe killed with SIGKILL cannot stop the service it started: the service notices and shuts down."""
    import subprocess
    import sys

    script = (
        "import sys, time\n"
        "from orchard.env.embedded import serve\n"
        f"with serve(root_dir={str(root)!r}, in_process=False) as s:\n"
        "    print(s.process.pid, flush=True)\n"
        "    time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert os.path.exists(f"/proc/{child}")
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.waitpid(child, os.WNOHANG)  # not ours (re-parented), so this raises; a zombie never stays
            except ChildProcessError:
                pass
            if not os.path.exists(f"/proc/{child}") or _state(child) == "Z":
                break
            time.sleep(0.2)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the embedded service outlived its SIGKILLed parent by 20 s")
    finally:
        if parent.poll() is None:
            parent.kill()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
