"""`KubernetesBackend`: a pod per sandbox, on the official Kubernetes Python client.

Create: a Secret (the agent's bearer token, fresh per sandbox: never the service's API key), a NetworkPolicy
(ingress only from the orchestrator, egress only when asked), then the pod (`manifests.pod_manifest`); then wait
until the pod is Ready, as the pod watcher (LIST + WATCH, `watch.PodWatcher`) reports it. A pod that fails, or is
not ready within `ready_timeout_s`, fails the create with the reason Kubernetes gave, and its objects are deleted.

Commands and files go over HTTP to the agent in the pod, at the pod's IP (so the orchestrator must run in the
cluster, or route to pod IPs). Every API request is retried on 429, 5xx and transport errors, with backoff.
Every request to an agent goes on a connection of its own (`Connection: close`): httpcore's pool can close an
idle keep-alive connection it has just handed to a request that has not started yet (its keep-alive expiry
passes meanwhile: the race of encode/httpcore#1110), which under load broke execs mid-request
(docs/env-kubernetes.md).
A request whose connection breaks anyway (refused, reset, closed early) is retried; an exec or a patch carries
a `request_id` that the agent deduplicates, so a retry of one that already reached the agent gets its answer
and never runs it again.

Pods that fail (evicted, their node lost, their agent dead) are reaped as soon as the watcher sees them: the
pod, its Secret and its NetworkPolicy are deleted and the sandbox's next call fails with what Kubernetes said
(Orchard Env leaves such pods to a 2-hour TTL). A pod deleted by someone else (`kubectl delete`, a node drain, an
upgrade: the watch sees it Terminating or gone, or a relist after 410 Gone finds it missing) makes its sandbox
lost as well; `lost_sandboxes` reports both kinds, with the reason, for the orchestrator to mark the sandbox failed
in its store and delete what is left (its Secret and NetworkPolicy: only once the store says failed can no create
of the same id be under way on another replica). Until then a call names the failure, not "not found".
On start, Secrets and NetworkPolicies without a pod are swept; pods that no record of the orchestrator owns are
deleted by its reconciliation (`list_ids`), unless its store holds no sandbox at all (a store that lost its data:
`Orchestrator.reconcile` then keeps them and says so).

Readiness is waited for only until a pod has been Ready once: a pod that was Ready and is reported not Ready again
(a readiness probe that timed out under load) is still asked directly, so a call fails or succeeds within its
connection retries instead of waiting up to `ready_timeout_s` for the probe. A delete is done once the API has
let the pod go (grace 0); the node stops its containers after that, so an agent may still answer a request the
delete overtook: that answer is dropped, and the call fails saying the sandbox was deleted while it ran.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from typing import Any

from orchard._extras import requires_extra
from orchard._retry import backoff_s
from orchard.env.agent.core import validate_env
from orchard.env.backends.base import (
    BackendError,
    ExecRequest,
    ExecResult,
    FileInfo,
    PathEscapeError,
    PtySession,
    RefusedError,
    Resources,
    SandboxNotFoundError,
    SandboxSpec,
)
from orchard.env.backends.kubernetes import snapshots
from orchard.env.backends.kubernetes.manifests import (
    CPU_ANNOTATION,
    MEMORY_ANNOTATION,
    POD_BY,
    SANDBOX,
    TOKEN_KEY,
    KubernetesConfig,
    network_policy_manifest,
    object_name,
    pod_manifest,
    pod_state,
    secret_manifest,
)
from orchard.env.backends.kubernetes.watch import PodWatcher

DELETED_OUT_OF_BAND = ("its pod was deleted out of band (not through this service: kubectl delete, a node drain, "
                       "a cluster upgrade)")
"""Why a sandbox failed whose pod someone else deleted."""

with requires_extra("env"):
    import httpx
with requires_extra("k8s"):
    import urllib3
    from kubernetes import client as k8s
    from kubernetes.client.exceptions import ApiException

logger = logging.getLogger(__name__)

_ID_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
RETRY_MAX_S = 10.0
"""The longest wait between two tries of an API request."""
SWEEP_SLACK_S = 60.0
"""How long past an object's `POD_BY` the sweep still leaves it: clocks of replicas may disagree."""
AGENT_RETRIES = 3
"""Retries of a request to a pod's agent whose connection failed (`AGENT_RETRYABLE`), with backoff."""
AGENT_RETRYABLE = (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ConnectTimeout, httpx.WriteTimeout)
"""Transport failures worth a retry. Not a read timeout: the agent took the request and has not answered within
the command's own timeout (+30 s); asking again would only wait as long again."""


