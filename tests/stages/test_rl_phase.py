"""A recipe's RL phase (`rl_phase`) on scripted harnesses, the RL stage replaced by one that plays its groups through
the real `rollout_groups`: the filter's choice, the step that shrinks to the kept tasks, every rollout kept (or none,
the rows unchanged), BAR's report, a judge's counts over the RL stage only, per-step stats, a warm pool per part
sized to it, and each part's phase named to the recipe."""

import asyncio
import contextlib
import importlib

from orchard.rollout.rollouts import JudgedRolloutsBase
from orchard.stages import RLConfig, RolloutConfig, TaskFilterConfig, rl_phase, rollout_groups

rl_phase_module = importlib.import_module("orchard.stages.rl_phase")  # the package's name is the function


class Counting(JudgedRolloutsBase):
    """A judge that grades nothing and counts what it saw."""

    counted = ("rl/judged",)

    async def judge_batch(self, trajectories, tasks):
        return {"rl/judged": float(len(trajectories))}


class Pools:
    """The run's sandboxes: each part's pool size recorded."""

    def __init__(self):
        self.sizes = []

    def stage(self, n):
        self.sizes.append(n)
        return contextlib.nullcontext()


def fake_rl_stage(played):
    async def rl_stage(model, engine, harnesses, tasks, cfg, *, rollout, pad_id, seed, output_dir, log, teacher):
        played.update(tasks=list(tasks), tasks_per_step=cfg.tasks_per_step, output_dir=output_dir, teacher=teacher)
        history = []
        for step in (1, 2):
            step_tasks = tasks[:cfg.tasks_per_step]
            groups, generated = await rollout_groups(harnesses, engine, step_tasks, ["bash"] * len(step_tasks), cfg,
                                                     rollout)
            stats = {"rl/success_generated": sum(t.reward > 0 for t in generated) / len(generated),
                     "rl/groups": float(len(groups)), "rl/groups_with_signal": 1.0, "rl/env_errors": 0.0}
            log(stats, step)
            history.append(stats)
        return history

    return rl_stage


def test_filter_then_rl_on_the_kept_tasks(scripted_rollouts, monkeypatch, tmp_path, recording_log):
    played = {}
    monkeypatch.setattr(rl_phase_module, "rl_stage", fake_rl_stage(played))
    T, F = True, False
    plain = scripted_rollouts({"never": [F], "half": [T, F], "always": [T]})
    judged = Counting(plain, "http://judge:8000/v1")
    cfg = RLConfig(group_size=2, bar_n_max=4, bar_stride=4, use_bar=True, tasks_per_step=2)
    log, pools = recording_log(), Pools()
    result = asyncio.run(rl_phase(None, None, {"bash": judged}, ["never", "half", "always"], cfg,
                                  rollout=RolloutConfig(), pad_id=0, seed=0, output_dir=tmp_path / "rl", log=log,
                                  task_filter=TaskFilterConfig(attempts=4), filter_harnesses={"bash": plain},
                                  teacher="the teacher", step_stats=lambda trajs: {"rl/step_rollouts": len(trajs)},
                                  sandboxes=pools))
    # the filter: 4 rollouts each, p̂ = 0, 0.5, 1 -> "half" kept; the step shrinks from 2 tasks to the 1 kept
    assert played == {"tasks": ["half"], "tasks_per_step": 1, "output_dir": str(tmp_path / "rl"),
                      "teacher": "the teacher"}
    assert log.rows[0] == ({**log.rows[0][0], "filter/kept": 1.0}, 0)
    # pools: 3 candidates x 4 attempts for the filter, then 1 task x a BAR stride of 4 per step
    assert pools.sizes == [12, 4]
    # every rollout kept: the filter's 12, then 2 steps x one stride of 4
    assert len(result.generated) == 12 + 8 and [t.task_id for t in result.generated[12:]] == ["half"] * 8
    assert len(result.history) == 2
    # each step's row has its own rollouts' stats; the judge counted the RL stage's rollouts, not the filter's
    assert [(row.get("rl/step_rollouts"), step) for row, step in log.rows[1:]] == [(4, 1), (4, 2)]
    # BAR: the stride T, F, T, F is the pool (2 of 4 positive); it kept 1 of 2 (the band's {1} for n = 2)
    assert result.summary == {
        "tasks": 1, "steps": 2, "tasks_per_step": 1, "judge": {"rl/judged": 8.0},
        "bar_groups": [{"step": s, "pool_positive_ratio": 0.5, "kept_positive_ratio": 0.5} for s in (1, 2)]}


def test_no_task_kept_skips_rl_and_keeps_the_filters_rollouts(scripted_rollouts, monkeypatch, tmp_path,
                                                              recording_log):
    played = {}
    monkeypatch.setattr(rl_phase_module, "rl_stage", fake_rl_stage(played))
    log = recording_log()
    result = asyncio.run(rl_phase(None, None, {"bash": scripted_rollouts({"a": [False], "b": [True]})}, ["a", "b"],
                                  RLConfig(group_size=2, tasks_per_step=2), rollout=RolloutConfig(), pad_id=0, seed=0,
                                  output_dir=tmp_path, log=log, task_filter=TaskFilterConfig(attempts=2)))
    assert played == {} and result.history == [] and len(result.generated) == 4
    assert result.summary == {"tasks": 0, "steps": 0}
    assert log.lines[-1] == "rl: skipped, no task of useful difficulty for the policy"


