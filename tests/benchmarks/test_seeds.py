"""benchmarks/_seeds.py, the learning benchmarks' shared launcher: the mean ± std cells and the RL-minus-baseline
spread on hand-computed values, the command-line arguments every benchmark takes, and real child processes run
``jobs`` at once with a log each."""

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # as the benchmarks import it
import _seeds as seeds  # noqa: E402


def test_mean_std_is_the_sample_std_over_seeds():
    # mean (0.25 + 0.5 + 0.75) / 3 = 0.5; squared deviations 0.0625 + 0 + 0.0625 = 0.125, / (3 - 1) = 0.0625,
    # sqrt = 0.25 (the population std would be sqrt(0.125 / 3) = 0.204).
    assert seeds.mean_std([0.25, 0.5, 0.75]) == "0.500 ± 0.250"
    assert seeds.mean_std([0.25, 0.5, 0.75], each=2) == "0.500 ± 0.250 (0.25, 0.50, 0.75)"
    # 0.1 and 0.3: mean 0.2, squared deviations 0.01 + 0.01 = 0.02, / 1, sqrt = 0.1414
    assert seeds.mean_std([0.1, 0.3], each=3) == "0.200 ± 0.141 (0.100, 0.300)"


def test_the_summary_printed_is_the_summary_saved(tmp_path, capsys):
    seeds.publish(tmp_path, ["| a | b |", "|---|---|", "", "RL - SFT = +0.100"])
    printed = capsys.readouterr().out
    assert printed == "| a | b |\n|---|---|\n\nRL - SFT = +0.100\n"
    assert (tmp_path / "summary.md").read_text() == printed


def test_one_seed_has_no_spread_and_no_seed_is_refused_by_name():
    assert seeds.mean_std([0.4]) == "0.400 ± 0.000"
    with pytest.raises(ValueError, match="values must be a non-empty list"):
        seeds.mean_std([])


def test_gain_and_spread():
    # gains per seed: 0.5 - 0.25, 0.5 - 0.5, 0.5 - 0.75 = 0.25, 0, -0.25; the baseline's std is 0.25 (above),
    # the treated arm's 0: the spread is the larger, 0.25.
    gain, spread = seeds.gain_and_spread([0.25, 0.5, 0.75], [0.5, 0.5, 0.5])
    np.testing.assert_allclose(gain, [0.25, 0.0, -0.25])
    assert spread == pytest.approx(0.25)
    # one seed: a gain, no spread measured
    gain, spread = seeds.gain_and_spread([0.2], [0.5])
    np.testing.assert_allclose(gain, [0.3])
    assert spread == 0.0
    with pytest.raises(ValueError, match="baseline and treated"):
        seeds.gain_and_spread([0.1, 0.2], [0.3])


def test_the_run_arguments_every_learning_benchmark_takes():
    parser = argparse.ArgumentParser()
    seeds.add_run_arguments(parser, config="x_tiny.yaml", out="x", jobs=2, jobs_help="runs at once")
    assert vars(parser.parse_args([])) == {"seeds": [0, 1, 2], "config": str(ROOT / "recipes/configs/x_tiny.yaml"),
                                           "out": str(ROOT / "runs/x"), "jobs": 2, "overrides": []}
    given = parser.parse_args(["--seeds", "3", "4", "--jobs", "1", "--out", "o", "--config", "c.yaml", "a=1", "b.c=2"])
    assert vars(given) == {"seeds": [3, 4], "config": "c.yaml", "out": "o", "jobs": 1, "overrides": ["a=1", "b.c=2"]}
    assert "runs at once" in parser.format_help()
    with pytest.raises(ValueError, match="jobs must be an int >= 1, got 0"):
        seeds.add_run_arguments(argparse.ArgumentParser(), config="x_tiny.yaml", out="x", jobs=0)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_runs_every_launch_jobs_at_once_with_a_log_each(tmp_path, capsys):
    # Each child appends its start and end to one shared file. Seeds 0 and 1 end only once both have started (a
    # barrier, bounded at 60 s): run one at a time, seed 0 would exit 1 after the bound.
    trace = tmp_path / "trace"
    barrier = (f"import sys, time; t = {str(trace)!r}; s = sys.argv[1]; open(t, 'a').write('start ' + s + chr(10)); "
               "deadline = time.monotonic() + 60\n"
               "while not {'start 0', 'start 1'} <= set(open(t).read().split(chr(10))):\n"
               "    time.sleep(0.01)\n"
               "    if time.monotonic() > deadline: sys.exit(1)\n"
               "print('seed', s); open(t, 'a').write('end ' + s + chr(10))")
    launches = [seeds.Launch(s, f"seed {s}", [*python(barrier), str(s)], tmp_path / f"seed{s}" / "stdout.log")
                for s in (0, 1, 2)]
    status = seeds.run_launches(launches, jobs=2, t0=time.monotonic(), poll_s=0.05)
    assert status == {0: 0, 1: 0, 2: 0}
    for s in (0, 1, 2):  # the log's folder is made for it
        assert (tmp_path / f"seed{s}" / "stdout.log").read_text() == f"seed {s}\n"
    events = trace.read_text().split("\n")[:-1]
    # seed 2 waits for a free slot
    assert sorted(events[:2]) == ["start 0", "start 1"]
    assert events.index("start 2") > min(events.index("end 0"), events.index("end 1"))
    out = capsys.readouterr().out
    assert out.count("+ -c") == 3 and "seed 2 done after" in out


def test_a_failure_stops_the_benchmark_or_is_recorded(tmp_path, capsys):
    fail = seeds.Launch((0, "a"), "seed 0 a", python("import sys; print('boom'); sys.exit(3)"), tmp_path / "a.log")
    ok = seeds.Launch((0, "b"), "seed 0 b", python("pass"), tmp_path / "b.log")
    with pytest.raises(SystemExit, match=f"seed 0 a failed \\(exit 3\\); see {tmp_path / 'a.log'}"):
        seeds.run_launches([fail], jobs=1, t0=time.monotonic(), poll_s=0.05)
    status = seeds.run_launches([fail, ok], jobs=1, t0=time.monotonic(), poll_s=0.05, stop_on_failure=False)
    assert status == {(0, "a"): 3, (0, "b"): 0}
    assert (tmp_path / "a.log").read_text() == "boom\n"
    assert "seed 0 a failed (exit 3)" in capsys.readouterr().out


def test_bad_arguments_are_refused_by_name(tmp_path):
    launch = seeds.Launch(0, "seed 0", python("pass"), tmp_path / "log")
    with pytest.raises(ValueError, match="jobs must be >= 1, got 0"):
        seeds.run_launches([launch], jobs=0, t0=0.0)
    with pytest.raises(ValueError, match="distinct keys"):
        seeds.run_launches([launch, launch], jobs=1, t0=0.0)
