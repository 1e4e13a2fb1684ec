"""What the learning benchmarks share: one process per seed (or per seed and arm), ``jobs`` at once, each with its
own log, the mean ± std cells and RL-minus-baseline verdicts of their tables, and the printed and saved summary.

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _seeds import Launch, add_run_arguments, gain_and_spread, machine, mean_std, run_launches

Each run is its own process because each recipe starts its own embedded sandbox service and uses one torch thread:
``jobs`` of them share the machine's cores without sharing an interpreter.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    """One line: architecture, cpus, python and the commit the run measured."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}, commit {commit.stdout.strip()}"


def add_run_arguments(parser: argparse.ArgumentParser, *, config: str, out: str, jobs: int = 1,
                      jobs_help: str = "seeds run at once") -> None:
    """Adds what every learning benchmark's command line takes: ``--seeds`` (default 0 1 2), ``--config`` (default
    ``recipes/configs/<config>``), ``--out`` (default ``runs/<out>``), ``--jobs`` (default ``jobs``, described by
    ``jobs_help``) and the positional ``key=value`` overrides of the recipe's config."""
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got {jobs!r}")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--config", default=str(ROOT / "recipes/configs" / config))
    parser.add_argument("--out", default=str(ROOT / "runs" / out))
    parser.add_argument("--jobs", type=int, default=jobs, help=jobs_help)
    parser.add_argument("overrides", nargs="*")


@dataclass(frozen=True)
class Launch:
    """One process to run: ``command`` with stdout and stderr into ``log``."""

    key: Hashable
    """What the caller gets the exit status under (a seed, or a (seed, arm) pair)."""
    name: str
    """How progress lines call it ("seed 0", "seed 0 grpo_bar")."""
    command: list[str]
    log: Path
    run_dir: Path | None = None
    """The run's ``output_dir``: a previous run there is moved aside to ``<run_dir>.<n>`` before the launch
    (`orchard.stages.prepare_output_dir`), so neither the new log nor the new run overwrites it."""


def run_launches(launches: Sequence[Launch], *, jobs: int, t0: float, stop_on_failure: bool = True,
                 poll_s: float = 2.0) -> dict[Hashable, int]:
    """Runs every launch, ``jobs`` at once in the given order, and returns each key's exit status.

    Prints ``+ <command without the interpreter>`` at each start and ``<name> done after <s> s`` (seconds since
    ``t0``) at each end. With ``stop_on_failure`` a nonzero exit raises ``SystemExit`` naming the run and its log
    (the runs still going are left to finish on their own); without it the failure is printed and the rest go on.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if len({launch.key for launch in launches}) != len(launches):
        raise ValueError(f"launches must have distinct keys, got {[launch.key for launch in launches]}")
    pending = list(launches)
    running: list[tuple[Launch, subprocess.Popen, IO[Any]]] = []
    status: dict[Hashable, int] = {}
    while pending or running:
        while pending and len(running) < jobs:
            launch = pending.pop(0)
            if launch.run_dir is not None:
                from orchard.stages.run_files import prepare_output_dir

                moved = prepare_output_dir(launch.run_dir, "move")
                if moved is not None:
                    print(f"{launch.name}: the previous run in {launch.run_dir} moved to {moved}", flush=True)
            launch.log.parent.mkdir(parents=True, exist_ok=True)
            print("+", " ".join(launch.command[1:]), flush=True)
            log = launch.log.open("w")
            running.append((launch, subprocess.Popen(launch.command, stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(poll_s)
        for item in list(running):
            launch, proc, log = item
            if proc.poll() is None:
                continue
            log.close()
            running.remove(item)
            status[launch.key] = proc.returncode
            if proc.returncode == 0:
                print(f"{launch.name} done after {time.monotonic() - t0:.0f} s", flush=True)
            elif stop_on_failure:
                raise SystemExit(f"{launch.name} failed (exit {proc.returncode}); see {launch.log}")
            else:
                print(f"{launch.name} failed (exit {proc.returncode}) after {time.monotonic() - t0:.0f} s; "
                      f"see {launch.log}", flush=True)
    return status


def mean_std(values: Sequence[float], *, each: int | None = None) -> str:
    """``"mean ± std"`` over seeds, three decimals, the sample std (ddof 1; 0.0 for a single seed); with ``each``
    the per-seed values follow in brackets at that many decimals: ``"0.500 ± 0.100 (0.40, 0.50, 0.60)"``."""
    v = np.asarray(values, dtype=float)
    if v.ndim != 1 or v.size == 0:
        raise ValueError(f"values must be a non-empty list of numbers, got shape {v.shape}")
    std = v.std(ddof=1) if v.size > 1 else 0.0
    text = f"{v.mean():.3f} ± {std:.3f}"
    return text if each is None else f"{text} ({', '.join(f'{x:.{each}f}' for x in v)})"


def gain_and_spread(baseline: Sequence[float], treated: Sequence[float]) -> tuple[np.ndarray, float]:
    """Per seed ``treated - baseline`` and the spread a mean gain must exceed to count: the larger of the two arms'
    sample stds across seeds (0.0 for a single seed, where no spread is measured)."""
    base, new = np.asarray(baseline, dtype=float), np.asarray(treated, dtype=float)
    if base.ndim != 1 or base.size == 0 or new.shape != base.shape:
        raise ValueError(f"baseline and treated must be equal-length non-empty lists, got shapes {base.shape} "
                         f"and {new.shape}")
    spread = float(max(base.std(ddof=1), new.std(ddof=1))) if base.size > 1 else 0.0
    return new - base, spread


def publish(out: Path, lines: Sequence[str]) -> None:
    """Prints a benchmark's summary and writes it, as printed, to ``out/summary.md``."""
    text = "\n".join(lines)
    print(text)
    (out / "summary.md").write_text(text + "\n")
