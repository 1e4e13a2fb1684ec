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

import asyncio
import contextlib
import itertools
import json
import math
import sys
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from orchard import stages
from orchard._cli import run_main
from orchard.domains.swe.convention import unparseable_actions
from orchard.domains.swe.generator import LEVELS, TEMPLATES, generate_instances
from orchard.domains.swe.harness import SWEEvalHarness
from orchard.domains.swe.instances import SWEInstance, check_snapshots, load_instances
from orchard.domains.swe.judge import JudgedRollouts, ScriptedJudge
from orchard.domains.swe.sandbox import SHARED_PYTEST, patched_paths, sandbox_options, write_pytest_bundle
from orchard.domains.swe.teacher import ATTEMPTS_PER_TASK, SWETeacherEngine
from orchard.domains.swe.tool_rollout import SWEBashRollouts, SWEToolRollouts
from orchard.domains.swe.values import ScriptedValueEstimator, step_values_async
from orchard.env import AsyncSandboxClient, AsyncSandboxPool
from orchard.env.orchestrator import parse_cpu, parse_memory_mb
from orchard.models import tiny_qwen3
from orchard.rollout.hf_engine import HFEngine
from orchard.rollout.openai_engine import OpenAIEngine
from orchard.rollout.rollouts import AgentLoopRollouts, Rollouts
from orchard.stages import (
    SFT_MODES,
    EvalConfig,
    RecordedRollouts,
    RLConfig,
    RolloutConfig,
    SFTConfig,
    TaskFilterConfig,
)
from orchard.stages.policy import ModelConfig, load_policy, make_engine
from orchard.stages.sandboxes import PooledSandboxes, sandbox_service
from orchard.train.config import ConfigError, config_to_dict
from orchard.train.metrics import WandbConfig
from orchard.train.model import load_causal_lm
from orchard.train.objective import LossTerm
from orchard.value import ValueModel

HARNESSES = ("bash", "tool", "eval")
SCRIPTED_MAX_TOKENS = 4096  # the scripted teacher's edit turns quote whole hunks: more than a policy turn's budget
SCRIPTED = "the scripted teacher (gold-patch replay)"
TRAINABLE = ("bash", "tool")


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
class OPDTeacherConfig:
    url: str | None = None
    """OpenAI-compatible server that scores prompts (``vllm serve``, ``orchard serve-model``) over a model sharing
    the student's tokenizer: the paper's Qwen3.5-397B-A17B; null: ``path``, or a teacher trained here."""
    model: str = "orchard"
    """Model name sent to the teacher server."""
    tokenizer: str | None = None
    """The served teacher's tokenizer ('tiny', a local HF directory or a named checkpoint); required with url. Before
    any work it is checked to be the student's (vocabulary and special tokens), as is ``path``'s."""
    path: str | None = None
    """Local HF checkpoint of the teacher (scored in process); null with url null: at CPU scale a larger tiny model
    than the student, trained longer on the teacher corpus (the scripted teacher's resolved trajectories)."""
    hidden_size: int = 128
    """Hidden size of the CPU teacher (the student's model.hidden_size must be smaller: never the student itself)."""
    num_layers: int = 4
    """Layers of the CPU teacher."""
    epochs: float = 6.0
    """SFT epochs of the CPU teacher on the resolved teacher trajectories."""

    def __post_init__(self) -> None:
        if self.url is not None and self.tokenizer is None:
            raise ValueError("tokenizer must name the served teacher's tokenizer when url is set: OPD scores the "
                             "student's token ids, so it is checked to be the student's before any work")
        if self.url is not None or self.tokenizer is not None:  # the shared checks of a teacher by URL
            stages.TeacherConfig(url=self.url, model=self.model, tokenizer=self.tokenizer)


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
    teacher: OPDTeacherConfig = field(default_factory=OPDTeacherConfig)
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
class ValueModelConfig:
    enabled: bool = True
    """Train the value model on the run's verified train rollouts and rerank held-out candidates."""
    backbone: str | None = None
    """Local causal-LM checkpoint of the value backbone (the paper: 4B), checked before any work to have the
    student's tokenizer (it reads the student's rollouts); null: this run's SFT model (a fresh tiny one without
    SFT)."""
    candidates: int = 6
    """Candidates per held-out instance from the final policy, whose rollouts are not in the pool (the paper: 6)."""
    harness: str = "bash"
    """Harness the candidates are played through."""
    max_per_task: int = 8
    """Pool cap per task."""
    steps: int = 100
    """Value training steps."""
    batch_size: int = 8
    """Trajectories per value training step."""
    lr: float = 1.0e-4
    """AdamW learning rate of value training."""
    gamma: float = 0.98
    """GAE discount over decision steps (the paper: 0.98)."""
    lam: float = 0.95
    """GAE lambda (the paper: 0.95)."""
    max_len: int = 4096
    """Longest sequence the value model reads; longer trajectories are read in left-truncated windows."""


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
        if self.value_model.candidates < 2:
            raise ValueError(f"value_model.candidates must be >= 2, got {self.value_model.candidates}")
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


