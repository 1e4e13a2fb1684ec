"""The SWE reward reads pytest as the SWE-bench harness does, and stricter where a verdict could be faked: a
regression only a subtest sees, a fixture whose teardown raises, ``PASSED`` lines a patch prints into the captured
output, and a run whose exit status says it failed while its summary lists every test passed are all not resolved.
The parser is checked on summaries as pytest writes them, and the reward end to end: real pytest runs in the real
embedded sandbox service, scored by `score_sandbox`."""

import asyncio
import os
import subprocess
import sys

import pytest

from orchard.domains.swe.instances import SWEInstance
from orchard.domains.swe.sandbox import prepare_sandbox, score_sandbox
from orchard.domains.swe.testrun import PYTEST_ENV, parse_test_results, pytest_argv
from orchard.env import AsyncSandboxClient, RetryPolicy
from orchard.env.embedded import serve

HEADER = "=========================== short test summary info ============================"

# The end of a real `pytest -q -rA` run (pytest 9.2) over a test with a failing subtest, one whose fixture's
# teardown raised, and a plain passing test; the failures' tracebacks above the summary left out.
PYTEST_9 = f"""uuuF..EuF                                                                [100%]
==================================== PASSES ====================================
{HEADER}
PASSED test_s.py::test_plain
PASSED test_s.py::test_td
ERROR test_s.py::test_td - RuntimeError: teardown broke
SUBFAILED[case] (i=1) test_s.py::test_sub - assert 1 != 1
FAILED test_s.py::test_sub - contains 1 failed subtest
4 failed, 2 passed, 1 error, 2 subtests passed in 1.26s
"""


def test_a_real_pytest_9_summary_is_read_per_test():
    ids = ["test_s.py::test_plain", "test_s.py::test_td", "test_s.py::test_sub"]
    # test_td printed PASSED (its call) and ERROR (its teardown): it failed, as SWE-bench reads the later line
    expected = {"test_s.py::test_plain": True, "test_s.py::test_td": False, "test_s.py::test_sub": False}
    assert parse_test_results(PYTEST_9, ids) == expected
    assert parse_test_results(PYTEST_9, ids, exit_code=1) == expected  # the failures explain the status


@pytest.mark.parametrize("lines", [
    ["PASSED t.py::a", "ERROR t.py::a - RuntimeError: teardown broke"],  # pytest's order under -rA
    ["ERROR t.py::a - RuntimeError: teardown broke", "PASSED t.py::a"],  # the other order: no later line wins
    ["ERROR t.py::a - RuntimeError: teardown broke", "XFAIL t.py::a - known bug"],
])
@pytest.mark.parametrize("exit_code", [None, 1])
def test_a_test_reported_passed_and_error_failed_whatever_the_order(lines, exit_code):
    output = "\n".join([HEADER, *lines, "PASSED t.py::b", "1 passed, 1 error in 0.10s"])
    assert parse_test_results(output, ["t.py::a", "t.py::b"], exit_code=exit_code) == {"t.py::a": False,
                                                                                       "t.py::b": True}


@pytest.mark.parametrize("subtest_line", [
    "SUBFAILED[case] (i=1) tests/t.py::test_table - assert 1 != 1",  # pytest >= 9
    "SUBFAILED(i=1) tests/t.py::test_table",  # no message, no subtest name
    "[case with spaces] (i=1) SUBFAIL tests/t.py::test_table - assert 1 != 1",  # the pytest-subtests plugin
    "(<subtest>) SUBFAIL tests/t.py::test_table - AssertionError",
    "SUBERROR tests/t.py::test_table - KeyError: 'x'",
])
def test_a_failed_subtest_fails_its_test_even_when_the_test_itself_passed(subtest_line):
    # pytest < 9 with the pytest-subtests plugin reports the test itself PASSED next to its failed subtests
    output = "\n".join([HEADER, "PASSED tests/t.py::test_table", subtest_line, "PASSED tests/t.py::test_other",
                        "1 failed, 2 passed in 0.10s"])
    ids = ["tests/t.py::test_table", "tests/t.py::test_other"]
    assert parse_test_results(output, ids) == {"tests/t.py::test_table": False, "tests/t.py::test_other": True}
    assert parse_test_results(output, ids, exit_code=1) == {"tests/t.py::test_table": False,
                                                           "tests/t.py::test_other": True}


