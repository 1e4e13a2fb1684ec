"""A tar unpacked by the file layer: the tree as ``tar -x`` leaves it, and every escape refused before a write."""

from __future__ import annotations

import gzip
import io
import os
import stat
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
from _archives import BAD, MTIME, TREE, TREE_BYTES, TREE_FILES, bad_archive, gnu_sparse, pax_sparse, tar_of

from orchard.env.agent.archive import extract_archive
from orchard.env.agent.files import Workspace
from orchard.env.backends.base import PathEscapeError


@pytest.fixture
def ws(tmp_path):
    """A workspace ``tmp_path/ws`` beside ``tmp_path/outside/secret.txt``."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("secret")
    (tmp_path / "ws").mkdir()
    return Workspace(str(tmp_path / "ws"))


def check_tree(root: str) -> None:
    """`TREE` unpacked at ``root``: contents, modes, times, the empty directories and the links."""
    for path, (data, mode) in TREE_FILES.items():
        full = os.path.join(root, path)
        assert Path(full).read_bytes() == data, path
        assert stat.S_IMODE(os.stat(full).st_mode) == mode, path
        assert os.stat(full).st_mtime == MTIME, path
    assert os.listdir(os.path.join(root, "empty")) == []
    assert stat.S_IMODE(os.stat(os.path.join(root, "empty")).st_mode) == 0o700
    assert os.listdir(os.path.join(root, ".git/refs/heads")) == []
    assert os.readlink(os.path.join(root, "pkg/core_link.py")) == "core.py"
    assert os.readlink(os.path.join(root, "pkg_link")) == "pkg"
    assert os.stat(os.path.join(root, "pkg/hard.py")).st_ino == os.stat(os.path.join(root, "pkg/core.py")).st_ino
    assert not [n for n in os.listdir(os.path.join(root, "pkg")) if n.startswith(".orchard-")]  # no temp file


@pytest.mark.parametrize("gz", [False, True])
def test_a_tree_unpacks_with_modes_times_empty_dirs_git_and_links(ws, gz):
    summary = extract_archive(ws, "/workspace/repo", tar_of(*TREE, gz=gz))
    check_tree(os.path.join(ws.root, "repo"))
    # 12 members written (the "./" entry is the destination itself); 87 file bytes (see TREE_BYTES)
    assert (summary.entries, summary.bytes) == (len(TREE) - 1, TREE_BYTES)


def test_existing_files_and_links_are_replaced_and_directories_kept(ws):
    extract_archive(ws, ".", tar_of(("a.txt", "file", (b"old", 0o600)), ("keep/x", "file", (b"x", 0o644))))
    os.symlink("keep", os.path.join(ws.root, "b"))
    extract_archive(ws, ".", tar_of(("a.txt", "file", (b"new", 0o644)), ("b", "file", (b"file now", 0o644)),
                                    ("keep", "dir", 0o755)))
    assert ws.read_file("a.txt") == b"new"
    assert not os.path.islink(os.path.join(ws.root, "b")) and ws.read_file("b") == b"file now"
    assert ws.read_file("keep/x") == b"x"


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_member_that_escapes_or_is_special_is_refused_and_nothing_is_written(ws, name):
    with pytest.raises(PathEscapeError):
        extract_archive(ws, "dest", bad_archive(name))
    assert os.listdir(ws.root) == []  # not even the destination, nor good.txt before the bad member
    assert (Path(ws.root).parent / "outside" / "secret.txt").read_text() == "secret"


@pytest.mark.parametrize("path", ["..", "/etc", "/workspace/../tmp"])
def test_a_destination_outside_the_workspace_is_refused(ws, path):
    with pytest.raises(PathEscapeError):
        extract_archive(ws, path, tar_of(("a.txt", "file", (b"x", 0o644))))


def test_a_directory_on_the_way_that_became_a_link_is_not_followed(ws, tmp_path):
    os.symlink(str(tmp_path / "outside"), os.path.join(ws.root, "pkg"))
    with pytest.raises(PathEscapeError):
        extract_archive(ws, ".", tar_of(("pkg/evil.txt", "file", (b"x", 0o644))))
    assert sorted(os.listdir(tmp_path / "outside")) == ["secret.txt"]


def test_the_unpacked_size_is_capped_plain_and_gzipped(ws):
    archive = tar_of(("big", "file", (bytes(10_000), 0o644)))
    # one 10 000-byte file: 512 (header) + 10 240 (its data in 512-byte blocks) + 1 024 (the end) = 11 776,
    # padded to tarfile's 10 240-byte records: 20 480
    assert len(archive) == 20_480
    bomb = gzip.compress(archive)  # zeros: some 100 bytes that unpack to 20 480
    assert len(bomb) < 200
    for data in (archive, bomb):
        with pytest.raises(ValueError, match="max_bytes=20479"):
            extract_archive(ws, ".", data, max_bytes=20_479)
    assert os.listdir(ws.root) == []
    assert extract_archive(ws, ".", bomb, max_bytes=20_480).bytes == 10_000


@pytest.mark.parametrize("data", [b"", b"not a tar at all" * 64, b"\x1f\x8bnot gzip"])
def test_data_that_is_no_tar_is_a_value_error(ws, data):
    with pytest.raises(ValueError, match="data is not"):
        extract_archive(ws, ".", data)


def test_invalid_arguments(ws):
    with pytest.raises(ValueError, match="data must be bytes"):
        extract_archive(ws, ".", "text")  # type: ignore[arg-type]
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="max_bytes"):
            extract_archive(ws, ".", tar_of(), max_bytes=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("build", [gnu_sparse, pax_sparse], ids=["gnu_type_S", "pax_gnu_sparse_1_0"])
def test_a_sparse_member_is_refused_before_its_holes_are_expanded(ws, build):
    archive = build("big", b"data", 1 << 20)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        good, big = tar.getmembers()
    # 4 stored bytes, but tarfile reports (and would read out) 1 MiB = 1 048 576 bytes, 64 x the cap of
    # 16 KiB = 16 384 bytes that the whole tar (10 240 bytes: tarfile pads to its records) stays under
    assert (good.name, big.name, big.size, big.isreg(), len(archive)) == ("good.txt", "big", 1 << 20, True, 10_240)
    with pytest.raises(ValueError, match="'big' is a sparse file"):
        extract_archive(ws, "dest", archive, max_bytes=16 * 1024)
    assert os.listdir(ws.root) == []  # not even good.txt, before it


def test_a_member_time_beyond_2262_is_clamped_and_one_that_is_no_number_refused(ws):
    far = tarfile.TarInfo("far.txt")
    far.pax_headers = {"mtime": "1e30"}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(far)
    extract_archive(ws, ".", buffer.getvalue())
    # (2**63 - 1) // 10**9 = 9 223 372 036 s (2262-04-11), the latest second a signed 64-bit ns count holds
    assert os.stat(os.path.join(ws.root, "far.txt")).st_mtime_ns == 9_223_372_036 * 10**9
    for value in ("inf", "nan"):
        bad = tarfile.TarInfo(f"{value}.txt")
        bad.pax_headers = {"mtime": value}
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
            tar.addfile(bad)
        with pytest.raises(ValueError, match="no number"):
            extract_archive(ws, ".", buffer.getvalue())
    assert os.listdir(ws.root) == ["far.txt"]


_FEW_FDS = textwrap.dedent("""
    import os, resource, sys
    from orchard.env.agent.archive import extract_archive
    from orchard.env.agent.files import Workspace
    data = sys.stdin.buffer.read()
    fds = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    summary = extract_archive(Workspace(sys.argv[1]), ".", data)
    print(summary.entries, summary.bytes, len(os.listdir("/proc/self/fd")) - fds)
