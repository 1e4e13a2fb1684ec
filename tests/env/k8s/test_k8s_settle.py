"""A replica SIGKILLed in the middle of creates: the replica that survives settles them (issue 15).

Replica B (this process, `serve(store=redis://...)`) runs; replica A (`orchard env serve --backend kubernetes
--store redis://...`, a child process) gets two creates, each with an Idempotency-Key, and is killed while both
are in flight: one whose pod exists and is not ready yet (the kubelet holds its readiness back), and one whose
Secret and NetworkPolicy exist but whose pod was refused (a 503 whose Retry-After keeps A waiting). Before the
fix both records stayed "pending" for good and the second one's Secret and NetworkPolicy were never deleted.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
from conftest import NAMESPACE, Cluster, k8s_service
from k8s_replicas import start_replica, stop_replica

from orchard.env import SandboxClient
from orchard.env.backends.kubernetes.manifests import object_name

KEY = "settle-key"


def _until(predicate, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (found := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return found


def _create(url: str, sandbox_id: str, idempotency_key: str) -> httpx.Response:
    return httpx.post(f"{url}/sandboxes", json={"sandbox_id": sandbox_id}, timeout=120,
                      headers={"X-API-Key": KEY, "Idempotency-Key": idempotency_key})


def _create_in_background(url: str, sandbox_id: str, idempotency_key: str) -> threading.Thread:
    def run() -> None:
        try:
            _create(url, sandbox_id, idempotency_key)
        except httpx.HTTPError:  # the replica died under it: the caller never hears back
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_creates_of_a_killed_replica_are_adopted_or_dropped_by_the_survivor(cluster: Cluster, redis_url, tmp_path):
    store = redis_url.rsplit("/", 1)[0] + "/6"  # a database of its own: both replicas use the default prefix
    adopted, half = "settle-adopted", "settle-half"
    cluster.kubelet.slow_ready_s[adopted] = 6.0  # its pod runs, but is not Ready when A dies
    with k8s_service(cluster, api_key=KEY, store=store, replica_lease_s=30.0, reap_interval_s=0.3) as b:
        a = start_replica(cluster.api.url, NAMESPACE, store, KEY, tmp_path / "a", lease_s=1.0, reap_interval_s=0.3)
        try:
            first = _create_in_background(a.url, adopted, "key-adopted")
            _until(lambda: object_name(adopted) in cluster.objects("pods"), "A to make the first pod")
            cluster.api.fail_next("POST", "pods", 503, retry_after=30)  # A backs off 10 s (its cap) before a retry
            second = _create_in_background(a.url, half, "key-half")
            _until(lambda: any(m == "POST" and p.endswith("/pods") and code == 503
                               for m, p, code in list(cluster.api.requests)), "A's refused pod POST")
            assert object_name(half) in set(cluster.objects("secrets")) & set(cluster.objects("networkpolicies"))
            a.process.send_signal(signal.SIGKILL)
            a.process.wait(10)
        finally:
            stop_replica(a)
        first.join(10)
        second.join(10)
        with SandboxClient(b.url, KEY) as client:
            # B's reaper, once A's lease (1 s) has ended: the pod that exists is waited for and adopted...
            sandbox = client.sandbox(adopted)
            _until(lambda: sandbox.refresh()["status"] != "pending", "B to settle the create whose pod exists",
                   timeout_s=30)
            assert sandbox.info["status"] == "ready"
            assert sandbox.exec("echo adopted").stdout == "adopted\n"  # its agent token read from the Secret
            # ...the create that died before its pod is dropped, with the Secret and NetworkPolicy it made
            _until(lambda: httpx.get(f"{b.url}/sandboxes/{half}", headers={"X-API-Key": KEY}).status_code == 404,
                   "B to drop the create without a pod", timeout_s=30)
            name = object_name(half)
            assert name not in cluster.objects("secrets") + cluster.objects("networkpolicies") + cluster.objects(
                "pods")
            # the clients' retries, to B: the adopted create is answered from its key; the dropped one runs anew
            retried = _create(b.url, adopted, "key-adopted")
            assert (retried.status_code, retried.json()["sandbox_id"], retried.json()["status"]) == (
                200, adopted, "ready")
            again = _create(b.url, half, "key-half")
            assert (again.status_code, again.json()["status"]) == (200, "ready")
            client.sandbox(half).delete()
            sandbox.delete()
    assert cluster.leftovers() == {}  # no pod, Secret, NetworkPolicy or agent process left
