"""deploy/ and the backend's own manifests, validated offline against the Kubernetes schemas (strict mode:
an unknown or misspelled field fails, which the API server would otherwise drop silently)."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from orchard.env.backends.base import SandboxSpec
from orchard.env.backends.kubernetes.manifests import (
    KubernetesConfig,
    network_policy_manifest,
    pod_manifest,
    secret_manifest,
)

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
KUBERNETES_VERSION = "1.37.0"
"""The newest version kubernetes-validate 1.37 ships schemas for."""
KUSTOMIZATIONS = sorted(DEPLOY.rglob("kustomization.yaml"))
MANIFESTS = sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml")


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_deploy_manifest_is_valid_in_strict_mode(path):
    docs = documents(path)
    assert docs
    for doc in docs:
        if path.name.endswith("-patch.yaml"):  # a strategic-merge patch is a partial object: check its kind only
            assert doc["kind"] == "Deployment"
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_every_manifest_is_in_a_kustomization_and_every_reference_exists():
    referenced = set()
    for k in KUSTOMIZATIONS:
        (spec,) = documents(k)
        for key in ("resources", "components"):
            for entry in spec.get(key, []):
                target = (k.parent / entry).resolve()
                assert target.exists(), f"{k.relative_to(DEPLOY)} names {entry}, which does not exist"
                referenced.add(target)
        referenced |= {(k.parent / p["path"]).resolve() for p in spec.get("patches", [])}
    assert set(MANIFESTS) - referenced == set()


def test_the_role_grants_what_the_backend_uses_and_no_more():
    (role,) = [d for d in documents(DEPLOY / "base" / "rbac.yaml") if d["kind"] == "Role"]
    rules = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert rules == {("", "pods"): {"get", "list", "watch", "create", "delete"},
                     ("", "secrets"): {"get", "list", "create", "delete"},
                     ("networking.k8s.io", "networkpolicies"): {"get", "list", "create", "delete"}}


@pytest.mark.parametrize("spec", [SandboxSpec(), SandboxSpec(image="ubuntu:24.04", network=True, cpu=0.25,
                                                              memory_mb=300, env={"A": "1"}, workdir="/srv/app")])
def test_the_backends_manifests_are_valid_in_strict_mode(spec):
    config = KubernetesConfig()
    for doc in (pod_manifest(config, "Run_1", spec), secret_manifest(config, "Run_1", "t0ken"),
                network_policy_manifest(config, "Run_1", spec.network)):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
