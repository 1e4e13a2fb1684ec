"""Orchard-GUI: train a browser agent (the 13 tools over Chromium in sandboxes) with SFT, then multi-turn GRPO.

Stages (`orchard.stages`, the domain `orchard.domains.gui`): the teacher plays 4 rollouts per train task
(failures kept; ``teacher.url``'s model through the policy's GUI harness, or by default the scripted teacher, a
program that knows each task's hidden answer, not a model), the two-stage judge scores them -> held-out evaluation of the base model -> SFT curation (the
shortest judged success per task, at most K = 20 tasks per website) and SFT with one target assistant turn
per serialized prefix (with screenshots: the checkpoint's image processor renders them, only the last
``keep_last_images`` of each prefix kept as images, as the policy's own prompts keep them; the vision tower frozen
with ``model.freeze_vision``, as the paper trains) -> evaluation -> multi-turn GRPO (+1 when every turn is well
formed, one or more tool calls, and the two-stage judge confirms completion, -1 after repeated format failures, 0
otherwise; the trajectory's advantage on all its assistant tokens; dynamic sampling drops groups whose rewards
are all 0 or all positive; clipping 0.2 / 0.28, no KL), one RL stage per step budget of the curriculum (15 then
30 turns) -> evaluation. Held-out success is the task's checker. Captcha-blocked runs and judge failures leave
the loss and are counted; sandbox failures are dropped.
Writes ``metrics.jsonl``, ``results.json`` (with the resolved config) and ``learning_curve.png`` under
``output_dir``.

The teacher plays first: the tiny model's offline tokenizer is trained on its episodes' text. One browser per
episode (a Chromium start each), so the tiny run is minutes, not seconds.

Single machine (CPU, a tiny random Qwen3 from a config, text view, the programmatic judge, the embedded sandbox
service that the recipe starts and stops itself; Chromium and Playwright from ``scripts/setup``):

    python recipes/gui.py --config recipes/configs/gui_tiny.yaml [key=value ...]

Multi-GPU, the paper's setting (Qwen3-VL-4B-Thinking from a local path, vLLM rollouts, DeepSpeed training, a
vision-language judge served by URL, a sandbox service already running) — this is the launch line as it stands:

    SANDBOX_API_KEY=... python recipes/gui.py --config recipes/configs/gui.yaml \\
        model.path=/models/Qwen3-VL-4B-Thinking env_url=https://sandboxes.example judge.url=http://vl-judge:8000/v1

Known gap (issue 19): the rollout engines get token ids only, so with ``images: true`` the policy's prompts hold
the template's vision placeholders but no pixels; the screenshots reach the trajectories and the judge, and SFT
trains on them. A policy that samples the vision tokens itself (a random tiny one does) stops the run when its
rollouts are rendered with pixels: no engine can ban those tokens yet (docs/gui.md). Rollouts and training share
this one process; several ranks are not supported yet.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field, replace
from typing import Any

from orchard import stages
from orchard._cli import run_main
from orchard.data import RenderedSample, Trajectory
from orchard.data.tokenizer import build_chat_tokenizer
from orchard.domains.gui.corpus import tokenizer_corpus
from orchard.domains.gui.curation import MAX_TASKS_PER_SITE, curate_sft, sft_turn_samples
from orchard.domains.gui.judge import (
    IMAGE_MODES,
    JudgedGUIRollouts,
    ProgrammaticJudge,
    judge_gui_trajectories,
)
from orchard.domains.gui.rollouts import gui_rollouts
from orchard.domains.gui.tasks import TEMPLATES, GUITask, split_tasks
from orchard.domains.gui.teacher import (
    ATTEMPTS_PER_TASK,
    DEFAULT_FAILURE_RATE,
    teacher_trajectories,
)
from orchard.domains.gui.tools import KEEP_LAST_IMAGES
from orchard.env import SandboxClient
from orchard.stages import EvalConfig, RLConfig, RolloutConfig, SFTConfig
from orchard.stages.policy import ModelConfig, load_image_processor, load_policy, make_engine
from orchard.stages.sandboxes import sandbox_service
from orchard.train.config import config_to_dict
from orchard.train.metrics import WandbConfig

DERIVED = stages.derived_keys("sft", "rl")


@dataclass
class TasksConfig:
    train_per_template: int = 20
    """Train tasks per template (the teacher's tasks and the RL pool)."""
    heldout_per_template: int = 4
    """Held-out tasks per template (other seeds, other sites)."""
    templates: list[str] = field(default_factory=list)
    """Templates used (empty: all nine, the captcha's included)."""
    max_tasks_per_site: int | None = MAX_TASKS_PER_SITE
    """SFT curation's K: at most this many tasks per website (the paper: 20, per issue 33; null: all)."""


@dataclass
class TeacherConfig(stages.TeacherConfig):
    attempts: int = ATTEMPTS_PER_TASK
    """Teacher rollouts per train task, failures kept (the paper: 4)."""
    failure_rate: float = DEFAULT_FAILURE_RATE
    """Share of the scripted teacher's attempts that go wrong (distracted, wrong value, done early); the scripted
    teacher is a program that knows each task's hidden answer and reads the text view, not a model (url null)."""

    def __post_init__(self) -> None:
        if isinstance(self.failure_rate, bool) or not isinstance(self.failure_rate, (int, float)) \
                or not 0 <= self.failure_rate <= 1:
            raise ValueError(f"failure_rate must be a number in [0, 1], got {self.failure_rate!r}")
        super().__post_init__()


@dataclass
class JudgeConfig:
    url: str | None = None
    """OpenAI-compatible URL of the two-stage judge (a vision-language model); null: the programmatic judge."""
    model: str = "orchard"
    """Model name sent to the judge."""
    images: str = "data_url"
    """How a URL judge gets the screenshots: data_url (a vision-language judge) or placeholder (text only)."""


@dataclass
class GUIConfig:
    output_dir: str = "runs/gui"
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
    """Seed of model initialisation, the teacher's noise, sampling and training."""
    env_url: str | None = None
    """Sandbox service URL (key in SANDBOX_API_KEY); null starts the embedded service for the run."""
    threads: int = 0
    """torch CPU threads (0: leave torch's default)."""
    images: bool = False
    """Screenshots in the observations (the paper's VLM; needs model.path, a checkpoint with an image processor)
    or the text view only (the tiny CPU recipe)."""
    keep_last_images: int | None = KEEP_LAST_IMAGES
    """With images: the policy sees only the last k screenshots as images, earlier ones a placeholder (the paper's
    rule; k = 3 is ours, the paper gives none). The one setting for both the agent loop's prompts and the SFT
    prefixes, so SFT trains on the context the policy sees; null keeps every screenshot."""
    max_prompt_tokens: int | None = None
    """A prompt longer than this ends the episode (the context is a budget too); null: no limit."""
    sft_warmup_fraction: float | None = None
    """When set, SFT warms up for this share of its steps (sft.train.optim.warmup_steps; the paper: 0.1)."""
    step_budgets: list[int] = field(default_factory=lambda: [15, 30])
    """RL's step-budget curriculum: one RL stage of rl.steps steps per budget, in order (the paper: 15 then 30)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    tasks: TasksConfig = field(default_factory=TasksConfig)
    """Task pool."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The teacher of the SFT rollouts: a model by URL through the policy's GUI harness, or (url null) the scripted
    one."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The two-stage judge of teacher and RL rollouts."""
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(max_steps=30, max_tokens=256,
                                                                         concurrency=8, max_time_s=600.0))
    """Episode settings (max_steps: the evaluation's step budget; RL uses step_budgets)."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised stage."""
    rl: RLConfig = field(default_factory=lambda: RLConfig(group_filter="all_zero_or_all_positive"))
    """GRPO stage (each budget of the curriculum)."""
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(attempts=1, harnesses=["gui"]))
    """Held-out evaluation."""

    def __post_init__(self) -> None:
        if self.existing not in stages.EXISTING_RUN_CHOICES:
            raise ValueError(f"existing must be one of {list(stages.EXISTING_RUN_CHOICES)}, "
                             f"got {self.existing!r}")
        if isinstance(self.loggers, str) or any(name not in stages.RUN_LOGGERS for name in self.loggers):
            raise ValueError(f"loggers must be among {list(stages.RUN_LOGGERS)}, got {self.loggers!r}")
        if any(t not in TEMPLATES for t in self.tasks.templates):
            raise ValueError(f"tasks.templates must be among {sorted(TEMPLATES)}, got {self.tasks.templates!r}")
        for key in ("train_per_template", "heldout_per_template"):
            if getattr(self.tasks, key) < 1:
                raise ValueError(f"tasks.{key} must be >= 1, got {getattr(self.tasks, key)}")
        if not self.step_budgets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                                        for b in self.step_budgets):
            raise ValueError(f"step_budgets must be a non-empty list of ints >= 1, got {self.step_budgets!r}")
        if self.eval.harnesses != ["gui"]:
            raise ValueError(f"eval.harnesses must be ['gui'], got {self.eval.harnesses!r}")
        if self.images and self.model.path is None:
            raise ValueError("images: true needs model.path (a vision-language checkpoint with its image "
                             "processor); the tiny model reads the text view")
        if self.keep_last_images is not None and (isinstance(self.keep_last_images, bool)
                                                  or not isinstance(self.keep_last_images, int)
                                                  or self.keep_last_images < 0):
            raise ValueError(f"keep_last_images must be an int >= 0 or null, got {self.keep_last_images!r}")
        k = self.tasks.max_tasks_per_site
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"tasks.max_tasks_per_site must be an int >= 1 or null, got {k!r}")
        if self.judge.images not in IMAGE_MODES:
            raise ValueError(f"judge.images must be one of {list(IMAGE_MODES)}, got {self.judge.images!r}")
        if self.sft_warmup_fraction is not None and not 0 <= self.sft_warmup_fraction < 1:
            raise ValueError(f"sft_warmup_fraction must be in [0, 1) or null, got {self.sft_warmup_fraction!r}")
        if self.teacher.url is not None and self.model.path is None:
            raise ValueError("teacher.url needs model.path: a tiny student's tokenizer is trained on the scripted "
                             "teacher's episodes, so no served teacher can share it")
        pool = len(self.tasks.templates or TEMPLATES) * self.tasks.train_per_template
        if self.rl.enabled and self.rl.tasks_per_step > pool:
            raise ValueError(f"rl.tasks_per_step must be <= the RL task pool ({pool} tasks), "
                             f"got {self.rl.tasks_per_step}")


