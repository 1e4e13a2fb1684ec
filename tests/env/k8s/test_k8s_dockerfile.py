"""The orchestrator image's Dockerfile against what deploy/ expects of it. No Docker engine runs here (the image
is not built in CI): these check what can go wrong without one: a COPY of a file that is not there, an image
name, command, uid or extra that disagrees with the manifests."""

from __future__ import annotations

import configparser
import json
import re
import shlex
from pathlib import Path

import yaml

from orchard.env.backends.kubernetes.manifests import KubernetesConfig

REPO = Path(__file__).resolve().parents[3]


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(word.upper(), rest.strip()) for word, _, rest in (line.partition(" ") for line in lines)]


def deployment() -> dict:
    docs = yaml.safe_load_all((REPO / "deploy/base/orchestrator.yaml").read_text())
    return next(d for d in docs if d["kind"] == "Deployment")


def deploy_images() -> set[str]:
    found = set()
    for path in (REPO / "deploy").rglob("*.yaml"):
        found |= set(re.findall(r"image:\s*(orchard-env\S*)", path.read_text()))
        found |= set(re.findall(r"value:\s*(orchard-env:\S+)", path.read_text()))
    return found


def test_every_copy_source_exists():
    copies = [shlex.split(args) for op, args in instructions() if op == "COPY"]
    sources = [s for words in copies if not words[0].startswith("--from") for s in words[:-1]]
    assert sources  # the build stage copies the package and its metadata
    assert [s for s in sources if not (REPO / s).exists()] == []


def test_the_image_is_the_one_deploy_and_the_backend_name():
    (title,) = [re.search(r'org.opencontainers.image.title="([^"]+)"', args)[1]
                for op, args in instructions() if op == "LABEL"]
    # the Deployment, its agent image variable, the prepull DaemonSet and the backend's default all name it
    images = deploy_images() | {KubernetesConfig().agent_image}
    assert images == {"orchard-env:latest"} and {i.split(":")[0] for i in images} == {title}


def test_the_command_uid_and_extras_match_the_manifests():
    ops = instructions()
    (cmd,) = [json.loads(args) for op, args in ops if op == "CMD"]
    container = deployment()["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:5] == cmd[:5] == ["orchard", "env", "serve", "--backend", "kubernetes"]
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    assert "orchard = orchard.cli:main" in setup["options.entry_points"]["console_scripts"]
    extras = re.search(r'"\.\[([a-z0-9,]+)\]"', dict(ops)["RUN"])[1].split(",")
    assert set(extras) <= set(setup["options.extras_require"]) and {"env", "redis", "k8s"} <= set(extras)
    # `python` and `orchard` (the init container's and the orchestrator's commands) resolve to the venv
    assert "python -m venv /opt/orchard" in dict(ops)["RUN"]
    assert dict(ops)["ENV"].startswith("PATH=/opt/orchard/bin:")
    (user,) = [args for op, args in ops if op == "USER"]
    pod = deployment()["spec"]["template"]["spec"]["securityContext"]
    assert user == f"{pod['runAsUser']}:{pod['runAsGroup']}" == "65532:65532"  # non-root, as runAsNonRoot needs
