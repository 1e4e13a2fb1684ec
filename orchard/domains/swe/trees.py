"""The trees built on this host for a SWE sandbox: before the episode the base (the repository at its base commit
with a git repository of one commit: `base_tree`, cached), after it the tree the tests run in (the base with the
agent's patch and ``test_patch``: `scored_archive`; `scored_tree` is its plain reference and its fallback).

What it costs per episode, for a repository of a few MB (the issue that asked for this measured 33-43 ms per
look-up for ~1 MB, and ~360 ms for the scored tree under load): the base's cache is keyed without reading the
repository's files (its ``files`` hashed in memory, or its snapshot directory's file metadata: one ``lstat`` per
file), and the scoring reuses the base the sandbox was prepared with (`orchard.domains.swe.sandbox`), so the
repository is read and committed once per snapshot, not per call. The scored tree is not unpacked and packed
again whole: it is the base's archive, already compressed, followed by the files the two patches touch
(`scored_archive`); only a patch that removes a file of the base, or turns a directory into a file, takes the
whole tree (`scored_tree`), since an archive cannot remove what an earlier member wrote.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from orchard.domains.swe.instances import SWEInstance
from orchard.domains.swe.patches import patch_write_bound, patched_paths
from orchard.rollout.harness import EnvironmentFailure

GIT_ENV = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "orchard",
           "GIT_AUTHOR_EMAIL": "orchard@localhost", "GIT_COMMITTER_NAME": "orchard",
           "GIT_COMMITTER_EMAIL": "orchard@localhost", "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
           "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z"}
"""Our git commands read no configuration the agent could have written (``~/.gitconfig``: aliases, hooks), and
the base commit's identity and date are fixed, so its hash depends on the files only."""

EXCLUDE = "__pycache__/\n*.pyc\n.pytest_cache/\n"
"""Never part of the agent's patch (``.git/info/exclude``, not a file of the repository)."""

MAX_PATCH_WRITE_BYTES = 256 << 20
"""A patch that may write more when applied (`patch_write_bound`) is not applied on this host and not resolved:
``git diff --binary`` deflates, so 16 MiB of diff can stand for many GiB of files (a file of zeros). A quarter of
the archive upload's 1 GiB cap on the scored tree, so the base, the patch and ``test_patch`` fit under it; no
repository fix writes 256 MiB."""

BASE_CACHE_BYTES = 256 << 20
"""`base_tree` keeps the most recently used bases up to this many compressed bytes in all."""

RECENT_CHANGE_S = 2.0
"""A snapshot directory with a file changed (its time or its inode's change time) less than this many seconds
before `base_tree` looked at it is built but not cached. A file's times come from a clock that ticks in steps
(milliseconds), so a file rewritten within the same step as the look-up, at the same size, would keep all its
metadata; a file whose change time was already older than this when the key was taken cannot change again
without a later change time (which no process can set back), so the key of a cached build never matches a
changed snapshot. (Our rule, as git's "racily clean" index entries; a network file system whose clock runs
seconds behind this host's would need a larger value.)"""

_TAR_END = gzip.compress(bytes(2 * tarfile.BLOCKSIZE), mtime=0)
"""The end-of-archive blocks, as a gzip member of their own: appended to a `BaseTree`'s body (a gzip stream may
hold several members, which gzip, Python and the archive upload read as one)."""


@contextlib.contextmanager
def _gzipped_tar(buffer: io.BytesIO, level: int) -> Iterator[tarfile.TarFile]:
    """A tar written gzipped into ``buffer`` with a fixed gzip time (tarfile's ``w:gz`` stamps the current second
    in the header, so the same files would give other bytes)."""
    with gzip.GzipFile(fileobj=buffer, mode="wb", compresslevel=level, mtime=0) as stream, \
            tarfile.open(fileobj=stream, mode="w") as tar:
        yield tar


def _snapshot_entries(root: Path) -> list[tuple[str, os.stat_result]]:
    """The files and symbolic links of a snapshot directory, its top-level ``.git`` left out, as (path relative
    to ``root``, ``lstat``), sorted by path components; a link to a directory is a link (never followed)."""
    found: list[tuple[tuple[str, ...], os.stat_result]] = []

    def walk(parts: tuple[str, ...], directory: str) -> None:
        with os.scandir(directory) as entries:
            for entry in entries:
                here = (*parts, entry.name)
                if here == (".git",):
                    continue
                info = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(info.st_mode):
                    walk(here, entry.path)
                elif stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode):
                    found.append((here, info))

    walk((), str(root))
    found.sort(key=lambda item: item[0])
    return [("/".join(parts), info) for parts, info in found]


