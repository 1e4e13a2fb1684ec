"""Does the Claw recipe learn? Runs recipes/claw.py with the tiny config for several seeds and reports held-out
success (mean ± std over seeds) of the base, SFT and RL models, plus pass@k and pass^k, and the baseline RL has to
beat: the SFT model at its best sampling temperature.

    python benchmarks/claw_learning.py [--seeds 0 1 2] [--config recipes/configs/claw_tiny.yaml] [key=value ...]

The real pretrained policy, one seed per session, results kept under benchmarks/ and resumed:

    python benchmarks/claw_learning.py --config recipes/configs/claw_smollm2.yaml --out benchmarks/claw_smollm2 \
        --no-best-temperature --reuse --seeds 0 1 2     # the recipe computes SFT at its best T itself (sft_best_t)

Each seed runs as its own process (``--jobs`` of them at once; each recipe uses one torch thread and its own
embedded sandbox service); results land in runs/claw_learning/seed<N>/ and the table is printed and written to
runs/claw_learning/summary.md.

SFT at its best temperature (``--no-best-temperature`` skips it): for each seed, a second process loads the saved
SFT model and plays, through the recipe's own harnesses, a validation split at every temperature of
``--temperatures`` (default 0.3,0.45,...,1.2). The validation split is train-distribution tasks from a block of
task seeds that neither SFT, the RL pool nor the held-out set draws (``split_tasks("train", n, seed=1)``: task
seeds 10,000 on; training uses 0 .. 9,999, the held-out set 1,000,000 on), ``tasks.heldout_per_template`` per
template, ``eval.attempts`` episodes each. Each harness takes the temperature of its highest validation success
(ties: the one nearest the evaluation's temperature, the smallest change), and the SFT model is evaluated on the
held-out set at it; the result is ``seed<N>/best_temperature.json``. The other rows keep the evaluation's
temperature.

``--temperature-control`` then asks what RL learned beyond the sharpness of its sampling: for each seed it reads
the mean of ``model.norm.weight`` (with a linear lm head and no bias, the logits' inverse temperature) of the SFT
and the RL model, and evaluates the SFT model on the same held-out tasks at temperature ``sft / rl`` of those
means (``sft.enabled=false rl.enabled=false eval.temperature=T``, under seed<N>/control/). ``--reuse`` skips the
training runs of seeds whose results.json already exists.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _seeds import Launch, add_run_arguments, gain_and_spread, machine, mean_std, publish, run_launches

from orchard.domains.claw.tasks import VALIDATION_BLOCK
from orchard.stages.temperature import TEMPERATURE_GRID, best_temperature

ROOT = Path(__file__).resolve().parents[1]


def recipe_command(config: str, args: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "recipes/claw.py"), "--config", config, *args]


def run_all(seeds: list[int], jobs: int, out: Path, command: Callable[[int], list[str]], log_name: str,
            t0: float, run_dir: Callable[[int], Path] | None = None) -> None:
    """Runs ``command(seed)`` once per seed, ``jobs`` at once, each logging to ``seed<N>/<log_name>`` (a previous
    run in ``run_dir(seed)`` moved aside first)."""
    run_launches([Launch(seed, f"seed {seed}", command(seed), out / f"seed{seed}" / log_name,
                         None if run_dir is None else run_dir(seed)) for seed in seeds], jobs=jobs, t0=t0)


def norm_scale(model_dir: Path) -> float:
    """Mean of the saved model's ``model.norm.weight``."""
    from safetensors.torch import load_file

    for shard in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(shard)
        if "model.norm.weight" in tensors:
            return float(tensors["model.norm.weight"].float().mean())
    raise SystemExit(f"no model.norm.weight in {model_dir}")


async def finished_or_run(path: Path, evaluate: Callable[[], Any]) -> dict[str, Any]:
    """The rows saved at ``path`` by an earlier run of this evaluation, else ``await evaluate()``'s rows, saved."""
    if path.exists():
        return json.loads(path.read_text())
    rows = await evaluate()
    path.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


