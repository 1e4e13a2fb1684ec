"""Orchard-Claw: train a personal-assistant agent (mail, calendar, inventory, files) with SFT, then GRPO.

Stages: held-out evaluation of the base model -> SFT on the scripted teacher's episodes through both harnesses
(inputs masked, only the assistant's tokens supervised) -> evaluation -> GRPO on the train split (+1 / -1 outcome
reward per episode, group-relative advantages, clipped policy loss 0.2 / 0.28, optionally Balanced Adaptive
Rollout) with new weights handed to the rollout engine after every step -> evaluation. Episodes whose sandbox
failed are marked ``env_error``, counted, and left out of training and scoring. It prints a table (success, pass@k,
pass^k per stage and harness), writes ``metrics.jsonl`` and ``learning_curve.png`` under ``output_dir``.

Single machine (CPU, a tiny random Qwen3 from a config, an offline tokenizer, the embedded sandbox service that the
recipe starts and stops itself):

    scripts/claw                                    # set-up, then exactly the next line
    python recipes/claw.py --config recipes/configs/claw_tiny.yaml [key=value ...]

Paper setting (Qwen3-30B-A3B-Thinking from a local path, vLLM rollouts, DeepSpeed ZeRO-3, a sandbox service
already running on Kubernetes or elsewhere):

    SANDBOX_API_KEY=... python recipes/claw.py --config recipes/configs/claw.yaml \\
        model.path=/models/Qwen3-30B-A3B-Thinking env_url=https://sandboxes.example

Rollouts and evaluation run in this one process; with ``train.engine: deepspeed`` the trainer is a single-process
DeepSpeed engine (ZeRO over the GPUs of this process's launcher is the trainer's business, see docs/training.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from orchard._extras import requires_extra
from orchard.data import Trajectory, collate, merge_prefix_samples, render_trajectory
from orchard.data.tokenizer import build_chat_tokenizer
from orchard.domains.claw.corpus import tokenizer_corpus
from orchard.domains.claw.harness import ClawReactHarness
from orchard.domains.claw.tasks import ClawTask, split_tasks
from orchard.domains.claw.teacher import TeacherEngine
from orchard.domains.claw.text_rollout import TextEpisode, run_text_episodes
from orchard.env import AsyncSandboxClient
from orchard.env.embedded import serve
from orchard.rollout.agent_loop import AgentLoop
from orchard.rollout.engine import SamplingParams
from orchard.rollout.hf_engine import HFEngine
from orchard.rollout.proxy import RecordingProxy
from orchard.sampling import BARConfig, abar_select, avg_at_k, group_advantages, pass_at_k, pass_hat_k
from orchard.train.action_logprobs import action_logprobs
from orchard.train.config import config_to_dict, format_help, load_config
from orchard.train.metrics import JsonlLogger
from orchard.train.model import load_causal_lm
from orchard.train.objective import LossTerm
from orchard.train.tiny import tiny_qwen3
from orchard.train.trainer import OptimConfig, TrainConfig, Trainer

HARNESSES = ("react", "text")
REWARDS = ("outcome", "score")


@dataclass
class ModelConfig:
    path: str | None = None
    """Local HF checkpoint directory (weights and tokenizer); null builds a tiny random Qwen3 and an offline
    tokenizer from the train tasks' text."""
    vocab_size: int = 1024
    """Offline tokenizer's vocabulary size (tiny model only)."""
    split_words: bool = False
    """Offline tokenizer: False lets BPE merges span words, so the fixed prompts cost a few tokens (tiny only)."""
    hidden_size: int = 128
    """Tiny model width."""
    num_layers: int = 4
    """Tiny model depth."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the trained model and the HF engine."""
    engine: Literal["hf", "vllm"] = "hf"
    """Rollout engine: hf (this process, CPU or GPU) or vllm (GPU extra)."""
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of vllm.LLM (tensor_parallel_size, gpu_memory_utilization, ...)."""


@dataclass
class TasksConfig:
    train_per_template: int = 20
    """Train tasks per template (9 templates, 3 levels)."""
    heldout_per_template: int = 4
    """Held-out tasks per template (disjoint seeds)."""
    heldout_templates: list[str] = field(default_factory=list)
    """Templates kept out of training entirely (an out-of-template test); none by default."""


@dataclass
class RolloutConfig:
    max_steps: int = 6
    """Assistant turns per episode."""
    max_tokens: int = 96
    """Tokens per assistant turn."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts."""
    concurrency: int = 32
    """Episodes in flight at once (and concurrent sandboxes)."""
    max_time_s: float = 600.0
    """Wall-clock budget of one episode; an episode over it ends as time_budget (the paper: 10 minutes)."""


