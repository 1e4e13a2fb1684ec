"""benchmarks/gui_learning.py's reading of the recipe's outputs: the counts beside the table (the teacher's row, RL
counts summed over steps) and the table itself, on hand-made results of two seeds."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # as the benchmarks import each other
import gui_learning  # noqa: E402


def rl_row(step: int, budget: int, **counts: float) -> dict[str, float]:
    return {"step": step, "rl/step_budget": float(budget), "rl/success": 0.0, **{f"rl/{k}": v for k, v in counts.items()}}


def test_run_counts_reads_the_teacher_row_and_sums_rl_steps():
    rows = [
        {"step": 0, "eval/base/gui/success": 0.0},  # an evaluation row: no count
        {"step": 0, "sft/curated_tasks": 8.0, "sft/samples": 32.0, "sft/teacher_episodes": 32.0,
         "sft/teacher_passed": 24.0, "sft/teacher_captcha_blocked": 0.0, "sft/teacher_judge_failures": 1.0},
        rl_row(1, 15, episodes=8.0, removed=2.0, captcha_blocked=1.0, judge_failures=1.0, format_failures=3.0),
        rl_row(2, 30, episodes=8.0, removed=1.0, captcha_blocked=1.0, judge_unparseable=0.0, format_failures=5.0),
    ]
    counts = gui_learning.run_counts(rows)
    assert counts == {
        "teacher_episodes": 32.0, "teacher_passed": 24.0, "curated_tasks": 8.0, "samples": 32.0,
        "teacher_captcha_blocked": 0.0, "teacher_judge_failures": 1.0,
        # 8 + 8 episodes, 2 + 1 removed, 1 + 1 captcha-blocked, 1 + (absent: 0) judge failures, 3 + 5 format
        "rl_episodes": 16.0, "rl_removed": 3.0, "rl_captcha_blocked": 2.0, "rl_judge_failures": 1.0,
        "rl_judge_unparseable": 0.0, "rl_format_failures": 8.0, "rl_steps": 2.0,
    }
    # a run without RL has no RL counts (not zeros: nothing was measured)
    assert "rl_episodes" not in gui_learning.run_counts(rows[:2])


def result(base: float, sft: float, rl: float) -> dict:
    def row(success: float) -> dict[str, float]:
        return {"success": success, "pass@1": success, "pass^1": success, "tasks": 8.0, "env_errors": 0.0}

    return {"results": {"base": {"gui": row(base)}, "sft": {"gui": row(sft)}, "rl": {"gui": row(rl)}},
            "config": {"eval": {"attempts": 1}}, "wall_s": 60.0}


def test_summary_table_and_verdicts():
    # SFT 0.25 and 0.5 (mean 0.375, std |0.25 - 0.5| / sqrt(2) = 0.177); RL 0.5 and 0.75 (mean 0.625, std 0.177):
    # RL - SFT = 0.25 on each seed, above the spread 0.177. RL - base: 0.5 - 0 and 0.75 - 0.125 = 0.5, 0.625.
    runs = [result(0.0, 0.25, 0.5), result(0.125, 0.5, 0.75)]
    counts = [{"curated_tasks": 8.0}, {"curated_tasks": 6.0}]
    lines = gui_learning.summarize([3, 4], runs, counts)
    assert lines[0] == "held-out tasks per seed: 8 (x 1 attempts)"
    assert lines[2] == "| stage | success | pass@1 | pass^1 | env errors |"
    assert lines[5] == "| sft | 0.375 ± 0.177 (0.250, 0.500) | 0.375 ± 0.177 (0.250, 0.500) | " \
                       "0.375 ± 0.177 (0.250, 0.500) | 0 |"
    assert "RL - sft success = +0.250 (per seed [0.25, 0.25]), spread across seeds 0.177 -> beyond the spread" in lines
    assert "RL - base success = +0.562 (per seed [0.5, 0.625]), spread across seeds 0.177 -> beyond the spread" \
        in lines
    assert lines[-3:] == ["| count | seed 3 | seed 4 |", "|---|---|---|", "| curated_tasks | 8 | 6 |"]
