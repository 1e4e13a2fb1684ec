"""The emulated cluster (API server + simulated kubelet) and the sandbox service on its Kubernetes backend."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

import pytest
from k8s_emulator import ApiEmulator
from k8s_kubelet import SimulatedKubelet

from orchard.env import SandboxClient
from orchard.env.backends.kubernetes import API_URL_ENV
from orchard.env.embedded import EmbeddedService, serve

NAMESPACE = "orchard-test"
FACTORY = "orchard.env.backends.kubernetes:from_environment"


@dataclass
class Cluster:
    api: ApiEmulator
    kubelet: SimulatedKubelet

    def objects(self, resource: str) -> list[str]:
        return [o["metadata"]["name"] for o in self.api.list(resource, NAMESPACE)]

    def leftovers(self) -> dict[str, list[str]]:
        """Whatever sandbox objects or processes still exist (all empty once every sandbox is deleted)."""
        found = {r: self.objects(r) for r in ("pods", "secrets", "networkpolicies")}
        found["processes"] = self.kubelet.live_pods()
        return {k: v for k, v in found.items() if v}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with ApiEmulator() as api:
        kubelet = SimulatedKubelet(api, tmp_path_factory.mktemp("kubelet"))
        try:
            yield Cluster(api, kubelet)
        finally:
            kubelet.stop()


@contextlib.contextmanager
def k8s_service(cluster: Cluster, *, ready_timeout_s: float = 120, api_retries: int = 3,
                **options: object) -> Iterator[EmbeddedService]:
    """The sandbox service, in this process, built as `orchard env serve --backend kubernetes` builds it.

    `ready_timeout_s` only bounds a hang: a pod's agent is a fresh interpreter, which on a loaded machine (a
    shared CI box at load 20) takes many seconds to start, so a test must never depend on its speed."""
    env = {API_URL_ENV: cluster.api.url, "ORCHARD_K8S_NAMESPACE": NAMESPACE,
           "ORCHARD_K8S_READY_TIMEOUT": str(ready_timeout_s), "ORCHARD_K8S_WATCH_TIMEOUT": "5",
           "ORCHARD_K8S_API_RETRIES": str(api_retries)}
    with mock.patch.dict(os.environ, env), serve(backend=FACTORY, **options) as svc:  # type: ignore[arg-type]
        yield svc


@pytest.fixture(scope="module")
def service(cluster: Cluster) -> Iterator[EmbeddedService]:
    """One service on the Kubernetes backend for the module (a module may define its own)."""
    with k8s_service(cluster, max_concurrent_execs=8) as svc:
        yield svc
    assert cluster.leftovers() == {}  # every test deleted what it made; closing the service leaves pods alone


@pytest.fixture(scope="module")
def client(service: EmbeddedService) -> Iterator[SandboxClient]:
    with SandboxClient(service.url, service.api_key) as c:
        yield c


@pytest.fixture
def sb(client: SandboxClient) -> Iterator[object]:
    with client.create() as sandbox:
        yield sandbox
