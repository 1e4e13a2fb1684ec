"""Orchard-SWE part 2 at toy scale (the paper's Tables 7 and 8): held-out resolve rate of the SFT model, of each RL
variant after it, and of best-of-6 by the value model beside a random pick and the oracle, mean ± std over seeds.

    python benchmarks/swe_rl.py [--seeds 0 1 2] [--variants grpo_bar ...] [--jobs 3] [--quick] [key=value ...]

Each (seed, variant) is one run of recipes/swe.py with the tiny config (its own process, one torch thread, its own
embedded sandbox service): SFT, the task filter, the variant's RL, then the value model trained on that run's
rollouts and best-of-6 over the final policy's held-out candidates. The SFT row is the same model for every variant
of a seed (read from the first variant's run). A variant that fails on some seed is reported as not run, with the
first line of its error. ``--quick`` shrinks everything (two templates, short episodes, 2 RL steps) to check the pipeline,
not to measure. Under ``--out`` (default runs/swe_rl): seed<N>/<variant>/ (the recipe's outputs), summary.md (the
table), rl_success.png (train resolve rate over RL steps), judge_reward.png (the rubric judge's mean reward and
rubric per RL step, for judged variants: rpr), bar_ratio.png (BAR's positive ratio per group) and value_curves.png
(V over decision steps of resolved and failed held-out candidates); notebooks/swe_rl.ipynb plots the same directory.
The tiny SFT model resolves few train instances, so the task filter may keep none and RL is skipped: add
``rl.filter.enabled=false`` to train RL on every train instance (how the notebook's test data was made).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _seeds import Launch, add_run_arguments, machine, mean_std, publish, run_launches

from orchard.train.metrics import read_jsonl_metrics

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("grpo_bar", "opd_k2", "opd_k3", "opd_js", "opd_js_grpo", "opd_js_grpo_bar", "rpr")
QUICK = ["instances.templates=[inventory, ledger]", "instances.train_per_template=2", "instances.levels=[1]",
         "teacher.attempts=3", "sft.epochs=1", "rollout.max_steps=4", "rollout.max_tokens=48", "rl.steps=2",
         "rl.tasks_per_step=2", "rl.filter.attempts=4", "value_model.steps=10", "eval.harnesses=[bash, tool]"]


def run_all(jobs_list: list[tuple[int, str]], jobs: int, out: Path, config: str, overrides: list[str],
            t0: float) -> dict[tuple[int, str], int]:
    """Runs recipes/swe.py once per (seed, variant), ``jobs`` at once; returns each run's exit status."""
    return run_launches([Launch((seed, variant), f"seed {seed} {variant}", [
        sys.executable, str(ROOT / "recipes/swe.py"), "--config", config, f"seed={seed}",
        f"output_dir={out / f'seed{seed}' / variant}", f"rl.variant={variant}", *overrides],
        out / f"seed{seed}" / variant / "stdout.log", out / f"seed{seed}" / variant)
        for seed, variant in jobs_list], jobs=jobs, t0=t0,
        stop_on_failure=False)


def cell(values: list[float]) -> str:
    """Mean ± std over seeds, each seed's rate after it at two decimals."""
    return mean_std(values, each=2)


def read(run_dir: Path, name: str) -> Any:
    path = run_dir / name
    return json.loads(path.read_text()) if path.exists() else None


def summarise(out: Path, seeds: list[int], variants: list[str], status: dict[tuple[int, str], int],
              harnesses: list[str]) -> list[str]:
    ok = [v for v in variants if all(status.get((s, v)) == 0 for s in seeds)]
    lines = ["| row | " + " | ".join(harnesses) + " | note |", "|---|" + "---|" * (len(harnesses) + 1)]
    if not ok:
        return [*lines, "", "no variant finished on every seed: " + ", ".join(
            f"{v} (see seed{seeds[0]}/{v}/stdout.log)" for v in variants)]
    runs = {(s, v): read(out / f"seed{s}" / v, "results.json") for s in seeds for v in ok}
    sft = [runs[(s, ok[0])]["results"]["sft"] for s in seeds]
    lines.append("| SFT | " + " | ".join(cell([r[h]["success"] for r in sft]) for h in harnesses) + " | |")
    for v in ok:
        summaries = [read(out / f"seed{s}" / v, "rl_summary.json") for s in seeds]
        # A seed whose filter kept no task ran no RL: its policy is the SFT model, counted as such.
        rl = [runs[(s, v)]["results"].get("rl", runs[(s, v)]["results"]["sft"]) for s in seeds]
        skipped = sum(x["steps"] == 0 for x in summaries)
        note = f"RL skipped on {skipped} seed(s): no task kept by the filter" if skipped else ""
        lines.append(f"| + {v} | " + " | ".join(cell([r[h]["success"] for r in rl]) for h in harnesses)
                     + f" | {note} |")
    lines += ["", "best-of-N over the final policy's held-out candidates (value_model.harness), the value model "
              "trained on the run's train rollouts:", "",
              "| policy | best-of-N by value | random of N | oracle of N | N | pool (share resolved) |",
              "|---|---|---|---|---|---|"]
    notes = []
    for v in ok:
        reports = [read(out / f"seed{s}" / v, "rerank.json")["report"] for s in seeds]
        lines.append(f"| {v} | " + " | ".join(cell([r[k] for r in reports]) for k in
                                              ("rerank/success", "rerank/random", "rerank/oracle"))
                     + f" | {reports[0]['rerank/n']:.0f} | {np.mean([r['value/pool'] for r in reports]):.0f} "
                       f"({np.mean([r['value/pool_success'] for r in reports]):.2f}) |")
        gap = np.array([r["rerank/oracle"] - r["rerank/random"] for r in reports])
        gain = np.array([r["rerank/success"] - r["rerank/random"] for r in reports])
        share = gain.sum() / gap.sum() if gap.sum() > 0 else float("nan")
        notes.append(f"{v}: value - random = {gain.mean():+.3f} (per seed {np.round(gain, 3).tolist()}), "
                     f"share of the random -> oracle gap closed {share:.2f} (the goal: >= 0.33)")
    lines += ["", *notes]
    failed = [v for v in variants if v not in ok]
    if failed:
        lines.append("\nnot run (failed on some seed; the first line of its error): " + "; ".join(
            f"{v}: {first_error(out / f'seed{seeds[0]}' / v / 'stdout.log')}" for v in failed))
    return lines


