"""Orchard-SWE: repository-level issue resolution in sandboxes; credit-assigned SFT, then RL and a value reranker.

Stages (`orchard.stages`): held-out evaluation of the base model on three harnesses (bash-only, tool calling, and a
third convention held out of training) -> the teacher's trajectories, 5 per task through each trained harness,
failures kept (the paper's): ``teacher.url``'s model (any OpenAI-compatible endpoint sharing the student's
tokenizer, sampled at ``teacher.temperature``), or by default the scripted teacher (a program that replays each
task's gold patch, with seeded mistakes; not a model) -> curation (``sft.curate``: those over ``sft.max_len`` and those with
undefined, invalid or unparseable tool calls dropped) -> hindsight values of the failed ones from a value teacher behind the
engine / OpenAI interface -> SFT in ``sft.mode``: resolved-only, all, or credit (resolved trajectories whole, failed
ones only on the steps whose TD credit is >= 0.05) -> held-out evaluation (resolve rate, pass@k) on the three
harnesses -> the task filter (8 rollouts of the SFT policy per RL instance, keep 0 < p̂ <= 0.5; the RL instances
are ``instances.rl_path``'s, apart from SFT's as in the paper, else the train ones) -> RL in ``rl.variant`` (the
RL_VARIANTS table; grpo_bar: GRPO with Balanced Adaptive Rollout on the outcome reward) on the kept instances
through the trained harnesses -> held-out evaluation -> a value model trained on the run's rollouts, and
best-of-6 by value over the final policy's held-out candidates beside random and oracle. Sandbox failures are
counted, never scored. Each stage's episodes draw their sandboxes from a warm pool sized to what it
plays at once (``env_pool`` the most); the embedded service shares the pytest bundle with every sandbox. Writes ``metrics.jsonl``, ``results.json`` (with the resolved config),
``learning_curve.png``, ``rl_summary.json`` (BAR's positive ratio per group), ``rerank.json`` and
``value_curves.png`` under ``output_dir``.

Single machine (CPU, a tiny random Qwen3, an offline tokenizer, seeded toy instances, the embedded sandboxes):

    python recipes/swe.py --config recipes/configs/swe_tiny.yaml [key=value ...]

Multi-GPU, the paper's setting (the student Qwen3.5-35B-A3B from a local path; vLLM over this node's GPUs; the trainer a
single-process DeepSpeed ZeRO-3 engine; instances in the SWE-bench schema on disk, SFT, RL and held-out files apart,
each instance's repository a local clone or git worktree at its base_commit under ``instances.repo_root``
(``<repo_root>/<instance_id>``, checked before the run); a sandbox service already running on Kubernetes; a value
teacher and the OPD teacher served by URL, the latter checked to share the student's tokenizer; ``teacher.url``,
``teacher.model`` and ``teacher.tokenizer`` make a served model the trajectory teacher too) — this is the launch
line as it stands:

    SANDBOX_API_KEY=... python recipes/swe.py --config recipes/configs/swe.yaml \\
        model.path=/models/Qwen3.5-35B-A3B rl.teacher.tokenizer=/models/Qwen3.5-397B-A17B \\
        instances.path=/data/swe-gym-sft.jsonl \\
        instances.rl_path=/data/swe-gym-rl.jsonl instances.heldout_path=/data/swe-bench-verified.jsonl \\
        instances.repo_root=/data/repos env_url=https://sandboxes.example values.url=http://value-teacher:8000/v1

RL variants (``rl.variant``): ``grpo_bar``; on-policy distillation from ``rl.teacher`` (``opd_k2``, ``opd_k3``,
``opd_js``, ``opd_js_grpo``, the paper's best, without BAR as the paper ran it, and ``opd_js_grpo_bar``, the same
with BAR: a teacher served by URL, a local checkpoint, or at CPU scale a larger tiny model trained longer on the
scripted teacher's resolved trajectories, never the student); ``rpr``: GRPO on plain groups on outcome + rubric
process reward from ``rl.judge`` (an LLM judge by URL, or the programmatic stand-in).

Rollouts and training share this one process; several ranks under ``deepspeed`` / ``torchrun`` are not supported
yet.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from orchard import stages
from orchard._cli import run_main
from orchard.domains.swe.convention import unparseable_actions
from orchard.domains.swe.corpus import tokenizer_corpus
from orchard.domains.swe.generator import LEVELS, TEMPLATES
from orchard.domains.swe.harnesses import HARNESSES, TRAINABLE, swe_harnesses
from orchard.domains.swe.judge import judge_step_stats, judged_harnesses
from orchard.domains.swe.pools import instance_pools
from orchard.domains.swe.sandbox import sandbox_options, shared_folders
from orchard.domains.swe.teacher import ATTEMPTS_PER_TASK, SWETeacherEngine
from orchard.domains.swe.values import hindsight_values
from orchard.env.orchestrator import parse_cpu, parse_memory_mb
from orchard.stages import SFT_MODES, EvalConfig, RLConfig, RolloutConfig, SFTConfig, TaskFilterConfig
from orchard.stages.policy import ModelConfig, load_policy, make_engine
from orchard.train.config import ConfigError, config_to_dict
from orchard.train.metrics import WandbConfig
from orchard.train.objective import LossTerm

SCRIPTED_MAX_TOKENS = 4096  # the scripted teacher's edit turns quote whole hunks: more than a policy turn's budget
SCRIPTED = "the scripted teacher (gold-patch replay)"


@dataclass(frozen=True)
class RLVariant:
    """One RL composition: the objective's terms, the reward they read, BAR or plain groups, and what else it
    needs beside the policy (an OPD teacher's log-probs, a rubric judge)."""

    objective: tuple[LossTerm, ...]
    reward: str
    use_bar: bool
    teacher: bool = False
    judge: bool = False


POLICY = LossTerm("policy", 1.0, {"eps_low": 0.2, "eps_high": 0.28})  # GRPO, asymmetric clipping (paper)
JS = LossTerm("js_opd", 1.0, {"lam": 0.5})  # JS on-policy distillation, lambda 0.5 (paper)

# rl.variant -> the composition. The OPD rows score every rollout batch with rl.teacher (rl_stage(teacher=)); the
# RPR row judges every rollout (JudgedRollouts: reward = outcome + rubric_weight * rubric, judge failures removed
# from the loss). The OPD rows run without BAR, JS + GRPO included, as the paper ran its distillation rows; the pure
# OPD rows also without the group filter (no outcome term to need signal). opd_js_grpo_bar is the same objective on
# BAR's groups, a row of its own. grpo_bar keeps BAR and the filter. RPR runs on plain groups with the group filter:
# BAR balances resolved against unresolved rollouts and drops a group with no resolved one, which is exactly the
# group whose only signal is the rubric (our reading: the process reward is there to teach those).
RL_VARIANTS: dict[str, RLVariant] = {
    #                  objective                             reward     BAR    teacher judge
    "grpo_bar":        RLVariant((POLICY,),                  "outcome", True),
    "opd_k2":          RLVariant((LossTerm("k2_opd", 1.0),), "outcome", False, True),
    "opd_k3":          RLVariant((LossTerm("k3_opd", 1.0),), "outcome", False, True),
    "opd_js":          RLVariant((JS,),                      "outcome", False, True),
    "opd_js_grpo":     RLVariant((POLICY, JS),               "outcome", False, True),
    "opd_js_grpo_bar": RLVariant((POLICY, JS),               "outcome", True,  True),
    "rpr":             RLVariant((POLICY,),                  "outcome", False, False,  True),  # the judge folds R in
}
# The variant sets these; the config loader refuses them.
DERIVED = {**stages.derived_keys("sft", "rl"), "rl.use_bar": "rl.variant", "rl.reward": "rl.variant",
           "rl.train.objective": "rl.variant"}


@dataclass
class InstancesConfig:
    path: str | None = None
    """Instances in the SWE-bench schema (JSONL, parquet or a saved dataset): the teacher's tasks (SFT data), and
    RL's unless rl_path is set; null generates seeded toy ones."""
    heldout_path: str | None = None
    """Held-out instances (same formats); with path set, required."""
    rl_path: str | None = None
    """RL instances (same formats; a saved DatasetDict's "rl" split), kept apart from path's as the paper keeps
    its RL pool apart from SFT's; null: RL draws from path's. Needs path."""
    repo_root: str | None = None
    """Folder of repository snapshots, ``<repo_root>/<instance_id>`` each (a clone or ``git worktree`` checked out
    at the row's base_commit), for rows with neither files nor repo_dir; every snapshot is checked with git to be
    at its base_commit, unchanged, before the run starts. Needs path."""
    train_per_template: int = 2
    """Toy instances per repository template for training (6 templates)."""
    heldout_per_template: int = 1
    """Toy held-out instances per template (bugs never seen in training)."""
    levels: list[int] = field(default_factory=lambda: list(LEVELS))
    """Toy difficulty levels: 1 the issue names the module, 2 it must be found, 3 the fix spans two places."""
    templates: list[str] = field(default_factory=list)
    """Toy repository templates to draw from (empty: all six)."""


@dataclass
class TeacherConfig(stages.TeacherConfig):
    attempts: int = ATTEMPTS_PER_TASK
    """Teacher trajectories per task and harness, failures kept (the paper: 5)."""
    failure_rate: float = 0.3
    """Share of the scripted teacher's attempts that go wrong (wrong file, partial fix, regression, untested); the
    scripted teacher is a program that replays each task's gold patch, not a model (url null)."""

    def __post_init__(self) -> None:
        if isinstance(self.failure_rate, bool) or not isinstance(self.failure_rate, (int, float)) \
                or not 0 <= self.failure_rate <= 1:
            raise ValueError(f"failure_rate must be a number in [0, 1], got {self.failure_rate!r}")
        super().__post_init__()


@dataclass
class ValuesConfig:
    url: str | None = None
    """OpenAI-compatible URL of the value teacher; null uses the scripted estimator in process."""
    model: str = "orchard"
    """Model name sent to the value teacher."""
    eps: float = 0.05
    """Credit threshold: a failed trajectory trains on the steps whose TD credit is at least this (the paper's)."""


@dataclass
class JudgeConfig:
    url: str | None = None
    """OpenAI-compatible LLM judge for the rubric process reward; null: the programmatic judge (``ScriptedJudge``, a
    stand-in that scores R1-R7 from the trajectory's evidence) in process."""
    model: str = "orchard"
    """Model name sent to the judge server."""
    rubric_weight: float = 1.0
    """RL reward = outcome (+1 / -1) + rubric_weight x rubric (in [0, 1]); in [0, 1] so a resolved rollout always
    ranks first."""


@dataclass
class SWERLConfig(RLConfig):
    variant: str = "grpo_bar"
    """The RL composition, a row of RL_VARIANTS: grpo_bar (GRPO + BAR on the outcome); opd_k2, opd_k3, opd_js (on-
    policy distillation from rl.teacher), opd_js_grpo (JS + GRPO on plain groups, the paper's best, run without BAR
    as the paper ran it), opd_js_grpo_bar (the same on BAR's groups, its own row), rpr (GRPO on outcome + rubric
    process reward from rl.judge, on plain groups: BAR would drop the all-failed groups the rubric grades).
    It sets use_bar, reward, train.objective (and group_filter none for pure OPD)."""
    filter: TaskFilterConfig = field(default_factory=TaskFilterConfig)
    """The task filter before RL."""
    teacher: stages.OPDTeacherConfig = field(default_factory=stages.OPDTeacherConfig)
    """The OPD teacher (opd_* variants)."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The rubric judge (rpr)."""

    def __post_init__(self) -> None:
        if self.variant not in RL_VARIANTS:
            raise ValueError(f"variant must be one of {list(RL_VARIANTS)}, got {self.variant!r}")
        row = RL_VARIANTS[self.variant]
        self.use_bar, self.reward = row.use_bar, row.reward
        self.train.objective = list(row.objective)
        if row.teacher and not any(term.name == "policy" for term in row.objective):
            self.group_filter = "none"  # pure distillation trains every group, signal or not
        if not 0.0 <= self.judge.rubric_weight <= 1.0:
            raise ValueError(f"judge.rubric_weight must be in [0, 1], got {self.judge.rubric_weight}")
        super().__post_init__()


@dataclass
class SWESFTConfig(SFTConfig):
    curate: bool = True
    """Before SFT, drop the teacher trajectories longer than max_len and those with undefined, invalid or
    unparseable tool calls (the paper's curation, `stages.curate_sft`); false: train on all, left-truncated."""


@dataclass
class ValueModelConfig(stages.ValueRerankConfig):
    harness: str = "bash"
    """Harness the candidates are played through."""


@dataclass
class SWEConfig:
    output_dir: str = "runs/swe"
    """Where metrics.jsonl, results.json, learning_curve.png, the trainer's logs and the model go."""
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
    """Sandbox service URL (key in SANDBOX_API_KEY); null starts the embedded service for the run, sharing the
    pytest bundle with every sandbox (read in place; a service by URL keeps its own way: pytest in its image, its
    shared folder, or sent with each sandbox's set-up)."""
    env_pool: int = 64
    """Most sandboxes kept created and started ahead for one stage (a warm pool per stage, sized to the episodes
    the stage plays at once: held-out tasks x attempts, train tasks x teacher attempts, RL tasks per step x N, ...,
    up to this); its idle ones are deleted when the stage ends. 0: every sandbox created on the spot."""
    sandbox_cpu: str | None = None
    """CPU every sandbox is requested with (a Kubernetes quantity: "2", "500m"; the paper: 2 vCPU); null: the
    service's default."""
    sandbox_memory: str | None = None
    """Memory every sandbox is requested with ("8Gi"; the paper: 8 GiB); null: the service's default."""
    harnesses: list[str] = field(default_factory=lambda: ["bash", "tool"])
    """Harnesses whose teacher trajectories train the model (bash and / or tool)."""
    threads: int = 0
    """torch CPU threads (0: leave torch's default)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    instances: InstancesConfig = field(default_factory=InstancesConfig)
    """Task pool."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The teacher of the SFT trajectories: a model by URL, or (url null) the scripted one that replays the gold
    patch."""
    values: ValuesConfig = field(default_factory=ValuesConfig)
    """Hindsight values for credit-assigned SFT."""
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(max_steps=12, max_tokens=256,
                                                                         concurrency=8, max_time_s=300.0))
    """Episode settings."""
    sft_mode: str = "credit"
    """What SFT learns from the teacher's trajectories: resolved (resolved only), all (unmasked), credit."""
    sft: SWESFTConfig = field(default_factory=SWESFTConfig)
    """Supervised stage."""
    rl: SWERLConfig = field(default_factory=SWERLConfig)
    """RL stage: task filter, then the variant's composition on the kept tasks through the trained harnesses."""
    value_model: ValueModelConfig = field(default_factory=ValueModelConfig)
    """Value model on the run's rollouts and best-of-N reranking of held-out candidates."""
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(attempts=1, harnesses=["bash", "tool", "eval"]))
    """Held-out evaluation (the eval harness is never trained on: a transfer test)."""

    def __post_init__(self) -> None:
        if self.existing not in stages.EXISTING_RUN_CHOICES:
            raise ValueError(f"existing must be one of {list(stages.EXISTING_RUN_CHOICES)}, "
                             f"got {self.existing!r}")
        if isinstance(self.loggers, str) or any(name not in stages.RUN_LOGGERS for name in self.loggers):
            raise ValueError(f"loggers must be among {list(stages.RUN_LOGGERS)}, got {self.loggers!r}")
        if not self.harnesses or any(h not in TRAINABLE for h in self.harnesses):
            raise ValueError(f"harnesses must be a non-empty list among {list(TRAINABLE)}, got {self.harnesses!r}")
        if any(h not in HARNESSES for h in self.eval.harnesses):
            raise ValueError(f"eval.harnesses must be among {list(HARNESSES)}, got {self.eval.harnesses!r}")
        if self.sft_mode not in SFT_MODES:
            raise ValueError(f"sft_mode must be one of {list(SFT_MODES)}, got {self.sft_mode!r}")
        if (self.instances.path is None) != (self.instances.heldout_path is None):
            raise ValueError("instances.heldout_path must be set exactly when instances.path is")
        for name in ("rl_path", "repo_root"):
            if getattr(self.instances, name) is not None and self.instances.path is None:
                raise ValueError(f"instances.{name} needs instances.path (toy instances carry their files and draw "
                                 f"RL from the train pool)")
        if any(level not in LEVELS for level in self.instances.levels) or not self.instances.levels:
            raise ValueError(f"instances.levels must be among {list(LEVELS)}, got {self.instances.levels!r}")
        if any(t not in TEMPLATES for t in self.instances.templates):
            raise ValueError(f"instances.templates must be among {sorted(TEMPLATES)}, got {self.instances.templates!r}")
        if self.value_model.harness not in TRAINABLE:
            raise ValueError(f"value_model.harness must be among {list(TRAINABLE)}, got {self.value_model.harness!r}")
        if isinstance(self.env_pool, bool) or not isinstance(self.env_pool, int) or self.env_pool < 0:
            raise ValueError(f"env_pool must be an int >= 0, got {self.env_pool!r}")
        for name, parse, like in (("sandbox_cpu", parse_cpu, "'2' or '500m'"),
                                  ("sandbox_memory", parse_memory_mb, "'8Gi' or '512Mi'")):
            value = getattr(self, name)
            try:  # a bad quantity is refused here, not by the service mid-run
                ok = value is None or (isinstance(value, str) and parse(value) is not None)
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"{name} must be a quantity string like {like} or null, got {value!r}")
        for key, url in (("teacher", self.teacher.url), ("rl.teacher", self.rl.teacher.url)):
            if url is not None and self.model.path is None:
                raise ValueError(f"{key}.url needs model.path: a tiny student's tokenizer is trained in the run, so "
                                 f"no served teacher can share it")

    def check_tokenizers(self, student: Any) -> None:
        """A `ConfigError` naming both unless every model that exchanges token ids with the student (``teacher.url``
        for SFT data; ``rl.teacher``'s URL or checkpoint for an OPD variant; the value backbone, which reads the
        student's rollouts) has the student's tokenizer (``student``: the tokenizer, or model.path to load it from)."""
        opd = self.rl.enabled and RL_VARIANTS[self.rl.variant].teacher
        t = self.rl.teacher
        for key, name, used in (("teacher.tokenizer", self.teacher.tokenizer,
                                 self.teacher.url is not None and (self.sft.enabled or opd)),
                                ("rl.teacher.tokenizer", t.tokenizer, opd and t.url is not None),
                                ("rl.teacher.path", t.path, opd and t.url is None and t.path is not None),
                                ("value_model.backbone", self.value_model.backbone, self.value_model.enabled)):
            if used and name is not None:
                stages.check_tokenizers(student, name, key=key, student_name="model.path")

    def sft_provenance(self) -> dict[str, str]:
        """What the SFT data is, for the SFT model's provenance."""
        return {
            "source": f"{self.teacher.describe(SCRIPTED)}'s {self.teacher.attempts} attempts per train instance "
                      f"through {self.harnesses} (trajectories/sft_teacher.jsonl.gz)"
                      + (", curated (stages.curate_sft)" if self.sft.curate else ""),
            "mode": self.sft_mode,
            "mask": {"resolved": "resolved trajectories, every generated token",
                     "all": "every valid trajectory, every generated token",
                     "credit": f"resolved trajectories whole; failed ones only on the tokens of steps with hindsight "
                               f"credit >= {self.values.eps} (stages.sft_samples)"}[self.sft_mode]}


