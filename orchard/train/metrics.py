"""Metric loggers: one small protocol; ``metrics.jsonl`` always, TensorBoard / W&B when installed and asked for.

Every key a trainer logs is documented in ``docs/metrics.md``. A logger receives plain floats (the trainer does
the one device sync per step), so loggers never touch tensors.
"""

from __future__ import annotations

import importlib.util
import json
import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from orchard._extras import requires_extra

__all__ = [
    "LOGGER_NAMES",
    "JsonlLogger",
    "MetricLogger",
    "MultiLogger",
    "ProgressLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "build_loggers",
    "read_jsonl_metrics",
]

LOGGER_NAMES = ("jsonl", "tensorboard", "wandb", "progress")
"""Names accepted by ``build_loggers``."""


@runtime_checkable
class MetricLogger(Protocol):
    """Anything that takes a step's metrics. ``log`` is called once per optimizer step, on rank 0 only."""

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def _check(metrics: Mapping[str, float], step: int) -> None:
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if not isinstance(metrics, Mapping):
        raise ValueError(f"metrics must be a mapping of str to float, got {type(metrics).__name__}")


class JsonlLogger:
    """Appends ``{"step": s, **metrics}`` as one JSON line per step to ``path`` (flushed every line).

    ``resume_step``: when resuming from the checkpoint of step ``s``, lines with ``step > s`` (written after that
    checkpoint by the run that died) are dropped first, so the file reads as one uninterrupted run.
    Non-finite floats are written as the strings ``"nan"`` / ``"inf"`` / ``"-inf"`` (JSON has no such numbers).
    """

    def __init__(self, path: str | Path, *, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            kept = [
                line
                for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", -1) <= resume_step
            ]
            self.path.write_text("".join(f"{line}\n" for line in kept))
        self._file = self.path.open("a")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        _check(metrics, step)
        row: dict[str, Any] = {"step": step}
        for key, value in metrics.items():
            row[key] = value if not isinstance(value, float) or math.isfinite(value) else str(value)
        self._file.write(json.dumps(row, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_jsonl_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` file, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class TensorBoardLogger:
    """Scalars to a TensorBoard event directory (needs the ``tensorboard`` package)."""

    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        _check(metrics, step)
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """Weights & Biases run (needs ``wandb``; ``mode="offline"`` writes locally without a network)."""

    def __init__(
        self, *, project: str, run_name: str | None, config: Mapping[str, Any], log_dir: str | Path, mode: str
    ) -> None:
        import wandb

        self._run = wandb.init(project=project, name=run_name, config=dict(config), dir=str(log_dir), mode=mode)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        _check(metrics, step)
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class ProgressLogger:
    """A rich progress bar over the run's steps with a few headline metrics beside it."""

    def __init__(self, total_steps: int, *, keys: Sequence[str] = ("loss/total", "lr", "grad_norm"),
                 start_step: int = 0) -> None:
        with requires_extra("train"):
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._keys = tuple(keys)
        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"), transient=False,
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
        self._progress.start()

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        _check(metrics, step)
        info = "  ".join(f"{k}={metrics[k]:.4g}" for k in self._keys if isinstance(metrics.get(k), (int, float)))
        self._progress.update(self._task, completed=step, info=info)

    def close(self) -> None:
        self._progress.stop()


class MultiLogger:
    """Fans a step's metrics out to several loggers."""

    def __init__(self, loggers: Sequence[MetricLogger]) -> None:
        self.loggers = list(loggers)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log(metrics, step)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def build_loggers(
    names: Sequence[str],
    out_dir: str | Path,
    *,
    total_steps: int,
    resume_step: int | None = None,
    config: Mapping[str, Any] | None = None,
    wandb_project: str = "orchard",
    wandb_mode: str = "offline",
) -> MultiLogger:
    """The loggers named in ``names`` (see ``LOGGER_NAMES``) writing under ``out_dir``.

    ``jsonl`` (``out_dir/metrics.jsonl``) is always included. ``tensorboard`` and ``wandb`` are skipped with a
    warning when their package is not installed, so a config asking for them still runs on a bare machine.
    """
    unknown = [n for n in names if n not in LOGGER_NAMES]
    if unknown:
        raise ValueError(f"names has unknown logger {unknown[0]!r}; valid: {', '.join(LOGGER_NAMES)}")
    out = Path(out_dir)
    loggers: list[MetricLogger] = [JsonlLogger(out / "metrics.jsonl", resume_step=resume_step)]
    if "tensorboard" in names:
        if importlib.util.find_spec("tensorboard") is None:
            warnings.warn("logger 'tensorboard' asked for but the tensorboard package is not installed; skipped",
                          stacklevel=2)
        else:
            loggers.append(TensorBoardLogger(out / "tensorboard"))
    if "wandb" in names:
        if importlib.util.find_spec("wandb") is None:
            warnings.warn("logger 'wandb' asked for but the wandb package is not installed; skipped", stacklevel=2)
        else:
            loggers.append(WandbLogger(project=wandb_project, run_name=out.name, config=config or {},
                                       log_dir=out, mode=wandb_mode))
    if "progress" in names:
        loggers.append(ProgressLogger(total_steps, start_step=resume_step or 0))
    return MultiLogger(loggers)
