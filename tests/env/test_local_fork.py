"""Snapshots and forks of the local backend: the workspace copy is isolated from its original under every kind of
write (the property a hard-link farm lacks), keeps links unfollowed, leaves nothing when it fails; forks and
snapshots outlive their parent; a restart finds snapshots and sweeps half-made ones."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

import pytest
from _box import requires

from orchard.env.agent.isolation import probe_bubblewrap
from orchard.env.backends.base import (
    BackendError,
    ExecRequest,
    SandboxNotFoundError,
    SandboxSpec,
    SnapshotBackend,
    SnapshotNotFoundError,
)
from orchard.env.backends.local import DEFAULT_UID_RANGE, LocalBackend
from orchard.env.backends.workspace_copy import copy_tree

IS_ROOT = os.geteuid() == 0
needs_bwrap = requires(probe_bubblewrap((DEFAULT_UID_RANGE[0],) * 2 if IS_ROOT else None), "bubblewrap")
MODES = [pytest.param(True, marks=needs_bwrap, id="bubblewrap"), pytest.param(False, id="process-group")]
SPEC = SandboxSpec(network=True)  # the process-group fallback refuses a blocked network it cannot enforce


@pytest.fixture
def root_dir():
    # under the system temp directory (world-searchable): sandbox uids must reach their workspaces
    d = tempfile.mkdtemp(prefix="orchard-fork-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _tree(top: str) -> None:
    os.makedirs(os.path.join(top, "pkg", "sub"))
    with open(os.path.join(top, "pkg", "a.txt"), "w") as f:
        f.write("alpha\n")
    with open(os.path.join(top, "pkg", "run.sh"), "w") as f:
        f.write("#!/bin/sh\necho hi\n")
    os.chmod(os.path.join(top, "pkg", "run.sh"), 0o755)
    with open(os.path.join(top, "db.bin"), "wb") as f:
        f.write(bytes(range(256)) * 16)
    os.link(os.path.join(top, "pkg", "a.txt"), os.path.join(top, "pkg", "sub", "a-link.txt"))
    os.symlink("/etc/hostname", os.path.join(top, "host-link"))
    os.symlink("pkg/a.txt", os.path.join(top, "rel-link"))


def _state(top: str) -> dict[str, tuple]:
    """Every entry's kind, mode bits, size and content (links: their target, never followed)."""
    out = {}
    for here, dirs, files in os.walk(top):
        for name in dirs + files:
            path = os.path.join(here, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                body: object = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    body = f.read()
            else:
                body = None
            out[os.path.relpath(path, top)] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), body)
    return out


def _write_every_way(top: str) -> None:
    """The writes a hard-link farm would leak into every tree sharing the inode."""
    with open(os.path.join(top, "pkg", "a.txt"), "a") as f:  # append (>>)
        f.write("appended\n")
    with open(os.path.join(top, "db.bin"), "r+b") as f:  # in place, as sqlite3 or mmap would
        f.seek(100)
        f.write(b"XXXX")
    os.truncate(os.path.join(top, "pkg", "run.sh"), 3)
    os.chmod(os.path.join(top, "pkg", "run.sh"), 0o600)
    os.rename(os.path.join(top, "pkg", "sub"), os.path.join(top, "pkg", "moved"))
    os.unlink(os.path.join(top, "rel-link"))


@pytest.mark.parametrize("written", ["original", "copy"])
async def test_copy_is_isolated_from_its_original_under_every_kind_of_write(tmp_path, written):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    _tree(src)
    await copy_tree(src, dst)
    before = _state(src)
    assert _state(dst) == before  # a faithful copy: modes, contents, links as links
    assert os.readlink(os.path.join(dst, "host-link")) == "/etc/hostname"  # not followed out of the tree
    for name in ("pkg/a.txt", "db.bin", "pkg/run.sh"):
        assert os.lstat(os.path.join(src, name)).st_ino != os.lstat(os.path.join(dst, name)).st_ino, name
    # a hard link inside the tree stays one inside the copy, never back to the original
    assert os.lstat(os.path.join(dst, "pkg", "a.txt")).st_ino == os.lstat(
        os.path.join(dst, "pkg", "sub", "a-link.txt")).st_ino
    changed, untouched = (src, dst) if written == "original" else (dst, src)
    _write_every_way(changed)
    assert _state(untouched) == before
    assert _state(changed) != before
    with open(os.path.join(changed, "pkg", "moved", "a-link.txt")) as f:
        assert f.read() == "alpha\nappended\n"  # the link inside the written tree saw its own append


