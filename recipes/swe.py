"""Orchard-SWE, part 1: repository-level issue resolution in sandboxes, with resolved-only, all or credit-assigned SFT.

Stages (`orchard.stages`): held-out evaluation of the base model on three harnesses (bash-only, tool calling, and a
third convention held out of training) -> the scripted teacher's trajectories, 5 per task through each trained
harness, failures kept (the paper's) -> hindsight values of the failed ones from a value teacher behind the
engine / OpenAI interface -> SFT in ``sft.mode``: resolved-only, all, or credit (resolved trajectories whole, failed
ones only on the steps whose TD credit is >= 0.05) -> held-out evaluation (resolve rate, pass@k) on the three
harnesses. Sandbox failures are counted, never scored. Writes ``metrics.jsonl``, ``results.json`` (with the resolved
config) and ``learning_curve.png`` under ``output_dir``.

Single machine (CPU, a tiny random Qwen3, an offline tokenizer, seeded toy instances, the embedded sandboxes):

    python recipes/swe.py --config recipes/configs/swe_tiny.yaml [key=value ...]

Multi-GPU, the paper's setting (Qwen3-30B-A3B-Thinking from a local path; vLLM over this node's GPUs; the trainer a
single-process DeepSpeed ZeRO-3 engine; instances in the SWE-bench schema on disk; a sandbox service already running
on Kubernetes; a value teacher served by URL) — this is the launch line as it stands:

    SANDBOX_API_KEY=... python recipes/swe.py --config recipes/configs/swe.yaml \\
        model.path=/models/Qwen3-30B-A3B-Thinking instances.path=/data/swe-gym.jsonl \\
        env_url=https://sandboxes.example values.url=http://value-teacher:8000/v1

Rollouts and training share this one process; several ranks under ``deepspeed`` / ``torchrun`` are not supported
yet. RL and the value model for best-of-N are part 2.
"""

from __future__ import annotations

import asyncio
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from orchard import stages
from orchard._cli import run_main
from orchard.domains.swe.generator import LEVELS, TEMPLATES, generate_instances
from orchard.domains.swe.harness import SWEEvalHarness
from orchard.domains.swe.instances import SWEInstance, load_instances
from orchard.domains.swe.teacher import ATTEMPTS_PER_TASK, SWETeacherEngine, teacher_trajectories
from orchard.domains.swe.tool_rollout import SWEBashRollouts, SWEToolRollouts
from orchard.domains.swe.values import ScriptedValueEstimator, step_values_async
from orchard.env import AsyncSandboxClient
from orchard.rollout.rollouts import AgentLoopRollouts, Rollouts
from orchard.stages import SFT_MODES, EvalConfig, RolloutConfig, SFTConfig
from orchard.stages.policy import ModelConfig, load_policy, make_engine, save_policy
from orchard.stages.sandboxes import sandbox_service
from orchard.train.config import config_to_dict

HARNESSES = ("bash", "tool", "eval")
TRAINABLE = ("bash", "tool")
DERIVED = stages.derived_keys("sft", rl=None)


@dataclass
class InstancesConfig:
    path: str | None = None
    """Instances in the SWE-bench schema (JSONL, parquet or a saved dataset); null generates seeded toy ones."""
    heldout_path: str | None = None
    """Held-out instances (same formats); with path set, required."""
    train_per_template: int = 2
    """Toy instances per repository template for training (6 templates)."""
    heldout_per_template: int = 1
    """Toy held-out instances per template (bugs never seen in training)."""
    levels: list[int] = field(default_factory=lambda: list(LEVELS))
    """Toy difficulty levels: 1 the issue names the module, 2 it must be found, 3 the fix spans two places."""
    templates: list[str] = field(default_factory=list)
    """Toy repository templates to draw from (empty: all six)."""


@dataclass
class TeacherConfig:
    attempts: int = ATTEMPTS_PER_TASK
    """Teacher trajectories per task and harness, failures kept (the paper: 5)."""
    failure_rate: float = 0.3
    """Share of the scripted teacher's attempts that go wrong (wrong file, partial fix, regression, untested)."""


@dataclass
class ValuesConfig:
    url: str | None = None
    """OpenAI-compatible URL of the value teacher; null uses the scripted estimator in process."""
    model: str = "orchard"
    """Model name sent to the value teacher."""
    eps: float = 0.05
    """Credit threshold: a failed trajectory trains on the steps whose TD credit is at least this (the paper's)."""


