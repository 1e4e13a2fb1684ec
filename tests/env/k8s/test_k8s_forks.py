"""Snapshots and forks on the Kubernetes backend, through the service: the emulated API server, the simulated
kubelet's pods (real agent processes), tar streams in and out of them. Isolation, parent deletion, bad input,
nothing left behind."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from conftest import Cluster, k8s_service

from orchard.env import ConflictError, NotFoundError, SandboxClient
from orchard.env.embedded import EmbeddedService


@pytest.fixture(scope="module")
def service(cluster: Cluster) -> Iterator[EmbeddedService]:
    with k8s_service(cluster, max_snapshots=2) as svc:
        yield svc
    assert cluster.leftovers() == {}


@pytest.fixture(scope="module")
def client(service: EmbeddedService) -> Iterator[SandboxClient]:
    with SandboxClient(service.url, service.api_key) as c:
        yield c


def _error(service: EmbeddedService, method: str, path: str) -> tuple[int, str]:
    r = httpx.request(method, service.url + path, json={}, headers={"X-API-Key": service.api_key}, timeout=60)
    return r.status_code, r.json()["detail"]["error"]


def test_forks_of_a_pod_are_isolated_and_outlive_their_parent(service, client):
    parent = client.create()
    assert parent.exec("mkdir -p repo/bin && printf 'v1\\n' > repo/f && printf '#!/bin/sh\\necho ran\\n' > "
                       "repo/bin/run && chmod 755 repo/bin/run && ln -s /etc/hostname repo/host-link").ok
    with parent.snapshot() as snap:
        assert snap.info["processes_carried"] is False
        a, b, c = snap.fork(), snap.fork(), parent.fork()
        try:
            assert c.info["forked_from"] == f"sandbox:{parent.sandbox_id}"
            for sb in (parent, a, b, c):
                assert sb.exec(f"echo {sb.sandbox_id} >> repo/f").ok
            for sb in (parent, a, b, c):
                assert sb.download("repo/f") == f"v1\n{sb.sandbox_id}\n".encode()
            assert a.exec("repo/bin/run").stdout == "ran\n"  # the exec bit came along
            assert a.exec("readlink repo/host-link").stdout == "/etc/hostname\n"  # a link stays a link
            parent.delete()
            assert c.download("repo/f") == f"v1\n{c.sandbox_id}\n".encode()
            with snap.fork() as late:  # the snapshot is the parent's state when it was taken
                assert late.download("repo/f") == b"v1\n"
        finally:
            for sb in (a, b, c):
                sb.delete()


def test_bad_input_on_kubernetes(service, client):
    assert _error(service, "POST", "/snapshots/nope/fork") == (404, "snapshot_not_found")
    gone = client.create()
    gone.delete()
    assert _error(service, "POST", f"/sandboxes/{gone.sandbox_id}/fork") == (404, "sandbox_not_found")
    with client.create() as sb:
        job = sb.exec("sleep 3", wait=False)
        with pytest.raises(ConflictError) as busy:
            sb.fork()
        assert busy.value.detail["error"] == "sandbox_busy"
        assert client.wait_job(job.job_id, 60).ok
        with sb.snapshot(), sb.snapshot():
            assert _error(service, "POST", f"/sandboxes/{sb.sandbox_id}/snapshots") == (403, "quota_exceeded")
    assert client.list_snapshots() == []
    with pytest.raises(NotFoundError):
        client.get_snapshot("nope")