def test_a_subtest_line_names_whole_ids_only():
    # test_p[10]'s failed subtest says nothing of test_p[1] or of test_p (another id, a prefix of both)
    output = "\n".join([HEADER, "PASSED t.py::test_p[1]", "PASSED t.py::test_p[10]", "PASSED t.py::test_p",
                        "SUBFAILED(k=2) t.py::test_p[10] - assert 0", "SUBPASSED(k=1) t.py::test_p[1]"])
    ids = ["t.py::test_p[1]", "t.py::test_p[10]", "t.py::test_p"]
    assert parse_test_results(output, ids) == {"t.py::test_p[1]": True, "t.py::test_p[10]": False,
                                               "t.py::test_p": True}


def test_only_the_summary_is_read():
    # A patch printed PASSED lines at import; the hidden test file then failed to collect (its ERROR names the
    # file, not the test). Captured output is shown above the summary, where nothing is a verdict.
    output = "\n".join(["==================================== ERRORS ====================================",
                        "_____________________ ERROR collecting tests/test_add.py ______________________",
                        "E   ImportError: nope",
                        "------------------------------- Captured stdout --------------------------------",
                        "PASSED tests/test_add.py::test_add", HEADER, "ERROR tests/test_add.py", "1 error in 0.20s"])
    assert parse_test_results(output, ["tests/test_add.py::test_add"]) == {"tests/test_add.py::test_add": False}
    # no summary at all (a run killed before it): nothing passed
    assert parse_test_results("PASSED t.py::a\n", ["t.py::a"]) == {"t.py::a": False}
    # the last summary counts: a test's own output may hold a header and lines of its own
    faked = "\n".join([HEADER, "PASSED t.py::a", "captured text", HEADER, "FAILED t.py::a - assert 0"])
    assert parse_test_results(faked, ["t.py::a"]) == {"t.py::a": False}


def test_a_failed_exit_status_with_no_failure_in_the_summary_passes_nothing():
    output = "\n".join([HEADER, "PASSED t.py::a", "PASSED t.py::b", "2 passed in 0.01s"])
    ids = ["t.py::a", "t.py::b"]
    assert parse_test_results(output, ids, exit_code=0) == {"t.py::a": True, "t.py::b": True}
    assert parse_test_results(output, ids) == {"t.py::a": True, "t.py::b": True}  # status unknown: the summary
    for status in (1, 2, 124, -9):  # failures, an interrupted run, a timeout, a kill
        assert parse_test_results(output, ids, exit_code=status) == {"t.py::a": False, "t.py::b": False}
    # a failure the summary names explains the status: the other tests keep their verdicts
    explained = "\n".join([HEADER, "PASSED t.py::a", "FAILED t.py::b - assert 0"])
    assert parse_test_results(explained, ids, exit_code=1) == {"t.py::a": True, "t.py::b": False}


def test_an_expected_failure_passes_as_in_the_swe_bench_harness(tmp_path):
    # A real pytest run: a known bug marked xfail fails (XFAIL: passed, as SWE-bench counts it), a test marked xfail
    # passes anyway (XPASS: not passed, as in SWE-bench), a plain test passes.
    (tmp_path / "test_x.py").write_text(
        "import pytest\n\n\n@pytest.mark.xfail(reason='known bug')\ndef test_known_bug():\n    assert 1 == 2\n\n\n"
        "@pytest.mark.xfail(reason='known bug')\ndef test_fixed_anyway():\n    assert 1 == 1\n\n\n"
        "def test_plain():\n    assert True\n")
    ids = ["test_x.py::test_known_bug", "test_x.py::test_fixed_anyway", "test_x.py::test_plain"]
    run = subprocess.run(pytest_argv(sys.executable, ids), cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, **PYTEST_ENV}, timeout=120)
    assert run.returncode == 0 and "XFAIL test_x.py::test_known_bug - known bug" in run.stdout, run.stdout
    assert "XPASS test_x.py::test_fixed_anyway" in run.stdout
    assert parse_test_results(run.stdout, ids, exit_code=run.returncode) == {
        "test_x.py::test_known_bug": True, "test_x.py::test_fixed_anyway": False, "test_x.py::test_plain": True}
    # an expected failure next to another outcome of the same test (its teardown raised) did not pass
    teardown = "\n".join([HEADER, "XFAIL t.py::a - known bug", "ERROR t.py::a - RuntimeError: teardown broke"])
    assert parse_test_results(teardown, ["t.py::a"], exit_code=1) == {"t.py::a": False}


