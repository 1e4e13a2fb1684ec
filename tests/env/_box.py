"""The compiled box for tests: built once per session (cached per user like the service's), copied into a
directory every sandbox uid can reach, removed at exit."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from functools import lru_cache

import pytest

from orchard.env.agent.box_build import install_box


@lru_cache(maxsize=1)
def box_binary() -> str | None:
    """Path of a compiled box the sandboxes' uids can run, or None without a C compiler."""
    d = tempfile.mkdtemp(prefix="orchard-boxbin-")
    os.chmod(d, 0o711)
    atexit.register(shutil.rmtree, d, True)
    return install_box(d)


needs_compiled_box = pytest.mark.skipif(box_binary() is None, reason="no C compiler to build the box")