def instance_pools(cfg: SWEConfig) -> tuple[list[SWEInstance], list[SWEInstance], list[SWEInstance]]:
    """(train, RL, held-out): from disk, each snapshot checked to be at its base commit (a bad row or snapshot is a
    one-line `ConfigError` naming the file's key and the instance); or seeded toy instances whose held-out bugs
    never appear in training (RL draws from train)."""
    c = cfg.instances
    if c.path is None:
        kw = {"levels": tuple(c.levels), "templates": tuple(c.templates) or None}
        train = generate_instances("train", c.train_per_template, **kw)
        return train, train, generate_instances("heldout", c.heldout_per_template, **kw)
    pools: dict[str, list[SWEInstance]] = {}
    for key, path, split in (("path", c.path, "train"), ("rl_path", c.rl_path, "rl"),
                             ("heldout_path", c.heldout_path, "heldout")):
        if path is None:
            continue
        try:
            pools[key] = load_instances(path, split=split, repo_root=c.repo_root)
            check_snapshots(pools[key])
        except ValueError as exc:
            raise ConfigError(f"instances.{key}: {exc}") from exc
    return pools["path"], pools.get("rl_path", pools["path"]), pools["heldout_path"]


@contextlib.asynccontextmanager
async def swe_sandboxes(cfg: SWEConfig) -> AsyncIterator[PooledSandboxes]:
    """The run's sandboxes: the service (``env_url``, or the embedded one with the pytest bundle shared), a client,
    and the per-stage warm pools the harnesses draw from (`warm`)."""
    with sandbox_service(cfg.env_url, shared={SHARED_PYTEST: write_pytest_bundle}) as env:
        async with AsyncSandboxClient(*env) as client:
            yield PooledSandboxes(client, cpu=cfg.sandbox_cpu, memory=cfg.sandbox_memory)


def warm(sandboxes: PooledSandboxes, cfg: SWEConfig, episodes: int) -> AbstractAsyncContextManager[AsyncSandboxPool]:
    """A stage's warm pool for ``episodes`` played at once (up to ``env_pool``), closed when the stage ends."""
    return sandboxes.stage(min(episodes, cfg.env_pool), **sandbox_options())


def swe_harnesses(cfg: SWEConfig, tokenizer: Any, client: Any) -> dict[str, Rollouts]:
    """The three conventions behind one interface: bash and tool as a program via the proxy, eval in process;
    ``client`` an ``AsyncSandboxClient`` or the run's `PooledSandboxes`."""
    r = cfg.rollout
    program = {"concurrency": r.concurrency, "max_steps": r.max_steps, "max_tokens": r.max_tokens,
               "max_time_s": r.max_time_s}
    return {
        "bash": SWEBashRollouts(client, tokenizer, **program),
        "tool": SWEToolRollouts(client, tokenizer, **program),
        "eval": AgentLoopRollouts(client, SWEEvalHarness(max_steps=r.max_steps), tokenizer, max_tokens=r.max_tokens,
                                  seed=cfg.seed, max_time_s=r.max_time_s, concurrency=r.concurrency),
    }


