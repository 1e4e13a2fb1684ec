"""Run test cases against variants of a toy repository, fast: a child process of the generator (standard library
only, run by file path as ``python -I -S _screen.py``), reading JSON on stdin and writing JSON on stdout.

Input: ``{"package": str, "variants": [{path: source}], "cases": [{"imports", "setup", "call", "expected",
"raises"}], "timeout_s": float}``. Output: one list per variant, one ``{"passed": bool, "got": str}`` per case,
where ``got`` is the call's ``repr`` or ``"<Exception>: <message>"``; or ``null`` for a variant that did not
finish a case within ``timeout_s``. Each variant is imported fresh from a directory of its own.

This only chooses mutations quickly; every instance is then verified with pytest itself.
"""

from __future__ import annotations

import builtins
import json
import os
import signal
import sys
import tempfile


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout


def _run_case(case, timeout_s):
    namespace = {}
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        try:
            exec(case["imports"], namespace)
            exec(case["setup"], namespace)
        except _Timeout:
            raise
        except Exception as exc:  # as in the test, only the call may raise the expected error
            return {"passed": False, "got": f"{type(exc).__name__}: {exc}"}
        try:
            value = eval(case["call"], namespace)
        except _Timeout:
            raise
        except Exception as exc:
            error = getattr(builtins, case["raises"] or "", None)
            passed = isinstance(error, type) and isinstance(exc, error)
            return {"passed": passed, "got": f"{type(exc).__name__}: {exc}"}
        if case["raises"]:
            return {"passed": False, "got": repr(value)}
        return {"passed": bool(value == eval(case["expected"], {})), "got": repr(value)}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def main():
    request = json.load(sys.stdin)
    signal.signal(signal.SIGALRM, _alarm)
    sys.dont_write_bytecode = True
    results = []
    with tempfile.TemporaryDirectory(prefix="orchard-screen-") as root:
        for index, files in enumerate(request["variants"]):
            folder = os.path.join(root, str(index))
            for path, text in files.items():
                target = os.path.join(folder, path)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "w") as handle:
                    handle.write(text)
            for name in [m for m in sys.modules if m == request["package"] or m.startswith(request["package"] + ".")]:
                del sys.modules[name]
            sys.path.insert(0, folder)
            try:
                results.append([_run_case(case, request["timeout_s"]) for case in request["cases"]])
            except _Timeout:
                results.append(None)
            finally:
                sys.path.remove(folder)
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
