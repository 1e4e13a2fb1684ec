"""What every recipe's ``run`` does around its domain's choices, once: seeds, the run log, held-out evaluation after
each stage, the SFT stage's hand-over to the engine, and the end (results written by rank 0).

A recipe reads::

    run = RecipeRun(cfg.output_dir, seed=cfg.seed, threads=cfg.threads, eval_cfg=cfg.eval,
                    ranks=init_ranks())
    ...                                          # the domain: tasks, model, engine, harnesses
    harnesses = run.saving(harnesses)            # every episode played, by phase, under trajectories/
    await run.evaluate("base", 0, harnesses, engine, heldout)
    run.phase = "sft_teacher"
    ...                                          # the demonstrations
    await run.sft(model, tokenizer, engine, samples, cfg.sft, provenance={...})   # also writes sft_data/
    await run.evaluate("sft", len(run.sft_history), harnesses, engine, heldout)
    run.phase = "rl"
    run.rl_history = await rl_stage(...)
    run.save_policy(model, tokenizer, "rl_model")
    await run.evaluate("rl", len(run.rl_history), harnesses, engine, heldout)
    return await run.finish(engine, config_to_dict(cfg))
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from orchard.data import RenderedSample, Trajectory
from orchard.rollout.engine import derive_seed
from orchard.rollout.rollouts import Rollouts
from orchard.stages.config import EvalConfig, SFTConfig
from orchard.stages.evaluate import evaluate_stage
from orchard.stages.policy import save_policy
from orchard.stages.ranks import Ranks, barrier
from orchard.stages.report import RunLog, write_results
from orchard.stages.run_files import SavingRollouts, append_trajectories, prepare_output_dir, save_sft_data
from orchard.stages.sft import sft_stage
from orchard.train.metrics import WandbConfig

__all__ = ["RecipeRun"]

class RecipeRun:
    """One recipe run: Python's and torch's generators seeded with ``seed``, torch's CPU threads set (``threads``
    0 leaves torch's default), a `RunLog` under ``output_dir`` (silent but on rank 0), and what the run reports:
    :attr:`results` (``{stage: {harness: row}}`` of `evaluate_stage`), :attr:`sft_history` and
    :attr:`rl_history` (per-step metrics for the learning curve).

    Args:
        output_dir: where metrics.jsonl, results.json, learning_curve.png and the saved models go.
        seed: the run's seed; also the SFT stage's.
        threads: torch CPU threads, >= 0 (0: torch's default).
        eval_cfg: the held-out evaluation's settings (`evaluate_stage`; its ``attempts`` head the final table).
        ranks: this process among the launcher's (`orchard.stages.ranks.init_ranks`); default a single process.
        existing: what to do when ``output_dir`` already holds a run (its ``metrics.jsonl`` or ``results.json``):
            ``"refuse"`` (default: raise before any work, naming the choices), ``"move"`` (rename it to
            ``<output_dir>.<n>``, the first free ``n`` from 1, and start afresh), or ``"resume"`` (keep it: metrics
            are appended, and the RL stage continues from its checkpoint when ``rl.resume`` is on). A previous run
            is never deleted.
        loggers, wandb, config: the run's metric sinks beside ``metrics.jsonl`` (`RunLog`: ``tensorboard``,
            ``wandb``: one W&B run per recipe run, named after ``output_dir``, with ``config``); each gets every
            metric the run logs, the SFT stage's per-step rows included (as ``sft/<key>``).
    """

    def __init__(self, output_dir: str | Path, *, seed: int, threads: int = 0, eval_cfg: EvalConfig,
                 ranks: Ranks | None = None, existing: str = "refuse", loggers: Sequence[str] = ("jsonl",),
                 wandb: WandbConfig | None = None, config: Mapping[str, Any] | None = None) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise ValueError(f"threads must be an int >= 0, got {threads!r}")
        if not isinstance(eval_cfg, EvalConfig):
            raise ValueError(f"eval_cfg must be an EvalConfig, got {type(eval_cfg).__name__}")
        if ranks is not None and not isinstance(ranks, Ranks):
            raise ValueError(f"ranks must be a Ranks or None, got {type(ranks).__name__}")
        self.ranks = ranks if ranks is not None else Ranks()
        self.out = Path(output_dir)
        self.moved_to = prepare_output_dir(self.out, existing, is_main=self.ranks.is_main)
        random.seed(seed)
        torch.manual_seed(seed)
        if threads:
            torch.set_num_threads(threads)
        self.seed, self.eval_cfg = seed, eval_cfg
        self.log = RunLog(self.out, enabled=self.ranks.is_main, append=existing == "resume", loggers=loggers,
                          wandb=wandb, config=config)
        self.phase = "run"
        """What the run is doing, named in the files of `saving`'s trajectories (`evaluate` sets ``eval_<stage>``
        while it runs; a recipe sets the others: ``sft_teacher``, ``rl``, ...)."""
        self.results: dict[str, dict[str, dict[str, float]]] = {}
        self.sft_history: list[dict[str, float]] = []
        self.rl_history: list[dict[str, float]] = []

    async def evaluate(self, stage: str, step: int, harnesses: Mapping[str, Rollouts], engine: Any,
                       tasks: Sequence[Any]) -> dict[str, dict[str, float]]:
        """`evaluate_stage` of ``engine``'s policy after ``stage`` (logged at ``step``), kept in :attr:`results`.
        Every stage's evaluation plays with the same seed, ``derive_seed(seed, "eval")``: the stages are compared on
        the same sampling draws, and the rows do not depend on how many ranks played them."""
        phase, self.phase = self.phase, f"eval_{stage}"
        try:
            self.results[stage] = await evaluate_stage(stage, step, harnesses, engine, tasks, self.eval_cfg,
                                                       self.log, seed=derive_seed(self.seed, "eval"))
        finally:
            self.phase = phase
        return self.results[stage]

    def saving(self, harnesses: Mapping[str, Rollouts]) -> dict[str, Rollouts]:
        """``harnesses`` wrapped so that every trajectory they return is saved (`save_trajectories`, under the
        harness's name)."""
        return {name: SavingRollouts(rollouts, name, self.save_trajectories) for name, rollouts in harnesses.items()}

    def save_trajectories(self, trajectories: Sequence[Trajectory], rollouts: str | None = None) -> None:
        """Append ``trajectories`` to ``output_dir/trajectories/<phase>.jsonl.gz`` (`orchard.stages.run_files`),
        with ``phase`` (and ``rollouts``, the harness's name, when given) in their written metadata; under several
        ranks each rank writes its own to ``<phase>.rank<r>.jsonl.gz``."""
        suffix = "" if self.ranks.world_size == 1 else f".rank{self.ranks.rank}"
        extra = {"phase": self.phase} if rollouts is None else {"phase": self.phase, "rollouts": rollouts}
        append_trajectories(trajectories, self.out / "trajectories" / f"{self.phase}{suffix}.jsonl.gz", **extra)

    async def sft(self, model: Any, tokenizer: Any, engine: Any, samples: Sequence[RenderedSample],
                  cfg: SFTConfig, *, provenance: Mapping[str, Any] | None = None,
                  processor: Any = None) -> list[dict[str, float]]:
        """`sft_stage` on ``samples`` (trainer output under ``output_dir/sft``), the loss printed, the model saved as
        ``sft_model`` (rank 0; with ``processor`` beside it, `save_policy`), then the engine given the new weights;
        every rank waits there for rank 0's push, so no served replica generates with the old ones. Returns (and
        keeps in :attr:`sft_history`) the per-step metrics. First, rank 0 writes the samples as they train to
        ``output_dir/sft_data`` with ``provenance`` (the recipe's account of where they and their masks came from;
        `orchard.stages.run_files.save_sft_data`)."""
        if self.ranks.is_main:
            save_sft_data(samples, self.out / "sft_data", provenance)
        self.sft_history = sft_stage(model, samples, cfg, pad_id=tokenizer.pad_token_id, seed=self.seed,
                                     output_dir=str(self.out / "sft"))
        for step, row in enumerate(self.sft_history, 1):
            self.log.log({f"sft/{key}": value for key, value in row.items()}, step)
        self.log.print(f"sft: {len(samples)} samples, {len(self.sft_history)} steps, loss "
                       f"{self.sft_history[0]['loss/total']:.3f} -> {self.sft_history[-1]['loss/total']:.3f}")
        self.save_policy(model, tokenizer, "sft_model", processor=processor)
        await engine.update_weights(model.state_dict())
        barrier()
        return self.sft_history

    def save_policy(self, model: Any, tokenizer: Any, name: str, *, processor: Any = None) -> None:
        """The model and tokenizer (and a vision-language policy's image ``processor``, when given) saved under
        ``output_dir/name`` by rank 0 (`orchard.stages.policy.save_policy`)."""
        if self.ranks.is_main:
            save_policy(model, tokenizer, self.out / name, processor=processor)

    async def finish(self, engine: Any, config: Mapping[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
        """The end of the run: ``engine`` closed, the log closed, and on rank 0 `write_results` (results.json with
        ``config``, the learning curve, the printed table). Returns :attr:`results`."""
        await engine.close()
        self.log.close()
        if self.ranks.is_main:
            write_results(self.out, self.results, config, self.log, attempts=self.eval_cfg.attempts,
                          sft_history=self.sft_history, rl_history=self.rl_history)
        return self.results