""")


def test_more_directories_than_the_fd_limit_unpack(tmp_path):
    flat = [(f"d{i}", "dir", 0o755) for i in range(1000)] + [(f"d{i}/f", "file", (b"x", 0o644)) for i in range(1000)]
    deep = [("/".join(["n"] * depth), "dir", 0o500 if depth == 150 else 0o755) for depth in range(1, 301)]
    members = (*flat, *deep, ("/".join(["n"] * 300) + "/leaf", "file", (b"leaf", 0o644)))
    (tmp_path / "ws").mkdir()
    # 256 fds for the whole process: one open per directory (1 000 side by side, or 300 nested) would not fit
    run = subprocess.run([sys.executable, "-c", _FEW_FDS, str(tmp_path / "ws")], input=tar_of(*members),
                         capture_output=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    # 1 000 + 1 000 + 300 + 1 = 2 301 members, 1 000 x 1 + 4 = 1 004 file bytes, and no fd left open
    assert run.stdout.split() == [b"2301", b"1004", b"0"]
    assert (tmp_path / "ws" / "d999" / "f").read_bytes() == b"x"
    chain = os.path.join(tmp_path, "ws", *["n"] * 300)
    assert Path(chain, "leaf").read_bytes() == b"leaf"
    # the modes came last and deepest first: the read-only (0o500) directory at depth 150 still got its members
    assert stat.S_IMODE(os.stat(os.path.join(tmp_path, "ws", *["n"] * 150)).st_mode) == 0o500
    os.chmod(os.path.join(tmp_path, "ws", *["n"] * 150), 0o755)  # so that pytest can remove tmp_path
