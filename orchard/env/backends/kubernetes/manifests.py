"""What the Kubernetes backend asks the API server for: a Secret, a NetworkPolicy and a Pod per sandbox.

Pure functions from a sandbox's spec and the backend's `KubernetesConfig` to manifests (plain dicts, as the
API takes them), and from a pod as the API shows it to the sandbox's state. No I/O here.

Every object carries the labels `managed-by` (orchard-env), `owner` (the installation, so that two services
in one namespace never reap each other's pods) and `sandbox` (the sandbox id); the backend finds its objects by
these labels alone, so a restarted orchestrator (or another replica) knows every pod that is its.
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from orchard.env.backends.base import SandboxSpec

MANAGED_BY = "app.kubernetes.io/managed-by"
OWNER = "orchard.dev/owner"
SANDBOX = "orchard.dev/sandbox"
TOKEN_KEY = "token"
TOKEN_ENV = "ORCHARD_AGENT_TOKEN"
AGENT_MOUNT = "/orchard-agent"
HOST_IMAGE = "host"
POD_BY = "orchard.dev/pod-by"
"""Annotation of a sandbox's Secret and NetworkPolicy: the epoch second by which the create that made them has
made its pod or given up. Until then (and a minute more, for clocks that disagree) the start-up sweep of any
replica leaves them alone, even while they have no pod: that create may still be in flight elsewhere."""
CPU_ANNOTATION = "orchard.dev/cpu"
MEMORY_ANNOTATION = "orchard.dev/memory-mb"
"""The pod's CPU (cores) and memory (MiB) as numbers, for `resources()` (its quantities are strings)."""

_NAME_RE = re.compile(r"[^a-z0-9-]+")
_FATAL_WAITING = frozenset({"InvalidImageName", "ErrImageNeverPull", "CreateContainerError"})
"""Waiting reasons that no amount of waiting cures (a pull error may be a registry's hiccup; these are not)."""


