"""A small Kubernetes API server, in-process on loopback, for the routes the Kubernetes backend uses.

Pods, Secrets (core/v1) and NetworkPolicies (networking.k8s.io/v1) in any namespace: create, get, list, delete
and watch, with equality label selectors (`a=b`, `a!=b`, `a`, `!a`), a global resourceVersion, watch from a
resourceVersion (410 Gone once it is older than the retained history), `timeoutSeconds`, and a BOOKMARK (the
resourceVersion the watch has reached) before a watch ends by its timeout when the client allows bookmarks.
Pods are deleted gracefully, as a real API server does: a DELETE with a grace period (`gracePeriodSeconds`, else
the pod's `terminationGracePeriodSeconds`, else 30) only sets `deletionTimestamp` (the pod is Terminating, a
MODIFIED event) and the kubelet removes the pod once its containers have stopped (a DELETE with grace 0); a
DELETE with grace 0 removes it at once (a force delete), whatever the kubelet is still doing.
The official client talks to it as to a real API server (JSON over HTTP/1.1; watches are chunked streams of
JSON lines). What it does not do: authentication, admission, scheduling, NetworkPolicy enforcement, image pulls,
resource limits, garbage collection by owner references, PATCH.

Faults: `fail_next` answers the next matching requests with 429 (with Retry-After) or 5xx; `drop_watches` cuts
every open watch mid-stream; `compact` forgets the event history, so a watch resumed from before gets 410;
`delete_out_of_band` deletes a pod as `kubectl delete`, a node drain or a cluster upgrade would, behind the
backend's back.
"""

from __future__ import annotations

import bisect
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

KINDS = {"pods": "Pod", "secrets": "Secret", "networkpolicies": "NetworkPolicy"}
_PATH = re.compile(
    r"^/(?:api/v1|apis/networking\.k8s\.io/v1)/namespaces/(?P<ns>[^/]+)/(?P<res>pods|secrets|networkpolicies)"
    r"(?:/(?P<name>[^/]+))?$"
)


def matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based label selector: "a=b,c!=d,e,!f" (all terms must hold)."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k) != v:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


@dataclass
class Fault:
    method: str
    resource: str
    status: int
    times: int
    retry_after: float | None
    reason: str = "Injected"
    message: str = "injected fault"