@dataclass
class SFTStage:
    enabled: bool = True
    """Run the SFT stage."""
    epochs: float = 2.0
    """Passes over the teacher's episodes (sets train.total_steps)."""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        global_batch_size=16, micro_batch_size=16, optim=OptimConfig(lr=1e-5, min_lr=1e-6)))
    """Trainer settings (objective: sft; total_steps is derived from epochs)."""


@dataclass
class RLStage:
    enabled: bool = True
    """Run the GRPO stage."""
    steps: int = 150
    """Optimizer steps (one rollout batch each)."""
    tasks_per_step: int = 8
    """Tasks per rollout batch (paper: 8)."""
    group_size: int = 8
    """Episodes per task (paper: 8)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch (1: one on-policy update per batch)."""
    mini_batches: int = 1
    """Optimizer steps per pass (the batch is split into this many shuffled mini-batches)."""
    use_bar: bool = False
    """Select each group with Balanced Adaptive Rollout (generate up to bar_n_max, keep group_size)."""
    bar_n_max: int = 16
    """BAR budget of episodes per task."""
    bar_stride: int = 16
    """BAR episodes generated per round."""
    reward: str = "outcome"
    """Trajectory reward: "outcome" (+1 passed / -1 not, the paper's) or "score" (2 x the verifier's claw score
    - 1: partial credit for completion, robustness and safety; success is still judged by pass >= 0.75)."""
    task_pool_per_template: int = 0
    """Train-split tasks per template that RL draws from (0: the SFT pool, tasks.train_per_template). A larger
    pool holds the SFT tasks and fresh ones of the same templates, never a held-out task."""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        global_batch_size=64, micro_batch_size=16, optim=OptimConfig(lr=1e-6, min_lr=1e-7),
        objective=[LossTerm("policy", 1.0, {"eps_low": 0.2, "eps_high": 0.28})]))
    """Trainer settings (objective: policy; total_steps is set to steps x ppo_epochs x mini_batches)."""


@dataclass
class EvalConfig:
    attempts: int = 3
    """Episodes per held-out task (pass@k and pass^k use k = attempts)."""
    temperature: float = 1.0
    """Sampling temperature of evaluation episodes."""
    harnesses: list[str] = field(default_factory=lambda: ["react", "text"])
    """Harnesses evaluated."""


