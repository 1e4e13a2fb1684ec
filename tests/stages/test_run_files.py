"""What a recipe run writes for a researcher to read and reuse: every trajectory its harnesses played, by phase,
and the SFT data as it trained, with where the samples and their masks came from."""

import asyncio
import json

import datasets
import pytest
import torch

from orchard.data import Trajectory, read_jsonl, render_trajectory
from orchard.data.tokenizer import build_chat_tokenizer
from orchard.stages import EvalConfig, RecipeRun
from orchard.stages.ranks import Ranks
from orchard.stages.run_files import save_sft_data

EVAL = EvalConfig(attempts=2, temperature=0.5, harnesses=["x"])


async def harness(engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
    return [Trajectory(messages=[{"role": "user", "content": f"do {t}"}], reward=float(i), task_id=t,
                       metadata={"attempt": i}) for t in tasks for i in range(group_size)]


def test_every_trajectory_played_is_written_under_its_phase(tmp_path):
    run = RecipeRun(tmp_path / "run", seed=0, eval_cfg=EVAL)
    harnesses = run.saving({"x": harness})
    asyncio.run(run.evaluate("base", 0, harnesses, None, ["a", "b"]))
    run.phase = "rl"
    played = asyncio.run(harnesses["x"](None, ["c"], group_size=3, temperature=1.0))
    asyncio.run(run.evaluate("rl", 1, harnesses, None, ["a"]))
    assert run.phase == "rl"  # an evaluation puts the phase back
    files = tmp_path / "run" / "trajectories"
    assert sorted(p.name for p in files.iterdir()) == ["eval_base.jsonl.gz", "eval_rl.jsonl.gz", "rl.jsonl.gz"]
    base = read_jsonl(files / "eval_base.jsonl.gz")
    # 2 tasks x 2 attempts, in the order played, each with its phase and harness name beside its own metadata
    assert [(t.task_id, t.reward) for t in base] == [("a", 0.0), ("a", 1.0), ("b", 0.0), ("b", 1.0)]
    assert base[1].metadata == {"attempt": 1, "phase": "eval_base", "rollouts": "x"}
    assert [t.metadata["phase"] for t in read_jsonl(files / "rl.jsonl.gz")] == ["rl"] * 3
    assert played[0].metadata == {"attempt": 0}  # what the stage gets back is not changed
    # a second batch of a phase is appended, never replaces the first
    asyncio.run(harnesses["x"](None, ["d"], group_size=1, temperature=1.0))
    assert [t.task_id for t in read_jsonl(files / "rl.jsonl.gz")] == ["c", "c", "c", "d"]


def test_each_rank_writes_its_own_file(tmp_path):
    run = RecipeRun(tmp_path / "run", seed=0, eval_cfg=EVAL, ranks=Ranks(rank=1, world_size=2))
    run.phase = "rl"
    asyncio.run(run.saving({"x": harness})["x"](None, ["a"], group_size=1, temperature=1.0))
    assert [p.name for p in (tmp_path / "run" / "trajectories").iterdir()] == ["rl.rank1.jsonl.gz"]


def test_a_trajectory_that_cannot_be_written_fails_the_call(tmp_path):
    async def bad(engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
        return [Trajectory(task_id="a", metadata={"handle": object()})]

    run = RecipeRun(tmp_path / "run", seed=0, eval_cfg=EVAL)
    with pytest.raises(ValueError):
        asyncio.run(run.saving({"x": bad})["x"](None, ["a"], group_size=1, temperature=1.0))


def _samples(tok):
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    return [render_trajectory(Trajectory(messages=convo, reward=r, task_id=f"t{r}"), tok) for r in (1.0, 0.5)]


def test_sft_data_is_the_samples_as_they_train_with_their_provenance(tmp_path):
    tok = build_chat_tokenizer()
    samples = _samples(tok)
    save_sft_data(samples, tmp_path / "sft_data", {"kept": "reward > 0"})
    data = datasets.load_from_disk(str(tmp_path / "sft_data"))
    assert data["task_id"] == ["t1.0", "t0.5"] and data["reward"] == [1.0, 0.5]
    for row, sample in zip(data, samples, strict=True):
        assert row["input_ids"] == sample.input_ids.tolist()
        # labels: the token where the action mask trains it, -100 elsewhere
        expected = torch.where(sample.action_mask, sample.input_ids, -100).tolist()
        assert row["labels"] == expected and row["assistant_masks"] == sample.action_mask.int().tolist()
    record = json.loads((tmp_path / "sft_data" / "provenance.json").read_text())
    tokens = sum(s.input_ids.numel() for s in samples)
    trained = sum(int(s.action_mask.sum()) for s in samples)
    assert record["samples"] == 2 and record["tokens"] == tokens and record["trained_tokens"] == trained
    assert 0 < trained < tokens and record["provenance"] == {"kept": "reward > 0"}
    assert record["rendering_mismatches"] == 0 and record["images"] is None


def test_the_sft_stage_writes_its_data_on_rank_0_only(tmp_path):
    from orchard.models import tiny_qwen3
    from orchard.stages import SFTConfig
    from orchard.train.trainer import OptimConfig, TrainConfig

    class Engine:
        async def update_weights(self, state_dict):
            pass

    tok = build_chat_tokenizer()
    model = tiny_qwen3(tok, seed=0, hidden_size=16, num_hidden_layers=1)
    cfg = SFTConfig(epochs=1, train=TrainConfig(global_batch_size=2, micro_batch_size=2, optim=OptimConfig(lr=1e-3)))
    for ranks in (Ranks(), Ranks(rank=1, world_size=2)):
        out = tmp_path / str(ranks.rank)
        run = RecipeRun(out, seed=0, eval_cfg=EVAL, ranks=ranks)
        asyncio.run(run.sft(model, tok, Engine(), _samples(tok), cfg, provenance={"source": "a test"}))
        assert (out / "sft_data" / "provenance.json").is_file() is ranks.is_main
