"""Does the GUI recipe learn? Runs recipes/gui.py with the tiny config for several seeds and reports held-out
success (mean ± std over seeds) of the base, SFT and RL models (the paper: RL +13.9 to +20.0 points over SFT; our
goal: RL above SFT beyond the spread across seeds), with what the recipe removed or counted beside it: the
teacher's episodes, judged successes and curated tasks, and the RL rollouts removed from the loss (captcha-blocked
runs, judge failures, unreadable judge answers) and ended by repeated format failures.

    python benchmarks/gui_learning.py [--seeds 0 1 2] [--jobs 2] [--config recipes/configs/gui_tiny.yaml] \\
        [--reuse] [key=value ...]

Each seed runs recipes/gui.py as its own process (``--jobs`` of them at once; each recipe uses one torch thread,
its own embedded sandbox service and one headless Chromium per episode); ``key=value`` overrides go to every
seed's recipe. Under ``--out`` (default runs/gui_learning): seed<N>/ (the recipe's outputs and stdout.log),
summary.md (the table, as printed) and learning_curve.png (SFT loss per step and RL train success per step, every
seed, with each seed's held-out success after SFT and after RL). ``--reuse`` keeps the seeds whose results.json
already exists.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _seeds import Launch, add_run_arguments, gain_and_spread, machine, mean_std, publish, run_launches

from orchard.train.metrics import read_jsonl_metrics

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("base", "sft", "rl")
TEACHER_COUNTS = ("teacher_episodes", "teacher_passed", "curated_tasks", "samples", "teacher_captcha_blocked",
                  "teacher_judge_failures")
"""The teacher's row of the recipe's metrics.jsonl (``sft/<name>``), one value per seed."""
RL_COUNTS = ("episodes", "removed", "captcha_blocked", "judge_failures", "judge_unparseable", "format_failures")
"""RL counts of the recipe's metrics.jsonl (``rl/<name>`` per step), summed over a seed's RL steps."""


def run_counts(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One seed's teacher counts and RL counts (summed over its RL steps, ``rl/step_budget`` rows only) from the
    recipe's metrics.jsonl rows; a count the run never logged (RL disabled) is absent."""
    counts: dict[str, float] = {}
    for row in rows:
        if "sft/curated_tasks" in row:
            counts.update({k: row[f"sft/{k}"] for k in TEACHER_COUNTS if f"sft/{k}" in row})
    rl = [row for row in rows if "rl/step_budget" in row]
    if rl:
        counts.update({f"rl_{k}": float(sum(row.get(f"rl/{k}", 0.0) for row in rl)) for k in RL_COUNTS})
        counts["rl_steps"] = float(len(rl))
    return counts


def summarize(seeds: Sequence[int], runs: Sequence[Mapping[str, Any]], counts: Sequence[Mapping[str, float]]) -> list[str]:
    """The markdown table of held-out success per stage (mean ± std over seeds, each seed after it), the RL - SFT
    and RL - base verdicts, and the counts beside them (a column per seed; ``runs`` and ``counts`` in seed order)."""
    stages = [s for s in STAGES if all(s in r["results"] for r in runs)]
    first = runs[0]["results"][stages[0]]["gui"]
    metrics = [k for k in first if k not in ("tasks", "env_errors")]
    lines = [f"held-out tasks per seed: {first['tasks']:.0f} (x {runs[0]['config']['eval']['attempts']} attempts)",
             "", "| stage | " + " | ".join(metrics) + " | env errors |", "|---|" + "---|" * (len(metrics) + 1)]
    for stage in stages:
        rows = [r["results"][stage]["gui"] for r in runs]
        lines.append(f"| {stage} | " + " | ".join(mean_std([row[m] for row in rows], each=3) for m in metrics)
                     + f" | {sum(row['env_errors'] for row in rows):.0f} |")
    verdicts = []
    for baseline in ("sft", "base"):
        if baseline not in stages or "rl" not in stages:
            continue
        gain, spread = gain_and_spread([r["results"][baseline]["gui"]["success"] for r in runs],
                                       [r["results"]["rl"]["gui"]["success"] for r in runs])
        verdict = "beyond the spread" if gain.mean() > spread else "NOT beyond the spread"
        verdicts.append(f"RL - {baseline} success = {gain.mean():+.3f} (per seed {np.round(gain, 3).tolist()}), "
                        f"spread across seeds {spread:.3f} -> {verdict}")
    if verdicts:
        lines += ["", *verdicts]
    keys = [k for k in (*TEACHER_COUNTS, "rl_steps", *(f"rl_{k}" for k in RL_COUNTS)) if all(k in c for c in counts)]
    if keys:
        lines += ["", "| count | " + " | ".join(f"seed {seed}" for seed in seeds) + " |",
                  "|---|" + "---|" * len(counts), *(f"| {k} | " + " | ".join(f"{c[k]:.0f}" for c in counts) + " |"
                                                   for k in keys)]
    return lines


