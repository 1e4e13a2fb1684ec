"""The asyncio client against the real service: files, patches, the PTY, and load (200 concurrent execs over
50 sandboxes); its aiohttp transport against a scripted loopback server: retries, keys, errors, queries."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from urllib.parse import parse_qs

import httpx
import pytest
from _archives import TREE, TREE_BYTES, TREE_FILES, bad_archive, tar_of

from orchard.env import (
    AsyncSandboxClient,
    AuthError,
    NotFoundError,
    PathError,
    SandboxConnectionError,
    ServiceUnavailable,
)
from orchard.env.client import AsyncSandbox, RetryPolicy
from orchard.env.embedded import serve


@pytest.fixture(scope="module")
def service():
    with serve() as svc:
        yield svc


async def test_async_files_patch_pty_and_jobs(service, tmp_path):
    async with AsyncSandboxClient(service.url, service.api_key) as client, await client.create() as sb:
        blob = os.urandom(1001)
        assert await sb.upload("/workspace/a/b.bin", blob) == 1001
        assert await sb.download("a/b.bin") == blob
        local = tmp_path / "in.txt"
        local.write_text("one\n")
        await sb.upload_file(local, "f.txt")
        assert await sb.download_file("f.txt", tmp_path / "out.txt") == 4
        assert (tmp_path / "out.txt").read_text() == "one\n"
        assert {e.name for e in await sb.list_files()} == {"a", "f.txt"}
        with pytest.raises(PathError):
            await sb.download("../../etc/passwd")
        with pytest.raises(NotFoundError):
            await sb.download("nope")
        patch = "--- a/f.txt\n+++ b/f.txt\n@@ -1 +1,2 @@\n one\n+two\n"
        assert (await sb.apply_patch(patch)).success
        assert await sb.download("f.txt") == b"one\ntwo\n"
        job = await sb.exec(["sh", "-c", "sleep 0.2; echo late"], wait=False)
        assert (await sb.get_job(job.job_id)).status in ("queued", "running")
        assert (await sb.wait_job(job.job_id, 30)).stdout == "late\n"
        assert (await sb.resources())["disk_bytes"] >= 1001 + 8
        await sb.heartbeat()
        proc = await sb.pty(["bash", "--norc", "--noprofile"], cwd="/workspace/a", env={"WHO": "async"})
        async with proc:
            await proc.write("echo $WHO-$(pwd)\n")
            out = await proc.read_until(b"async-/workspace/a", timeout=20)
            assert b"async-/workspace/a" in out
            await proc.write("exit 3\n")
            assert await proc.wait(timeout=20) == 3


@pytest.mark.slow
async def test_async_upload_archive_unpacks_and_refuses_an_escape(service):
    async with AsyncSandboxClient(service.url, service.api_key) as client, await client.create() as sb:
        assert await sb.upload_archive("/workspace/repo", tar_of(*TREE)) == TREE_BYTES
        assert (await sb.exec("stat -c %a repo/run.sh repo/empty && cat repo/pkg/hard.py")).stdout == (
            "755\n700\n" + TREE_FILES["pkg/hard.py"][0].decode())
        with pytest.raises(PathError):
            await sb.upload_archive("/workspace", bad_archive("symlink_climbs_out"))
        assert not (await sb.exec("ls good.txt")).ok


async def test_200_concurrent_execs_over_50_sandboxes_all_succeed(service):
    async with AsyncSandboxClient(service.url, service.api_key) as client:
        sandboxes = await asyncio.gather(*(client.create() for _ in range(50)))
        assert len({sb.sandbox_id for sb in sandboxes}) == 50

        async def run(i: int):
            sb = sandboxes[i % 50]
            return i, await sb.exec(f"echo {i} >> seen.txt; echo {i}")

        results = await asyncio.gather(*(run(i) for i in range(200)))
        assert all(r.ok and r.stdout == f"{i}\n" for i, r in results), [r for _, r in results if not r.ok][:3]
        # every sandbox saw exactly its four commands, once each
        for k, sb in enumerate(sandboxes):
            seen = sorted(int(x) for x in (await sb.download("seen.txt")).split())
            assert seen == [k, k + 50, k + 100, k + 150]
        summary = await client.resources()
        assert summary["sandboxes"] == 50 and summary["running_execs"] == 0 and summary["queued_execs"] == 0
        await asyncio.gather(*(sb.delete() for sb in sandboxes))
        assert await client.list_sandboxes() == []


class ScriptedServer:
    """A loopback HTTP/1.1 server that answers the i-th request with `answers[i]` (status, headers, body) or,
    for None, closes the connection without a byte; it records each request's line, headers and body."""

    def __init__(self, answers: list[tuple[int, dict[str, str], bytes] | None], *, close_after: bool = False) -> None:
        self.answers = list(answers)
        self.close_after = close_after  # close each connection after its answer, as an expired keep-alive does
        self.connections = 0
        self.seen: list[tuple[str, dict[str, str], bytes]] = []
        self.url = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> ScriptedServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                line, *rest = head.strip().split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in rest)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                self.seen.append((line, headers, body))
                answer = self.answers.pop(0) if self.answers else (500, {}, b'{"detail": "script ran out"}')
                if answer is None:
                    break
                status, extra, payload = answer
                lines = [f"HTTP/1.1 {status} X", f"content-length: {len(payload)}",
                         *(f"{k}: {v}" for k, v in extra.items())]
                writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
                await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


FAST = RetryPolicy(max_attempts=4, backoff_base_s=0.01, backoff_max_s=0.05)
JOB = json.dumps({"job_id": "j1", "status": "succeeded", "exit_code": 0, "stdout": "x\n"}).encode()


