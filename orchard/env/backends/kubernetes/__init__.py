"""The Kubernetes sandbox backend: a pod per sandbox, our exec agent injected by an init container.

    orchard env serve --backend kubernetes --host 0.0.0.0      # in a pod of the cluster (see deploy/)

`KubernetesBackend(config, api_client=...)` in code; `from_environment` is what `--backend kubernetes` builds,
from `ORCHARD_K8S_*` variables. Needs the `[k8s]` extra (the official `kubernetes` client). How to deploy and
operate it, and what the image of a sandbox must contain (python3 >= 3.10 and bash): docs/env-kubernetes.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchard._extras import requires_extra
from orchard.env.backends.kubernetes.manifests import KubernetesConfig

if TYPE_CHECKING:
    from orchard.env.backends.kubernetes.backend import KubernetesBackend

__all__ = ["ENVIRONMENT", "KubernetesBackend", "KubernetesConfig", "from_environment"]

ENVIRONMENT = {
    "ORCHARD_K8S_NAMESPACE": "namespace",
    "ORCHARD_K8S_OWNER": "owner",
    "ORCHARD_K8S_AGENT_IMAGE": "agent_image",
    "ORCHARD_K8S_DEFAULT_IMAGE": "default_image",
    "ORCHARD_K8S_READY_TIMEOUT": "ready_timeout_s",
    "ORCHARD_K8S_WATCH_TIMEOUT": "watch_timeout_s",
    "ORCHARD_K8S_API_RETRIES": "api_retries",
    "ORCHARD_K8S_SNAPSHOT_DIR": "snapshot_dir",
}
"""Environment variable -> `KubernetesConfig` field, read by `from_environment`."""
API_URL_ENV = "ORCHARD_K8S_API_URL"
"""An API server URL to talk to without credentials (a `kubectl proxy`, or the test suite's emulator);
unset: the in-cluster service account, else the kubeconfig."""


def __getattr__(name: str) -> Any:
    # the init container runs `python -m orchard.env.backends.kubernetes.inject`, which needs none of the
    # client libraries: the backend (and with it the Kubernetes client) is imported on first use only
    if name == "KubernetesBackend":
        from orchard.env.backends.kubernetes.backend import KubernetesBackend

        return KubernetesBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def from_environment(sandboxes_dir: str | Path | None = None) -> KubernetesBackend:
    """A `KubernetesBackend` configured by the `ENVIRONMENT` variables (the `module:factory` the service's
    `--backend kubernetes` names). Pods hold the sandboxes; `sandboxes_dir`, the embedded service's, holds the
    snapshots (`.snapshots/` under it) unless `ORCHARD_K8S_SNAPSHOT_DIR` names another directory."""
    from orchard.env.backends.kubernetes.backend import KubernetesBackend, default_api_client

    with requires_extra("k8s"):
        from kubernetes import client

    fields = KubernetesConfig.__dataclass_fields__
    options: dict[str, object] = {}
    for variable, name in ENVIRONMENT.items():
        raw = os.environ.get(variable)
        if raw:
            kind = fields[name].type
            options[name] = float(raw) if kind == "float" else int(raw) if kind == "int" else raw
    if "snapshot_dir" not in options and sandboxes_dir is not None:
        options["snapshot_dir"] = os.path.join(os.fspath(sandboxes_dir), ".snapshots")
    url = os.environ.get(API_URL_ENV)
    api_client = client.ApiClient(client.Configuration(host=url)) if url else default_api_client()
    return KubernetesBackend(KubernetesConfig(**options), api_client=api_client)  # type: ignore[arg-type]
