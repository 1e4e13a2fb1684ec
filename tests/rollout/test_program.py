"""The launcher's side of a harness program: running it under a time limit."""

import asyncio
import os

from orchard.rollout.program import run_program


def test_a_program_past_its_time_is_killed_on_python_310(tmp_path, python_310_timeouts):
    # Before the fix run_program caught the builtin TimeoutError, which 3.10's wait_for does not raise: the 3.10
    # error escaped to the launcher instead of giving (None, why), which marks the unreported episodes env_error.
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(60)\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    status, why = asyncio.run(run_program("sleeper", [], env, 2.0))  # killed at 2 s, 58 s before it would end
    assert (status, why) == (None, "the harness program ran past 2 s and was killed")
