"""RecipeRun: the frame every recipe's run shares (seeds, held-out results, the SFT hand-over, the written end)."""

import asyncio
import json
import random
from pathlib import Path

import pytest
import torch

from orchard.data import Trajectory, render_trajectory
from orchard.data.tokenizer import build_chat_tokenizer
from orchard.models import tiny_qwen3
from orchard.stages import EvalConfig, RecipeRun, RunLog, SFTConfig
from orchard.stages.ranks import Ranks
from orchard.train.trainer import OptimConfig, TrainConfig

EVAL = EvalConfig(attempts=2, temperature=0.5, harnesses=["x"])


class Engine:
    def __init__(self):
        self.pushed, self.closed = [], False

    async def update_weights(self, state_dict):
        self.pushed.append(sorted(state_dict))

    async def close(self):
        self.closed = True


async def harness(engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
    # every task: the first attempt fails (-1), the second passes (+1)
    return [Trajectory(reward=1.0 if i % 2 else -1.0, termination_reason="done", task_id=t)
            for t in tasks for i in range(group_size)]


def test_seeds_and_threads_are_set_at_the_start(tmp_path):
    threads = torch.get_num_threads()
    RecipeRun(tmp_path, seed=3, threads=1, eval_cfg=EVAL)
    drawn = (random.random(), torch.rand(1))
    random.seed(3)
    torch.manual_seed(3)
    assert drawn == (random.random(), torch.rand(1)) and torch.get_num_threads() == 1
    torch.set_num_threads(threads)


def test_a_run_keeps_each_stage_and_writes_the_results(tmp_path):
    run = RecipeRun(tmp_path, seed=0, eval_cfg=EVAL)
    engine = Engine()
    row = asyncio.run(run.evaluate("base", 0, {"x": harness, "unused": harness}, engine, ["a", "b"]))
    # a and b: 1 of 2 attempts passed each -> success 2 / 4, pass@2 = 1, pass^2 = 0
    assert row == {"x": {"success": 0.5, "pass@2": 1.0, "pass^2": 0.0, "tasks": 2, "env_errors": 0}}
    assert asyncio.run(run.finish(engine, {"seed": 0})) == {"base": row} and engine.closed
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["results"] == {"base": row} and written["config"] == {"seed": 0}
    [logged] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged["eval/base/x/success"] == 0.5 and logged["step"] == 0
    assert (tmp_path / "learning_curve.png").is_file()


def test_sft_trains_saves_and_hands_the_weights_to_the_engine(tmp_path):
    tok = build_chat_tokenizer()
    model = tiny_qwen3(tok, seed=0, hidden_size=16, num_hidden_layers=1)
    sample = render_trajectory(Trajectory(messages=[{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": "hello"}]), tok)
    cfg = SFTConfig(epochs=1, train=TrainConfig(global_batch_size=2, micro_batch_size=2, optim=OptimConfig(lr=1e-3)))
    for ranks, saved in ((Ranks(), True), (Ranks(rank=1, world_size=2), False)):
        out = tmp_path / str(ranks.rank)
        run, engine = RecipeRun(out, seed=0, eval_cfg=EVAL, ranks=ranks), Engine()
        history = asyncio.run(run.sft(model, tok, engine, [sample, sample], cfg))
        # 1 epoch x 2 samples / global batch 2 = 1 step; the engine gets every weight once, on every rank
        assert len(history) == 1 and run.sft_history is history
        assert engine.pushed == [sorted(model.state_dict())]
        # only rank 0 writes: the saved model, the log, the results
        assert (out / "sft_model" / "config.json").is_file() is saved
        asyncio.run(run.finish(engine, {}))
        assert (out / "results.json").is_file() is saved and (out / "metrics.jsonl").is_file() is saved


def test_a_policys_image_processor_is_saved_beside_it(tmp_path):
    from transformers import AutoImageProcessor

    from orchard.models import tiny_image_processor

    tok = build_chat_tokenizer()
    model, processor = tiny_qwen3(tok, seed=0, hidden_size=16, num_hidden_layers=1), tiny_image_processor()
    for ranks, saved in ((Ranks(), True), (Ranks(rank=1, world_size=2), False)):
        run = RecipeRun(tmp_path / str(ranks.rank), seed=0, eval_cfg=EVAL, ranks=ranks)
        run.save_policy(model, tok, "with", processor=processor)
        run.save_policy(model, tok, "without")
        out = tmp_path / str(ranks.rank)
        assert (out / "with" / "preprocessor_config.json").is_file() is saved  # rank 0 alone writes
        assert not (out / "without" / "preprocessor_config.json").exists()
    # the checkpoint loads its processor back, as load_image_processor does for model.path=<it>
    loaded = AutoImageProcessor.from_pretrained(tmp_path / "0" / "with", local_files_only=True)
    assert (loaded.patch_size, loaded.merge_size) == (processor.patch_size, processor.merge_size)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="seed must be an int"):
        RecipeRun(tmp_path, seed=1.5, eval_cfg=EVAL)
    with pytest.raises(ValueError, match="threads must be an int >= 0"):
        RecipeRun(tmp_path, seed=0, threads=-1, eval_cfg=EVAL)
    with pytest.raises(ValueError, match="eval_cfg must be an EvalConfig"):
        RecipeRun(tmp_path, seed=0, eval_cfg={"attempts": 2})
    with pytest.raises(ValueError, match="ranks must be a Ranks"):
        RecipeRun(tmp_path, seed=0, eval_cfg=EVAL, ranks=0)


def _previous_run(out):
    """An earlier run's files in ``out``: its metrics, results and a saved model."""
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 0, "eval/base/x/success": 0.25}\n')
    (out / "results.json").write_text('{"results": {}}')
    (out / "sft_model").mkdir()
    (out / "sft_model" / "config.json").write_text("{}")


def test_a_previous_run_is_refused_by_default_and_left_as_it_was(tmp_path):
    out = tmp_path / "run"
    _previous_run(out)
    before = sorted((p.relative_to(out), p.read_bytes() if p.is_file() else b"") for p in out.rglob("*"))
    with pytest.raises(ValueError, match=r"holds a previous run \(metrics.jsonl, results.json\).*existing=move.*"
                                         r"run\.1.*existing=resume"):
        RecipeRun(out, seed=0, eval_cfg=EVAL)
    assert sorted((p.relative_to(out), p.read_bytes() if p.is_file() else b"") for p in out.rglob("*")) == before


def test_move_puts_the_previous_run_aside_whole_and_starts_afresh(tmp_path):
    out = tmp_path / "run"
    _previous_run(out)
    run = RecipeRun(out, seed=0, eval_cfg=EVAL, existing="move")
    assert run.moved_to == tmp_path / "run.1"
    assert (tmp_path / "run.1" / "sft_model" / "config.json").is_file()
    assert (tmp_path / "run.1" / "metrics.jsonl").read_text().count("\n") == 1
    asyncio.run(run.evaluate("base", 0, {"x": harness}, Engine(), ["a"]))
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0]
    assert not (out / "sft_model").exists()
    # a third run moves the second one to the next free name
    assert RecipeRun(out, seed=0, eval_cfg=EVAL, existing="move").moved_to == tmp_path / "run.2"
    assert (tmp_path / "run.1" / "results.json").is_file()


def test_resume_keeps_the_previous_run_and_appends_to_its_metrics(tmp_path):
    out = tmp_path / "run"
    _previous_run(out)
    run = RecipeRun(out, seed=0, eval_cfg=EVAL, existing="resume")
    asyncio.run(run.evaluate("base", 1, {"x": harness}, Engine(), ["a"]))
    run.log.close()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1] and (out / "sft_model" / "config.json").is_file()


def test_a_directory_without_a_run_needs_no_choice(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "stdout.log").write_text("a launcher's log, written before the run starts\n")
    RecipeRun(tmp_path / "run", seed=0, eval_cfg=EVAL)
    assert (tmp_path / "run" / "stdout.log").is_file()
    with pytest.raises(ValueError, match="existing must be one of"):
        RecipeRun(tmp_path / "other", seed=0, eval_cfg=EVAL, existing="overwrite")


def test_the_run_log_never_truncates_an_earlier_metrics_file(tmp_path):
    _previous_run(tmp_path / "run")
    with pytest.raises(ValueError, match=r"earlier run's metrics\.jsonl"):
        RunLog(tmp_path / "run")
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1


def test_results_say_which_version_and_commit_produced_them(tmp_path, monkeypatch):
    import subprocess

    import orchard
    from orchard.stages.report import provenance

    run = RecipeRun(tmp_path / "run", seed=0, eval_cfg=EVAL)
    asyncio.run(run.finish(Engine(), {}))
    written = json.loads((tmp_path / "run" / "results.json").read_text())["provenance"]
    repo = Path(orchard.__file__).resolve().parent.parent
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert written["orchard_version"] == orchard.__version__ and written["torch"] == torch.__version__
    assert written["commit"] == head.stdout.strip() and len(written["commit"]) == 40
    assert isinstance(written["dirty"], bool)
    # orchard imported from outside a git checkout (a wheel in site-packages): the commit is unknown, not guessed
    # from whatever repository happens to enclose it (here a virtual environment inside a project's checkout)
    project = tmp_path / "project"
    site = project / ".venv" / "lib" / "site-packages" / "orchard"
    site.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    subprocess.run(["git", "-C", str(project), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "project"], check=True)
    monkeypatch.setattr(orchard, "__file__", str(site / "__init__.py"))
    assert provenance()["commit"] is None and provenance()["dirty"] is None
