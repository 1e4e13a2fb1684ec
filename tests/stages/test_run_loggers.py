"""A recipe run's metric sinks: one TensorBoard log and one W&B run per recipe run, named after it, with every
metric the run logs (evaluation, the SFT stage's steps, RL steps), each read back from what it wrote."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest
import wandb
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from orchard.data import Trajectory, render_trajectory
from orchard.data.tokenizer import build_chat_tokenizer
from orchard.models import tiny_qwen3
from orchard.stages import EvalConfig, RecipeRun, RunLog, SFTConfig
from orchard.train.metrics import WandbConfig
from orchard.train.trainer import OptimConfig, TrainConfig

_spec = importlib.util.spec_from_file_location("loggers_reader", Path(__file__).parents[1] / "train" / "test_loggers.py")
_reader = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_reader)

EVAL = EvalConfig(attempts=1, temperature=1.0, harnesses=["x"])


class Engine:
    async def update_weights(self, state_dict):
        pass

    async def close(self):
        pass


async def harness(engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
    return [Trajectory(reward=1.0, termination_reason="done", task_id=t) for t in tasks for _ in range(group_size)]


def _run(out: Path) -> None:
    """base eval (step 0), 2 SFT steps (rows 1, 2), an RL row at step 1, the RL eval at step 1: five log calls."""
    tok = build_chat_tokenizer()
    run = RecipeRun(out, seed=0, eval_cfg=EVAL, loggers=["jsonl", "tensorboard", "wandb"],
                    wandb=WandbConfig(project="orchard-test", mode="offline"), config={"seed": 0, "lr": 0.5})
    asyncio.run(run.evaluate("base", 0, {"x": harness}, Engine(), ["a"]))
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    sample = render_trajectory(Trajectory(messages=convo, reward=1.0), tok)
    cfg = SFTConfig(epochs=2, train=TrainConfig(global_batch_size=2, micro_batch_size=2, optim=OptimConfig(lr=1e-3)))
    asyncio.run(run.sft(tiny_qwen3(tok, seed=0, hidden_size=16, num_hidden_layers=1), tok, Engine(),
                        [sample, sample], cfg))
    run.log.log({"rl/success": 0.25}, 1)
    asyncio.run(run.evaluate("rl", 1, {"x": harness}, Engine(), ["a"]))
    asyncio.run(run.finish(Engine(), {"seed": 0}))


def test_one_wandb_run_and_one_tensorboard_log_per_recipe_run_with_every_metric(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "exp" / "seed0"
    _run(out)
    wandb.teardown()
    (path,) = (out / "wandb").glob("offline-run-*/run-*.wandb")  # one run for the whole recipe run
    records = list(_reader._wandb_records(path))
    (meta,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (meta.project, meta.display_name, meta.run_group) == ("orchard-test", str(out), str(out.parent))
    assert {i.key: json.loads(i.value_json) for i in meta.config.update}["lr"] == 0.5
    history = [(r.history.step.num, {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                     for i in r.history.item})
               for r in records if r.WhichOneof("record_type") == "history"]
    # W&B's step counts the log calls (it must increase); the run's own step rides along as run/step
    assert [step for step, _ in history] == [1, 2, 3, 4, 5]
    assert [h["run/step"] for _, h in history] == [0, 1, 2, 1, 1]
    assert history[0][1]["eval/base/x/success"] == 1.0 and history[3][1]["rl/success"] == 0.25
    assert "sft/loss/total" in history[1][1] and "sft/loss/total" in history[2][1]
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert {"eval/base/x/success", "sft/loss/total", "rl/success", "eval/rl/x/success"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("sft/loss/total")] == [2, 3]
    # metrics.jsonl keeps the run's own steps
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 1, 1]


def test_run_loggers_are_checked(tmp_path):
    with pytest.raises(ValueError, match="loggers must name loggers among"):
        RunLog(tmp_path, loggers=["jsonl", "progress"])
    with pytest.raises(ValueError, match="wandb must be a WandbConfig"):
        RunLog(tmp_path, loggers=["wandb"], wandb={"project": "p"})
