"""Fixtures of the env tests. A test that needs what the machine lacks skips via `_box.requires`, and fails on CI
(the root `tests/conftest.py`)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def redis_url():
    """A real redis-server for the session: a free loopback port, no persistence, killed at the end. Missing
    redis-server fails the test (CI promises it; scripts/setup installs it)."""
    from _redis import start_redis_server

    with start_redis_server() as url:
        yield url