def _snapshot_dir(instance: SWEInstance) -> Path:
    root = Path(instance.repo_dir or "")
    if not root.is_dir():
        raise ValueError(f"instance.repo_dir {instance.repo_dir!r} is not a directory")
    return root


def repository_archive(instance: SWEInstance) -> bytes:
    """The repository at the base commit as a gzipped tar (sorted, fixed times; a ``repo_dir``'s ``.git`` left
    out, symlinks kept as links)."""
    if not isinstance(instance, SWEInstance):
        raise ValueError(f"instance must be a SWEInstance, got {type(instance).__name__}")
    buffer = io.BytesIO()
    with _gzipped_tar(buffer, 6) as tar:
        if instance.files is not None:
            for path in sorted(instance.files):
                data = instance.files[path].encode()
                info = tarfile.TarInfo(path)
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
        else:
            root = _snapshot_dir(instance)
            for rel, _ in _snapshot_entries(root):
                path = root / rel
                info = tar.gettarinfo(str(path), rel)
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = 0
                if info.isreg():
                    with path.open("rb") as handle:
                        tar.addfile(info, handle)
                else:
                    tar.addfile(info)
    return buffer.getvalue()


def _base_key(instance: SWEInstance) -> tuple[tuple[str, ...], bool]:
    """What identifies the instance's repository without reading a file of a snapshot directory, and whether a
    build under it may be cached.

    ``files``: their SHA-256 (in memory). A snapshot directory: its real path and a SHA-256 of every file's and
    link's path, type and mode, size, modification and change times and inode, as `repository_archive` would
    take them; not cacheable when one of them changed within `RECENT_CHANGE_S`."""
    if instance.files is not None:
        digest = hashlib.sha256()
        for path in sorted(instance.files):
            for part in (path.encode(), instance.files[path].encode()):
                digest.update(len(part).to_bytes(8, "little"))
                digest.update(part)
        return ("files", digest.hexdigest()), True
    root = _snapshot_dir(instance)
    horizon = time.time_ns() - int(RECENT_CHANGE_S * 1e9)
    digest, settled = hashlib.sha256(), True
    for rel, info in _snapshot_entries(root):
        # NUL ends every field: no path holds one, so no two listings give the same bytes
        digest.update(f"{rel}\0{info.st_mode}\0{info.st_size}\0{info.st_mtime_ns}\0{info.st_ctime_ns}\0"
                      f"{info.st_dev}\0{info.st_ino}\0".encode("utf-8", "surrogateescape"))
        settled = settled and max(info.st_mtime_ns, info.st_ctime_ns) < horizon
    return ("dir", str(root.resolve()), digest.hexdigest()), settled


@dataclass(frozen=True, eq=False)
class BaseTree:
    """The repository at its base commit with its git repository of one commit, built on this host."""

    body: bytes
    """The gzipped tar's members without the end-of-archive blocks, so that more members may follow
    (`scored_archive`); `archive` is the whole archive. Each member is a gzip member of its own (`spans`), so
    that one file is taken out without inflating the others (a gzip stream of many members reads as one).
    """
    commit: str
    """The base commit's hash."""
    kinds: Mapping[str, str]
    """Every member's path -> ``"dir"``, ``"file"`` or ``"link"``."""
    sizes: Mapping[str, int]
    """Every regular file's path -> its size, bytes."""
    spans: Mapping[str, tuple[int, int]]
    """Every member's path -> where its gzip member starts and ends in ``body``."""

    @property
    def archive(self) -> bytes:
        """The base as a gzipped tar, ``.git`` included (what `prepare_sandbox` uploads)."""
        return self.body + _TAR_END


_BASES: OrderedDict[tuple[str, ...], BaseTree] = OrderedDict()
"""`base_tree`'s cache: `_base_key` -> the build, most recently used last."""
_BASES_LOCK = threading.Lock()