@dataclass(frozen=True)
class KubernetesConfig:
    """How the Kubernetes backend makes sandboxes. Every field has a default that works with `deploy/`.

    Cluster-wide choices (a node selector, tolerations, a runtime class such as gVisor) are left to the
    namespace's defaults and admission policies rather than duplicated here.
    """

    namespace: str = "orchard-env"
    """Where sandbox pods, their Secrets and NetworkPolicies live (the orchestrator's Role is scoped to it)."""
    owner: str = "orchard-env"
    """This installation's name, put on every object it makes; objects of other owners are never touched."""
    agent_image: str = "orchard-env:latest"
    """The orchestrator's own image: the init container copies the exec agent out of it."""
    default_image: str = "python:3.12-slim"
    """The image of a sandbox created with image "host" (the API's default), which means nothing on a cluster."""
    image_pull_policy: str = "IfNotPresent"
    default_cpu: float = 1.0
    """CPU request and limit, in cores, of a sandbox that asks for none."""
    default_memory_mb: int = 2048
    """Memory request and limit, in MiB, of a sandbox that asks for none."""
    workspace_size: str = "10Gi"
    """Size limit of the workspace volume (an emptyDir; the pod is evicted past it)."""
    run_as_user: int = 65532
    """The uid (and gid, fsGroup) the sandbox's container runs as; never 0."""
    agent_port: int = 8765
    orchestrator_labels: dict[str, str] = field(default_factory=lambda: {"app.kubernetes.io/name": "orchard-env"})
    """Labels of the orchestrator's pods: the only pods a sandbox's NetworkPolicy lets in."""
    ready_timeout_s: float = 300.0
    """A pod not ready after this long fails its create with the reason Kubernetes gave."""
    api_timeout_s: float = 30.0
    """Timeout of one API request."""
    api_retries: int = 6
    """Retries of an API request answered 429 or 5xx, or timed out (backoff doubling from 0.2 s to 10 s)."""
    watch_timeout_s: int = 240
    """The server ends each watch after this long; the watcher then resumes from the last resourceVersion."""
    snapshot_dir: str = ""
    """Where snapshots (tars of workspaces, `orchard.env.backends.kubernetes.snapshots`) are kept, on the
    orchestrator's disk; several replicas must share it (a ReadWriteMany volume). Empty: snapshots are refused;
    forks of live sandboxes work without it. `from_environment` defaults it to the service root's
    `sandboxes/.snapshots`."""

    def __post_init__(self) -> None:
        for name in ("namespace", "owner", "agent_image", "default_image"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", self.namespace):
            raise ValueError(f"namespace must be a DNS-1123 label, got {self.namespace!r}")
        if not re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", self.owner):
            raise ValueError(f"owner must be a valid label value, got {self.owner!r}")
        if isinstance(self.run_as_user, bool) or not isinstance(self.run_as_user, int) or self.run_as_user < 1:
            raise ValueError(f"run_as_user must be an int >= 1 (never root), got {self.run_as_user!r}")
        if not isinstance(self.agent_port, int) or not 1 <= self.agent_port <= 65535:
            raise ValueError(f"agent_port must be an int in [1, 65535], got {self.agent_port!r}")
        for name in ("ready_timeout_s", "api_timeout_s", "default_cpu", "default_memory_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not isinstance(self.api_retries, int) or self.api_retries < 0:
            raise ValueError(f"api_retries must be an int >= 0, got {self.api_retries!r}")
        if not isinstance(self.watch_timeout_s, int) or self.watch_timeout_s < 1:
            raise ValueError(f"watch_timeout_s must be an int >= 1, got {self.watch_timeout_s!r}")
        if not isinstance(self.snapshot_dir, str):
            raise ValueError(f"snapshot_dir must be a str (empty: no snapshots), got {self.snapshot_dir!r}")
        if not self.orchestrator_labels:
            raise ValueError("orchestrator_labels must name at least one label of the orchestrator's pods")

    def selector(self) -> str:
        """The label selector of every object this installation owns."""
        return f"{MANAGED_BY}=orchard-env,{OWNER}={self.owner}"


def object_name(sandbox_id: str) -> str:
    """The name of a sandbox's Pod, Secret and NetworkPolicy: a DNS-1123 label derived from the id.

    Ids may hold capitals and underscores, names may not; the hash of the exact id keeps "A" and "a" apart.
    "Run_1" -> "sbx-run-1-" + 8 hex digits.
    """
    readable = _NAME_RE.sub("-", sandbox_id.lower()).strip("-")[:40]
    digest = hashlib.sha256(sandbox_id.encode()).hexdigest()[:8]
    return f"sbx-{readable}-{digest}" if readable else f"sbx-{digest}"


def labels(config: KubernetesConfig, sandbox_id: str) -> dict[str, str]:
    return {MANAGED_BY: "orchard-env", OWNER: config.owner, SANDBOX: sandbox_id}


def _metadata(config: KubernetesConfig, sandbox_id: str, pod_by: float | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": object_name(sandbox_id), "namespace": config.namespace,
                            "labels": labels(config, sandbox_id)}
    if pod_by is not None:
        meta["annotations"] = {POD_BY: f"{pod_by:.0f}"}
    return meta


def secret_manifest(config: KubernetesConfig, sandbox_id: str, token: str, *,
                    pod_by: float | None = None) -> dict[str, Any]:
    """The Secret holding the sandbox agent's bearer token (the pod reads it into its agent's environment);
    `pod_by`, the create's deadline for its pod (`POD_BY`)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(config, sandbox_id, pod_by),
        "type": "Opaque",
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def network_policy_manifest(config: KubernetesConfig, sandbox_id: str, network: bool, *,
                            pod_by: float | None = None) -> dict[str, Any]:
    """Ingress only from the orchestrator's pods to the agent's port; egress nowhere unless `network` (then
    anywhere: a sandbox that asks for the network gets all of it, as on the local backend); `pod_by`, the
    create's deadline for its pod (`POD_BY`)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(config, sandbox_id, pod_by),
        "spec": {
            "podSelector": {"matchLabels": labels(config, sandbox_id)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{
                "from": [{"podSelector": {"matchLabels": dict(config.orchestrator_labels)}}],
                "ports": [{"protocol": "TCP", "port": config.agent_port}],
            }],
            "egress": [{}] if network else [],
        },
    }


def pod_manifest(config: KubernetesConfig, sandbox_id: str, spec: SandboxSpec) -> dict[str, Any]:
    """The sandbox's pod: its image runs our agent (copied in by an init container) on the workspace volume.

    `spec.cpu` / `spec.memory_mb` become equal requests and limits (Guaranteed QoS: a sandbox is not
    throttled below what it asked for, nor evicted first under pressure); None takes the config's defaults.
    `spec.pids` is not enforced per pod (the kubelet's pod pid limit applies). `spec.workdir` is where the
    workspace volume is mounted.
    """
    cores = spec.cpu if spec.cpu is not None else config.default_cpu
    memory_mb = spec.memory_mb if spec.memory_mb is not None else config.default_memory_mb
    cpu, memory = f"{round(cores * 1000)}m", f"{memory_mb}Mi"
    uid = config.run_as_user
    container_security = {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    agent_volume = {"name": "orchard-agent", "mountPath": AGENT_MOUNT}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**_metadata(config, sandbox_id), "annotations": {CPU_ANNOTATION: str(cores),
                                                                       MEMORY_ANNOTATION: str(memory_mb)}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 5,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": uid,
                "runAsGroup": uid,
                "fsGroup": uid,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "initContainers": [{
                "name": "inject-agent",
                "image": config.agent_image,
                "imagePullPolicy": config.image_pull_policy,
                "command": ["python", "-m", "orchard.env.backends.kubernetes.inject", AGENT_MOUNT],
                "securityContext": {**container_security, "readOnlyRootFilesystem": True},
                "resources": {"requests": {"cpu": "50m", "memory": "64Mi"},
                              "limits": {"cpu": "500m", "memory": "128Mi"}},
                "volumeMounts": [agent_volume],
            }],
            "containers": [{
                "name": "sandbox",
                "image": config.default_image if spec.image == HOST_IMAGE else spec.image,
                "imagePullPolicy": config.image_pull_policy,
                "command": ["python3", f"{AGENT_MOUNT}/agent", "--root", spec.workdir, "--mount", spec.workdir,
                            "--host", "0.0.0.0", "--port", str(config.agent_port), "--token-env", TOKEN_ENV],
                "workingDir": spec.workdir,
                "env": [
                    *({"name": k, "value": v} for k, v in sorted(spec.env.items())),
                    {"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": object_name(sandbox_id),
                                                                       "key": TOKEN_KEY}}},
                ],
                "ports": [{"name": "agent", "containerPort": config.agent_port, "protocol": "TCP"}],
                "readinessProbe": {
                    "httpGet": {"path": "/health", "port": config.agent_port},
                    "periodSeconds": 1,
                    "failureThreshold": 3,
                },
                "securityContext": container_security,
                "resources": {"requests": {"cpu": cpu, "memory": memory}, "limits": {"cpu": cpu, "memory": memory}},
                "volumeMounts": [{**agent_volume, "readOnly": True}, {"name": "workspace", "mountPath": spec.workdir}],
            }],
            "volumes": [
                {"name": "orchard-agent", "emptyDir": {"sizeLimit": "64Mi"}},
                {"name": "workspace", "emptyDir": {"sizeLimit": config.workspace_size}},
            ],
        },
    }


