"""Build the compiled box (`box.c`) once per machine, and put a copy where a service's sandboxes can run it.

`compiled_box()` compiles `box.c` with the system's C compiler (`$CC`, else `cc`, `gcc` or `clang`),
statically linked so that it runs in any image, into a per-user cache (`$ORCHARD_CACHE_DIR`, else
`$XDG_CACHE_HOME/orchard`, else `~/.cache/orchard`), named by a hash of the source and the compiler, and
returns its path; later calls (and later processes) reuse it. Without a compiler, or when the build fails,
it returns None and logs why once: the service then runs the Python box (`box.py`) under the image's
python3, which behaves the same and costs ~10 ms more CPU per sandbox.

`install_box(directory)` copies the binary into a directory the sandboxes' uids can reach (the cache is
usually private to the service's user), mode 0755, and returns the copy's path. bubblewrap binds it
read-only at `BOX_MOUNT` in each sandbox.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

BOX_C = Path(__file__).with_name("box.c")
BOX_MOUNT = "/.orchard-box"
"""Where the compiled box is bound (read-only) in a sandbox."""

_FLAGS = ("-O2", "-static", "-s", "-Wall", "-Wextra", "-Werror")
_lock = threading.Lock()
_built: dict[str, str | None] = {}


def cache_dir() -> Path:
    """The per-user directory compiled boxes are kept in."""
    if os.environ.get("ORCHARD_CACHE_DIR"):
        return Path(os.environ["ORCHARD_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "orchard"
    return Path.home() / ".cache" / "orchard"


def find_compiler() -> str | None:
    """The C compiler to build the box with: `$CC`, else the first of cc, gcc, clang on PATH."""
    for name in ([os.environ["CC"]] if os.environ.get("CC") else []) + ["cc", "gcc", "clang"]:
        found = shutil.which(name)
        if found:
            return found
    return None


def compiled_box(cache: str | os.PathLike[str] | None = None) -> str | None:
    """Path of the compiled box (built on first use and cached), or None where it cannot be built.

    Args:
        cache: directory to keep the binary in (default: `cache_dir()`).
    """
    compiler = find_compiler()
    if compiler is None:
        return _remember("", None, "no C compiler (cc, gcc, clang) on PATH")
    directory = Path(cache) if cache is not None else cache_dir()
    target = directory / f"box-{_digest(compiler)}"
    key = str(target)
    with _lock:
        if key in _built:
            return _built[key]
        if target.is_file() and os.access(target, os.X_OK):
            _built[key] = str(target)
            return str(target)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".box-", dir=directory)
            os.close(fd)
            try:
                done = subprocess.run([compiler, *_FLAGS, "-o", tmp, str(BOX_C)], capture_output=True,
                                      timeout=120, check=False)  # fmt: skip
                if done.returncode != 0:
                    why = done.stderr.decode(errors="replace").strip()[-2000:]
                    return _remember(key, None, f"{compiler} failed to build the box: {why}")
                os.chmod(tmp, 0o755)
                os.replace(tmp, target)  # atomic: concurrent builders race harmlessly
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except (OSError, subprocess.SubprocessError) as e:
            return _remember(key, None, f"cannot build the box in {str(directory)!r}: {e}")
        _built[key] = str(target)
        return str(target)


def install_box(directory: str | os.PathLike[str], binary: str | None = None) -> str | None:
    """Copy the compiled box (`binary`, default `compiled_box()`) into `directory` (created if missing),
    mode 0755, and return the copy's path; None if there is no compiled box."""
    if binary is None:
        binary = compiled_box()
    if binary is None:
        return None
    if not os.path.isfile(binary):
        raise ValueError(f"binary must be an existing file, got {binary!r}")
    os.makedirs(directory, mode=0o711, exist_ok=True)
    target = os.path.join(directory, os.path.basename(binary))
    if not os.path.isfile(target) or os.path.getsize(target) != os.path.getsize(binary):
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


@lru_cache(maxsize=8)
def _digest(compiler: str) -> str:
    """Names the binary: a hash of the source, the compiler (path and version line) and the flags."""
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, timeout=30, check=False)
        version = done.stdout.decode(errors="replace").partition("\n")[0]
    except (OSError, subprocess.SubprocessError):
        version = ""
    parts = (BOX_C.read_bytes(), compiler.encode(), version.encode(), " ".join(_FLAGS).encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]


def _remember(key: str, value: None, why: str) -> None:
    if key not in _built:
        log.warning("orchard: the compiled box is unavailable (%s); sandboxes run the Python box instead, "
                    "which costs ~10 ms more CPU per sandbox", why)  # fmt: skip
    _built[key] = value
    return value