def _build_base(plain: bytes) -> BaseTree:
    """Unpack ``plain`` (a `repository_archive`) here, commit it as the sandbox used to, and tar the result."""
    with tempfile.TemporaryDirectory(prefix="orchard-swe-base-") as tmp:
        work = Path(tmp) / "repo"
        work.mkdir()
        with tarfile.open(fileobj=io.BytesIO(plain), mode="r:gz") as tar:
            tar.extractall(work, filter="tar")
        # Nothing of this process's git environment (GIT_DIR, GIT_INDEX_FILE, a global config) may leak in.
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp, **GIT_ENV}

        def git(*args: str) -> str:
            run = subprocess.run(["git", *args], cwd=work, env=env, capture_output=True, text=True)
            if run.returncode != 0:
                raise RuntimeError(f"building the base commit on this host failed: git {args[0]}: "
                                   f"{run.stderr[-300:]}")
            return run.stdout

        git("init", "-q", "--template=", ".")  # an empty template: no sample hooks
        (work / ".git" / "info").mkdir(exist_ok=True)
        (work / ".git" / "info" / "exclude").write_text(EXCLUDE)
        git("add", "-A")
        git("-c", "commit.gpgsign=false", "-c", "core.logAllRefUpdates=false", "commit", "-q", "--no-verify",
            "--allow-empty", "-m", "base")
        commit = git("rev-parse", "HEAD").strip()
        # One pack instead of a loose object (and often a directory) per file: the sandbox gets a few members
        git("repack", "-a", "-d", "-q", "-n")
        kinds: dict[str, str] = {}
        sizes: dict[str, int] = {}
        starts: list[int] = []
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:

            def owned_by_nobody(info: tarfile.TarInfo) -> tarfile.TarInfo:
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                # a float time takes a PAX header of its own: twice the headers for the service to read
                info.mtime = int(info.mtime)
                kinds[info.name] = "dir" if info.isdir() else "link" if info.issym() else "file"
                starts.append(tar.offset)  # called just before the member is written
                if info.isreg():
                    sizes[info.name] = info.size
                return info

            for entry in sorted(work.iterdir()):
                tar.add(entry, entry.name, filter=owned_by_nobody)
            members_end = tar.offset  # before close() writes the end-of-archive blocks
    raw, parts, spans, at = buffer.getbuffer(), [], {}, 0
    for name, start, end in zip(kinds, starts, [*starts[1:], members_end], strict=True):
        parts.append(gzip.compress(raw[start:end], compresslevel=6, mtime=0))
        spans[name] = (at, at + len(parts[-1]))
        at += len(parts[-1])
    del raw  # the buffer can be freed
    return BaseTree(b"".join(parts), commit, kinds, sizes, spans)


def base_tree(instance: SWEInstance) -> BaseTree:
    """The repository at its base commit with its git repository (`BaseTree`), built on this host once per
    snapshot.

    The build: ``git init``, ``git add -A``, one commit with `GIT_ENV`'s fixed identity and date (so the hash
    depends on the files alone), the objects in one pack. Cached (most recently used first, up to
    `BASE_CACHE_BYTES`) under a key that reads no file of a snapshot directory (`_base_key`): the SHA-256 of
    ``files``, or the directory's real path and its files' metadata, so a second look-up costs one ``lstat`` per
    file. A snapshot whose files changed in any way (another commit checked out, a file edited, added, removed,
    or replaced by a link) gets another key, never an earlier build; one changed within `RECENT_CHANGE_S` is
    built each time until it settles.

    Raises:
        ValueError: ``instance`` is not a SWEInstance, or its ``repo_dir`` is not a directory.
        RuntimeError: this host's git failed.
    """
    if not isinstance(instance, SWEInstance):
        raise ValueError(f"instance must be a SWEInstance, got {type(instance).__name__}")
    key, settled = _base_key(instance)
    with _BASES_LOCK:
        if key in _BASES:
            _BASES.move_to_end(key)
            return _BASES[key]
    # the key was taken before the files are read: a file changed meanwhile gives the next look-up another key
    built = _build_base(repository_archive(instance))
    if settled:
        with _BASES_LOCK:
            _BASES[key] = built
            while sum(len(base.body) for base in _BASES.values()) > BASE_CACHE_BYTES and len(_BASES) > 1:
                _BASES.popitem(last=False)
    return built


def base_archive(instance: SWEInstance) -> tuple[bytes, str]:
    """`base_tree`'s archive (a gzipped tar, ``.git`` included) and its commit's hash.

    Raises:
        ValueError: ``instance`` is not a SWEInstance, or its ``repo_dir`` is not a directory.
        RuntimeError: this host's git failed.
    """
    base = base_tree(instance)
    return base.archive, base.commit


class PatchTooLargeError(Exception):
    """`scored_tree`: the agent's patch may write more than `MAX_PATCH_WRITE_BYTES` (the policy's failure)."""