@dataclass
class ClawConfig:
    output_dir: str = "runs/claw"
    """Where metrics.jsonl, learning_curve.png, the trainers' logs and the final model go."""
    seed: int = 0
    """Seed of tasks order, model initialisation, sampling and training."""
    env_url: str | None = None
    """Sandbox service URL (key in SANDBOX_API_KEY); null starts the embedded service for the run."""
    harnesses: list[str] = field(default_factory=lambda: ["react", "text"])
    """Harnesses trained on (SFT and RL): react (in-process ReAct) and/or text (a separate program via the proxy)."""
    threads: int = 0
    """torch CPU threads (0: leave torch's default)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    tasks: TasksConfig = field(default_factory=TasksConfig)
    """Task pool."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Episode settings."""
    sft: SFTStage = field(default_factory=SFTStage)
    """Supervised stage."""
    rl: RLStage = field(default_factory=RLStage)
    """GRPO stage."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""


class Episodes:
    """Runs episodes of a policy engine in either harness: the ReAct agent loop in-process, the text harness as a
    separate program behind the recording proxy."""

    def __init__(self, cfg: ClawConfig, tokenizer: Any, client: AsyncSandboxClient, env: tuple[str, str]):
        self.cfg, self.tokenizer, self.client, self.env = cfg, tokenizer, client, env
        self.react = ClawReactHarness(max_steps=cfg.rollout.max_steps)

    async def run(self, engine: Any, harness: str, tasks: list[ClawTask], group_size: int,
                  temperature: float, max_tokens: int | None = None) -> list[dict[str, Any]]:
        """Episodes as dicts: task, harness, reward (None for env_error), termination, samples, steps."""
        max_tokens = max_tokens or self.cfg.rollout.max_tokens
        if harness == "react":
            sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens)
            loop = AgentLoop(engine, self.client, self.react, self.tokenizer, sampling=sampling,
                             max_time_s=self.cfg.rollout.max_time_s, concurrency=self.cfg.rollout.concurrency,
                             progress=False, seed=random.randrange(2**31), start_jitter_s=0.2)
            trajectories = await loop.run_many(tasks, group_size=group_size)
            return [self._from_trajectory(t, task) for t, task in
                    zip(trajectories, [t for t in tasks for _ in range(group_size)], strict=True)]
        proxy = RecordingProxy(engine, self.tokenizer)
        try:
            episodes = await run_text_episodes(
                tasks, client=self.client, proxy=proxy, env_url=self.env[0], env_key=self.env[1],
                group_size=group_size, concurrency=self.cfg.rollout.concurrency,
                max_steps=self.cfg.rollout.max_steps, max_tokens=max_tokens, temperature=temperature,
                max_time_s=self.cfg.rollout.max_time_s)
        finally:
            await proxy.aclose()
        return [self._from_text(e) for e in episodes]

    def _from_trajectory(self, traj: Trajectory, task: ClawTask) -> dict[str, Any]:
        sample = None if traj.is_env_error else render_trajectory(traj, self.tokenizer)
        return {"task": task, "harness": "react", "reward": None if traj.is_env_error else traj.reward,
                "score": traj.reward_components.get("score"),
                "termination": traj.termination_reason, "samples": [sample] if sample is not None else [],
                "steps": traj.num_steps}

    @staticmethod
    def _from_text(e: TextEpisode) -> dict[str, Any]:
        # The program re-sends the conversation each call: its per-call samples usually chain into one sequence.
        return {"task": e.task, "harness": "text", "reward": e.reward, "termination": e.termination_reason,
                "score": e.reward_components.get("score"),
                "samples": merge_prefix_samples(e.samples), "steps": e.steps}


def success_table(episodes: list[dict[str, Any]], attempts: int) -> dict[str, float]:
    """Held-out metrics of one stage and harness: success (avg@k), pass@k, pass^k, env errors."""
    by_task: dict[str, list[bool]] = {}
    env_errors = 0
    for e in episodes:
        if e["reward"] is None:
            env_errors += 1
            continue
        by_task.setdefault(e["task"].id, []).append(e["reward"] > 0)
    full = [v for v in by_task.values() if len(v) == attempts]
    n = np.array([len(v) for v in full])
    c = np.array([sum(v) for v in full])
    return {
        "success": avg_at_k(full) if full else 0.0,
        f"pass@{attempts}": float(np.mean(pass_at_k(n, c, attempts))) if full else 0.0,
        f"pass^{attempts}": float(np.mean(pass_hat_k(n, c, attempts))) if full else 0.0,
        "tasks": float(len(full)),
        "env_errors": float(env_errors),
    }


def episode_reward(episode: dict[str, Any], kind: str) -> float:
    """The RL reward of a scored episode: its outcome (+1 / -1), or with ``kind="score"`` 2 x the verifier's claw
    score - 1 (the outcome where the verifier gave no score)."""
    if kind not in REWARDS:
        raise ValueError(f"rl.reward must be among {REWARDS}, got {kind!r}")
    if kind == "score" and episode.get("score") is not None:
        return 2.0 * float(episode["score"]) - 1.0
    return float(episode["reward"])


def rl_samples(groups: list[list[dict[str, Any]]], reward: str = "outcome",
               ) -> tuple[list[Any], list[float], dict[str, float]]:
    """Samples with their group-relative advantage, over each group's valid episodes; groups without signal are
    dropped."""
    samples, advantages = [], []
    kept = 0
    for group in groups:
        # Sandbox failures and episodes over the wall budget are dropped (the paper's "timeouts dropped").
        valid = [e for e in group if e["reward"] is not None and e["termination"] != "time_budget" and e["samples"]]
        rewards = torch.tensor([[episode_reward(e, reward) for e in valid]], dtype=torch.float32)  # [1, N]
        if len(valid) < 2 or bool((rewards == rewards[0, 0]).all()):
            continue
        kept += 1
        adv_N = group_advantages(rewards)[0]  # [N]
        for episode, adv in zip(valid, adv_N.tolist(), strict=True):
            for sample in episode["samples"]:
                samples.append(sample)
                advantages.append(adv)
    stats = {"rl/groups": float(len(groups)), "rl/groups_with_signal": float(kept),
             "rl/sequences": float(len(samples))}
    return samples, advantages, stats


def load_policy(cfg: ClawConfig, train_tasks: list[ClawTask]) -> tuple[Any, Any]:
    if cfg.model.path is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, local_files_only=True)
        return load_causal_lm(cfg.model.path, dtype=cfg.model.dtype), tokenizer
    tokenizer = build_chat_tokenizer(tokenizer_corpus(train_tasks), vocab_size=cfg.model.vocab_size,
                                     split_words=cfg.model.split_words)
    h = cfg.model.hidden_size
    model = tiny_qwen3(tokenizer, seed=cfg.seed, hidden_size=h, intermediate_size=3 * h,
                       num_hidden_layers=cfg.model.num_layers, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=h // 4)
    return model, tokenizer


def save_model(model: Any, tokenizer: Any, path: Path) -> None:
    """A checkpoint ``model.path`` can load (e.g. to start RL from the SFT model with ``sft.enabled=false``)."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def make_engine(cfg: ClawConfig, model: Any, tokenizer: Any) -> Any:
    if cfg.model.engine == "vllm":
        from orchard.rollout.vllm_engine import VLLMEngine

        if cfg.model.path is None:
            raise ValueError("model.engine=vllm needs model.path (vLLM loads a checkpoint)")
        return VLLMEngine(cfg.model.path, **cfg.model.vllm_kwargs)
    return HFEngine(copy.deepcopy(model).eval(), pad_token_id=tokenizer.pad_token_id, max_batch_size=64,
                    seed=cfg.seed)