@dataclass
class SWEConfig:
    output_dir: str = "runs/swe"
    """Where metrics.jsonl, results.json, learning_curve.png, the trainer's logs and the model go."""
    seed: int = 0
    """Seed of model initialisation, the teacher's noise, sampling and training."""
    env_url: str | None = None
    """Sandbox service URL (key in SANDBOX_API_KEY); null starts the embedded service for the run."""
    harnesses: list[str] = field(default_factory=lambda: ["bash", "tool"])
    """Harnesses whose teacher trajectories train the model (bash and / or tool)."""
    threads: int = 0
    """torch CPU threads (0: leave torch's default)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    instances: InstancesConfig = field(default_factory=InstancesConfig)
    """Task pool."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The scripted teacher."""
    values: ValuesConfig = field(default_factory=ValuesConfig)
    """Hindsight values for credit-assigned SFT."""
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(max_steps=12, max_tokens=256,
                                                                         concurrency=8, max_time_s=300.0))
    """Episode settings."""
    sft_mode: str = "credit"
    """What SFT learns from the teacher's trajectories: resolved (resolved only), all (unmasked), credit."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised stage."""
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(attempts=1, harnesses=["bash", "tool", "eval"]))
    """Held-out evaluation (the eval harness is never trained on: a transfer test)."""

    def __post_init__(self) -> None:
        if not self.harnesses or any(h not in TRAINABLE for h in self.harnesses):
            raise ValueError(f"harnesses must be a non-empty list among {list(TRAINABLE)}, got {self.harnesses!r}")
        if any(h not in HARNESSES for h in self.eval.harnesses):
            raise ValueError(f"eval.harnesses must be among {list(HARNESSES)}, got {self.eval.harnesses!r}")
        if self.sft_mode not in SFT_MODES:
            raise ValueError(f"sft_mode must be one of {list(SFT_MODES)}, got {self.sft_mode!r}")
        if (self.instances.path is None) != (self.instances.heldout_path is None):
            raise ValueError("instances.heldout_path must be set exactly when instances.path is")
        if any(level not in LEVELS for level in self.instances.levels) or not self.instances.levels:
            raise ValueError(f"instances.levels must be among {list(LEVELS)}, got {self.instances.levels!r}")
        if any(t not in TEMPLATES for t in self.instances.templates):
            raise ValueError(f"instances.templates must be among {sorted(TEMPLATES)}, got {self.instances.templates!r}")


def instance_pools(cfg: SWEConfig) -> tuple[list[SWEInstance], list[SWEInstance]]:
    """(train, held-out): from disk, or seeded toy instances whose held-out bugs never appear in training."""
    if cfg.instances.path is not None:
        return load_instances(cfg.instances.path), load_instances(cfg.instances.heldout_path, split="heldout")
    kw = {"levels": tuple(cfg.instances.levels), "templates": tuple(cfg.instances.templates) or None}
    return (generate_instances("train", cfg.instances.train_per_template, **kw),
            generate_instances("heldout", cfg.instances.heldout_per_template, **kw))


def swe_harnesses(cfg: SWEConfig, tokenizer: Any, client: AsyncSandboxClient) -> dict[str, Rollouts]:
    """The three conventions behind one interface: bash and tool as a program via the proxy, eval in process."""
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
    """The toy repositories' code and the issues' text, for the tiny model's offline tokenizer."""
    return [text for i in instances for text in (i.problem_statement, *i.files.values())]


async def hindsight_values(cfg: SWEConfig, trajectories: list[Any], tokenizer: Any) -> dict[int, Any]:
    """The value teacher's ``{state: value}`` of every failed trajectory (None where its answer was unusable)."""
    estimator = cfg.values.url or ScriptedValueEstimator(tokenizer)
    failed = [t for t in trajectories if t.valid and t.samples and not (t.reward or 0) > 0]
    values = await asyncio.gather(*(step_values_async(t, client_or_engine=estimator, tokenizer=tokenizer,
                                                      model=cfg.values.model) for t in failed))
    return {id(t): v for t, v in zip(failed, values, strict=True)}


async def run(cfg: SWEConfig) -> dict[str, Any]:
    out = Path(cfg.output_dir)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    train, heldout = instance_pools(cfg)
    log = stages.RunLog(out)
    model, tokenizer = load_policy(cfg.model, corpus([*train, *heldout]), seed=cfg.seed)
    engine = make_engine(cfg.model, model, tokenizer, seed=cfg.seed)
    results: dict[str, dict[str, dict[str, float]]] = {}
    sft_history: list[dict[str, float]] = []
    with sandbox_service(cfg.env_url) as env:
        async with AsyncSandboxClient(*env) as client:
            harnesses = swe_harnesses(cfg, tokenizer, client)

            async def held_out(stage: str, step: int) -> None:
                results[stage] = await stages.evaluate_stage(stage, step, harnesses, engine, heldout, cfg.eval, log)

            await held_out("base", 0)
            if cfg.sft.enabled:
                teacher = SWETeacherEngine(tokenizer, train, failure_rate=cfg.teacher.failure_rate, seed=cfg.seed)
                trajectories = [t for h in cfg.harnesses for t in await teacher_trajectories(
                    harnesses[h], teacher, train, attempts=cfg.teacher.attempts)]
                values = await hindsight_values(cfg, trajectories, tokenizer) if cfg.sft_mode == "credit" else {}
                samples, stats = stages.sft_samples(trajectories, mode=cfg.sft_mode, eps=cfg.values.eps,
                                                    step_values=lambda t: values.get(id(t)))
                log.log(stats, 0)
                log.print("teacher: " + " ".join(f"{k.split('/')[1]}={v:.0f}" for k, v in stats.items()))
                sft_history = stages.sft_stage(model, samples, cfg.sft, pad_id=tokenizer.pad_token_id,
                                               seed=cfg.seed, output_dir=str(out / "sft"))
                log.print(f"sft: {len(samples)} samples, {len(sft_history)} steps, loss "
                          f"{sft_history[0]['loss/total']:.3f} -> {sft_history[-1]['loss/total']:.3f}")
                save_policy(model, tokenizer, out / "sft_model")
                await engine.update_weights(model.state_dict())
                await held_out("sft", len(sft_history))
    await engine.close()
    log.close()
    stages.write_results(out, results, config_to_dict(cfg), log, attempts=cfg.eval.attempts,
                         sft_history=sft_history)
    return results


def main(argv: list[str] | None = None) -> int:
    return stages.recipe_main(SWEConfig, run, argv, doc=__doc__, derived=DERIVED)


if __name__ == "__main__":
    sys.exit(run_main(main))
