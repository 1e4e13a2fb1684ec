"""How a repository's tests are run and read, the same way at generation (a local temporary directory) and at
scoring (a sandbox): ``python -m pytest -q -p no:cacheprovider -rA <ids>``, one line per test in the summary.

``python -m`` puts the working directory (the repository root) first on ``sys.path``, so the package imports
without being installed; ``-p no:cacheprovider`` and ``PYTHONDONTWRITEBYTECODE`` keep the run from writing
into the repository.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

PYTEST_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
"""Environment of every test run (no bytecode in the repository; a fixed hash seed for set order)."""

_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\s+(\S+)")


def pytest_argv(python: str, test_ids: Sequence[str]) -> list[str]:
    """The argv that runs ``test_ids`` (all tests when empty) with ``python`` in the repository root."""
    if not isinstance(python, str) or not python:
        raise ValueError(f"python must be a non-empty str, got {python!r}")
    if isinstance(test_ids, str) or not all(isinstance(t, str) and t for t in test_ids):
        raise ValueError(f"test_ids must be a sequence of non-empty str, got {test_ids!r:.120}")
    return [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "--color=no", "--", *test_ids]


def parse_test_results(output: str, test_ids: Sequence[str]) -> dict[str, bool]:
    """Which of ``test_ids`` passed, read from the ``-rA`` summary of a pytest run.

    A test passed iff the summary has a ``PASSED <id>`` line for it and no other; a test that failed, errored, was
    skipped, xfailed or xpassed, or never ran (a collection error, a timeout, an id that no longer exists) did not. Parametrised ids match as
    given (``test_f[1]``).
    """
    if isinstance(test_ids, str):
        raise ValueError(f"test_ids must be a sequence of test ids, got {test_ids!r:.120}")
    passed: set[str] = set()
    failed: set[str] = set()
    for line in output.splitlines():
        match = _OUTCOME.match(line)
        if match is None:
            continue
        # pytest appends " - <message>" to failures; node ids hold no spaces except inside parameters
        (passed if match.group(1) == "PASSED" else failed).add(match.group(2))
    return {t: t in passed and t not in failed for t in test_ids}