async def search_temperature(args: Any, seed: int) -> dict[str, Any]:
    """One seed's SFT model: validation success at each of ``args.temperatures`` per harness, the best temperature
    per harness, and the held-out row at it (the module docstring says how)."""
    import random

    import torch

    from orchard import stages
    from orchard.domains.claw.tasks import split_tasks
    from orchard.env import AsyncSandboxClient
    from orchard.stages.policy import load_policy, make_engine
    from orchard.stages.sandboxes import sandbox_service
    from orchard.train.config import load_config

    # The recipe's own config and harnesses, so that these episodes are played exactly as its evaluation plays them.
    sys.path.insert(0, str(ROOT / "recipes"))
    import claw

    run_dir = Path(args.out) / f"seed{seed}"
    cfg = load_config(claw.ClawConfig, args.config, [*args.overrides, f"seed={seed}",
                                                     f"model.path={run_dir / 'sft_model'}"], derived=claw.DERIVED)
    random.seed(seed)
    torch.manual_seed(seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    _, _, heldout = claw.task_pools(cfg)
    validation = split_tasks("train", cfg.tasks.heldout_per_template, seed=VALIDATION_BLOCK,
                             heldout_templates=tuple(cfg.tasks.heldout_templates))
    model, tokenizer = load_policy(cfg.model, [], seed=seed)
    engine = make_engine(cfg.model, model, tokenizer, seed=seed)
    # Each evaluation's rows are kept as they finish, so a search stopped part-way resumes where it stopped.
    parts = run_dir / "best_temperature_parts"
    parts.mkdir(exist_ok=True)
    validation_rows: dict[str, dict[float, dict[str, float]]] = {h: {} for h in cfg.eval.harnesses}
    with sandbox_service(cfg.env_url) as env:
        async with AsyncSandboxClient(*env) as client:
            harnesses = claw.claw_harnesses(cfg, tokenizer, client)
            evaluated = {h: harnesses[h] for h in cfg.eval.harnesses}
            for temperature in args.temperatures:
                rows = await finished_or_run(parts / f"validation_T{temperature}.json", lambda t=temperature: (
                    stages.evaluate(evaluated, engine, validation, attempts=cfg.eval.attempts, temperature=t)))
                for harness, row in rows.items():
                    validation_rows[harness][temperature] = row
                print(f"T={temperature}: " + ", ".join(f"{h} {r['success']:.3f}" for h, r in rows.items()),
                      flush=True)
            chosen = {h: best_temperature({t: row["success"] for t, row in by_t.items()},
                                          reference=cfg.eval.temperature) for h, by_t in validation_rows.items()}
            heldout_rows = {}
            for harness, temperature in chosen.items():
                rows = await finished_or_run(parts / f"heldout_{harness}_T{temperature}.json", lambda h=harness, t=(
                    temperature): stages.evaluate({h: evaluated[h]}, engine, heldout, attempts=cfg.eval.attempts,
                                                  temperature=t))
                heldout_rows[harness] = rows[harness]
                print(f"held-out {harness} at T={temperature}: {rows[harness]}", flush=True)
    await engine.close()
    result = {"validation_tasks": len(validation), "temperature": chosen, "heldout": heldout_rows,
              "validation": {h: {str(t): row for t, row in by_t.items()} for h, by_t in validation_rows.items()}}
    (run_dir / "best_temperature.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def temperature_control(args: Any, out: Path, runs: list[dict[str, Any]], harnesses: list[str],
                        t0: float) -> list[str]:
    """The SFT model of each seed evaluated at the temperature its RL model's final-norm scale implies."""
    temps = {}
    for seed in args.seeds:
        sft, rl = norm_scale(out / f"seed{seed}" / "sft_model"), norm_scale(out / f"seed{seed}" / "rl_model")
        temps[seed] = (sft, rl, round(sft / rl, 3))
    run_all(list(args.seeds), args.jobs, out, lambda seed: recipe_command(args.config, [
        f"seed={seed}", f"output_dir={out / f'seed{seed}' / 'control'}",
        f"model.path={out / f'seed{seed}' / 'sft_model'}", "sft.enabled=false", "rl.enabled=false",
        f"eval.temperature={temps[seed][2]}", *args.overrides]), "control.log", t0,
        run_dir=lambda seed: out / f"seed{seed}" / "control")
    controls = [json.loads((out / f"seed{s}" / "control" / "results.json").read_text()) for s in args.seeds]
    lines = ["final-norm scale SFT -> RL (temperature): " + ", ".join(
        f"seed {s} {a:.3f} -> {b:.3f} ({t})" for s, (a, b, t) in temps.items()), "",
        "| harness | SFT at T=1 | SFT at the RL temperature | RL at T=1 |", "|---|---|---|---|"]

    for harness in harnesses:
        lines.append(f"| {harness} | {mean_std([r['results']['sft'][harness]['success'] for r in runs], each=3)} | "
                     f"{mean_std([c['results']['base'][harness]['success'] for c in controls], each=3)} | "
                     f"{mean_std([r['results']['rl'][harness]['success'] for r in runs], each=3)} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, config="claw_tiny.yaml", out="claw_learning")
    parser.add_argument("--reuse", action="store_true", help="keep finished seeds' results instead of rerunning")
    parser.add_argument("--temperature-control", action="store_true",
                        help="also evaluate each SFT model at the temperature its RL model's final norm implies")
    parser.add_argument("--temperatures", type=lambda text: [float(t) for t in text.split(",")],
                        default=list(TEMPERATURE_GRID), help="the comma-separated grid the SFT model's best "
                        f"temperature is searched on (default {','.join(map(str, TEMPERATURE_GRID))})")
    parser.add_argument("--no-best-temperature", action="store_true",
                        help="skip the SFT-at-its-best-temperature baseline")
    parser.add_argument("--search-seed", type=int, help=argparse.SUPPRESS)  # one seed's search, in its own process
    args = parser.parse_args()
    if any(not t > 0 for t in args.temperatures):
        raise SystemExit(f"--temperatures must all be > 0, got {args.temperatures}")
    if args.search_seed is not None:
        import asyncio

        asyncio.run(search_temperature(args, args.search_seed))
        return 0
    out = Path(args.out)
    t0 = time.monotonic()
    pending = [s for s in args.seeds if not (args.reuse and (out / f"seed{s}" / "results.json").exists())]
    run_all(pending, args.jobs, out, lambda seed: recipe_command(args.config, [
        f"seed={seed}", f"output_dir={out / f'seed{seed}'}", *args.overrides]), "stdout.log", t0,
        run_dir=lambda seed: out / f"seed{seed}")
    runs = [json.loads((out / f"seed{seed}" / "results.json").read_text()) for seed in args.seeds]
    best: list[dict[str, Any]] = []
    if not args.no_best_temperature:
        pending = [s for s in args.seeds if not (args.reuse and (out / f"seed{s}" / "best_temperature.json").exists())]
        run_all(pending, args.jobs, out, lambda seed: [
            sys.executable, str(Path(__file__).resolve()), "--search-seed", str(seed), "--config", args.config,
            "--out", str(out), "--temperatures", ",".join(map(str, args.temperatures)), *args.overrides],
            "best_temperature.log", t0)
        best = [json.loads((out / f"seed{seed}" / "best_temperature.json").read_text()) for seed in args.seeds]

    if best:
        for r, b in zip(runs, best, strict=True):
            r["results"]["sft@best T"] = b["heldout"]
    # sft_best_t: the recipe's own row (rl.start_temperature.search, as claw_smollm2.yaml runs it): the SFT policy
    # folded to its best validation temperature, the start RL is compared with
    stages = [s for s in ("base", "sft", "sft@best T", "sft_best_t", "rl") if all(s in r["results"] for r in runs)]
    harnesses = sorted({h for r in runs for s in stages for h in r["results"][s]})
    metrics = [k for k in next(iter(runs[0]["results"][stages[0]].values())) if k not in ("tasks", "env_errors")]
    lines = [f"machine: {machine()}", f"seeds: {args.seeds}; config: {Path(args.config).name} "
             f"{' '.join(args.overrides)}; wall per seed: {np.mean([r['wall_s'] for r in runs]):.0f} s "
             f"({args.jobs} at once; this invocation's runs {time.monotonic() - t0:.0f} s"
             f"{', finished seeds reused' if args.reuse else ''})", "",
             "| harness | stage | " + " | ".join(metrics) + " | env errors |",
             "|---|---|" + "---|" * (len(metrics) + 1)]
    for harness in harnesses:
        for stage in stages:
            rows = [r["results"][stage][harness] for r in runs]
            cells = [mean_std([row[m] for row in rows]) for m in metrics]
            errors = sum(row["env_errors"] for row in rows)
            lines.append(f"| {harness} | {stage} | " + " | ".join(cells) + f" | {errors:.0f} |")
    lines.append("")
    if best:
        lines.append("best temperature on the validation split (per seed): " + "; ".join(
            f"{h} {', '.join(str(b['temperature'][h]) for b in best)}" for h in harnesses))
    for baseline in ("sft", "sft@best T", "sft_best_t"):
        for harness in harnesses:
            if baseline not in stages or "rl" not in stages:
                continue
            gain, spread = gain_and_spread([r["results"][baseline][harness]["success"] for r in runs],
                                           [r["results"]["rl"][harness]["success"] for r in runs])
            verdict = "beyond the spread" if gain.mean() > spread else "NOT beyond the spread"
            lines.append(f"{harness}: RL - {baseline} success = {gain.mean():+.3f} (per seed "
                         f"{np.round(gain, 3).tolist()}), spread across seeds {spread:.3f} -> {verdict}")
    if args.temperature_control:
        lines += ["", *temperature_control(args, out, runs, harnesses, t0)]
    publish(out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
