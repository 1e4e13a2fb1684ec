"""SFT speed and memory: orchard's `Trainer` against TRL's `SFTTrainer` on the same data, parameters and batch.

Question (issue 31): on a real model on the CPU, how many tokens per second does orchard's SFT step train, at what
peak memory, against TRL's ``SFTTrainer`` doing the same work, for full fine-tuning and for LoRA, and do both
follow the same loss curve?

Data: the Claw recipe's SFT demonstrations (`recipes/configs/claw_smollm2.yaml`: the scripted teacher's episodes
through the react and text harnesses against the embedded sandbox service, rendered with ``--model``'s tokenizer,
left-truncated to ``--max-len``), shuffled once with ``--seed`` and repeated to exactly ``--steps`` x ``--batch``
sequences, which both trainers read in that order. Only the assistant's tokens are supervised: orchard's ``sft``
objective on the action mask, TRL's ``completion_only_loss`` on a ``completion_mask`` column equal to it. Both take
the token mean over the whole global batch, so the curves must agree within float noise.

Setup, the same for both: fp32 on the CPU, ``--batch`` sequences per optimizer step in micro-batches of
``--micro`` (TRL: ``gradient_accumulation_steps`` = batch / micro), AdamW (0.9, 0.999, eps 1e-8, no weight
decay), constant lr ``--lr``, gradient clip 1.0, activation checkpointing only with ``--gradient-checkpointing``
(TRL's default is on; here it follows the flag). Each trainer pads each micro-batch to its longest row, as each
does by default; neither packs. LoRA rows: orchard's ``TrainConfig.lora`` and TRL's peft ``LoraConfig`` with the
same rank, alpha, dropout 0 and target modules. orchard's trainer has no bf16 autocast option, so there is no bf16
row (a CPU bf16 autocast forward + backward measured ~25x slower than fp32 on the 2-core machine).

Each (trainer, mode) runs in its own process, one after another, so peak memory (max RSS) is that arm's alone.
Tokens/s are the sequences' tokens (supervised: the action tokens; total: every non-pad token) over the wall time
from the start of the training loop to its last step, model loading excluded.

    python benchmarks/sft_speed.py                                   # SmolLM2-135M-Instruct, 8 steps of 8, full + LoRA
    python benchmarks/sft_speed.py --steps 2 --batch 2 --micro 1 --max-len 256     # a smoke run
    python benchmarks/sft_speed.py --modes lora --rank 8 --alpha 16 --model /path/to/checkpoint
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from env_latency import machine  # noqa: E402

from orchard.train.lora import LORA_TARGETS  # noqa: E402

TRAINERS = ("orchard", "trl")
MODES = ("full", "lora")


def claw_demonstrations(model: str, max_len: int) -> tuple[list[Any], int]:
    """The Claw recipe's SFT samples (its SmolLM2 config's tasks and harnesses, the scripted teacher), rendered with
    ``model``'s tokenizer and left-truncated to ``max_len``; returns them and the pad id."""
    sys.path.insert(0, str(ROOT / "recipes"))
    from claw import DERIVED, ClawConfig, claw_harnesses, task_pools

    from orchard import stages
    from orchard.data import truncate_sample
    from orchard.domains.claw.teacher import TeacherEngine
    from orchard.env import AsyncSandboxClient
    from orchard.models.pretrained import load_chat_tokenizer
    from orchard.stages.sandboxes import sandbox_service
    from orchard.train.config import load_config

    cfg = load_config(ClawConfig, ROOT / "recipes/configs/claw_smollm2.yaml", derived=DERIVED)
    tokenizer = load_chat_tokenizer(model)

    async def demonstrations() -> list[Any]:
        train, _, _ = task_pools(cfg)
        tasks = list({t.prompt: t for t in reversed(train)}.values())[::-1]  # one per distinct request, as claw.py
        with sandbox_service(None) as env:
            async with AsyncSandboxClient(*env) as client:
                harnesses = claw_harnesses(cfg, tokenizer, client)
                samples, _ = await stages.demonstrations({h: harnesses[h] for h in cfg.harnesses},
                                                         TeacherEngine(tokenizer, tasks), tasks)
                return samples

    samples = asyncio.run(demonstrations())
    return [truncate_sample(s, max_len) for s in samples], int(tokenizer.pad_token_id)


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux reports KiB


def current_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 2**30
    return float("nan")


