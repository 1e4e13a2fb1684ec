"""Pods that go away behind the service's back, readiness that flaps, and deletes that race a command
(issue 37 items 3 and 6), against the emulated cluster."""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import NAMESPACE, Cluster, k8s_service
from test_k8s_faults import _replica, backend_health, eventually, new_id

from orchard.env import ConflictError
from orchard.env.backends.base import BackendError, ExecRequest, SandboxSpec
from orchard.env.backends.kubernetes.manifests import object_name


@pytest.fixture(scope="module")
def service(cluster: Cluster):
    # a reaper pass every 0.2 s: how soon the store learns what the watch saw
    with k8s_service(cluster, reap_interval_s=0.2) as svc:
        yield svc
    assert cluster.leftovers() == {}


def objects_of(cluster: Cluster, name: str) -> list[str]:
    return [r for r in ("pods", "secrets", "networkpolicies") if name in cluster.objects(r)]


@pytest.mark.parametrize("grace_s", [None, 0], ids=["graceful", "force"])
def test_a_pod_deleted_out_of_band_fails_its_sandbox_with_the_reason_and_leaves_nothing(client, cluster, grace_s):
    sb = client.create(sandbox_id=new_id("oob"))
    name = object_name(sb.sandbox_id)
    # `kubectl delete pod` (graceful: Terminating for up to the pod's 5 s grace period) or `--force`
    cluster.api.delete_out_of_band(NAMESPACE, name, grace_s=grace_s)
    info = eventually(lambda: (i := sb.refresh())["status"] == "failed" and i)  # before: "ready" forever
    assert "deleted out of band" in info["status_message"]
    eventually(lambda: not objects_of(cluster, name))  # before: its Secret and NetworkPolicy stayed
    with pytest.raises(ConflictError) as said:  # before: a job failed with "Sandbox ... not found"
        sb.exec("echo hi")
    assert "failed" in str(said.value) and "deleted out of band" in str(said.value)
    sb.delete()
    assert cluster.leftovers() == {}


def test_a_pod_deleted_while_the_watch_was_down_is_found_by_the_relist(service, client, cluster):
    sb = client.create(sandbox_id=new_id("gap"))
    name = object_name(sb.sandbox_id)
    before = backend_health(service)["watch"]
    # deleted in a gap of the watch that the server's history no longer covers: the resumed watch gets 410,
    # and only the relist can show that the pod is gone. The gap is held open by refusing the watch's resumes.
    seen = len(cluster.api.requests)
    cluster.api.fail_next("GET", "pods", 503, times=10**6)
    try:
        cluster.api.drop_watches()
        eventually(lambda: ("GET", 503) in {(m, c) for m, _, c in cluster.api.requests[seen:]})
        cluster.api.delete_out_of_band(NAMESPACE, name, grace_s=0)
        cluster.api.compact()
    finally:
        cluster.api.faults.clear()
    eventually(lambda: backend_health(service)["watch"]["lists"] > before["lists"])
    info = eventually(lambda: (i := sb.refresh())["status"] == "failed" and i)
    assert "deleted out of band" in info["status_message"]
    eventually(lambda: not objects_of(cluster, name))
    sb.delete()


def test_a_sandbox_deleted_through_the_service_is_not_reported_out_of_band(service, client, cluster):
    sb = client.create(sandbox_id=new_id("own"))
    sb.delete()
    with client.create(sandbox_id=sb.sandbox_id) as again:  # the same id at once: nothing of the first marks it
        time.sleep(1.0)  # five reaper passes
        assert again.refresh()["status"] == "ready" and again.exec("echo ok").stdout == "ok\n"


async def test_an_exec_before_the_store_knows_names_the_state_not_not_found(cluster):
    backend = _replica(cluster)
    sid = new_id("early")
    await backend.create(sid, SandboxSpec())
    cluster.api.delete_out_of_band(NAMESPACE, object_name(sid), grace_s=0)
    while sid not in await backend.lost_sandboxes():  # the watch has seen it go
        await asyncio.sleep(0.02)
    with pytest.raises(BackendError, match="failed: its pod was deleted out of band") as said:
        await backend.exec(sid, ExecRequest("echo hi"))
    assert "not found" not in str(said.value)  # before: SandboxNotFoundError("no sandbox ...")
    assert await backend.lost_sandboxes() == {sid: str(said.value).split("failed: ", 1)[1]}
    await backend.delete(sid)
    assert await backend.lost_sandboxes() == {}
    await backend.close()
    assert cluster.leftovers() == {}


