"""A short smoke run of the whole Claw recipe: embedded service started and stopped by the recipe, base eval,
SFT on teacher episodes through both harnesses, the best start temperature folded in and evaluated, two GRPO
steps, evaluation, table, metrics and plot."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from orchard.domains.claw.tasks import TEMPLATES

ROOT = Path(__file__).resolve().parents[2]

SMOKE = [
    # 24 SFT epochs (176 steps, ~20 s): after 1 epoch every rollout scored 0 and no RL group had signal; after 24
    # the policy earns partial credit on some tasks, so groups of its rollouts differ under rl.reward=score.
    "tasks.train_per_template=2", "tasks.heldout_per_template=1", "eval.attempts=2", "sft.epochs=24",
    "sft.train.global_batch_size=6", "sft.train.micro_batch_size=6", "sft.train.optim.lr=3e-3",
    "rl.steps=2", "rl.tasks_per_step=4", "rl.group_size=2", "rl.train.global_batch_size=8",
    "rl.train.micro_batch_size=4", "model.hidden_size=32", "model.num_layers=1", "rollout.max_tokens=24",
    "rollout.concurrency=8", "threads=1",
    # The optional RL pieces ride along: partial-credit reward, a larger task pool, a KL term to the SFT policy.
    "rl.reward=score", "tasks.rl_pool_per_template=4",
    "rl.train.objective=[{name: policy, weight: 1.0}, {name: kl, weight: 0.05}]",
    # RL starts from the SFT policy at its best of two temperatures, one episode of one validation task per template.
    "rl.start_temperature.search=true", "rl.start_temperature.temperatures=[0.5, 2.0]",
    "rl.start_temperature.validation_per_template=1", "rl.start_temperature.attempts=1",
]


@pytest.mark.slow
def test_claw_recipe_smoke(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes/claw.py"), "--config", str(ROOT / "recipes/configs/claw_tiny.yaml"),
         f"output_dir={out}", *SMOKE],
        capture_output=True, text=True, timeout=540,  # under the suite's 600 s per-test timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads((out / "results.json").read_text())
    results = saved["results"]
    assert list(results) == ["base", "sft", "sft_best_t", "rl"]
    # The resolved config is saved with the results: the YAML's values with the overrides applied.
    assert saved["config"]["rl"]["steps"] == 2 and saved["config"]["rollout"]["max_steps"] == 5
    table = proc.stdout[proc.stdout.index("\nstage ") + 1:].splitlines()
    for stage in results.values():
        assert set(stage) == {"react", "text"}
        for row in stage.values():
            # One task per template, every episode scored (no sandbox failures in a healthy service).
            assert row["tasks"] == len(TEMPLATES) and row["env_errors"] == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # The printed table is the saved results (counts as integers), in stage order.
    assert [line.split()[:2] for line in table[1:9]] == [
        [s, h] for s in ("base", "sft", "sft_best_t", "rl") for h in ("react", "text")]
    assert table[8].split()[2:] == [f"{results['rl']['text'][k]:.3f}" for k in ("success", "pass@2", "pass^2")] + [
        str(len(TEMPLATES)), "0"]
    for r in rows:
        for key, value in r.items():
            if key.startswith("eval/"):
                _, stage, harness, metric = key.split("/")
                assert results[stage][harness][metric] == value
    # The start temperature: each grid temperature's validation rows (11 tasks, 1 attempt each, both harnesses),
    # then the choice; the saved folded model is the SFT model with its final norm / T (rollout.temperature 1.0).
    searched = [r for r in rows if "start_temperature/value" in r]
    assert [r["start_temperature/value"] for r in searched] == [0.5, 2.0]
    for r in searched:
        assert r["start_temperature/react/tasks"] == r["start_temperature/text/tasks"] == len(TEMPLATES)
        assert r["start_temperature/mean_success"] == pytest.approx(
            (r["start_temperature/react/success"] + r["start_temperature/text/success"]) / 2)
    (chosen,) = [r["start_temperature/chosen"] for r in rows if "start_temperature/chosen" in r]
    best = max(r["start_temperature/mean_success"] for r in searched)
    # the best mean; on a tie the one nearer rollout.temperature 1.0: 0.5 (|0.5| < |1.0|)
    assert chosen == min((r["start_temperature/value"] for r in searched if r["start_temperature/mean_success"] == best),
                         key=lambda t: abs(t - 1.0))
    assert f"start temperature: T={chosen} " in proc.stdout
    sft_norm, folded_norm = (load_file(out / name / "model.safetensors")["model.norm.weight"]
                             for name in ("sft_model", "sft_best_t_model"))
    torch.testing.assert_close(folded_norm, sft_norm / chosen)
    rl_rows = [r for r in rows if "rl/episodes" in r]
    assert [r["step"] for r in rl_rows] == [1, 2]
    assert all(r["rl/episodes"] == 8 for r in rl_rows)
    # Every step took an optimizer step with signal (seed 0, measured: 1 of 4 groups each, grad norm 6.07 then
    # 2.93, success 0: partial credit alone), with the kl term against the frozen starting policy.
    for r in rl_rows:
        assert r["rl/groups_with_signal"] >= 1 and r["rl/sequences"] > 0, r
        assert r["grad_norm"] > 0 and r["lr"] > 0, r
        assert r["loss/kl"] == r["loss/kl"] and r["loss/kl"] >= -1e-6
    assert rl_rows[1]["loss/kl"] > 0  # after step 1's update the policy has left the reference
    teacher = {k: v for r in rows for k, v in r.items() if k.startswith("sft/teacher")}
    # The scripted teacher solves every train task it demonstrates (one per distinct request) in both harnesses.
    assert len(TEMPLATES) <= teacher["sft/teacher_react_episodes"] <= 2 * len(TEMPLATES)
    assert teacher["sft/teacher_react_passed"] == teacher["sft/teacher_react_episodes"]
    assert teacher["sft/teacher_text_passed"] == teacher["sft/teacher_text_episodes"]
    assert teacher["sft/teacher_text_episodes"] == teacher["sft/teacher_react_episodes"]
    assert (out / "learning_curve.png").stat().st_size > 10_000
    # Every episode played is on disk under its phase, and the SFT data as it trained, with its provenance.
    from orchard.data import read_jsonl

    played = {p.name.removesuffix(".jsonl.gz"): read_jsonl(p) for p in (out / "trajectories").iterdir()}
    assert set(played) == {"eval_base", "sft_teacher", "eval_sft", "start_temperature", "eval_sft_best_t", "rl",
                           "eval_rl"}
    assert len(played["eval_rl"]) == 2 * len(TEMPLATES) * 2  # 2 harnesses x 11 tasks x 2 attempts
    assert len(played["rl"]) == sum(r["rl/episodes"] for r in rl_rows)
    assert {t.metadata["rollouts"] for t in played["sft_teacher"]} == {"react", "text"}
    assert len(played["sft_teacher"]) == teacher["sft/teacher_react_episodes"] + teacher["sft/teacher_text_episodes"]
    sft_data = json.loads((out / "sft_data" / "provenance.json").read_text())
    assert sft_data["samples"] > 0 and "reward > 0" in sft_data["provenance"]["kept"]
    sft_rows = [json.loads(line) for line in (out / "sft" / "metrics.jsonl").read_text().splitlines()]
    # SFT at lr 3e-3 on the teacher's episodes lowers the loss over its steps.
    assert sft_rows[-1]["loss/total"] < sft_rows[0]["loss/total"]


def recipe(*args):
    return subprocess.run([sys.executable, str(ROOT / "recipes/claw.py"), "--config",
                           str(ROOT / "recipes/configs/claw_tiny.yaml"), *args],
                          capture_output=True, text=True, timeout=300)


CONFIG = ("--config", str(ROOT / "recipes/configs/claw_tiny.yaml"))


@pytest.mark.parametrize(("override", "message"), [
    ("rl.stepz=3", "rl.stepz is not a config key; did you mean 'rl.steps'?"),
    ("rl.steps=-3", "rl.steps must be an int >= 1, got -3"),
    ("eval.attempts=0", "eval.attempts must be an int >= 1, got 0"),
    ("rl.group_size=0", "rl.group_size must be an int >= 1, got 0"),
    # 11 templates x 20 train tasks
    ("rl.tasks_per_step=1000", f"rl.tasks_per_step must be <= the RL task pool ({len(TEMPLATES) * 20} tasks), got 1000"),
    ("rl.train.total_steps=5", "rl.train.total_steps is derived from rl.steps x rl.ppo_epochs x rl.mini_batches; "
                               "set that instead"),
    ("sft.train.output_dir=x", "sft.train.output_dir is derived from output_dir; set that instead"),
    ("model.path=/no/such/dir", "model.path must be a local checkpoint directory or a named checkpoint "
                                "(smollm2-135m-instruct), got '/no/such/dir' (no such directory)"),
    ("rl.start_temperature.temperatures=[]", "rl.start_temperature.temperatures must be a non-empty list of "
                                             "numbers > 0, got []"),
    ("rl.start_temperature.temperatures=[0.5, 0]", "rl.start_temperature.temperatures must hold finite numbers > 0, "
                                                   "got 0.0 in [0.5, 0.0]"),
    ("rl.start_temperature.temperatures=[0.5, -1.0]", "rl.start_temperature.temperatures must hold finite numbers "
                                                      "> 0, got -1.0 in [0.5, -1.0]"),
    ("rl.start_temperature.temperatures=[0.5, 0.5]", "rl.start_temperature.temperatures must not repeat a "
                                                     "temperature, got [0.5, 0.5]"),
    ("rl.start_temperature.validation_per_template=0", "rl.start_temperature.validation_per_template must be an "
                                                       "int >= 1, got 0"),
    ("rl.start_temperature.attempts=-1", "rl.start_temperature.attempts must be an int >= 0, got -1"),
    # caught before the base evaluation, not when the RL trainer is built
    ("rl.train.loggers=[jsonl, tensorbord]", "rl.train.loggers has unknown logger 'tensorbord'; did you mean "
                                             "'tensorboard'? valid: jsonl, tensorboard, wandb, progress"),
    # caught before any work, not at the first optimizer step with signal (or never)
    ("rl.train.objective=[{name: policy, kwargs: {eps_hgih: 0.3}}]",
     "rl.train.objective[0].kwargs has 'eps_hgih', which policy_loss (the policy term) does not take; did you mean "
     "'eps_high'? it takes: eps_low, eps_high, dual_clip, tis_threshold, is_mode, ratio_level, validate"),
])
def test_config_mistakes_are_one_line_before_any_work(override, message, recipe_main):
    # in process (the recipe's main under run_main, as its __main__ calls it): a subprocess per case costs a torch
    # import each; test_a_config_mistake_from_the_command_line runs one case as a user does
    assert recipe_main("claw", *CONFIG, override) == (2, "", f"error: {message}\n")  # nothing ran, no config print


@pytest.mark.parametrize(("overrides", "message"), [
    # greedy rollouts: there is no temperature to fold the chosen one against
    (("rollout.temperature=0",), "rollout.temperature must be > 0 with rl.start_temperature.search (the fold is the "
                                 "chosen temperature / rollout.temperature), got 0.0"),
    # 10,001 pool tasks per template reach seed 10,000, the validation split's first
    (("tasks.rl_pool_per_template=10001",), "tasks.train_per_template and tasks.rl_pool_per_template must be <= "
                                            "10000 with rl.start_temperature.search (more would reach the validation "
                                            "split's task seeds), got 10001"),
])
def test_the_start_temperature_search_refuses_what_it_cannot_do(overrides, message, recipe_main):
    assert recipe_main("claw", *CONFIG, "rl.start_temperature.search=true", *overrides) == (2, "", f"error: {message}\n")
    # without the search (the default) the same settings run
    status, out, _ = recipe_main("claw", *CONFIG, "--show-config", *overrides)
    assert status == 0 and "rl.start_temperature.search: false" in out


def test_a_config_mistake_from_the_command_line():
    proc = recipe("rl.steps=-3")
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, "error: rl.steps must be an int >= 1, got -3\n", "")


def test_show_config_prints_the_resolved_config_and_exits(recipe_main):
    status, out, err = recipe_main("claw", *CONFIG, "--show-config", "rl.steps=5")
    assert status == 0, err
    lines = out.splitlines()
    # The override, the YAML's values and the stage's own defaults (not TrainConfig's class defaults) show.
    assert [ln.split("#")[0].strip() for ln in lines if ln.startswith(("rl.steps:", "rl.train.global_batch_size:",
                                                                        "rl.train.optim.lr:", "sft.epochs:"))] == [
        "sft.epochs: 16.0", "rl.steps: 5", "rl.train.global_batch_size: 64", "rl.train.optim.lr: 0.0001"]
    # A derived key shows what it is derived from where its value would be, never the placeholder it holds.
    derived = {ln.split("#")[0].strip() for ln in lines if "(derived" in ln}
    assert derived == {"sft.train.total_steps: (derived from sft.epochs)", "sft.train.seed: (derived from seed)",
                       "sft.train.output_dir: (derived from output_dir)",
                       "rl.train.total_steps: (derived from rl.steps x rl.ppo_epochs x rl.mini_batches)",
                       "rl.train.seed: (derived from seed)", "rl.train.output_dir: (derived from output_dir)",
                       "rl.train.checkpoint_every: (derived from rl.checkpoint_every)",
                       "rl.train.resume: (derived from rl.resume)"}
    assert "runs/train" not in out  # TrainConfig's placeholder output_dir
    assert "eval base" not in out and "stage  harness" not in out  # it did not run


def test_lr_multipliers_from_the_yaml_can_be_cleared(recipe_main):
    # claw_tiny.yaml sets rl.train.optim.lr_multipliers; an override {} clears it (a mapping is replaced, not merged)
    def shown(*overrides):
        status, out, err = recipe_main("claw", *CONFIG, "--show-config", *overrides)
        assert status == 0, err
        (line,) = [ln for ln in out.splitlines() if ln.startswith("rl.train.optim.lr_multipliers:")]
        return line.split("#")[0].strip()

    assert shown() == "rl.train.optim.lr_multipliers: {'^model[.]norm[.]weight$': 300.0}"
    assert shown("rl.train.optim.lr_multipliers={}") == "rl.train.optim.lr_multipliers: {}"
    assert shown("rl.train.optim.lr_multipliers={lm_head: 2}") == "rl.train.optim.lr_multipliers: {lm_head: 2.0}"


def test_show_config_into_a_closed_pipe_ends_quietly():
    # `--show-config | head -1`: the reader is gone before the config is printed. Before, a BrokenPipeError's
    # traceback and an "Exception ignored" message; now nothing on stderr and status 141 (128 + SIGPIPE).
    proc = subprocess.Popen([sys.executable, str(ROOT / "recipes/claw.py"), *CONFIG, "--show-config"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the recipe's imports are done: its first write meets a closed pipe
    _, err = proc.communicate(timeout=300)
    assert (proc.returncode, err) == (141, "")


def test_ctrl_c_during_a_run_is_one_line_and_status_130(tmp_path):
    # Ctrl-C signals the terminal's whole process group: the recipe and the servers and programs it started.
    proc = subprocess.Popen([sys.executable, str(ROOT / "recipes/claw.py"), *CONFIG, f"output_dir={tmp_path / 'run'}",
                             "eval.progress_interval_s=0.5", "threads=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in proc.stdout:
            if "eval base:" in line:  # the base evaluation's episodes are in flight
                break
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert (proc.returncode, err) == (130, "interrupted\n")
    assert "stage  harness" not in out  # it stopped


def test_a_previous_run_in_output_dir_is_one_line_before_any_work(tmp_path, recipe_main):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    code, stdout, stderr = recipe_main("claw", *CONFIG, f"output_dir={out}")
    assert (code, stdout) == (2, "")
    assert stderr == (f"error: output_dir '{out}' holds a previous run (metrics.jsonl); choose another output_dir, "
                      f"or existing=move to move it aside to '{out}.1', or existing=resume to continue it\n")
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]  # untouched
    assert recipe_main("claw", *CONFIG, f"output_dir={out}", "existing=overwrite") == (
        2, "", "error: existing must be one of ['refuse', 'move', 'resume'], got 'overwrite'\n")