def task_pools(cfg: GUIConfig) -> tuple[list[GUITask], list[GUITask]]:
    """(train tasks: the teacher's and the RL pool, held-out tasks)."""
    templates = tuple(cfg.tasks.templates) or None
    return (split_tasks("train", cfg.tasks.train_per_template, seed=cfg.seed, templates=templates),
            split_tasks("heldout", cfg.tasks.heldout_per_template, seed=cfg.seed, templates=templates))


def sft_config(cfg: GUIConfig, samples: int) -> SFTConfig:
    """``cfg.sft`` with its warm-up set to ``sft_warmup_fraction`` of the steps `stages.sft_stage` will take."""
    if cfg.sft_warmup_fraction is None:
        return cfg.sft
    warmup = round(cfg.sft_warmup_fraction * stages.sft_steps(cfg.sft, samples))
    optim = replace(cfg.sft.train.optim, warmup_steps=warmup)
    return replace(cfg.sft, train=replace(cfg.sft.train, optim=optim))


async def teacher_phase(cfg: GUIConfig, client: SandboxClient, train: list[GUITask],
                        ) -> tuple[list[Trajectory], Any, Any]:
    """``teacher.attempts`` teacher rollouts per train task (failures kept) and the policy ``(model, tokenizer)``.
    With ``teacher.url``: the policy first, then the served model through the policy's own GUI harness at the
    curriculum's longest budget, sampled at ``teacher.temperature``. Else the scripted teacher plays first, and a
    tiny policy's tokenizer is trained on its episodes' text."""
    t = cfg.teacher
    if t.url is None:
        played = await asyncio.to_thread(teacher_trajectories, client, train, attempts=t.attempts, seed=cfg.seed,
                                         failure_rate=t.failure_rate, max_steps=max(cfg.step_budgets),
                                         images=cfg.images)
        return (played, *load_policy(cfg.model, tokenizer_corpus(played), seed=cfg.seed))
    model, tokenizer = load_policy(cfg.model, [], seed=cfg.seed)
    played, _ = await stages.teacher_phase(t, {"gui": policy_rollouts(cfg, client, tokenizer, None, max(cfg.step_budgets))},
                                           train, student_tokenizer=tokenizer)
    return played, model, tokenizer


