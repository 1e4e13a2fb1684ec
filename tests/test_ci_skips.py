"""The root conftest's rule, run in a pytest session of its own: on CI a skip fails unless it wants CUDA."""

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT_CONFTEST = Path(__file__).resolve().parent / "conftest.py"
QUIET = ("-p", "no:asyncio")  # pytest-asyncio warns that an ini option is unset; these sessions have no ini

TESTS = """
import pytest

def test_lacks_a_tool():
    pytest.skip("needs redis-server: not on PATH")

@pytest.mark.skipif(True, reason="needs a CUDA device (run by benchmarks/gpu_check.sh)")
def test_wants_cuda():
    pass

@pytest.mark.skip(reason="a browser is missing")
def test_marked_skip():
    pass

@pytest.mark.xfail(reason="a known bug", strict=True)
def test_known_bug():
    assert False

def test_passes():
    pass
"""

MODULE_SKIP = """
import pytest

pytest.importorskip("a_module_no_one_installed")

def test_never_collected():
    pass
"""


@pytest.fixture
def session(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(ROOT_CONFTEST.read_text())
    pytester.makepyfile(test_skips=TESTS)
    return pytester


def test_on_ci_a_skip_fails_and_a_cuda_skip_stays_a_skip(session, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = session.runpytest(*QUIET, "-rA")
    # A skip inside the test fails it; a skip mark, evaluated at setup, makes a setup error.
    result.assert_outcomes(passed=1, failed=1, errors=1, skipped=1, xfailed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    # The failures name the test and the reason it skipped.
    result.stdout.re_match_lines([r"SKIPPED \[1\] test_skips.py:\d+: needs a CUDA device",
                                  r"ERROR test_skips.py::test_marked_skip - Skipped: a browser is missing",
                                  r"FAILED test_skips.py::test_lacks_a_tool - Skipped: needs redis-server: not on PATH"])


def test_without_ci_a_skip_is_a_skip(session, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    result = session.runpytest(*QUIET)
    result.assert_outcomes(passed=1, skipped=3, xfailed=1)
    assert result.ret == pytest.ExitCode.OK


@pytest.mark.parametrize("ci", ["true", None])
def test_a_module_that_skips_whole_fails_on_ci(pytester, monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    pytester.makeconftest(ROOT_CONFTEST.read_text())
    pytester.makepyfile(test_module_skip=MODULE_SKIP)
    result = pytester.runpytest(*QUIET)
    if ci is None:
        result.assert_outcomes(skipped=1)
        assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    else:
        result.assert_outcomes(errors=1)
        assert result.ret == pytest.ExitCode.INTERRUPTED
        result.stdout.fnmatch_lines(["*could not import 'a_module_no_one_installed'*"])
