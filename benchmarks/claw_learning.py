"""Does the Claw recipe learn? Runs recipes/claw.py with the tiny config for several seeds and reports held-out
success (mean ± std over seeds) of the base, SFT and RL models, plus pass@k and pass^k.

    python benchmarks/claw_learning.py [--seeds 0 1 2] [--config recipes/configs/claw_tiny.yaml] [key=value ...]

Each seed runs as its own process (``--jobs`` of them at once; each recipe uses one torch thread and its own
embedded sandbox service); results land in runs/claw_learning/seed<N>/ and the table is printed and written to
runs/claw_learning/summary.md.

``--temperature-control`` then asks what RL learned beyond the sharpness of its sampling: for each seed it reads
the mean of ``model.norm.weight`` (with a linear lm head and no bias, the logits' inverse temperature) of the SFT
and the RL model, and evaluates the SFT model on the same held-out tasks at temperature ``sft / rl`` of those
means (``sft.enabled=false rl.enabled=false eval.temperature=T``, under seed<N>/control/). ``--reuse`` skips the
training runs of seeds whose results.json already exists.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}, commit {commit.stdout.strip()}"


def run_all(seeds: list[int], jobs: int, out: Path, seed_args: Any, config: str, log_name: str, t0: float) -> None:
    """Runs recipes/claw.py once per seed, ``jobs`` at once, each logging to ``seed<N>/<log_name>``."""
    pending = list(seeds)
    running: list[tuple[int, subprocess.Popen, Any]] = []
    while pending or running:
        while pending and len(running) < jobs:
            seed = pending.pop(0)
            run_dir = out / f"seed{seed}"
            run_dir.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, str(ROOT / "recipes/claw.py"), "--config", config, *seed_args(seed)]
            print("+", " ".join(cmd[1:]), flush=True)
            log = (run_dir / log_name).open("w")
            running.append((seed, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(2)
        for item in list(running):
            seed, proc, log = item
            if proc.poll() is not None:
                log.close()
                running.remove(item)
                if proc.returncode != 0:
                    raise SystemExit(f"seed {seed} failed (exit {proc.returncode}); see {out}/seed{seed}/{log_name}")
                print(f"seed {seed} done after {time.monotonic() - t0:.0f} s", flush=True)


def norm_scale(model_dir: Path) -> float:
    """Mean of the saved model's ``model.norm.weight``."""
    from safetensors.torch import load_file

    for shard in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(shard)
        if "model.norm.weight" in tensors:
            return float(tensors["model.norm.weight"].float().mean())
    raise SystemExit(f"no model.norm.weight in {model_dir}")


def temperature_control(args: Any, out: Path, runs: list[dict[str, Any]], harnesses: list[str],
                        t0: float) -> list[str]:
    """The SFT model of each seed evaluated at the temperature its RL model's final-norm scale implies."""
    temps = {}
    for seed in args.seeds:
        sft, rl = norm_scale(out / f"seed{seed}" / "sft_model"), norm_scale(out / f"seed{seed}" / "rl_model")
        temps[seed] = (sft, rl, round(sft / rl, 3))
    run_all(list(args.seeds), args.jobs, out, lambda seed: [
        f"seed={seed}", f"output_dir={out / f'seed{seed}' / 'control'}",
        f"model.path={out / f'seed{seed}' / 'sft_model'}", "sft.enabled=false", "rl.enabled=false",
        f"eval.temperature={temps[seed][2]}", *args.overrides], args.config, "control.log", t0)
    controls = [json.loads((out / f"seed{s}" / "control" / "results.json").read_text()) for s in args.seeds]
    lines = ["final-norm scale SFT -> RL (temperature): " + ", ".join(
        f"seed {s} {a:.3f} -> {b:.3f} ({t})" for s, (a, b, t) in temps.items()), "",
        "| harness | SFT at T=1 | SFT at the RL temperature | RL at T=1 |", "|---|---|---|---|"]

    def cell(values: list[float]) -> str:
        v = np.array(values)
        return f"{v.mean():.3f} ± {v.std(ddof=1) if len(v) > 1 else 0.0:.3f} ({', '.join(f'{x:.3f}' for x in v)})"

    for harness in harnesses:
        lines.append(f"| {harness} | {cell([r['results']['sft'][harness]['success'] for r in runs])} | "
                     f"{cell([c['results']['base'][harness]['success'] for c in controls])} | "
                     f"{cell([r['results']['rl'][harness]['success'] for r in runs])} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--config", default=str(ROOT / "recipes/configs/claw_tiny.yaml"))
    parser.add_argument("--out", default=str(ROOT / "runs/claw_learning"))
    parser.add_argument("--jobs", type=int, default=1, help="seeds run at once")
    parser.add_argument("--reuse", action="store_true", help="keep finished seeds' results instead of rerunning")
    parser.add_argument("--temperature-control", action="store_true",
                        help="also evaluate each SFT model at the temperature its RL model's final norm implies")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out = Path(args.out)
    t0 = time.monotonic()
    pending = [s for s in args.seeds if not (args.reuse and (out / f"seed{s}" / "results.json").exists())]
    run_all(pending, args.jobs, out, lambda seed: [f"seed={seed}", f"output_dir={out / f'seed{seed}'}",
                                                   *args.overrides], args.config, "stdout.log", t0)
    runs = [json.loads((out / f"seed{seed}" / "results.json").read_text()) for seed in args.seeds]

    stages = [s for s in ("base", "sft", "rl") if all(s in r["results"] for r in runs)]
    harnesses = sorted({h for r in runs for s in stages for h in r["results"][s]})
    metrics = [k for k in next(iter(runs[0]["results"][stages[0]].values())) if k not in ("tasks", "env_errors")]
    lines = [f"machine: {machine()}", f"seeds: {args.seeds}; config: {Path(args.config).name} "
             f"{' '.join(args.overrides)}; wall per seed: {np.mean([r['wall_s'] for r in runs]):.0f} s "
             f"({args.jobs} at once; this invocation's training runs {time.monotonic() - t0:.0f} s"
             f"{', finished seeds reused' if args.reuse else ''})", "",
             "| harness | stage | " + " | ".join(metrics) + " | env errors |",
             "|---|---|" + "---|" * (len(metrics) + 1)]
    for harness in harnesses:
        for stage in stages:
            rows = [r["results"][stage][harness] for r in runs]
            cells = []
            for m in metrics:
                values = np.array([row[m] for row in rows])
                std = values.std(ddof=1) if len(values) > 1 else 0.0
                cells.append(f"{values.mean():.3f} ± {std:.3f}")
            errors = sum(row["env_errors"] for row in rows)
            lines.append(f"| {harness} | {stage} | " + " | ".join(cells) + f" | {errors:.0f} |")
    for harness in harnesses:
        if "sft" in stages and "rl" in stages:
            sft = np.array([r["results"]["sft"][harness]["success"] for r in runs])
            rl = np.array([r["results"]["rl"][harness]["success"] for r in runs])
            gain = rl - sft
            spread = max(sft.std(ddof=1), rl.std(ddof=1)) if len(runs) > 1 else 0.0
            verdict = "learns" if gain.mean() > spread else "does NOT clearly learn"
            lines.append(f"\n{harness}: RL - SFT success = {gain.mean():+.3f} (per seed {np.round(gain, 3).tolist()}), "
                         f"spread across seeds {spread:.3f} -> {verdict}")
    if args.temperature_control:
        lines += ["", *temperature_control(args, out, runs, harnesses, t0)]
    text = "\n".join(lines)
    print(text)
    (out / "summary.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