def run_orchard(args: argparse.Namespace, samples: list[Any], pad_id: int, out: str) -> dict[str, Any]:
    from orchard.data import collate
    from orchard.train.lora import LoraConfig
    from orchard.train.model import load_causal_lm
    from orchard.train.trainer import OptimConfig, TrainConfig, Trainer

    model = load_causal_lm(args.model, dtype="float32", gradient_checkpointing=args.gradient_checkpointing)
    lora = LoraConfig(enabled=args.mode == "lora", rank=args.rank, alpha=args.alpha, target_modules=args.targets)
    cfg = TrainConfig(total_steps=args.steps, global_batch_size=args.batch, micro_batch_size=args.micro,
                      seed=args.seed, output_dir=out, resume=False, progress_interval_s=1e9, lora=lora,
                      optim=OptimConfig(lr=args.lr, min_lr=args.lr, warmup_steps=0, grad_clip=1.0))
    trainer = Trainer(model, cfg)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    rss_start = current_rss_gib()
    start = time.perf_counter()
    history = trainer.fit(samples, partial(collate, pad_id=pad_id), shuffle=False)
    wall = time.perf_counter() - start
    trainer.close()
    return {"losses": [h["loss/total"] for h in history], "wall_s": wall, "trainable": trainable,
            "step_s": [h["perf/step_time_s"] for h in history], "rss_start_gib": rss_start}


def run_trl(args: argparse.Namespace, samples: list[Any], pad_id: int, out: str) -> dict[str, Any]:
    import peft
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from orchard.models.pretrained import load_chat_tokenizer
    from orchard.train.model import load_causal_lm

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.start, self.ends, self.begins = 0.0, [], []

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            self.start = time.perf_counter()

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.begins.append(time.perf_counter())

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.ends.append(time.perf_counter())

    model = load_causal_lm(args.model, dtype="float32", gradient_checkpointing=args.gradient_checkpointing)
    tokenizer = load_chat_tokenizer(args.model)
    data = Dataset.from_dict({"input_ids": [s.input_ids.tolist() for s in samples],
                              "completion_mask": [s.action_mask.int().tolist() for s in samples]})
    config = SFTConfig(
        output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=args.batch // args.micro, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, gradient_checkpointing=args.gradient_checkpointing, bf16=False, fp16=False, use_cpu=True,
        completion_only_loss=True, max_length=None, train_sampling_strategy="sequential", seed=args.seed,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
    )
    lora = None
    if args.mode == "lora":
        lora = peft.LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0, target_modules=args.targets,
                               bias="none", task_type="CAUSAL_LM")
    clock = Clock()
    torch.manual_seed(args.seed)  # the adapters' initialisation draws from torch's generator, as orchard's does
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer, peft_config=lora,
                         callbacks=[clock])
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    rss_start = current_rss_gib()
    trainer.train()
    logs = [row for row in trainer.state.log_history if "loss" in row]
    return {"losses": [float(row["loss"]) for row in logs], "wall_s": clock.ends[-1] - clock.start,
            "trainable": trainable, "step_s": [e - b for b, e in zip(clock.begins, clock.ends, strict=True)],
            "rss_start_gib": rss_start, "trl_num_tokens": logs[-1].get("num_tokens")}


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    data = torch.load(args.data, weights_only=False)
    run = run_orchard if args.worker == "orchard" else run_trl
    with tempfile.TemporaryDirectory() as out:
        result = run(args, data["samples"], data["pad_id"], str(Path(out) / f"{args.worker}_{args.mode}"))
    result["peak_rss_gib"] = peak_rss_gib()
    Path(args.result).write_text(json.dumps(result))


def arm_command(args: argparse.Namespace, trainer: str, mode: str, data: Path, result: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", trainer, "--mode", mode, "--data", str(data),
            "--result", str(result), "--model", args.model, "--steps", str(args.steps), "--batch", str(args.batch),
            "--micro", str(args.micro), "--lr", str(args.lr), "--rank", str(args.rank), "--alpha", str(args.alpha),
            "--threads", str(args.threads), "--seed", str(args.seed), "--targets", *args.targets,
            *(["--gradient-checkpointing"] if args.gradient_checkpointing else [])]