def _clear_path(work: Path, path: str) -> None:
    """Remove whatever is at ``path`` under ``work`` (a file, a link, a directory), and every link or file on
    its way: never through a link the agent made (it could point anywhere on this host)."""
    target = work
    for part in Path(path).parts:
        if target.is_symlink() or (target.exists() and not target.is_dir()):
            target.unlink()
        target = target / part
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.is_dir():
        shutil.rmtree(target)


def _outside(path: str) -> bool:
    return path.startswith("/") or ".." in Path(path).parts


def _git_apply(work: Path, home: str) -> Callable[[str], subprocess.CompletedProcess[str]]:
    # No repository above `work` may be taken for its own (git apply inside one skips paths outside the cwd).
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "GIT_CEILING_DIRECTORIES": home,
           **GIT_ENV}

    def apply(diff: str) -> subprocess.CompletedProcess[str]:
        # --binary as the sandbox's diff was taken; the patch is data, never a path of ours
        return subprocess.run(["git", "apply", "--binary", "-"], cwd=work, env=env, input=diff, text=True,
                              capture_output=True)

    return apply


def scored_tree(base: bytes, patch: str, test_patch: str) -> bytes | None:
    """The tree the tests run in (steps 2 and 3, on this host), whole: the base (`base_archive`) with the agent's
    ``patch`` applied, the files ``test_patch`` touches reset to the base, then ``test_patch`` applied; as a
    gzipped tar, or None when ``patch`` does not apply. `scored_archive` gives the same tree for less.

    Raises:
        ValueError: ``base`` is not bytes, or a patch not a string.
        PatchTooLargeError: ``patch`` may write more than `MAX_PATCH_WRITE_BYTES` (`patch_write_bound`, with the
            base's file sizes); checked before anything is unpacked or applied on this host.
        EnvironmentFailure: ``test_patch`` does not apply to the base with the agent's patch undone on its
            files (the instance's fault, not the policy's), or names a path outside the repository.
    """
    if not isinstance(base, bytes):
        raise ValueError(f"base must be bytes (a base_archive), got {type(base).__name__}")
    _check_patches(patch, test_patch)
    with tempfile.TemporaryDirectory(prefix="orchard-swe-score-") as tmp:
        work = Path(tmp) / "repo"
        work.mkdir()
        apply = _git_apply(work, os.path.realpath(tmp))
        with tarfile.open(fileobj=io.BytesIO(base), mode="r:gz") as tar:
            members = {m.name.removeprefix("./"): m for m in tar.getmembers()}
            _check_bound(patch, {name: m.size for name, m in members.items() if m.isreg()})
            tar.extractall(work, filter="tar")
            if patch.strip() and apply(patch).returncode != 0:
                return None
            for path in patched_paths(test_patch):
                if _outside(path):
                    raise EnvironmentFailure(f"test_patch names a path outside the repository: {path!r}")
                _clear_path(work, path)
                if path in members:
                    tar.extract(members[path], work, filter="tar")
        if test_patch.strip():
            run = apply(test_patch)
            if run.returncode != 0:
                raise EnvironmentFailure(f"test_patch does not apply to the base: {run.stderr[-300:]}")
        buffer = io.BytesIO()
        with _gzipped_tar(buffer, 1) as out:
            for entry in sorted(work.iterdir()):
                out.add(entry, entry.name)
        return buffer.getvalue()


def _check_patches(patch: str, test_patch: str) -> None:
    for name, value in (("patch", patch), ("test_patch", test_patch)):
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a str, got {type(value).__name__}")


def _check_bound(patch: str, base_sizes: Mapping[str, int]) -> None:
    bound = patch_write_bound(patch, base_sizes)
    if bound > MAX_PATCH_WRITE_BYTES:
        raise PatchTooLargeError(f"the patch may write {bound} bytes when applied, more than "
                                 f"MAX_PATCH_WRITE_BYTES={MAX_PATCH_WRITE_BYTES}")


