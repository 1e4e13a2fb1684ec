"""The client's retries, idempotency keys and clean-up, against the real service with faults injected."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from orchard.env import (
    AsyncSandboxClient,
    AuthError,
    SandboxClient,
    SandboxConnectionError,
    ServiceUnavailable,
)
from orchard.env.client import RetryPolicy
from orchard.env.embedded import serve

FAST = RetryPolicy(max_attempts=4, backoff_base_s=0.01, backoff_max_s=0.05)


class DroppingProxy:
    """A loopback TCP relay that loses the answer to the first `drops` requests containing `trigger`: it
    forwards the request, waits until the server starts to answer (so the server accepted and ran it), then
    closes the client's connection without relaying a byte of the answer."""

    def __init__(self, target_url: str, trigger: bytes, drops: int = 1) -> None:
        host, port = target_url.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.trigger = trigger
        self.drops_left = drops
        self.dropped = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target)
        except OSError:
            client.close()
            return
        drop_answer = threading.Event()

        def upward() -> None:
            try:
                while data := client.recv(65536):
                    if self.trigger in data:
                        with self._lock:
                            if self.drops_left > 0:
                                self.drops_left -= 1
                                drop_answer.set()
                    upstream.sendall(data)
            except OSError:
                pass

        threading.Thread(target=upward, daemon=True).start()
        try:
            while data := upstream.recv(65536):
                if drop_answer.is_set():
                    self.dropped += 1
                    return
                client.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (client, upstream):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def close(self) -> None:
        self._listener.close()


@pytest.fixture(scope="module")
def service():
    with serve(reap_interval_s=0.2) as svc:
        yield svc


def test_dropped_connection_after_exec_was_accepted_runs_it_exactly_once(service):
    proxy = DroppingProxy(service.url, trigger=b"count-me", drops=1)
    try:
        with SandboxClient(proxy.url, service.api_key, retry=FAST) as client, client.create() as sb:
            result = sb.exec("echo count-me >> side_effects.txt; wc -l < side_effects.txt")
            assert proxy.dropped == 1  # the first answer was lost on the way back
            assert result.ok and result.stdout == "1\n"
            assert sb.download("side_effects.txt") == b"count-me\n"  # one line: the command ran once
    finally:
        proxy.close()


def test_dropped_create_and_delete_answers_do_not_double(service):
    proxy = DroppingProxy(service.url, trigger=b"drop-me", drops=1)
    try:
        with SandboxClient(proxy.url, service.api_key, retry=FAST) as client:
            before = {s["sandbox_id"] for s in client.list_sandboxes()}
            sb = client.create(env={"MARK": "drop-me"})  # the answer is lost; the retry gets the same sandbox
            assert proxy.dropped == 1
            after = {s["sandbox_id"] for s in client.list_sandboxes()}
            assert after - before == {sb.sandbox_id}  # one sandbox, not two
            assert sb.exec("echo $MARK").stdout == "drop-me\n"
            proxy.trigger, proxy.drops_left = b"DELETE", 1
            path = f"/sandboxes/{sb.sandbox_id}"
            keyed = {"X-API-Key": service.api_key, "Idempotency-Key": "delete-" + sb.sandbox_id}
            with pytest.raises(httpx.TransportError):
                httpx.delete(proxy.url + path, headers=keyed)  # deleted, but the answer is lost
            assert proxy.dropped == 2
            retried = httpx.delete(service.url + path, headers=keyed)  # same key: the first answer again
            assert retried.status_code == 200 and retried.json() == {"status": "deleted", "sandbox_id": sb.sandbox_id}
            fresh = httpx.delete(service.url + path, headers={"X-API-Key": service.api_key})
            assert fresh.status_code == 404  # without the key it is a new request, and the sandbox is gone
            sb.deleted = True
    finally:
        proxy.close()


