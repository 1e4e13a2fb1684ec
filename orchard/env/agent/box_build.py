"""Build the compiled box (`box.c`) once per machine, and put a copy where a service's sandboxes can run it.

`compiled_box()` compiles `box.c` with the system's C compiler (`$CC`, else `cc`, `gcc` or `clang`),
statically linked so that it runs in any image, into a per-user cache (`$ORCHARD_CACHE_DIR`, else
`$XDG_CACHE_HOME/orchard`, else `~/.cache/orchard`), named by a hash of the source, the compiler and the
flags, and returns its path; later calls (and later processes) reuse it. Under a root service the box starts
as root inside its sandbox before it drops to the sandbox's uid, so a cached binary is only trusted when it
and its directory belong to this user and nobody else can write them (else the box is built into a private
temporary directory). Without a compiler, or when the build fails, it returns None and logs why once: the
service then runs the Python box (`box.py`) under the image's python3, which behaves the same and costs
~10 ms more CPU per sandbox.

`install_box(directory)` copies the binary into a directory the sandboxes' uids can reach (the cache is
usually private to the service's user), mode 0755, and returns the copy's path. bubblewrap binds it
read-only at `BOX_MOUNT` in each sandbox.
"""

from __future__ import annotations

import atexit
import contextlib
import filecmp
import hashlib
import logging
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

BOX_C = Path(__file__).with_name("box.c")
BOX_MOUNT = "/.orchard-box"
"""Where the compiled box is bound (read-only) in a sandbox."""

FLAGS = ("-O2", "-static", "-s", "-Wall", "-Wextra")
"""How the box is built (the tests add -Werror: a new compiler's new warning must not cost a user the box)."""
_lock = threading.Lock()
_built: dict[str, str | None] = {}


def cache_dir() -> Path:
    """The per-user directory compiled boxes are kept in."""
    if os.environ.get("ORCHARD_CACHE_DIR"):
        return Path(os.environ["ORCHARD_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "orchard"
    return Path.home() / ".cache" / "orchard"


def find_compiler() -> tuple[str, ...] | None:
    """The C compiler's command to build the box with: `$CC` (which may carry arguments, e.g.
    "ccache gcc"), else the first of cc, gcc, clang on PATH; None without one."""
    candidates = [shlex.split(os.environ["CC"])] if os.environ.get("CC", "").strip() else []
    for command in [*candidates, ["cc"], ["gcc"], ["clang"]]:
        found = shutil.which(command[0])
        if found:
            return (found, *command[1:])
    return None


def compiled_box(cache: str | os.PathLike[str] | None = None) -> str | None:
    """Path of the compiled box (built on first use and cached), or None where it cannot be built.

    Args:
        cache: directory to keep the binary in (default: `cache_dir()`); one that is not this user's alone is
            not used (the box is then built into a private temporary directory).
    """
    compiler = find_compiler()
    if compiler is None:
        return _remember("", None, "no C compiler (cc, gcc, clang) on PATH")
    directory = Path(cache) if cache is not None else cache_dir()
    name = f"box-{_digest(compiler)}"
    key = str(directory / name)
    with _lock:
        if key in _built:
            return _built[key]
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not _private(directory, stat.S_ISDIR):
                log.warning("orchard: %s is not this user's alone; the compiled box is built into a private "
                            "temporary directory instead", directory)  # fmt: skip
                directory = Path(tempfile.mkdtemp(prefix="orchard-box-"))
                # sandboxes run the copy install_box makes, never this one: it may go with the process
                atexit.register(shutil.rmtree, directory, True)
            target = directory / name
            if not (target.exists() and _private(target, stat.S_ISREG) and os.access(target, os.X_OK)):
                why = _build(compiler, target)
                if why is not None:
                    return _remember(key, None, why)
        except (OSError, subprocess.SubprocessError) as e:
            return _remember(key, None, f"cannot build the box in {str(directory)!r}: {e}")
        _built[key] = str(target)
        return str(target)


def install_box(directory: str | os.PathLike[str], binary: str | None = None) -> str | None:
    """Copy the compiled box (`binary`, default `compiled_box()`) into `directory` (created if missing, made
    mode 0711 so sandbox uids can reach the copy), mode 0755, and return the copy's path; None if there is no
    compiled box. An existing copy is replaced unless its bytes are the binary's."""
    if binary is None:
        binary = compiled_box()
    if binary is None:
        return None
    if not os.path.isfile(binary):
        raise ValueError(f"binary must be an existing file, got {binary!r}")
    os.makedirs(directory, exist_ok=True)
    os.chmod(directory, 0o711)  # whatever the umask made of it
    target = os.path.join(directory, os.path.basename(binary))
    same = os.path.isfile(target) and not os.path.islink(target)
    same = same and filecmp.cmp(binary, target, shallow=False)
    if not same:
        _remove_stale_temps(Path(directory))
        fd, tmp = tempfile.mkstemp(prefix=".box-", dir=directory)
        os.close(fd)
        try:
            shutil.copyfile(binary, tmp)
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


_STALE_TEMP_S = 600.0
"""A `.box-*` temporary file this old is left over from a build or copy that was killed (each takes seconds)."""


def _remove_stale_temps(directory: Path) -> None:
    """Remove `.box-*` temporary files that builds or copies killed half-way left in `directory`."""
    cutoff = time.time() - _STALE_TEMP_S
    for leftover in directory.glob(".box-*"):
        with contextlib.suppress(OSError):
            if not leftover.is_symlink() and leftover.is_file() and leftover.stat().st_mtime < cutoff:
                leftover.unlink()


def _build(compiler: tuple[str, ...], target: Path) -> str | None:
    """Compile into `target` (atomically: concurrent builders race harmlessly); why it failed, or None."""
    _remove_stale_temps(target.parent)
    fd, tmp = tempfile.mkstemp(prefix=".box-", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([*compiler, *FLAGS, "-o", tmp, str(BOX_C)], capture_output=True, timeout=120,
                              check=False)  # fmt: skip
        if done.returncode != 0:
            why = done.stderr.decode(errors="replace")[-2000:]
            return f"{' '.join(compiler)} failed to build the box: {why}"
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _private(path: Path, kind: object) -> bool:
    """Whether `path` is of `kind` (stat.S_ISDIR / S_ISREG), not a symlink, this user's, and writable by
    no one else."""
    st = os.lstat(path)
    is_kind = bool(kind(st.st_mode))  # type: ignore[operator]
    return is_kind and st.st_uid == os.geteuid() and not st.st_mode & 0o022


@lru_cache(maxsize=8)
def _digest(compiler: tuple[str, ...]) -> str:
    """Names the binary: a hash of the source, the compiler (command and version line) and the flags."""
    try:
        done = subprocess.run([*compiler, "--version"], capture_output=True, timeout=30, check=False)
        version = done.stdout.decode(errors="replace").partition("\n")[0]
    except (OSError, subprocess.SubprocessError):
        version = ""
    parts = (BOX_C.read_bytes(), " ".join(compiler).encode(), version.encode(), " ".join(FLAGS).encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]


def _remember(key: str, value: None, why: str) -> None:
    if key not in _built:
        log.warning("orchard: the compiled box is unavailable (%s); sandboxes run the Python box instead "
                    "(~10 ms more CPU per sandbox; a bubblewrap per command where the image has no python3)",
                    why)  # fmt: skip
    _built[key] = value
    return value