def first_error(log: Path) -> str:
    text = log.read_text() if log.exists() else ""
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    return errors[0] if errors else f"see {log}"


def plots(out: Path, seeds: list[int], variants: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dirs = [(s, v, out / f"seed{s}" / v) for s in seeds for v in variants if (out / f"seed{s}" / v / "rerank.json").exists()]
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (s, v, d) in enumerate(dirs):
        rows = read_jsonl_metrics(d / "metrics.jsonl")
        rl = [(r["step"], r["rl/success_generated"]) for r in rows if "rl/success_generated" in r]
        if rl:
            ax.plot(*zip(*rl, strict=True), marker="o", color=f"C{i}", label=f"{v} seed {s}")
    ax.set(title="train resolve rate over RL steps (all generated)", xlabel="RL step", ylabel="resolve rate",
           ylim=(-0.02, 1.02))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "rl_success.png", dpi=100)
    plt.close(fig)

    judged = []  # only runs with the rubric judge (rpr) log these
    for i, (s, v, d) in enumerate(dirs):
        rows = read_jsonl_metrics(d / "metrics.jsonl")
        if rows := [r for r in rows if "rl/judge_reward_mean" in r]:
            judged.append((i, s, v, rows))
    if judged:
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, s, v, rows in judged:
            steps = [r["step"] for r in rows]
            ax.plot(steps, [r["rl/judge_reward_mean"] for r in rows], marker="o", color=f"C{i}",
                    label=f"reward, {v} seed {s}")
            ax.plot(steps, [r["rl/judge_rubric_mean"] for r in rows], marker="x", linestyle="--", color=f"C{i}",
                    label=f"rubric, {v} seed {s}")
        ax.set(title="rubric judge per RL step (reward = outcome + w x rubric)", xlabel="RL step")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "judge_reward.png", dpi=100)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (s, v, d) in enumerate(dirs):
        groups = (read(d, "rl_summary.json") or {}).get("bar_groups", [])
        pool = [(g["step"], g["pool_positive_ratio"]) for g in groups if g["pool_positive_ratio"] is not None]
        kept = [(g["step"], g["kept_positive_ratio"]) for g in groups if g["kept_positive_ratio"] is not None]
        if pool:
            ax.scatter(*zip(*pool, strict=True), marker="x", color=f"C{i}", alpha=0.5, label=f"pool, {v} seed {s}")
        if kept:
            ax.scatter(*zip(*kept, strict=True), marker="o", color=f"C{i}", label=f"kept, {v} seed {s}")
    ax.axhspan(0.375, 0.625, color="grey", alpha=0.15, label="the paper's band [0.375, 0.625]")
    ax.set(title="BAR positive ratio per group", xlabel="RL step", ylabel="share resolved", ylim=(-0.02, 1.02))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "bar_ratio.png", dpi=100)
    plt.close(fig)

    from orchard.stages import plot_value_curves

    curves = [c for _, _, d in dirs for c in read(d, "rerank.json")["curves"]]
    plot_value_curves(curves, out / "value_curves.png")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, config="swe_tiny.yaml", out="swe_rl", jobs_help="runs at once")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--quick", action="store_true", help="tiny everything: checks the pipeline, measures nothing")
    args = parser.parse_args()
    out = Path(args.out)
    overrides = [*(QUICK if args.quick else []), *args.overrides]
    t0 = time.monotonic()
    status = run_all([(s, v) for s in args.seeds for v in args.variants], args.jobs, out, args.config, overrides, t0)
    harnesses = ["bash", "tool", "eval"]
    first = read(out / f"seed{args.seeds[0]}" / args.variants[0], "results.json")
    if first is not None:
        harnesses = list(first["results"]["sft"])
    lines = [f"machine: {machine()}", f"seeds: {args.seeds}; variants: {args.variants}; config: "
             f"{Path(args.config).name} {' '.join(overrides)}; {time.monotonic() - t0:.0f} s ({args.jobs} at once)",
             "held-out resolve rate, mean ± std over seeds (per seed in brackets)", "",
             *summarise(out, args.seeds, args.variants, status, harnesses)]
    plots(out, args.seeds, args.variants)
    publish(out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
