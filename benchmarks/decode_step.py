"""Where does one decode step of `HFEngine` spend its time, and how far is it from the matmul floor?

For each batch size: the time of one decode step (rows of ``--prompt-len`` cached tokens, one new token each) on
the model's own HF forward over the engine's KV buffers and on `orchard.rollout.fast_decode.DecodeForward`, and the
floor: the step's matmuls alone (every layer's q, k, v, o, gate, up, down projections and the lm head) on the
model's own weights, which a step reads once each (float32 weights larger than the CPU's caches stream from
memory, so no engine does a step in less). Baseline: the HF forward. Same model as `benchmarks/rollout.py`
(``--shape bench`` or ``claw``); medians of ``--repeats`` timings of ``--steps`` steps each.

``--compile``: also the fast forward through ``torch.compile`` (``DecodeForward(model, compiled=True)``, what
``HFEngine(compile_decode=True)`` runs), timed after its first call, whose time (the compile, once per process:
later batch sizes reuse the graph) is a column of its own; the graphs dynamo built are counted at the end.

    python benchmarks/decode_step.py --batch 16 64
    python benchmarks/decode_step.py --batch 16 64 --compile
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from env_latency import machine
from rollout import SHAPES, bench_model


def _timed(step, steps: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean seconds of ``step()`` over ``steps`` calls, after 3 warm-up calls."""
    for _ in range(3):
        step()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        runs.append((time.perf_counter() - start) / steps)
    return statistics.median(runs)


def time_steps(model, batch: int, prompt_len: int, steps: int, repeats: int, compiled: bool) -> dict[str, float]:
    from orchard.rollout.fast_decode import DecodeForward
    from orchard.rollout.kv_cache import prefill_inputs

    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(batch)).tolist()
    ids_B = torch.randint(3, vocab, (batch,), generator=torch.Generator().manual_seed(0))

    def fresh_cache():
        inputs = prefill_inputs(model.config, [None] * batch, prompts, 0, torch.device("cpu"))
        with torch.no_grad():
            model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                  position_ids=inputs.position_ids, use_cache=True, cache=inputs.cache.hf_cache(model.config))
        inputs.cache.advance(prompt_len)
        return inputs.cache

    def stepper(decode):
        """One step of ``decode`` (None: the HF forward)."""
        cache = fresh_cache()

        def step() -> None:
            # a step at the same length each time: the cache's last column is written, then given back
            cache.reserve(1)
            cache.mask[:, cache.length] = 1
            positions_B = torch.full((batch,), cache.length)
            with torch.no_grad():
                if decode is not None:
                    decode(ids_B, positions_B, cache)
                else:
                    model(input_ids=ids_B[:, None], attention_mask=cache.mask[:, : cache.length + 1],
                          position_ids=positions_B[:, None], use_cache=True, logits_to_keep=1,
                          cache=cache.hf_cache(model.config))
            cache.mask[:, cache.length] = 0

        return step

    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in weights}

    def matmuls() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    out = {"hf": _timed(stepper(None), steps, repeats), "fast": _timed(stepper(DecodeForward(model)), steps, repeats),
           "floor": _timed(matmuls, steps, repeats)}
    if compiled:
        step = stepper(DecodeForward(model, compiled=True))
        start = time.perf_counter()
        step()
        out["first_call"] = time.perf_counter() - start
        out["compiled"] = _timed(step, steps, repeats)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="also time the compiled fast forward")
    args = parser.parse_args()
    if any(b < 1 for b in args.batch) or args.prompt_len < 1 or args.steps < 1 or args.repeats < 1:
        raise SystemExit("--batch, --prompt-len, --steps and --repeats must be >= 1")
    torch.set_num_threads(args.threads)
    model = bench_model("cpu", torch.float32, args.shape)
    mib = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear)) / 2**20
    print(f"machine: {machine()}  torch {torch.__version__}  threads {args.threads}  model {args.shape} "
          f"(matmul weights {mib:.1f} MiB)\n")
    print(f"## one decode step, {args.prompt_len} cached tokens per row, float32, ms (median of {args.repeats})")
    columns = " compiled ms | first call s (compile) | fast / compiled | compiled / floor |" if args.compile else ""
    print(f"| batch | HF forward | fast forward | matmuls alone (floor) | HF / fast | fast / floor |{columns}")
    print("|---:" * (10 if args.compile else 6) + "|")
    for batch in args.batch:
        t = time_steps(model, batch, args.prompt_len, args.steps, args.repeats, args.compile)
        row = (f"| {batch} | {t['hf'] * 1e3:.1f} | {t['fast'] * 1e3:.1f} | {t['floor'] * 1e3:.1f} | "
               f"{t['hf'] / t['fast']:.2f} | {t['fast'] / t['floor']:.2f} |")
        if args.compile:
            row += (f" {t['compiled'] * 1e3:.1f} | {t['first_call']:.1f} | {t['fast'] / t['compiled']:.2f} | "
                    f"{t['compiled'] / t['floor']:.2f} |")
        print(row, flush=True)
    if args.compile:
        from torch._dynamo.utils import counters

        print(f"\ngraphs compiled: {counters['stats']['unique_graphs']} (batch sizes {args.batch})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
