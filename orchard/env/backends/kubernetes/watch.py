"""A cache of the backend's pods, kept by LIST + WATCH (the informer pattern, in one thread).

LIST gives the pods and the collection's resourceVersion; WATCH from that version gives every change after it.
A watch the server ends (its `timeoutSeconds` passed) or that drops (a connection reset, a proxy's idle timeout)
is resumed from the last resourceVersion seen, so no event is missed or repeated. When the server no longer
has that version (410 Gone: its history was compacted), the watcher lists again and reports, for every pod,
what changed in between, deletions included.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from collections.abc import Callable
from typing import Any

from orchard._extras import requires_extra

with requires_extra("k8s"):
    from kubernetes import watch as k8s_watch
    from kubernetes.client import CoreV1Api
    from kubernetes.client.exceptions import ApiException

logger = logging.getLogger(__name__)

OnChange = Callable[[str, "dict[str, Any] | None"], None]
"""Called (on the watcher's thread) with a pod's name and the pod, or None once it is gone."""


class PodWatcher:
    """Keeps `pods` (name -> pod as a dict) equal to the pods of `namespace` matching `selector`.

    Args:
        api: the client's CoreV1Api.
        namespace, selector: which pods.
        on_change: called for every pod that changed, on the watcher's thread.
        watch_timeout_s: asked of the server for each watch (it ends the watch after that long).
        request_timeout_s: a LIST, or a watch that sends nothing for this long past `watch_timeout_s`, fails.

    Attributes:
        synced: set once the first LIST is in `pods`.
        lists, resumes: how often it listed (1 + the 410s) and resumed a watch that ended or dropped.
    """

    def __init__(self, api: CoreV1Api, namespace: str, selector: str, on_change: OnChange, *,
                 watch_timeout_s: int = 240, request_timeout_s: float = 30.0) -> None:
        self.api = api
        self.namespace = namespace
        self.selector = selector
        self.on_change = on_change
        self.watch_timeout_s = watch_timeout_s
        self.request_timeout_s = request_timeout_s
        self.pods: dict[str, dict[str, Any]] = {}
        self.resource_version: str | None = None
        self.synced = threading.Event()
        self.lists = 0
        self.resumes = 0
        self._stop = threading.Event()
        self._watch: k8s_watch.Watch | None = None
        self._thread = threading.Thread(target=self._run, name="orchard-k8s-pod-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                if self.resource_version is None:
                    self._list()
                self._watch_once()
                backoff = 0.1
            except ApiException as e:
                if e.status == 410:  # our resourceVersion was compacted away: start over from a fresh list
                    logger.info("pod watch expired (410 Gone); listing again")
                    self.resource_version = None
                    continue
                logger.warning("pod watch failed (%s %s); retrying in %.1fs", e.status, e.reason, backoff)
                self._pause(backoff)
                backoff = min(backoff * 2, 5.0)
            except Exception as e:  # a dropped connection, a timeout: resume where we were
                if self._stop.is_set():
                    return
                logger.info("pod watch dropped (%s); resuming from %s", type(e).__name__, self.resource_version)
                self._pause(backoff)
                backoff = min(backoff * 2, 5.0)
            self.resumes += 1

    def _pause(self, seconds: float) -> None:
        self._stop.wait(seconds * (0.5 + random.random()))

    def _list(self) -> None:
        resp = self.api.list_namespaced_pod(self.namespace, label_selector=self.selector, _preload_content=False,
                                            _request_timeout=self.request_timeout_s)
        body = json.loads(resp.data)
        fresh = {p["metadata"]["name"]: p for p in body.get("items") or []}
        gone = set(self.pods) - set(fresh)
        self.pods = fresh
        self.resource_version = body["metadata"]["resourceVersion"]
        self.lists += 1
        for name in gone:
            self.on_change(name, None)
        for name, pod in fresh.items():
            self.on_change(name, pod)
        self.synced.set()

    def _watch_once(self) -> None:
        # pods stay dicts, as the LIST gives them: no model objects built per event only to be read as dicts
        self._watch = w = k8s_watch.Watch(return_type="object")
        if self._stop.is_set():
            return
        stream = w.stream(self.api.list_namespaced_pod, self.namespace, label_selector=self.selector,
                          resource_version=self.resource_version, timeout_seconds=self.watch_timeout_s,
                          allow_watch_bookmarks=True,
                          _request_timeout=(self.request_timeout_s, self.watch_timeout_s + self.request_timeout_s))
        for event in stream:
            kind, pod = event["type"], event["raw_object"]
            version = (pod.get("metadata") or {}).get("resourceVersion")
            if version:
                self.resource_version = version
            if kind == "BOOKMARK":
                continue
            name = pod["metadata"]["name"]
            if kind == "DELETED":
                self.pods.pop(name, None)
                self.on_change(name, None)
            else:
                self.pods[name] = pod
                self.on_change(name, pod)