def make_judge(cfg: GUIConfig) -> tuple[Any, dict[str, Any]]:
    """The judge (a URL, or the programmatic judge in process) and the keywords of its calls."""
    if cfg.judge.url is not None:
        return cfg.judge.url, {"model": cfg.judge.model, "images": cfg.judge.images}
    return ProgrammaticJudge(build_chat_tokenizer()), {}


def sft_samples(cfg: GUIConfig, curated: list[Trajectory], tokenizer: Any, processor: Any) -> list[RenderedSample]:
    """One sample per assistant turn of ``curated`` (`sft_turn_samples`). With ``images``, ``processor`` (the
    checkpoint's, `load_image_processor`) renders the screenshots, and each prefix keeps only its last
    ``keep_last_images`` as images: the context the policy's prompts hold at that turn (`gui_rollouts`'
    ``keep_images``, set from the same field)."""
    if not cfg.images:
        return sft_turn_samples(curated, tokenizer)
    return sft_turn_samples(curated, tokenizer, keep_images=cfg.keep_last_images, processor=processor)


def policy_rollouts(cfg: GUIConfig, client: SandboxClient, tokenizer: Any, processor: Any, max_steps: int) -> Any:
    """The policy's `gui_rollouts` under ``cfg`` with a step budget of ``max_steps``: with ``images`` its prompts
    keep the last ``keep_last_images`` screenshots as images (the SFT prefixes' rule, `sft_samples`) and
    ``processor`` renders its training samples."""
    r = cfg.rollout
    return gui_rollouts(client, tokenizer, max_steps=max_steps, images=cfg.images,
                        keep_images=cfg.keep_last_images if cfg.images else None, processor=processor,
                        max_tokens=r.max_tokens, seed=cfg.seed, concurrency=r.concurrency, max_time_s=r.max_time_s,
                        max_prompt_tokens=cfg.max_prompt_tokens)


