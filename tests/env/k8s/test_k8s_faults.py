"""Faults of the cluster, injected into the emulator and the simulated kubelet, against the real service."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest
from conftest import NAMESPACE, Cluster, k8s_service

from orchard.env import BackendRefusedError, ConflictError, SandboxClient, ServerError
from orchard.env.backends.base import BackendError, ExecRequest, SandboxSpec
from orchard.env.backends.kubernetes.manifests import POD_BY, KubernetesConfig, labels, object_name


@pytest.fixture(scope="module")
def service(cluster: Cluster):
    with k8s_service(cluster) as svc:
        yield svc
    assert cluster.leftovers() == {}


def backend_health(service) -> dict:
    r = httpx.get(service.url + "/resources", headers={"X-API-Key": service.api_key}, timeout=30)
    return r.json()["backend_health"]


def eventually(check, timeout_s: float = 120.0):
    """Poll `check` until it returns something truthy (the watcher acts on its own thread); the timeout only
    bounds a hang."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)
    return value


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


@pytest.mark.parametrize("fault, said", [("evict", "Evicted: The node was low on resource: memory."),
                                         ("lose_node", "NodeLost")])
def test_a_failed_pod_is_reaped_at_once_and_its_sandbox_says_why(service, client, cluster, fault, said):
    sb = client.create(sandbox_id=new_id(fault))
    name = object_name(sb.sandbox_id)
    getattr(cluster.kubelet, fault)(NAMESPACE, name)
    # reaped by the watcher, not by a TTL: pod, Secret and NetworkPolicy all go
    eventually(lambda: name not in cluster.objects("pods") + cluster.objects("secrets")
               + cluster.objects("networkpolicies"))
    # the sandbox is marked failed with the reason (by the next reaper pass), and a call says so
    info = eventually(lambda: (i := sb.refresh())["status"] == "failed" and i)
    assert said in info["status_message"]
    with pytest.raises(ConflictError, match="is failed, not ready: its pod failed"):
        sb.exec("true")
    sb.delete()


def test_a_dropped_watch_is_resumed_from_its_resource_version(service, client, cluster):
    before = backend_health(service)["watch"]
    sid = new_id("slow")
    cluster.kubelet.slow_ready_s[sid] = 1.0
    cluster.api.drop_watches()  # while nothing is pending
    with client.create(sandbox_id=sid) as sb:  # readiness arrives over the resumed watch
        assert sb.exec("echo ok").stdout == "ok\n"
    after = backend_health(service)["watch"]
    assert after["resumes"] > before["resumes"] and after["lists"] == before["lists"]  # resumed, not relisted


def test_a_watch_too_old_for_the_server_relists_and_sees_what_changed_meanwhile(service, client, cluster):
    sb = client.create(sandbox_id=new_id("gone"))
    name = object_name(sb.sandbox_id)
    before = backend_health(service)["watch"]
    # Cut the watch and, before it resumes, compact the history past its resourceVersion: the resumed watch
    # gets 410 Gone, and the pod's eviction happened in the gap, so only the relist can reveal it.
    cluster.api.compact()
    cluster.kubelet.evict(NAMESPACE, name)
    cluster.api.compact()
    cluster.api.drop_watches()
    eventually(lambda: backend_health(service)["watch"]["lists"] > before["lists"])
    eventually(lambda: name not in cluster.objects("pods"))
    sb.delete()
    with client.create() as fresh:  # the watch after the relist carries readiness again
        assert fresh.exec("echo ok").stdout == "ok\n"


def test_429_and_500_answers_are_retried(service, client, cluster):
    cluster.api.fail_next("POST", "secrets", 429, times=2, retry_after=0.05)
    cluster.api.fail_next("POST", "pods", 500)
    cluster.api.fail_next("DELETE", "pods", 503, times=2)
    seen = len(cluster.api.requests)
    with client.create() as sb:
        assert sb.exec("echo ok").stdout == "ok\n"
    statuses = [s for _, _, s in cluster.api.requests[seen:]]
    assert statuses.count(429) == 2 and statuses.count(500) == 1 and statuses.count(503) == 2


def test_an_api_that_keeps_failing_fails_the_create_and_leaves_nothing(service, client, cluster):
    cluster.api.fail_next("POST", "pods", 500, times=100)
    try:
        with pytest.raises(ServerError) as info:
            client.create(sandbox_id=new_id("down"))
    finally:
        cluster.api.faults.clear()
    assert "create_namespaced_pod: 500" in str(info.value)
    assert cluster.leftovers() == {}


