"""File operations confined to a workspace: escapes refused, symlinks inside followed, no blocking on FIFOs."""

from __future__ import annotations

import os
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.env.agent.files import Workspace
from orchard.env.backends.base import PathEscapeError


@pytest.fixture
def tree(tmp_path):
    """tmp_path/outside/secret.txt next to tmp_path/ws (the workspace) holding a few files and links."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    (ws / "sub" / "f.txt").write_text("inside")
    os.symlink("sub", ws / "in_link")  # stays inside
    os.symlink(str(outside), ws / "out_dir")  # absolute, leaves
    os.symlink("../outside/secret.txt", ws / "out_file")  # relative, leaves
    os.symlink("../..", ws / "sub" / "up")  # in a parent directory, leaves
    return Workspace(str(ws)), tmp_path


def test_write_read_roundtrip_creates_parents_and_sets_mode(tree):
    ws, _ = tree
    ws.write_file("a/b/c.bin", b"\x00\x01payload", mode=0o600)
    assert ws.read_file("a/b/c.bin") == b"\x00\x01payload"
    assert ws.read_file("/workspace/a/b/c.bin") == b"\x00\x01payload"  # the sandbox's absolute form
    st_ = os.stat(os.path.join(ws.root, "a/b/c.bin"))
    assert stat.S_IMODE(st_.st_mode) == 0o600
    ws.write_file("a/b/c.bin", b"short")  # replacing truncates
    assert ws.read_file("a/b/c.bin") == b"short"
    assert ws.read_file("a/b/c.bin", max_bytes=3) == b"sho"
    assert ws.read_file("a/b/c.bin", max_bytes=0) == b""


def test_dotdot_that_stays_inside_is_fine(tree):
    ws, _ = tree
    assert ws.read_file("sub/../sub/./f.txt") == b"inside"
    assert ws.relative("sub/..") == "."


@pytest.mark.parametrize("path", ["..", "../outside/secret.txt", "sub/../../outside/secret.txt", "/etc/passwd",
                                  "/workspace/../etc/passwd", "/workspacex/f"])  # fmt: skip
def test_escapes_are_refused(tree, path):
    ws, _ = tree
    with pytest.raises(PathEscapeError):
        ws.read_file(path)
    with pytest.raises(PathEscapeError):
        ws.write_file(path, b"x")


@pytest.mark.parametrize("path", ["out_dir/secret.txt", "out_file", "sub/up/outside/secret.txt", "out_dir"])
def test_symlinks_pointing_out_are_refused(tree, path):
    ws, tmp = tree
    with pytest.raises(PathEscapeError):
        ws.read_file(path)
    with pytest.raises(PathEscapeError):
        ws.write_file(path, b"overwritten")
    with pytest.raises(PathEscapeError):
        ws.list_files(path)
    assert (tmp / "outside" / "secret.txt").read_text() == "secret"


def test_symlink_inside_is_followed(tree):
    ws, _ = tree
    assert ws.read_file("in_link/f.txt") == b"inside"
    ws.write_file("in_link/new.txt", b"via link")
    # in_link -> sub: the write lands in the link's target directory, not in a new "in_link" directory
    with open(os.path.join(ws.root, "sub", "new.txt"), "rb") as f:
        assert f.read() == b"via link"
    assert os.path.islink(os.path.join(ws.root, "in_link")) and ws.read_file("sub/new.txt") == b"via link"


def test_a_component_that_became_a_symlink_is_not_followed(tree):
    """The race the two-step open guards against: resolution saw a directory, the open finds a symlink."""
    ws, _ = tree
    with pytest.raises(PathEscapeError):
        ws._open_dir(["out_dir"])  # as if "out_dir" had been a directory during resolution


def test_fifo_is_refused_without_blocking(tree):
    ws, _ = tree
    os.mkfifo(os.path.join(ws.root, "pipe"))
    with pytest.raises(ValueError, match="not a regular file"):
        ws.read_file("pipe")
    with pytest.raises(ValueError, match="not a regular file"):
        ws.write_file("pipe", b"x")


def test_list_files_sorted_recursive_and_never_through_links(tree):
    ws, _ = tree
    top = [f.path for f in ws.list_files(".")]
    assert top == sorted(["sub", "in_link", "out_dir", "out_file"])
    deep = {f.path: f for f in ws.list_files(".", recursive=True)}
    assert set(deep) == {"sub", "sub/f.txt", "sub/up", "in_link", "out_dir", "out_file"}
    assert deep["sub"].is_dir and not deep["in_link"].is_dir  # the link itself, not its target
    assert deep["sub/f.txt"].size == len("inside")
    assert [f.path for f in ws.list_files("sub/f.txt")] == ["sub/f.txt"]
    assert [f.path for f in ws.list_files("in_link")] == ["sub/f.txt", "sub/up"]


def test_missing_and_directory_errors(tree):
    ws, _ = tree
    with pytest.raises(FileNotFoundError):
        ws.read_file("nope.txt")
    with pytest.raises(IsADirectoryError):
        ws.read_file("sub")
    with pytest.raises(IsADirectoryError):
        ws.write_file(".", b"x")
    with pytest.raises(NotADirectoryError):
        ws.write_file("sub/f.txt/child", b"x")  # a regular file in the middle is not an escape


def test_invalid_arguments(tree):
    ws, _ = tree
    with pytest.raises(ValueError, match="max_bytes"):
        ws.read_file("sub/f.txt", max_bytes=-1)
    with pytest.raises(ValueError, match="data"):
        ws.write_file("x", "text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode"):
        ws.write_file("x", b"", mode=0o10000)
    with pytest.raises(ValueError, match="NUL"):
        ws.read_file("a\x00b")
    with pytest.raises(ValueError, match="mount"):
        Workspace(ws.root, mount="/")
    with pytest.raises(ValueError, match="root"):
        Workspace("relative/dir")


def test_disk_usage_counts_allocated_bytes(tree):
    ws, _ = tree
    before = ws.disk_usage()
    ws.write_file("big.bin", os.urandom(200_000))
    # 200,000 bytes occupy at least 200,000 / 512 = 390.6 -> 391 blocks of 512 bytes
    assert ws.disk_usage() - before >= 391 * 512


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(["..", ".", "sub", "in_link", "up", "x", "out_dir", ""]), max_size=7))
def test_resolution_never_leaves_the_root(tmp_path_factory, parts):
    """Property: any path either raises PathEscapeError or resolves to components that, joined under the
    root, stay under it with no '..' and no symlink leaving it."""
    base = tmp_path_factory.getbasetemp() / "prop"
    if not base.exists():
        (base / "ws" / "sub").mkdir(parents=True)
        os.symlink("sub", base / "ws" / "in_link")
        os.symlink("../..", base / "ws" / "sub" / "up")
        os.symlink("/", base / "ws" / "out_dir")
    ws = Workspace(str(base / "ws"))
    path = "/".join(parts)
    try:
        comps = ws.components(path)
    except PathEscapeError:
        return
    assert ".." not in comps and "" not in comps
    real_root = os.path.realpath(ws.root)
    real = os.path.realpath(os.path.join(ws.root, *comps))
    assert real == real_root or real.startswith(real_root + os.sep)


def test_replacing_keeps_mode_never_writes_through_links_and_leaves_no_temp_file(tree):
    ws, tmp = tree
    ws.write_file("sub/x.sh", b"v1", mode=0o750)
    ws.write_file("sub/x.sh", b"v2")  # mode None keeps the old mode
    assert stat.S_IMODE(os.stat(os.path.join(ws.root, "sub/x.sh")).st_mode) == 0o750
    os.link(tmp / "outside" / "secret.txt", os.path.join(ws.root, "hard.txt"))  # planted by someone else
    ws.write_file("hard.txt", b"replaced")
    assert ws.read_file("hard.txt") == b"replaced"
    assert (tmp / "outside" / "secret.txt").read_text() == "secret"  # the other link is untouched
    assert not [n for n in os.listdir(ws.root) + os.listdir(os.path.join(ws.root, "sub")) if ".tmp" in n]