def corpus(instances: list[SWEInstance]) -> list[str]:
    """The issues' text and the code the tasks are about, for the tiny model's offline tokenizer: a toy
    repository whole; of a snapshot on disk, the files its fix and its tests touch, and the fix."""
    texts = []
    for i in instances:
        texts.append(i.problem_statement)
        if i.files is not None:
            texts += i.files.values()
        else:
            touched = dict.fromkeys([*patched_paths(i.patch), *patched_paths(i.test_patch)])
            texts += [t for t in map(i.read, touched) if t is not None]
            texts.append(i.patch)
    return texts


async def teacher_phase(cfg: SWEConfig, trained: dict[str, Rollouts], tokenizer: Any,
                        train: list[SWEInstance]) -> tuple[list[Any], dict[str, float]]:
    """``teacher.attempts`` teacher trajectories per train instance through each trained harness, failures kept:
    from ``teacher.url``'s model at ``teacher.temperature``, or the scripted teacher (it replays the gold patch)."""
    return await stages.teacher_phase(cfg.teacher, trained, train, student_tokenizer=tokenizer,
                                      scripted=lambda: SWETeacherEngine(tokenizer, train, seed=cfg.seed,
                                                                        failure_rate=cfg.teacher.failure_rate),
                                      scripted_max_tokens=SCRIPTED_MAX_TOKENS)


def check_teacher_tokenizers(cfg: SWEConfig, student: Any) -> None:
    """A `ConfigError` naming both unless every model that exchanges token ids with the student (``teacher.url``
    for SFT data; ``rl.teacher``'s URL or checkpoint for an OPD variant; the value backbone, which reads the
    student's rollouts) has the student's tokenizer (``student``: the tokenizer, or model.path to load it from)."""
    opd = cfg.rl.enabled and RL_VARIANTS[cfg.rl.variant].teacher
    if cfg.teacher.url is not None and (cfg.sft.enabled or opd):
        stages.check_tokenizers(student, cfg.teacher.tokenizer, key="teacher.tokenizer", student_name="model.path")
    t = cfg.rl.teacher
    if opd and t.url is not None:
        stages.check_tokenizers(student, t.tokenizer, key="rl.teacher.tokenizer", student_name="model.path")
    elif opd and t.path is not None:
        stages.check_tokenizers(student, t.path, key="rl.teacher.path", student_name="model.path")
    if cfg.value_model.enabled and cfg.value_model.backbone is not None:
        stages.check_tokenizers(student, cfg.value_model.backbone, key="value_model.backbone",
                                student_name="model.path")


async def hindsight_values(cfg: SWEConfig, trajectories: list[Any], tokenizer: Any) -> dict[int, Any]:
    """The value teacher's ``{state: value}`` of every failed trajectory (None where its answer was unusable)."""
    estimator = cfg.values.url or ScriptedValueEstimator(tokenizer)
    failed = [t for t in trajectories if t.valid and t.samples and not (t.reward or 0) > 0]
    values = await asyncio.gather(*(step_values_async(t, client_or_engine=estimator, tokenizer=tokenizer,
                                                      model=cfg.values.model) for t in failed))
    return {id(t): v for t, v in zip(failed, values, strict=True)}


async def rl_task_pool(cfg: SWEConfig, trained: dict[str, Rollouts], engine: Any, instances: list[SWEInstance],
                       log: stages.RunLog) -> tuple[list[SWEInstance], list[Any]]:
    """The RL stage's tasks among ``instances`` (those of useful difficulty for the SFT policy, unless
    rl.filter.enabled is false) and the filter's rollouts."""
    f = cfg.rl.filter
    if not f.enabled:
        return instances, []
    kept = await stages.filter_tasks(trained, engine, f.candidates_of(instances, cfg.seed), attempts=f.attempts,
                                     low=f.low, high=f.high, temperature=cfg.rollout.temperature, seed=cfg.seed)
    log.log(kept.stats, 0)
    log.print(f"task filter: kept {len(kept.tasks)}/{kept.stats['filter/candidates']:.0f} ({f.low} < p̂ <= {f.high} "
              f"over {f.attempts} rollouts), success {kept.stats['filter/success']:.3f}")
    return kept.tasks, kept.trajectories