@dataclass(frozen=True)
class PodState:
    """A pod as the backend sees it. `phase` is one of "pending", "ready", "failed", "terminating"."""

    phase: str
    reason: str = ""
    """Why it is not ready (or why it failed), in Kubernetes' words: "Evicted: The node was low on ..."."""
    ip: str | None = None


def pod_state(pod: dict[str, Any]) -> PodState:
    """Classify a pod (a dict as the API returns it). "failed" means: reap it, it will never serve again."""
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return PodState("terminating", "the pod is being deleted", ip)
    phase = status.get("phase") or "Pending"
    said = ": ".join(x for x in (status.get("reason"), status.get("message")) if x)
    if phase == "Failed":
        return PodState("failed", said or _container_reason(status) or "the pod failed", ip)
    if phase == "Succeeded":
        return PodState("failed", "the sandbox's agent exited", ip)
    if phase == "Unknown":
        return PodState("failed", said or "Unknown: the pod's node stopped reporting", ip)
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    if phase == "Running" and (conditions.get("Ready") or {}).get("status") == "True" and ip:
        return PodState("ready", "", ip)
    for status_list in ("initContainerStatuses", "containerStatuses"):
        for c in status.get(status_list) or []:
            terminated = (c.get("state") or {}).get("terminated")
            if status_list == "initContainerStatuses" and terminated and terminated.get("exitCode", 0) != 0:
                return PodState("failed", _describe(c["name"], terminated), ip)
            waiting = (c.get("state") or {}).get("waiting")
            if waiting and waiting.get("reason") in _FATAL_WAITING:
                return PodState("failed", _describe(c["name"], waiting), ip)
    reason = _container_reason(status)
    scheduled = conditions.get("PodScheduled") or {}
    if not reason and scheduled.get("status") == "False":
        reason = ": ".join(x for x in (scheduled.get("reason"), scheduled.get("message")) if x)
    if not reason and phase == "Running":
        reason = "the agent does not answer its readiness probe yet"
    return PodState("pending", reason or phase, ip)


def _describe(container: str, state: dict[str, Any]) -> str:
    words = [state.get("reason") or "", state.get("message") or ""]
    if "exitCode" in state:
        words.append(f"exit code {state['exitCode']}")
    return f"container {container}: " + ": ".join(w for w in words if w)


def _container_reason(status: dict[str, Any]) -> str:
    for status_list in ("initContainerStatuses", "containerStatuses"):
        for c in status.get(status_list) or []:
            state = c.get("state") or {}
            for kind in ("waiting", "terminated"):
                if state.get(kind) and (state[kind].get("reason") or state[kind].get("message")):
                    return _describe(c["name"], state[kind])
    return ""