@pytest.mark.parametrize("refusal", ["quota_exceeded", "forbidden", "invalid"])
def test_an_api_refusal_fails_the_create_with_what_kubernetes_said_never_retried(service, client, cluster, refusal):
    if refusal == "quota_exceeded":  # a ResourceQuota whose pod count is used up (by a sandbox of this test)
        held = client.create(sandbox_id=new_id("held"))
        cluster.api.quota["pods"] = len(cluster.objects("pods"))
        said, status = "exceeded quota", 403
    elif refusal == "forbidden":  # a Role without pods/create, or an admission policy that denies the pod
        cluster.api.fail_next("POST", "pods", 403, reason="Forbidden", message='pods is forbidden: User '
                              '"system:serviceaccount:orchard:orchard" cannot create resource "pods"')
        said, status = "cannot create resource", 403
    else:  # the API server finds the pod invalid
        cluster.api.fail_next("POST", "pods", 422, reason="Invalid", message='Pod "x" is invalid: '
                              "spec.containers[0].resources.limits: Invalid value")
        said, status = "is invalid", 422
    seen = len(cluster.api.requests)
    try:
        with pytest.raises(BackendRefusedError) as info:  # before: ServerError, a 500
            client.create(sandbox_id=new_id(refusal))
    finally:
        cluster.api.quota.clear()
        cluster.api.faults.clear()
    assert info.value.status_code == status and info.value.detail["error"] == refusal
    assert said in str(info.value) and said in info.value.detail["message"]
    pod_posts = [r for r in cluster.api.requests[seen:] if r[0] == "POST" and r[1].endswith("/pods")]
    assert len(pod_posts) == 1  # asked once: a refusal is not retried
    if refusal == "quota_exceeded":
        held.delete()
    assert cluster.leftovers() == {}  # the create's Secret and NetworkPolicy went with it


def test_slow_readiness_is_waited_for(client, cluster):
    sid = new_id("slow")
    cluster.kubelet.slow_ready_s[sid] = 1.5  # readiness held back, well under the service's readiness timeout
    with client.create(sandbox_id=sid) as sb:
        assert sb.info["status"] == "ready" and sb.exec("echo ok").stdout == "ok\n"


def test_a_pod_that_never_becomes_ready_fails_its_create_with_the_reason_kubernetes_gave(cluster):
    sid = new_id("pull")
    cluster.kubelet.never_ready[sid] = ("ImagePullBackOff", 'Back-off pulling image "no-such:image"')
    # A service of its own with a short readiness timeout: the pod never gets ready, so the timeout's length
    # decides nothing but how long the test waits (the module's service keeps a generous one).
    with (k8s_service(cluster, ready_timeout_s=2) as impatient,
          SandboxClient(impatient.url, impatient.api_key) as client,
          pytest.raises(ServerError) as info):
        client.create(sandbox_id=sid, image="no-such:image")
    assert 'not ready after 2s: container sandbox: ImagePullBackOff: Back-off pulling image "no-such:image"' in (
        str(info.value))
    assert cluster.leftovers() == {}


def test_pods_no_record_owns_are_deleted_on_start_when_allowed_and_other_owners_are_left_alone(cluster):
    config = KubernetesConfig(namespace=NAMESPACE)
    orphan = {"metadata": {"name": object_name("orphan"), "labels": labels(config, "orphan")},
              "spec": {"containers": [{"name": "c", "image": "x", "readinessProbe": {"httpGet": {"path": "/",
                                                                                                  "port": 1}}}]}}
    cluster.kubelet.never_ready["orphan"] = cluster.kubelet.never_ready["stranger"] = ("ContainerCreating", "")
    stranger = {"metadata": {"name": "stranger", "labels": {**labels(config, "stranger"), "orchard.dev/owner": "x"}},
                "spec": orphan["spec"]}
    cluster.api.create("pods", NAMESPACE, orphan)
    cluster.api.create("pods", NAMESPACE, stranger)
    # a Secret left by a create that died before its pod (old enough that no create can still be in flight)
    cluster.api.create("secrets", NAMESPACE, {"metadata": {"name": object_name("half"), "labels": labels(config, "half")}})
    cluster.api.objects[("secrets", NAMESPACE, object_name("half"))]["metadata"]["creationTimestamp"] = (
        "2020-01-01T00:00:00Z")
    with k8s_service(cluster, allow_empty_store_sweep=True):  # its store is new, so empty: the sweep needs leave
        pass
    assert cluster.objects("pods") == ["stranger"] and cluster.objects("secrets") == []
    cluster.api.delete("pods", NAMESPACE, "stranger")