def bar_groups(calls_per_step: list[list[list[Any]]]) -> list[dict[str, Any]]:
    """BAR's positive ratio per group and step: over the group's pool (BAR's candidates: judge-removed rollouts,
    dropped timeouts and sandbox failures are not) and over the group_size it kept (None: dropped; pool None: no
    candidate). Read from the choice `stages.rollout_groups` made (each candidate's ``metadata["bar"]``), never
    made again here, so the report and the groups that trained agree, whatever the stride."""
    rows = []
    for step, calls in enumerate(calls_per_step, 1):
        groups: dict[str, list[dict[str, bool]]] = {}
        for traj in (t for call in calls for t in call):  # a step draws each task once: one group per task
            groups.setdefault(traj.task_id, [])
            if "bar" in traj.metadata:
                groups[traj.task_id].append(traj.metadata["bar"])
        for pool in groups.values():
            kept = [c["positive"] for c in pool if c["kept"]]
            rows.append({"step": step,
                         "pool_positive_ratio": sum(c["positive"] for c in pool) / len(pool) if pool else None,
                         "kept_positive_ratio": sum(kept) / len(kept) if kept else None})
    return rows


def judge_step_stats(trajectories: list[Any]) -> dict[str, float]:
    """The rubric judge's view of one RL step's generated rollouts (the RPR variant's curves): over those it graded,
    the mean rubric (in [0, 1]) and the mean RL reward (outcome + rubric_weight x rubric); 0 when none was graded."""
    graded = [t for t in trajectories if t.valid and not t.metadata.get("removed") and "rubric" in t.reward_components]
    n = len(graded)
    return {"rl/judge_graded": float(n),
            "rl/judge_rubric_mean": sum(t.reward_components["rubric"] for t in graded) / n if n else 0.0,
            "rl/judge_reward_mean": sum(t.reward for t in graded) / n if n else 0.0}


