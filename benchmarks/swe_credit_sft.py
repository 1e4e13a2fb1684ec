"""Does credit-assigned SFT beat resolved-only SFT on held-out SWE instances, beyond the spread across seeds?

Four arms, one teacher dataset per seed (the recipe's config: toy instances, the scripted teacher, 5 attempts per
task with failures kept, the scripted value teacher), each arm trained from the same initial model:

- ``resolved``: the resolved trajectories, every action token (the recipe's ``sft_mode=resolved``);
- ``credit``: those plus the credit runs of failed trajectories (``sft_mode=credit``; the paper: 59.3 -> 61.2 on
  SWE-bench Verified);
- ``control``: the resolved ones plus as many extra resolved trajectories as ``credit`` adds failed ones (the
  control the paper lacks: does credit help by its content, or by being more data?). The extras are careful
  attempts of the same teacher (``failure_rate=0``) on the same train instances; the scripted teacher's careful
  attempts of one instance are near-identical, so at this scale the control amounts to repeating resolved
  examples;
- ``all``: every valid trajectory unmasked (``sft_mode=all``).

Each arm's model is evaluated on the held-out instances on every harness of ``eval.harnesses``, the held-out
``eval`` convention included (transfer to a harness never trained on). Prints a markdown table of mean ± std of
the resolve rate over seeds and writes ``summary.json`` / ``summary.md`` (one ``seed<N>.json`` per seed) under
``--out``.

    python benchmarks/swe_credit_sft.py [--seeds 0 1 2] [--jobs 3] [--quick] [key=value ...]

``key=value`` overrides go to the recipe's config (``recipes/configs/swe_tiny.yaml`` by default). ``--quick`` is a
smoke: two templates, level 1, 2 train instances per template, 2 teacher attempts, one epoch.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _seeds import Launch, add_run_arguments, gain_and_spread, machine, mean_std, publish, run_launches

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("resolved", "credit", "control", "all")
QUICK = ["instances.templates=[inventory, ledger]", "instances.levels=[1]", "instances.train_per_template=2",
         "instances.heldout_per_template=1", "teacher.attempts=2", "sft.epochs=1", "rollout.max_steps=6",
         "rollout.max_tokens=64", "sft.train.global_batch_size=4"]


def recipe_module() -> Any:
    """recipes/swe.py as a module, for its config: the benchmark composes the stages itself (one teacher dataset,
    four arms)."""
    spec = importlib.util.spec_from_file_location("swe_recipe", ROOT / "recipes/swe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["swe_recipe"] = module
    spec.loader.exec_module(module)
    return module


async def one_seed(cfg: Any, out: Path) -> dict[str, Any]:
    """The teacher's dataset once, then each arm: a fresh model, SFT, held-out evaluation."""
    import torch

    from orchard import stages
    from orchard.domains.swe.corpus import tokenizer_corpus
    from orchard.domains.swe.harnesses import swe_harnesses
    from orchard.domains.swe.pools import instance_pools
    from orchard.domains.swe.sandbox import sandbox_options, shared_folders
    from orchard.domains.swe.teacher import SWETeacherEngine, teacher_trajectories
    from orchard.domains.swe.values import hindsight_values
    from orchard.stages.policy import load_policy, make_engine

    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    train, _, heldout = instance_pools(**asdict(cfg.instances))  # SFT arms only: the RL pool unused
    moved = stages.prepare_output_dir(out, "move")  # a rerun keeps the earlier one, aside
    log = stages.RunLog(out)
    if moved is not None:
        log.print(f"the previous run in {out} moved to {moved}")
    _, tokenizer = load_policy(cfg.model, tokenizer_corpus([*train, *heldout]), seed=cfg.seed)
    result: dict[str, Any] = {"seed": cfg.seed, "arms": {}, "counts": {}}
    r = cfg.rollout
    async with stages.pooled_sandboxes(cfg.env_url, shared=shared_folders(), cpu=cfg.sandbox_cpu,
                                       memory=cfg.sandbox_memory, max_pool=cfg.env_pool,
                                       pool_options=sandbox_options()) as sandboxes:  # the recipe's: a pool per stage
        harnesses = swe_harnesses(sandboxes, tokenizer, max_steps=r.max_steps, max_tokens=r.max_tokens,
                                  max_time_s=r.max_time_s, concurrency=r.concurrency, seed=cfg.seed)

        async def teach(failure_rate: float, seed: int, attempts: int) -> list[Any]:
            teacher = SWETeacherEngine(tokenizer, train, failure_rate=failure_rate, seed=seed)
            async with sandboxes.stage(len(train) * attempts):
                return [t for h in cfg.harnesses for t in await teacher_trajectories(
                    harnesses[h], teacher, train, attempts=attempts)]

        trajectories = await teach(cfg.teacher.failure_rate, cfg.seed, cfg.teacher.attempts)
        values = await hindsight_values(trajectories, tokenizer, estimator=cfg.values.url, model=cfg.values.model)
        arm_samples: dict[str, list[Any]] = {}
        for mode in ("resolved", "credit", "all"):
            arm_samples[mode], stats = stages.sft_samples(trajectories, mode=mode, eps=cfg.values.eps,
                                                          step_values=lambda t: values.get(id(t)))
            if mode == "credit":
                result["counts"] = {k.split("/")[1]: v for k, v in stats.items()}
        extra_needed = int(result["counts"]["credit_trajectories"])
        per_instance = math.ceil(extra_needed / (len(train) * len(cfg.harnesses))) if extra_needed else 0
        extra = [t for t in await teach(0.0, cfg.seed + 1, per_instance) if t.valid and (t.reward or 0) > 0] \
            if per_instance else []
        arm_samples["control"] = arm_samples["resolved"] + [s for t in extra[:extra_needed] for s in t.samples]
        result["counts"]["control_extra"] = min(len(extra), extra_needed)
        log.print("teacher: " + " ".join(f"{k}={v:.0f}" for k, v in result["counts"].items()))
        for arm in ARMS:
            model, _ = load_policy(cfg.model, tokenizer_corpus([*train, *heldout]), seed=cfg.seed)
            history = stages.sft_stage(model, arm_samples[arm], cfg.sft, pad_id=tokenizer.pad_token_id,
                                       seed=cfg.seed, output_dir=str(out / arm))
            engine = make_engine(cfg.model, model, tokenizer, seed=cfg.seed)
            try:
                async with sandboxes.stage(len(heldout) * cfg.eval.attempts):
                    rows = await stages.evaluate_stage(arm, len(history), harnesses, engine, heldout, cfg.eval,
                                                       log)
            finally:
                await engine.close()
            result["arms"][arm] = {"samples": len(arm_samples[arm]), "steps": len(history), "eval": rows}
    log.close()
    result["wall_s"] = log.elapsed_s
    return result


