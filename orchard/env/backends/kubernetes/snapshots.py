"""Snapshots and forks on the Kubernetes backend: a tar stream out of the source pod, into the fork's pod.

Mechanism (docs/env-kubernetes.md, "Snapshots and forks"):

- snapshot: the orchestrator execs ``tar -cf - .`` in the sandbox's workspace through the pod's agent (the same
  exec route as every command, so the pod needs nothing new: GNU or busybox tar, present in the usual images)
  and writes the stream to ``<snapshot_dir>/<snapshot id>.tar`` on its own disk (under a hidden name, renamed
  into place once complete);
- fork: the fork's pod is created as any sandbox's (its own Secret, NetworkPolicy, token, empty workspace volume),
  then ``tar -xpf -`` runs in it with the tar on its stdin: the snapshot's file, or, for a fork of a live sandbox,
  a stream taken from the parent just before (one exec in each pod, nothing kept).

Isolation: the fork's workspace is an emptyDir of its own pod, filled with a copy; nothing is shared with its
source at any layer. The tar is made and unpacked inside the pods, as their own user, so it crosses no boundary:
a crafted archive could only write where the fork's own commands can. Its cost is a full copy through the
orchestrator (no copy-on-write): bytes of the workspace, twice over the pod network.

What stays untested here (the test suite runs the emulated API server and a simulated kubelet whose pods are local
processes): a real node's emptyDir on its disk, tar in a real image, the pod network's throughput for large
workspaces, and several replicas, which must share `snapshot_dir` (a ReadWriteMany volume mounted in every
orchestrator pod) to fork from each other's snapshots: a replica that does not find the file answers 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import time

from orchard.env.backends.base import Backend, BackendError, ExecRequest, SandboxSpec, SnapshotNotFoundError

MAX_WORKSPACE_BYTES = 1 << 30
"""The largest tar a snapshot or fork carries (the pod agent's request cap): beyond it, a `BackendError`."""
TAR_TIMEOUT_S = 600.0
_TAR_CREATE = ["tar", "-cf", "-", "."]
_TAR_EXTRACT = ["tar", "-xpf", "-"]


_SNAPSHOT_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
STALE_PART_S = 2 * TAR_TIMEOUT_S
"""A half-written snapshot file older than this was left by a replica that died while writing it."""


def _path(directory: str, snapshot_id: str) -> str:
    if not isinstance(snapshot_id, str) or not _SNAPSHOT_ID_RE.match(snapshot_id):
        raise ValueError(f"snapshot_id must match {_SNAPSHOT_ID_RE.pattern}, got {snapshot_id!r}")
    return os.path.join(directory, f"{snapshot_id}.tar")


def _checked(directory: str) -> str:
    if not directory:
        raise BackendError("snapshots need a directory on the orchestrator: set KubernetesConfig.snapshot_dir "
                           "(ORCHARD_K8S_SNAPSHOT_DIR)")
    return directory


async def workspace_tar(backend: Backend, sandbox_id: str) -> bytes:
    """The sandbox's workspace as a tar, made by tar in its pod."""
    result = await backend.exec(sandbox_id, ExecRequest(command=_TAR_CREATE, timeout_s=TAR_TIMEOUT_S,
                                                        max_output_bytes=MAX_WORKSPACE_BYTES))
    if result.stdout_truncated:
        raise BackendError(f"sandbox {sandbox_id}: its workspace's tar is larger than {MAX_WORKSPACE_BYTES} bytes")
    if result.exit_code != 0:
        said = result.stderr.decode(errors="replace").strip()[:500]
        raise BackendError(f"sandbox {sandbox_id}: tar of the workspace exited {result.exit_code}: {said}")
    return result.stdout


async def restore(backend: Backend, sandbox_id: str, tar: bytes) -> None:
    """Unpack `tar` into the (new, empty) workspace of the sandbox, by tar in its pod."""
    result = await backend.exec(sandbox_id, ExecRequest(command=_TAR_EXTRACT, stdin=tar, timeout_s=TAR_TIMEOUT_S))
    if result.exit_code != 0:
        said = result.stderr.decode(errors="replace").strip()[:500]
        raise BackendError(f"sandbox {sandbox_id}: unpacking the copied workspace exited {result.exit_code}: {said}")


async def take(backend: Backend, directory: str, sandbox_id: str, snapshot_id: str) -> None:
    """Write a tar of the sandbox's workspace to `directory` (`KubernetesConfig.snapshot_dir`)."""
    directory = _checked(directory)
    target = _path(directory, snapshot_id)
    if os.path.lexists(target):
        raise ValueError(f"snapshot {snapshot_id!r} exists")
    tar = await workspace_tar(backend, sandbox_id)
    os.makedirs(directory, 0o700, exist_ok=True)
    part = os.path.join(directory, f".{snapshot_id}.part-{secrets.token_hex(4)}")

    def write() -> None:
        try:
            with open(part, "xb") as f:
                f.write(tar)
                f.flush()
                os.fsync(f.fileno())
            os.rename(part, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(part)
            raise

    await asyncio.to_thread(write)


async def fork(backend: Backend, directory: str, sandbox_id: str, spec: SandboxSpec, *, parent_id: str | None,
               snapshot_id: str | None) -> None:
    """Create the sandbox with `backend.create`, then unpack the parent's workspace or the snapshot into it."""
    if (parent_id is None) == (snapshot_id is None):
        raise ValueError("fork needs exactly one of parent_id and snapshot_id")
    if parent_id is not None:
        tar = await workspace_tar(backend, parent_id)
    else:
        try:
            tar = await asyncio.to_thread(_read, _path(_checked(directory), snapshot_id))  # type: ignore[arg-type]
        except FileNotFoundError:
            raise SnapshotNotFoundError(f"no snapshot {snapshot_id!r} in {directory}") from None
    await backend.create(sandbox_id, spec)
    await restore(backend, sandbox_id, tar)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


async def delete(directory: str, snapshot_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        await asyncio.to_thread(os.unlink, _path(_checked(directory), snapshot_id))


def list_ids(directory: str) -> list[str]:
    """The complete snapshots in `directory`; half-written files of dead replicas are removed on the way."""
    if not directory:
        return []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    now = time.time()
    for name in names:
        if name.startswith(".") and ".part-" in name:
            with contextlib.suppress(OSError):
                if now - os.stat(os.path.join(directory, name)).st_mtime > STALE_PART_S:
                    os.unlink(os.path.join(directory, name))
    return sorted(n.removesuffix(".tar") for n in names if n.endswith(".tar") and not n.startswith("."))
