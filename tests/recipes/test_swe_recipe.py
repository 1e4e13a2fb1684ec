"""A short smoke run of the SWE recipe (part 1; part 2, RL, is test_swe_recipe_rl.py): embedded service, toy
instances of two templates, base evaluation on three harnesses, the scripted teacher's trajectories (failures
kept), hindsight values, credit-assigned SFT, evaluation; the whole recipe on a real fix, SFT and one step of JS
distillation included; its config errors; and the paper's config, loaded without running."""

import json
from dataclasses import asdict

import pytest
from swe_smoke import ROOT, assert_trained, real_files, recipe

from orchard.data import read_jsonl
from orchard.domains.swe.pools import instance_pools
from orchard.train.config import load_config

SMOKE = [
    "instances.train_per_template=2", "instances.heldout_per_template=1", "instances.levels=[1, 3]",
    "instances.templates=[inventory, ledger]", "teacher.attempts=3", "teacher.failure_rate=0.5",
    "rollout.max_tokens=48", "rollout.max_steps=8", "sft.epochs=1", "sft.train.global_batch_size=4",
    "sft.train.micro_batch_size=2", "model.hidden_size=32", "model.num_layers=1", "model.vocab_size=1024",
    "rl.enabled=false", "value_model.enabled=false",
]


# The real fix (cachetools issue #130, tests/domains/swe/cachetools_130) as train, RL and held-out instance at once:
# base evaluation, the scripted teacher (the gold patch replayed, 2 attempts, one may go wrong), SFT, evaluation, a
# CPU OPD teacher trained on the resolved attempts, one step of pure JS distillation (every group trains: signal
# without a resolved rollout), evaluation. Bash harness only, small budgets.
REAL_SMOKE = [
    "harnesses=[bash]", "eval.harnesses=[bash]", "teacher.attempts=2", "teacher.failure_rate=0.5",
    "sft_mode=resolved", "sft.epochs=1", "sft.train.global_batch_size=4", "sft.train.micro_batch_size=2",
    "rollout.max_tokens=48", "rollout.max_steps=10", "model.hidden_size=32", "model.num_layers=1",
    "model.vocab_size=1024", "rl.variant=opd_js", "rl.teacher.hidden_size=48", "rl.teacher.num_layers=1",
    "rl.teacher.epochs=1", "rl.filter.enabled=false", "rl.steps=1", "rl.tasks_per_step=1", "rl.group_size=2",
    "rl.train.global_batch_size=4", "rl.train.micro_batch_size=2", "value_model.enabled=false",
]


