"""Tar archives for the archive upload's tests: a normal repository-like tree, and one bad member at a time."""

from __future__ import annotations

import io
import tarfile

MTIME = 946684800  # 2000-01-01T00:00:00Z


def tar_of(*members: tuple[str, str, object], gz: bool = False) -> bytes:
    """A tar of (name, kind, value): kind "dir" (value: mode), "file" ((bytes, mode)), "symlink" / "hardlink"
    (value: the link's target), "fifo" / "chr" (value ignored)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz" if gz else "w") as tar:
        for name, kind, value in members:
            info = tarfile.TarInfo(name)
            info.mtime = MTIME
            data = b""
            if kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, value
            elif kind == "file":
                data, info.mode = value
                info.size = len(data)
            elif kind in ("symlink", "hardlink"):
                info.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
                info.linkname = value
            else:
                info.type = tarfile.FIFOTYPE if kind == "fifo" else tarfile.CHRTYPE
            tar.addfile(info, io.BytesIO(data) if data else None)
    return buffer.getvalue()


TREE = (
    ("./", "dir", 0o755),
    ("pkg", "dir", 0o755),
    ("pkg/__init__.py", "file", (b"", 0o644)),
    ("pkg/core.py", "file", (b"def add(a, b):\n    return a + b\n", 0o644)),
    ("run.sh", "file", (b"#!/bin/sh\necho ran\n", 0o755)),
    ("empty", "dir", 0o700),
    (".git", "dir", 0o755),
    (".git/HEAD", "file", (b"ref: refs/heads/main\n", 0o644)),
    (".git/refs/heads", "dir", 0o755),
    (".git/objects/ab/cdef", "file", (b"\x78\x01binary\x00object", 0o444)),
    ("pkg/core_link.py", "symlink", "core.py"),
    ("pkg_link", "symlink", "pkg"),
    ("pkg/hard.py", "hardlink", "pkg/core.py"),
)
"""A repository in miniature: modes 755 / 700 / 444, an empty directory, a ``.git`` directory with an empty one
inside, a link inside a directory and one to a directory, a hard link."""

TREE_FILES = {"pkg/__init__.py": (b"", 0o644), "pkg/core.py": (b"def add(a, b):\n    return a + b\n", 0o644),
              "run.sh": (b"#!/bin/sh\necho ran\n", 0o755), ".git/HEAD": (b"ref: refs/heads/main\n", 0o644),
              ".git/objects/ab/cdef": (b"\x78\x01binary\x00object", 0o444),
              "pkg/hard.py": (b"def add(a, b):\n    return a + b\n", 0o644)}
"""The regular files `TREE` unpacks to, with content and mode."""

TREE_BYTES = 0 + 32 + 19 + 21 + 15
"""The file bytes `TREE` writes: __init__.py, core.py, run.sh, HEAD, the object (a hard link writes none)."""

BAD = {
    "dotdot": (("../evil.txt", "file", (b"x", 0o644)),),
    "dotdot_inside_name": (("pkg/../../evil.txt", "file", (b"x", 0o644)),),
    "absolute": (("/tmp/evil.txt", "file", (b"x", 0o644)),),
    "symlink_absolute": (("link", "symlink", "/etc/passwd"),),
    "symlink_climbs_out": (("pkg", "dir", 0o755), ("pkg/link", "symlink", "../../outside")),
    "symlink_through_a_link": (("sub", "dir", 0o755), ("sub/self", "symlink", "."),
                               ("link", "symlink", "sub/self/../..")),
    "written_through_a_link": (("link", "symlink", "."), ("link/evil.txt", "file", (b"x", 0o644))),
    "hardlink_out": (("link", "hardlink", "../outside/secret.txt"),),
    "hardlink_absolute": (("link", "hardlink", "/etc/passwd"),),
    "hardlink_to_nothing_in_the_archive": (("link", "hardlink", "elsewhere.txt"),),
    "fifo": (("pipe", "fifo", None),),
    "device": (("tty", "chr", None),),
}
"""Each a member (with what it needs before it) that leaves the destination or is special."""


def bad_archive(name: str) -> bytes:
    """`BAD`'s archive ``name`` after a good file, ``good.txt``: when it is refused, that file is not written."""
    return tar_of(("good.txt", "file", (b"good", 0o644)), *BAD[name])


def gnu_sparse(name: str, data: bytes, realsize: int) -> bytes:
    """A tar of ``good.txt`` then one old-GNU sparse member (type ``S``) ``name``: ``data`` stored, mapped at
    offset 0, and a hole of zeros after it up to ``realsize``, the size tarfile reports. Hand-built, as tarfile
    writes no sparse member: tarfile's GNU header of a plain file with the type, the first sparse-map entry and
    the real size patched in."""
    tar = tar_of(("good.txt", "file", (b"good", 0o644)), (name, "file", (data, 0o644)))
    at = 1024  # good.txt's header and its 4 bytes padded to a block
    header = bytearray(tar[at : at + 512])
    header[156:157] = tarfile.GNUTYPE_SPARSE
    header[386:410] = b"%011o\0" % 0 + b"%011o\0" % len(data)  # sparse map entry 0: (offset, numbytes)
    header[483:495] = b"%011o\0" % realsize  # the member's real (expanded) size
    header[148:156] = b" " * 8  # the checksum is the byte sum with its own field as spaces
    header[148:155] = b"%06o\0" % sum(header)
    return tar[:at] + bytes(header) + tar[at + 512 :]


def pax_sparse(name: str, data: bytes, realsize: int) -> bytes:
    """A tar of ``good.txt`` then one PAX (GNU 1.0) sparse member ``name``: ``data`` mapped at offset 0, a hole
    up to ``realsize``. The map ("1 entry: offset 0, ``len(data)`` bytes") is a block before the data, as GNU
    tar writes it."""
    sparse_map = f"1\n0\n{len(data)}\n".encode().ljust(512, b"\0")
    info = tarfile.TarInfo(f"GNUSparseFile.0/{name}")
    info.size, info.mtime, info.mode = len(sparse_map) + len(data), MTIME, 0o644
    info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": name,
                        "GNU.sparse.realsize": str(realsize)}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        good = tarfile.TarInfo("good.txt")
        good.size, good.mtime = 4, MTIME
        tar.addfile(good, io.BytesIO(b"good"))
        tar.addfile(info, io.BytesIO(sparse_map + data))
    return buffer.getvalue()
