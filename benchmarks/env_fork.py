"""How long does a sandbox fork take on a 10 MB / 1,000-file workspace (issue 36: target <= 50 ms per fork)?

In one run, on one workspace (1,000 files of 10 KiB of random bytes in 50 directories, 10.24 MB): the baseline, a
plain recursive copy in Python (`shutil.copytree`, which copies each file with `sendfile` and its metadata with
`copystat`); the copy the local backend makes (`cp -a --reflink=auto`, `orchard.env.backends.workspace_copy`);
`LocalBackend.snapshot`; `LocalBackend.fork` from a snapshot and from a live sandbox (a whole sandbox: its
directory, uid, user files, the copy, owner changes when root, its metadata); and a fork through the REST service
with the sync client (`Snapshot.fork`, an in-process service on loopback). Each row is timed `--n` times
(fresh targets, removed between runs outside the timing) and reported as p50 / p90 with the ratio of its p50 to the
baseline's. The file system of `--root-parent` decides whether copies are reflinks (copy-on-write: btrfs, XFS)
or full copies (ext4, tmpfs); the script says which.

    python benchmarks/env_fork.py                          # 30 forks of each kind, under the temp dir
    python benchmarks/env_fork.py --n 50 --root-parent /mnt/xfs
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from env_latency import machine, percentiles

from orchard.env import SandboxClient
from orchard.env.backends.base import SandboxSpec
from orchard.env.backends.local import LocalBackend
from orchard.env.backends.workspace_copy import copy_tree
from orchard.env.embedded import serve

FILES, FILE_BYTES, DIRS = 1000, 10 * 1024, 50


def make_workspace(top: str) -> int:
    for i in range(FILES):
        d = os.path.join(top, f"pkg{i % DIRS:02d}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"m{i:04d}.py"), "wb") as f:
            f.write(os.urandom(FILE_BYTES))
    return FILES * FILE_BYTES


def file_system(path: str) -> str:
    try:
        out = subprocess.run(["df", "--output=fstype", path], capture_output=True, text=True, check=True).stdout
        return out.split()[-1]
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def timed_sync(n: int, run: Callable[[int], object], undo: Callable[[int], object]) -> list[float]:
    lat = []
    for i in range(n):
        t = time.perf_counter()
        run(i)
        lat.append(time.perf_counter() - t)
        undo(i)
    return lat


async def timed_async(n: int, run: Callable[[int], Awaitable[object]],
                      undo: Callable[[int], Awaitable[object]]) -> list[float]:
    lat = []
    for i in range(n):
        t = time.perf_counter()
        await run(i)
        lat.append(time.perf_counter() - t)
        await undo(i)
    return lat


async def backend_rows(root: str, workspace: str, n: int) -> tuple[dict[str, list[float]], bool]:
    backend = LocalBackend(os.path.join(root, "sandboxes"), use_bwrap=None, allow_weak_isolation=True)
    spec = SandboxSpec(network=True)
    rows: dict[str, list[float]] = {}
    try:
        await backend.create("parent", spec)
        # the parent's workspace holds the benchmark's files, as if a task had unpacked them
        ws = os.path.join(backend.root_dir, "parent", "workspace")
        os.rmdir(ws)
        shutil.copytree(workspace, ws, symlinks=True)
        if backend.is_root:
            uid = os.stat(os.path.join(backend.root_dir, "parent", "home", "sandbox")).st_uid
            subprocess.run(["chown", "-R", f"{uid}:{uid}", ws], check=True)
        await backend.snapshot("parent", "base")

        async def delete_snapshot(i: int) -> None:
            await backend.delete_snapshot(f"s{i}")

        async def delete_fork(i: int) -> None:
            await backend.delete(f"f{i}")

        rows["LocalBackend.snapshot"] = await timed_async(n, lambda i: backend.snapshot("parent", f"s{i}"),
                                                          delete_snapshot)
        rows["LocalBackend.fork, from a snapshot"] = await timed_async(
            n, lambda i: backend.fork(f"f{i}", spec, snapshot_id="base"), delete_fork)
        rows["LocalBackend.fork, from a live sandbox"] = await timed_async(
            n, lambda i: backend.fork(f"f{i}", spec, parent_id="parent"), delete_fork)
        return rows, backend.reflinks
    finally:
        await backend.close()


def service_row(root: str, workspace: str, n: int) -> list[float]:
    with serve(os.path.join(root, "service"), allow_weak_isolation=True) as svc, \
            SandboxClient(svc.url, svc.api_key) as client, client.create(block_network=False) as sb:
        sb.upload_archive("/workspace", _tar(workspace))
        with sb.snapshot() as snap:
            forks = []
            lat = timed_sync(n, lambda i: forks.append(snap.fork()), lambda i: forks.pop().delete())
    return lat


def _tar(directory: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(directory, arcname=".")
    return buf.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=30, help="timed repetitions of each row")
    p.add_argument("--root-parent", default=None, help="where workspaces and sandboxes live (default: temp dir)")
    p.add_argument("--no-service", action="store_true", help="skip the row through the REST service")
    args = p.parse_args()
    if args.n < 1:
        p.error(f"--n must be >= 1, got {args.n}")
    root = tempfile.mkdtemp(prefix="orchard-bench-fork-", dir=args.root_parent)
    os.chmod(root, 0o711)
    try:
        workspace = os.path.join(root, "workspace")
        size = make_workspace(workspace)
        rows: dict[str, list[float]] = {}
        rows["shutil.copytree (baseline)"] = timed_sync(
            args.n, lambda i: shutil.copytree(workspace, os.path.join(root, f"c{i}"), symlinks=True),
            lambda i: shutil.rmtree(os.path.join(root, f"c{i}")))
        rows["cp -a --reflink=auto (copy_tree)"] = timed_sync(
            args.n, lambda i: asyncio.run(copy_tree(workspace, os.path.join(root, f"r{i}"))),
            lambda i: shutil.rmtree(os.path.join(root, f"r{i}")))
        backend, reflinks = asyncio.run(backend_rows(root, workspace, args.n))
        rows.update(backend)
        if not args.no_service:
            rows["REST fork of a snapshot (sync client)"] = service_row(root, workspace, args.n)
        info = machine()
        print(f"# env_fork: {FILES} files, {size / 1e6:.2f} MB; file system {file_system(root)}, "
              f"{'reflinks (copy-on-write)' if reflinks else 'no reflinks: full copies'}; n = {args.n} each")
        print(f"# machine: {info['machine']}; python {info['python']}; commit {info['commit']}; "
              f"running as {'root (forks get uids of their own)' if os.geteuid() == 0 else 'a user'}")
        base = percentiles(rows["shutil.copytree (baseline)"])["p50"]
        print(f"{'what':<42}{'p50 ms':>9}{'p90 ms':>9}{'p50 / baseline':>16}{'<= 50 ms':>10}")
        for name, lat in rows.items():
            q = percentiles(lat)
            print(f"{name:<42}{q['p50'] * 1e3:>9.1f}{q['p90'] * 1e3:>9.1f}{q['p50'] / base:>16.2f}"
                  f"{'yes' if q['p50'] <= 0.05 else 'no':>10}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
