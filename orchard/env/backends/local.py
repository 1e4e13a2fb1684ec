"""The embedded sandbox backend: one workspace directory per sandbox, commands isolated with bubblewrap.

Layout under `root_dir` (kept across restarts, so a restarted orchestrator finds its sandboxes with `list_ids`):

    root_dir/                      mode 0711, the service's
      <sandbox id>/                mode 0711
        meta.json                  mode 0600: the spec, the sandbox's uid, creation time (written last)
        workspace/                 mode 0700, owned by the sandbox's uid: `/workspace` inside the sandbox
        home/sandbox/              mode 0700, owned by the sandbox's uid: HOME (/home/sandbox inside)
        passwd, group              the image's, plus a "sandbox" entry for the uid (bound read-only)
      .snapshots/                  mode 0700, the service's: no sandbox reaches a snapshot
        <snapshot id>/             a copy of a workspace (`snapshot`); `fork` copies it into a new sandbox

A sandbox is only listed once its `meta.json` exists; `delete` first renames the directory to a hidden
`.trash-*` name, so a sandbox is either fully there or gone, even if the service dies half-way.

When the service runs as root, each sandbox gets a uid (and gid) of its own from `uid_range`; its processes
run as that uid, its files belong to it, and the pids limit counts per sandbox. The uid is claimed host-wide
(`orchard.env.backends.uid_claims`), so a second service on the machine never hands out the same one.
Commands and the isolation are described in `orchard.env.agent.isolation`; this module only keeps the books.
Creating a sandbox costs a few file-system operations (no process is started), so thousands can be created
per second; its box (the process that runs its commands) starts with its first command.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import resource
import secrets
import shutil
import time
from collections.abc import Mapping
from dataclasses import asdict
from functools import lru_cache
from pathlib import PurePosixPath
from typing import Any

from orchard.env.agent.box_build import install_box
from orchard.env.agent.box_client import BoxCpu
from orchard.env.agent.core import SandboxAgent, validate_env
from orchard.env.agent.files import Workspace
from orchard.env.agent.isolation import (
    BUBBLEWRAP,
    PROCESS_GROUP,
    Isolation,
    Limits,
    kill_marked,
    marker_needle,
    probe_bubblewrap,
    rootfs_tools,
)
from orchard.env.agent.pty import LocalPty
from orchard.env.backends import root_lock
from orchard.env.backends.base import (
    SHARED_MOUNT,
    BackendError,
    CapacityError,
    ExecRequest,
    ExecResult,
    FileInfo,
    IsolationUnavailableError,
    Resources,
    SandboxNotFoundError,
    SandboxSpec,
    SnapshotNotFoundError,
)
from orchard.env.backends.images import HOST_IMAGE, ImageRegistry
from orchard.env.backends.uid_claims import DEFAULT_UID_CLAIMS_DIR, UidClaims
from orchard.env.backends.workspace_copy import copy_tree, reflinks_work

logger = logging.getLogger(__name__)

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_META = "meta.json"
_WORKSPACE = "workspace"
_HOME = "home"
_BOX_DIR = ".box"
_SNAPSHOTS = ".snapshots"
"""Where snapshots live under root_dir (hidden, like the box: never taken for a sandbox)."""
"""Where the compiled box is copied under root_dir (hidden: sandbox ids start with a letter or digit)."""
_GITCONFIG = """[user]
\tname = orchard sandbox
\temail = sandbox@orchard.invalid
"""
_PATCH_MOUNT = "/.orchard-workspace"
_SECRET_DIRS = ("/etc", "/root", "/home", "/proc", "/sys", "/dev", "/run", "/boot", "/var/run")
"""Shared folders may neither lie under nor contain these (credentials, keys, other users' files)."""
_SECRET_NAMES = frozenset({".ssh", ".gnupg", ".aws", ".azure", ".kube", ".docker", ".netrc", ".git-credentials",
                           ".pypirc", ".env", "id_rsa", "id_ed25519", "credentials.json"})
"""A shared folder holding an entry of one of these names is refused: every sandbox could read it."""
_SHARED_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
DEFAULT_UID_RANGE = (200_000, 65_536)
"""(first uid, count): the uids given to sandboxes when the service runs as root."""


def _check_id(sandbox_id: str) -> None:
    if not isinstance(sandbox_id, str) or not _ID_RE.match(sandbox_id):
        raise ValueError(
            f"sandbox_id must match {_ID_RE.pattern} (letters, digits, '_', '.', '-'), got {sandbox_id!r}"
        )


def _check_workdir(workdir: str) -> None:
    if not isinstance(workdir, str) or not workdir.startswith("/") or "\x00" in workdir:
        raise ValueError(f"workdir must be an absolute path, got {workdir!r}")
    p = PurePosixPath(os.path.normpath(workdir))
    if p == PurePosixPath("/") or p.parts[1] in ("proc", "dev"):
        raise ValueError(f"workdir must not be '/', /proc or /dev, got {workdir!r}")


@lru_cache(maxsize=64)
def _image_file_lines_cached(path: str, mtime_ns: int) -> tuple[str, ...]:
    with open(path) as f:
        return tuple(f.read().splitlines())


def _image_file_lines(path: str) -> list[str] | None:
    try:
        return list(_image_file_lines_cached(path, os.stat(path).st_mtime_ns))
    except OSError:
        return None


def _user_files(d: str, uid: int, gid: int, rootfs: str) -> tuple[tuple[str, str], ...]:
    """Make the sandbox's home (`d/home/sandbox`, with a default git identity so `git commit` and
    `git stash` work) and an /etc/passwd and /etc/group that name its uid "sandbox" (tools that look the
    user up, such as git and whoami, fail without). Returns the (host file, sandbox path) pairs to bind."""
    home = os.path.join(d, _HOME, "sandbox")
    if not os.path.isdir(home):
        os.makedirs(home, 0o700)
        with open(os.path.join(home, ".gitconfig"), "w") as f:
            f.write(_GITCONFIG)
        if os.geteuid() == 0:
            os.chown(home, uid, gid)
            os.chown(os.path.join(home, ".gitconfig"), uid, gid)
    image_etc = os.path.join(rootfs, "etc")
    out = []
    for name, line, key in (
        ("passwd", f"sandbox:x:{uid}:{gid}:orchard sandbox:/home/sandbox:/bin/bash", 2),
        ("group", f"sandbox:x:{gid}:", 2),
    ):
        src = os.path.join(image_etc, name)
        if os.path.isdir(image_etc) and not os.path.isfile(src):
            continue  # no mount point for it in the read-only image
        dst = os.path.join(d, name)
        if not os.path.exists(dst):
            lines = _image_file_lines(src)
            if lines is None:
                lines = ["root:x:0:0:root:/root:/bin/sh"] if name == "passwd" else ["root:x:0:"]
            own = str(uid if name == "passwd" else gid)
            lines = [
                x for x in lines if x.split(":")[0] != "sandbox" and x.split(":")[key : key + 1] != [own]
            ]
            tmp = f"{dst}.{secrets.token_hex(4)}"
            with open(tmp, "w") as f:
                f.write("\n".join([*lines, line]) + "\n")
            os.chmod(tmp, 0o644)
            os.replace(tmp, dst)
        out.append((dst, f"/etc/{name}"))
    return tuple(out)


def _raise_open_files_limit(want: int = 65536) -> None:
    """Each running command holds about five descriptors (pipes, pidfds); 200 concurrent commands would
    exhaust the common soft limit of 1024, so raise it toward the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def _check_traversable(root_dir: str) -> None:
    """Sandbox uids must be able to walk down to their workspaces (bubblewrap binds them by path)."""
    parts = PurePosixPath(root_dir).parts
    for i in range(2, len(parts)):
        d = os.path.join(*parts[:i])
        if not os.stat(d).st_mode & 0o001:
            raise ValueError(
                f"root_dir {root_dir!r} is not reachable by the sandboxes' uids: {d!r} is not searchable by "
                f"others (chmod o+x {d!r}, or put root_dir elsewhere, e.g. under /var/lib or /tmp)"
            )


def _check_readable_by_others(name: str, folder: str) -> None:
    """Sandbox uids must reach a shared folder (every directory above it searchable, itself readable)."""
    parts = PurePosixPath(folder).parts
    for i in range(2, len(parts) + 1):
        d = os.path.join(*parts[:i])
        need = 0o005 if i == len(parts) else 0o001
        if os.stat(d).st_mode & need != need:
            raise ValueError(f"shared[{name!r}] = {folder!r} is not readable by the sandboxes' uids: {d!r} lacks "
                             f"o+{'rx' if need == 0o005 else 'x'}")


def _within(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def check_shared(shared: Mapping[str, str | os.PathLike[str]], root_dir: str) -> dict[str, str]:
    """The shared folders as name -> real host path, or ValueError naming ``shared`` and the offending entry.

    Refused: a name that is not a plain word (letters, digits, ``_.-``); a path that is not an existing
    directory; ``/``; a path under or above a system or home directory (``/etc``, ``/root``, ``/home``, ``/proc``,
    ``/sys``, ``/dev``, ``/run``, ``/boot``, this process's ``$HOME``) or the service's ``root_dir`` (its state and
    every sandbox's files); a folder holding an entry named like a credential (``.ssh``, ``.aws``, ``.netrc``, ...).
    Symlinks are resolved first, so a link cannot smuggle a refused path in.
    """
    if not isinstance(shared, Mapping):
        raise ValueError(f"shared must be a mapping name -> directory, got {type(shared).__name__}")
    home = os.path.realpath(os.path.expanduser("~"))
    guarded = [*(os.path.realpath(d) for d in _SECRET_DIRS), home, os.path.realpath(root_dir)]
    out: dict[str, str] = {}
    for name, folder in shared.items():
        if not isinstance(name, str) or not _SHARED_NAME_RE.match(name):
            raise ValueError(f"shared names must match {_SHARED_NAME_RE.pattern}, got {name!r}")
        if not isinstance(folder, str | os.PathLike):
            raise ValueError(f"shared[{name!r}] must be a path, got {type(folder).__name__}")
        path = os.path.realpath(os.fspath(folder))
        if not os.path.isdir(path):
            raise ValueError(f"shared[{name!r}] must be an existing directory, got {os.fspath(folder)!r}")
        for guard in guarded:
            if path == "/" or _within(path, guard) or _within(guard, path):
                raise ValueError(f"shared[{name!r}] = {path!r} would show {guard!r} (or lie in it) to every "
                                 "sandbox; share a directory of its own")
        for top, dirs, files in os.walk(path):
            secret = _SECRET_NAMES.intersection(dirs + files)
            if secret:
                raise ValueError(f"shared[{name!r}] holds {os.path.join(top, min(secret))!r}, which looks like "
                                 "a credential; every sandbox could read it")
        out[name] = path
    return out


class LocalBackend:
    """Sandboxes as workspace directories under `root_dir`, isolated with bubblewrap where it works.

    Args:
        root_dir: where sandboxes live (created if missing, made mode 0711). When the service runs as root,
            every directory above it must be searchable by others (o+x): sandboxes run as their own uids and
            bubblewrap reaches the workspace by path. A home directory (mode 0700) is not; /var/lib/... or a
            directory from `tempfile.mkdtemp()` is.
        images: an `ImageRegistry`, or a mapping name -> rootfs directory ("host" is always available).
        limits: default limits for a spec that leaves them None (default `Limits()`: 256 pids, 4096 MiB of
            address space per process, no CPU limit).
        use_bwrap: True requires bubblewrap (BackendError if it cannot create namespaces here), False uses
            the process-group fallback, None (default) probes and falls back with a logged warning.
        allow_weak_isolation: in the process-group fallback, still create (and run) sandboxes whose spec
            blocks the network, although nothing blocks it (their commands reach the host's network and
            files). Default False: such a sandbox is refused with `IsolationUnavailableError`, so that a
            blocked network is never promised where it would not hold. Irrelevant under bubblewrap.
        uid_range: (first, count) of the uids given to sandboxes when running as root; choose a range no
            account and no /etc/subuid entry of the host uses (default 200000..265535).
        uid_claims_dir: where every root service of the machine claims its sandboxes' uids (default
            `/var/lib/orchard/sandbox-uids`), so that two services never give two sandboxes the same uid. None:
            no host-wide claims (only safe where this is the one service on the machine); a directory that
            cannot be made is logged and treated as None. Unused when not root.
        max_sandboxes: `create` raises CapacityError beyond this many sandboxes (None: no limit).
        box: under bubblewrap, run each sandbox's commands through one long-lived isolated process (its
            box, started by the sandbox's first command; see `orchard.env.agent.box_client`) rather than a
            fresh bubblewrap per command. Same isolation and exec rules at a fraction of the cost per
            command; False keeps a bubblewrap per command. Terminals always get a bubblewrap of their own.
            The box is the compiled one (`orchard.env.agent.box_build`, built once per machine with the C
            compiler and copied to `root_dir/.box/`) where it can be built, else the Python one.
        shared: service-level shared folders, name -> host directory: each is bound read-only at
            `SHARED_MOUNT/<name>` (``/.orchard-shared/<name>``) in every sandbox, so what all sandboxes need
            (a tool, a package bundle, a data set) is on the host once instead of copied into each. Refused
            (ValueError, see `check_shared`) for paths that would expose secrets or the service's own files.
            Under bubblewrap only: the process-group fallback has no mount namespace and logs that it ignores
            them. When the service runs as root the folders must be readable by others (the sandbox uids).
            On Kubernetes an image layer or a read-only volume plays this role.

    Attributes:
        isolation: "bubblewrap" or "process-group" (report it on /health and with every sandbox).
        blocks_network: whether a sandbox whose spec has `network=False` really has no network (only under
            bubblewrap).
        bwrap_as_root: bubblewrap is started as root and commands drop to the sandbox's uid inside (a root
            service, images with setpriv and prlimit); otherwise it starts as the sandbox's uid in a user
            namespace. Both give the same isolation; the first costs about half the CPU per command.
        isolation_warning: why the fallback was taken (None under bubblewrap).
        box_binary: the compiled box the sandboxes run (None: the Python box, or no box).
    """

    name = "local"

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        *,
        images: ImageRegistry | Mapping[str, str | os.PathLike[str]] | None = None,
        limits: Limits | None = None,
        use_bwrap: bool | None = None,
        uid_range: tuple[int, int] = DEFAULT_UID_RANGE,
        uid_claims_dir: str | os.PathLike[str] | None = DEFAULT_UID_CLAIMS_DIR,
        max_sandboxes: int | None = None,
        box: bool = True,
        allow_weak_isolation: bool = False,
        shared: Mapping[str, str | os.PathLike[str]] | None = None,
    ) -> None:
        if not isinstance(root_dir, str | os.PathLike):
            raise ValueError(f"root_dir must be a path, got {type(root_dir).__name__}")
        if images is None:
            images = ImageRegistry()
        elif not isinstance(images, ImageRegistry):
            images = ImageRegistry(images)
        if limits is not None and not isinstance(limits, Limits):
            raise ValueError(f"limits must be a Limits or None, got {type(limits).__name__}")
        if use_bwrap not in (None, True, False):
            raise ValueError(f"use_bwrap must be True, False or None, got {use_bwrap!r}")
        first, count = uid_range
        if not (isinstance(first, int) and isinstance(count, int) and first >= 1000 and count >= 1):
            raise ValueError(f"uid_range must be (first >= 1000, count >= 1), got {uid_range!r}")
        if uid_claims_dir is not None and not isinstance(uid_claims_dir, str | os.PathLike):
            raise ValueError(f"uid_claims_dir must be a path or None, got {type(uid_claims_dir).__name__}")
        if max_sandboxes is not None and (not isinstance(max_sandboxes, int) or max_sandboxes < 1):
            raise ValueError(f"max_sandboxes must be a positive int or None, got {max_sandboxes!r}")
        if not isinstance(box, bool):
            raise ValueError(f"box must be a bool, got {box!r}")
        if not isinstance(allow_weak_isolation, bool):
            raise ValueError(f"allow_weak_isolation must be a bool, got {allow_weak_isolation!r}")
        self.allow_weak_isolation = allow_weak_isolation
        self.box = box
        self.root_dir = os.path.abspath(os.fspath(root_dir))
        self.shared = check_shared(shared or {}, self.root_dir)
        os.makedirs(self.root_dir, exist_ok=True)
        os.chmod(self.root_dir, 0o711)
        self.is_root = os.geteuid() == 0
        if self.is_root:
            _check_traversable(self.root_dir)
        # before anything that touches what another service on the root may be using (its trash, its processes)
        self._root_lock: str | None = root_lock.acquire(self.root_dir)
        try:
            self._set_up(images, limits, use_bwrap, (first, count), uid_claims_dir, max_sandboxes, box)
        except BaseException:
            self._release_root()
            raise

    def _set_up(self, images: ImageRegistry, limits: Limits | None, use_bwrap: bool | None,
                uid_range: tuple[int, int], uid_claims_dir: str | os.PathLike[str] | None,
                max_sandboxes: int | None, box: bool) -> None:
        self.images = images
        self.default_limits = limits or Limits()
        self.uid_range = uid_range
        self.max_sandboxes = max_sandboxes
        self._claims: UidClaims | None = None
        if self.is_root and uid_claims_dir is not None:
            try:
                self._claims = UidClaims(uid_claims_dir)
            except OSError as e:
                logger.warning("cannot keep uid claims in %s (%s): another service on this machine may give "
                               "its sandboxes the uids this one gives", uid_claims_dir, e)  # fmt: skip
        self._agents: dict[str, SandboxAgent] = {}
        self._uids: dict[str, int] | None = None
        self._next_uid = 0
        self.isolation, self.isolation_warning = self._choose_isolation(use_bwrap)
        self.blocks_network = self.isolation == BUBBLEWRAP
        if self.shared and self.isolation != BUBBLEWRAP:
            logger.warning("shared folders %s are not mounted: sandboxes run in process groups, without a "
                           "mount namespace", sorted(self.shared))  # fmt: skip
        elif self.is_root:
            for name, folder in self.shared.items():
                _check_readable_by_others(name, folder)
        self._sweep_trash()
        self.reflinks = reflinks_work(self.root_dir)
        """Whether snapshots and forks are copy-on-write clones here (else full copies; both are isolated)."""
        self.box_binary = None
        if box and self.isolation == BUBBLEWRAP:
            try:
                self.box_binary = install_box(os.path.join(self.root_dir, _BOX_DIR))
            except (OSError, ValueError) as e:
                logger.warning("cannot install the compiled box under %s (%s); sandboxes run the Python box",
                               self.root_dir, e)  # fmt: skip
        _raise_open_files_limit()
        # Without bubblewrap nothing ties a command to the service's life: end what a killed predecessor on
        # this root_dir left running. (Under bubblewrap, --die-with-parent already did.)
        self._mark_prefix = hashlib.sha256(self.root_dir.encode()).hexdigest()[:12] + "-"
        orphans = kill_marked(marker_needle(self._mark_prefix), None)
        if orphans:
            logger.warning("ended %d processes left by a previous service on %s", orphans, self.root_dir)

    # -- set-up ------------------------------------------------------------------------------------------

    def _choose_isolation(self, use_bwrap: bool | None) -> tuple[str, str | None]:
        self.bwrap_as_root = False
        self.bwrap_userns = False
        if use_bwrap is False:
            reason = "bubblewrap disabled by configuration (use_bwrap=False)"
        else:
            probe_as = (self.uid_range[0], self.uid_range[0]) if self.is_root else None
            reason = probe_bubblewrap(probe_as)
            self.bwrap_userns = reason is None
            if self.is_root:
                self.bwrap_as_root = probe_bubblewrap(probe_as, privileged=True) is None
            if self.bwrap_userns or self.bwrap_as_root:
                return BUBBLEWRAP, None
            if use_bwrap is True:
                raise BackendError(f"bubblewrap was required but does not work here: {reason}")
        logger.warning(
            "SANDBOXES ARE NOT ISOLATED: %s. Commands run on the host in process groups (no pid, mount or "
            "network namespace; host file system and network visible with the sandbox uid's rights).",
            reason,
        )
        return PROCESS_GROUP, reason

    def _check_enforceable(self, spec: SandboxSpec) -> None:
        """Refuse a spec whose blocked network this backend cannot enforce, unless the operator opted in."""
        if spec.network or self.blocks_network or self.allow_weak_isolation:
            return
        raise IsolationUnavailableError(
            f"block_network=true cannot be enforced: sandboxes run in process groups, not bubblewrap "
            f"({self.isolation_warning}), so their commands would reach the host's network. Fix: install "
            "bubblewrap and let it create user namespaces (or run the service as root), then restart the "
            "service; or create the sandbox with block_network=false; or, accepting that sandboxes are not "
            "isolated, start the service with `orchard env serve --allow-weak-isolation` "
            "(LocalBackend(allow_weak_isolation=True), serve(allow_weak_isolation=True))."
        )

    def _sweep_trash(self) -> None:
        for entry in os.scandir(self.root_dir):
            if entry.name.startswith(".trash-"):
                shutil.rmtree(entry.path, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError), os.scandir(os.path.join(self.root_dir, _SNAPSHOTS)) as parts:
            for entry in parts:
                if entry.name.startswith(".part-"):  # a snapshot whose copy a dead service left half-made
                    shutil.rmtree(entry.path, ignore_errors=True)

    def health(self) -> dict[str, Any]:
        """What /health should report about the backend."""
        return {
            "backend": self.name,
            "isolation": self.isolation,
            "isolation_warning": self.isolation_warning,
            "blocks_network": self.blocks_network,
            "allow_weak_isolation": self.allow_weak_isolation,
            "bubblewrap_started_as": (
                ("root" if self.bwrap_as_root else "sandbox uid") if self.isolation == BUBBLEWRAP else None
            ),
            "commands_run_by": (
                (
                    ("a compiled box per sandbox" if self.box_binary else "a Python box per sandbox")
                    if self.box
                    else "a bubblewrap per command"
                )
                if self.isolation == BUBBLEWRAP
                else "a process group per command"
            ),
            "box_cpu_s": {
                "boxes_closed": BoxCpu.boxes,
                "boxes": round(BoxCpu.box_s, 3),
                "commands": round(BoxCpu.commands_s, 3),
            },
            "per_sandbox_uid": self.is_root,
            "workspace_copies": "reflink (copy-on-write)" if self.reflinks else "full copy (no reflinks here)",
            "limits": asdict(self.default_limits),
            "images": self.images.names(),
            "shared": {name: f"{SHARED_MOUNT}/{name}" for name in self.shared} if self.isolation == BUBBLEWRAP
            else {},
        }

    # -- bookkeeping -------------------------------------------------------------------------------------

    def _dir(self, sandbox_id: str) -> str:
        return os.path.join(self.root_dir, sandbox_id)

    def _load_uids(self) -> dict[str, int]:
        if self._uids is None:
            self._uids = {}
            for sid in self._scan_ids():
                meta = self._read_meta(sid)
                if meta is not None and meta.get("uid") is not None:
                    self._uids[sid] = int(meta["uid"])
            if self._claims is not None:  # a sandbox made without claims (an older version, another claims dir)
                for sid, uid in self._uids.items():
                    other = self._claims.reclaim(uid, self._dir(sid))
                    if other is not None:
                        logger.warning("sandbox %r's uid %d is claimed by %s as well: their processes can "
                                       "signal each other; delete one of them", sid, uid, other)  # fmt: skip
        return self._uids

    def _allocate_uid(self, sandbox_id: str) -> int:
        """The next uid of `uid_range` (round robin) that no sandbox of this backend has and, host-wide, no
        other service's sandbox holds; claimed for `sandbox_id`."""
        used = set(self._load_uids().values())
        first, count = self.uid_range
        start = self._next_uid
        free = (uid for i in range(count) if (uid := first + (start + i) % count) not in used)
        uid = self._claims.claim_first(free, self._dir(sandbox_id)) if self._claims else next(free, None)
        if uid is None:
            held = f", here or (claims in {self._claims.directory}) by other services" if self._claims else ""
            raise CapacityError(f"all {count} sandbox uids from {first} are in use{held}")
        self._next_uid = (uid - first + 1) % count
        self._uids[sandbox_id] = uid  # type: ignore[index]
        return uid

    def _release_uid(self, sandbox_id: str, uid: int | None) -> None:
        if self._uids is not None:
            self._uids.pop(sandbox_id, None)
        if uid is not None and self._claims is not None:
            self._claims.release(uid, self._dir(sandbox_id))

    def _scan_ids(self) -> list[str]:
        out = []
        for entry in os.scandir(self.root_dir):
            if not entry.name.startswith(".") and os.path.exists(os.path.join(entry.path, _META)):
                out.append(entry.name)
        return sorted(out)

    def _read_meta(self, sandbox_id: str) -> dict[str, Any] | None:
        try:
            with open(os.path.join(self._dir(sandbox_id), _META)) as f:
                return json.load(f)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, ValueError) as e:
            raise BackendError(f"sandbox {sandbox_id!r} has unreadable metadata: {e}") from e

    def _limits_for(self, spec: SandboxSpec) -> Limits:
        d = self.default_limits
        return Limits(
            pids=d.pids if spec.pids is None else spec.pids,
            memory_mb=d.memory_mb if spec.memory_mb is None else spec.memory_mb,
            cpu=d.cpu if spec.cpu is None else spec.cpu,
        )

    def _agent(self, sandbox_id: str) -> SandboxAgent:
        _check_id(sandbox_id)
        agent = self._agents.get(sandbox_id)
        if agent is not None:
            return agent
        meta = self._read_meta(sandbox_id)
        if meta is None:
            raise SandboxNotFoundError(f"no sandbox {sandbox_id!r}")
        spec = SandboxSpec(**meta["spec"])
        self._check_enforceable(spec)  # e.g. made under bubblewrap by a service restarted without it
        uid = meta.get("uid")
        run_as = (uid, uid) if uid is not None and self.is_root else None
        root = os.path.join(self._dir(sandbox_id), _WORKSPACE)
        ws = Workspace(
            root,
            mount=os.path.normpath(spec.workdir),
            uid=run_as[0] if run_as else None,
            gid=run_as[1] if run_as else None,
            # without a mount namespace commands run in the host directory, so `pwd` prints its path: the
            # file API takes it (and the real path, should root_dir lie under a symlink) as the workspace too
            aliases=tuple(dict.fromkeys((root, os.path.realpath(root)))) if self.isolation == PROCESS_GROUP else (),
        )
        image = self.images.resolve(spec.image)
        d = self._dir(sandbox_id)
        uid_gid = run_as or (os.getuid(), os.getgid())
        ro_files = _user_files(d, uid_gid[0], uid_gid[1], image.rootfs)
        common = dict(
            home=os.path.join(d, _HOME),
            mark_prefix=self._mark_prefix,
            mode=self.isolation,
            network=spec.network,
            limits=self._limits_for(spec),
            run_as=run_as,
            hide=(self.root_dir,),
            privileged=None if self.bwrap_as_root else False,
        )
        shared = tuple((folder, f"{SHARED_MOUNT}/{name}") for name, folder in sorted(self.shared.items()))
        own = dict(rootfs=image.rootfs, ro_files=ro_files, ro_dirs=shared, box_binary=self.box_binary)
        iso = Isolation(ws, **own, **common)  # type: ignore[arg-type]
        host_iso = None
        if image.rootfs != "/":
            # git comes from the host for images without it; the workspace is mounted where the host's
            # top level has nothing (the image's workdir may lie in a host directory, e.g. /srv/app).
            patch_ws = Workspace(ws.root, mount=_PATCH_MOUNT, uid=ws.uid, gid=ws.gid)
            host_iso = Isolation(patch_ws, rootfs="/", **common)  # type: ignore[arg-type]
        agent = SandboxAgent(iso, env=spec.env, host_isolation=host_iso, box=self.box)
        self._agents[sandbox_id] = agent
        return agent

    # -- the Backend protocol ----------------------------------------------------------------------------

    async def create(self, sandbox_id: str, spec: SandboxSpec) -> None:
        """Make the workspace and write the metadata; idempotent for an existing id (its spec is kept)."""
        await self._make(sandbox_id, spec, None)

    async def _make(self, sandbox_id: str, spec: SandboxSpec, source: str | None) -> None:
        """`create`, with the workspace a copy of the directory `source` (a fork) or empty (None)."""
        _check_id(sandbox_id)
        if not isinstance(spec, SandboxSpec):
            raise ValueError(f"spec must be a SandboxSpec, got {type(spec).__name__}")
        validate_env(spec.env, "spec.env")
        _check_workdir(spec.workdir)
        self._limits_for(spec)  # validates cpu / memory_mb / pids
        self._check_enforceable(spec)
        image = self.images.resolve(spec.image)
        if spec.image != HOST_IMAGE and self.isolation != BUBBLEWRAP:
            logger.warning("image %r cannot be used without bubblewrap; commands see the host", spec.image)
        top = PurePosixPath(os.path.normpath(spec.workdir)).parts[1]
        if (
            top != "tmp"
            and os.path.lexists(os.path.join(image.rootfs, top))
            and not os.path.isdir(os.path.join(image.rootfs, spec.workdir.lstrip("/")))
        ):
            raise ValueError(f"workdir {spec.workdir!r} cannot be mounted in image {spec.image!r}")
        if (
            self.isolation == BUBBLEWRAP
            and not self.bwrap_userns
            and (not self.bwrap_as_root or rootfs_tools(image.rootfs) is None)
        ):
            raise BackendError(
                f"image {spec.image!r} lacks setpriv and prlimit, and user namespaces are unavailable here"
            )
        d = self._dir(sandbox_id)
        if os.path.exists(os.path.join(d, _META)):
            return
        if self.max_sandboxes is not None and len(self._scan_ids()) >= self.max_sandboxes:
            raise CapacityError(f"the backend already holds {self.max_sandboxes} sandboxes")
        try:
            os.mkdir(d, 0o711)
        except FileExistsError:
            if os.path.exists(os.path.join(d, _META)):
                return
            # left over by a create that died half-way
        uid = self._allocate_uid(sandbox_id) if self.is_root else None
        try:
            ws = os.path.join(d, _WORKSPACE)
            if source is None:
                os.makedirs(ws, 0o700, exist_ok=True)
                if uid is not None:
                    os.chown(ws, uid, uid)
            else:
                await asyncio.to_thread(shutil.rmtree, ws, True)  # left by a fork that died half-way
                await copy_tree(source, ws, owner=uid)
            uid_gid = (uid, uid) if uid is not None else (os.getuid(), os.getgid())
            _user_files(d, uid_gid[0], uid_gid[1], image.rootfs)
            meta = {"id": sandbox_id, "spec": asdict(spec), "uid": uid, "created": time.time()}
            tmp = os.path.join(d, f".{_META}.{secrets.token_hex(4)}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(meta, f)
            os.replace(tmp, os.path.join(d, _META))
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            self._release_uid(sandbox_id, uid)
            raise

    async def delete(self, sandbox_id: str) -> None:
        """End every process of the sandbox and remove its directory. Idempotent."""
        _check_id(sandbox_id)
        agent = self._agents.get(sandbox_id)
        if agent is not None:
            # The agent stays registered, closed, until the directory is gone: a command arriving meanwhile
            # is refused by it rather than run by a fresh agent that nothing would end.
            await agent.kill_all()
        d = self._dir(sandbox_id)
        trash = os.path.join(self.root_dir, f".trash-{sandbox_id}-{secrets.token_hex(4)}")
        uid = self._load_uids().get(sandbox_id)
        try:
            os.rename(d, trash)
        except FileNotFoundError:
            return
        finally:
            if agent is not None and self._agents.get(sandbox_id) is agent:
                del self._agents[sandbox_id]
            # only now, with its processes ended, may another sandbox (of any service) get the uid
            self._release_uid(sandbox_id, uid)
        await asyncio.to_thread(shutil.rmtree, trash, True)

    async def exists(self, sandbox_id: str) -> bool:
        _check_id(sandbox_id)
        return os.path.exists(os.path.join(self._dir(sandbox_id), _META))

    async def list_ids(self) -> list[str]:
        return self._scan_ids()

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        return await self._agent(sandbox_id).exec(request)

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int | None = None) -> None:
        await self._agent(sandbox_id).write_file(path, data, mode)

    async def read_file(self, sandbox_id: str, path: str, max_bytes: int | None = None) -> bytes:
        return await self._agent(sandbox_id).read_file(path, max_bytes)

    async def extract_archive(self, sandbox_id: str, path: str, data: bytes) -> tuple[int, int]:
        summary = await self._agent(sandbox_id).extract_archive(path, data)
        return summary.entries, summary.bytes

    async def list_files(self, sandbox_id: str, path: str = ".", recursive: bool = False) -> list[FileInfo]:
        return await self._agent(sandbox_id).list_files(path, recursive)

    async def apply_patch(self, sandbox_id: str, patch: str) -> ExecResult:
        return await self._agent(sandbox_id).apply_patch(patch)

    async def resources(self, sandbox_id: str) -> Resources:
        return await self._agent(sandbox_id).resources()

    async def open_pty(
        self, sandbox_id: str, command: str | None = None, cols: int = 80, rows: int = 24
    ) -> LocalPty:
        return await self._agent(sandbox_id).open_pty(command, cols, rows)

    # -- snapshots and forks (the copies: orchard.env.backends.workspace_copy) ----------------------------

    def _snapshot_dir(self, snapshot_id: str) -> str:
        _check_id(snapshot_id)
        return os.path.join(self.root_dir, _SNAPSHOTS, snapshot_id)

    def _workspace_of(self, sandbox_id: str) -> str:
        _check_id(sandbox_id)
        if not os.path.exists(os.path.join(self._dir(sandbox_id), _META)):
            raise SandboxNotFoundError(f"no sandbox {sandbox_id!r}")
        return os.path.join(self._dir(sandbox_id), _WORKSPACE)

    async def snapshot(self, sandbox_id: str, snapshot_id: str) -> None:
        """Copy the workspace to `root_dir/.snapshots/<snapshot_id>` (mode 0700, the service's: no sandbox
        reaches it). The copy is made under a hidden name and renamed into place, so a snapshot is complete or
        absent, even if the service dies half-way."""
        target = self._snapshot_dir(snapshot_id)
        source = self._workspace_of(sandbox_id)
        if os.path.lexists(target):
            raise ValueError(f"snapshot {snapshot_id!r} exists")
        top = os.path.dirname(target)
        os.makedirs(top, 0o700, exist_ok=True)
        part = os.path.join(top, f".part-{snapshot_id}-{secrets.token_hex(4)}")
        await copy_tree(source, part)
        try:
            os.rename(part, target)
        except OSError:
            await asyncio.to_thread(shutil.rmtree, part, True)
            raise

    async def fork(self, sandbox_id: str, spec: SandboxSpec, *, parent_id: str | None = None,
                   snapshot_id: str | None = None) -> None:
        """`create`, with the workspace a copy of the live sandbox `parent_id`'s or of the snapshot's, owned by
        the fork's own uid; its home starts fresh, as a created sandbox's."""
        if (parent_id is None) == (snapshot_id is None):
            raise ValueError("fork needs exactly one of parent_id and snapshot_id")
        if parent_id is not None:
            source = self._workspace_of(parent_id)
        else:
            source = self._snapshot_dir(snapshot_id)  # type: ignore[arg-type]
            if not os.path.isdir(source):
                raise SnapshotNotFoundError(f"no snapshot {snapshot_id!r}")
        await self._make(sandbox_id, spec, source)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        target = self._snapshot_dir(snapshot_id)
        trash = os.path.join(self.root_dir, f".trash-snapshot-{snapshot_id}-{secrets.token_hex(4)}")
        try:
            os.rename(target, trash)
        except FileNotFoundError:
            return
        await asyncio.to_thread(shutil.rmtree, trash, True)

    async def list_snapshot_ids(self) -> list[str]:
        try:
            entries = os.scandir(os.path.join(self.root_dir, _SNAPSHOTS))
        except FileNotFoundError:
            return []
        with entries:
            return sorted(e.name for e in entries if not e.name.startswith("."))

    async def close(self) -> None:
        """End the processes this backend started (running commands, terminals), then free the root for another
        service (`root_lock`); workspaces stay."""
        agents = list(self._agents.values())
        self._agents.clear()
        await asyncio.gather(*(a.kill_all() for a in agents), return_exceptions=True)
        self._release_root()

    def _release_root(self) -> None:
        key, self._root_lock = self._root_lock, None
        if key is not None:
            root_lock.release(key)
