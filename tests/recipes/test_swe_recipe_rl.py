"""A short smoke run of the SWE recipe (part 2, RL; part 1 is test_swe_recipe.py): one RL step of each kind of
variant on the toy `inventory` instances, each asserted to be an optimizer step with signal (STYLE 12b). GRPO + BAR
(then the value model and best-of-N reranking) and JS + GRPO start from a tiny student that has memorised the
scripted teacher's resolved trajectories (`swe_smoke.memorised_student`): the untrained one resolves nothing, so an
outcome-reward group has no signal. The rubric process reward starts from the untrained student: the rubric tells
its failures apart. Then how each variant forms its groups, on scripted rollouts."""

import asyncio
import json
import math

import pytest
from swe_smoke import (
    MEMORISED_EPISODE,
    RL_INSTANCES,
    assert_trained,
    memorised_student,
    metrics_rows,
    recipe,
    uniform_teacher,
)

from orchard.data import Trajectory, read_jsonl
from orchard.stages import RolloutConfig, rollout_groups

# One RL step of 2 tasks of the RL pool (the task filter off: every train instance), groups of 2 (BAR: 2 kept of
# up to 4, in one stride of 4), then the value stage; no SFT (the policy comes from model.path, or is the tiny one).
ONE_STEP = [
    *RL_INSTANCES, "sft.enabled=false", "rl.filter.enabled=false", "rl.steps=1", "rl.tasks_per_step=2",
    "rl.group_size=2", "rl.bar_n_max=4", "rl.bar_stride=4", "rl.train.global_batch_size=4",
    "rl.train.micro_batch_size=2", "value_model.candidates=2", "value_model.steps=2", "eval.harnesses=[bash]",
]
# ... from the memorised student, through bash (the harness it learned) with the episode budget it replays.
MEMORISED_RL = [*ONE_STEP, "harnesses=[bash]", *MEMORISED_EPISODE]
# ... from the untrained tiny student through both trained harnesses, small budgets.
UNTRAINED_RL = [*ONE_STEP, "rollout.max_tokens=32", "rollout.max_steps=3", "model.hidden_size=32",
                "model.num_layers=1", "model.vocab_size=1024"]


@pytest.fixture(scope="module")
def memorised(tmp_path_factory):
    """The memorised student's checkpoint, built once for this module (~30 s: the recipe's SFT, 105 steps)."""
    return memorised_student(tmp_path_factory.mktemp("memorised") / "run")


@pytest.fixture
def swe(recipe_module):
    """recipes/swe.py as a module, loaded once per session."""
    return recipe_module("swe")


def rl_step(out):
    """The one RL step's metrics row of the run in ``out``."""
    [step] = [row for row in metrics_rows(out / "metrics.jsonl") if "rl/episodes" in row]
    return step


@pytest.mark.slow
def test_swe_rl_and_rerank_smoke(tmp_path, memorised):
    out = tmp_path / "run"
    proc = recipe(f"output_dir={out}", f"model.path={memorised}", *MEMORISED_RL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())["results"]
    assert set(results) == {"base", "rl"} and results["rl"]["bash"]["tasks"] == 1
    summary = json.loads((out / "rl_summary.json").read_text())
    assert (summary["variant"], summary["steps"], summary["tasks"]) == ("grpo_bar", 1, 2)
    step = rl_step(out)
    assert step["rl/episodes"] == 8 and step["rl/env_errors"] == 0  # 2 tasks x BAR's budget of 4
    # the 8 rollouts (BAR's discards included) written once, under rl (the filter is off)
    rl_written = read_jsonl(out / "trajectories" / "rl.jsonl.gz")
    assert len(rl_written) == 8 and all(t.metadata["phase"] == "rl" for t in rl_written)
    # BAR spends its whole budget of 4 per task in one stride: two groups, one generation call each. Measured (seed
    # 0): 4 of the 8 resolved, 1 of one task's 4 and 3 of the other's (pool ratios 0.25 and 0.75, the groups in the
    # order they finish); from each BAR keeps N = 2 with 1 resolved (ratio 0.5, inside the band [0.375, 0.625]):
    # both groups have signal, the step trains (grad norm 0.19).
    groups = summary["bar_groups"]
    assert [g["step"] for g in groups] == [1, 1]
    assert all(0 < g["pool_positive_ratio"] < 1 and g["kept_positive_ratio"] == 0.5 for g in groups), groups
    assert_trained(step, groups=2)
    assert step["rl/sequences"] >= 4  # both kept rollouts of both groups (a sequence per episode at least)
    rerank = json.loads((out / "rerank.json").read_text())
    report = rerank["report"]
    # 1 held-out instance x 2 candidates
    assert report["rerank/n"] == 2 and report["value/candidates"] == 2
    # The pool is the RL stage's 8 scored rollouts, balanced: as many failed as resolved, min(4, 4) = 4 of each.
    resolved = round(step["rl/success_generated"] * step["rl/episodes"])
    assert report["value/pool"] == 2 * min(resolved, step["rl/episodes"] - resolved) >= 2
    assert report["value/pool_success"] == 0.5
    # two value steps on returns of both signs, a finite positive loss each
    losses = [h["value/loss"] for h in rerank["history"]]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses), rerank
    assert (out / "value_curves.png").stat().st_size > 5_000


