"""A short smoke run of the whole Claw recipe: embedded service started and stopped by the recipe, base eval,
SFT on teacher episodes through both harnesses, two GRPO steps, evaluation, table, metrics and plot."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SMOKE = [
    "tasks.train_per_template=2", "tasks.heldout_per_template=1", "eval.attempts=2", "sft.epochs=1",
    "sft.train.global_batch_size=6", "sft.train.micro_batch_size=6", "sft.train.optim.lr=3e-3",
    "rl.steps=2", "rl.tasks_per_step=2", "rl.group_size=2", "rl.train.global_batch_size=4",
    "rl.train.micro_batch_size=4", "model.hidden_size=32", "model.num_layers=1", "rollout.max_tokens=24",
    "rollout.concurrency=8", "threads=1",
    # The optional RL pieces ride along: partial-credit reward, a larger task pool, a KL term to the SFT policy.
    "rl.reward=score", "rl.task_pool_per_template=4",
    "rl.train.objective=[{name: policy, weight: 1.0}, {name: kl, weight: 0.05}]",
]


@pytest.mark.slow
def test_claw_recipe_smoke(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes/claw.py"), "--config", str(ROOT / "recipes/configs/claw_tiny.yaml"),
         f"output_dir={out}", *SMOKE],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out |   success" in proc.stdout
    results = json.loads((out / "results.json").read_text())["results"]
    assert set(results) == {"base", "sft", "rl"}
    for stage in results.values():
        assert set(stage) == {"react", "text"}
        for row in stage.values():
            # One task per template, every episode scored (no sandbox failures in a healthy service).
            assert row["tasks"] == 9 and row["env_errors"] == 0
            assert 0.0 <= row["pass^2"] <= row["success"] <= row["pass@2"] <= 1.0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl_rows = [r for r in rows if "rl/episodes" in r]
    assert [r["step"] for r in rl_rows] == [1, 2]
    assert all(r["rl/episodes"] == 4 for r in rl_rows)
    # Every step that trained (a group with signal) ran the kl term against the frozen starting policy.
    for r in rl_rows:
        assert ("loss/kl" in r) == (r["rl/sequences"] > 0)
        if "loss/kl" in r:
            assert r["loss/kl"] == r["loss/kl"] and r["loss/kl"] >= -1e-6
    teacher = {k: v for r in rows for k, v in r.items() if k.startswith("sft/teacher")}
    # The scripted teacher solves every train task it demonstrates (one per distinct request) in both harnesses.
    assert 9 <= teacher["sft/teacher_react_episodes"] <= 18
    assert teacher["sft/teacher_react_passed"] == teacher["sft/teacher_react_episodes"]
    assert teacher["sft/teacher_text_passed"] == teacher["sft/teacher_text_episodes"]
    assert teacher["sft/teacher_text_episodes"] == teacher["sft/teacher_react_episodes"]
    assert (out / "learning_curve.png").stat().st_size > 10_000
    assert (out / "sft" / "metrics.jsonl").exists()


def test_claw_recipe_rejects_unknown_keys_naming_them():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes/claw.py"), "rl.stepz=3"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0 and "rl.stepz" in proc.stderr


def test_episode_reward_kinds():
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        from claw import episode_reward
    finally:
        sys.path.remove(str(ROOT / "recipes"))
    episode = {"reward": -1.0, "score": 0.6}
    assert episode_reward(episode, "outcome") == -1.0
    assert episode_reward(episode, "score") == pytest.approx(0.2)
    assert episode_reward({"reward": 1.0, "score": None}, "score") == 1.0
    with pytest.raises(ValueError, match=r"rl\.reward"):
        episode_reward(episode, "shaped")
