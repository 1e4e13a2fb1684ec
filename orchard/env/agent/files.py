"""File operations confined to a sandbox's workspace directory.

A path names a file inside the workspace: relative to its root (`src/a.py`), or absolute under the sandbox's
mount point (`/workspace/src/a.py` when the workspace is mounted at `/workspace`) or under one of its
`aliases` (where the sandbox's processes see the workspace without a mount: the process-group mode runs them
in the host directory itself, so `pwd` prints that, and a path it printed names the same file). Anything that would resolve
outside the root is refused with `PathEscapeError`: `..` past the root, an absolute path elsewhere, a symlink
whose target leaves the root, a symlink in a parent directory that does. Symlinks whose target stays inside
the workspace are followed.

The service may run as root while the sandbox's own processes can rewrite the workspace at any moment, so a
check-then-open is not enough (a directory swapped for a symlink between the two would let root write
anywhere). Resolution is therefore done in two steps: symlinks are resolved lexically against the root, then
the resulting symlink-free path is opened component by component with `openat(O_NOFOLLOW)`; if any component
has become a symlink in between, the open fails instead of following it. Only regular files are read or
written (a FIFO planted in the workspace cannot block the service: files are opened non-blocking and checked
with `fstat`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import PurePosixPath

from orchard.env.backends.base import FileInfo, PathEscapeError

_MAX_SYMLINKS = 40
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Workspace:
    """A workspace directory on the host and where the sandbox sees it.

    Args:
        root: host path of the workspace directory (must exist).
        mount: absolute path at which processes in the sandbox see `root` (default "/workspace").
        uid, gid: owner given to files and directories the service creates (None = leave as created).
        aliases: other absolute paths at which the sandbox's processes see `root` (the process-group mode:
            `root` itself and its real path), accepted like `mount`.
    """

    root: str
    mount: str = "/workspace"
    uid: int | None = None
    gid: int | None = None
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not os.path.isabs(self.root):
            raise ValueError(f"root must be an absolute path, got {self.root!r}")
        if not self.mount.startswith("/") or PurePosixPath(self.mount) == PurePosixPath("/"):
            raise ValueError(f"mount must be an absolute path other than '/', got {self.mount!r}")
        for alias in self.aliases:
            if not isinstance(alias, str) or not alias.startswith("/") or PurePosixPath(alias) == PurePosixPath("/"):
                raise ValueError(f"aliases must be absolute paths other than '/', got {alias!r}")

    # -- resolution -------------------------------------------------------------------------------------

    def components(self, path: str) -> list[str]:
        """The symlink-free components (relative to the root) that `path` resolves to.

        Raises:
            PathEscapeError: the path or a symlink on the way leaves the workspace.
            ValueError: `path` is not a string or contains a NUL byte.
        """
        if not isinstance(path, str):
            raise ValueError(f"path must be a string, got {type(path).__name__}")
        if "\x00" in path:
            raise ValueError(f"path must not contain NUL bytes, got {path!r}")
        pending = self._relative_parts(path)
        pending.reverse()  # a stack: the next component to resolve is at the end
        resolved: list[str] = []
        links = 0
        while pending:
            part = pending.pop()
            if part in ("", "."):
                continue
            if part == "..":
                if not resolved:
                    raise PathEscapeError(f"path {path!r} leaves the workspace")
                resolved.pop()
                continue
            host = os.path.join(self.root, *resolved, part)
            try:
                st = os.lstat(host)
            except FileNotFoundError:
                resolved.append(part)  # a not-yet-existing tail is fine (write creates it)
                continue
            except NotADirectoryError:
                resolved.append(part)
                continue
            if not stat.S_ISLNK(st.st_mode):
                resolved.append(part)
                continue
            links += 1
            if links > _MAX_SYMLINKS:
                raise PathEscapeError(f"path {path!r}: too many levels of symbolic links")
            target = os.readlink(host)
            target_parts = self._relative_parts(target) if target.startswith("/") else target.split("/")
            if target.startswith("/"):
                resolved = []
            pending.extend(reversed(target_parts))
        return resolved

    def _relative_parts(self, path: str) -> list[str]:
        if not path.startswith("/"):
            return path.split("/")
        p = PurePosixPath(os.path.normpath(path))
        for base in map(PurePosixPath, (self.mount, *self.aliases)):
            if p == base:
                return []
            if base in p.parents:
                return list(p.relative_to(base).parts)
        raise PathEscapeError(f"absolute path {path!r} is outside the workspace {self.mount!r}")

    def in_workspace(self, path: str) -> bool:
        """Whether the absolute `path` lies in the workspace (at its mount or an alias), symlinks aside."""
        p = PurePosixPath(os.path.normpath(path))
        return any(p == base or base in p.parents for base in map(PurePosixPath, (self.mount, *self.aliases)))

    def relative(self, path: str) -> str:
        """The workspace-relative form of `path` ("." for the root), symlinks resolved."""
        parts = self.components(path)
        return "/".join(parts) if parts else "."

    # -- secure open --------------------------------------------------------------------------------------

    def _open_dir(self, parts: list[str], *, create: bool = False) -> int:
        """A directory fd for root/parts, walking with O_NOFOLLOW; creates missing directories if asked."""
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            for part in parts:
                try:
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                    except FileExistsError:
                        pass
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                    self._chown_fd(nxt)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_symlink(part, fd):
                        raise PathEscapeError(f"{'/'.join(parts)!r}: {part!r} became a symlink") from e
                    raise
                os.close(fd)
                fd = nxt
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _chown_fd(self, fd: int) -> None:
        if self.uid is not None and self.gid is not None and os.geteuid() == 0:
            os.fchown(fd, self.uid, self.gid)

    # -- operations ---------------------------------------------------------------------------------------

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """The content of a regular file (its first `max_bytes` bytes if given).

        Raises:
            FileNotFoundError, IsADirectoryError: no such file / a directory.
            PathEscapeError: the path leaves the workspace.
            ValueError: not a regular file, or `max_bytes` negative.
        """
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
            raise ValueError(f"max_bytes must be a non-negative int or None, got {max_bytes!r}")
        parts = self.components(path)
        if not parts:
            raise IsADirectoryError(f"{path!r} is the workspace root")
        dfd = self._open_dir(parts[:-1])
        try:
            try:
                fd = os.open(
                    parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd
                )
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise PathEscapeError(f"{path!r} became a symlink while being opened") from e
                if e.errno == errno.ENXIO:  # a FIFO without reader, a socket
                    raise ValueError(f"{path!r} is not a regular file") from e
                raise
        finally:
            os.close(dfd)
        with os.fdopen(fd, "rb", buffering=0) as f:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(f"{path!r} is a directory")
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{path!r} is not a regular file (mode {oct(st.st_mode)})")
            os.set_blocking(fd, True)
            chunks: list[bytes] = []
            left = st.st_size if max_bytes is None else max_bytes
            # Read to EOF rather than trusting st_size alone: the file may grow while we read.
            while max_bytes is None or left > 0:
                chunk = f.read(1 << 20 if max_bytes is None else min(left, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                if max_bytes is not None:
                    left -= len(chunk)
            return b"".join(chunks)

    def write_file(self, path: str, data: bytes, mode: int | None = None) -> None:
        """Create or atomically replace a regular file, creating missing parent directories.

        Args:
            path: the file (see the module docstring).
            data: its new content.
            mode: permission bits (default 0o644 for a new file, the old mode when replacing one).

        Raises:
            PathEscapeError: the path leaves the workspace.
            IsADirectoryError: `path` names a directory.
            ValueError: `data` is not bytes, `mode` out of range, or an existing non-regular file.
        """
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ValueError(f"data must be bytes, got {type(data).__name__}")
        if mode is not None and (not isinstance(mode, int) or not 0 <= mode <= 0o7777):
            raise ValueError(f"mode must be an int in [0, 0o7777] or None, got {mode!r}")
        parts = self.components(path)
        if not parts:
            raise IsADirectoryError(f"{path!r} is the workspace root")
        name = parts[-1]
        dfd = self._open_dir(parts[:-1], create=True)
        try:
            try:
                old: os.stat_result | None = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                old = None
            if old is not None and stat.S_ISDIR(old.st_mode):
                raise IsADirectoryError(f"{path!r} is a directory")
            if old is not None and not (stat.S_ISREG(old.st_mode) or stat.S_ISLNK(old.st_mode)):
                raise ValueError(f"{path!r} is not a regular file (mode {oct(old.st_mode)})")
            if mode is None:
                mode = stat.S_IMODE(old.st_mode) if old is not None and stat.S_ISREG(old.st_mode) else 0o644
            self.replace_at(dfd, name, data, mode)
        finally:
            os.close(dfd)

    def replace_at(self, dfd: int, name: str, data: bytes | bytearray | memoryview, mode: int,
                   mtime_ns: int | None = None) -> None:
        """Write ``name`` in the directory ``dfd`` (opened by this workspace's O_NOFOLLOW walk) with ``data`` and
        ``mode``, owned by the sandbox's uid, as a new inode renamed over whatever file or link had the name."""
        # Written beside the target and renamed over it: readers never see half a file, and the old
        # inode (which might have other links) is never written through.
        tmp = f".orchard-{secrets.token_hex(6)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fchmod(fd, mode)
                self._chown_fd(fd)
                if mtime_ns is not None:
                    os.utime(fd, ns=(mtime_ns, mtime_ns))
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise

    def list_files(self, path: str = ".", recursive: bool = False) -> list[FileInfo]:
        """Entries under a directory (or the file itself), sorted by path; symlinks are listed, not followed.

        Paths in the result are relative to the workspace root. With `recursive`, subdirectories are walked
        (never through a symlink).
        """
        parts = self.components(path)
        try:
            dfd = self._open_dir(parts)
        except NotADirectoryError:
            dfd = -1
        if dfd < 0:  # a single file
            parent = self._open_dir(parts[:-1])
            try:
                st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
            finally:
                os.close(parent)
            return [_info("/".join(parts), st)]
        out: list[FileInfo] = []
        try:
            self._walk(dfd, "/".join(parts), recursive, out)
        finally:
            os.close(dfd)
        out.sort(key=lambda f: f.path)
        return out

    def _walk(self, dfd: int, prefix: str, recursive: bool, out: list[FileInfo]) -> None:
        for name in os.listdir(dfd):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            rel = f"{prefix}/{name}" if prefix else name
            out.append(_info(rel, st))
            if recursive and stat.S_ISDIR(st.st_mode):
                try:
                    sub = os.open(name, _DIR_FLAGS, dir_fd=dfd)
                except OSError:
                    continue  # replaced or removed meanwhile
                try:
                    self._walk(sub, rel, recursive, out)
                finally:
                    os.close(sub)

    def disk_usage(self) -> int:
        """Bytes allocated to the workspace (st_blocks * 512 summed over all entries, links not followed)."""
        total = 0
        stack = [os.open(self.root, _DIR_FLAGS)]
        while stack:
            dfd = stack.pop()
            try:
                for e in os.scandir(dfd):
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += st.st_blocks * 512
                    if stat.S_ISDIR(st.st_mode):
                        # by fd with O_NOFOLLOW: a directory swapped for a symlink is not walked into
                        with contextlib.suppress(OSError):
                            stack.append(os.open(e.name, _DIR_FLAGS, dir_fd=dfd))
            finally:
                os.close(dfd)
        return total


def _is_symlink(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _info(rel: str, st: os.stat_result) -> FileInfo:
    return FileInfo(
        path=rel,
        size=st.st_size,
        is_dir=stat.S_ISDIR(st.st_mode),
        mode=stat.S_IMODE(st.st_mode),
        mtime=st.st_mtime,
    )