@pytest.mark.slow
def test_swe_opd_js_grpo_smoke(tmp_path, memorised):
    """The paper's best OPD composition, JS + GRPO on plain groups (no BAR), one RL step from the memorised student.
    Its OPD teacher here is a fresh, near-uniform tiny model (`swe_smoke.uniform_teacher`: the CPU teacher the recipe
    trains goes only with a tiny student built in the run), so this smoke proves the plumbing: the teacher's
    log-probs reach the JS term, which has a value and trains beside GRPO. That distillation from a trained teacher
    teaches is the real-fix smoke's (test_swe_recipe.py) and the losses' tests' to show."""
    out = tmp_path / "run"
    teacher = uniform_teacher(memorised, tmp_path / "opd_teacher")
    proc = recipe(f"output_dir={out}", f"model.path={memorised}", *MEMORISED_RL, "rl.variant=opd_js_grpo",
                  f"rl.teacher.path={teacher}", "value_model.enabled=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "rl_summary.json").read_text())
    assert (summary["variant"], summary["steps"], summary["bar_groups"]) == ("opd_js_grpo", 1, [])
    step = rl_step(out)
    # Plain groups, as the paper ran them: the 2 x 2 rollouts asked for. Measured (seed 0): 3 of 4 resolved, one
    # group 1 of 2 (signal), the other 2 of 2 (dropped by the group filter the GRPO term needs); grad norm 0.08;
    # the student's JS divergence from the teacher on its own rollouts 0.34.
    assert step["rl/episodes"] == 4 and step["rl/env_errors"] == 0
    assert_trained(step)
    assert step["opd/js"] > 0
    # the teacher is near-uniform, as said: about 1/V to every token the student sampled, log(1/1024) = -6.93
    assert step["opd/teacher_logprob"] == pytest.approx(-math.log(1024), abs=0.05)


@pytest.mark.slow
def test_swe_rpr_smoke(tmp_path):
    """The rubric process reward (the programmatic judge), one RL step from the untrained tiny student."""
    out = tmp_path / "run"
    proc = recipe(f"output_dir={out}", *UNTRAINED_RL, "rl.variant=rpr", "value_model.enabled=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "rl_summary.json").read_text())
    assert (summary["variant"], summary["steps"]) == ("rpr", 1)
    step = rl_step(out)
    judge = summary["judge"]
    # every scored episode was judged once, and the programmatic judge never fails
    valid = step["rl/episodes"] - step["rl/env_errors"]
    assert judge == {"rl/judged": valid, "rl/judge_failures": 0, "rl/judge_unparseable": 0}
    assert step["rl/removed"] == 0
    # None resolved (seed 0: 4 of 4 format errors), yet the rubric tells the rollouts apart: both groups train,
    # which is what RPR is for (measured: groups 2/2, 12 sequences, grad norm 0.29, mean rubric 0.17)
    assert step["rl/success"] == 0 and step["rl/judge_rubric_mean"] > 0
    assert_trained(step, groups=2)


def test_js_with_grpo_runs_without_bar_as_the_paper_ran_it_and_its_bar_row_is_apart(swe):
    asked = []

    async def one_resolved(engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
        # 1 of every 8 rollouts resolves the task: outcome +1, the others -1
        asked.append(group_size)
        return [Trajectory(task_id=str(task), reward=r, reward_components={"outcome": r})
                for task in tasks for r in (1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0)[:group_size]]

    def kept(variant):
        asked.clear()
        cfg = swe.SWERLConfig(variant=variant, group_size=4, bar_n_max=8, bar_stride=8, tasks_per_step=1)
        groups, _ = asyncio.run(rollout_groups({"bash": one_resolved}, None, ["a"], ["bash"], cfg,
                                               RolloutConfig()))
        [group] = [g.trajectories for g in groups if g.trajectories]
        return cfg, sum(asked), group

    plain, generated_plain, group_plain = kept("opd_js_grpo")
    with_bar, generated_bar, group_bar = kept("opd_js_grpo_bar")
    # The same objective, JS (lambda 0.5) + GRPO (0.2 / 0.28), in both rows.
    for cfg in (plain, with_bar):
        assert [(t.name, t.weight, t.kwargs) for t in cfg.train.objective] == [
            ("policy", 1.0, {"eps_low": 0.2, "eps_high": 0.28}), ("js_opd", 1.0, {"lam": 0.5})]
    assert (plain.use_bar, with_bar.use_bar) == (False, True)
    assert plain.group_filter == with_bar.group_filter != "none"  # the GRPO term needs a group with signal
    # Plain groups: the 4 rollouts asked for, trained as they came, none chosen by BAR.
    assert generated_plain == 4 and len(group_plain) == 4
    assert not any("bar" in t.metadata for t in group_plain)
    # BAR: a stride of 8 drawn, 4 of them chosen (1 resolved of 8 cannot make the band's 2 of 4: the relaxed choice).
    assert generated_bar == 8 and len(group_bar) == 4
    assert all(t.metadata["bar"]["kept"] for t in group_bar)


def test_rpr_trains_the_all_failed_groups_bar_would_drop(swe):
    async def unresolved(engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
        # None resolved; the judge graded their processes 0.8, 0.2, 0.6, 0.4 (reward = -1 + 0.5 x rubric).
        return [Trajectory(task_id=str(task), reward=-1.0 + 0.5 * r, reward_components={"outcome": 0.0})
                for task in tasks for r in (0.8, 0.2, 0.6, 0.4, 0.8, 0.2, 0.6, 0.4)[:group_size]]

    def kept(variant):
        cfg = swe.SWERLConfig(variant=variant, group_size=4, bar_n_max=8, bar_stride=8, tasks_per_step=1)
        groups, _ = asyncio.run(rollout_groups({"bash": unresolved}, None, ["a"], ["bash"], cfg, RolloutConfig()))
        return [len(g.trajectories) for g in groups if g.trajectories]

    # BAR: 0 of 8 resolved -> no balanced set, the group is dropped, its rubric signal (rewards -0.6 .. -0.9) lost.
    assert kept("grpo_bar") == []
    # RPR on plain groups: the 4 rollouts asked for train (the group filter sees four different rewards).
    assert kept("rpr") == [4]