async def run(cfg: GUIConfig) -> dict[str, Any]:
    if cfg.teacher.url is not None:  # the teacher answers the student's ids: checked before any work
        stages.check_tokenizers(cfg.model.path, cfg.teacher.tokenizer, key="teacher.tokenizer",
                                student_name="model.path")
    run = stages.RecipeRun(cfg.output_dir, seed=cfg.seed, threads=cfg.threads, eval_cfg=cfg.eval,
                           existing=cfg.existing, loggers=cfg.loggers, wandb=cfg.wandb,
                           config=config_to_dict(cfg))
    train, heldout = task_pools(cfg)
    judge, judge_kwargs = make_judge(cfg)
    processor = load_image_processor(cfg.model) if cfg.images else None  # fails before any work if missing
    with sandbox_service(cfg.env_url) as env, SandboxClient(*env) as client:
        # the teacher's 4 rollouts per task, judged like RL rollouts (captcha runs removed, counted)
        teacher, model, tokenizer = await teacher_phase(cfg, client, train)
        judged = await judge_gui_trajectories(judge, teacher, tasks=train, **judge_kwargs)
        run.phase = "sft_teacher"
        run.save_trajectories(teacher)
        engine = make_engine(cfg.model, model, tokenizer, seed=cfg.seed)
        r = cfg.rollout

        def rollouts(max_steps: int) -> Any:
            return policy_rollouts(cfg, client, tokenizer, processor, max_steps)

        # a fresh Rollouts per evaluation: each draws its episodes' seeds from cfg.seed anew
        await run.evaluate("base", 0, run.saving({"gui": rollouts(r.max_steps)}), engine, heldout)
        if cfg.sft.enabled:
            curated = curate_sft(teacher, train, max_tasks_per_site=cfg.tasks.max_tasks_per_site, seed=cfg.seed)
            samples = sft_samples(cfg, curated, tokenizer, processor)
            stats = {"sft/teacher_episodes": float(len(teacher)),
                     "sft/teacher_passed": float(sum(t.passed for t in teacher)),
                     "sft/curated_tasks": float(len(curated)), "sft/samples": float(len(samples)),
                     **{k.replace("rl/", "sft/teacher_"): v for k, v in judged.items()}}
            run.log.log(stats, 0)
            run.log.print("teacher: " + " ".join(f"{k.split('/')[1]}={v:.0f}" for k, v in stats.items()))
            await run.sft(model, tokenizer, engine, samples, sft_config(cfg, len(samples)), provenance={
                "source": f"{cfg.teacher.describe()}'s "
                          f"{len(teacher)} rollouts of the train tasks, judged "
                          "(trajectories/sft_teacher.jsonl.gz)",
                "kept": "curate_sft: passed rollouts, at most tasks.max_tasks_per_site tasks per site",
                "mask": "one sample per assistant turn (sft_turn_samples): that turn's tokens"}, processor=processor)
            await run.evaluate("sft", len(run.sft_history), run.saving({"gui": rollouts(r.max_steps)}), engine,
                               heldout)
        if cfg.rl.enabled:
            for budget in cfg.step_budgets:
                offset = len(run.rl_history)

                def on_step(stats: dict[str, float], step: int, budget: int = budget, offset: int = offset) -> None:
                    run.log.log({**stats, "rl/step_budget": float(budget)}, offset + step)
                    run.log.print(f"rl step {offset + step} (budget {budget}): success {stats['rl/success']:.2f} "
                                  f"groups {stats['rl/groups_with_signal']:.0f}/{stats['rl/groups']:.0f} removed "
                                  f"{stats['rl/removed']:.0f} format_errors {stats['rl/format_errors']:.0f}")

                judged_rollouts = run.saving({"gui": JudgedGUIRollouts(rollouts(budget), judge, **judge_kwargs)})
                run.phase = f"rl_budget_{budget}"
                # each budget is one RL stage: a fresh optimizer and schedule on the weights the last one left
                run.rl_history += await stages.rl_stage(model, engine, judged_rollouts, train, cfg.rl,
                                                        rollout=r, pad_id=tokenizer.pad_token_id, seed=cfg.seed,
                                                        output_dir=str(run.out / "rl" / f"budget_{budget}"),
                                                        log=on_step)
            run.save_policy(model, tokenizer, "rl_model", processor=processor)
            await run.evaluate("rl", len(run.rl_history), run.saving({"gui": rollouts(r.max_steps)}), engine, heldout)
    return await run.finish(engine, config_to_dict(cfg))


def main(argv: list[str] | None = None) -> int:
    return stages.recipe_main(GUIConfig, run, argv, doc=__doc__, derived=DERIVED)


if __name__ == "__main__":
    sys.exit(run_main(main))
