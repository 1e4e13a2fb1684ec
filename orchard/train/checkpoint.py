"""Checkpoint directories that a killed run resumes from exactly: engine state, RNG states, data cursor.

Layout under ``output_dir/checkpoints``::

    step_000004/            one directory per saved optimizer step
        engine files        model / optimizer / scheduler (plain torch) or a DeepSpeed checkpoint
        rng_rank{r}.pt      python, numpy and torch (CPU and CUDA) generator states of rank r
        trainer_state.json  {"step": 4, "cursor": {...}, "extra": {...}}, written last
    latest                  the name of the newest complete checkpoint, replaced atomically

A checkpoint counts only once ``latest`` names it, and ``latest`` is written (rename of a temporary file) after
every rank has finished writing, so a process killed mid-save leaves the previous checkpoint in force.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["get_rng_state", "latest_checkpoint", "mark_latest", "prune_checkpoints", "set_rng_state",
           "step_dir"]


def get_rng_state() -> dict[str, Any]:
    """The python, numpy and torch generator states of this process."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``get_rng_state`` returned."""
    for key in ("python", "numpy", "torch"):
        if key not in state:
            raise ValueError(f"state is missing the {key!r} generator state; keys: {sorted(state)}")
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def step_dir(root: Path, step: int) -> Path:
    """``root/step_{step:06d}``."""
    return Path(root) / f"step_{step:06d}"


def mark_latest(root: Path, step: int) -> None:
    """Atomically point ``root/latest`` at the checkpoint of ``step``."""
    tmp = Path(root) / f".latest.{os.getpid()}"
    tmp.write_text(step_dir(root, step).name)
    os.replace(tmp, Path(root) / "latest")


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint directory under ``root``, or ``None``."""
    pointer = Path(root) / "latest"
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if (path / "trainer_state.json").is_file() else None


def prune_checkpoints(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints (and always the one ``latest`` names); delete the rest.

    Only complete checkpoints (``trainer_state.json`` written) count toward ``keep``: a save that died half-way
    is never the reason a complete checkpoint is deleted. An incomplete directory older than ``latest`` is
    deleted (the run has moved past its step, so it can never complete); a newer one is left alone (a resumed
    run writes that step again).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep!r}")
    latest = latest_checkpoint(root)
    latest_name = latest.name if latest is not None else None
    dirs = sorted(p for p in Path(root).glob("step_*") if p.is_dir())
    complete = [p for p in dirs if (p / "trainer_state.json").is_file()]
    doomed = [p for p in complete[:-keep] if p.name != latest_name]
    if latest_name is not None:
        doomed += [p for p in dirs if p not in complete and p.name < latest_name]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)


def write_trainer_state(directory: Path, state: dict[str, Any]) -> None:
    """Write ``trainer_state.json`` (the file whose presence completes a checkpoint directory)."""
    tmp = directory / "trainer_state.json.tmp"
    tmp.write_text(json.dumps(state, sort_keys=True))
    os.replace(tmp, directory / "trainer_state.json")


def read_trainer_state(directory: Path) -> dict[str, Any]:
    """Read ``trainer_state.json``."""
    return json.loads((Path(directory) / "trainer_state.json").read_text())
