"""What a run reports: metrics.jsonl, timestamped console lines, the learning-curve plot, the results table."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from orchard._extras import requires_extra
from orchard.train.metrics import JsonlLogger, MetricLogger, TensorBoardLogger, WandbConfig, WandbLogger

__all__ = ["RunLog", "format_table", "plot_learning_curve", "provenance", "recipe_main", "write_results"]


RUN_LOGGERS = ("jsonl", "tensorboard", "wandb")
"""What a recipe run's ``loggers`` may name (``metrics.jsonl`` is always written)."""


class RunLog:
    """Appends metrics to ``<output_dir>/metrics.jsonl`` and prints progress lines that start with the seconds
    since the run began. A file already there is an earlier run's: it is kept and appended to with ``append=True``
    (a resumed run), else refused (`orchard.stages.prepare_output_dir` moves it aside first when asked). With
    ``enabled=False`` (every rank but 0 under a launcher) it writes and prints nothing.

    ``loggers`` may add ``tensorboard`` (``output_dir/tensorboard``) and ``wandb`` (one W&B run for the whole
    recipe run, named after ``output_dir`` and grouped by its parent unless ``wandb`` names them, with ``config``
    as its config): each gets every metric the run logs. Their step is the count of `log` calls (W&B needs it to
    increase; a run logs evaluation, SFT and RL rows on steps of their own), and the run's own step is the metric
    ``run/step``.
    """

    def __init__(self, output_dir: str | Path, *, enabled: bool = True, append: bool = False,
                 loggers: Sequence[str] = ("jsonl",), wandb: WandbConfig | None = None,
                 config: Mapping[str, Any] | None = None) -> None:
        if isinstance(loggers, str) or not all(name in RUN_LOGGERS for name in loggers):
            raise ValueError(f"loggers must name loggers among {list(RUN_LOGGERS)}, got {loggers!r}")
        if wandb is not None and not isinstance(wandb, WandbConfig):
            raise ValueError(f"wandb must be a WandbConfig or None, got {type(wandb).__name__}")
        self.path = Path(output_dir) / "metrics.jsonl"
        self.enabled = bool(enabled)
        self._jsonl: JsonlLogger | None = None
        self._sinks: list[MetricLogger] = []
        self._logged = 0
        if self.enabled:
            if self.path.exists() and not append:
                raise ValueError(f"output_dir {str(self.path.parent)!r} holds an earlier run's metrics.jsonl; "
                                 f"append=True continues it, or move it aside")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = JsonlLogger(self.path)
            out = self.path.parent
            if "tensorboard" in loggers:
                self._sinks.append(TensorBoardLogger(out / "tensorboard"))
            if "wandb" in loggers:
                w = wandb or WandbConfig()
                named = replace(w, run_name=w.run_name or str(output_dir), group=w.group or str(out.parent))
                self._sinks.append(WandbLogger(named, log_dir=out, config=config))
        self.started = time.monotonic()

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._jsonl is not None:
            self._jsonl.log(metrics, step)
        if self._sinks:
            self._logged += 1
            for sink in self._sinks:
                sink.log({**metrics, "run/step": float(step)}, self._logged)

    def print(self, message: str) -> None:
        if self.enabled:
            print(f"[{self.elapsed_s:6.0f}s] {message}", flush=True)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        for sink in self._sinks:
            sink.close()
        self._sinks = []