async def test_a_pod_whose_readiness_flaps_off_still_takes_commands_at_once(cluster):
    # Under load a readiness probe times out and the kubelet reports the pod not Ready while its agent runs.
    # Before, a call then waited for Ready again for up to the readiness timeout (here 60 s, 300 s by default).
    backend = _replica(cluster, ready_timeout_s=60)
    sid = new_id("flap")
    await backend.create(sid, SandboxSpec())
    name = object_name(sid)
    cluster.kubelet.set_ready(NAMESPACE, name, False)
    while backend._watcher.pods[name]["status"]["conditions"][1]["status"] != "False":
        await asyncio.sleep(0.02)
    started = time.monotonic()
    result = await asyncio.wait_for(backend.exec(sid, ExecRequest("echo ok")), 120)
    assert result.stdout == b"ok\n" and time.monotonic() - started < 15  # one round trip, not a wait for Ready
    cluster.kubelet.set_ready(NAMESPACE, name, True)
    await backend.delete(sid)
    await backend.close()
    assert cluster.leftovers() == {}


async def test_a_pod_whose_readiness_flaps_off_and_whose_agent_is_gone_fails_within_bounded_time(cluster):
    backend = _replica(cluster, ready_timeout_s=60)
    sid = new_id("flapdead")
    await backend.create(sid, SandboxSpec())
    name = object_name(sid)
    with cluster.kubelet._lock:  # the agent dies without the kubelet reporting it yet (its status is stale)
        procs = cluster.kubelet.processes.pop(name)
    for p in procs:
        p.kill()
        p.wait()
    cluster.kubelet.set_ready(NAMESPACE, name, False)
    while backend._watcher.pods[name]["status"]["conditions"][1]["status"] != "False":
        await asyncio.sleep(0.02)
    started = time.monotonic()
    with pytest.raises(BackendError, match="did not answer"):
        await asyncio.wait_for(backend.exec(sid, ExecRequest("echo ok")), 120)
    assert time.monotonic() - started < 15  # its connection retries, not the readiness timeout
    await backend.delete(sid)
    await backend.close()
    assert cluster.leftovers() == {}


async def test_an_exec_that_a_delete_overtakes_is_not_reported_as_its_result(cluster):
    # A delete with grace 0 is done once the API has let the pod go; the node stops its containers later
    # (here 3 s later), so the command's agent may still answer after the delete returned.
    backend = _replica(cluster)
    sid = new_id("race")
    await backend.create(sid, SandboxSpec())
    cluster.kubelet.slow_kill_s = 3.0
    try:
        running = asyncio.create_task(backend.exec(sid, ExecRequest("sleep 1; echo done")))
        await asyncio.sleep(0.5)
        await backend.delete(sid)
        with pytest.raises(BackendError, match="deleted while"):  # before: exit 0, "done"
            await running
        await asyncio.sleep(3.5)  # the kubelet catches up
    finally:
        cluster.kubelet.slow_kill_s = 0.0
    await backend.close()
    assert cluster.leftovers() == {}


async def test_the_watch_resumes_from_a_bookmark_past_events_it_did_not_select(cluster):
    # Other objects change (Secrets share the resourceVersion sequence) while no pod does; the watch ends at its
    # timeout with a BOOKMARK at the newest version, so a resume after a compaction of the older history does
    # not get 410 and relist everything.
    backend = _replica(cluster, watch_timeout_s=1)
    await backend.list_ids()
    watcher = backend._watcher
    cluster.api.create("secrets", NAMESPACE, {"metadata": {"name": "unrelated"}})
    bookmarks = cluster.api.bookmarks
    while cluster.api.bookmarks == bookmarks:
        await asyncio.sleep(0.05)
    eventually(lambda: int(watcher.resource_version) >= cluster.api.rv, 30)
    cluster.api.compact()
    lists = watcher.lists
    resumes = watcher.resumes
    while watcher.resumes < resumes + 2:  # two more watches, each resumed after the compaction
        await asyncio.sleep(0.05)
    assert watcher.lists == lists
    cluster.api.delete("secrets", NAMESPACE, "unrelated")
    await backend.close()