async def run(cfg: ClawConfig) -> dict[str, Any]:
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    for name in (*cfg.harnesses, *cfg.eval.harnesses):
        if name not in HARNESSES:
            raise ValueError(f"harnesses must be among {HARNESSES}, got {name!r}")
    if cfg.rl.reward not in REWARDS:
        raise ValueError(f"rl.reward must be among {REWARDS}, got {cfg.rl.reward!r}")
    if cfg.rl.task_pool_per_template < 0:
        raise ValueError(f"rl.task_pool_per_template must be >= 0, got {cfg.rl.task_pool_per_template}")
    (out / "metrics.jsonl").unlink(missing_ok=True)
    log = JsonlLogger(out / "metrics.jsonl")
    started = time.monotonic()

    train_tasks = split_tasks("train", cfg.tasks.train_per_template,
                              heldout_templates=tuple(cfg.tasks.heldout_templates))
    heldout = split_tasks("heldout", cfg.tasks.heldout_per_template)
    model, tokenizer = load_policy(cfg, train_tasks)
    engine = make_engine(cfg, model, tokenizer)
    results: dict[str, dict[str, dict[str, float]]] = {}
    curve: list[dict[str, float]] = []

    with contextlib.ExitStack() as stack:
        if cfg.env_url is None:
            service = stack.enter_context(serve(in_process=False))
            env = (service.url, service.api_key)
        else:
            env = (cfg.env_url, os.environ.get("SANDBOX_API_KEY", ""))
        async with AsyncSandboxClient(*env) as client:
            episodes = Episodes(cfg, tokenizer, client, env)

            async def evaluate(stage: str, step: int) -> None:
                results[stage] = {}
                for harness in cfg.eval.harnesses:
                    eps = await episodes.run(engine, harness, heldout, cfg.eval.attempts, cfg.eval.temperature)
                    row = success_table(eps, cfg.eval.attempts)
                    results[stage][harness] = row
                    log.log({f"eval/{stage}/{harness}/{k}": v for k, v in row.items()}, step)
                    print(f"[{time.monotonic() - started:6.0f}s] eval {stage:4s} {harness:5s} "
                          + " ".join(f"{k}={v:.3f}" for k, v in row.items()), flush=True)

            await evaluate("base", 0)

            if cfg.sft.enabled:
                # The teacher recognises a task by its request: it demonstrates one task per distinct request.
                demo_tasks = list({t.prompt: t for t in reversed(train_tasks)}.values())[::-1]
                teacher = TeacherEngine(tokenizer, demo_tasks)
                samples = []
                for harness in cfg.harnesses:
                    eps = await episodes.run(teacher, harness, demo_tasks, 1, 0.0, max_tokens=4096)
                    good = [e for e in eps if e["reward"] is not None and e["reward"] > 0]
                    samples += [s for e in good for s in e["samples"]]
                    log.log({f"sft/teacher_{harness}_episodes": float(len(eps)),
                             f"sft/teacher_{harness}_passed": float(len(good))}, 0)
                if not samples:
                    raise RuntimeError("the teacher solved no task: check the sandbox service and the harnesses")
                steps = max(1, round(cfg.sft.epochs * len(samples) / cfg.sft.train.global_batch_size))
                trainer = Trainer(model, replace(cfg.sft.train, total_steps=steps, seed=cfg.seed,
                                                 output_dir=str(out / "sft"), resume=False))
                history = trainer.fit(samples, partial(collate, pad_id=tokenizer.pad_token_id))
                trainer.close()
                for i, m in enumerate(history, 1):
                    curve.append({"stage": 0.0, "step": float(i), "loss": m["loss/total"]})
                print(f"[{time.monotonic() - started:6.0f}s] sft: {len(samples)} samples, {steps} steps, "
                      f"loss {history[0]['loss/total']:.3f} -> {history[-1]['loss/total']:.3f}", flush=True)
                save_model(model, tokenizer, out / "sft_model")
                await engine.update_weights(model.state_dict())
                await evaluate("sft", steps)

            if cfg.rl.enabled:
                updates = cfg.rl.steps * cfg.rl.ppo_epochs * cfg.rl.mini_batches
                trainer = Trainer(model, replace(cfg.rl.train, total_steps=updates, seed=cfg.seed,
                                                 output_dir=str(out / "rl"), resume=False))
                rng = random.Random(cfg.seed)
                # A `kl` objective term anchors the policy to the model RL started from (a frozen copy).
                reference = None
                if any(term.name == "kl" for term in cfg.rl.train.objective):
                    reference = copy.deepcopy(model).eval().requires_grad_(False)
                rl_tasks = train_tasks
                if cfg.rl.task_pool_per_template:
                    rl_tasks = split_tasks("train", cfg.rl.task_pool_per_template,
                                           heldout_templates=tuple(cfg.tasks.heldout_templates))
                bar = BARConfig(n=cfg.rl.group_size, n_max=cfg.rl.bar_n_max, stride=cfg.rl.bar_stride)
                for step in range(1, cfg.rl.steps + 1):
                    tasks = rng.sample(rl_tasks, cfg.rl.tasks_per_step)
                    harness_of = {t.id: cfg.harnesses[i % len(cfg.harnesses)] for i, t in enumerate(tasks)}
                    groups = await rollout_groups(episodes, engine, tasks, harness_of, cfg, bar)
                    flat = [e for g in groups for e in g]
                    valid = [e for e in flat if e["reward"] is not None]
                    stats = {
                        "rl/success": float(np.mean([e["reward"] > 0 for e in valid])) if valid else 0.0,
                        "rl/env_errors": float(len(flat) - len(valid)),
                        "rl/format_errors": float(sum(e["termination"] == "format_error" for e in flat)),
                        "rl/timeouts": float(sum(e["termination"] == "time_budget" for e in flat)),
                        "rl/episodes": float(len(flat)),
                    }
                    samples, advantages, sample_stats = rl_samples(groups, cfg.rl.reward)
                    stats.update(sample_stats)
                    if samples:
                        # PPO-style reuse of one rollout batch: ppo_epochs passes over shuffled mini-batches, the
                        # clipped ratio against the sampling log-probs keeping each update near the rollout policy.
                        for _ in range(cfg.rl.ppo_epochs):
                            order = rng.sample(range(len(samples)), len(samples))
                            for part in np.array_split(np.array(order), min(cfg.rl.mini_batches, len(order))):
                                batch = collate([samples[i] for i in part], tokenizer.pad_token_id,
                                                advantages=[advantages[i] for i in part])
                                if reference is not None:
                                    with torch.no_grad():
                                        batch["ref_logprobs"] = action_logprobs(
                                            reference, batch["input_ids"], batch["action_mask"],
                                            attention_mask=batch["attention_mask"])
                                stats.update(trainer.train_step(batch))
                        # One hand-over per rollout batch, after its last update (not after every update).
                        await engine.update_weights(trainer.full_state_dict())
                    log.log(stats, step)
                    curve.append({"stage": 1.0, "step": float(step), "success": stats["rl/success"]})
                    print(f"[{time.monotonic() - started:6.0f}s] rl step {step}: success {stats['rl/success']:.2f} "
                          f"groups {stats['rl/groups_with_signal']:.0f}/{stats['rl/groups']:.0f} "
                          f"env_errors {stats['rl/env_errors']:.0f}", flush=True)
                trainer.close()
                save_model(model, tokenizer, out / "rl_model")
                await engine.update_weights(model.state_dict())
                await evaluate("rl", cfg.rl.steps)
    await engine.close()
    log.close()
    (out / "results.json").write_text(json.dumps({"results": results, "config": config_to_dict(cfg),
                                                  "wall_s": time.monotonic() - started}, indent=2))
    plot_curve(curve, results, out / "learning_curve.png")
    print_table(results, cfg.eval.attempts)
    return results


