"""`StepProgress`: a line at the first step, then one per interval and at the last in a log; redrawn in place on a
terminal; the ETA from the mean time per step so far; tokens/s from the steps' ``tokens/total``."""

import io

import pytest

from orchard.train import progress as progress_module
from orchard.train.progress import StepProgress, format_duration


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", fake)
    return fake


def test_a_log_gets_the_first_step_one_line_per_interval_and_the_last(clock):
    out = io.StringIO()
    p = StepProgress("sft", 10, interval_s=30, stream=out)
    for step in range(1, 11):
        clock.now += 10  # 10 s a step, 200 tokens a step
        p.update(step, {"loss/total": 2.0 / step, "tokens/total": 200})
    lines = out.getvalue().splitlines()
    # step 1 at t=10 s; then the first step 30 s or more after the last line: 4 (t=40), 7 (t=70), 10 (t=100, last)
    assert [line.split("  ")[0] for line in lines] == ["sft: step 1/10", "sft: step 4/10", "sft: step 7/10",
                                                         "sft: step 10/10"]
    # after step 4: 40 s for 4 steps -> 10 s a step x 6 left = 1m00s; 800 tokens / 40 s = 20 tok/s; loss 2/4
    assert lines[1] == "sft: step 4/10  loss 0.5000  20 tok/s  elapsed 40s  ETA 1m00s"
    assert lines[-1].endswith("elapsed 1m40s  done")


def test_a_terminal_line_is_redrawn_every_step_and_ended_once(clock):
    out = Terminal()
    p = StepProgress("rl", 3, stream=out)
    for step in (1, 2):
        clock.now += 1
        p.update(step)
    p.close()
    text = out.getvalue()
    assert text.count("\r\033[K") == 2 and text.endswith("\n") and text.count("\n") == 1
    assert "rl: step 2/3" in text and "ETA 1s" in text


def test_a_resumed_run_counts_only_its_own_steps_for_the_eta(clock):
    out = io.StringIO()
    p = StepProgress("sft", 10, start=8, stream=out)
    clock.now += 5
    p.update(9)  # one step of 5 s done here, one left
    assert out.getvalue().strip().endswith("ETA 5s")


def test_nothing_is_written_when_disabled_and_bad_arguments_are_named(clock):
    out = Terminal()
    p = StepProgress("x", 2, stream=out, enabled=False)
    p.update(2)
    p.close()
    assert out.getvalue() == ""
    with pytest.raises(ValueError, match="total"):
        StepProgress("x", 0)
    with pytest.raises(ValueError, match="start"):
        StepProgress("x", 2, start=3)
    with pytest.raises(ValueError, match="interval_s"):
        StepProgress("x", 2, interval_s=0)
    with pytest.raises(ValueError, match="step"):
        StepProgress("x", 2).update(3)


def test_durations_read_as_a_person_writes_them():
    assert [format_duration(s) for s in (0, 59.4, 61, 3725)] == ["0s", "59s", "1m01s", "1h02m"]
    assert format_duration(float("nan")) == "?" and format_duration(-1) == "?"
