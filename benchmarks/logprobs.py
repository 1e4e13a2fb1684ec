"""How much time and memory does scoring sampled tokens cost, with and without materialising the logits?

Forward + backward of ``Σ_i log p(y_i)`` from hidden states ``[N, H]`` and an lm head ``[V, H]`` (gradients to
both), for each of:

    naive    logits = hidden @ W.T;  log_softmax(logits.float()).gather(labels)     the baseline
    chunked  logits = hidden @ W.T;  orchard.losses.token_logprobs(logits, labels)  chunked upcast, logits kept
    fused    orchard.losses.fused_token_logprobs(hidden, W, labels)                 no [N, V] tensor at all
    fused_loss  orchard.losses.fused_token_loss(hidden, W, labels, token_loss)      one pass: the gradients are
             formed in the forward (token_loss returns logp, so the loss is Σ logp), 3 matmuls instead of 4
    trl      logits = hidden @ W.T;  trl selective_log_softmax(logits, labels)      when trl is installed
    liger    Liger-Kernel fused linear cross-entropy, reduction "sum"               cuda only, when installed

Each case's log-probs, ``hidden.grad`` and every 128th row of ``W.grad`` are compared with naive's (the
``max|Δlogp|`` column, and ``Δgrad`` in the note: max abs difference over the largest reference entry).
Every case runs in a fresh Python process (``--worker``), so one case's allocator state and peak cannot leak
into another's. Peak memory is measured the same way for every case:

    cpu   inputs are allocated and touched, one small warm-up call runs (N ≤ 64 tokens), then the process's
          peak resident set is reset (``echo 5 > /proc/self/clear_refs``, Linux) and the baseline ``VmRSS``
          read. After the measured call, peak = ``VmHWM − baseline`` from ``/proc/self/status``. Where
          clear_refs cannot be written, ``ru_maxrss`` is used instead (then the warm-up's own peak is included).
    cuda  ``torch.cuda.reset_peak_memory_stats()`` after the warm-up; peak = ``max_memory_allocated() −
          memory_allocated()`` at the baseline (tensors only, not the caching allocator's reserve).

Peak includes the gradients the call produces (``W.grad`` is V × H × 4 B = 594 MiB at float32, V = 151,936,
H = 1024), which every case must hold; the ``work`` columns subtract those gradients, leaving what a case needs
beyond its inputs and outputs. ``cpu s`` is the worker's process CPU time (both threads), steadier than the wall
time on a shared machine. The time is the measured call (first after warm-up); with
``--repeats k`` the median of k calls. Cases whose estimated peak exceeds ``--memory-guard-gib`` are skipped
and marked so. Ratios are to ``naive`` at the same N, measured in the same run.

    python benchmarks/logprobs.py                                  # CPU: N = 1024 4096 16384, float32, 2 threads
    python benchmarks/logprobs.py --n 1024 4096                    # only N = 1024 and 4096, every case
    python benchmarks/logprobs.py --n 1024 4096 --cases naive fused fused_loss   # the issue-4 time target
    python benchmarks/logprobs.py --n 1024 --cases naive fused_loss --loss-chunk-size 128   # one chunk size
    python benchmarks/logprobs.py --device cuda --dtype bfloat16 --n 16384 65536 --hidden 4096 \\
        --chunk-size 8192 --vocab-chunk-size 8192 --loss-chunk-size 2048 --repeats 3 --hbm-gbps 4800 \\
        --peak-tflops 989
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from orchard.losses.fused import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_LOSS_CHUNK_SIZE,
    DEFAULT_LOSS_CHUNK_SIZE_CUDA,
    DEFAULT_VOCAB_CHUNK_SIZE,
)

CASES = ("naive", "chunked", "fused", "fused_loss", "trl", "liger")
WEIGHT_GRAD_ROW_STRIDE = 128  # rows of W.grad saved for the comparison with naive (V × H is too big to save)
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ----------------------------------------------------------------------------------------------------- worker


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _make_case(name: str, args: argparse.Namespace):
    """A function (hidden, weight, labels) -> (Σ logp as a differentiable scalar, per-token logp or None)."""
    import torch

    if name == "naive":

        def run(hidden, weight, labels):
            logits = hidden @ weight.T  # [N, V]
            logp = torch.log_softmax(logits.float(), dim=-1).gather(1, labels.unsqueeze(1)).squeeze(1)
            return logp.sum(), logp

    elif name == "chunked":
        from orchard.losses import token_logprobs

        def run(hidden, weight, labels):
            logp = token_logprobs(hidden @ weight.T, labels)
            return logp.sum(), logp

    elif name == "fused":
        from orchard.losses import fused_token_logprobs

        def run(hidden, weight, labels):
            logp = fused_token_logprobs(
                hidden, weight, labels, chunk_size=args.chunk_size, vocab_chunk_size=args.vocab_chunk_size
            )
            return logp.sum(), logp

    elif name == "fused_loss":
        from orchard.losses import fused_token_loss

        def run(hidden, weight, labels):
            logp_out = torch.empty(labels.shape[0], device=hidden.device)

            def token_loss(logp, entropy, index):
                logp_out[index] = logp.detach()  # recorded only for the comparison with naive
                return logp  # the loss is Σ logp, the objective of every other case

            total = fused_token_loss(hidden, weight, labels, token_loss, chunk_size=args.loss_chunk_size)
            return total, logp_out

    elif name == "trl":
        from trl.trainer.utils import selective_log_softmax

        def run(hidden, weight, labels):
            logp = selective_log_softmax(hidden @ weight.T, labels)
            return logp.sum(), logp

    elif name == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum")

        def run(hidden, weight, labels):
            out = loss_fn(weight, hidden, labels)
            loss = out[0] if isinstance(out, tuple) else out
            return -loss, None  # Σ CE = −Σ logp

    else:
        raise ValueError(f"case must be one of {CASES}, got {name!r}")
    return run


def worker(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    n, h, v = args.worker_n, args.hidden, args.vocab
    try:
        run = _make_case(args.worker, args)
    except ImportError as exc:
        return {"status": f"not installed ({exc.name})"}

    gen = torch.Generator(device=device).manual_seed(0)  # drawn where they live: a 4096-wide head is 2.5 GB
    hidden = torch.randn(n, h, generator=gen, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen, device=device) / math.sqrt(h)).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=gen, device=device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def call():
        hidden.grad = weight.grad = None
        total, logp = run(hidden, weight, labels)
        total.backward()
        sync()
        return total, logp

    # warm-up on a few tokens: thread pools, kernel selection, lazy imports
    small = min(n, 64)
    warm_total, _ = run(hidden[:small].detach().requires_grad_(), weight, labels[:small])
    warm_total.backward()
    weight.grad = None
    del warm_total
    sync()

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        method = "cuda max_memory_allocated"
    else:
        reset = _reset_peak_rss()
        baseline_kib = _status_kib("VmRSS") or 0
        baseline = baseline_kib * 1024
        method = "VmHWM after clear_refs" if reset else "ru_maxrss"

    start, cpu_start = time.perf_counter(), time.process_time()
    total, logp = call()
    times = [time.perf_counter() - start]
    cpu_s = time.process_time() - cpu_start

    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - baseline
    elif method == "ru_maxrss":
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    else:
        peak = (_status_kib("VmHWM") or 0) * 1024 - baseline

    for _ in range(args.repeats - 1):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)

    result = {
        "status": "ok",
        "time_s": statistics.median(times),
        "cpu_s": cpu_s,
        "peak_bytes": peak,
        "method": method,
        "sum_logp": float(total.detach()),
    }
    if args.logp_out:
        saved = {
            "hidden_grad": hidden.grad.float().cpu(),
            "weight_grad_rows": weight.grad[::WEIGHT_GRAD_ROW_STRIDE].float().cpu(),
        }
        if logp is not None:
            saved["logp"] = logp.detach().float().cpu()
        torch.save(saved, args.logp_out)
    return result


# ------------------------------------------------------------------------------------------------------ driver


def gradient_bytes(n: int, h: int, v: int, dtype_bytes: int) -> int:
    """Bytes of hidden.grad and W.grad: what every case must hand back, and so part of every peak."""
    return (n + v) * h * dtype_bytes


def estimate_peak_bytes(case: str, n: int, h: int, v: int, dtype_bytes: int, args: argparse.Namespace) -> int:
    """A guess of a case's peak with some margin, only to skip what cannot fit (not a measurement).

    Per logit, float32 on this CPU at N = 4096 the measured peaks beyond the gradients were about 11 B (naive and
    chunked) and 12 B (trl); the guesses add margin and the bf16 casts.
    """
    grads = gradient_bytes(n, h, v, dtype_bytes)
    nv = n * v
    if case == "naive":  # saved float32 log_softmax, the scattered grad, the grad of the logits (+ casts)
        return grads + nv * (4 + 4 + 2 * dtype_bytes)
    if case in ("chunked", "trl"):
        return grads + nv * (3 * 4 + 2 * dtype_bytes)
    if case == "fused":
        block = args.chunk_size * args.vocab_chunk_size * 4
        return grads + 4 * block + n * h * 4
    if case == "fused_loss":  # one [chunk, V] float32 block (+ a half-precision copy), float32 W-grad sums
        block = min(args.loss_chunk_size, n) * v * 4
        return grads + 2 * block + (v * h * 4 if dtype_bytes < 4 else 0)
    return grads + 4 * 4 * v * min(n, 8192)  # liger: a chunk of float32 logits at a time


def machine_line(args: argparse.Namespace) -> str:
    import torch

    if args.device == "cuda" and torch.cuda.is_available():
        where = f"{torch.cuda.get_device_name(0)}, "
    else:
        model = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        where = f"{model}, {os.cpu_count()} cores visible, {args.threads} torch threads, "
    return f"{where}torch {torch.__version__}, python {platform.python_version()}"


def git_commit() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "orchard/losses", "benchmarks"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + (" (uncommitted changes under orchard/losses or benchmarks)" if dirty else "")


def floors(args: argparse.Namespace, n: int) -> list[str]:
    """Lower bounds on the fused case's time, from bandwidth and from arithmetic (see benchmarks/README.md)."""
    es = DTYPES[args.dtype]
    h, v = args.hidden, args.vocab
    passes = 3  # forward; backward recompute of the logits; backward grad_hidden = G @ W reads W again
    lines = []
    if args.hbm_gbps:
        bw = args.hbm_gbps * 1e9
        token_chunks = math.ceil(n / args.chunk_size)
        weight_floor = v * h * es * token_chunks * passes / bw
        lines.append(
            f"bandwidth floor (weight re-read per token chunk): V·H·{es} B × ceil(N/{args.chunk_size}) = "
            f"{token_chunks} chunks × {passes} passes / {args.hbm_gbps:g} GB/s = {weight_floor * 1e3:.2f} ms"
        )
        vocab_blocks = math.ceil(v / args.vocab_chunk_size)
        ours = passes * (v * h * es + n * h * es * vocab_blocks) / bw
        lines.append(
            f"bandwidth floor (this schedule: W once, hidden once per vocab block, {vocab_blocks} blocks, "
            f"× {passes} passes) = {ours * 1e3:.2f} ms"
        )
        loss_chunks = math.ceil(n / args.loss_chunk_size)
        per_chunk = v * h * (2 * es + 2 * 4)  # W read for the logits and for grad_hidden; float32 grad_W read+written
        lines.append(
            f"fused_loss bandwidth floor: V·H·(2·{es} + 8) B × {loss_chunks} token chunks / {args.hbm_gbps:g} GB/s "
            f"= {per_chunk * loss_chunks / bw * 1e3:.2f} ms"
        )
    if args.peak_tflops:
        for case, matmuls in (("fused", 4), ("fused_loss", 3)):  # fused recomputes the logits in the backward
            flops = matmuls * 2 * n * h * v
            lines.append(
                f"{case} compute floor: {matmuls} matmuls × 2·N·H·V = {flops / 1e12:.1f} TFLOP / "
                f"{args.peak_tflops:g} TFLOP/s = {flops / (args.peak_tflops * 1e12) * 1e3:.1f} ms"
            )
    return lines


