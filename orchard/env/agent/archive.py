"""A tar (or gzipped tar) unpacked into a sandbox's workspace by the file layer, without a process in the sandbox.

What ``tar -x`` in the sandbox would do (directories, regular files with their permission bits and times,
symbolic and hard links), done by the service through `Workspace`'s O_NOFOLLOW directory walk and as the
sandbox's uid, so putting a repository in place costs no process start. The whole archive is checked before
anything is written: a member that would land or point outside the destination directory is refused with
`PathEscapeError` (the file API's error for an escape) and nothing is unpacked. Refused:

- a name that is absolute or has a ``..`` component;
- a name under a symbolic link of the same archive (a later member written through an earlier link);
- a symbolic link whose target is absolute, or climbs (``..``, leading only) above the destination, or has a
  ``..`` after a named component (``a/../b``: ``a`` may itself be a link, so only a lexical climb from the
  link's own directory, which is a real directory of the archive, is sure to stay inside; our reading of
  "pointing out", stricter than the kernel's);
- a hard link to anything but a regular file earlier in the same archive;
- device files, FIFOs and other special members.

The decompressed tar stream is capped (`MAX_ARCHIVE_BYTES` by default; headers count, so many empty members
cannot stand in for one large file), and so are the regular members' declared sizes together. Sparse members
(GNU type ``S``, or PAX ``GNU.sparse.*``) are refused with `ValueError`: tarfile expands their holes with zeros,
so a few KiB of tar would declare (and allocate) any size past the cap. A member's data is written from the
unpacked stream itself, one member at a time, never copied out of it first. A member's time outside the signed
64-bit nanosecond range (years 1677 to 2262) is clamped into it, one that is no number (PAX ``nan``, ``inf``)
refused (`ValueError`). Existing files and links of the same name are replaced, existing directories kept (as
``tar -x`` does); a directory already in the workspace on a member's way that is a symbolic link is not followed
(`PathEscapeError`), even when it points inside. At most `_OPEN_DIRS` directory fds (plus the destination's) are
open at a time, however many directories the archive has or however deep they go.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import io
import math
import os
import stat
import tarfile
import zlib
from dataclasses import dataclass

from orchard.env.agent.files import Workspace, _is_symlink
from orchard.env.backends.base import PathEscapeError

MAX_ARCHIVE_BYTES = 1 << 30
"""The default cap on the unpacked tar stream, bytes (1 GiB, the pod agent's request cap)."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_DIRS = 32
"""Directory fds kept open along the current member's path: one per directory of the archive would run the
service (every sandbox's) out of fds on an archive of many directories, well under the byte cap."""
_MAX_MTIME_S = (2**63 - 1) // 10**9
"""The latest member time that nanoseconds in a signed 64 bits hold (2262-04-11), seconds; its negative the earliest."""


@dataclass(frozen=True)
class ArchiveSummary:
    """What `extract_archive` wrote."""

    entries: int
    """Members written (directories, files and links; the destination's own ``.`` entry not counted)."""
    bytes: int
    """Bytes of regular files written (a hard link writes none)."""


def _parts(name: str, what: str) -> tuple[str, ...]:
    if name.startswith("/"):
        raise PathEscapeError(f"archive {what} {name!r} is an absolute path")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise PathEscapeError(f"archive {what} {name!r} leaves the destination")
    return parts


def _check_symlink(parts: tuple[str, ...], target: str) -> None:
    if not target or target.startswith("/"):
        raise PathEscapeError(f"archive member {'/'.join(parts)!r}: symlink target {target!r} is absolute or empty")
    steps = [p for p in target.split("/") if p not in ("", ".")]
    climb = 0
    while climb < len(steps) and steps[climb] == "..":
        climb += 1
    if ".." in steps[climb:] or climb > len(parts) - 1:
        raise PathEscapeError(f"archive member {'/'.join(parts)!r}: symlink target {target!r} leaves the destination")


def _unpack(data: bytes, max_bytes: int) -> bytes:
    if data[:2] != b"\x1f\x8b":
        raw = bytes(data)
    else:
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(data)) as stream:
                raw = stream.read(max_bytes + 1)
        except (OSError, EOFError, zlib.error) as exc:
            raise ValueError(f"data is not a valid gzip stream: {exc}") from exc
    if len(raw) > max_bytes:
        raise ValueError(f"the archive unpacks to more than max_bytes={max_bytes} bytes")
    return raw


