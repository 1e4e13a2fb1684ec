"""`benchmarks/rl_scaling.py`'s arithmetic: which steps count, and the ratios of its table (the benchmark itself
launches servers and ranks for minutes, too long for CI)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "rl_scaling", Path(__file__).resolve().parents[1] / "benchmarks" / "rl_scaling.py")
rl_scaling = importlib.util.module_from_spec(_spec)
sys.modules["rl_scaling"] = rl_scaling  # its dataclass looks its module up there
_spec.loader.exec_module(rl_scaling)


def test_summarize_measures_steps_after_the_first():
    # Steps end at 10, 12, 15 s: steps 2-3 take 5 s in all (2.5 s each); their 40 + 60 episodes -> 20 episodes/s,
    # 1000 + 1500 tokens -> 500 tokens/s; step 1's 99 episodes, 9999 tokens and its 0.9 s push do not count.
    # Syncs of steps 2-3: (0.2 + 0.3) / 2 = 0.25 s, a share of 0.25 / 2.5 = 0.1.
    result = {"step_end_s": [10.0, 12.0, 15.0], "episodes": [99.0, 40.0, 60.0], "tokens": [9999.0, 1000.0, 1500.0],
              "sync_s": [0.9, 0.2, 0.3]}
    assert rl_scaling.summarize(result) == pytest.approx(
        {"episodes_per_s": 20.0, "tokens_per_s": 500.0, "step_s": 2.5, "sync_s": 0.25, "sync_share": 0.1})


def test_summarize_of_one_step_is_zero_not_a_division_error():
    result = {"step_end_s": [3.0], "episodes": [8.0], "tokens": [64.0], "sync_s": [0.1]}
    assert set(rl_scaling.summarize(result).values()) == {0.0}


def test_table_ratios_are_against_the_one_process_synchronous_row():
    rows = {"1-inproc-sync": {"episodes_per_s": 10.0, "tokens_per_s": 640.0, "step_s": 3.2, "sync_s": 0.016,
                              "sync_share": 0.005},
            "2-2srv-async": {"episodes_per_s": 15.0, "tokens_per_s": 960.0, "step_s": 2.1, "sync_s": 0.1,
                             "sync_share": 0.0476}}
    lines = rl_scaling.table(rows).splitlines()
    assert lines[2].startswith("| 1-inproc-sync | 1 | in-process HF | sync | 10.00 | 640 | 1.00x |")
    # 960 / 640 = 1.5; 0.0476 -> 4.8 %
    assert lines[3] == "| 2-2srv-async | 2 | 2 served | async | 15.00 | 960 | 1.50x | 2.10 | 0.100 | 4.8 % |"
    assert "| - |" in rl_scaling.table({"2-1srv-sync": rows["2-2srv-async"]})  # no baseline row: no ratio


def test_row_names_cover_the_grid():
    assert [r.name for r in rl_scaling.ROWS][:3] == ["1-inproc-sync", "1-inproc-async", "1-1srv-sync"]
    assert len(rl_scaling.ROWS) == 12 and set(rl_scaling.QUICK_ROWS) <= {r.name for r in rl_scaling.ROWS}


def test_weight_gap_is_the_difference_over_the_distance_trained():
    # start 0; b moved to (3, 4): ||b - start|| = 5. a = (3, 4.5): ||a - b|| = 0.5 -> gap 0.1, max |dw| 0.5.
    start = {"w": torch.zeros(2)}
    gap, max_abs = rl_scaling.weight_gap({"w": torch.tensor([3.0, 4.5])}, {"w": torch.tensor([3.0, 4.0])}, start)
    assert gap == pytest.approx(0.1) and max_abs == pytest.approx(0.5)
    assert rl_scaling.weight_gap(start, start, start) == (0.0, 0.0)  # nothing trained: a defined 0, not a NaN
