"""Shared helpers of the env tests: what a test needs from the machine, and the compiled box.

A test that needs bubblewrap, root or a C compiler is skipped where the machine lacks it; on CI (the `CI`
environment variable set) the root `tests/conftest.py` turns that skip into a failure, since a CI run that skips
the isolation tests would pass without having tested the isolation it promises.

The compiled box for tests is built once per session (cached per user like the service's), copied into a
directory every sandbox uid can reach, removed at exit.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from functools import lru_cache
from typing import NoReturn

import pytest

from orchard.env.agent.box_build import install_box


def requires(problem: str | None, what: str) -> pytest.MarkDecorator:
    """A mark for a test that needs `what` ("bubblewrap", "root", ...); `problem` says why this machine lacks
    it (None: it does not). Skips where it is lacking (fails on CI)."""
    return pytest.mark.skipif(problem is not None, reason=f"needs {what}: {problem}" if problem else what)


def lacking(what: str, problem: str) -> NoReturn:
    """Inside a test: skip it (fail on CI) because the machine lacks `what`."""
    pytest.skip(f"needs {what}: {problem}")


@lru_cache(maxsize=1)
def box_binary() -> str | None:
    """Path of a compiled box the sandboxes' uids can run, or None without a C compiler."""
    d = tempfile.mkdtemp(prefix="orchard-boxbin-")
    os.chmod(d, 0o711)
    atexit.register(shutil.rmtree, d, True)
    return install_box(d)


IS_ROOT = os.geteuid() == 0
needs_root = requires(None if IS_ROOT else "the tests do not run as root", "root")
needs_compiled_box = requires(None if box_binary() is not None else "no C compiler to build the box",
                              "a compiled box")