def _ratio(result: dict, base: dict, key: str) -> float:
    return result[key] / base[key] if base.get("status") == "ok" and base.get(key) else float("nan")


def run_case(case: str, n: int, args: argparse.Namespace, tmp: Path) -> dict:
    logp_path = tmp / f"{case}_{n}.pt"
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--worker", case, "--worker-n", str(n),
        "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--device", args.device, "--dtype", args.dtype,
        "--threads", str(args.threads), "--repeats", str(args.repeats), "--chunk-size", str(args.chunk_size),
        "--vocab-chunk-size", str(args.vocab_chunk_size), "--loss-chunk-size", str(args.loss_chunk_size),
        "--logp-out", str(logp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"status": f"failed (rc {proc.returncode}): {tail[:80]}"}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["logp_path"] = logp_path if logp_path.exists() else None
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n" + __doc__.rsplit("\n\n", 1)[1].rstrip('"\n'),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384],
                        help="token counts N (default 1024 4096 16384; e.g. --n 1024 4096 for the first two)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size H")
    parser.add_argument("--vocab", type=int, default=151_936, help="vocabulary size V (Qwen3's)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in each worker")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per case (median reported)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES,
                        help="cases to run (default: all; liger only on cuda)")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="fused: tokens per block")
    parser.add_argument("--vocab-chunk-size", type=int, default=DEFAULT_VOCAB_CHUNK_SIZE,
                        help="fused: vocabulary entries per block")
    parser.add_argument("--loss-chunk-size", type=int, default=None,
                        help="fused_loss: tokens per block, each spanning the whole vocabulary (default: "
                             f"the library's, {DEFAULT_LOSS_CHUNK_SIZE} on cpu, {DEFAULT_LOSS_CHUNK_SIZE_CUDA} on cuda)")
    parser.add_argument("--memory-guard-gib", type=float, default=14.0,
                        help="skip a case whose estimated peak exceeds this (cuda: free memory if smaller)")
    parser.add_argument("--hbm-gbps", type=float, default=None, help="memory bandwidth, for the bandwidth floor")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense matmul peak, for the compute floor")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--worker", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--worker-n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--logp-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.loss_chunk_size is None:
        args.loss_chunk_size = DEFAULT_LOSS_CHUNK_SIZE if args.device == "cpu" else DEFAULT_LOSS_CHUNK_SIZE_CUDA
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    for name in ("hidden", "vocab", "threads", "repeats", "chunk_size", "vocab_chunk_size", "loss_chunk_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(n < 1 for n in args.n):
        parser.error(f"--n must be positive token counts, got {args.n}")
    import torch

    guard = args.memory_guard_gib * 2**30
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda but torch.cuda.is_available() is False")
        guard = min(guard, torch.cuda.mem_get_info()[0] * 0.9)
    elif "liger" in args.cases:
        args.cases = [c for c in args.cases if c != "liger"]  # Triton kernels: cuda only

    print(f"# benchmarks/logprobs.py — V={args.vocab:,} H={args.hidden} dtype={args.dtype} device={args.device}")
    print(f"# machine: {machine_line(args)}")
    print(f"# commit: {git_commit()}")
    print(f"# fused blocks: chunk_size={args.chunk_size} vocab_chunk_size={args.vocab_chunk_size}; "
          f"fused_loss blocks: {args.loss_chunk_size} tokens × V; "
          f"memory guard {guard / 2**30:.1f} GiB; forward + backward of Σ logp, grads to hidden and W")
    header = (f"{'N':>6} | {'case':<10} | {'time s':>7} | {'×naive':>6} | {'cpu s':>6} | {'×naive':>6} | "
              f"{'peak MiB':>8} | {'×naive':>6} | {'work MiB':>8} | {'×naive':>6} | max|Δlogp| | note")
    print(header)
    print("-" * len(header))
    rows = []
    es = DTYPES[args.dtype]
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        for n in args.n:
            results = {}
            for case in args.cases:
                estimate = estimate_peak_bytes(case, n, args.hidden, args.vocab, es, args)
                if estimate > guard:
                    results[case] = {"status": f"skipped: est. {estimate / 2**30:.1f} GiB > guard"}
                else:
                    results[case] = run_case(case, n, args, tmp)
            base = results.get("naive", {})
            ref_path = base.get("logp_path") or results.get("fused", {}).get("logp_path")
            ref = torch.load(ref_path) if ref_path else {}
            grads = gradient_bytes(n, args.hidden, args.vocab, es)
            for r in results.values():
                if r["status"] == "ok":
                    r["work_bytes"] = r["peak_bytes"] - grads
            for case, r in results.items():
                row = {"n": n, "case": case, **{k: v for k, v in r.items() if k != "logp_path"}}
                rows.append(row)
                if r["status"] != "ok":
                    blanks = " | ".join(f"{'':>{w}}" for w in (7, 6, 6, 6, 8, 6, 8, 6, 10))
                    print(f"{n:>6} | {case:<10} | {blanks} | {r['status']}")
                    continue
                t_ratio, c_ratio, m_ratio, w_ratio = (_ratio(r, base, k) for k in ("time_s", "cpu_s", "peak_bytes",
                                                                                    "work_bytes"))
                saved = torch.load(r["logp_path"]) if r.get("logp_path") else {}
                diff, grad_diff = "Σ only", None
                if "logp" in saved and "logp" in ref:
                    diff = f"{(saved['logp'] - ref['logp']).abs().max().item():.1e}"
                if saved and ref:
                    grad_diff = max(
                        ((saved[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-30)).item()
                        for k in ("hidden_grad", "weight_grad_rows")
                    )
                notes = ["Σ logp = −CE sum"] if case == "liger" else []
                if grad_diff is not None:
                    notes.append(f"Δgrad {grad_diff:.1e}")
                    row["grad_rel_diff"] = grad_diff
                note = "; ".join(notes)
                print(f"{n:>6} | {case:<10} | {r['time_s']:>7.1f} | {t_ratio:>6.2f} | {r['cpu_s']:>6.1f} | "
                      f"{c_ratio:>6.2f} | {r['peak_bytes'] / 2**20:>8.0f} | {m_ratio:>6.3f} | "
                      f"{r['work_bytes'] / 2**20:>8.0f} | {w_ratio:>6.3f} | {diff:>10} | {note}")
                row.update(time_ratio=t_ratio, cpu_ratio=c_ratio, peak_ratio=m_ratio, work_bytes=r["work_bytes"],
                           work_ratio=w_ratio)
            print(f"# N={n}: gradients returned (hidden.grad + W.grad) = {grads / 2**20:.0f} MiB; "
                  "work = peak − that")
            for line in floors(args, n):
                print(f"# N={n}: {line}")
    print(f"# peak memory: {rows[0].get('method', 'see docstring') if rows else ''}; "
          "max|Δlogp| and Δgrad (relative to the largest entry) are against naive (or fused where naive was skipped)")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_line(args), "commit": git_commit(), "rows": rows},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