def extract_archive(workspace: Workspace, path: str, data: bytes, *,
                    max_bytes: int = MAX_ARCHIVE_BYTES) -> ArchiveSummary:
    """Unpack the tar (or gzipped tar) ``data`` into the directory ``path`` of ``workspace`` (made if missing).

    Args:
        workspace: the sandbox's workspace.
        path: the destination directory (workspace-relative, or absolute under its mount), as the file API.
        data: a tar archive, gzipped or not.
        max_bytes: cap on the decompressed tar stream. Default `MAX_ARCHIVE_BYTES` (1 GiB).

    Returns:
        How many members and file bytes were written.

    Raises:
        PathEscapeError: ``path`` leaves the workspace, or a member would land or point outside it (see the
            module); nothing is written.
        ValueError: ``data`` is not bytes, not a tar, unpacks (or its files add up) beyond ``max_bytes``, or has
            a sparse member or a time that is no number; ``max_bytes`` < 1.
        NotADirectoryError, IsADirectoryError: a member's directory is a file here, or a file member's name is
            a directory here.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ValueError(f"data must be bytes, got {type(data).__name__}")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be an int >= 1, got {max_bytes!r}")
    raw = _unpack(bytes(data), max_bytes)
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
            members = tar.getmembers()
    except tarfile.TarError as exc:
        raise ValueError(f"data is not a tar archive: {exc}") from exc
    plan = _plan(members, len(raw), max_bytes)
    dest = workspace.components(path)
    return _write(workspace, dest, plan, memoryview(raw))


_Plan = list[tuple[tarfile.TarInfo, tuple[str, ...]]]


def _plan(members: list[tarfile.TarInfo], stream_bytes: int, max_bytes: int) -> _Plan:
    """Every member to write with its path under the destination; raises before anything is written.

    ``stream_bytes`` is the length of the tar stream the members' data offsets point into."""
    plan: _Plan = []
    links: set[tuple[str, ...]] = set()
    regular: set[tuple[str, ...]] = set()
    declared = 0
    for member in members:
        if member.sparse is not None or member.type == tarfile.GNUTYPE_SPARSE or any(
                key.startswith("GNU.sparse.") for key in member.pax_headers):
            raise ValueError(f"archive member {member.name!r} is a sparse file, which the upload does not take")
        if member.isreg():
            declared += member.size
            if declared > max_bytes:
                raise ValueError(f"the archive's files add up to more than max_bytes={max_bytes} bytes")
            if member.offset_data + member.size > stream_bytes:
                raise ValueError(f"archive member {member.name!r}: its data runs past the end of the archive")
        if not math.isfinite(member.mtime):
            raise ValueError(f"archive member {member.name!r} has the time {member.mtime!r}, which is no number")
        parts = _parts(member.name, "member")
        if any(parts[:i] in links for i in range(1, len(parts))):
            raise PathEscapeError(f"archive member {member.name!r} lies under a symbolic link of the archive")
        if not (member.isdir() or member.isreg() or member.issym() or member.islnk()):
            raise PathEscapeError(f"archive member {member.name!r} is a device file, FIFO or other special file")
        if not parts:
            if not member.isdir():
                raise ValueError(f"archive member {member.name!r} names the destination itself but is no directory")
            continue
        if member.issym():
            _check_symlink(parts, member.linkname)
        if member.islnk() and _parts(member.linkname, "hard link target") not in regular:
            raise PathEscapeError(f"archive member {member.name!r}: hard link to {member.linkname!r}, "
                                  "which is no regular file earlier in the archive")
        links.discard(parts)  # a later member of the same name replaces the earlier one
        regular.discard(parts)
        if member.issym():
            links.add(parts)
        elif not member.isdir():
            regular.add(parts)
        plan.append((member, parts))
    return plan


def _mtime_ns(mtime: float) -> int:
    """A member's time in nanoseconds, clamped to what a signed 64 bits hold (as os.utime takes it)."""
    return int(max(-_MAX_MTIME_S, min(_MAX_MTIME_S, mtime))) * 10**9


