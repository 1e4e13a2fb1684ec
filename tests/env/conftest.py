"""Turns the mark of a requirement the machine lacks into a failure (on CI only; see `_box.requires`)."""

from __future__ import annotations

import pytest
from _box import MISSING_MARK


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MISSING_MARK}(reason): the machine lacks what the test needs (CI: fail)")


def pytest_runtest_setup(item: pytest.Item) -> None:
    mark = item.get_closest_marker(MISSING_MARK)
    if mark is not None:
        pytest.fail(mark.kwargs["reason"], pytrace=False)


@pytest.fixture(scope="session")
def redis_url():
    """A real redis-server for the session: a free loopback port, no persistence, killed at the end. Missing
    redis-server fails the test (CI promises it; scripts/setup installs it)."""
    from _redis import start_redis_server

    with start_redis_server() as url:
        yield url