class _PastDeadline(Exception):
    """An API request not sent: it could end after the create's `POD_BY`."""


def retry_delay(error: BaseException, attempt: int, *, base_s: float = 0.2, max_s: float = RETRY_MAX_S) -> float | None:
    """Seconds to wait before retrying a failed API request, or None when it must not be retried.

    429 and 5xx answers and transport errors (timeouts, refused or reset connections) are retried; a
    `Retry-After` the server sent wins over the backoff (capped at `max_s`). Backoff: `base_s * 2**attempt`
    capped at `max_s`, jittered into its upper half (`orchard._retry.backoff_s`: attempt 0 -> 0.1..0.2 s,
    attempt 3 -> 0.8..1.6 s).
    """
    if isinstance(error, ApiException):
        if error.status not in RETRYABLE_STATUS:
            return None
        after = (error.headers or {}).get("Retry-After")
        if after is not None:
            with contextlib.suppress(ValueError):
                return min(max(float(after), 0.0), max_s)
    elif not isinstance(error, urllib3.exceptions.HTTPError | OSError | TimeoutError):
        return None
    return backoff_s(attempt, base_s=base_s, max_s=max_s)


def _refusal(error: BaseException) -> str | None:
    """Why the API server refused a request for good (`RefusedError.reason`), or None: 403 is a used-up quota when
    its message says "exceeded quota" (the quota admission plugin's words), else a request that RBAC or an
    admission policy forbids; 422 is an invalid object."""
    if not isinstance(error, ApiException):
        return None
    if error.status == 403:
        return "quota_exceeded" if "exceeded quota" in _api_message(error) else "forbidden"
    return "invalid" if error.status == 422 else None


def _api_message(error: ApiException) -> str:
    with contextlib.suppress(TypeError, ValueError):
        return f"{error.status} {json.loads(error.body)['message']}"
    return f"{error.status} {error.reason}"