def opd_teacher(cfg: SWEConfig, out: Path, tokenizer: Any, trajectories: list[Any], log: stages.RunLog) -> Any:
    """The OPD teacher as a scoring engine: a server by URL, a local checkpoint, or (CPU) a larger tiny model than
    the student trained for ``rl.teacher.epochs`` on the scripted teacher's resolved trajectories."""
    t = cfg.rl.teacher
    if t.url is not None:
        return OpenAIEngine(t.url, model=t.model)
    if t.path is not None:
        teacher_model = load_causal_lm(t.path, dtype=cfg.model.dtype)
    else:
        if cfg.model.path is not None or t.hidden_size <= cfg.model.hidden_size:
            raise ValueError(f"rl.teacher: give url or path, or a CPU teacher larger than the tiny student "
                             f"(hidden_size {t.hidden_size} <= model.hidden_size {cfg.model.hidden_size})")
        samples, _ = stages.sft_samples(trajectories, mode="resolved")
        if not samples:
            raise ValueError("rl.teacher: the CPU teacher trains on the scripted teacher's resolved trajectories and "
                             "there are none; give rl.teacher.url or rl.teacher.path")
        h = t.hidden_size
        teacher_model = tiny_qwen3(tokenizer, seed=cfg.seed + 1, hidden_size=h, intermediate_size=3 * h,
                                   num_hidden_layers=t.num_layers, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=h // 4)
        history = stages.sft_stage(teacher_model, samples, replace(cfg.sft, epochs=t.epochs),
                                   pad_id=tokenizer.pad_token_id, seed=cfg.seed + 1,
                                   output_dir=str(out / "opd_teacher"))
        log.print(f"opd teacher: hidden {h} x {t.num_layers} layers, {len(samples)} samples, {len(history)} steps, "
                  f"loss {history[0]['loss/total']:.3f} -> {history[-1]['loss/total']:.3f}")
    return HFEngine(teacher_model.eval(), pad_token_id=tokenizer.pad_token_id, max_batch_size=64, seed=cfg.seed)


def judged(cfg: SWEConfig, trained: dict[str, Rollouts], tokenizer: Any, instances: list[SWEInstance],
           ) -> dict[str, Rollouts]:
    """The RPR variant's harnesses: every rollout graded by ``rl.judge`` (the reference block: the instance's
    hidden FAIL_TO_PASS tests and gold patch); judge failures leave the loss and are counted by the RL stage."""
    j = cfg.rl.judge
    judge: Any = j.url if j.url is not None else ScriptedJudge(tokenizer)
    by_id = {inst.instance_id: inst for inst in instances}

    def reference(traj: Any) -> dict[str, Any]:
        inst = by_id[traj.task_id]
        return {"fail_to_pass": inst.FAIL_TO_PASS, "gold_patch": inst.patch}

    return {h: JudgedRollouts(r, judge, rubric_weight=j.rubric_weight, reference=reference, model=j.model,
                              tokenizer=tokenizer) for h, r in trained.items()}


async def rl(cfg: SWEConfig, out: Path, harnesses: dict[str, Rollouts], sandboxes: PooledSandboxes, engine: Any,
             model: Any, tokenizer: Any, instances: list[SWEInstance], log: stages.RunLog, teacher: Any = None,
             ) -> tuple[list[dict[str, float]], list[Any]]:
    """Task filter over ``instances`` (the RL pool: instances.rl_path's, else the train instances), then
    ``rl.variant`` through the trained harnesses on the kept tasks (skipped when none is kept), each with its warm
    pool. Returns the RL history and every verified-or-not rollout generated on those tasks (the value pool)."""
    trained = {h: harnesses[h] for h in cfg.harnesses}
    rated = len(cfg.rl.filter.candidates_of(instances, cfg.seed))
    async with warm(sandboxes, cfg, rated * math.ceil(cfg.rl.filter.attempts / len(trained))):
        tasks, generated = await rl_task_pool(cfg, trained, engine, instances, log)
    judges = judged(cfg, trained, tokenizer, instances) if RL_VARIANTS[cfg.rl.variant].judge else None
    trained = judges or trained
    summary: dict[str, Any] = {"variant": cfg.rl.variant, "tasks": len(tasks), "steps": 0}
    history: list[dict[str, float]] = []
    if tasks:
        # A filter that keeps fewer tasks than a step draws shrinks the step rather than failing the run.
        rl_cfg = replace(cfg.rl, tasks_per_step=min(cfg.rl.tasks_per_step, len(tasks)))
        calls: list[list[Any]] = []
        recorded = {h: RecordedRollouts(r, calls) for h, r in trained.items()}
        marks = [0]

        def on_step(stats: dict[str, float], step: int) -> None:
            step_trajs = [t for c in calls[marks[-1]:] for t in c]
            marks.append(len(calls))
            log.log({**stats, **(judge_step_stats(step_trajs) if judges is not None else {})}, step)
            log.print(f"rl step {step}: success {stats['rl/success_generated']:.2f} groups "
                      f"{stats['rl/groups_with_signal']:.0f}/{stats['rl/groups']:.0f} "
                      f"env_errors {stats['rl/env_errors']:.0f}")

        # a step plays tasks_per_step groups at once; under BAR each draws a stride at a time
        group = rl_cfg.bar_stride if rl_cfg.use_bar else rl_cfg.group_size
        async with warm(sandboxes, cfg, rl_cfg.tasks_per_step * group):
            history = await stages.rl_stage(model, engine, recorded, tasks, rl_cfg, rollout=cfg.rollout,
                                            pad_id=tokenizer.pad_token_id, seed=cfg.seed,
                                            output_dir=str(out / "rl"), log=on_step, teacher=teacher)
        generated += [t for c in calls for t in c]
        if judges is not None:  # the judge's counts over the whole stage (rubric mean: of the last batch)
            summary["judge"] = {k: sum(j.totals.get(k, 0.0) for j in judges.values())
                                for k in ("rl/judged", "rl/judge_failures", "rl/judge_unparseable")}
        summary.update(steps=len(history), tasks_per_step=rl_cfg.tasks_per_step,
                       bar_groups=bar_groups([calls[a:b] for a, b in itertools.pairwise(marks)])
                       if rl_cfg.use_bar else [])
    else:
        log.print("rl: skipped, no task of useful difficulty for the policy")
    (out / "rl_summary.json").write_text(json.dumps(summary, indent=2))
    return history, generated


async def value_rerank(cfg: SWEConfig, out: Path, harnesses: dict[str, Rollouts], sandboxes: PooledSandboxes,
                       engine: Any, policy: Any, tokenizer: Any, heldout: list[SWEInstance], pool: list[Any],
                       log: stages.RunLog) -> None:
    """Value model on ``pool``; N candidates per held-out instance from the final policy, reranked by V."""
    v = cfg.value_model
    async with warm(sandboxes, cfg, len(heldout) * v.candidates):
        candidates = await harnesses[v.harness](engine, heldout, group_size=v.candidates,
                                                temperature=cfg.eval.temperature)
    backbone = v.backbone or (str(out / "sft_model") if cfg.sft.enabled else None)
    value_model = ValueModel.from_pretrained(backbone, seed=cfg.seed) if backbone \
        else ValueModel.from_config(policy.config, seed=cfg.seed)
    result = stages.value_rerank_stage(pool, candidates, value_model, tokenizer, max_per_task=v.max_per_task,
                                       steps=v.steps, batch_size=v.batch_size, lr=v.lr, gamma=v.gamma, lam=v.lam,
                                       max_len=v.max_len, seed=cfg.seed, log=lambda m, step: log.log(m, step))
    r = result.report
    log.log(r, 0)
    log.print(f"best-of-{v.candidates} on {r['rerank/groups']:.0f} held-out instances: value "
              f"{r['rerank/success']:.3f}, random {r['rerank/random']:.3f}, oracle {r['rerank/oracle']:.3f} "
              f"(pool {r['value/pool']:.0f}, {r['value/pool_success']:.2f} resolved)")
    (out / "rerank.json").write_text(json.dumps({"report": r, "history": result.history,
                                                 "curves": result.curves}, indent=2))
    stages.plot_value_curves(result.curves, out / "value_curves.png")


async def run(cfg: SWEConfig) -> dict[str, Any]:
    train, rl_pool, heldout = instance_pools(cfg)  # a bad file or snapshot stops the run before it writes anything
    if cfg.model.path is not None:  # a checkpoint's tokenizer meets its teachers' before the run writes anything
        check_teacher_tokenizers(cfg, cfg.model.path)
    run = stages.RecipeRun(cfg.output_dir, seed=cfg.seed, threads=cfg.threads, eval_cfg=cfg.eval,
                           existing=cfg.existing, loggers=cfg.loggers, wandb=cfg.wandb,
                           config=config_to_dict(cfg))
    out, log = run.out, run.log
    unique = {i.instance_id: i for i in [*train, *rl_pool, *heldout]}
    model, tokenizer = load_policy(cfg.model, corpus(list(unique.values())), seed=cfg.seed)
    if cfg.model.path is None:  # a tiny student's tokenizer, trained just now, before any episode
        check_teacher_tokenizers(cfg, tokenizer)
    engine = make_engine(cfg.model, model, tokenizer, seed=cfg.seed)
    trajectories: list[Any] = []
    dropped: dict[str, float] = {}
    evaluating = len(heldout) * cfg.eval.attempts  # one harness's held-out episodes: one call
    async with swe_sandboxes(cfg) as sandboxes:
        harnesses = swe_harnesses(cfg, tokenizer, sandboxes)
        async with warm(sandboxes, cfg, evaluating):
            await run.evaluate("base", 0, run.saving(harnesses), engine, heldout)
        row = RL_VARIANTS[cfg.rl.variant]
        cpu_teacher = cfg.rl.enabled and row.teacher and cfg.rl.teacher.url is None and cfg.rl.teacher.path is None
        if cfg.sft.enabled or cpu_teacher:  # the teacher's corpus: SFT's data, the CPU OPD teacher's
            async with warm(sandboxes, cfg, len(train) * cfg.teacher.attempts):
                trajectories, stats = await teacher_phase(cfg, {h: harnesses[h] for h in cfg.harnesses}, tokenizer,
                                                          train)
            log.log(stats, 0)
            run.phase = "sft_teacher"
            run.save_trajectories(trajectories)
            # curated once: SFT and the CPU OPD teacher learn from the same corpus
            trajectories, dropped = stages.curate_sft(trajectories, max_len=cfg.sft.max_len,
                                                      unparseable=unparseable_actions) if cfg.sft.curate \
                else (trajectories, {})
        if cfg.sft.enabled:
            values = await hindsight_values(cfg, trajectories, tokenizer) if cfg.sft_mode == "credit" else {}
            samples, stats = stages.sft_samples(trajectories, mode=cfg.sft_mode, eps=cfg.values.eps,
                                                step_values=lambda t: values.get(id(t)))
            stats = {**stats, **dropped}
            log.log(stats, 0)
            log.print("teacher: " + " ".join(f"{k.split('/')[1]}={v:.0f}" for k, v in stats.items()))
            await run.sft(model, tokenizer, engine, samples, cfg.sft, provenance={
                "source": f"{cfg.teacher.describe(SCRIPTED)}'s {cfg.teacher.attempts} attempts per train instance "
                          f"through "
                          f"{cfg.harnesses} (trajectories/sft_teacher.jsonl.gz)"
                          + (", curated (stages.curate_sft)" if cfg.sft.curate else ""),
                "mode": cfg.sft_mode,
                "mask": {"resolved": "resolved trajectories, every generated token",
                         "all": "every valid trajectory, every generated token",
                         "credit": f"resolved trajectories whole; failed ones only on the tokens of steps with "
                                   f"hindsight credit >= {cfg.values.eps} (stages.sft_samples)"}[cfg.sft_mode]})
            async with warm(sandboxes, cfg, evaluating):
                await run.evaluate("sft", len(run.sft_history), run.saving(harnesses), engine, heldout)
        pool: list[Any] = []
        if cfg.rl.enabled:
            teacher = opd_teacher(cfg, out, tokenizer, trajectories, log) if row.teacher else None
            # The stage hands the engine new weights after every update: it holds the final policy here.
            run.phase = "rl"
            run.rl_history, pool = await rl(cfg, out, harnesses, sandboxes, engine, model, tokenizer, rl_pool, log,
                                            teacher)
            run.save_trajectories(pool)  # the task filter's and the RL stage's rollouts, judged where judged
            if teacher is not None:
                await teacher.close()
            if run.rl_history:
                run.save_policy(model, tokenizer, "rl_model")
                async with warm(sandboxes, cfg, evaluating):
                    await run.evaluate("rl", len(run.rl_history), run.saving(harnesses), engine, heldout)
        if cfg.value_model.enabled:
            run.phase = "value_rerank"
            await value_rerank(cfg, out, run.saving(harnesses), sandboxes, engine, model, tokenizer, heldout, pool,
                               log)
    return await run.finish(engine, config_to_dict(cfg))


def main(argv: list[str] | None = None) -> int:
    return stages.recipe_main(SWEConfig, run, argv, doc=__doc__, derived=DERIVED)


if __name__ == "__main__":
    sys.exit(run_main(main))
