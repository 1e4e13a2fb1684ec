"""The embedded service's child start: the wait for its ready line is bounded even when the child prints nothing,
and every line it prints is kept."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from orchard.env.embedded import READY_PREFIX, _wait_ready


def child(script: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_a_silent_child_times_out_instead_of_blocking():
    # The child prints nothing for 60 s; the old wait blocked in readline() until it printed or exited.
    process = child("import time; time.sleep(60)")
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            _wait_ready(process, [], 0.5)
        except RuntimeError as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    try:
        waiter.start()
        waiter.join(timeout=20)  # a bound for a hang, far above the 0.5 s deadline; not a timing assertion
        assert not waiter.is_alive(), "the wait did not return while the child was silent"
        assert len(outcome) == 1 and "did not start within 0.5 s" in str(outcome[0])
    finally:
        process.kill()
        process.wait()


def test_ready_url_and_every_line_before_and_after_it_are_kept():
    process = child(f"import time; print('starting', flush=True); print('{READY_PREFIX}http://127.0.0.1:9', "
                    "flush=True); time.sleep(0.2); print('serving', flush=True)")
    output: list[str] = []
    try:
        assert _wait_ready(process, output, 60) == "http://127.0.0.1:9"
        process.wait(timeout=30)
        for _ in range(200):  # the pump thread appends the last line a moment after the child exits
            if len(output) == 3:
                break
            time.sleep(0.05)
        assert output == ["starting\n", f"{READY_PREFIX}http://127.0.0.1:9\n", "serving\n"]
    finally:
        process.kill()
        process.wait()


def test_a_child_that_exits_before_ready_is_reported_with_its_output():
    process = child("print('boom', flush=True)")
    with pytest.raises(RuntimeError, match="exited before it was ready:\nboom"):
        _wait_ready(process, [], 60)
    process.wait()