async def test_async_client_dropped_answers_attach_to_the_same_job(service):
    proxy = DroppingProxy(service.url, trigger=b"count-me", drops=2)
    try:
        async with AsyncSandboxClient(proxy.url, service.api_key, retry=FAST) as client:
            sb = await client.create()
            job = await sb.exec("echo count-me >> n.txt", wait=False)  # answer dropped, retried
            done = await sb.wait_job(job.job_id, timeout=30)
            again = await sb.exec("echo count-me >> n.txt")  # answer dropped, retried
            assert done.ok and again.ok and proxy.dropped == 2
            assert await sb.download("n.txt") == b"count-me\ncount-me\n"  # two execs, two lines
            await sb.delete()
    finally:
        proxy.close()


def test_without_idempotency_keys_a_retry_would_run_twice(service):
    """The control: the same drop with a naive retry (no key) runs the command twice, so the test above
    really measures the keys."""
    proxy = DroppingProxy(service.url, trigger=b"count-me", drops=1)
    h = {"X-API-Key": service.api_key}
    try:
        with SandboxClient(service.url, service.api_key) as client, client.create() as sb:
            body = {"command": "echo count-me >> twice.txt", "wait": True}
            with pytest.raises(httpx.TransportError):
                httpx.post(f"{proxy.url}/sandboxes/{sb.sandbox_id}/exec", json=body, headers=h, timeout=30)
            httpx.post(f"{proxy.url}/sandboxes/{sb.sandbox_id}/exec", json=body, headers=h, timeout=30)
            assert sb.download("twice.txt") == b"count-me\ncount-me\n"
    finally:
        proxy.close()


def test_retry_policy_backoff_bounds():
    policy = RetryPolicy(max_attempts=5, backoff_base_s=0.5, backoff_max_s=3.0)
    # attempt k waits uniform(c/2, c), c = min(3, 0.5 * 2**k): c = 0.5, 1, 2, 3, 3
    for attempt, cap in enumerate([0.5, 1.0, 2.0, 3.0, 3.0]):
        delays = [policy.delay(attempt) for _ in range(200)]
        assert cap / 2 <= min(delays) and max(delays) <= cap
        assert max(delays) - min(delays) > cap / 10  # jittered, not constant
    # Retry-After 4 -> 4 + uniform(0, 1)
    assert all(4.0 <= policy.delay(0, retry_after_s=4.0) <= 5.0 for _ in range(50))
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)


def test_503_is_retried_with_the_same_idempotency_key_and_retry_after():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((time.monotonic(), request.headers.get("Idempotency-Key")))
        if len(seen) < 3:
            return httpx.Response(503, headers={"Retry-After": "0.1"}, json={"detail": "busy"})
        return httpx.Response(200, json={"job_id": "j1", "status": "succeeded", "exit_code": 0, "stdout": "x"})

    client = SandboxClient("http://svc.invalid", "k", transport=httpx.MockTransport(handler), auto_cleanup=False)
    data = client.request("POST", "/sandboxes/s/exec", json={"command": "true"})
    assert data["job_id"] == "j1" and len(seen) == 3
    assert len({key for _, key in seen}) == 1 and seen[0][1]  # one key, on every attempt
    assert seen[1][0] - seen[0][0] >= 0.1 and seen[2][0] - seen[1][0] >= 0.1  # Retry-After honoured
    gets = []
    client2 = SandboxClient("http://svc.invalid", "k", auto_cleanup=False,
                            transport=httpx.MockTransport(lambda r: gets.append(r) or httpx.Response(200, json={})))
    client2.request("GET", "/health")
    assert "Idempotency-Key" not in gets[0].headers  # only mutating requests carry one


def test_503_from_the_real_service_when_the_queue_is_full():
    with serve(max_pending_execs=0, retry_after_s=2) as (url, key), SandboxClient(
            url, key, retry=RetryPolicy(max_attempts=1)) as client, client.create() as sb:
        r = httpx.post(f"{url}/sandboxes/{sb.sandbox_id}/exec", json={"command": "true"},
                       headers={"X-API-Key": key})
        assert r.status_code == 503 and r.headers["Retry-After"] == "2"
        with pytest.raises(ServiceUnavailable) as info:
            sb.exec("true")
        assert info.value.retry_after_s == 2.0