async def test_aiohttp_path_retries_503_and_lost_answers_with_one_key_then_maps_errors():
    busy = (503, {"Retry-After": "0.1"}, b'{"detail": "busy"}')
    script = [busy, None, (200, {}, JOB), (404, {}, b'{"detail": "Sandbox s not found"}'),
              (403, {}, b'{"detail": "Invalid API key"}'), (503, {}, b"not json")]
    async with ScriptedServer(script) as server, AsyncSandboxClient(server.url, "k", retry=FAST,
                                                                auto_cleanup=False) as client:
        start = time.monotonic()
        data = await client.request("POST", "/sandboxes/s/exec", json={"command": "echo x", "wait": True})
        assert data["stdout"] == "x\n" and len(server.seen) == 3  # 503, dropped, answered
        assert time.monotonic() - start >= 0.1  # Retry-After honoured
        keys = {headers["idempotency-key"] for _, headers, _ in server.seen}
        assert len(keys) == 1 and keys != {""}  # one key on every attempt
        line, headers, body = server.seen[0]
        assert line == "POST /sandboxes/s/exec HTTP/1.1" and headers["x-api-key"] == "k"
        assert headers["content-type"] == "application/json"
        assert json.loads(body) == {"command": "echo x", "wait": True}
        with pytest.raises(NotFoundError, match="404: Sandbox s not found"):
            await client.request("GET", "/sandboxes/s")
        with pytest.raises(AuthError) as auth:
            await client.request("GET", "/resources")
        assert auth.value.status_code == 403
        once = AsyncSandboxClient(server.url, "k", retry=RetryPolicy(max_attempts=1), auto_cleanup=False)
        with pytest.raises(ServiceUnavailable) as busy_error:  # the final attempt's 503 is raised
            await once.request("GET", "/health")
        await once.aclose()
        assert busy_error.value.retry_after_s == 1.0 and "not json" in str(busy_error.value)
        assert "idempotency-key" not in server.seen[3][1]  # only mutating requests carry one


async def test_aiohttp_path_query_parameters_decode_as_httpx_sends_them():
    listing = (200, {}, b'{"path": "/w", "files": []}')
    odd_path = "/w x/a&b=c+ü"
    async with ScriptedServer([listing, listing]) as server, AsyncSandboxClient(server.url, "k",
                                                                            auto_cleanup=False) as client:
        sb = AsyncSandbox(client, "s", {}, owned=False)
        assert await sb.list_files(odd_path, recursive=True) == []
        assert await sb.list_files("/w") == []
    for (line, _, _), params in zip(server.seen, [{"path": odd_path, "recursive": True},
                                                  {"path": "/w", "recursive": False}], strict=True):
        target = line.split(" ")[1]
        reference = httpx.Request("GET", "http://x/sandboxes/s/files/list", params=params).url
        assert target.split("?")[0] == reference.path
        assert parse_qs(target.split("?")[1]) == parse_qs(reference.query.decode())  # booleans "true"/"false"


async def test_connection_refused_gives_up_with_a_typed_error_after_every_attempt():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    async with AsyncSandboxClient(f"http://127.0.0.1:{port}", "k", retry=FAST, auto_cleanup=False) as client:
        with pytest.raises(SandboxConnectionError, match="4 attempts"):
            await client.health()


def test_one_client_serves_several_event_loops(service):
    client = AsyncSandboxClient(service.url, service.api_key, auto_cleanup=False)
    for _ in range(2):  # each asyncio.run has its own loop: the client opens a session in each
        assert asyncio.run(client.health())["status"] == "healthy"
    asyncio.run(client.aclose())


async def test_httpx_transport_path_keeps_the_same_retries():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("Idempotency-Key"))
        if len(seen) < 2:
            return httpx.Response(503, headers={"Retry-After": "0.05"}, json={"detail": "busy"})
        return httpx.Response(200, content=JOB)

    async with AsyncSandboxClient("http://svc.invalid", "k", transport=httpx.MockTransport(handler),
                                  auto_cleanup=False) as client:
        sb = AsyncSandbox(client, "s", {}, owned=False)
        job = await sb.exec("echo x")
    assert job.ok and job.stdout == "x\n" and len(seen) == 2 and seen[0] == seen[1] and seen[0]


async def test_aiohttp_path_goes_through_a_proxy_from_the_environment_as_httpx_does(monkeypatch):
    async with ScriptedServer([(200, {}, b'{"status": "healthy"}')]) as proxy:
        for name in ("NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        async with AsyncSandboxClient("http://svc.invalid:8000", "k", auto_cleanup=False) as client:
            assert (await client.health())["status"] == "healthy"
    line, headers, _ = proxy.seen[0]
    assert line == "GET http://svc.invalid:8000/health HTTP/1.1"  # the absolute form a proxy is sent
    assert headers["x-api-key"] == "k"


def test_importing_orchard_env_does_not_import_aiohttp():
    import subprocess
    import sys

    code = "import sys, orchard.env; print('aiohttp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr  # loaded by the first AsyncSandboxClient, not by the import


async def test_a_connection_the_server_closed_is_not_reused():
    ok = (200, {}, b'{"status": "healthy"}')
    async with ScriptedServer([ok, ok, ok], close_after=True) as server, AsyncSandboxClient(
            server.url, "k", retry=RetryPolicy(max_attempts=1), auto_cleanup=False) as client:
        for _ in range(3):  # one attempt each: a stale pooled connection would fail it
            assert (await client.health())["status"] == "healthy"
            await asyncio.sleep(0.05)  # the server's close arrives before the next request
    assert len(server.seen) == 3 and server.connections == 3