def plot_learning_curve(sft_history: Sequence[Mapping[str, float]], rl_history: Sequence[Mapping[str, float]],
                        results: Mapping[str, Mapping[str, Mapping[str, float]]], path: str | Path) -> None:
    """SFT loss per step (left); RL success per step over the episodes that trained and, where they differ
    (BAR), over every episode generated, with the held-out success of each stage as lines (right)."""
    with requires_extra("plot"):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

    fig, (ax_sft, ax_rl) = plt.subplots(1, 2, figsize=(10, 4))
    ax_sft.plot(range(1, len(sft_history) + 1), [m["loss/total"] for m in sft_history])
    ax_sft.set(title="SFT loss", xlabel="step", ylabel="token-mean NLL")
    steps = np.arange(1, len(rl_history) + 1)
    window = max(1, len(rl_history) // 10)
    series: list[tuple[str, str]] = [("rl/success", "train rollouts (trained groups)")]
    if any(m.get("rl/success_generated") != m.get("rl/success") for m in rl_history):
        series.append(("rl/success_generated", "train rollouts (all generated)"))
    for key, label in series:
        values = [m[key] for m in rl_history]
        if not values:
            continue
        line = ax_rl.plot(steps, values, alpha=0.3, label=label)[0]
        smooth = np.convolve(values, np.ones(window) / window, mode="valid")
        ax_rl.plot(steps[window - 1:], smooth, color=line.get_color(), label=f"{label}, {window}-step mean")
    for stage, style in (("base", ":"), ("sft", "--"), ("sft_best_t", "-."), ("rl", "-")):
        for i, (harness, row) in enumerate(results.get(stage, {}).items()):
            ax_rl.axhline(row["success"], linestyle=style, color=f"C{i + 2}", label=f"held-out {stage} ({harness})")
    ax_rl.set(title="RL success", xlabel="RL step", ylabel="success rate", ylim=(-0.02, 1.02))
    ax_rl.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_table(results: Mapping[str, Mapping[str, Mapping[str, float]]], attempts: int) -> str:
    """``results[stage][harness] = success_row(...)`` as an aligned text table (counts as integers)."""
    keys = ("success", f"pass@{attempts}", f"pass^{attempts}", "tasks", "env_errors")
    width = max(len(k) for k in keys) + 1
    stage_w = max([len("stage"), *(len(s) for s in results)])
    harness_w = max([len("harness"), *(len(h) for by in results.values() for h in by)])
    lines = [f"{'stage':<{stage_w}}  {'harness':<{harness_w}} " + "".join(f"{k:>{width}}" for k in keys)]
    for stage, by_harness in results.items():
        for harness, row in by_harness.items():
            cells = [f"{row[k]:>{width}.3f}" if k not in ("tasks", "env_errors") else f"{int(row[k]):>{width}d}"
                     for k in keys]
            lines.append(f"{stage:<{stage_w}}  {harness:<{harness_w}} " + "".join(cells))
    return "\n".join(lines)


def write_results(out: str | Path, results: Mapping[str, Mapping[str, Mapping[str, float]]], config: Mapping[str, Any],
                  log: RunLog, *, attempts: int, sft_history: Sequence[Mapping[str, float]] = (),
                  rl_history: Sequence[Mapping[str, float]] = ()) -> None:
    """The end of a run: ``results.json`` (results, the resolved config, wall time, and what produced them:
    `provenance`), ``learning_curve.png`` and the printed table."""
    out = Path(out)
    (out / "results.json").write_text(json.dumps({"results": results, "config": config, "wall_s": log.elapsed_s,
                                                  "provenance": provenance()}, indent=2))
    plot_learning_curve(sft_history, rl_history, results, out / "learning_curve.png")
    print("\n" + format_table(results, attempts))


def provenance() -> dict[str, Any]:
    """What produced a run: orchard's version; the git commit of the checkout orchard was imported from and whether
    its tracked files differed from it (both None when orchard is not in a git checkout, e.g. installed from a
    wheel); the Python, torch and transformers versions."""
    import platform
    import subprocess

    import torch

    import orchard

    root = Path(orchard.__file__).resolve().parent.parent
    commit = dirty = None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode == 0 and (root / ".git").exists():
            commit = head.stdout.strip()
            status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10)
            dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):  # no git on the machine: the commit is unknown, not an error
        pass
    try:
        import transformers

        transformers_version: str | None = transformers.__version__
    except ImportError:
        transformers_version = None
    return {"orchard_version": orchard.__version__, "commit": commit, "dirty": dirty,
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers_version}


def recipe_main(config_cls: type, run: Callable[[Any], Awaitable[Any]], argv: Sequence[str] | None, *,
                doc: str | None, derived: Mapping[str, str]) -> int:
    """A recipe's command line: ``[--config YAML] [--show-config] [key=value ...]``. The config is resolved
    (defaults, then the YAML, then the overrides) and validated before any work, printed, then ``run`` (unless
    ``--show-config``). Wrap it in ``orchard._cli.run_main`` so a config or usage mistake is one line."""
    import argparse
    import asyncio

    from orchard._cli import UsageErrorParser
    from orchard.train.config import ConfigError, format_config, load_config

    parser = UsageErrorParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help=f"YAML file filling {config_cls.__name__}")
    parser.add_argument("--show-config", action="store_true",
                        help="print the resolved config (defaults, then --config, then overrides) and exit")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, dotted for nested fields")
    args = parser.parse_args(argv)
    cfg = load_config(config_cls, args.config, args.overrides, derived=derived)
    if not args.show_config and getattr(cfg, "existing", "refuse") == "refuse" and hasattr(cfg, "output_dir"):
        from orchard.stages.run_files import previous_run, refusal

        if previous_run(cfg.output_dir):  # before any work, as one line (RecipeRun would refuse it too)
            raise ConfigError(refusal(cfg.output_dir))
    print(format_config(cfg, derived=derived), flush=True)
    if not args.show_config:
        asyncio.run(run(cfg))
    return 0
