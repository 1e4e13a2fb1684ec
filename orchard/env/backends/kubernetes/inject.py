"""The agent's files, and the init container's command that puts them into a sandbox pod.

``python -m orchard.env.backends.kubernetes.inject DIR`` (run by the init container, from the orchestrator's own
image) writes ``DIR/agent/``: the pod agent (`pod_agent`) with the agent modules it uses, all standard library,
and a ``__main__.py``, so the sandbox's container runs ``python3 DIR/agent`` with its own Python (3.10 or later)
and needs nothing of ours. A directory rather than a zipapp: the agent reads its box program (`box.py`) as a
file, which a zip archive would hide.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

AGENT_DIR = "agent"

_ORCHARD = Path(__file__).resolve().parents[3]
_MODULES = (
    "env/agent/__init__.py",
    "env/agent/archive.py",
    "env/agent/box.py",
    "env/agent/box_build.py",
    "env/agent/box_client.py",
    "env/agent/core.py",
    "env/agent/files.py",
    "env/agent/isolation.py",
    "env/agent/process.py",
    "env/agent/pty.py",
    "env/agent/reaper.py",
    "env/backends/base.py",
    "env/backends/kubernetes/pod_agent.py",
)
"""The modules the pod agent imports, relative to the `orchard` package (none imports a third-party package)."""
_STUB = '"""A part of orchard packed into the sandbox agent\'s zipapp."""\n'
_STUBS = ("__init__.py", "env/__init__.py", "env/backends/__init__.py", "env/backends/kubernetes/__init__.py")
"""Packages whose real `__init__` imports what the sandbox's image lacks (httpx, the Kubernetes client)."""
_MAIN = "import sys\n\nfrom orchard.env.backends.kubernetes.pod_agent import main\n\nsys.exit(main())\n"


def agent_files() -> dict[str, bytes]:
    """The agent's files by path relative to the agent directory (``python3 agent --root /workspace``)."""
    files = {f"orchard/{name}": _STUB.encode() for name in _STUBS}
    for name in _MODULES:
        files[f"orchard/{name}"] = (_ORCHARD / name).read_bytes()
    files["__main__.py"] = _MAIN.encode()
    return files


def write_agent(directory: str | os.PathLike[str]) -> str:
    """Write `agent_files()` under ``directory/agent`` (read-only, replaced whole); returns that path."""
    if not os.path.isdir(directory):
        raise ValueError(f"directory must be an existing directory, got {os.fspath(directory)!r}")
    path = os.path.join(directory, AGENT_DIR)
    tmp = tempfile.mkdtemp(prefix=".agent-", dir=directory)
    for name, data in agent_files().items():
        target = os.path.join(tmp, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(data)
        os.chmod(target, 0o444)
    os.chmod(tmp, 0o755)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m orchard.env.backends.kubernetes.inject DIR", file=sys.stderr)
        return 2
    print(f"wrote {write_agent(args[0])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
