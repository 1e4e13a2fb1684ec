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
_PASSING = ("PASSED", "XFAIL")
"""The outcomes that pass a test: SWE-bench's harness counts an expected failure (``XFAIL``) as passed."""
_SUMMARY = re.compile(r"^=+ short test summary info =+$")
"""The header of the ``-rA`` summary; only the lines after its last occurrence are read."""
_SUBTEST_FAILED = re.compile(r"\bSUB(?:FAIL(?:ED)?|ERROR)\b")
"""A failed subtest's summary word: pytest >= 9 writes ``SUBFAILED[msg] (k=v) <id> - ...``, the pytest-subtests
plugin ``[msg] (k=v) SUBFAIL <id> - ...``."""


def pytest_argv(python: str, test_ids: Sequence[str]) -> list[str]:
    """The argv that runs ``test_ids`` (all tests when empty) with ``python`` in the repository root."""
    if not isinstance(python, str) or not python:
        raise ValueError(f"python must be a non-empty str, got {python!r}")
    if isinstance(test_ids, str) or not all(isinstance(t, str) and t for t in test_ids):
        raise ValueError(f"test_ids must be a sequence of non-empty str, got {test_ids!r:.120}")
    return [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "--color=no", "--", *test_ids]


def parse_test_results(output: str, test_ids: Sequence[str], *, exit_code: int | None = None) -> dict[str, bool]:
    """Which of ``test_ids`` passed, read from the ``-rA`` summary of a pytest run and its exit code.

    Only the summary is read (the lines after the last ``short test summary info`` header): a line the tests
    printed elsewhere (``PASSED <id>`` in captured output) is no verdict. A test passed iff the summary has a
    ``PASSED <id>`` or ``XFAIL <id>`` line for it (an expected failure passes, as the SWE-bench harness counts it)
    and no line of another outcome naming it: a test that failed, errored (also ``PASSED`` then ``ERROR`` when a
    fixture's teardown raised), was skipped or xpassed, has a failed subtest (a ``SUBFAILED`` / ``SUBFAIL`` line
    naming it, even next to its own ``PASSED``: pytest before 9 with the pytest-subtests plugin reports the test
    passed), or never ran (a collection error, a timeout, an id that no longer exists) did not. Parametrised ids
    match as given (``test_f[1]``).

    The exit code is the check on the summary: a run that exited non-zero although the summary names no failure
    of any of ``test_ids`` failed for a reason the summary does not show (a collection error in another file, a
    hook, a crash after the summary was written), so none of them counts as passed. When the summary does name a
    failure, the run's status is explained and each test keeps its own line's verdict.

    Args:
        output: the run's standard output.
        test_ids: the pytest node ids to read, each a non-empty str.
        exit_code: the run's exit status; None when unknown (the summary alone decides).

    Raises:
        ValueError: ``output`` is not a str, ``test_ids`` not a sequence of non-empty str, or ``exit_code`` not
            an int or None.
    """
    if not isinstance(output, str):
        raise ValueError(f"output must be a str, got {type(output).__name__}")
    if isinstance(test_ids, str) or not isinstance(test_ids, Sequence) or not all(
            isinstance(t, str) and t for t in test_ids):
        raise ValueError(f"test_ids must be a sequence of non-empty str, got {test_ids!r:.120}")
    if exit_code is not None and (isinstance(exit_code, bool) or not isinstance(exit_code, int)):
        raise ValueError(f"exit_code must be an int or None, got {exit_code!r}")
    lines = output.splitlines()
    headers = [i for i, line in enumerate(lines) if _SUMMARY.match(line)]
    summary = lines[headers[-1] + 1:] if headers else []
    passed: set[str] = set()
    failed: set[str] = set()
    for line in summary:
        match = _OUTCOME.match(line)
        if match is not None:
            # pytest appends " - <message>" to failures; node ids hold no spaces except inside parameters
            (passed if match.group(1) in _PASSING else failed).add(match.group(2))
        elif (sub := _SUBTEST_FAILED.search(line)) is not None:
            # the subtest's description may hold spaces: the line names each id it is about as a whole word,
            # followed by the message or the line's end
            rest = line[sub.start():]
            failed.update(t for t in test_ids if re.search(rf"\s{re.escape(t)}(?:\s+-\s|\s*$)", rest))
    results = {t: t in passed and t not in failed for t in test_ids}
    if exit_code not in (None, 0) and not failed.intersection(test_ids):
        return dict.fromkeys(test_ids, False)
    return results
