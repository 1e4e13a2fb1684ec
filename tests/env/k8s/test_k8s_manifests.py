"""The backend's pure parts: names, pod states, retry delays, config validation, the agent's files."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
from kubernetes.client.exceptions import ApiException

from orchard.env.backends.kubernetes.backend import retry_delay
from orchard.env.backends.kubernetes.inject import agent_files, write_agent
from orchard.env.backends.kubernetes.manifests import KubernetesConfig, object_name, pod_state


def test_object_names_are_dns_labels_that_keep_distinct_ids_apart():
    # "Run_1" -> lower "run_1" -> "_" becomes "-" -> "run-1", plus the first 8 hex digits of sha256("Run_1")
    assert object_name("Run_1") == "sbx-run-1-" + hashlib.sha256(b"Run_1").hexdigest()[:8]
    assert object_name("A") != object_name("a")
    long = object_name("x" * 63)
    assert len(long) == 4 + 40 + 1 + 8  # "sbx-" + 40 kept + "-" + 8 hex = 53 <= 63


def _pod(phase, *, ready=False, ip="10.0.0.7", reason=None, message=None, waiting=None, init_exit=None,
         unschedulable=None, deleting=False):
    status = {"phase": phase, "podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if reason:
        status.update(reason=reason, message=message)
    if waiting:
        status["containerStatuses"] = [{"name": "sandbox", "state": {"waiting": {"reason": waiting[0],
                                                                                 "message": waiting[1]}}}]
    if init_exit is not None:
        status["initContainerStatuses"] = [{"name": "inject-agent", "state": {"terminated": {"exitCode": init_exit}}}]
    if unschedulable:
        status["conditions"].append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                     "message": unschedulable})
    meta = {"name": "p", "deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {"name": "p"}
    return {"metadata": meta, "status": status}


@pytest.mark.parametrize("pod, phase, reason", [
    (_pod("Running", ready=True), "ready", ""),
    (_pod("Running"), "pending", "the agent does not answer its readiness probe yet"),
    (_pod("Running", ready=True, ip=None), "pending", "the agent does not answer its readiness probe yet"),
    (_pod("Pending", waiting=("ImagePullBackOff", "Back-off pulling image")), "pending",
     "container sandbox: ImagePullBackOff: Back-off pulling image"),
    (_pod("Pending", waiting=("InvalidImageName", "bad ref")), "failed", "container sandbox: InvalidImageName: bad ref"),
    (_pod("Pending", unschedulable="0/3 nodes are available: 3 Insufficient cpu."), "pending",
     "Unschedulable: 0/3 nodes are available: 3 Insufficient cpu."),
    (_pod("Pending", init_exit=1), "failed", "container inject-agent: exit code 1"),
    (_pod("Failed", reason="Evicted", message="low on memory"), "failed", "Evicted: low on memory"),
    (_pod("Unknown"), "failed", "Unknown: the pod's node stopped reporting"),
    (_pod("Succeeded"), "failed", "the sandbox's agent exited"),
    (_pod("Running", ready=True, deleting=True), "terminating", "the pod is being deleted"),
])
def test_pod_state(pod, phase, reason):
    state = pod_state(pod)
    assert (state.phase, state.reason) == (phase, reason)


def test_retry_delay_backs_off_honours_retry_after_and_refuses_client_errors():
    for attempt, low, high in ((0, 0.1, 0.2), (3, 0.8, 1.6), (9, 5.0, 10.0)):  # 0.2 * 2**a capped at 10, halved..1x
        d = retry_delay(ApiException(status=500), attempt)
        assert low <= d <= high
    throttled = ApiException(status=429)
    throttled.headers = {"Retry-After": "3"}
    assert retry_delay(throttled, 0) == 3.0
    throttled.headers = {"Retry-After": "3600"}
    assert retry_delay(throttled, 0) == 10.0  # capped
    assert retry_delay(ConnectionResetError(), 0) is not None
    for status in (400, 403, 404, 409, 422):
        assert retry_delay(ApiException(status=status), 0) is None
    assert retry_delay(KeyError("x"), 0) is None  # a bug, not a flaky API


@pytest.mark.parametrize("field, value", [("namespace", "Not_DNS"), ("run_as_user", 0), ("agent_port", 0),
                                          ("ready_timeout_s", 0), ("api_retries", -1), ("owner", ""),
                                          ("orchestrator_labels", {})])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        KubernetesConfig(**{field: value})


def test_the_agent_runs_on_the_standard_library_alone(tmp_path):
    path = write_agent(tmp_path)
    assert set(agent_files()) >= {"__main__.py", "orchard/env/agent/box.py"}
    # -S: no site-packages, as in a bare image with only python3; it refuses to serve without a token
    done = subprocess.run([sys.executable, "-S", path, "--root", str(tmp_path / "ws")], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin"}, timeout=30)
    assert done.returncode == 2 and "refusing to serve without a token" in done.stderr
