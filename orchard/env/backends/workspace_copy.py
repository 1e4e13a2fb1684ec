"""Copies of a workspace directory: how the local backend takes snapshots and makes forks.

The mechanism is `cp -a --reflink=auto` (GNU coreutils). On a file system with reflinks (btrfs, XFS with
reflink=1, bcachefs, overlayfs over one of them) each file of the copy shares its blocks with the original until
one of the two is written: a copy-on-write clone that costs metadata only. Elsewhere (ext4, tmpfs) the same command
copies the data, in the kernel (`copy_file_range`), with no buffer in this process. Either way every file of the
copy is an inode of its own, so the copy is isolated from its original: a write, a truncation, a `chmod` or a
`rename` in one is never seen in the other, whatever process makes it and however it opens the file.

Why not a hard-link farm (a tree of links to the original's inodes, cheaper still on every file system): linked
names share one inode, so a sandbox that appends to a file (`>>`), truncates it, writes it in place (`open(...,
"r+")`, `mmap`, `sqlite3`) or changes its mode changes it in every other tree that links it. Breaking the link on
open-for-write would need every open in the sandbox to be intercepted (a FUSE layer or an LD_PRELOAD shim, which a
static binary bypasses); bubblewrap does not do that. A farm is therefore not isolated, and is not used.

`cp -a` keeps what a workspace holds: directories, regular files with their permission bits and times, symbolic
links as links (never followed), hard links between files of the tree (as links between the copies), FIFOs.
Extended attributes are kept where the target file system takes them. The copy's owner is then set to the
sandbox's uid when the service gives each sandbox one (as root), since a fork runs as a uid of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import secrets
import shutil
import subprocess

from orchard.env.backends.base import BackendError

FICLONE = 0x40049409
"""The Linux ioctl that clones one file's blocks into another (what `cp --reflink` uses)."""


def _run_sync(argv: list[str]) -> None:
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              check=False)
    except FileNotFoundError as exc:
        raise BackendError(f"copying a workspace needs GNU coreutils' {argv[0]!r} on the service's PATH") from exc
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip()[:500]
        raise BackendError(f"{argv[0]} exited {done.returncode}: {said}")


async def _run(*argv: str) -> None:
    # a thread with subprocess.run, not the event loop's subprocess support: under uvloop that forks the whole
    # service per process (see benchmarks/README.md, env_backend.py)
    await asyncio.to_thread(_run_sync, list(argv))


async def copy_tree(src: str, dst: str, *, owner: int | None = None) -> None:
    """Copy the directory `src` to `dst`, which must not exist, with `cp -a --reflink=auto`; then, with
    `owner`, make every entry of the copy belong to uid and gid `owner` (links themselves, never their targets).
    A failed copy removes what it made and raises `BackendError` with cp's message.

    Raises:
        FileNotFoundError: `src` is not a directory.
        FileExistsError: `dst` exists.
        BackendError: cp or chown failed (a full disk, a file cp cannot read).
    """
    if not os.path.isdir(src) or os.path.islink(src):
        raise FileNotFoundError(f"no directory {src!r} to copy")
    if os.path.lexists(dst):
        raise FileExistsError(f"{dst!r} exists")
    try:
        await _run("cp", "-a", "--reflink=auto", "--no-target-directory", "--", src, dst)
        if owner is not None:
            await _run("chown", "-R", "-P", "-h", f"{owner}:{owner}", "--", dst)
    except BaseException:
        await asyncio.to_thread(shutil.rmtree, dst, True)
        raise


def reflinks_work(directory: str) -> bool:
    """Whether the file system of `directory` clones files copy-on-write (FICLONE), probed with two small
    temporary files. What `/resources` reports as the local backend's `workspace_copies`."""
    base = os.path.join(directory, f".reflink-probe-{secrets.token_hex(4)}")
    try:
        with open(base + "-a", "wb") as a:
            a.write(b"x" * 4096)
        with open(base + "-a", "rb") as a, open(base + "-b", "wb") as b:
            fcntl.ioctl(b.fileno(), FICLONE, a.fileno())
        return True
    except OSError:
        return False
    finally:
        for suffix in ("-a", "-b"):
            with contextlib.suppress(OSError):
                os.unlink(base + suffix)
