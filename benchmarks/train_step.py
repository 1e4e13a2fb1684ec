"""Tokens per second of one training step (forward, backward, optimizer) with orchard.train.Trainer.

Question: what does a full step cost, and what do the fused action log-probs and micro-batching change?
Every row runs the same global batch through ``Trainer.train_step``; the baseline row scores log-probs from the
full ``[B, T, V]`` logits (``log_softmax`` + gather), the others use the default fused ``action_logprobs``.

CPU (default; a tiny Qwen3, plain-torch engine)::

    .venv/bin/python benchmarks/train_step.py

GPU (benchmarks/gpu_check.sh): a Qwen3-1.7B-shaped model with random weights, one 8K-token sequence, bf16,
DeepSpeed ZeRO-2 on one GPU, gradient checkpointing; it also reports model FLOPs utilisation::

    python benchmarks/train_step.py --qwen3-1p7b --device cuda --tokens 8192 --peak-tflops 989

MFU = achieved model FLOP/s / peak, with model FLOPs per step = 6 · N · tokens + 6 · L · T² · d_attn · B (the
dense weights N without the embedding lookup, forward + backward; causal attention scores and values, half of
the full 12 · L · T² · d_attn); recomputation by checkpointing is not counted as useful work.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchard.train.objective import LossTerm  # noqa: E402
from orchard.train.tiny import tiny_qwen3_config  # noqa: E402
from orchard.train.trainer import OptimConfig, TrainConfig, Trainer  # noqa: E402


def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        return sha or "unknown"
    except OSError:
        return "unknown"


def machine(device: str) -> str:
    if device == "cuda":
        where = torch.cuda.get_device_name(0)
    else:
        where = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {os.cpu_count()} cores"
    return f"{where}; torch {torch.__version__}; python {platform.python_version()}"


def logits_logprobs(module: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Baseline: full logits, log-softmax, gather (what a trainer without the fused path does)."""
    lm = getattr(module, "lm", None) or module.module.lm
    logits = lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # [B, T, V]
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return torch.nn.functional.pad(lp, (1, 0))


def make_batch(B: int, T: int, vocab: int, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tokens; actions are the second half of each row (an agent turn after its observation)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=gen)
    action = torch.zeros(B, T, dtype=torch.bool)
    action[:, T // 2 :] = True
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones(B, T, dtype=torch.long),
        "action_mask": action,
        "old_logprobs": torch.where(action, -torch.rand(B, T, generator=gen) * 2, torch.zeros(())),
        "advantages": torch.randn(B, 1, generator=gen) * action.float(),
    }
    return {k: v.to(device) for k, v in batch.items()}


def model_flops(config, B: int, T: int) -> float:
    """Useful FLOPs of one forward + backward (formula in the module docstring)."""
    H, L = config.hidden_size, config.num_hidden_layers
    d_attn = config.num_attention_heads * config.head_dim
    d_kv = config.num_key_value_heads * config.head_dim
    per_layer = H * d_attn + 2 * H * d_kv + d_attn * H + 3 * H * config.intermediate_size
    n_dense = L * per_layer + H * config.vocab_size  # the lm head is a matmul, the embedding lookup is not
    return 6.0 * n_dense * B * T + 6.0 * L * T * T * d_attn * B


def run(label: str, config, cfg_kw: dict, batch: dict, *, baseline: bool, device: str, warmup: int,
        repeats: int, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    if cfg_kw.pop("checkpointing", False):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(total_steps=warmup + repeats, output_dir=out, objective=[LossTerm("policy")],
                          optim=OptimConfig(lr=1e-6, min_lr=1e-7), **cfg_kw)
        trainer = Trainer(model, cfg, logprob_fn=logits_logprobs if baseline else None)
        times = []
        for i in range(warmup + repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            trainer.train_step(batch)
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        trainer.close()
    times.sort()
    median = times[len(times) // 2]
    tokens = int(batch["attention_mask"].sum())
    row = {"label": label, "s_per_step": median, "tokens_per_s": tokens / median}
    if device == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--qwen3-1p7b", action="store_true", help="Qwen3-1.7B shape, bf16, ZeRO-2 (GPU)")
    p.add_argument("--tokens", type=int, default=8192, help="sequence length in --qwen3-1p7b mode")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (CPU mode)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence (CPU mode)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H200 SXM: 989)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    if args.qwen3_1p7b:
        from transformers import Qwen3Config

        config = Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                             num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                             max_position_embeddings=40960, attn_implementation="sdpa")
        try:
            import flash_attn  # noqa: F401

            config._attn_implementation = "flash_attention_2"
        except ImportError:
            pass
        batch = make_batch(1, args.tokens, config.vocab_size, args.device)
        common = dict(global_batch_size=1, micro_batch_size=1, engine="deepspeed", zero_stage=2, dtype="bfloat16",
                      checkpointing=True)
        row = run("qwen3-1.7b-shape zero2 bf16 fused", config, dict(common), batch, baseline=False,
                  device=args.device, warmup=args.warmup, repeats=args.repeats, dtype=torch.bfloat16)
        flops = model_flops(config, 1, args.tokens)
        row["mfu"] = flops / row["s_per_step"] / (args.peak_tflops * 1e12)
        rows.append(row)
        base = row
    else:
        config = tiny_qwen3_config(1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   attn_implementation="sdpa")
        batch = make_batch(args.batch, args.seq, config.vocab_size, args.device)
        kw = dict(global_batch_size=args.batch, engine="plain")
        base = run("baseline: full logits, micro=B", config, dict(kw, micro_batch_size=args.batch), batch,
                   baseline=True, device=args.device, warmup=args.warmup, repeats=args.repeats, dtype=torch.float32)
        rows.append(base)
        for label, extra in (("fused action log-probs, micro=B", dict(micro_batch_size=args.batch)),
                             ("fused, micro=B/4", dict(micro_batch_size=max(1, args.batch // 4))),
                             ("fused, micro=B, checkpointing", dict(micro_batch_size=args.batch, checkpointing=True))):
            rows.append(run(label, config, dict(kw, **extra), batch, baseline=False, device=args.device,
                            warmup=args.warmup, repeats=args.repeats, dtype=torch.float32))
    tokens = int(batch["attention_mask"].sum())
    print(f"machine: {machine(args.device)}")
    print(f"commit: {commit()}    tokens/step: {tokens}    repeats: {args.repeats} (median)")
    head = f"| {'configuration':<36} | {'s/step':>8} | {'tokens/s':>10} | {'vs baseline':>11} |"
    extra_cols = [c for c in ("peak_mem_gib", "mfu") if c in rows[0]]
    head += "".join(f" {c:>12} |" for c in extra_cols)
    print(head)
    print("|" + "|".join("-" * (len(c) - 0) for c in head.split("|")[1:-1]) + "|")
    for r in rows:
        line = (f"| {r['label']:<36} | {r['s_per_step']:>8.4f} | {r['tokens_per_s']:>10.0f} | "
                f"{r['tokens_per_s'] / base['tokens_per_s']:>10.2f}x |")
        line += "".join(f" {r[c]:>12.3f} |" for c in extra_cols)
        print(line)


if __name__ == "__main__":
    main()