def _copy_entry(source: Path, target: Path) -> None:
    """A file (its bytes and mode) or a link (its target) copied; its directory made."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_symlink():
        target.symlink_to(os.readlink(source))
    else:
        shutil.copy2(source, target, follow_symlinks=False)


def scored_archive(base: BaseTree, patch: str, test_patch: str) -> bytes | None:
    """The tree the tests run in, as `scored_tree` builds it, for a cost that grows with the patches rather than
    the repository: the base's archive as it is (already compressed), followed by a gzip member holding the final
    state of each path the patches touch (the later member of a name replaces the earlier, as ``tar -x`` and the
    archive upload do). Only those paths are taken out of the base, patched with ``git apply`` and reset as
    `scored_tree` does. Whenever members that follow the base cannot say the result (a path of the base
    removed, a directory where the base has a file or a link or the other way round, a patch or ``test_patch``
    that does not apply to the paths taken out, a file written that the patch's headers do not name), the whole
    tree is built by `scored_tree`, which decides. None when ``patch`` does not apply.

    Raises:
        ValueError: ``base`` is not a `BaseTree`, or a patch not a string.
        PatchTooLargeError, EnvironmentFailure: as `scored_tree`.
    """
    if not isinstance(base, BaseTree):
        raise ValueError(f"base must be a BaseTree (base_tree(instance)), got {type(base).__name__}")
    _check_patches(patch, test_patch)
    _check_bound(patch, base.sizes)
    overlay = _overlay(base, patch, test_patch)
    return scored_tree(base.archive, patch, test_patch) if overlay is None else base.body + overlay


def _overlay(base: BaseTree, patch: str, test_patch: str) -> bytes | None:
    """`scored_archive`'s gzip member after the base, or None when the whole tree must be built."""
    test_paths = patched_paths(test_patch)
    touched = sorted(set(patched_paths(patch)) | set(test_paths))
    if not all(_fits_the_base(base, path) for path in touched):
        return None
    in_base = [path for path in touched if base.kinds.get(path) in ("file", "link")]
    # git apply runs in the base's repository as in `scored_tree`: the same attributes (.gitattributes, read
    # from the index where the file is not taken out) convert line ends the same way
    git_dir = [name for name in base.kinds if name == ".git" or name.startswith(".git/")]
    with tempfile.TemporaryDirectory(prefix="orchard-swe-score-") as tmp:
        work, original = Path(tmp) / "repo", Path(tmp) / "base"
        work.mkdir()
        _extract(base, [*in_base, *git_dir], original)
        (original / ".git").rename(work / ".git")
        for path in in_base:
            _copy_entry(original / path, work / path)
        apply = _git_apply(work, os.path.realpath(tmp))
        if patch.strip() and apply(patch).returncode != 0:
            return None
        for path in test_paths:
            _clear_path(work, path)
            if path in in_base:
                _copy_entry(original / path, work / path)
        if test_patch.strip() and apply(test_patch).returncode != 0:
            return None
        states = {path: _final_state(work, path) for path in touched}
        if any(state == "other" or (state == "gone" and path in base.kinds) for path, state in states.items()):
            return None
        written = {rel for rel, _ in _snapshot_entries(work)}
        if not written <= set(touched):
            return None
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as out:
            for path in touched:
                if states[path] == "gone":
                    continue
                info = out.gettarinfo(str(work / path), path)
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                if info.isreg():
                    with (work / path).open("rb") as handle:
                        out.addfile(info, handle)
                else:
                    out.addfile(info)
    return gzip.compress(buffer.getvalue(), compresslevel=1, mtime=0)


def _fits_the_base(base: BaseTree, path: str) -> bool:
    """Whether members that follow the base can carry ``path``: a plain relative path outside ``.git`` that is
    no directory of the base and has no file or link of the base on its way."""
    parts = path.split("/")
    if _outside(path) or "" in parts or "." in parts or parts[0] == ".git" or base.kinds.get(path) == "dir":
        return False
    return all(base.kinds.get("/".join(parts[:i]), "dir") == "dir" for i in range(1, len(parts)))


def _final_state(work: Path, path: str) -> str:
    """What ``path`` under ``work`` is after the patches: ``"file"``, ``"link"``, ``"gone"``, or ``"other"`` (a
    directory, or a link or file on its way)."""
    target = work
    for part in path.split("/")[:-1]:
        target = target / part
        if target.is_symlink() or (target.exists() and not target.is_dir()):
            return "other"
        if not target.exists():
            return "gone"
    try:
        mode = os.lstat(work / path).st_mode
    except FileNotFoundError:
        return "gone"
    return "file" if stat.S_ISREG(mode) else "link" if stat.S_ISLNK(mode) else "other"


def _extract(base: BaseTree, paths: list[str], into: Path) -> None:
    """The base's members ``paths`` unpacked under ``into`` (made here), each inflated from its own gzip member:
    nothing else of the base is read."""
    into.mkdir()
    for name in paths:
        start, end = base.spans[name]
        member = gzip.decompress(base.body[start:end])
        with tarfile.open(fileobj=io.BytesIO(member), mode="r:") as tar:
            tar.extractall(into, filter="tar")