def report(args: argparse.Namespace, results: dict[tuple[str, str], dict[str, Any]], supervised: int, total: int,
           n_samples: int) -> None:
    info = machine()
    print(f"machine: {info['machine']}; python {info['python']}; torch {torch.__version__}; "
          f"{args.threads} threads")
    print(f"commit: {info['commit']}    model: {args.model}    data: {n_samples} Claw teacher samples, "
          f"{args.steps} steps x {args.batch} sequences (micro {args.micro}), {supervised} supervised / {total} "
          f"tokens    fp32, lr {args.lr}, checkpointing {'on' if args.gradient_checkpointing else 'off'}, "
          f"LoRA r={args.rank} alpha={args.alpha} on {','.join(args.targets)}")
    head = (f"| {'mode':<5} | {'trainer':<7} | {'trainable':>11} | {'sup. tok/s':>10} | {'total tok/s':>11} | "
            f"{'s/step':>7} | {'RSS start GiB':>13} | {'peak RSS GiB':>12} | {'final loss':>10} |")
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    for (trainer, mode), r in results.items():
        print(f"| {mode:<5} | {trainer:<7} | {r['trainable']:>11,} | {supervised / r['wall_s']:>10.1f} | "
              f"{total / r['wall_s']:>11.1f} | {r['wall_s'] / args.steps:>7.2f} | {r['rss_start_gib']:>13.2f} | "
              f"{r['peak_rss_gib']:>12.2f} | {r['losses'][-1]:>10.4f} |")
    print("\norchard / TRL (speed: > 1 is faster; memory: < 1 is smaller):")
    for mode in args.modes:
        o, t = results.get(("orchard", mode)), results.get(("trl", mode))
        if o is None or t is None:
            continue
        gap = max(abs(a - b) for a, b in zip(o["losses"], t["losses"], strict=True))
        print(f"  {mode:<5} tokens/s {t['wall_s'] / o['wall_s']:.2f}x   peak RSS {o['peak_rss_gib'] / t['peak_rss_gib']:.2f}x"
              f"   max |loss gap| over steps {gap:.2e}   trainable params equal: {o['trainable'] == t['trainable']}"
              f"   TRL counted {t.get('trl_num_tokens')} tokens")
    if "full" in args.modes and "lora" in args.modes and ("orchard", "full") in results:
        f, lo = results[("orchard", "full")], results[("orchard", "lora")]
        print(f"  orchard LoRA / full: tokens/s {f['wall_s'] / lo['wall_s']:.2f}x   "
              f"peak RSS {lo['peak_rss_gib'] / f['peak_rss_gib']:.2f}x")
    print("  bf16 autocast: not measured (orchard's trainer has no autocast option)")
    print("\nloss per step:")
    keys = list(results)
    print("| step | " + " | ".join(f"{t} {m}" for t, m in keys) + " |")
    for i in range(args.steps):
        print(f"| {i + 1:>4} | " + " | ".join(f"{results[k]['losses'][i]:.5f}" for k in keys) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a named pretrained checkpoint or a directory")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--micro", type=int, default=4, help="sequences per forward / backward")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--max-len", type=int, default=8192, help="left-truncate longer samples to this many tokens")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--targets", nargs="+", default=list(LORA_TARGETS), help="LoRA target modules")
    p.add_argument("--gradient-checkpointing", action="store_true", help="for both trainers")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "runs" / "sft_speed"), help="data, logs and results.json")
    p.add_argument("--worker", choices=TRAINERS, help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.batch % args.micro:
        p.error(f"--batch ({args.batch}) must be a multiple of --micro ({args.micro})")
    missing = [name for name in ("trl", "peft") if importlib.util.find_spec(name) is None]
    if missing:  # checked before the orchard arm, not after it has run for minutes
        p.error(f"{' and '.join(missing)} not installed: pip install 'orchard-rl[bench]'")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    samples, pad_id = claw_demonstrations(args.model, args.max_len)
    random.Random(args.seed).shuffle(samples)
    rows = [samples[i % len(samples)] for i in range(args.steps * args.batch)]
    data = out / "data.pt"
    torch.save({"samples": rows, "pad_id": pad_id}, data)
    supervised = sum(int(s.action_mask.sum()) for s in rows)
    total = sum(int(s.input_ids.numel()) for s in rows)
    results: dict[tuple[str, str], dict[str, Any]] = {}
    for mode in args.modes:
        for trainer in TRAINERS:
            result, log = out / f"{trainer}_{mode}.json", out / f"{trainer}_{mode}.log"
            print(f"+ {trainer} {mode} (log: {log})", flush=True)
            with log.open("w") as f:
                code = subprocess.run(arm_command(args, trainer, mode, data, result), stdout=f,
                                      stderr=subprocess.STDOUT).returncode
            if code:
                sys.exit(f"{trainer} {mode} failed with exit status {code}:\n{log.read_text()[-3000:]}")
            results[(trainer, mode)] = json.loads(result.read_text())
    (out / "results.json").write_text(json.dumps(
        {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "mode", "data", "result")},
         "machine": machine(), "supervised_tokens": supervised, "total_tokens": total,
         "arms": {f"{t}_{m}": r for (t, m), r in results.items()}}, indent=1))
    report(args, results, supervised, total, len(samples))


if __name__ == "__main__":
    main()
