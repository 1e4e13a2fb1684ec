"""Metric loggers: one small protocol; ``metrics.jsonl`` always, TensorBoard and W&B when asked for.

TensorBoard needs the ``[tensorboard]`` extra and W&B the ``[wandb]`` extra; a logger asked for without its package
fails at start with a one-line message that names the extra (a run that silently logs nowhere is worse).

Every key a trainer logs is documented in ``docs/metrics.md``. A logger receives plain floats (the trainer does
the one device sync per step), so loggers never touch tensors.
"""

from __future__ import annotations

import difflib
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, get_args, runtime_checkable

from orchard._extras import requires_extra

__all__ = [
    "LOGGER_NAMES",
    "JsonlLogger",
    "MetricLogger",
    "MultiLogger",
    "ProgressLogger",
    "TensorBoardLogger",
    "WandbConfig",
    "WandbLogger",
    "build_loggers",
    "check_logger_names",
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
            kept = [row for row in read_jsonl_metrics(self.path) if row.get("step", -1) <= resume_step]
            self.path.write_text("".join(f"{json.dumps(row, sort_keys=True)}\n" for row in kept))
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


def read_jsonl_metrics(path: str | Path, *, missing_ok: bool = False) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` file, in order (blank lines skipped); with ``missing_ok``, no file reads as
    no rows."""
    path = Path(path)
    if missing_ok and not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class TensorBoardLogger:
    """Scalars to a TensorBoard event file in ``log_dir`` through torch's ``SummaryWriter`` (the ``[tensorboard]``
    extra).

    Numbers only (bools and strings are skipped), stored as TensorBoard's float32 ``simple_value``; flushed every
    step."""

    def __init__(self, log_dir: str | Path) -> None:
        with requires_extra("tensorboard"):
            # torch's writer needs the tensorboard package; imported first so that its absence names the extra
            # even when torch.utils.tensorboard is already loaded
            import tensorboard  # noqa: F401
            from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        _check(metrics, step)
        wall_time = time.time()
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(key, float(value), global_step=step, walltime=wall_time)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


WandbMode = Literal["online", "offline", "disabled"]


@dataclass
class WandbConfig:
    """Where the ``wandb`` logger sends a run. ``TrainConfig.wandb`` holds one (YAML ``wandb: {project: ...}``)."""

    project: str = "orchard"
    """W&B project of the run."""
    mode: WandbMode = "offline"
    """online: stream to the W&B server; offline: write the run directory only (``wandb sync`` uploads it later,
    no network needed); disabled: log nothing."""
    run_name: str | None = None
    """Run name shown in W&B; None: the name of the output directory (a recipe run's: its output_dir)."""
    group: str | None = None
    """W&B group of the run; None: no group (a recipe run's: its output_dir's parent, e.g. the seeds of one
    benchmark)."""

    def __post_init__(self) -> None:
        if not isinstance(self.project, str) or not self.project:
            raise ValueError(f"project must be a non-empty str, got {self.project!r}")
        if self.mode not in get_args(WandbMode):
            raise ValueError(f"mode must be one of {', '.join(get_args(WandbMode))}, got {self.mode!r}")
        for name in ("run_name", "group"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a str or None, got {type(getattr(self, name)).__name__}")


class WandbLogger:
    """A Weights & Biases run (the ``[wandb]`` extra) whose files go under ``log_dir/wandb``."""

    def __init__(self, cfg: WandbConfig, *, log_dir: str | Path, config: Mapping[str, Any] | None = None) -> None:
        with requires_extra("wandb"):
            import wandb

        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=cfg.project, name=cfg.run_name or Path(log_dir).name, mode=cfg.mode,
                               group=cfg.group, config=dict(config or {}), dir=str(log_dir))

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


def check_logger_names(names: Sequence[str], arg: str = "names") -> None:
    """``ValueError`` naming ``arg``, the closest valid name and all of them, for a name not in ``LOGGER_NAMES``."""
    unknown = [n for n in names if n not in LOGGER_NAMES]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), LOGGER_NAMES, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"{arg} has unknown logger {unknown[0]!r}; {hint}valid: {', '.join(LOGGER_NAMES)}")


def build_loggers(
    names: Sequence[str],
    out_dir: str | Path,
    *,
    total_steps: int,
    resume_step: int | None = None,
    config: Mapping[str, Any] | None = None,
    wandb: WandbConfig | None = None,
) -> MultiLogger:
    """The loggers named in ``names`` (see ``LOGGER_NAMES``) writing under ``out_dir``.

    ``jsonl`` (``out_dir/metrics.jsonl``) is always included; ``tensorboard`` writes ``out_dir/tensorboard``;
    ``wandb`` logs the run ``wandb`` (default ``WandbConfig()``: project ``orchard``, offline) with ``config`` as
    the run's config, its files under ``out_dir/wandb``. A logger whose package is missing raises
    ``ModuleNotFoundError`` naming the extra to install.
    """
    check_logger_names(names)
    if wandb is not None and not isinstance(wandb, WandbConfig):
        raise ValueError(f"wandb must be a WandbConfig or None, got {type(wandb).__name__}")
    out = Path(out_dir)
    loggers: list[MetricLogger] = [JsonlLogger(out / "metrics.jsonl", resume_step=resume_step)]
    if "tensorboard" in names:
        loggers.append(TensorBoardLogger(out / "tensorboard"))
    if "wandb" in names:
        loggers.append(WandbLogger(wandb or WandbConfig(), log_dir=out, config=config))
    if "progress" in names:
        loggers.append(ProgressLogger(total_steps, start_step=resume_step or 0))
    return MultiLogger(loggers)