def test_connection_refused_gives_up_with_a_typed_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    client = SandboxClient(f"http://127.0.0.1:{port}", "k", retry=FAST, auto_cleanup=False)
    with pytest.raises(SandboxConnectionError, match="4 attempts"):
        client.health()


def test_settings_from_environment_and_auth_error(service, monkeypatch):
    monkeypatch.setenv("SANDBOX_BASE_URL", service.url)
    monkeypatch.setenv("SANDBOX_API_KEY", service.api_key)
    with SandboxClient() as client:
        assert client.base_url == service.url and client.resources()["status"] == "ok"
    with SandboxClient(api_key="wrong") as client, pytest.raises(AuthError) as info:
        client.resources()
    assert info.value.status_code == 403
    with pytest.raises(ValueError, match="base_url"):
        SandboxClient("ftp://x")


def test_the_clients_read_the_public_variables_not_the_services_own_key(monkeypatch):
    from orchard.env import API_KEY_ENV, BASE_URL_ENV
    from orchard.env.embedded import API_KEY_ENV as SERVICE_KEY_ENV

    monkeypatch.setenv(BASE_URL_ENV, "http://127.0.0.1:1")
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.setenv(SERVICE_KEY_ENV, "the-service's")  # what a service starts with, not what clients send
    with SandboxClient(auto_cleanup=False) as client:
        assert (client.base_url, client.api_key) == ("http://127.0.0.1:1", None)
    monkeypatch.setenv(API_KEY_ENV, "the-client's")
    with SandboxClient(auto_cleanup=False) as client:
        assert client.api_key == "the-client's"


def test_keepalive_thread_sends_heartbeats(service):
    with SandboxClient(service.url, service.api_key) as client:
        kept = client.create(heartbeat_timeout=1.0, keepalive_s=0.2)
        idle = client.create(heartbeat_timeout=1.0)
        time.sleep(2.0)  # the reaper (every 0.2 s) deletes what is idle past 1 s
        assert kept.refresh()["status"] == "ready"
        assert idle.sandbox_id not in {s["sandbox_id"] for s in client.list_sandboxes()}
        kept.delete()


SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    from orchard.env import SandboxClient
    # Ctrl-C as at a terminal, whatever the test runner left: a runner started in the background of a shell
    # without job control passes SIGINT on ignored, and the signal would then never arrive
    signal.signal(signal.SIGINT, signal.default_int_handler)
    client = SandboxClient(sys.argv[1], sys.argv[2])
    leaked = client.create()              # never deleted by the script: atexit must do it
    ids = [leaked.sandbox_id]
    try:
        with client.create() as sb:       # Ctrl-C inside the with-block
            ids.append(sb.sandbox_id)
            print(json.dumps(ids), flush=True)
            os.kill(os.getpid(), signal.SIGINT)
            sb.exec("sleep 5")
    except KeyboardInterrupt:
        print("interrupted", flush=True)
""")


def test_ctrl_c_and_interpreter_exit_delete_sandboxes(service):
    out = subprocess.run([sys.executable, "-c", SCRIPT, service.url, service.api_key], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    ids = json.loads(lines[0])
    assert lines[1] == "interrupted" and len(ids) == 2
    with SandboxClient(service.url, service.api_key) as client:
        live = {s["sandbox_id"] for s in client.list_sandboxes()}
    assert not live & set(ids)


async def test_async_cancellation_still_deletes(service):
    async with AsyncSandboxClient(service.url, service.api_key) as client:
        created = []

        async def work() -> None:
            async with await client.create() as sb:
                created.append(sb.sandbox_id)
                await sb.exec("sleep 10")

        task = asyncio.create_task(work())
        while not created:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        live = {s["sandbox_id"] for s in await client.list_sandboxes()}
        assert created[0] not in live

