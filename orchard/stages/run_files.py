"""The files of a recipe run: its ``output_dir`` made ready without destroying a previous run (`prepare_output_dir`),
and what it writes besides its metrics, so a researcher can read and reuse it: every trajectory the run's
harnesses played, by phase, and the SFT data exactly as it trained (`RecipeRun.saving`, `RecipeRun.sft`)::

    <output_dir>/trajectories/<phase>.jsonl.gz      # one `Trajectory` a line (orchard.data.read_jsonl reads it)
    <output_dir>/sft_data/                           # datasets.load_from_disk: input_ids, labels, masks, task_id
    <output_dir>/sft_data/provenance.json            # what made the samples and their masks, and the counts

A trajectory's ``metadata`` gains ``"phase"`` (the run's phase when it was played: ``eval_base``, ``sft_teacher``,
``rl``, ...) and ``"rollouts"`` (the name of the harness it was played through) in the file, not in memory. Under
several ranks each rank writes the episodes it played, to ``<phase>.rank<r>.jsonl.gz``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from orchard.data import RenderedSample, Trajectory, to_token_dataset, write_jsonl
from orchard.rollout.rollouts import Rollouts
from orchard.stages.ranks import barrier

__all__ = ["EXISTING_RUN_CHOICES", "SavingRollouts", "append_trajectories", "prepare_output_dir", "previous_run",
           "refusal", "save_sft_data"]

EXISTING_RUN_CHOICES = ("refuse", "move", "resume")
"""What a recipe may do with an ``output_dir`` that holds a run already (`prepare_output_dir`)."""
RUN_MARKERS = ("metrics.jsonl", "results.json")
"""Files whose presence means a directory holds a run."""


def prepare_output_dir(output_dir: str | Path, existing: str = "refuse", *, is_main: bool = True) -> Path | None:
    """Make ``output_dir`` ready for a new run without destroying a previous one (`RecipeRun`'s
    ``existing``). Returns where the previous run was moved (``"move"``, rank 0), else None.

    Raises:
        ValueError: ``existing`` is not one of `EXISTING_RUN_CHOICES`; or it is ``"refuse"`` and the directory holds
            a run (the message names the files found and the choices).
    """
    if existing not in EXISTING_RUN_CHOICES:
        raise ValueError(f"existing must be one of {list(EXISTING_RUN_CHOICES)}, got {existing!r}")
    out = Path(output_dir)
    if not previous_run(out) or existing == "resume":
        return None
    if existing == "refuse":
        raise ValueError(refusal(out))
    barrier()  # every rank has looked before rank 0 moves it (the others then see an empty directory)
    moved = None
    if is_main:
        moved = _free_sibling(out)
        out.rename(moved)
    barrier()
    return moved


def previous_run(output_dir: str | Path) -> list[str]:
    """The files of `RUN_MARKERS` that ``output_dir`` holds (empty: no run there)."""
    return [name for name in RUN_MARKERS if (Path(output_dir) / name).exists()]


def refusal(output_dir: str | Path) -> str:
    """Why a run will not start in ``output_dir`` (it holds a previous one), with the user's choices."""
    out = Path(output_dir)
    return (f"output_dir {str(out)!r} holds a previous run ({', '.join(previous_run(out))}); choose another "
            f"output_dir, or existing=move to move it aside to {str(_free_sibling(out))!r}, or existing=resume to "
            f"continue it")


def _free_sibling(out: Path) -> Path:
    """``<out>.<n>`` for the first ``n`` from 1 that does not exist."""
    n = 1
    while out.with_name(f"{out.name}.{n}").exists():
        n += 1
    return out.with_name(f"{out.name}.{n}")



def append_trajectories(trajectories: Sequence[Trajectory], path: str | Path, **metadata: Any) -> int:
    """Append ``trajectories`` to the JSONL file ``path`` (gzip for ``.gz``), each with ``metadata`` added to its
    written ``metadata`` (the objects are not changed); returns how many. A trajectory that cannot be written
    (metadata that is not JSON) raises: a run's record is not silently incomplete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_jsonl([replace(t, metadata={**t.metadata, **metadata}) for t in trajectories], path, append=True)


class SavingRollouts:
    """A `Rollouts` that plays through ``inner`` and hands every batch it returns to ``sink(trajectories, name)``
    (`RecipeRun.save_trajectories`) before returning it."""

    def __init__(self, inner: Rollouts, name: str, sink: Callable[[Sequence[Trajectory], str], Any]) -> None:
        if not isinstance(inner, Rollouts):
            raise ValueError(f"inner must be a Rollouts (an async callable), got {type(inner).__name__}")
        self.inner, self.name, self.sink = inner, name, sink

    async def __call__(self, engine: Any, tasks: Sequence[Any], *, group_size: int, temperature: float,
                       max_tokens: int | None = None, seed: int | None = None) -> list[Trajectory]:
        trajectories = await self.inner(engine, tasks, group_size=group_size, temperature=temperature,
                                        max_tokens=max_tokens, seed=seed)
        self.sink(trajectories, self.name)
        return trajectories


def save_sft_data(samples: Sequence[RenderedSample], out: str | Path,
                  provenance: Mapping[str, Any] | None = None) -> Path:
    """The SFT samples as they train, under ``out``: `orchard.data.to_token_dataset` (``input_ids``,
    ``attention_mask``, ``labels`` = -100 off the action mask, ``assistant_masks``) plus ``task_id`` and ``reward``
    columns, saved with ``save_to_disk``; and ``out/provenance.json``: the counts (samples, tokens, trained tokens,
    samples whose rendering differed from the sampled ids) and ``provenance``, the recipe's account of where the
    samples and their masks came from. Samples with images keep only ``provenance.json`` (a token dataset cannot
    carry them), which says so. Returns ``out``."""
    if not isinstance(samples, Sequence) or not all(isinstance(s, RenderedSample) for s in samples):
        raise ValueError("samples must be a sequence of RenderedSample")
    if provenance is not None and not isinstance(provenance, Mapping):
        raise ValueError(f"provenance must be a mapping or None, got {type(provenance).__name__}")
    out = Path(out)
    images = any(s.pixel_values is not None for s in samples)
    counts = {
        "samples": len(samples),
        "tokens": sum(int(s.input_ids.numel()) for s in samples),
        "trained_tokens": sum(int(s.action_mask.sum()) for s in samples),
        "rendering_mismatches": sum(bool(s.report.mismatches) for s in samples),
    }
    if not images:
        dataset = to_token_dataset(samples)
        dataset = dataset.add_column("task_id", [s.task_id for s in samples])
        dataset = dataset.add_column("reward", [s.reward for s in samples])
        dataset.save_to_disk(str(out))
    out.mkdir(parents=True, exist_ok=True)
    record = {**counts, "provenance": dict(provenance or {}),
              "dataset": None if images else "datasets.load_from_disk(this directory)",
              "images": "the samples carry images: no token dataset was written" if images else None}
    (out / "provenance.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    return out