def test_an_empty_store_beside_live_pods_deletes_none_of_them_and_says_so(cluster, caplog):
    """Issue 37 item 2: a store that lost its data (a Redis restarted without its files; here a replica on a fresh
    SQLite root, the same thing to the orchestrator) must not make the next start delete every sandbox."""
    with (k8s_service(cluster) as first,
          SandboxClient(first.url, first.api_key, auto_cleanup=False) as client):  # the pods outlive the client
        kept = [client.create(sandbox_id=new_id("kept")) for _ in range(2)]
    names = sorted(object_name(sb.sandbox_id) for sb in kept)
    assert sorted(cluster.objects("pods")) == names  # closing a service leaves its sandboxes running

    with caplog.at_level("ERROR", logger="orchard.env.orchestrator"), k8s_service(cluster) as amnesiac:
        assert sorted(cluster.objects("pods")) == names and len(cluster.kubelet.live_pods()) == 2
        r = httpx.get(amnesiac.url + "/resources", headers={"X-API-Key": amnesiac.api_key}, timeout=30)
        assert r.json()["unknown_sandboxes_kept"] == 2 and r.json()["sandboxes"] == 0
    errors = [rec.getMessage() for rec in caplog.records if rec.levelname == "ERROR"]
    assert any("holds no sandbox, yet the backend holds 2: kept them all" in e for e in errors), errors
    assert sorted(cluster.objects("pods")) == names  # and still there after it closed

    with k8s_service(cluster, allow_empty_store_sweep=True):  # the operator's explicit decision: swept as before
        pass
    assert cluster.leftovers() == {}


def _replica(cluster: Cluster, **options):
    """A Kubernetes backend of its own on the emulated cluster, as another replica's."""
    from kubernetes import client as k8s

    from orchard.env.backends.kubernetes.backend import KubernetesBackend

    api = k8s.ApiClient(k8s.Configuration(host=cluster.api.url))
    return KubernetesBackend(KubernetesConfig(namespace=NAMESPACE, **options), api_client=api)


async def test_the_start_up_sweep_leaves_alone_a_create_in_flight_on_another_replica(cluster):
    def replica(**options):
        return _replica(cluster, **options)

    # Replica A creates while the API server refuses NetworkPolicies for a while (a brown-out it rides out: its
    # retries are many); its Secret exists, its pod does not yet.
    a, b = replica(api_retries=1000), replica(ready_timeout_s=5)
    sid = new_id("inflight")
    name = object_name(sid)
    cluster.api.fail_next("POST", "networkpolicies", 503, times=10**6, retry_after=0.05)
    create = asyncio.create_task(a.create(sid, SandboxSpec()))
    try:
        while name not in cluster.objects("secrets"):
            await asyncio.sleep(0.02)
        # The create has been in flight for longer than the sweeping replica's own create could take (its
        # readiness timeout + 60 s): made to look so by dating the Secret back, as a long brown-out would.
        cluster.api.objects[("secrets", NAMESPACE, name)]["metadata"]["creationTimestamp"] = (
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 600)))
        # A Secret left by a create that has given up (its creator died): past the time its creator set for its
        # pod, the sweep deletes it however young it is.
        left = object_name(new_id("left"))
        cluster.api.create("secrets", NAMESPACE, {"metadata": {"name": left, "labels": labels(b.config, "left"),
                                                               "annotations": {POD_BY: "1"}}})
        assert await b.list_ids() == []  # B starts: its first call lists pods and sweeps
        # before: B deleted A's Secret, and A's pod, made after the brown-out, never started (secret not found)
        assert name in cluster.objects("secrets") and left not in cluster.objects("secrets")
    finally:
        cluster.api.faults.clear()
    await asyncio.wait_for(create, 120)
    assert (await a.exec(sid, ExecRequest("echo ok"))).stdout == b"ok\n"
    await a.delete(sid)
    await a.close()
    await b.close()
    assert cluster.leftovers() == {}


async def test_a_create_that_finds_a_secret_past_its_deadline_makes_no_pod(cluster):
    # an earlier try of the create made the Secret, whose deadline has passed: a sweep may delete it any time,
    # so a pod made now could start without it
    backend = _replica(cluster)
    await backend.list_ids()  # started, and swept, before the Secret was made
    sid = new_id("late")
    name = object_name(sid)
    cluster.api.create("secrets", NAMESPACE, {"metadata": {"name": name, "labels": labels(backend.config, sid),
                                                           "annotations": {POD_BY: "1"}}})
    with pytest.raises(BackendError, match="deadline"):
        await backend.create(sid, SandboxSpec())
    assert name not in cluster.objects("pods") + cluster.objects("networkpolicies")
    await backend.delete(sid)
    await backend.close()
    assert cluster.leftovers() == {}
