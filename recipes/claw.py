"""Orchard-Claw: train a personal-assistant agent (mail, calendar, inventory, files) with SFT, then GRPO.

Stages (`orchard.stages`): held-out evaluation of the base model -> SFT on the teacher's episodes through both
harnesses that passed (inputs masked; every episode kept on disk): ``teacher.url``'s model (any OpenAI-compatible
endpoint sharing the student's tokenizer), or by default the scripted teacher (a program that holds each task's
plan, not a model) -> evaluation -> optionally (``rl.start_temperature.search``) the policy's best
sampling temperature on a validation split folded into its weights, evaluated as "sft_best_t" -> GRPO on the train
split (+1 when every check of the task passed, -1 otherwise; group-relative advantages; clipped policy loss
0.2 / 0.28; optionally Balanced Adaptive Rollout, and the paper's task filter first, `rl.filter`: RL only on pool
tasks the starting policy solves 0 < p̂ <= 0.5), new weights handed to the rollout engine after every step ->
evaluation. Held-out success is the Claw-Eval pass
rule (task score >= 0.75). Episodes whose sandbox failed are counted and left out of training and scoring. Writes
``metrics.jsonl``, ``results.json`` (with the resolved config) and ``learning_curve.png`` under ``output_dir``.

Single machine (CPU, a tiny random Qwen3 from a config, an offline tokenizer, the embedded sandbox service that the
recipe starts and stops itself):

    scripts/claw                                    # set-up, then exactly the next line
    python recipes/claw.py --config recipes/configs/claw_tiny.yaml [key=value ...]

Multi-GPU, the paper's setting (Qwen3-30B-A3B-Thinking from a local path; vLLM spreads rollouts over this node's
GPUs with tensor_parallel_size 4; the trainer is a single-process DeepSpeed ZeRO-3 engine; a sandbox service
already running on Kubernetes or elsewhere) — this is the launch line as it stands:

    SANDBOX_API_KEY=... python recipes/claw.py --config recipes/configs/claw.yaml \\
        model.path=/models/Qwen3-30B-A3B-Thinking env_url=https://sandboxes.example

Several ranks (one node; several with ``--nnodes`` / a ``deepspeed`` hostfile, see docs/distributed.md): every
rank plays its block of each step's tasks and evaluation, training is DeepSpeed ZeRO-2 over the ranks, and rank 0
alone writes metrics, results, the plot and the models. Rollouts go to served replicas shared by the ranks
(``engine_urls``; rank 0 pushes new weights through ``save_dir = output_dir/weights``, a path every replica can
read), or, with ``engine_urls: []``, to an in-process HF engine per rank:

    orchard serve-model --model /models/policy --model-name orchard --device cuda:0 --port 8001 \\
        --allow-weight-updates &                   # one line per replica (same weights as model.path)
    CUDA_VISIBLE_DEVICES=1,2,3,4 torchrun --nproc_per_node 4 recipes/claw.py --config recipes/configs/claw.yaml \\
        model.path=/models/policy env_url=https://sandboxes.example 'engine_urls=[http://localhost:8001]' \\
        sft.train.engine=deepspeed rl.train.engine=deepspeed

On CPU (gloo), the tiny run on 2 ranks: ``torchrun --nproc_per_node 2 recipes/claw.py --config
recipes/configs/claw_tiny.yaml sft.train.engine=deepspeed rl.train.engine=deepspeed``. Under ZeRO-3 the ``model``
this script saves is partitioned: use ZeRO-2 here.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchard import stages
from orchard._cli import run_main
from orchard.domains.claw.corpus import tokenizer_corpus
from orchard.domains.claw.harness import ClawReactHarness
from orchard.domains.claw.tasks import TEMPLATES, VALIDATION_BLOCK, ClawTask, split_tasks
from orchard.domains.claw.teacher import TeacherEngine
from orchard.domains.claw.text_rollout import ClawTextRollouts
from orchard.env import AsyncSandboxClient
from orchard.rollout.rollouts import AgentLoopRollouts, Rollouts
from orchard.stages import EvalConfig, RLConfig, RolloutConfig, SFTConfig, TaskFilterConfig
from orchard.stages.policy import ModelConfig, load_policy, make_engine
from orchard.stages.ranks import Ranks, init_ranks
from orchard.stages.sandboxes import sandbox_service
from orchard.train.config import config_to_dict
from orchard.train.metrics import WandbConfig

HARNESSES = ("react", "text")
SCRIPTED_MAX_TOKENS = 4096  # the scripted teacher's turns are not held to a policy turn's budget
DERIVED = stages.derived_keys("sft", "rl")


@dataclass
class TasksConfig:
    train_per_template: int = 20
    """Train tasks per template (SFT demonstrations and, by default, the RL pool)."""
    heldout_per_template: int = 4
    """Held-out tasks per template (disjoint seeds)."""
    heldout_templates: list[str] = field(default_factory=list)
    """Templates kept out of training entirely (an out-of-template test); none by default."""
    rl_pool_per_template: int = 0
    """Train-split tasks per template that RL draws from (0: train_per_template). A larger pool holds the SFT
    tasks and fresh ones of the same templates, never a held-out task."""


@dataclass
class TeacherConfig(stages.TeacherConfig):
    attempts: int = 1
    """Teacher episodes per SFT task and harness, failures kept (a URL teacher samples; the scripted one plays one
    fixed plan per task, so more attempts repeat it: our choice of 1 for it; 5 is the paper's count for SWE)."""


@dataclass
class StartTemperatureConfig:
    search: bool = False
    """Before RL (and its task filter), choose the policy's best sampling temperature T on the validation split and
    fold it into the weights against rollout.temperature (`stages.start_at_best_temperature`): RL starts from the
    policy at T, and the held-out row "sft_best_t" is the baseline RL has to beat (issue 16). Off: RL starts from
    the policy as it is."""
    temperatures: list[float] = field(default_factory=lambda: list(stages.TEMPERATURE_GRID))
    """The grid searched (distinct, > 0; default 0.3 to 1.2 by 0.15)."""
    validation_per_template: int = 6
    """Validation tasks per trained template: ``split_tasks("train", n, seed=VALIDATION_BLOCK)``, disjoint from
    the SFT tasks, the RL pool and the held-out set."""
    attempts: int = 0
    """Episodes per validation task and temperature (0: eval.attempts)."""

    def __post_init__(self) -> None:
        stages.check_temperatures(self.temperatures)
        if isinstance(self.validation_per_template, bool) or not isinstance(self.validation_per_template, int) \
                or self.validation_per_template < 1:
            raise ValueError(f"validation_per_template must be an int >= 1, got {self.validation_per_template!r}")
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 0:
            raise ValueError(f"attempts must be an int >= 0, got {self.attempts!r}")


@dataclass
class ClawRLConfig(RLConfig):
    filter: TaskFilterConfig = field(default_factory=lambda: TaskFilterConfig(enabled=False))
    """The paper's task filter before RL (off by default here: the Claw recipe trains on its whole pool): the
    starting policy's rollouts on ``candidates`` pool tasks, RL on those with ``low < p̂ <= high``."""
    start_temperature: StartTemperatureConfig = field(default_factory=StartTemperatureConfig)
    """RL's start: the policy as it is, or (``search``) folded to its best validation temperature."""


@dataclass
class ClawConfig:
    output_dir: str = "runs/claw"
    """Where metrics.jsonl, results.json, learning_curve.png, the trainers' logs and the models go."""
    existing: str = "refuse"
    """When output_dir holds a previous run: refuse (stop before any work), move (rename it to output_dir.<n>
    and start afresh) or resume (append to it; RL continues from its checkpoint). A run is never deleted."""
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])
    """The run's metric sinks: jsonl (output_dir/metrics.jsonl, always), tensorboard (output_dir/tensorboard),
    wandb (one W&B run per recipe run, named after output_dir, grouped by its parent): every metric the run logs."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """W&B project, mode (online / offline / disabled), run name and group, used when loggers has wandb."""
    seed: int = 0
    """Seed of tasks order, model initialisation, sampling and training."""
    env_url: str | None = None
    """Sandbox service URL (key in SANDBOX_API_KEY); null starts the embedded service for the run."""
    harnesses: list[str] = field(default_factory=lambda: ["react", "text"])
    """Harnesses trained on (SFT and RL): react (in-process ReAct) and/or text (a separate program via the proxy)."""
    threads: int = 0
    """torch CPU threads (0: leave torch's default)."""
    engine_urls: list[str] = field(default_factory=list)
    """Base URLs of served replicas (orchard serve-model --model-name orchard --allow-weight-updates) that every
    rank's EnginePool shares; [] builds an in-process HF engine (or vLLM, model.engine) per rank."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    tasks: TasksConfig = field(default_factory=TasksConfig)
    """Task pool."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The teacher of the SFT episodes: a model by URL, or (url null) the scripted one (a program that holds each
    task's plan and plays it, not a model)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Episode settings."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised stage."""
    rl: ClawRLConfig = field(default_factory=ClawRLConfig)
    """GRPO stage."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""

    def __post_init__(self) -> None:
        if self.existing not in stages.EXISTING_RUN_CHOICES:
            raise ValueError(f"existing must be one of {list(stages.EXISTING_RUN_CHOICES)}, "
                             f"got {self.existing!r}")
        if isinstance(self.loggers, str) or any(name not in stages.RUN_LOGGERS for name in self.loggers):
            raise ValueError(f"loggers must be among {list(stages.RUN_LOGGERS)}, got {self.loggers!r}")
        for key, names in (("harnesses", self.harnesses), ("eval.harnesses", self.eval.harnesses)):
            if not names or any(n not in HARNESSES for n in names):
                raise ValueError(f"{key} must be a non-empty list among {list(HARNESSES)}, got {names!r}")
        for key in ("train_per_template", "heldout_per_template"):
            if getattr(self.tasks, key) < 1:
                raise ValueError(f"tasks.{key} must be >= 1, got {getattr(self.tasks, key)}")
        if self.teacher.url is not None and self.model.path is None:
            raise ValueError("teacher.url needs model.path: a tiny student's tokenizer is trained in the run, so no "
                             "served teacher can share it")
        if self.tasks.rl_pool_per_template < 0:
            raise ValueError(f"tasks.rl_pool_per_template must be >= 0, got {self.tasks.rl_pool_per_template}")
        pool = len(TEMPLATES) - len(self.tasks.heldout_templates)
        pool *= self.tasks.rl_pool_per_template or self.tasks.train_per_template
        if self.rl.enabled and self.rl.tasks_per_step > pool:
            raise ValueError(f"rl.tasks_per_step must be <= the RL task pool ({pool} tasks), "
                             f"got {self.rl.tasks_per_step}")
        if self.rl.enabled and self.rl.start_temperature.search:
            if not self.rollout.temperature > 0:
                raise ValueError("rollout.temperature must be > 0 with rl.start_temperature.search (the fold is the "
                                 f"chosen temperature / rollout.temperature), got {self.rollout.temperature}")
            largest = max(self.tasks.train_per_template, self.tasks.rl_pool_per_template)
            if largest > VALIDATION_BLOCK * 10_000:
                raise ValueError(f"tasks.train_per_template and tasks.rl_pool_per_template must be <= "
                                 f"{VALIDATION_BLOCK * 10_000} with rl.start_temperature.search (more would reach the "
                                 f"validation split's task seeds), got {largest}")


def rollout_engine(cfg: ClawConfig, model: Any, tokenizer: Any, ranks: Ranks) -> Any:
    """An `EnginePool` over ``cfg.engine_urls`` (rank 0 pushes the weights, the others drain and follow), else
    this process's own engine."""
    if not cfg.engine_urls:
        return make_engine(cfg.model, model, tokenizer, seed=cfg.seed)
    from orchard.rollout.engine_pool import EnginePool

    return EnginePool.from_urls(cfg.engine_urls, save_dir=str(Path(cfg.output_dir) / "weights"),
                                push_weights=ranks.is_main)


def task_pools(cfg: ClawConfig) -> tuple[list[ClawTask], list[ClawTask], list[ClawTask]]:
    """(SFT tasks, RL pool, held-out tasks)."""
    kept_out = tuple(cfg.tasks.heldout_templates)
    train = split_tasks("train", cfg.tasks.train_per_template, heldout_templates=kept_out)
    pool = split_tasks("train", cfg.tasks.rl_pool_per_template, heldout_templates=kept_out) \
        if cfg.tasks.rl_pool_per_template else train
    return train, pool, split_tasks("heldout", cfg.tasks.heldout_per_template)


def validation_tasks(cfg: ClawConfig) -> list[ClawTask]:
    """``rl.start_temperature``'s validation split: task seeds from ``VALIDATION_BLOCK`` on, disjoint from the SFT
    tasks, the RL pool and the held-out set."""
    n, kept_out = cfg.rl.start_temperature.validation_per_template, tuple(cfg.tasks.heldout_templates)
    return split_tasks("train", n, seed=VALIDATION_BLOCK, heldout_templates=kept_out)


def claw_harnesses(cfg: ClawConfig, tokenizer: Any, client: AsyncSandboxClient) -> dict[str, Rollouts]:
    """The domain's two harness paths behind one interface: ReAct in-process, the text program via the proxy."""
    r = cfg.rollout
    return {
        "react": AgentLoopRollouts(client, ClawReactHarness(max_steps=r.max_steps), tokenizer,
                                   max_tokens=r.max_tokens, seed=cfg.seed, max_time_s=r.max_time_s,
                                   concurrency=r.concurrency, start_jitter_s=0.2),
        "text": ClawTextRollouts(client, tokenizer, concurrency=r.concurrency, max_steps=r.max_steps,
                                 max_tokens=r.max_tokens, max_time_s=r.max_time_s),
    }


async def teacher_phase(cfg: ClawConfig, trained: dict[str, Rollouts], tokenizer: Any, tasks: list[ClawTask],
                        ) -> tuple[list[Any], dict[str, float]]:
    """``teacher.attempts`` teacher episodes per task through each trained harness, failures kept: ``teacher.url``'s
    model at ``teacher.temperature``, or the scripted teacher, greedy, on one task per distinct request (it
    recognises a task by its request)."""
    if cfg.teacher.url is None:
        tasks = list({task.prompt: task for task in reversed(tasks)}.values())[::-1]
    return await stages.teacher_phase(cfg.teacher, trained, tasks, student_tokenizer=tokenizer,
                                      scripted=lambda: TeacherEngine(tokenizer, tasks),
                                      scripted_max_tokens=SCRIPTED_MAX_TOKENS)


async def run(cfg: ClawConfig) -> dict[str, Any]:
    ranks = init_ranks()
    if cfg.teacher.url is not None and cfg.sft.enabled:  # the teacher answers the student's ids: checked first
        stages.check_tokenizers(cfg.model.path, cfg.teacher.tokenizer, key="teacher.tokenizer",
                                student_name="model.path")
    run = stages.RecipeRun(cfg.output_dir, seed=cfg.seed, threads=cfg.threads, eval_cfg=cfg.eval,
                           existing=cfg.existing, loggers=cfg.loggers, wandb=cfg.wandb,
                           config=config_to_dict(cfg), ranks=ranks)
    train_tasks, rl_pool, heldout = task_pools(cfg)
    model, tokenizer = load_policy(cfg.model, tokenizer_corpus(train_tasks), seed=cfg.seed)
    engine = rollout_engine(cfg, model, tokenizer, ranks)
    with sandbox_service(cfg.env_url) as env:
        async with AsyncSandboxClient(*env) as client:
            harnesses = run.saving(claw_harnesses(cfg, tokenizer, client))
            trained = {h: harnesses[h] for h in cfg.harnesses}
            await run.evaluate("base", 0, harnesses, engine, heldout)
            if cfg.sft.enabled:
                run.phase = "sft_teacher"
                played, stats = await teacher_phase(cfg, trained, tokenizer, train_tasks)
                samples = [s for t in played if t.valid and (t.reward or 0) > 0 for s in t.samples]
                run.log.log(stats, 0)
                await run.sft(model, tokenizer, engine, samples, cfg.sft, provenance={
                    "source": f"{cfg.teacher.describe()}'s {cfg.teacher.attempts} episode(s) per train task through "
                              f"{sorted(trained)} (trajectories/sft_teacher.jsonl.gz, failures kept)",
                    "kept": "episodes with reward > 0",
                    "mask": "every token the teacher generated (assistant content, tool calls, end of turn); "
                            "react: the episode rendered whole; text: each recorded call, chained by prefix"})
                await run.evaluate("sft", len(run.sft_history), harnesses, engine, heldout)
            if cfg.rl.enabled and cfg.rl.start_temperature.search:
                run.phase, st = "start_temperature", cfg.rl.start_temperature
                await stages.start_at_best_temperature(model, engine, trained, validation_tasks(cfg),
                                                       temperatures=st.temperatures,
                                                       attempts=st.attempts or cfg.eval.attempts,
                                                       reference=cfg.rollout.temperature, seed=cfg.seed, log=run.log,
                                                       step=len(run.sft_history))
                run.save_policy(model, tokenizer, "sft_best_t_model")
                await run.evaluate("sft_best_t", len(run.sft_history), harnesses, engine, heldout)
            if cfg.rl.enabled:  # the stage hands the engine new weights after every update: the final policy after it
                rl = await stages.rl_phase(model, engine, trained, rl_pool, cfg.rl, task_filter=cfg.rl.filter,
                                           rollout=cfg.rollout, pad_id=tokenizer.pad_token_id, seed=cfg.seed,
                                           output_dir=run.out / "rl", log=run.log, keep_generated=False,
                                           set_phase=lambda phase: setattr(run, "phase", phase))
                run.rl_history = rl.history
                if run.rl_history:
                    run.save_policy(model, tokenizer, "rl_model")
                    await run.evaluate("rl", len(run.rl_history), harnesses, engine, heldout)
    return await run.finish(engine, config_to_dict(cfg))


def main(argv: list[str] | None = None) -> int:
    return stages.recipe_main(ClawConfig, run, argv, doc=__doc__, derived=DERIVED)


if __name__ == "__main__":
    sys.exit(run_main(main))