class _Dirs:
    """Directory fds under the destination, reached by O_NOFOLLOW walks from its fd.

    Only the fds of the current directory and its nearest ancestors stay open (at most `_OPEN_DIRS`): tar
    members come mostly in tree order, so the next member's directory is usually here or one step away, and a
    jump elsewhere walks again from the deepest open ancestor (from the destination at worst)."""

    def __init__(self, workspace: Workspace, root: int) -> None:
        self.workspace, self.root = workspace, root
        self.path: tuple[str, ...] = ()
        self.fds: list[int | None] = []  # fds[i] opens path[:i + 1]; the open ones are the last few

    def get(self, parts: tuple[str, ...], *, create: bool = True) -> int:
        """The fd of the directory ``parts`` (owned here: valid until the next call), made if missing and asked."""
        common = 0
        while common < min(len(self.path), len(parts)) and self.path[common] == parts[common]:
            common += 1
        self._close(common)
        start = common
        while start and self.fds[start - 1] is None:
            start -= 1
        fd = self.fds[start - 1] if start else self.root
        del self.fds[start:]
        try:
            for i in range(start, len(parts)):
                fd = self._open(fd, parts[: i + 1], create)
                self.fds.append(fd)
                shallow = self.fds[i - _OPEN_DIRS] if i >= _OPEN_DIRS else None
                if shallow is not None:
                    os.close(shallow)
                    self.fds[i - _OPEN_DIRS] = None
        finally:
            self.path = parts[: len(self.fds)]
        return fd

    def _open(self, parent: int, parts: tuple[str, ...], create: bool) -> int:
        name = parts[-1]
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o755, dir_fd=parent)
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
            self.workspace._chown_fd(fd)
            return fd
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_symlink(name, parent):
                raise PathEscapeError(f"{'/'.join(parts)!r} is a symbolic link in the workspace") from exc
            raise

    def _close(self, keep: int) -> None:
        """Close the fds deeper than the first ``keep`` directories of the current path."""
        for fd in self.fds[keep:]:
            if fd is not None:
                os.close(fd)
        del self.fds[keep:]
        self.path = self.path[:keep]

    def close(self) -> None:
        self._close(0)
        os.close(self.root)


def _write(workspace: Workspace, dest: list[str], plan: _Plan, stream: memoryview) -> ArchiveSummary:
    dirs = _Dirs(workspace, workspace._open_dir(dest, create=True))
    modes: dict[tuple[str, ...], int] = {}

    def clear(parent: int, name: str, what: str) -> None:
        """Remove a file or link in the way of a link (a directory stays: refused)."""
        try:
            old = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(old.st_mode):
            raise IsADirectoryError(f"{what!r} is a directory in the workspace")
        os.unlink(name, dir_fd=parent)

    written = 0
    try:
        for member, parts in plan:
            if member.isdir():
                dirs.get(parts)
                modes[parts] = member.mode & 0o777
                continue
            if member.isreg():
                data = stream[member.offset_data : member.offset_data + member.size]
                workspace.replace_at(dirs.get(parts[:-1]), parts[-1], data, member.mode & 0o777,
                                     _mtime_ns(member.mtime))
                written += len(data)
            elif member.issym():
                parent, name = dirs.get(parts[:-1]), parts[-1]
                clear(parent, name, member.name)
                os.symlink(member.linkname, name, dir_fd=parent)
                if workspace.uid is not None and workspace.gid is not None and os.geteuid() == 0:
                    os.chown(name, workspace.uid, workspace.gid, dir_fd=parent, follow_symlinks=False)
            else:
                source = _parts(member.linkname, "hard link target")
                source_dir = os.dup(dirs.get(source[:-1]))  # the next get may close it
                try:
                    parent, name = dirs.get(parts[:-1]), parts[-1]
                    clear(parent, name, member.name)
                    os.link(source[-1], name, src_dir_fd=source_dir, dst_dir_fd=parent, follow_symlinks=False)
                finally:
                    os.close(source_dir)
        # Last, as tar does: a read-only directory still got its members. Deepest first, so that a directory
        # made unsearchable (0o600) is not on the way to one whose mode is still to come. Each is walked to
        # again from the destination without following links, so a directory the sandbox swapped for a link
        # meanwhile is refused, never chmodded through.
        for parts in sorted(modes, key=len, reverse=True):
            os.fchmod(dirs.get(parts, create=False), modes[parts])
    finally:
        dirs.close()
    return ArchiveSummary(len(plan), written)