def plot(out: Path, seeds: Sequence[int], runs: Sequence[Mapping[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_sft, ax_rl) = plt.subplots(1, 2, figsize=(10, 4))
    for i, (seed, run) in enumerate(zip(seeds, runs, strict=True)):
        sft = read_jsonl_metrics(out / f"seed{seed}" / "sft" / "metrics.jsonl", missing_ok=True)
        ax_sft.plot([r["step"] for r in sft], [r["loss/total"] for r in sft], marker=".", markersize=3, color=f"C{i}",
                    label=f"seed {seed}")
        rl = [r for r in read_jsonl_metrics(out / f"seed{seed}" / "metrics.jsonl", missing_ok=True) if "rl/step_budget" in r]
        if rl:
            ax_rl.plot([r["step"] for r in rl], [r["rl/success"] for r in rl], marker="o", color=f"C{i}",
                       label=f"seed {seed} train rollouts")
        for stage, style in (("sft", "--"), ("rl", "-")):
            if stage in run["results"]:
                ax_rl.axhline(run["results"][stage]["gui"]["success"], linestyle=style, color=f"C{i}", alpha=0.6,
                              label=f"seed {seed} held-out after {stage}")
    ax_sft.set(title="SFT loss", xlabel="step", ylabel="token-mean NLL")
    ax_sft.legend(fontsize=7)
    ax_rl.set(title="RL success", xlabel="RL step", ylabel="success rate", ylim=(-0.02, 1.02))
    ax_rl.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "learning_curve.png", dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, config="gui_tiny.yaml", out="gui_learning", jobs=2)
    parser.add_argument("--reuse", action="store_true", help="keep finished seeds' results instead of rerunning")
    args = parser.parse_args()
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be >= 1, got {args.jobs}")
    out = Path(args.out)
    t0 = time.monotonic()
    pending = [s for s in args.seeds if not (args.reuse and (out / f"seed{s}" / "results.json").exists())]
    run_launches([Launch(seed, f"seed {seed}", [
        sys.executable, str(ROOT / "recipes/gui.py"), "--config", args.config, f"seed={seed}",
        f"output_dir={out / f'seed{seed}'}", *args.overrides], out / f"seed{seed}" / "stdout.log", out / f"seed{seed}")
        for seed in pending], jobs=args.jobs, t0=t0)
    runs = [json.loads((out / f"seed{s}" / "results.json").read_text()) for s in args.seeds]
    counts = [run_counts(read_jsonl_metrics(out / f"seed{s}" / "metrics.jsonl", missing_ok=True)) for s in args.seeds]
    lines = [f"machine: {machine()}", f"seeds: {args.seeds}; config: {' '.join([Path(args.config).name, *args.overrides])}; wall per seed: {np.mean([r['wall_s'] for r in runs]):.0f} s "
             f"({args.jobs} at once; this invocation {time.monotonic() - t0:.0f} s"
             f"{', finished seeds reused' if args.reuse else ''})", *summarize(args.seeds, runs, counts)]
    plot(out, args.seeds, runs)
    publish(out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