async def test_copy_refuses_an_existing_target_and_leaves_nothing_when_it_fails(tmp_path):
    src = str(tmp_path / "src")
    _tree(src)
    os.mkdir(tmp_path / "taken")
    with pytest.raises(FileExistsError):
        await copy_tree(src, str(tmp_path / "taken"))
    with pytest.raises(FileNotFoundError):
        await copy_tree(str(tmp_path / "none"), str(tmp_path / "x"))
    # cp fails (the target's parent is a file): an error naming cp, and no partial copy
    (tmp_path / "file").write_text("")
    with pytest.raises(BackendError, match="cp exited"):
        await copy_tree(src, str(tmp_path / "file" / "dst"))
    assert sorted(os.listdir(tmp_path)) == ["file", "src", "taken"]


async def _sh(backend: LocalBackend, sandbox_id: str, command: str) -> str:
    result = await backend.exec(sandbox_id, ExecRequest(command=["bash", "-c", command], timeout_s=30))
    assert result.exit_code == 0, (command, result.stderr)
    return result.stdout.decode()


@pytest.mark.parametrize("use_bwrap", MODES)
async def test_forks_and_snapshots_are_isolated_and_outlive_their_parent(root_dir, use_bwrap):
    backend = LocalBackend(root_dir, use_bwrap=use_bwrap, allow_weak_isolation=True)
    try:
        assert isinstance(backend, SnapshotBackend)
        await backend.create("parent", SPEC)
        await _sh(backend, "parent", "mkdir -p repo && echo v1 > repo/f && printf x > counter")
        await backend.snapshot("parent", "snap")
        assert await backend.list_snapshot_ids() == ["snap"]
        await backend.fork("child-a", SPEC, snapshot_id="snap")
        await backend.fork("child-b", SPEC, parent_id="parent")
        # each writes its own value into the same file, in place and by append
        for sid in ("parent", "child-a", "child-b"):
            await _sh(backend, sid, f"echo {sid} >> repo/f && printf {sid} > counter")
        for sid in ("parent", "child-a", "child-b"):
            assert await backend.read_file(sid, "repo/f") == f"v1\n{sid}\n".encode()
            assert await backend.read_file(sid, "counter") == sid.encode()
        if IS_ROOT:  # each fork's files are its own uid's, so it can write what its parent made
            uids = {sid: os.stat(os.path.join(root_dir, sid, "workspace", "repo", "f")).st_uid
                    for sid in ("parent", "child-a", "child-b")}
            assert len(set(uids.values())) == 3, uids
        await backend.delete("parent")
        assert await backend.read_file("child-b", "repo/f") == b"v1\nchild-b\n"
        await backend.fork("child-c", SPEC, snapshot_id="snap")  # the snapshot is still the parent's old state
        assert await backend.read_file("child-c", "repo/f") == b"v1\n"
        assert await backend.read_file("child-c", "counter") == b"x"
        await backend.delete_snapshot("snap")
        await backend.delete_snapshot("snap")  # idempotent
        assert await backend.list_snapshot_ids() == []
        assert await backend.read_file("child-c", "repo/f") == b"v1\n"  # a fork does not need its snapshot
    finally:
        await backend.close()


async def test_missing_sources_make_nothing_and_a_restart_finds_snapshots(root_dir):
    backend = LocalBackend(root_dir, use_bwrap=False, allow_weak_isolation=True)
    try:
        with pytest.raises(SnapshotNotFoundError):
            await backend.fork("f1", SPEC, snapshot_id="none")
        with pytest.raises(SandboxNotFoundError):
            await backend.fork("f2", SPEC, parent_id="none")
        with pytest.raises(SandboxNotFoundError):
            await backend.snapshot("none", "s0")
        with pytest.raises(ValueError, match="exactly one"):
            await backend.fork("f3", SPEC)
        assert await backend.list_ids() == [] and await backend.list_snapshot_ids() == []
        await backend.create("a", SPEC)
        await backend.write_file("a", "x.txt", b"kept")
        await backend.snapshot("a", "s1")
        with pytest.raises(ValueError, match="exists"):
            await backend.snapshot("a", "s1")
    finally:
        await backend.close()
    os.mkdir(os.path.join(root_dir, ".snapshots", ".part-s2-dead"))  # a copy a killed service left half-made
    again = LocalBackend(root_dir, use_bwrap=False, allow_weak_isolation=True)
    try:
        assert await again.list_snapshot_ids() == ["s1"]
        assert os.listdir(os.path.join(root_dir, ".snapshots")) == ["s1"]
        await again.fork("b", SPEC, snapshot_id="s1")
        assert await again.read_file("b", "x.txt") == b"kept"
        assert again.health()["workspace_copies"] in ("reflink (copy-on-write)", "full copy (no reflinks here)")
    finally:
        await again.close()