def test_without_a_filter_rl_plays_every_task_on_plain_groups(scripted_rollouts, monkeypatch, tmp_path,
                                                              recording_log):
    played = {}
    monkeypatch.setattr(rl_phase_module, "rl_stage", fake_rl_stage(played))
    result = asyncio.run(rl_phase(None, None, {"bash": scripted_rollouts({"a": [False], "b": [True]})}, ["a", "b"],
                                  RLConfig(group_size=2, tasks_per_step=2), rollout=RolloutConfig(), pad_id=0, seed=0,
                                  output_dir=tmp_path, log=recording_log(),
                                  task_filter=TaskFilterConfig(enabled=False)))
    assert played["tasks"] == ["a", "b"] and len(result.generated) == 2 * 2 * 2  # 2 steps x 2 tasks x 2
    assert result.summary == {"tasks": 2, "steps": 2, "tasks_per_step": 2, "bar_groups": []}


def test_the_filter_rates_its_candidates_over_every_harness(scripted_rollouts, monkeypatch, tmp_path,
                                                            recording_log):
    T, F = True, False
    # 8 attempts over the two harnesses (4 each): p̂ = 0, 2/8, 4/8, 8/8 -> "rare" and "half" are kept.
    outcomes = {"never": [F], "rare": [T, F, F, F], "half": [T, F], "always": [T]}
    harnesses = {"bash": scripted_rollouts(outcomes), "tool": scripted_rollouts(outcomes)}

    def trained_on(**filter_kwargs):
        played = {}
        monkeypatch.setattr(rl_phase_module, "rl_stage", fake_rl_stage(played))
        asyncio.run(rl_phase(None, None, harnesses, list(outcomes), RLConfig(group_size=2, tasks_per_step=1),
                             rollout=RolloutConfig(), pad_id=0, seed=0, output_dir=tmp_path, log=recording_log(),
                             task_filter=TaskFilterConfig(**filter_kwargs)))
        return played.get("tasks", [])

    assert trained_on() == ["rare", "half"]
    # 2 candidates drawn with the run's seed: the kept ones are those of the 2 among "rare" and "half"
    two = TaskFilterConfig(candidates=2).candidates_of(list(outcomes), seed=0)
    assert not set(two) >= {"rare", "half"}  # (the seed's draw leaves one out: a filter ignoring candidates fails)
    assert trained_on(candidates=2) == [t for t in two if t in ("rare", "half")]
    assert trained_on(low=0.9, high=1.0) == ["always"]


def test_rollouts_let_go_leave_the_rows_and_the_summary_as_they_were(scripted_rollouts, monkeypatch, tmp_path,
                                                                     recording_log):
    T, F = True, False

    def phase(keep_generated):
        monkeypatch.setattr(rl_phase_module, "rl_stage", fake_rl_stage({}))
        log, phases = recording_log(), []
        result = asyncio.run(rl_phase(
            None, None, {"bash": scripted_rollouts({"never": [F], "half": [T, F], "always": [T]})},
            ["never", "half", "always"], RLConfig(group_size=2, bar_n_max=4, bar_stride=4, use_bar=True,
                                                  tasks_per_step=2),
            rollout=RolloutConfig(), pad_id=0, seed=0, output_dir=tmp_path, log=log,
            task_filter=TaskFilterConfig(attempts=4), step_stats=lambda trajs: {"rl/step_rollouts": len(trajs)},
            keep_generated=keep_generated, set_phase=phases.append))
        return result, log, phases

    kept, kept_log, kept_phases = phase(True)
    dropped, dropped_log, dropped_phases = phase(False)
    assert len(kept.generated) == 12 + 8 and dropped.generated == []  # the filter's 12, 2 steps x a stride of 4
    assert dropped.summary == kept.summary and dropped.history == kept.history
    assert dropped_log.rows == kept_log.rows and dropped_log.lines == kept_log.lines
    assert [row.get("rl/step_rollouts") for row, _ in dropped_log.rows[1:]] == [4, 4]
    assert dropped_phases == kept_phases == ["task_filter", "rl"]  # each part named as it starts


def test_only_the_parts_that_run_are_named(scripted_rollouts, monkeypatch, tmp_path, recording_log):
    monkeypatch.setattr(rl_phase_module, "rl_stage", fake_rl_stage({}))

    def phases(outcomes, task_filter):
        named = []
        asyncio.run(rl_phase(None, None, {"bash": scripted_rollouts(outcomes)}, list(outcomes),
                             RLConfig(group_size=2, tasks_per_step=1), rollout=RolloutConfig(), pad_id=0, seed=0,
                             output_dir=tmp_path, log=recording_log(), task_filter=task_filter, set_phase=named.append))
        return named

    assert phases({"a": [True]}, None) == ["rl"]  # no filter
    assert phases({"a": [True]}, TaskFilterConfig(attempts=2)) == ["task_filter"]  # p̂ = 1: none kept, no RL
