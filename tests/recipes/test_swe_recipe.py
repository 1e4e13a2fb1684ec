"""A short smoke run of the SWE recipe (part 1): embedded service, toy instances of two templates, base evaluation
on three harnesses, the scripted teacher's trajectories (failures kept), hindsight values, credit-assigned SFT,
evaluation; its config errors; and the paper's config, loaded without running."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SMOKE = [
    "instances.train_per_template=2", "instances.heldout_per_template=1", "instances.levels=[1, 3]",
    "instances.templates=[inventory, ledger]", "teacher.attempts=3", "teacher.failure_rate=0.5",
    "rollout.max_tokens=48", "rollout.max_steps=8", "sft.epochs=1", "sft.train.global_batch_size=4",
    "sft.train.micro_batch_size=2", "model.hidden_size=32", "model.num_layers=1", "model.vocab_size=1024",
]


def recipe(*args, timeout=540):
    return subprocess.run([sys.executable, str(ROOT / "recipes/swe.py"), "--config",
                           str(ROOT / "recipes/configs/swe_tiny.yaml"), *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_swe_recipe_smoke(tmp_path):
    out = tmp_path / "run"
    proc = recipe(f"output_dir={out}", *SMOKE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads((out / "results.json").read_text())
    assert saved["config"]["sft_mode"] == "credit"
    results = saved["results"]
    assert set(results) == {"base", "sft"}
    for stage in results.values():
        # 2 templates x 1 held-out instance, each scored on every harness (the eval one never trained on).
        assert set(stage) == {"bash", "tool", "eval"}
        assert all(row["tasks"] == 2 and row["env_errors"] == 0 for row in stage.values())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    [teacher] = [r for r in rows if "sft/resolved" in r]
    # 4 train instances x 3 attempts x 2 trained harnesses, all scored; at rate 0.5 some resolve and some fail.
    assert teacher["sft/resolved"] + teacher["sft/failed"] == 24
    assert teacher["sft/resolved"] > 0 and teacher["sft/failed"] > 0
    assert teacher["sft/unvalued"] == 0  # the scripted value teacher answered every failed trajectory
    # Credit SFT also learns from failed trajectories: the value teacher found credited steps in some of them.
    assert teacher["sft/credit_trajectories"] >= 1 and teacher["sft/credit_steps"] >= teacher["sft/credit_trajectories"]
    sft_rows = [json.loads(line) for line in (out / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert sft_rows and all(r["loss/total"] == r["loss/total"] for r in sft_rows)  # finite, ran
    assert (out / "learning_curve.png").stat().st_size > 5_000


@pytest.mark.parametrize(("override", "message"), [
    ("sft_mode=credits", "sft_mode must be one of ['resolved', 'all', 'credit'], got 'credits'"),
    ("harnesses=[eval]", "harnesses must be a non-empty list among ['bash', 'tool'], got ['eval']"),
    ("sft.train.total_steps=3", "sft.train.total_steps is derived from sft.epochs; set that instead"),
    ("instances.path=x.jsonl", "instances.heldout_path must be set exactly when instances.path is"),
])
def test_config_mistakes_are_one_line(override, message):
    proc = recipe(override, timeout=300)
    assert (proc.returncode, proc.stderr) == (2, f"error: {message}\n")


def test_paper_config_loads_with_the_papers_setting(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("swe_recipe", ROOT / "recipes/swe.py")
    swe = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "swe_recipe", swe)  # dataclasses resolve the recipe's annotations there
    spec.loader.exec_module(swe)
    from orchard.train.config import load_config

    checkpoint = tmp_path / "Qwen3-30B-A3B-Thinking"
    checkpoint.mkdir()
    cfg = load_config(swe.SWEConfig, ROOT / "recipes/configs/swe.yaml", [f"model.path={checkpoint}"],
                      derived=swe.DERIVED)
    assert (cfg.model.path, cfg.model.engine, cfg.model.dtype) == (str(checkpoint), "vllm", "bfloat16")
    assert cfg.model.vllm_kwargs["max_model_len"] == 65536
    assert (cfg.sft_mode, cfg.sft.epochs, cfg.sft.max_len) == ("credit", 5, 65536)  # 64K context, left truncation
    train = cfg.sft.train
    assert (train.global_batch_size, train.engine, train.zero_stage) == (128, "deepspeed", 3)
    assert (train.optim.lr, train.optim.min_lr) == (1e-5, 1e-6)  # the cosine's peak and floor
    assert cfg.instances.path and cfg.instances.heldout_path and cfg.env_url.startswith("https://")
    assert (cfg.teacher.attempts, cfg.values.eps, cfg.eval.harnesses) == (5, 0.05, ["bash", "tool", "eval"])
    assert not hasattr(cfg, "rl")  # RL is part 2