def run_seeds(args: Any, out: Path) -> None:
    """Each seed as its own process (its own embedded sandbox service), ``--jobs`` at once."""
    run_launches([Launch(seed, f"seed {seed}", [
        sys.executable, __file__, "--one-seed", str(seed), "--out", str(out), "--config", args.config,
        *(["--quick"] if args.quick else []), *args.overrides], out / f"seed{seed}.log") for seed in args.seeds],
        jobs=args.jobs, t0=time.monotonic())


def summarize(args: Any, out: Path, t0: float) -> str:
    runs = [json.loads((out / f"seed{s}.json").read_text()) for s in args.seeds]
    harnesses = list(runs[0]["arms"]["resolved"]["eval"])

    def rates(arm: str, harness: str) -> np.ndarray:
        return np.array([r["arms"][arm]["eval"][harness]["success"] for r in runs])

    lines = [f"machine: {machine()}",
             f"seeds: {args.seeds}; config: {Path(args.config).name} {'--quick ' if args.quick else ''}"
             f"{' '.join(args.overrides)}; wall per seed {np.mean([r['wall_s'] for r in runs]):.0f} s, "
             f"{args.jobs} at once, {time.monotonic() - t0:.0f} s in all", "",
             "held-out resolve rate, mean ± std over seeds (`eval` is the harness never trained on):", "",
             "| arm | samples | " + " | ".join(harnesses) + " |", "|---|---|" + "---|" * len(harnesses)]
    for arm in ARMS:
        samples = np.mean([r["arms"][arm]["samples"] for r in runs])
        lines.append(f"| {arm} | {samples:.0f} | " + " | ".join(mean_std(rates(arm, h)) for h in harnesses) + " |")
    counts = {k: np.mean([r["counts"][k] for r in runs]) for k in runs[0]["counts"]}
    lines += ["", "teacher per seed (mean): " + ", ".join(f"{k} {v:.1f}" for k, v in counts.items()), ""]
    for h in harnesses:
        gain, spread = gain_and_spread(rates("resolved", h), rates("credit", h))
        verdict = "above the spread" if gain.mean() > spread else "NOT above the spread"
        lines.append(f"{h}: credit - resolved = {gain.mean():+.3f} (per seed {np.round(gain, 3).tolist()}), "
                     f"spread {spread:.3f} -> {verdict}")
    (out / "summary.json").write_text(json.dumps({"machine": machine(), "seeds": args.seeds, "quick": args.quick,
                                                  "overrides": args.overrides, "runs": runs}, indent=1))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, config="swe_tiny.yaml", out="swe_credit_sft")
    parser.add_argument("--quick", action="store_true", help="a smoke: tiny pools, one epoch")
    parser.add_argument("--one-seed", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be >= 1, got {args.jobs}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.one_seed is not None:
        from orchard.train.config import load_config

        swe = recipe_module()
        overrides = [*(QUICK if args.quick else []), *args.overrides, f"seed={args.one_seed}",
                     f"output_dir={out / f'seed{args.one_seed}'}"]
        cfg = load_config(swe.SWEConfig, args.config, overrides, derived=swe.DERIVED)
        cfg = replace(cfg, sft=replace(cfg.sft, enabled=True))
        result = asyncio.run(one_seed(cfg, Path(cfg.output_dir)))
        (out / f"seed{args.one_seed}.json").write_text(json.dumps(result, indent=1))
        return 0
    t0 = time.monotonic()
    run_seeds(args, out)
    publish(out, [summarize(args, out, t0)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
