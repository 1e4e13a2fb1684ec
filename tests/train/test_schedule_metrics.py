"""Cosine schedule with warm-up, checkpoint pointer helpers, and the metric loggers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from orchard.train import checkpoint as ckpt
from orchard.train.metrics import JsonlLogger, MetricLogger, read_jsonl_metrics
from orchard.train.schedule import cosine_lr, cosine_schedule


def test_cosine_hand_computed() -> None:
    kw = dict(lr=1e-5, min_lr=1e-6, warmup_steps=2, total_steps=7)
    # warm-up: 1e-5 * 1/2, 1e-5 * 2/2; decay over steps 2..6 (4 intervals): progress 0, .25, .5, .75, 1
    expected = [5e-6, 1e-5, 1e-5, 1e-6 + 9e-6 * 0.5 * (1 + math.cos(math.pi / 4)), 5.5e-6,
                1e-6 + 9e-6 * 0.5 * (1 + math.cos(3 * math.pi / 4)), 1e-6, 1e-6]
    got = [cosine_lr(s, **kw) for s in range(8)]
    assert got == pytest.approx(expected, rel=1e-12)


def test_cosine_schedule_drives_optimizer_and_round_trips() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1e-6)
    sched = cosine_schedule(opt, lr=1e-6, min_lr=1e-7, warmup_steps=0, total_steps=3)
    seen = []
    for _ in range(3):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([1e-6, 5.5e-7, 1e-7])
    state = sched.state_dict()
    opt2 = torch.optim.SGD([p], lr=1e-6)
    sched2 = cosine_schedule(opt2, lr=1e-6, min_lr=1e-7, warmup_steps=0, total_steps=3)
    sched2.load_state_dict(state)
    assert sched2.get_last_lr() == sched.get_last_lr()


def transformers_cosine_lrs(*, lr: float, min_lr: float, warmup_steps: int, total_steps: int, steps: int) -> list[float]:
    """The lr of each of ``steps`` optimizer steps under transformers' cosine-with-floor schedule."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = get_cosine_with_min_lr_schedule_with_warmup(opt, warmup_steps, total_steps, min_lr=min_lr)
    seen = []
    for _ in range(steps):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return seen


# S - W >= 2: a decay long enough to reach the floor (a one-step decay is that step at the peak, in both)
@pytest.mark.parametrize(("warmup_steps", "total_steps"), [(0, 5), (2, 7), (3, 5), (4, 12), (1, 3)])
def test_cosine_differs_from_transformers_only_where_the_docstring_says(warmup_steps: int, total_steps: int) -> None:
    kw = dict(lr=1e-5, min_lr=1e-6, warmup_steps=warmup_steps)
    ours = [cosine_lr(s, **kw, total_steps=total_steps) for s in range(total_steps + 3)]
    theirs = transformers_cosine_lrs(**kw, total_steps=total_steps, steps=total_steps + 4)
    theirs_one_short = transformers_cosine_lrs(**kw, total_steps=total_steps - 1, steps=total_steps)
    # Warm-up: ours at step s is theirs at s + 1 (theirs trains step 0 at lr 0).
    assert ours[:warmup_steps] == pytest.approx(theirs[1:warmup_steps + 1], rel=1e-12)
    if warmup_steps:
        assert theirs[0] == 0.0 and ours[0] == pytest.approx(1e-5 / warmup_steps)
    # Decay: ours is theirs with one training step fewer, so that step S - 1 is at the floor and theirs is not.
    decay = slice(warmup_steps, total_steps)
    assert ours[decay] == pytest.approx(theirs_one_short[decay], rel=1e-12)
    assert ours[total_steps - 1] == pytest.approx(1e-6, rel=1e-12) and theirs[total_steps - 1] > 1.05e-6
    # Past S: ours holds the floor, theirs climbs back.
    assert ours[total_steps:] == [1e-6] * 3
    assert theirs[total_steps] == pytest.approx(1e-6, rel=1e-9) and theirs[total_steps + 1] > theirs[total_steps]


@pytest.mark.parametrize(("kw", "name"), [(dict(min_lr=2.0), "min_lr"), (dict(total_steps=0), "total_steps"),
                                          (dict(warmup_steps=-1), "warmup_steps"), (dict(lr=0.0), "lr")])
def test_cosine_rejects_bad_arguments(kw: dict, name: str) -> None:
    args = dict(lr=1.0, min_lr=0.1, warmup_steps=0, total_steps=5) | kw
    with pytest.raises(ValueError, match=name):
        cosine_lr(0, **args)


def test_jsonl_logger_truncates_on_resume(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = JsonlLogger(path)
    assert isinstance(log, MetricLogger)
    for s in (1, 2, 3):
        log.log({"loss": float(s), "bad": float("nan")}, s)
    log.close()
    before = path.read_text().splitlines()
    log = JsonlLogger(path, resume_step=2)  # step 3 was written after the checkpoint of step 2
    log.log({"loss": 30.0}, 3)
    log.close()
    rows = read_jsonl_metrics(path)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["loss"] == 30.0
    assert rows[0]["bad"] == "nan"
    json.loads(path.read_text().splitlines()[0])  # valid JSON despite the NaN
    assert path.read_text().splitlines()[:2] == before[:2]  # the kept lines, byte for byte


def test_read_jsonl_metrics_skips_blank_lines_and_may_allow_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n\n  \n{"step": 2, "loss": 0.25}\n')
    assert read_jsonl_metrics(path) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]
    assert read_jsonl_metrics(tmp_path / "absent.jsonl", missing_ok=True) == []
    with pytest.raises(FileNotFoundError):
        read_jsonl_metrics(tmp_path / "absent.jsonl")


def test_checkpoint_pointer_and_prune(tmp_path: Path) -> None:
    assert ckpt.latest_checkpoint(tmp_path) is None
    for s in (1, 3, 4):
        d = ckpt.step_dir(tmp_path, s)
        d.mkdir()
        ckpt.write_trainer_state(d, {"step": s})
        ckpt.mark_latest(tmp_path, s)
    # Saves that died before trainer_state.json: step 2 (an earlier run, resumed from step 1) and step 5.
    ckpt.step_dir(tmp_path, 2).mkdir()
    ckpt.step_dir(tmp_path, 5).mkdir()
    assert ckpt.latest_checkpoint(tmp_path) == ckpt.step_dir(tmp_path, 4)
    ckpt.prune_checkpoints(tmp_path, keep=2)
    # Complete: 1, 3, 4 -> the newest two (3, 4) stay, 1 goes. Incomplete ones do not count: 2 (older than latest,
    # it can never complete) goes, 5 (newer: a resumed run writes it again) stays.
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000003", "step_000004", "step_000005"]
    ckpt.prune_checkpoints(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000004", "step_000005"]
    with pytest.raises(ValueError, match="keep"):
        ckpt.prune_checkpoints(tmp_path, keep=0)


def test_prune_never_deletes_latest_even_when_a_newer_complete_one_exists(tmp_path: Path) -> None:
    # Step 2's trainer_state.json was written, then a kill came before ``latest`` moved from step 1 to step 2.
    for s in (1, 2):
        d = ckpt.step_dir(tmp_path, s)
        d.mkdir()
        ckpt.write_trainer_state(d, {"step": s})
    ckpt.mark_latest(tmp_path, 1)
    ckpt.prune_checkpoints(tmp_path, keep=1)
    # keep=1 keeps the newest complete one (2), and the one latest names (1) is never deleted.
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000001", "step_000002"]
