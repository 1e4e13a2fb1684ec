"""Host-wide claims on the uids the local backend gives its sandboxes, so that no two services share one.

A root service gives each sandbox a uid of its own from `uid_range`, and every service on a machine starts
from the same default range. A backend that only knew its own `root_dir`'s sandboxes gave the first sandbox
of every concurrent service (two test runs, a recipe beside a notebook) the same uid: those sandboxes could
signal each other, shared one `RLIMIT_NPROC`, and a look for "the processes of this sandbox's uid" found the
other service's box and commands as well.

A claim is a file `<directory>/<uid>` that holds the absolute path of the sandbox directory owning the uid.
Every backend of the host takes and releases claims under an exclusive `flock` of `<directory>/.lock`. A
claim whose sandbox directory is gone (deleted, a temporary `root_dir` removed, a service that died half-way
through a create) is stale and may be taken over, so nothing needs cleaning up by hand. Claims live outside
every `root_dir` and survive a reboot, so a restarted service still finds its sandboxes' uids its own.

A uid that some process of the host runs as is not free either, claimed or not: a service that does not claim
(an older version) or an account in the range. The processes are looked up in /proc at most once a second
(a scan costs milliseconds on a loaded machine, more than the rest of a create).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import time
from collections.abc import Iterable, Iterator

DEFAULT_UID_CLAIMS_DIR = "/var/lib/orchard/sandbox-uids"
"""Where every root service of a machine claims its sandboxes' uids (see `UidClaims`)."""

_LOCK = ".lock"
_RUNNING_SCAN_S = 1.0


class UidClaims:
    """The host's uid claims in `directory` (created mode 0700 if missing; OSError when that fails).

    Owners are sandbox directories (absolute paths): a claim is live while its owner directory exists.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        if not isinstance(directory, str | os.PathLike):
            raise ValueError(f"directory must be a path, got {type(directory).__name__}")
        self.directory = os.path.abspath(os.fspath(directory))
        os.makedirs(self.directory, 0o700, exist_ok=True)
        self._running: frozenset[int] = frozenset()
        self._running_at: float | None = None

    def running_uids(self) -> frozenset[int]:
        """The uids the host's processes run as (zombies included), as of at most a second ago."""
        now = time.monotonic()
        if self._running_at is None or now - self._running_at >= _RUNNING_SCAN_S:
            found = set()
            with os.scandir("/proc") as entries:
                for entry in entries:
                    if entry.name.isdigit():
                        with contextlib.suppress(OSError):  # exited meanwhile
                            found.add(entry.stat(follow_symlinks=False).st_uid)
            self._running, self._running_at = frozenset(found), now
        return self._running

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(os.path.join(self.directory, _LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # also drops the lock

    def _path(self, uid: int) -> str:
        return os.path.join(self.directory, str(uid))

    def _recorded(self, uid: int) -> str | None:
        try:
            with open(self._path(uid)) as f:
                return f.read()
        except (FileNotFoundError, UnicodeDecodeError):
            return None

    def holder(self, uid: int) -> str | None:
        """The sandbox directory that holds `uid`, or None when the uid is free (never or no longer claimed)."""
        owner = self._recorded(uid)
        return owner if owner and os.path.isabs(owner) and os.path.isdir(owner) else None

    def _write(self, uid: int, owner: str) -> None:
        # replaced whole, so a service killed mid-write leaves the old claim or the new one, never half a path
        tmp = os.path.join(self.directory, f".{uid}.{secrets.token_hex(4)}")
        with open(tmp, "w") as f:
            f.write(owner)
        os.replace(tmp, self._path(uid))

    @staticmethod
    def _check_owner(owner: str) -> None:
        if not isinstance(owner, str) or not os.path.isabs(owner) or "\x00" in owner:
            raise ValueError(f"owner must be an absolute path (a sandbox directory), got {owner!r}")

    def claim_first(self, candidates: Iterable[int], owner: str) -> int | None:
        """Claim for `owner` the first of `candidates` that is free (or already `owner`'s); None if none is.
        A uid that a process of the host runs as is not free (see the module docstring)."""
        self._check_owner(owner)
        with self._locked():
            running = self.running_uids()
            for uid in candidates:
                holder = self.holder(uid)
                if holder == owner or (holder is None and uid not in running):
                    self._write(uid, owner)
                    return uid
        return None

    def reclaim(self, uid: int, owner: str) -> str | None:
        """Claim `uid` for `owner` again (a restarted service, or claims made before a reboot were lost);
        the other sandbox directory that holds it live, if any (then nothing is written)."""
        self._check_owner(owner)
        with self._locked():
            holder = self.holder(uid)
            if holder is not None and holder != owner:
                return holder
            if self._recorded(uid) != owner:
                self._write(uid, owner)
        return None

    def release(self, uid: int, owner: str) -> None:
        """Give up `owner`'s claim on `uid` (a claim someone else holds is left alone)."""
        self._check_owner(owner)
        with self._locked():
            if self._recorded(uid) == owner:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._path(uid))