class KubernetesBackend:
    """Sandboxes as pods in one namespace (see the module docstring and docs/env-kubernetes.md).

    Args:
        config: how pods are made (`KubernetesConfig`; its defaults match `deploy/`).
        api_client: the official client's `ApiClient` (None: in-cluster configuration when running in a pod,
            else the kubeconfig).

    Attributes:
        isolation: "pod". blocks_network: True: a sandbox without network gets a default-deny egress
            NetworkPolicy, which holds where the cluster's network plugin enforces NetworkPolicies.
        reaped: (sandbox id, reason) of every sandbox whose failed pod this backend reaped.
    """

    name = "kubernetes"
    isolation = "pod"
    blocks_network = True

    def __init__(self, config: KubernetesConfig | None = None, *, api_client: k8s.ApiClient | None = None) -> None:
        if config is not None and not isinstance(config, KubernetesConfig):
            raise ValueError(f"config must be a KubernetesConfig or None, got {type(config).__name__}")
        self.config = config or KubernetesConfig()
        self.api_client = api_client if api_client is not None else default_api_client()
        self.core = k8s.CoreV1Api(self.api_client)
        self.net = k8s.NetworkingV1Api(self.api_client)
        self.reaped: list[tuple[str, str]] = []
        self._tokens: dict[str, str] = {}
        self._lost: dict[str, str] = {}
        """Sandbox id -> why it is gone for good (its pod failed, or was deleted out of band)."""
        self._lost_uid: dict[str, str | None] = {}
        """Sandbox id -> the uid of the pod it lost: a pod of another uid is the id made again."""
        self._seen: dict[str, tuple[str, str | None]] = {}
        """Pod name -> (sandbox id, uid) of every sandbox pod the watch holds."""
        self._was_ready: set[str] = set()
        """Uids of the pods seen Ready: their readiness is not waited for again."""
        self._deleting: set[str] = set()
        self._changed: dict[str, asyncio.Event] = {}
        self._watcher: PodWatcher | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._start_lock: asyncio.Lock | None = None
        self._http: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # -- the API server ------------------------------------------------------------------------------------

    async def _call(self, fn: Callable[..., Any], *args: Any, ok: tuple[int, ...] = (), until: float | None = None,
                    **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` on a thread, retried with backoff; a status in `ok` returns None. With `until`
        (epoch seconds), no try is sent that could end after it (checked on the thread, just before sending):
        `BackendError` instead."""
        timeout = self.config.api_timeout_s

        def attempt_once() -> Any:
            if until is not None and time.time() + timeout > until:
                raise _PastDeadline
            return fn(*args, _request_timeout=timeout, **kwargs)

        for attempt in range(self.config.api_retries + 1):
            try:
                return await asyncio.to_thread(attempt_once)
            except Exception as e:
                if isinstance(e, ApiException) and e.status in ok:
                    return None
                if isinstance(e, _PastDeadline):
                    raise BackendError(f"Kubernetes API {fn.__name__}: not sent, as it could end after the "
                                       "create's deadline for its pod (the start-up sweep may then have deleted "
                                       "the Secret and NetworkPolicy it needs)") from None
                delay = retry_delay(e, attempt)
                what = _api_message(e) if isinstance(e, ApiException) else f"{type(e).__name__}: {e}"
                if delay is None or attempt == self.config.api_retries:
                    refusal = _refusal(e)
                    if refusal is not None:
                        raise RefusedError(f"Kubernetes API {fn.__name__}: {what}", reason=refusal) from e
                    raise BackendError(f"Kubernetes API {fn.__name__}: {what}") from e
                logger.info("Kubernetes API %s: %s; retry %d in %.2fs", fn.__name__, what, attempt + 1, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _started(self) -> PodWatcher:
        """Start the pod watcher on first use (the backend is built before the service's event loop runs)."""
        if self._watcher is not None and self._watcher.synced.is_set():
            return self._watcher
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._watcher is None:
                self._loop = asyncio.get_running_loop()
                self._watcher = PodWatcher(self.core, self.config.namespace, self.config.selector(),
                                           self._on_change_threadsafe, watch_timeout_s=self.config.watch_timeout_s,
                                           request_timeout_s=self.config.api_timeout_s)
                self._watcher.start()
                deadline = time.monotonic() + self.config.ready_timeout_s
                while not self._watcher.synced.is_set():
                    if time.monotonic() > deadline:
                        raise BackendError("could not list the sandbox pods (see the log for the API's answers)")
                    await asyncio.sleep(0.02)
                await self._sweep()
        return self._watcher

    async def _sweep(self) -> None:
        """Delete Secrets and NetworkPolicies whose pod is gone (left by a create or delete that died half-way);
        only those older than a create may take, so a create in flight on another replica keeps its own."""
        assert self._watcher is not None
        now = time.time()
        cutoff = now - self.config.ready_timeout_s - 60  # for objects made before `POD_BY` was written
        for lister, deleter in ((self.core.list_namespaced_secret, self.core.delete_namespaced_secret),
                                (self.net.list_namespaced_network_policy, self.net.delete_namespaced_network_policy)):
            found = await self._call(lister, self.config.namespace, label_selector=self.config.selector(),
                                     _preload_content=False)
            for item in json.loads(found.data).get("items") or []:
                meta = item["metadata"]
                made, pod_by = _epoch(meta.get("creationTimestamp")), _pod_by(meta)
                due = now > pod_by + SWEEP_SLACK_S if pod_by is not None else made is not None and made < cutoff
                if meta["name"] not in self._watcher.pods and due:
                    await self._call(deleter, meta["name"], self.config.namespace, ok=(404,))

    def _on_change_threadsafe(self, name: str, pod: dict[str, Any] | None) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._on_change, name, pod)

    def _on_change(self, name: str, pod: dict[str, Any] | None) -> None:
        event = self._changed.get(name)
        if event is not None:
            event.set()
        if pod is None:
            sandbox_id, uid = self._seen.pop(name, (None, None))
            self._was_ready.discard(uid or "")
            if name in self._deleting:
                self._deleting.discard(name)
            elif sandbox_id is not None:
                self._lose(sandbox_id, uid, DELETED_OUT_OF_BAND)
            return
        sandbox_id = (pod["metadata"].get("labels") or {}).get(SANDBOX)
        if not sandbox_id:
            return
        uid = pod["metadata"].get("uid")
        self._seen[name] = (sandbox_id, uid)
        state = pod_state(pod)
        if state.phase == "ready":
            self._was_ready.add(uid or "")
        if state.phase in ("pending", "ready") and self._lost_uid.get(sandbox_id, uid) != uid:
            self.forget_lost(sandbox_id)  # made again (here or by another replica) after it was lost
        if name in self._deleting or sandbox_id in self._lost:
            return
        if state.phase == "failed":
            self._lose(sandbox_id, uid, f"its pod failed ({state.reason})")
            task = asyncio.get_running_loop().create_task(self._reap(sandbox_id, state.reason))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif state.phase == "terminating":  # deleted gracefully by someone else: it is going away
            self._lose(sandbox_id, uid, DELETED_OUT_OF_BAND)

    def _lose(self, sandbox_id: str, uid: str | None, reason: str) -> None:
        if sandbox_id not in self._lost:
            logger.warning("sandbox %s is lost: %s", sandbox_id, reason)
            self._lost[sandbox_id], self._lost_uid[sandbox_id] = reason, uid

    async def lost_sandboxes(self) -> dict[str, str]:
        """Sandbox id -> why it is gone for good (its pod failed, or was deleted out of band), for each sandbox
        whose pod the watch saw fail or go and that no create or delete through this backend has ended since.
        Each is checked against the API server first: one whose id has a new pod meanwhile (made again by
        another replica, which this replica's watch has not shown yet) is forgotten, not reported."""
        await self._started()
        out = {}
        for sandbox_id, reason in list(self._lost.items()):
            found = await self._call(self.core.read_namespaced_pod, object_name(sandbox_id), self.config.namespace,
                                     ok=(404,), _preload_content=False)
            if found is None or json.loads(found.data)["metadata"].get("uid") == self._lost_uid.get(sandbox_id):
                out[sandbox_id] = reason
            elif self._lost.get(sandbox_id) == reason:
                self.forget_lost(sandbox_id)
        return out

    def forget_lost(self, sandbox_id: str) -> None:
        """Stop reporting a lost sandbox (the orchestrator found it deleted, or made again)."""
        self._lost.pop(sandbox_id, None)
        self._lost_uid.pop(sandbox_id, None)

    async def _reap(self, sandbox_id: str, reason: str) -> None:
        logger.warning("sandbox %s: its pod failed (%s); deleting it now", sandbox_id, reason)
        self.reaped.append((sandbox_id, reason))
        try:
            await self._delete_objects(sandbox_id)
        except BackendError:
            logger.exception("reaping sandbox %s failed; the next start sweeps it", sandbox_id)

    async def _delete_objects(self, sandbox_id: str) -> None:
        name, ns = object_name(sandbox_id), self.config.namespace
        self._deleting.add(name)
        await self._call(self.core.delete_namespaced_pod, name, ns, grace_period_seconds=0, ok=(404,))
        await self._call(self.core.delete_namespaced_secret, name, ns, ok=(404,))
        await self._call(self.net.delete_namespaced_network_policy, name, ns, ok=(404,))

    async def _pod_by_of(self, reader: Callable[..., Any], name: str) -> float:
        """The `POD_BY` of an object a create found made (by an earlier try of it); for one made before the
        annotation was written, when the sweep's old rule lets it go. Gone meanwhile: already past."""
        found = await self._call(reader, name, self.config.namespace, ok=(404,), _preload_content=False)
        if found is None:
            return float("-inf")
        meta = json.loads(found.data)["metadata"]
        pod_by = _pod_by(meta)
        if pod_by is not None:
            return pod_by
        made = _epoch(meta.get("creationTimestamp"))
        return made + self.config.ready_timeout_s + 60 - SWEEP_SLACK_S if made is not None else float("-inf")

    async def _wait_ready(self, sandbox_id: str, timeout_s: float) -> str:
        """The pod's IP once it is Ready; BackendError with Kubernetes' reason if it fails or times out."""
        watcher = await self._started()
        name = object_name(sandbox_id)
        event = self._changed.setdefault(name, asyncio.Event())
        deadline = time.monotonic() + timeout_s
        seen, reason = False, "the pod was not seen by the watch"
        try:
            while True:
                event.clear()
                pod = watcher.pods.get(name)
                if pod is not None:
                    seen = True
                    state = pod_state(pod)
                    if state.phase == "ready":
                        return state.ip  # type: ignore[return-value]
                    if state.phase in ("failed", "terminating"):
                        raise BackendError(f"sandbox {sandbox_id}: pod {name} {state.phase}: {state.reason}")
                    reason = state.reason
                elif seen:
                    raise BackendError(f"sandbox {sandbox_id}: pod {name} was deleted before it was ready")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BackendError(f"sandbox {sandbox_id}: pod {name} not ready after {timeout_s:g}s: {reason}")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(event.wait(), left)
        finally:
            self._changed.pop(name, None)

    # -- the Backend protocol --------------------------------------------------------------------------------

    async def create(self, sandbox_id: str, spec: SandboxSpec) -> None:
        """Make the sandbox's Secret, NetworkPolicy and pod, and wait until the pod is Ready. Idempotent: an
        existing pod is waited for, not made again."""
        _check_id(sandbox_id)
        _check_spec(spec)
        watcher = await self._started()
        name, ns = object_name(sandbox_id), self.config.namespace
        self.forget_lost(sandbox_id)
        if name not in watcher.pods or name in self._deleting:
            self._deleting.discard(name)
            token = secrets.token_urlsafe(32)
            # The deadline for the pod, written on the Secret and the NetworkPolicy (`POD_BY`) so that another
            # replica's start-up sweep leaves them alone until then: three requests' tries, with their waits.
            until = time.time() + 3 * (self.config.api_retries + 1) * (self.config.api_timeout_s + RETRY_MAX_S)
            made = await self._call(self.core.create_namespaced_secret, ns,
                                    secret_manifest(self.config, sandbox_id, token, pod_by=until), ok=(409,))
            if made is not None:  # else one exists (a retried create): its token is read when needed
                self._tokens[sandbox_id] = token
            else:  # and its deadline holds: the sweep reads the one written on it
                until = min(until, await self._pod_by_of(self.core.read_namespaced_secret, name))
            made = await self._call(self.net.create_namespaced_network_policy, ns,
                                    network_policy_manifest(self.config, sandbox_id, spec.network, pod_by=until),
                                    ok=(409,), until=until)
            if made is None:
                until = min(until, await self._pod_by_of(self.net.read_namespaced_network_policy, name))
            await self._call(self.core.create_namespaced_pod, ns, pod_manifest(self.config, sandbox_id, spec),
                             ok=(409,), until=until)
        try:
            await self._wait_ready(sandbox_id, self.config.ready_timeout_s)
        except BaseException:
            with contextlib.suppress(BackendError):
                await self.delete(sandbox_id)
            raise

    async def delete(self, sandbox_id: str) -> None:
        """Delete the pod (no grace period: its processes end now), its Secret and NetworkPolicy. Idempotent."""
        _check_id(sandbox_id)
        await self._started()
        self._tokens.pop(sandbox_id, None)
        self.forget_lost(sandbox_id)
        await self._delete_objects(sandbox_id)

    async def exists(self, sandbox_id: str) -> bool:
        _check_id(sandbox_id)
        return sandbox_id in await self.list_ids()

    async def list_ids(self) -> list[str]:
        """Ids of the sandboxes whose pods are pending or ready (failed ones are being reaped)."""
        watcher = await self._started()
        out = []
        for name, pod in list(watcher.pods.items()):
            sandbox_id = (pod["metadata"].get("labels") or {}).get(SANDBOX)
            if sandbox_id and name not in self._deleting and pod_state(pod).phase in ("pending", "ready"):
                out.append(sandbox_id)
        return sorted(out)

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        body = {"command": request.command, "cwd": request.cwd, "env": request.env, "timeout_s": request.timeout_s,
                "max_output_bytes": request.max_output_bytes,
                "stdin_b64": base64.b64encode(request.stdin).decode() if request.stdin is not None else None,
                "request_id": secrets.token_hex(16)}  # the same on every retry: the agent runs it once
        r = await self._agent(sandbox_id, "POST", "/exec", json=body, timeout_s=request.timeout_s + 30)
        return _result(r.json())

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int | None = None) -> None:
        params = {"path": path} if mode is None else {"path": path, "mode": f"{mode:o}"}
        await self._agent(sandbox_id, "PUT", "/files", params=params, content=data)

    async def extract_archive(self, sandbox_id: str, path: str, data: bytes) -> tuple[int, int]:
        summary = (await self._agent(sandbox_id, "PUT", "/files/archive", params={"path": path}, content=data)).json()
        return int(summary["entries"]), int(summary["bytes"])

    async def read_file(self, sandbox_id: str, path: str, max_bytes: int | None = None) -> bytes:
        params: dict[str, Any] = {"path": path} if max_bytes is None else {"path": path, "max_bytes": max_bytes}
        return (await self._agent(sandbox_id, "GET", "/files", params=params)).content

    async def list_files(self, sandbox_id: str, path: str = ".", recursive: bool = False) -> list[FileInfo]:
        r = await self._agent(sandbox_id, "GET", "/files/list",
                              params={"path": path, "recursive": "true" if recursive else "false"})
        return [FileInfo(**f) for f in r.json()["files"]]

    async def apply_patch(self, sandbox_id: str, patch: str) -> ExecResult:
        body = {"patch": patch, "request_id": secrets.token_hex(16)}
        return _result((await self._agent(sandbox_id, "POST", "/apply_patch", json=body)).json())

    async def resources(self, sandbox_id: str) -> Resources:
        """The pod's CPU and memory limits and the workspace's disk use (`pids` is the kubelet's: None)."""
        disk = (await self._agent(sandbox_id, "GET", "/resources")).json()["disk_bytes"]
        pod = (await self._started()).pods.get(object_name(sandbox_id)) or {}
        notes = pod.get("metadata", {}).get("annotations") or {}
        cpu, memory = notes.get(CPU_ANNOTATION), notes.get(MEMORY_ANNOTATION)
        return Resources(cpu=float(cpu) if cpu else None, memory_mb=int(memory) if memory else None, pids=None,
                         disk_bytes=int(disk))

    async def open_pty(self, sandbox_id: str, command: str | None = None, cols: int = 80, rows: int = 24) -> PtySession:
        raise BackendError("the Kubernetes backend offers no terminals; run commands with exec")

    # -- snapshots and forks: a tar stream through the orchestrator (orchard.env.backends.kubernetes.snapshots) --

    async def snapshot(self, sandbox_id: str, snapshot_id: str) -> None:
        _check_id(sandbox_id)
        await snapshots.take(self, self.config.snapshot_dir, sandbox_id, snapshot_id)

    async def fork(self, sandbox_id: str, spec: SandboxSpec, *, parent_id: str | None = None,
                   snapshot_id: str | None = None) -> None:
        """A new pod made as `create` makes one, its workspace unpacked from the snapshot's tar or from a tar of
        the live parent's workspace (see the snapshots module)."""
        _check_id(sandbox_id)
        _check_spec(spec)
        if parent_id is not None:
            _check_id(parent_id)
        await snapshots.fork(self, self.config.snapshot_dir, sandbox_id, spec, parent_id=parent_id,
                             snapshot_id=snapshot_id)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await snapshots.delete(self.config.snapshot_dir, snapshot_id)

    async def list_snapshot_ids(self) -> list[str]:
        return await asyncio.to_thread(snapshots.list_ids, self.config.snapshot_dir)

    async def close(self) -> None:
        """Stop the watcher and close connections; the pods stay (a restarted service finds them)."""
        for task in list(self._tasks):
            task.cancel()
        if self._watcher is not None:
            await asyncio.to_thread(self._watcher.stop)
        if self._http is not None:
            await self._http.aclose()
        self._http = None

    def health(self) -> dict[str, Any]:
        """What /health reports about the backend."""
        w = self._watcher
        return {
            "backend": self.name,
            "isolation": self.isolation,
            "namespace": self.config.namespace,
            "owner": self.config.owner,
            "pods": len(w.pods) if w else None,
            "watch": {"lists": w.lists, "resumes": w.resumes} if w else None,
            "reaped": len(self.reaped),
        }

    # -- the agent in the pod ------------------------------------------------------------------------------

    async def _token(self, sandbox_id: str) -> str:
        token = self._tokens.get(sandbox_id)
        if token is None:  # made by another replica, or before a restart: the Secret has it
            secret = await self._call(self.core.read_namespaced_secret, object_name(sandbox_id),
                                      self.config.namespace, ok=(404,), _preload_content=False)
            if secret is None:
                raise SandboxNotFoundError(f"no sandbox {sandbox_id!r} (its Secret is gone)")
            token = base64.b64decode(json.loads(secret.data)["data"][TOKEN_KEY]).decode()
            self._tokens[sandbox_id] = token
        return token

    def _check_not_lost(self, sandbox_id: str) -> None:
        reason = self._lost.get(sandbox_id)
        if reason is not None:
            raise BackendError(f"sandbox {sandbox_id} failed: {reason}")

    async def _agent(self, sandbox_id: str, method: str, path: str, *, timeout_s: float = 300.0,
                     **kwargs: Any) -> httpx.Response:
        _check_id(sandbox_id)
        watcher = await self._started()
        self._check_not_lost(sandbox_id)
        name = object_name(sandbox_id)
        pod = watcher.pods.get(name)
        if pod is None or name in self._deleting:
            raise SandboxNotFoundError(f"no sandbox {sandbox_id!r}")
        uid = pod["metadata"].get("uid")
        state = pod_state(pod)
        if state.phase == "pending" and state.ip and uid in self._was_ready:
            ip = state.ip  # Ready before: its probe failed under load, its agent is asked (and retried) now
        elif state.phase == "pending":  # made by another replica a moment ago
            ip = await self._wait_ready(sandbox_id, self.config.ready_timeout_s)
        elif state.phase != "ready":
            raise BackendError(f"sandbox {sandbox_id}: pod {name} is {state.phase}: {state.reason}")
        else:
            ip = state.ip  # type: ignore[assignment]
        if self._http is None:
            # nothing kept alive: a pooled connection can be closed under the request it was handed to (below)
            self._http = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))
        host = f"[{ip}]" if ":" in ip else ip
        # a connection per request: a pooled one can be closed under the request by the pool (module docstring)
        headers = {"Authorization": f"Bearer {await self._token(sandbox_id)}", "Connection": "close"}
        for attempt in range(AGENT_RETRIES + 1):
            try:
                r = await self._http.request(method, f"http://{host}:{self.config.agent_port}{path}",
                                             headers=headers, timeout=timeout_s, **kwargs)
                break
            except httpx.HTTPError as e:
                self._check_not_lost(sandbox_id)
                if not isinstance(e, AGENT_RETRYABLE) or attempt == AGENT_RETRIES or name in self._deleting:
                    raise BackendError(f"sandbox {sandbox_id}: its agent at {ip} did not answer: {_chain(e)}") from e
                delay = backoff_s(attempt, base_s=0.2)
                logger.warning("sandbox %s: %s %s to its agent: %s; retry %d in %.2fs", sandbox_id, method,
                               path, _chain(e), attempt + 1, delay)
                await asyncio.sleep(delay)
        # A delete (ours with grace 0, or someone else's) may have overtaken the request while the node had not
        # yet stopped the pod's agent: what the agent answered then belongs to a sandbox that is gone.
        self._check_not_lost(sandbox_id)
        now = watcher.pods.get(name)
        if name in self._deleting or now is None or now["metadata"].get("uid") != uid:
            raise BackendError(f"sandbox {sandbox_id} was deleted while {method} {path} ran; its answer is "
                               "not reported")
        if r.status_code < 300:
            return r
        try:
            detail = r.json()
        except ValueError:
            detail = {"detail": r.text}
        message = str(detail.get("detail"))
        if r.status_code == 400:
            raise (PathEscapeError if detail.get("error") == "path_escape" else ValueError)(message)
        if r.status_code == 404 and detail.get("error") == "not_found":
            raise FileNotFoundError(message)
        raise BackendError(f"sandbox {sandbox_id}: its agent answered {r.status_code}: {message}")


def _result(j: dict[str, Any]) -> ExecResult:
    return ExecResult(exit_code=j["exit_code"], stdout=base64.b64decode(j["stdout_b64"]),
                      stderr=base64.b64decode(j["stderr_b64"]), stdout_truncated=j["stdout_truncated"],
                      stderr_truncated=j["stderr_truncated"], timed_out=j["timed_out"], duration_s=j["duration_s"])


def _chain(error: BaseException) -> str:
    """`error` and what caused it, innermost last ("ReadError: ... <- OSError: [Errno 104] ..."): httpx's
    transport errors hide the socket's errno, which tells a reset (a peer gone) from an end of stream."""
    parts, seen = [], set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        parts.append(f"{type(cause).__name__}: {cause}")
        cause = cause.__cause__ or cause.__context__
    return " <- ".join(parts)


def _pod_by(meta: dict[str, Any]) -> float | None:
    with contextlib.suppress(KeyError, TypeError, ValueError):
        return float((meta.get("annotations") or {})[POD_BY])
    return None


def _epoch(timestamp: str | None) -> float | None:
    if not timestamp:
        return None
    from datetime import datetime

    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def _check_id(sandbox_id: str) -> None:
    if not isinstance(sandbox_id, str) or not _ID_RE.match(sandbox_id):
        raise ValueError(f"sandbox_id must be a Kubernetes label value ({_ID_RE.pattern}), got {sandbox_id!r}")


def _check_spec(spec: SandboxSpec) -> None:
    if not isinstance(spec, SandboxSpec):
        raise ValueError(f"spec must be a SandboxSpec, got {type(spec).__name__}")
    validate_env(spec.env, "spec.env")
    if not isinstance(spec.image, str) or not spec.image or any(c.isspace() for c in spec.image):
        raise ValueError(f"spec.image must be an image reference without spaces, got {spec.image!r}")
    if not isinstance(spec.workdir, str) or not spec.workdir.startswith("/") or spec.workdir.rstrip("/") == "":
        raise ValueError(f"spec.workdir must be an absolute path other than '/', got {spec.workdir!r}")
    if spec.cpu is not None and not spec.cpu > 0:
        raise ValueError(f"spec.cpu must be > 0, got {spec.cpu!r}")
    if spec.memory_mb is not None and not spec.memory_mb >= 1:
        raise ValueError(f"spec.memory_mb must be >= 1, got {spec.memory_mb!r}")


def default_api_client() -> k8s.ApiClient:
    """An `ApiClient` for where we run: the in-cluster service account in a pod, else the kubeconfig."""
    from kubernetes import config as k8s_config

    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        k8s_config.load_incluster_config()
    else:
        k8s_config.load_kube_config()
    return k8s.ApiClient()