async def rollout_groups(episodes: Episodes, engine: Any, tasks: list[ClawTask], harness_of: dict[str, str],
                         cfg: ClawConfig, bar: BARConfig) -> list[list[dict[str, Any]]]:
    """One group of episodes per task (BAR-selected when enabled; BAR drops groups without signal)."""
    temp = cfg.rollout.temperature
    if not cfg.rl.use_bar:
        groups = []
        for harness in cfg.harnesses:
            mine = [t for t in tasks if harness_of[t.id] == harness]
            if mine:
                eps = await episodes.run(engine, harness, mine, cfg.rl.group_size, temp)
                groups += [eps[i * cfg.rl.group_size:(i + 1) * cfg.rl.group_size] for i in range(len(mine))]
        return groups

    async def select(task: ClawTask) -> list[dict[str, Any]]:
        async def source(k: int) -> list[dict[str, Any]]:
            return await episodes.run(engine, harness_of[task.id], [task], k, temp)

        result = await abar_select(source, bar, positive=lambda e: e["reward"] > 0,
                                   terminated=lambda e: e["termination"] == "done",
                                   length=lambda e: float(e["steps"]), valid=lambda e: e["reward"] is not None)
        return list(result.selected)

    return list(await asyncio.gather(*(select(t) for t in tasks)))


