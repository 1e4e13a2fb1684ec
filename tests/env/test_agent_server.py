"""The exec agent as a real server process (`python -m orchard.env.agent`) on a Unix socket: real HTTP, a
real WebSocket PTY, real child processes."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from _archives import TREE, TREE_BYTES, bad_archive, tar_of
from websockets.asyncio.client import unix_connect

TOKEN = secrets.token_hex(16)
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module", params=["auto", "process-group"])
def agent_server(request):
    """The agent as a pod would run it (process-group: the pod is the boundary) and with auto-detection."""
    base = tempfile.mkdtemp(prefix="orchard-agent-srv-")
    os.chmod(base, 0o711)
    root = os.path.join(base, "ws")
    sock = os.path.join(base, "agent.sock")
    env = {**os.environ, "ORCHARD_AGENT_TOKEN": TOKEN}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchard.env.agent",
            "--root",
            root,
            "--uds",
            sock,
            "--uid",
            "201999",
            "--isolation",
            request.param,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if os.path.exists(sock):
            try:
                with httpx.Client(transport=httpx.HTTPTransport(uds=sock)) as c:
                    if c.get("http://agent/health").status_code == 200:
                        break
            except httpx.TransportError:
                pass
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read().decode())  # type: ignore[union-attr]
        time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError("agent did not start")
    yield sock, root, request.param
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    shutil.rmtree(base, ignore_errors=True)


def client(sock: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.AsyncHTTPTransport(uds=sock), base_url="http://agent", timeout=30
    )


def decode(body: dict) -> tuple[int, bytes, bytes]:
    return body["exit_code"], base64.b64decode(body["stdout_b64"]), base64.b64decode(body["stderr_b64"])


async def test_health_and_auth(agent_server):
    sock, root, mode = agent_server
    async with client(sock) as c:
        r = await c.get("/health")
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert r.json()["isolation"] in ("bubblewrap", "process-group")
        if mode == "process-group":
            assert r.json()["isolation"] == "process-group" and r.json()["workdir"] == root
        for method, url in [("POST", "/exec"), ("GET", "/files?path=x"), ("GET", "/resources")]:
            r = await c.request(method, url, json={"command": "true"})
            assert r.status_code == 401, (url, r.text)
        r = await c.post("/exec", json={"command": "true"}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401


async def test_exec_files_patch_over_http(agent_server):
    sock, root, _ = agent_server
    async with client(sock) as c:
        r = await c.post(
            "/exec",
            headers=AUTH,
            json={"command": "cat; echo err >&2; exit 4", "stdin_b64": base64.b64encode(b"in").decode()},
        )
        assert r.status_code == 200 and decode(r.json()) == (4, b"in", b"err\n")

        r = await c.put("/files", params={"path": "d/f.txt", "mode": "640"}, content=b"data", headers=AUTH)
        assert r.status_code == 204
        assert os.stat(os.path.join(root, "d", "f.txt")).st_mode & 0o777 == 0o640
        r = await c.get("/files", params={"path": "d/f.txt"}, headers=AUTH)
        assert r.content == b"data"
        r = await c.get("/files/list", params={"path": ".", "recursive": "true"}, headers=AUTH)
        assert [f["path"] for f in r.json()["files"]] == ["d", "d/f.txt"]
        for bad in ["../x", "/etc/passwd"]:
            r = await c.get("/files", params={"path": bad}, headers=AUTH)
            # the pod agent's answer, which the Kubernetes backend turns into PathEscapeError (before: no "error")
            assert (r.status_code, r.json()["error"]) == (400, "path_escape"), r.text
        r = await c.get("/files", params={"path": "missing"}, headers=AUTH)
        assert (r.status_code, r.json()["error"]) == (404, "not_found"), r.text
        r = await c.post("/exec", headers=AUTH, json={"command": "true", "timeout_s": -1})
        assert r.status_code == 400

        patch = "--- a/d/f.txt\n+++ b/d/f.txt\n@@ -1 +1 @@\n-data\n\\ No newline at end of file\n+new\n"
        r = await c.post("/apply_patch", headers=AUTH, json={"patch": patch})
        assert r.json()["exit_code"] == 0, r.json()
        assert (await c.get("/files", params={"path": "d/f.txt"}, headers=AUTH)).content == b"new\n"
        r = await c.get("/resources", headers=AUTH)
        assert r.json()["pids"] == 256 and r.json()["disk_bytes"] > 0

        r = await c.put("/files/archive", params={"path": "repo"}, content=tar_of(*TREE, gz=True), headers=AUTH)
        assert r.json() == {"entries": len(TREE) - 1, "bytes": TREE_BYTES}  # the "./" entry is repo itself
        assert os.stat(os.path.join(root, "repo", "run.sh")).st_mode & 0o777 == 0o755
        r = await c.put("/files/archive", params={"path": "."}, content=bad_archive("symlink_absolute"), headers=AUTH)
        assert r.status_code == 400 and "absolute" in r.json()["detail"]
        assert not os.path.exists(os.path.join(root, "good.txt"))


async def test_timeout_over_http_leaves_nothing_and_agent_survives(agent_server):
    sock, _, _ = agent_server
    m = f"{970_000 + secrets.randbelow(9999)}.{secrets.randbelow(10**6):06d}"
    async with client(sock) as c:
        t0 = time.monotonic()
        r = await c.post(
            "/exec", headers=AUTH, json={"command": f"setsid sleep {m} & sleep {m}", "timeout_s": 0.8}
        )
        body = r.json()
        assert body["timed_out"] and body["exit_code"] == 124 and time.monotonic() - t0 < 3
        await asyncio.sleep(0.2)
        left = []
        for e in os.listdir("/proc"):
            if e.isdigit():
                try:
                    with open(f"/proc/{e}/cmdline", "rb") as f:
                        if m.encode() in f.read():
                            left.append(e)
                except OSError:
                    pass
        assert left == []
        r = await c.post("/exec", headers=AUTH, json={"command": ["echo", "still here"]})
        assert decode(r.json())[1] == b"still here\n"


async def test_pty_over_websocket(agent_server):
    sock, _, _ = agent_server
    async with unix_connect(sock, "ws://agent/pty?cols=80&rows=24", additional_headers=AUTH) as ws:
        await ws.send(b"stty size; echo $((7*6))z\n")
        buf = b""
        while b"42z" not in buf:
            buf += await asyncio.wait_for(ws.recv(), 10)
        assert b"24 80" in buf
        await ws.send(json.dumps({"resize": [100, 30]}))
        await ws.send(b"stty size\n")
        while b"30 100" not in buf:
            buf += await asyncio.wait_for(ws.recv(), 10)
        await ws.send(b"exit\n")
        with pytest.raises(Exception):  # noqa: B017 - the server closes the socket when the shell ends
            while True:
                await asyncio.wait_for(ws.recv(), 10)


class _BrokenDisk:
    """An agent whose `resources` fails with an error no route expects (the disk it measures is gone)."""

    async def resources(self):
        raise OSError(5, "Input/output error")


async def test_an_unexpected_error_is_a_500_with_its_cause_as_the_pod_agent_answers():
    from orchard.env.agent.server import create_agent_app

    app = create_agent_app(_BrokenDisk(), token=TOKEN)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://agent") as c:
        r = await c.get("/resources", headers=AUTH)
    # before: FastAPI's bare text "Internal Server Error", so the Kubernetes backend's client had no cause
    assert (r.status_code, r.json()) == (500, {"detail": "OSError: [Errno 5] Input/output error"})
