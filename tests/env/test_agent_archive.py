"""A tar unpacked by the file layer: the tree as ``tar -x`` leaves it, and every escape refused before a write."""

from __future__ import annotations

import gzip
import os
import stat
from pathlib import Path

import pytest
from _archives import BAD, MTIME, TREE, TREE_BYTES, TREE_FILES, bad_archive, tar_of

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