async def run(cfg: SWEConfig) -> dict[str, Any]:
    try:  # a bad file or snapshot stops the run before it writes anything
        train, rl_pool, heldout = instance_pools(**asdict(cfg.instances))
    except ValueError as exc:
        raise ConfigError(f"instances.{exc}") from exc
    if cfg.model.path is not None:  # a checkpoint's tokenizer meets its teachers' before the run writes anything
        cfg.check_tokenizers(cfg.model.path)
    run = stages.RecipeRun(cfg.output_dir, seed=cfg.seed, threads=cfg.threads, eval_cfg=cfg.eval,
                           existing=cfg.existing, loggers=cfg.loggers, wandb=cfg.wandb, config=config_to_dict(cfg))
    model, tokenizer = load_policy(cfg.model, tokenizer_corpus([*train, *rl_pool, *heldout]), seed=cfg.seed)
    if cfg.model.path is None:  # a tiny student's tokenizer, trained just now, before any episode
        cfg.check_tokenizers(tokenizer)
    engine = make_engine(cfg.model, model, tokenizer, seed=cfg.seed)
    row, r, j, trajectories, dropped, pool = RL_VARIANTS[cfg.rl.variant], cfg.rollout, cfg.rl.judge, [], {}, []
    async with stages.pooled_sandboxes(cfg.env_url, shared=shared_folders(), cpu=cfg.sandbox_cpu,
                                       memory=cfg.sandbox_memory, max_pool=cfg.env_pool,
                                       pool_options=sandbox_options()) as sandboxes:
        raw = swe_harnesses(sandboxes, tokenizer, max_steps=r.max_steps, max_tokens=r.max_tokens,
                            max_time_s=r.max_time_s, concurrency=r.concurrency, seed=cfg.seed)
        harnesses = run.saving(raw)  # every episode written once, under the phase that played it
        trained = {h: harnesses[h] for h in cfg.harnesses}

        async def evaluate(stage: str, step: int) -> None:  # a warm pool for one harness's held-out episodes
            async with sandboxes.stage(len(heldout) * cfg.eval.attempts):
                await run.evaluate(stage, step, harnesses, engine, heldout)

        await evaluate("base", 0)
        if cfg.sft.enabled or (cfg.rl.enabled and row.teacher and cfg.rl.teacher.trained_here):  # SFT's corpus, the
            run.phase = "sft_teacher"
            async with sandboxes.stage(len(train) * cfg.teacher.attempts):                      # CPU OPD teacher's
                trajectories, stats = await stages.teacher_phase(
                    cfg.teacher, trained, train, student_tokenizer=tokenizer, scripted_max_tokens=SCRIPTED_MAX_TOKENS,
                    scripted=lambda: SWETeacherEngine(tokenizer, train, seed=cfg.seed,
                                                      failure_rate=cfg.teacher.failure_rate))
            run.log.log(stats, 0)
            if cfg.sft.curate:  # once: SFT and the CPU OPD teacher learn from the same corpus
                trajectories, dropped = stages.curate_sft(trajectories, max_len=cfg.sft.max_len,
                                                          unparseable=unparseable_actions)
        if cfg.sft.enabled:
            values = await hindsight_values(trajectories, tokenizer, estimator=cfg.values.url,
                                            model=cfg.values.model) if cfg.sft_mode == "credit" else {}
            samples, stats = stages.sft_samples(trajectories, mode=cfg.sft_mode, eps=cfg.values.eps,
                                                step_values=lambda t: values.get(id(t)))
            run.log.log({**stats, **dropped}, 0)
            run.log.print("teacher: " + " ".join(f"{k.split('/')[1]}={x:.0f}" for k, x in {**stats, **dropped}.items()))
            await run.sft(model, tokenizer, engine, samples, cfg.sft, provenance=cfg.sft_provenance())
            await evaluate("sft", len(run.sft_history))
        if cfg.rl.enabled:
            teacher = stages.opd_teacher(cfg.rl.teacher, tokenizer, trajectories, sft=cfg.sft, dtype=cfg.model.dtype,
                                         student_hidden_size=None if cfg.model.path else cfg.model.hidden_size,
                                         seed=cfg.seed, output_dir=run.out / "opd_teacher",
                                         log=run.log.print) if row.teacher else None
            run.phase = "rl"  # the stage hands the engine new weights after every update: the final policy after it
            plain = {h: raw[h] for h in cfg.harnesses}  # saved below, once, judged where judged
            rl = await stages.rl_phase(
                model, engine, judged_harnesses(plain, tokenizer, rl_pool, judge=j.url, model=j.model,
                                                rubric_weight=j.rubric_weight) if row.judge else plain,
                rl_pool, cfg.rl, task_filter=cfg.rl.filter, filter_harnesses=plain, rollout=r,
                pad_id=tokenizer.pad_token_id, seed=cfg.seed, output_dir=run.out / "rl", log=run.log, teacher=teacher,
                step_stats=judge_step_stats if row.judge else None, sandboxes=sandboxes)
            (run.out / "rl_summary.json").write_text(json.dumps({"variant": cfg.rl.variant, **rl.summary}, indent=2))
            run.rl_history, pool = rl.history, rl.generated
            run.save_trajectories(pool)  # the task filter's and the RL stage's rollouts, judged where judged
            if teacher is not None:
                await teacher.close()
            if run.rl_history:
                run.save_policy(model, tokenizer, "rl_model")
                await evaluate("rl", len(run.rl_history))
        if cfg.value_model.enabled:
            run.phase = "value_rerank"
            await stages.value_rerank_phase(
                cfg.value_model, harnesses[cfg.value_model.harness], engine, heldout, pool, tokenizer, policy=model,
                default_backbone=run.out / "sft_model" if cfg.sft.enabled else None,
                temperature=cfg.eval.temperature, seed=cfg.seed, output_dir=run.out, log=run.log, sandboxes=sandboxes)
    return await run.finish(engine, config_to_dict(cfg))


def main(argv: list[str] | None = None) -> int:
    return stages.recipe_main(SWEConfig, run, argv, doc=__doc__, derived=DERIVED)


if __name__ == "__main__":
    sys.exit(run_main(main))