def test_an_empty_test_id_is_refused_before_it_runs_every_test(tmp_path):
    # `pytest -- ""` reads "" as the current directory and runs the whole suite: here 2 tests where 1 was asked
    (tmp_path / "test_x.py").write_text("def test_a():\n    pass\n\n\ndef test_b():\n    pass\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "--", ""],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "PASSED test_x.py::test_a" in run.stdout and "PASSED test_x.py::test_b" in run.stdout
    for ids in ([""], ["test_x.py::test_a", ""]):
        with pytest.raises(ValueError, match="test_ids must be a sequence of non-empty str"):
            pytest_argv(sys.executable, ids)
    assert pytest_argv("python3", ["test_x.py::test_a"])[-2:] == ["--", "test_x.py::test_a"]


@pytest.mark.parametrize("call, message", [
    (lambda: parse_test_results(None, ["t.py::a"]), "output"),
    (lambda: parse_test_results("", "t.py::a"), "test_ids"),
    (lambda: parse_test_results("", ["t.py::a", ""]), "test_ids"),
    (lambda: parse_test_results("", ["t.py::a"], exit_code="1"), "exit_code"),
    (lambda: parse_test_results("", ["t.py::a"], exit_code=True), "exit_code"),
])
def test_bad_arguments_are_refused_by_name(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# A repository whose P2P tests use a subtest table and a fixture with a teardown; test_patch adds the F2P test.
CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n\n\ndef close():\n    return None\n"
CALC_TESTS = """import pytest

import calc


@pytest.fixture
def session():
    yield
    calc.close()


def test_mul_table(subtests):
    for a in range(4):
        with subtests.test(a=a):
            assert calc.mul(a, 3) == 3 * a


def test_mul_in_a_session(session):
    assert calc.mul(3, 3) == 9
"""
TEST_PATCH = """diff --git a/tests/test_add.py b/tests/test_add.py
new file mode 100644
--- /dev/null
+++ b/tests/test_add.py
@@ -0,0 +1,5 @@
+import calc
+
+
+def test_add():
+    assert calc.add(2, 3) == 5
"""
FIXED = CALC.replace("a - b", "a + b")
INSTANCE = SWEInstance(
    "toy__calc-subtests", "toy/calc", "0" * 40, "add() subtracts", "", TEST_PATCH,
    ["tests/test_add.py::test_add"], ["tests/test_calc.py::test_mul_table", "tests/test_calc.py::test_mul_in_a_session"],
    files={"calc.py": CALC, "tests/test_calc.py": CALC_TESTS})
FAKE_LINES = "".join(f"print('PASSED {t}')\n" for t in INSTANCE.tests) + "raise ImportError('nothing here')\n"

PATCHES = {
    "gold": {"calc.py": FIXED},
    # add fixed, mul broken for a == 2 only: test_mul_in_a_session (3 * 3) passes, one subtest of the table fails
    "subtest_regression": {"calc.py": FIXED.replace("return a * b", "return 0 if a == 2 else a * b")},
    # add fixed, close() raises: test_mul_in_a_session is reported PASSED (its call) and ERROR (its teardown)
    "teardown_error": {"calc.py": FIXED.replace("def close():\n    return None",
                                                "def close():\n    raise RuntimeError('leaked')")},
    # nothing fixed: the module prints a PASSED line per decisive test, then fails every test file's import
    "fake_lines": {"calc.py": FAKE_LINES},
    # add fixed, and a conftest makes the run exit 1 after a summary in which every test passed
    "exit_status": {"calc.py": FIXED,
                    "conftest.py": "def pytest_sessionfinish(session, exitstatus):\n    session.exitstatus = 1\n"},
}


@pytest.fixture(scope="module")
def verdicts():
    async def episode(client, name, files):
        async with await client.create(sandbox_id=f"swe-verdict-{name.replace('_', '-')}") as sandbox:
            await prepare_sandbox(sandbox, INSTANCE)
            for path, text in files.items():
                await sandbox.upload(path, text)
            return name, await score_sandbox(sandbox, INSTANCE, timeout_s=60)

    async def main(service):
        retry = RetryPolicy(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.01)
        async with AsyncSandboxClient(service.url, service.api_key, retry=retry) as client:
            return dict(await asyncio.gather(*(episode(client, n, f) for n, f in PATCHES.items())))

    with serve() as service:
        return asyncio.run(main(service))


def test_the_gold_fix_resolves(verdicts):
    gold = verdicts["gold"]
    assert gold.resolved and gold.reward == 1.0 and all(gold.tests.values()), gold.details
    assert gold.details["exit_code"] == 0


def test_a_regression_only_a_subtest_sees_is_not_resolved(verdicts):
    verdict = verdicts["subtest_regression"]
    assert not verdict.resolved and verdict.reward == -1.0
    assert verdict.tests == {"tests/test_add.py::test_add": True, "tests/test_calc.py::test_mul_table": False,
                             "tests/test_calc.py::test_mul_in_a_session": True}
    assert "SUBFAILED" in verdict.details["output_tail"]


def test_a_test_whose_fixture_teardown_raises_failed(verdicts):
    verdict = verdicts["teardown_error"]
    assert not verdict.resolved
    assert "PASSED tests/test_calc.py::test_mul_in_a_session" in verdict.details["output_tail"]
    assert "ERROR tests/test_calc.py::test_mul_in_a_session" in verdict.details["output_tail"]
    assert verdict.tests == {"tests/test_add.py::test_add": True, "tests/test_calc.py::test_mul_table": True,
                             "tests/test_calc.py::test_mul_in_a_session": False}


def test_passed_lines_the_patch_prints_are_no_verdict(verdicts):
    verdict = verdicts["fake_lines"]
    assert "PASSED tests/test_add.py::test_add" in verdict.details["output_tail"]  # printed, above the summary
    assert not verdict.resolved and not any(verdict.tests.values())


def test_a_run_that_exits_failed_is_not_resolved_whatever_its_summary_says(verdicts):
    verdict = verdicts["exit_status"]
    assert verdict.details["exit_code"] == 1
    tail = verdict.details["output_tail"]
    assert all(f"PASSED {t}" in tail for t in INSTANCE.tests) and "FAILED" not in tail
    assert not verdict.resolved and not any(verdict.tests.values())


class NoSandbox:
    """Scoring must refuse the instance before it touches the sandbox."""

    def __getattr__(self, name):
        raise AssertionError(f"the sandbox was used: {name}")


@pytest.mark.parametrize("fail_to_pass, pass_to_pass, message", [
    ([], [], "FAIL_TO_PASS must name at least one test"),  # else resolved with nothing run: all([]) is True
    ([], ["tests/test_calc.py::test_mul_table"], "FAIL_TO_PASS must name at least one test"),
    ([""], [], "FAIL_TO_PASS must be a list of non-empty test ids"),
    (["tests/test_add.py::test_add"], ["  "], "PASS_TO_PASS must be a list of non-empty test ids"),
])
def test_an_instance_with_no_test_or_an_empty_test_id_is_not_scored(fail_to_pass, pass_to_pass, message):
    instance = SWEInstance("x-1", "toy/calc", "0" * 40, "bug", "", TEST_PATCH, fail_to_pass, pass_to_pass,
                           files={"calc.py": CALC})
    with pytest.raises(ValueError, match=message):
        asyncio.run(score_sandbox(NoSandbox(), instance))
