"""Reading a ``git diff`` from its text alone: the paths it touches (`patched_paths`) and a bound on what applying
it writes (`patch_write_bound`), so that nothing the agent wrote is inflated or applied on this host before it is
known to be small enough."""

from __future__ import annotations

import base64
import re
import zlib
from collections.abc import Mapping

_C_ESCAPES = {b"a": 7, b"b": 8, b"t": 9, b"n": 10, b"v": 11, b"f": 12, b"r": 13, b'"': 34, b"\\": 92}


def _git_path(text: str) -> str:
    """A path as git writes it in a diff's headers: verbatim, or in double quotes with C escapes (``\\t``, and
    ``\\303\\251`` per byte of a non-ASCII name) when it holds a quote, a backslash, a control character or
    (``core.quotePath``, git's default) a byte above 127."""
    if len(text) < 2 or text[0] != '"' or text[-1] != '"':
        return text

    def byte(escape: re.Match[bytes]) -> bytes:
        code = escape[1]
        return bytes([int(code, 8) if code[0] in b"01234567" else _C_ESCAPES.get(code, code[0])])

    raw = re.sub(rb"\\([0-7]{1,3}|.)", byte, text[1:-1].encode("utf-8", "surrogateescape"))
    return raw.decode("utf-8", "surrogateescape")


def _diff_git_names(rest: str) -> list[str]:
    """The two names of a ``diff --git`` line after its prefix: each quoted, or plain. Plain names may hold
    spaces (git does not quote them), so they are read as git apply does: a/NAME b/NAME with equal halves; a
    rename's differing names come from its ``rename from`` / ``rename to`` lines instead."""
    quoted = re.fullmatch(r'("(?:[^"\\]|\\.)*"|\S+) ("(?:[^"\\]|\\.)*"|\S+)', rest)
    if quoted and '"' in rest:
        return [_git_path(name)[2:] for name in quoted.groups()]
    half = (len(rest) - 1) // 2
    if len(rest) % 2 == 1 and rest[half] == " " and rest[:2] == "a/" and rest[half + 1:half + 3] == "b/" \
            and rest[2:half] == rest[half + 3:]:
        return [rest[2:half]]
    return [name[2:] for name in quoted.groups()] if quoted else []


def patched_paths(test_patch: str) -> list[str]:
    """The paths a ``git diff`` touches (old and new names), in order of appearance; git's quoted names
    (non-ASCII, control characters) unquoted, and names with spaces read whole."""
    paths: list[str] = []
    for line in test_patch.splitlines():
        if line.startswith("diff --git "):
            names = _diff_git_names(line[len("diff --git "):])
        else:
            header = re.match(r"^(?:rename|copy) (?:from|to) (.+)$", line)
            names = [_git_path(header[1])] if header else []
        paths += [p for p in dict.fromkeys(names) if p and p not in paths]
    return paths


def _base85_line(line: str) -> bytes | None:
    """The bytes of one line of a git binary hunk: a length character (A-Z: 1-26, a-z: 27-52), then base85
    (the alphabet of Python's ``b85``); None when malformed."""
    if not line or not line[0].isascii() or not line[0].isalpha():
        return None
    size = ord(line[0]) - (ord("A") - 1 if line[0].isupper() else ord("a") - 27)
    try:
        return base64.b85decode(line[1:])[:size]
    except ValueError:
        return None


def _delta_result_size(lines: list[str]) -> int | None:
    """The result size a git binary delta declares: its header (after zlib) is two varints, 7 bits a byte,
    least significant first, the source's size and the result's; None when it cannot be read (git apply then
    refuses the hunk too)."""
    deflated = b""
    for line in lines:  # the header is the first bytes inflated: a few lines carry it
        chunk = _base85_line(line)
        if chunk is None:
            break
        deflated += chunk
    try:
        header = zlib.decompressobj().decompress(deflated, 20)
    except zlib.error:
        return None
    sizes, value, shift = [], 0, 0
    for byte in header:
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            sizes.append(value)
            value = shift = 0
            if len(sizes) == 2:
                return sizes[1]
    return None


_BOUND_CEILING = 1 << 62
"""Where `patch_write_bound` stops counting."""


def patch_write_bound(patch: str, base_sizes: Mapping[str, int] | None = None) -> int:
    """An upper bound on the bytes ``git apply`` writes for ``patch``, read from the patch alone (nothing is
    inflated but a delta's header): its text (a text hunk adds at most its lines to a file), plus each binary
    hunk's result (a ``literal <n>``: git inflates it into exactly n bytes; a ``delta <n>``: the result size in
    its header, since a few bytes of delta can copy its source many times over; n when the header cannot be
    read), plus for each copy (``copy from``) its source: its size in ``base_sizes`` plus everything counted
    before it (which the patch may have written there). Both hunks of a binary patch count (git applies one).
    The count stops at 2**62 bytes (more than any disk holds).

    Args:
        patch: a ``git diff --binary``.
        base_sizes: path -> size, bytes, of the files the patch applies to (copies of unknown paths count only
            what the patch wrote before them). Default: none known.

    Raises:
        ValueError: ``patch`` is not a string, or ``base_sizes`` not a mapping.
    """
    if not isinstance(patch, str):
        raise ValueError(f"patch must be a str, got {type(patch).__name__}")
    if base_sizes is not None and not isinstance(base_sizes, Mapping):
        raise ValueError(f"base_sizes must be a mapping of path to size or None, got {type(base_sizes).__name__}")
    sizes = base_sizes or {}
    lines = patch.splitlines()
    bound = len(patch.encode("utf-8", "surrogateescape"))
    for i, line in enumerate(lines):
        hunk = re.fullmatch(r"(literal|delta) ([0-9]+)", line)
        copy = re.fullmatch(r"copy from (.+)", line)
        if hunk:
            # a number of thousands of digits is no size (and int() refuses to read it)
            declared = int(hunk[2]) if len(hunk[2]) <= 18 else _BOUND_CEILING
            result = _delta_result_size(lines[i + 1:i + 65]) if hunk[1] == "delta" else None
            bound += declared if result is None else result
        elif copy:
            bound += int(sizes.get(_git_path(copy[1]), 0)) + bound
        # a chain of copies doubles the count each time: past any size, it stays a small int
        bound = min(bound, _BOUND_CEILING)
    return bound