class ApiEmulator:
    """The API server (start with `start()`, or use as a context manager). State lives in `objects`."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.events: list[tuple[int, str, str, str, dict[str, Any]]] = []
        """(resourceVersion, resource, namespace, type, object) since `oldest`."""
        self.rv = 1000
        self.oldest = 1000
        """Watches from a resourceVersion below this get 410 Gone."""
        self.cond = threading.Condition()
        self.faults: list[Fault] = []
        self.quota: dict[str, int] = {}
        """resource -> how many objects of it a namespace may hold (a ResourceQuota's `count/<resource>`): a
        create past it is refused with 403 Forbidden, "exceeded quota", as the quota admission plugin does."""
        self.requests: list[tuple[str, str, int]] = []
        """(method, path, status) of every request answered."""
        self.watch_starts = 0
        self.bookmarks = 0
        """BOOKMARK events sent."""
        self._cut_generation = 0
        self.on_event: list[Callable[[str, str, dict[str, Any]], None]] = []
        """Called (outside the lock) with (type, resource, object) after every change: the kubelet's hook."""
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> ApiEmulator:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.drop_watches()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> ApiEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- faults -----------------------------------------------------------------------------------------------

    def fail_next(self, method: str, resource: str, status: int, times: int = 1,
                  retry_after: float | None = None, *, reason: str = "Injected",
                  message: str = "injected fault") -> None:
        """Answer the next `times` `method` requests on `resource` ("pods", ...) with `status`, in a Status
        object with `reason` and `message` (a real answer's: "Forbidden", "Invalid", ...)."""
        with self.cond:
            self.faults.append(Fault(method, resource, status, times, retry_after, reason, message))

    def drop_watches(self) -> None:
        """Cut every open watch mid-stream (the client sees a broken chunked response)."""
        with self.cond:
            self._cut_generation += 1
            self.cond.notify_all()

    def compact(self) -> None:
        """Forget the event history: a watch from any resourceVersion before now gets 410 Gone."""
        with self.cond:
            self.events.clear()
            self.oldest = self.rv
            self.cond.notify_all()

    def delete_out_of_band(self, namespace: str, name: str, grace_s: float | None = None) -> None:
        """Delete a pod as someone other than the backend would (`kubectl delete pod`; a drain evicts the same
        way): gracefully, so it is Terminating until the kubelet has stopped it. `grace_s=0`: `kubectl delete
        --force --grace-period=0`, gone at once."""
        code, said = self.delete("pods", namespace, name, grace_s=grace_s)
        if code != 200:
            raise KeyError(said["message"])

    # -- state ------------------------------------------------------------------------------------------------

    def list(self, resource: str, namespace: str, selector: str = "") -> list[dict[str, Any]]:
        with self.cond:
            return [json.loads(json.dumps(o)) for (r, ns, _), o in sorted(self.objects.items())
                    if r == resource and ns == namespace and matches(selector, o["metadata"].get("labels") or {})]

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        with self.cond:
            obj = self.objects.get((resource, namespace, name))
            return json.loads(json.dumps(obj)) if obj is not None else None

    def _record(self, kind: str, resource: str, namespace: str, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.events.append((self.rv, resource, namespace, kind, json.loads(json.dumps(obj))))
        self.cond.notify_all()

    def _notify(self, kind: str, resource: str, obj: dict[str, Any]) -> None:
        for hook in list(self.on_event):
            hook(kind, resource, obj)

    def create(self, resource: str, namespace: str, obj: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        meta = obj.setdefault("metadata", {})
        name = meta.get("name")
        if not name:
            return 422, _status(422, "Invalid", "metadata.name: Required value")
        with self.cond:
            if (resource, namespace, name) in self.objects:
                return 409, _status(409, "AlreadyExists", f'{resource} "{name}" already exists')
            limit = self.quota.get(resource)
            used = sum(r == resource and ns == namespace for r, ns, _ in self.objects)
            if limit is not None and used >= limit:
                return 403, _status(403, "Forbidden", f'{resource} "{name}" is forbidden: exceeded quota: '
                                    f"sandboxes, requested: count/{resource}=1, used: count/{resource}={used}, "
                                    f"limited: count/{resource}={limit}")
            meta.update(namespace=namespace, uid=str(uuid.uuid4()),
                        creationTimestamp=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            if resource == "pods":
                obj["status"] = {"phase": "Pending"}
            self.objects[(resource, namespace, name)] = obj
            self._record("ADDED", resource, namespace, obj)
            out = json.loads(json.dumps(obj))
        self._notify("ADDED", resource, out)
        return 201, out

    def update_status(self, namespace: str, name: str, status: dict[str, Any]) -> bool:
        """Replace a pod's status (what the kubelet reports); False if the pod is gone."""
        with self.cond:
            obj = self.objects.get(("pods", namespace, name))
            if obj is None:
                return False
            obj["status"] = status
            self._record("MODIFIED", "pods", namespace, obj)
        return True

    def delete(self, resource: str, namespace: str, name: str,
               grace_s: float | None = None) -> tuple[int, dict[str, Any]]:
        """Delete an object; a pod with a grace period (`grace_s`, else its spec's, else 30 s) is only marked
        Terminating (`deletionTimestamp`), for the kubelet to stop and then remove with `grace_s=0`."""
        with self.cond:
            obj = self.objects.get((resource, namespace, name))
            if obj is None:
                return 404, _status(404, "NotFound", f'{resource} "{name}" not found')
            if grace_s is None and resource == "pods":
                grace_s = (obj.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
            if resource == "pods" and grace_s:
                meta = obj["metadata"]
                if "deletionTimestamp" not in meta:  # a second graceful DELETE changes nothing
                    meta["deletionTimestamp"] = datetime.fromtimestamp(time.time() + grace_s, UTC).strftime(
                        "%Y-%m-%dT%H:%M:%SZ")
                    meta["deletionGracePeriodSeconds"] = int(grace_s)
                    self._record("MODIFIED", resource, namespace, obj)
                    kind = "MODIFIED"
                else:
                    kind = ""
            else:
                del self.objects[(resource, namespace, name)]
                self._record("DELETED", resource, namespace, obj)
                kind = "DELETED"
            out = json.loads(json.dumps(obj))
        if kind:
            self._notify(kind, resource, out)
        return 200, out

    def _take_fault(self, method: str, resource: str) -> Fault | None:
        with self.cond:
            for f in self.faults:
                if f.method == method and f.resource == resource and f.times > 0:
                    f.times -= 1
                    return f
        return None


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason,
            "message": message, "metadata": {}}


def _handler(api: ApiEmulator) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _reply(self, code: int, obj: dict[str, Any], headers: dict[str, str] | None = None) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)
            api.requests.append((self.command, self.path, code))

        def _serve(self) -> None:
            url = urlsplit(self.path)
            q = {k: v[-1] for k, v in parse_qs(url.query).items()}
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            m = _PATH.match(url.path)
            if m is None:
                self._reply(404, _status(404, "NotFound", f"no route {url.path}"))
                return
            ns, res, name = m["ns"], m["res"], m["name"]
            fault = api._take_fault(self.command, res)
            if fault is not None:
                headers = {"Retry-After": f"{fault.retry_after:g}"} if fault.retry_after is not None else {}
                self._reply(fault.status, _status(fault.status, fault.reason, fault.message), headers)
                return
            if self.command == "GET" and name is None and q.get("watch") in ("true", "1"):
                self._watch(res, ns, q)
            elif self.command == "GET" and name is None:
                items = api.list(res, ns, q.get("labelSelector", ""))
                self._reply(200, {"kind": KINDS[res] + "List", "apiVersion": "v1", "items": items,
                                  "metadata": {"resourceVersion": str(api.rv)}})
            elif self.command == "GET":
                obj = api.get(res, ns, name)
                if obj is None:
                    self._reply(404, _status(404, "NotFound", f'{res} "{name}" not found'))
                else:
                    self._reply(200, obj)
            elif self.command == "POST" and name is None:
                self._reply(*api.create(res, ns, json.loads(body)))
            elif self.command == "DELETE" and name is not None:
                options = json.loads(body) if body else {}
                grace = q.get("gracePeriodSeconds", options.get("gracePeriodSeconds"))
                self._reply(*api.delete(res, ns, name, grace_s=float(grace) if grace is not None else None))
            else:
                self._reply(405, _status(405, "MethodNotAllowed", f"{self.command} {url.path}"))

        do_GET = do_POST = do_DELETE = _serve

        def _chunk(self, obj: dict[str, Any]) -> None:
            data = json.dumps(obj).encode() + b"\n"
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _watch(self, res: str, ns: str, q: dict[str, str]) -> None:
            selector = q.get("labelSelector", "")
            deadline = time.monotonic() + float(q.get("timeoutSeconds") or 1800)
            since = q.get("resourceVersion")
            bookmarks = q.get("allowWatchBookmarks") in ("true", "1")
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            api.requests.append(("WATCH", self.path, 200))
            with api.cond:
                api.watch_starts += 1
                generation = api._cut_generation
                if since in (None, "", "0"):
                    pending = [("ADDED", o) for (r, n, _), o in sorted(api.objects.items()) if r == res and n == ns]
                    last = api.rv
                elif int(since) < api.oldest:
                    pending, last = None, api.rv
                else:
                    pending, last = [], int(since)
            if pending is None:
                self._chunk({"type": "ERROR", "object": _status(410, "Expired", f"too old resource version: {since}")})
                self.wfile.write(b"0\r\n\r\n")
                return
            try:
                while True:
                    for kind, obj in pending:
                        if matches(selector, obj["metadata"].get("labels") or {}):
                            self._chunk({"type": kind, "object": obj})
                    with api.cond:
                        while True:
                            if api._cut_generation != generation:
                                self.close_connection = True
                                self.connection.shutdown(2)  # mid-stream, no final chunk: a dropped watch
                                return
                            # events are in resourceVersion order: a bisection, not a scan of the whole history
                            # per wake-up (which made a 1,000-sandbox run quadratic in the emulator)
                            fresh = api.events[bisect.bisect_right(api.events, last, key=lambda e: e[0]):]
                            if fresh:
                                last = fresh[-1][0]
                            pending = [(k, o) for _, r, n, k, o in fresh if r == res and n == ns]
                            left = deadline - time.monotonic()
                            if pending or left <= 0:
                                break
                            api.cond.wait(min(left, 0.5))
                    if not pending:  # the watch's time is up
                        if bookmarks:  # where it got to, events of other kinds included: resume from there
                            self._chunk({"type": "BOOKMARK", "object": {"kind": KINDS[res], "apiVersion": "v1",
                                                                        "metadata": {"resourceVersion": str(last)}}})
                            api.bookmarks += 1
                        self.wfile.write(b"0\r\n\r\n")
                        return
            except OSError:
                return

    return Handler
