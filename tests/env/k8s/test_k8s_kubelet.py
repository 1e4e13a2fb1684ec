"""The simulated kubelet as a neighbour on a shared machine: its pods never take an address something else holds,
and they never outlive the process that runs it (else a killed run's agents break every later run)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import NAMESPACE, Cluster, k8s_service

from orchard.env import SandboxClient
from orchard.env.backends.kubernetes.manifests import object_name

HERE = Path(__file__).resolve().parent
REPO = str(HERE.parents[2])
AGENT_PORT = 8765


@pytest.fixture(scope="module")
def client(cluster: Cluster):
    with k8s_service(cluster) as svc, SandboxClient(svc.url, svc.api_key) as c:
        yield c
    assert cluster.leftovers() == {}


def pod_ip(cluster: Cluster, sandbox_id: str) -> str:
    return cluster.api.get("pods", NAMESPACE, object_name(sandbox_id))["status"]["podIP"]


class _Impostor(BaseHTTPRequestHandler):
    """An agent of another run: healthy, and answers every request 200 with a body no exec result has."""

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps({"status": "ok"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_an_address_whose_agent_port_is_taken_is_not_given_to_a_pod(client, cluster):
    with client.create() as first:
        ip = pod_ip(cluster, first.sandbox_id)
    # The kubelet hands out addresses in turn: the next pod would get the next one (x.y.z.254 -> x.y.z.2).
    prefix, last = ip.rsplit(".", 1)
    taken = f"{prefix}.{int(last) + 1 if int(last) < 254 else 2}"
    impostor = ThreadingHTTPServer((taken, AGENT_PORT), _Impostor)
    threading.Thread(target=impostor.serve_forever, daemon=True).start()
    try:
        # Given the taken address, the pod's agent would die at bind while the impostor answered the readiness
        # probe: the create would succeed and the exec fail (pod failed, exit code 1) or reach the impostor.
        with client.create() as sb:
            assert pod_ip(cluster, sb.sandbox_id) != taken
            assert sb.exec("echo ok").stdout == "ok\n"
    finally:
        impostor.shutdown()
        impostor.server_close()
    assert cluster.kubelet.exits == {}  # no agent exited on its own


KUBELET_IN_A_CHILD = """
import sys, time
sys.path.insert(0, sys.argv[1])
from k8s_emulator import ApiEmulator
from k8s_kubelet import SimulatedKubelet
from orchard.env.backends.base import SandboxSpec
from orchard.env.backends.kubernetes.manifests import KubernetesConfig, pod_manifest, secret_manifest

api = ApiEmulator().start()
kubelet = SimulatedKubelet(api, sys.argv[2])
config = KubernetesConfig(namespace="orphans")
api.create("secrets", "orphans", secret_manifest(config, "left", "a-token"))
api.create("pods", "orphans", pod_manifest(config, "left", SandboxSpec()))
while not kubelet.live_pods():
    time.sleep(0.05)
print(*(p.pid for ps in kubelet.processes.values() for p in ps), flush=True)
time.sleep(3600)
"""


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie no longer does: it only waits for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_a_pods_processes_die_with_the_process_that_runs_the_kubelet(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen([sys.executable, "-c", KUBELET_IN_A_CHILD, str(HERE), str(tmp_path)],
                             stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout is not None
    line = child.stdout.readline()
    agents = [int(pid) for pid in line.split()]
    try:
        assert len(agents) == 1 and alive(agents[0])  # the pod's agent runs
        child.send_signal(signal.SIGKILL)  # a test run or benchmark killed mid-way: no cleanup of its own runs
        child.wait()
        deadline = time.monotonic() + 60  # bounds a hang only: the kernel signals the agent as the child dies
        while alive(agents[0]):
            assert time.monotonic() < deadline, f"agent {agents[0]} outlived its kubelet"
            time.sleep(0.05)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for pid in agents:
            if alive(pid) and str(tmp_path) in Path(f"/proc/{pid}/cmdline").read_text():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