@pytest.fixture
def swe(recipe_module):
    """recipes/swe.py as a module, loaded once per session."""
    return recipe_module("swe")


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
    # curation (sft.curate, on by default) ran and the scripted teacher's episodes all passed it
    assert teacher["sft/dropped_over_length"] == 0 and teacher["sft/dropped_invalid_calls"] == 0
    assert teacher["sft/resolved"] > 0 and teacher["sft/failed"] > 0
    assert teacher["sft/unvalued"] == 0  # the scripted value teacher answered every failed trajectory
    # Credit SFT also learns from failed trajectories: the value teacher found credited steps in some of them.
    assert teacher["sft/credit_trajectories"] >= 1 and teacher["sft/credit_steps"] >= teacher["sft/credit_trajectories"]
    sft_rows = [json.loads(line) for line in (out / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert sft_rows and all(r["loss/total"] == r["loss/total"] for r in sft_rows)  # finite, ran
    assert (out / "learning_curve.png").stat().st_size > 5_000
    # every episode played is written once, under the phase that played it: the 24 teacher episodes (failures
    # kept), and 2 held-out instances x 3 harnesses per evaluation
    files = out / "trajectories"
    assert sorted(p.name for p in files.iterdir()) == ["eval_base.jsonl.gz", "eval_sft.jsonl.gz",
                                                       "sft_teacher.jsonl.gz"]
    assert [len(read_jsonl(files / f"{phase}.jsonl.gz")) for phase in ("sft_teacher", "eval_base", "eval_sft")] == [
        24, 6, 6]


@pytest.mark.parametrize(("override", "message"), [
    ("rl.judge.rubric_weight=2", "rl.judge.rubric_weight must be in [0, 1], got 2.0"),
    ("rl.variant=ppo", "rl.variant must be one of ['grpo_bar', 'opd_k2', 'opd_k3', 'opd_js', 'opd_js_grpo', "
                       "'opd_js_grpo_bar', 'rpr'], got 'ppo'"),
    ("teacher.url=ftp://teacher", "teacher.url must be an http(s) URL or null, got 'ftp://teacher'"),
    ("teacher.attempts=0", "teacher.attempts must be an int >= 1, got 0"),
    ("teacher.temperature=-1", "teacher.temperature must be a finite number >= 0, got -1.0"),
    ("teacher.tokenizer=no/such/dir", "teacher.tokenizer must be 'tiny', a local HF directory or a named checkpoint "
                                      "(smollm2-135m-instruct), got 'no/such/dir' (no such directory)"),
    ("teacher.url=http://teacher:8000/v1", "teacher.tokenizer must name the served model's tokenizer when url is set "
                                           "('tiny', a local HF directory or a named checkpoint): it is checked to be "
                                           "the student's"),
    ("rl.teacher.url=http://opd:8000/v1", "rl.teacher.tokenizer must name the served teacher's tokenizer when url is "
                                          "set: OPD scores the student's token ids, so it is checked to be the "
                                          "student's before any work"),
    ("sandbox_memory=8GB", "sandbox_memory must be a quantity string like '8Gi' or '512Mi' or null, got '8GB'"),
    ("sandbox_cpu='0'", "sandbox_cpu must be a quantity string like '2' or '500m' or null, got '0'"),
    ("rl.use_bar=false", "rl.use_bar is derived from rl.variant; set that instead"),
    ("sft_mode=credits", "sft_mode must be one of ['resolved', 'all', 'credit'], got 'credits'"),
    ("harnesses=[eval]", "harnesses must be a non-empty list among ['bash', 'tool'], got ['eval']"),
    ("sft.train.total_steps=3", "sft.train.total_steps is derived from sft.epochs; set that instead"),
    ("instances.path=x.jsonl", "instances.heldout_path must be set exactly when instances.path is"),
    ("instances.rl_path=rl.jsonl", "instances.rl_path needs instances.path (toy instances carry their files and "
                                   "draw RL from the train pool)"),
    ("instances.repo_root=repos", "instances.repo_root needs instances.path (toy instances carry their files and "
                                  "draw RL from the train pool)"),
    ("env_pool=-1", "env_pool must be an int >= 0, got -1"),
])
def test_config_mistakes_are_one_line(override, message, recipe_main):
    # in process (the recipe's own main under run_main, as its __main__ calls it): a subprocess per case costs a
    # torch import each; test_a_config_mistake_from_the_command_line runs one case as a user does
    status, _, err = recipe_main("swe", "--config", str(ROOT / "recipes/configs/swe_tiny.yaml"), override)
    assert status == 2
    assert err == f"error: {message}\n"


def test_the_recipe_reads_a_real_file_with_its_clones_and_refuses_a_clone_off_its_base_commit(
        swe, build_real_swe, fixture_git, recipe_main, tmp_path):
    real = build_real_swe(tmp_path / "real")
    cfg = load_config(swe.SWEConfig, ROOT / "recipes/configs/swe_tiny.yaml", real_files(real), derived=swe.DERIVED)
    train, rl_pool, heldout = instance_pools(**asdict(cfg.instances))  # the config's keys are its arguments
    assert [i.instance_id for i in (*train, *rl_pool, *heldout)] == ["tkem__cachetools-130"] * 3
    assert train[0].repo_dir == str(real.repo) and train[0].files is None
    # the clone moved on: the run stops before it writes anything, naming the file's key and the instance
    fixture_git(real.repo, "commit", "-q", "--allow-empty", "-m", "later work")
    head = fixture_git(real.repo, "rev-parse", "HEAD").strip()
    out = tmp_path / "run"
    status, _, err = recipe_main("swe", "--config", str(ROOT / "recipes/configs/swe_tiny.yaml"), *real_files(real),
                                 f"output_dir={out}")
    assert status == 2 and not out.exists()
    message = err.strip().split("\n")[-1]  # after the progress bars of `datasets` reading the file
    assert message.startswith(f"error: instances.path: tkem__cachetools-130: the snapshot '{real.repo}' is at commit "
                          f"{head}, not at its base_commit {real.base_commit}"), err


@pytest.mark.slow
def test_swe_recipe_smoke_on_a_real_fix(tmp_path, build_real_swe):
    real = build_real_swe(tmp_path / "real")
    out = tmp_path / "run"
    proc = recipe(f"output_dir={out}", *real_files(real), *REAL_SMOKE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())["results"]
    assert set(results) == {"base", "sft", "rl"}
    assert all(stage["bash"]["tasks"] == 1 and stage["bash"]["env_errors"] == 0 for stage in results.values())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    [teacher] = [r for r in rows if "sft/resolved" in r]
    # 2 attempts, both scored; the gold patch replayed resolves the real instance
    assert teacher["sft/resolved"] + teacher["sft/failed"] == 2 and teacher["sft/resolved"] >= 1
    sft_rows = [json.loads(line) for line in (out / "sft" / "metrics.jsonl").read_text().splitlines()]
    # SFT stepped on the teacher's resolved trajectories: a positive loss and a gradient
    assert sft_rows and all(r["loss/total"] > 0 and r["grad_norm"] > 0 for r in sft_rows)
    # the CPU OPD teacher, wider than the student, trained here on the resolved attempts
    assert "opd teacher: hidden 48 x 1 layers" in proc.stdout
    assert (out / "opd_teacher" / "metrics.jsonl").exists()
    [step] = [r for r in rows if "rl/episodes" in r]
    # the RL step trained a group of the RL pool's instance with signal: the student's JS divergence from the CPU
    # teacher (another model) on its own rollouts is positive, and the step had a gradient
    assert step["rl/episodes"] == 2 and step["rl/env_errors"] == 0
    assert_trained(step, spread=False)  # pure JS distillation: the teacher is the signal
    assert step["rl/groups_with_signal"] == 1 and step["opd/js"] > 0
    assert json.loads((out / "rl_summary.json").read_text())["steps"] == 1


def test_a_config_mistake_from_the_command_line():
    proc = recipe("rl.variant=ppo", timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("error: rl.variant must be one of ")


def test_paper_config_loads_with_the_papers_setting(tmp_path, swe):
    checkpoint, teacher = tmp_path / "Qwen3.5-35B-A3B", tmp_path / "Qwen3.5-397B-A17B"
    checkpoint.mkdir()
    teacher.mkdir()
    cfg = load_config(swe.SWEConfig, ROOT / "recipes/configs/swe.yaml",
                      [f"model.path={checkpoint}", f"rl.teacher.tokenizer={teacher}"], derived=swe.DERIVED)
    assert (cfg.model.path, cfg.model.engine, cfg.model.dtype) == (str(checkpoint), "vllm", "bfloat16")
    assert cfg.model.vllm_kwargs["max_model_len"] == 131072  # evaluation and rollouts at 128K
    assert (cfg.sft_mode, cfg.sft.epochs, cfg.sft.max_len) == ("credit", 5, 65536)  # 64K context, left truncation
    assert (cfg.sandbox_cpu, cfg.sandbox_memory) == ("2", "8Gi")  # 2 vCPU / 8 GiB per sandbox
    train = cfg.sft.train
    assert (train.global_batch_size, train.engine, train.zero_stage) == (128, "deepspeed", 3)
    assert (train.optim.lr, train.optim.min_lr) == (1e-5, 1e-6)  # the cosine's peak and floor
    assert cfg.instances.path and cfg.instances.heldout_path and cfg.env_url.startswith("https://")
    assert cfg.instances.rl_path not in (None, cfg.instances.path) and cfg.instances.repo_root  # RL apart from SFT
    assert (cfg.teacher.attempts, cfg.values.eps, cfg.eval.harnesses) == (5, 0.05, ["bash", "tool", "eval"])
    rl = cfg.rl  # part 2: JS + GRPO without BAR from the task filter's instances, the teacher served by URL
    assert (rl.variant, rl.steps, rl.tasks_per_step * rl.group_size, rl.use_bar) == ("opd_js_grpo", 150, 128, False)
    assert (rl.bar_n_max, rl.bar_stride, rl.bar_rho_min, rl.bar_rho_max) == (16, 16, 0.375, 0.625)  # opd_js_grpo_bar
    assert [t.name for t in rl.train.objective] == ["policy", "js_opd"] and rl.teacher.url.startswith("http")
    assert (rl.teacher.model, rl.teacher.tokenizer) == ("Qwen3.5-397B-A17B", str(teacher))
    assert (rl.train.global_batch_size, rl.train.optim.lr, rl.train.optim.min_lr) == (128, 1e-6, 1e-7)
    assert (rl.filter.attempts, rl.filter.high, cfg.value_model.candidates) == (8, 0.5, 6)
    assert cfg.value_model.backbone.endswith("-4B")  # the paper's value backbone size
    # student and teachers of one family: the paper's student is Qwen3.5-35B-A3B, never a Qwen3 beside a Qwen3.5
    assert "Qwen3.5" in cfg.model.path and "Qwen3.5" in rl.teacher.model and "Qwen3.5" in cfg.value_model.backbone
