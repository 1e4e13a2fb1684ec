"""Shared helpers of the env tests: what a test needs from the machine, and the compiled box.

A test that needs bubblewrap, root or a C compiler is skipped where the machine lacks it, except on CI (the
`CI` environment variable set, as CI runs): there it fails, since a CI run that skips the isolation tests would
pass without having tested the isolation it promises. The failure is raised by `conftest.py`.

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

ON_CI = bool(os.environ.get("CI"))
MISSING_MARK = "missing_requirement"
"""The mark `conftest.py` turns into a failure (registered there)."""


def requires(problem: str | None, what: str) -> pytest.MarkDecorator:
    """A mark for a test that needs `what` ("bubblewrap", "root", ...); `problem` says why this machine lacks
    it (None: it does not). Skips where it is lacking, fails on CI."""
    if problem is None:
        return pytest.mark.skipif(False, reason=what)
    reason = f"needs {what}: {problem}"
    if ON_CI:
        return getattr(pytest.mark, MISSING_MARK)(reason=reason)
    return pytest.mark.skip(reason=reason)


def lacking(what: str, problem: str) -> NoReturn:
    """Inside a test: skip it (fail on CI) because the machine lacks `what`."""
    reason = f"needs {what}: {problem}"
    if ON_CI:
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


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