def print_table(results: dict[str, dict[str, dict[str, float]]], attempts: int) -> None:
    keys = ("success", f"pass@{attempts}", f"pass^{attempts}", "tasks", "env_errors")
    print("\nheld-out | " + " | ".join(f"{k:>9s}" for k in keys))
    for stage, by_harness in results.items():
        for harness, row in by_harness.items():
            print(f"{stage:4s} {harness:5s}| " + " | ".join(f"{row[k]:9.3f}" for k in keys))


def plot_curve(curve: list[dict[str, float]], results: dict[str, Any], path: Path) -> None:
    with requires_extra("plot"):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

    fig, (ax_sft, ax_rl) = plt.subplots(1, 2, figsize=(10, 4))
    sft = [p for p in curve if p["stage"] == 0.0]
    rl = [p for p in curve if p["stage"] == 1.0]
    ax_sft.plot([p["step"] for p in sft], [p["loss"] for p in sft])
    ax_sft.set(title="SFT loss", xlabel="step", ylabel="token-mean NLL")
    if rl:
        window = max(1, len(rl) // 10)
        smooth = np.convolve([p["success"] for p in rl], np.ones(window) / window, mode="valid")
        ax_rl.plot([p["step"] for p in rl], [p["success"] for p in rl], alpha=0.3, label="train rollouts")
        ax_rl.plot([p["step"] for p in rl][window - 1:], smooth, label=f"train rollouts ({window}-step mean)")
    for stage, style in (("base", ":"), ("sft", "--"), ("rl", "-")):
        for harness, row in results.get(stage, {}).items():
            ax_rl.axhline(row["success"], linestyle=style, color="gray" if harness == "react" else "tab:green",
                          label=f"held-out {stage} ({harness})")
    ax_rl.set(title="GRPO success", xlabel="RL step", ylabel="success rate", ylim=(-0.02, 1.02))
    ax_rl.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file filling ClawConfig")
    parser.add_argument("--show-config", action="store_true", help="print every field with its doc and exit")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, dotted for nested fields")
    args = parser.parse_args(argv)
    if args.show_config:
        print(format_help(ClawConfig))
        return 0
    cfg = load_config(ClawConfig, args.config, args.overrides)
    asyncio.run(run(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
