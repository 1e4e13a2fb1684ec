"""The service's API contract on the Kubernetes backend: real HTTP to the service, the official client to the
emulated API server, real agent processes in the simulated pods (one service for the module)."""

from __future__ import annotations

import base64
import os
import uuid

import httpx
import pytest
from _archives import TREE, TREE_BYTES, bad_archive, tar_of
from conftest import NAMESPACE

from orchard.env import ConflictError, NotFoundError, PathError
from orchard.env.backends.kubernetes.manifests import object_name


def raw(service, method, path, **kwargs):
    return httpx.request(method, service.url + path, headers={"X-API-Key": service.api_key}, timeout=30, **kwargs)


def test_lifecycle_makes_and_removes_the_pod_its_secret_and_its_network_policy(service, client, cluster):
    sid = "life-" + uuid.uuid4().hex[:6]
    sb = client.create(sandbox_id=sid, cpu="500m", memory="256Mi")
    name = object_name(sid)
    assert sb.info["status"] == "ready" and sb.info["isolation"] == "pod"
    assert {name} <= set(cluster.objects("pods")) & set(cluster.objects("secrets")) & set(
        cluster.objects("networkpolicies"))
    pod = cluster.api.get("pods", NAMESPACE, name)
    main = pod["spec"]["containers"][0]
    # 500m = 0.5 cores -> "500m"; 256Mi -> 256 MiB; requests equal limits (Guaranteed QoS)
    assert main["resources"] == {"requests": {"cpu": "500m", "memory": "256Mi"},
                                 "limits": {"cpu": "500m", "memory": "256Mi"}}
    assert sb.resources()["cpu"] == 0.5 and sb.resources()["memory_mb"] == 256
    assert raw(service, "GET", "/resources").json()["backend_health"]["pods"] >= 1
    with pytest.raises(ConflictError):
        client.create(sandbox_id=sid)
    sb.delete()
    assert raw(service, "GET", f"/sandboxes/{sid}").status_code == 404
    assert name not in cluster.objects("pods") + cluster.objects("secrets") + cluster.objects("networkpolicies")
    sb.delete()  # deleting twice is not an error


def test_exec_results_cwd_env_and_stdin(sb):
    r = sb.exec("echo out; echo err >&2; exit 3")
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("failed", 3, "out\n", "err\n")
    ok = sb.exec(["python3", "-c", "print(6 * 7)"])
    assert ok.ok and ok.stdout == "42\n"
    sb.exec("mkdir -p sub")
    r = sb.exec('pwd; echo "$GREETING"; cat', cwd="/workspace/sub", env={"GREETING": "hi there"}, stdin="fed\n")
    lines = r.stdout.splitlines()
    assert lines[0].endswith("/workspace/sub") and lines[1:] == ["hi there", "fed"]
    slow = sb.exec("echo started; sleep 30", timeout=0.5)
    assert slow.timed_out and slow.exit_code == 124 and slow.stdout == "started\n"


def test_the_sandbox_env_reaches_commands_and_the_agent_token_does_not(client):
    with client.create(env={"TASK": "t-17"}) as sb:
        out = sb.exec("echo $TASK; env").stdout
        assert out.splitlines()[0] == "t-17"
        assert "ORCHARD_AGENT_TOKEN" not in out


def test_upload_download_list_roundtrip(sb):
    payload = os.urandom(4099)
    assert sb.upload("/workspace/dir/blob.bin", payload) == 4099
    assert sb.download("/workspace/dir/blob.bin") == payload
    assert sb.download("dir/blob.bin", max_bytes=10) == payload[:10]
    sb.upload("/workspace/run.sh", "echo from-file\n", mode=0o755)
    assert sb.exec("./run.sh").stdout == "from-file\n"
    entries = {e.name: e for e in sb.list_files("/workspace")}
    assert entries["dir"].is_dir and entries["run.sh"].size == 15  # len("echo from-file\n") = 15
    assert any(e.path.endswith("dir/blob.bin") for e in sb.list_files("/workspace", recursive=True))
    with pytest.raises(NotFoundError):
        sb.download("/workspace/missing.txt")


def test_upload_archive_through_the_pod_agent(sb):
    assert sb.upload_archive("/workspace/repo", tar_of(*TREE, gz=True)) == TREE_BYTES
    listing = sb.exec("cd repo && stat -c '%n %a' run.sh empty .git/objects/ab/cdef && readlink pkg_link && ls -A empty")
    assert listing.stdout == "run.sh 755\nempty 700\n.git/objects/ab/cdef 444\npkg\n"
    for name in ("dotdot", "symlink_climbs_out", "hardlink_out", "device"):
        with pytest.raises(PathError):
            sb.upload_archive("/workspace", bad_archive(name))
    assert sb.exec("ls -A").stdout == "repo\n"  # the simulated pod runs in its workspace, not at /workspace


@pytest.mark.parametrize("path", ["../outside.txt", "/etc/passwd", "link/passwd"])
def test_path_escapes_are_refused_with_400(service, sb, path):
    sb.exec("ln -sfn /etc link")
    with pytest.raises(PathError):
        sb.download(path)
    r = raw(service, "POST", f"/sandboxes/{sb.sandbox_id}/files",
            json={"path": path, "content": base64.b64encode(b"x").decode()})
    assert r.status_code == 400


def test_apply_patch(sb):
    sb.upload("/workspace/hello.txt", "line1\n")
    patch = "--- a/hello.txt\n+++ b/hello.txt\n@@ -1 +1,2 @@\n line1\n+line2\n"
    assert sb.apply_patch(patch).success
    assert sb.download("hello.txt") == b"line1\nline2\n"


def test_the_agent_wants_the_sandbox_token_not_the_api_key(service, sb, cluster):
    pod = cluster.api.get("pods", NAMESPACE, object_name(sb.sandbox_id))
    agent = f"http://{pod['status']['podIP']}:8765"
    body = {"command": "true"}
    assert httpx.get(agent + "/health").status_code == 200  # the readiness probe needs no token
    assert httpx.post(agent + "/exec", json=body).status_code == 401
    wrong = {"Authorization": f"Bearer {service.api_key}"}
    assert httpx.post(agent + "/exec", json=body, headers=wrong).status_code == 401
    secret = cluster.api.get("secrets", NAMESPACE, object_name(sb.sandbox_id))
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert token != service.api_key
    right = {"Authorization": f"Bearer {token}"}
    assert httpx.post(agent + "/exec", json=body, headers=right).json()["exit_code"] == 0


def test_pod_security_and_network_policy(client, cluster):
    with client.create() as closed, client.create(block_network=False) as open_:
        pod = cluster.api.get("pods", NAMESPACE, object_name(closed.sandbox_id))
        spec = pod["spec"]
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
        for c in spec["containers"] + spec["initContainers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"} and sc["runAsNonRoot"] is True
        closed_policy = cluster.api.get("networkpolicies", NAMESPACE, object_name(closed.sandbox_id))["spec"]
        open_policy = cluster.api.get("networkpolicies", NAMESPACE, object_name(open_.sandbox_id))["spec"]
        assert closed_policy["policyTypes"] == ["Ingress", "Egress"] and closed_policy["egress"] == []
        assert open_policy["egress"] == [{}]  # asked for the network: egress anywhere
        (ingress,) = closed_policy["ingress"]
        assert ingress["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "orchard-env"}}}]
        assert closed_policy["podSelector"]["matchLabels"]["orchard.dev/sandbox"] == closed.sandbox_id
        assert open_.info["block_network"] is False and closed.info["block_network"] is True
