"""How does the RL stage scale past one process, and what does the weight sync cost?

`orchard.stages.rl_stage` (the stage every recipe runs) for a few GRPO steps of a tiny random Qwen3, in each of:

- **processes**: 1 process (the plain-torch trainer, a recipe's single-machine default) or 2 ranks under
  ``torchrun --nproc_per_node 2`` (gloo, DeepSpeed ZeRO-2, as ``tests/stages/test_ranks.py`` launches them);
- **engine**: the in-process `HFEngine` (one per rank), one served CPU engine (an ``orchard serve-model
  --allow-weight-updates`` child process behind an `EnginePool`, as ``recipes/claw.py`` builds it from
  ``engine_urls``), or two (one `EnginePool` over both, shared by the ranks; rank 0 pushes the weights);
- **schedule**: synchronous, or ``async_rollouts`` (step k+1's rollouts generated while step k trains).

The rollouts are single-turn and token-level (`TokenRollouts`: a random prompt per task, ``--new-tokens`` sampled
tokens through the engine's ``generate``, a reward from the sampled tokens), not Claw episodes in sandboxes: the
question here is the training side (ranks, gather, served engines, weight sync); the sandbox service's cost per
episode is measured by ``env_latency.py`` / ``env_scale.py`` and would only add the same wall time to every row.
Every group trains (``group_filter: none``), so trained tokens are every episode's tokens.

Per row, over steps 2..S (step 1 holds the trainer's start and the first forward passes): episodes per second,
trained tokens (prompt + completion of every trained sequence) per second, seconds per step, and the weight sync:
the seconds rank 0's ``engine.update_weights`` takes per update (in-process: ``load_state_dict``; served: save the
state dict once, drain, every replica loads the file) and its share of a step (target <= 10 %). Ratios are
against the 1-process, in-process, synchronous row measured in the same run.

    python benchmarks/rl_scaling.py                 # every row, 4 steps each (~22 min on a loaded 2-core box)
    python benchmarks/rl_scaling.py --quick         # smoke: 3 rows, 2 steps (~5 min)
    python benchmarks/rl_scaling.py --rows 1-inproc-sync 2-2srv-async
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from env_latency import machine

REPO = Path(__file__).resolve().parent.parent
READY_PREFIX = "ORCHARD_MODEL_URL="  # orchard.rollout.cli.READY_PREFIX, without importing the library here
BENCH_SIZE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32)
"""The benchmark's Qwen3 shape over the offline chat tokenizer (overrides of ``tiny_qwen3_config``)."""


@dataclass(frozen=True)
class Row:
    processes: int
    servers: int
    asynchronous: bool
    vllm: bool = False

    @property
    def name(self) -> str:
        engine = "vllm" if self.vllm else "inproc" if not self.servers else f"{self.servers}srv"
        return f"{self.processes}-{engine}-{'async' if self.asynchronous else 'sync'}"


ROWS = [Row(p, s, a) for p in (1, 2) for s in (0, 1, 2) for a in (False, True)]
GPU_ROWS = [Row(1, 0, a, vllm=True) for a in (False, True)]
"""A colocated `VLLMEngine` (one GPU; the trainer stays on the CPU): the weight sync is vLLM's in-process load
(``collective_rpc``). Never in the default rows; ``benchmarks/gpu_check.sh`` runs them where a GPU is lent."""
QUICK_ROWS = ["1-inproc-sync", "1-1srv-sync", "2-1srv-async"]


# ---- the worker: one process of a row (rank r of W) ----------------------------------------------------------------


class TokenRollouts:
    """`Rollouts` of one sampled answer per episode: task ``t``'s prompt is ``prompt_len`` random ids (seed t);
    ``group_size`` completions of up to ``new_tokens`` tokens, all requests of a call at once through
    ``engine.generate``; reward +1 when at least half the sampled ids are even, else -1. Records the tokens of
    every episode per call (one call per RL step: one harness, no BAR)."""

    def __init__(self, vocab: int, prompt_len: int, new_tokens: int, seeded: bool = True) -> None:
        self.vocab, self.prompt_len, self.new_tokens, self.seeded = vocab, prompt_len, new_tokens, seeded
        self.tokens_per_call: list[int] = []

    async def __call__(self, engine: Any, tasks: Sequence[Any], *, group_size: int, temperature: float,
                       max_tokens: int | None = None, seed: int | None = None) -> list[Any]:
        from orchard.data import RenderedSample, RenderReport, Trajectory
        from orchard.rollout.engine import GenerateRequest, SamplingParams, derive_seed

        params = SamplingParams(temperature=temperature, max_tokens=max_tokens or self.new_tokens)
        prompts = [torch.randint(3, self.vocab, (self.prompt_len,), generator=torch.Generator().manual_seed(int(t)))
                   .tolist() for t in tasks]
        seed = seed if self.seeded else None  # unseeded: the engine's generators decide (the old behaviour)
        requests = [GenerateRequest(p, replace(params, seed=None if seed is None else derive_seed(seed, int(t), j)))
                    for p, t in zip(prompts, tasks, strict=True) for j in range(group_size)]
        results = await engine.generate(requests)
        out, tokens = [], 0
        for i, result in enumerate(results):
            completion = result.completions[0]
            ids = torch.tensor([*result.prompt_ids, *completion.token_ids])  # [T]
            action = torch.arange(len(ids)) >= len(result.prompt_ids)  # [T]
            old = torch.zeros(len(ids))
            old[action] = torch.tensor(completion.logprobs, dtype=torch.float32)
            sample = RenderedSample(ids, action, torch.where(action, 0, -1), old, action.clone(), RenderReport())
            even = sum(1 - t % 2 for t in completion.token_ids)
            reward = 1.0 if 2 * even >= len(completion.token_ids) else -1.0
            out.append(Trajectory(reward=reward, task_id=str(tasks[i // group_size]), samples=[sample]))
            tokens += len(ids)
        self.tokens_per_call.append(tokens)
        return out


class TimedEngine:
    """An engine whose ``update_weights`` durations are recorded (the stage's weight sync, as seen by this rank)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.sync_s: list[float] = []

    async def generate(self, requests: Any) -> Any:
        return await self.engine.generate(requests)

    async def update_weights(self, weights: Any) -> None:
        start = time.perf_counter()
        await self.engine.update_weights(weights)
        self.sync_s.append(time.perf_counter() - start)

    async def close(self) -> None:
        await self.engine.close()


async def _worker_main(args: argparse.Namespace) -> None:
    from orchard.rollout.cli import load_model_and_tokenizer
    from orchard.rollout.engine_pool import EnginePool
    from orchard.rollout.hf_engine import HFEngine
    from orchard.stages import RLConfig, RolloutConfig, rl_stage
    from orchard.stages.ranks import all_reduce_sum, init_ranks
    from orchard.train.objective import LossTerm
    from orchard.train.trainer import OptimConfig, TrainConfig

    ranks = init_ranks(timeout_s=600)
    model, tokenizer = load_model_and_tokenizer(args.model_dir)
    if args.vllm:
        from orchard.rollout.vllm_engine import VLLMEngine

        inner: Any = VLLMEngine(args.model_dir, gpu_memory_utilization=0.3, enforce_eager=True, seed=ranks.rank)
    elif args.engine_urls:
        inner = EnginePool.from_urls(args.engine_urls, save_dir=str(args.out / "weights"),
                                          push_weights=ranks.is_main, timeout_s=600)
    else:
        inner = HFEngine(copy.deepcopy(model).eval(), pad_token_id=tokenizer.pad_token_id, max_batch_size=64,
                         seed=ranks.rank)
    engine = TimedEngine(inner)
    rollouts = TokenRollouts(len(tokenizer), args.prompt_len, args.new_tokens, seeded=not args.unseeded)
    cfg = RLConfig(steps=args.steps, tasks_per_step=args.tasks, group_size=args.group, mini_batches=2,
                   group_filter="none", async_rollouts=args.asynchronous, train=TrainConfig(
                       micro_batch_size=args.tasks * args.group // 2, zero_stage=2,
                       engine="deepspeed" if ranks.world_size > 1 else "plain",
                       optim=OptimConfig(lr=1e-4, min_lr=1e-4, eps=1e-6, grad_clip=1.0),
                       objective=[LossTerm("policy", 1.0, {"eps_low": 0.2, "eps_high": 0.28})]))
    marks: list[float] = []
    history = await rl_stage(model, engine, {"tokens": rollouts}, list(range(64)), cfg,
                             rollout=RolloutConfig(temperature=1.0), pad_id=tokenizer.pad_token_id, seed=0,
                             output_dir=str(args.out / "train"), log=lambda stats, step: marks.append(
                                 time.perf_counter()))
    await engine.close()
    tokens = all_reduce_sum({str(i): float(n) for i, n in enumerate(rollouts.tokens_per_call)})
    if ranks.is_main:
        result = {"step_end_s": marks, "episodes": [h["rl/episodes"] for h in history],
                  "tokens": [tokens[str(i)] for i in range(len(tokens))], "sync_s": engine.sync_s}
        (args.out / "result.json").write_text(json.dumps(result))
        torch.save({k: v.detach().float().cpu() for k, v in model.state_dict().items()}, args.out / "final.pt")


# ---- the driver: servers, launches, the table ----------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "build" / "torch_extensions"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model_dir: Path) -> tuple[subprocess.Popen[str], str]:
    """``orchard serve-model`` over ``model_dir`` on a free loopback port; returns the process and its URL."""
    proc = subprocess.Popen([sys.executable, "-m", "orchard", "serve-model", "--model", str(model_dir), "--port", "0",
                             "--model-name", "orchard", "--allow-weight-updates", "--max-batch-size", "64",
                             "--log-level", "warning"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(READY_PREFIX):
            return proc, line[len(READY_PREFIX):].strip()
    proc.wait()
    raise RuntimeError("orchard serve-model did not start:\n" + "".join(lines[-30:]))


def _stop(procs: Sequence[subprocess.Popen[str]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_row(row: Row, model_dir: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One row's processes (servers, then the stage's ranks); returns rank 0's ``result.json``."""
    servers = [start_server(model_dir) for _ in range(row.servers)]
    try:
        worker = [str(Path(__file__).resolve()), "--worker", "--out", str(out), "--model-dir", str(model_dir),
                  "--steps", str(args.steps), "--tasks", str(args.tasks), "--group", str(args.group),
                  "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
                  *(["--async"] if row.asynchronous else []), *(["--vllm"] if row.vllm else []),
                  *(["--unseeded"] if args.unseeded else []),
                  *(["--engine-urls", *(url for _, url in servers)] if servers else [])]
        if row.processes == 1:
            launch = [sys.executable, *worker]
        else:
            torchrun = Path(sys.executable).parent / "torchrun"
            launch = [str(torchrun), "--nproc_per_node", str(row.processes), "--master_addr", "127.0.0.1",
                      "--master_port", str(_free_port()), *worker]
        proc = subprocess.run(launch, env=_env(), capture_output=True, text=True, timeout=args.row_timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"row {row.name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    finally:
        _stop([p for p, _ in servers])
    return json.loads((out / "result.json").read_text())


def summarize(result: dict[str, Any]) -> dict[str, float]:
    """Rates over steps 2..S: ``step_end_s`` are rank 0's clock at the end of each step (after its weight push),
    so step k's time is ``end[k] - end[k-1]``; one step (S = 1) is measured from nothing and gives zeros."""
    ends, episodes, tokens, sync = (result[k] for k in ("step_end_s", "episodes", "tokens", "sync_s"))
    if len(ends) < 2:
        return {"episodes_per_s": 0.0, "tokens_per_s": 0.0, "step_s": 0.0, "sync_s": 0.0, "sync_share": 0.0}
    wall = ends[-1] - ends[0]
    measured_sync = sync[-(len(ends) - 1):]  # a resume's or a first push before step 2 is not a step's sync
    step_s = wall / (len(ends) - 1)
    sync_s = sum(measured_sync) / len(measured_sync)
    return {"episodes_per_s": sum(episodes[1:]) / wall, "tokens_per_s": sum(tokens[1:]) / wall, "step_s": step_s,
            "sync_s": sync_s, "sync_share": sync_s / step_s}


def table(rows: dict[str, dict[str, float]], baseline: str = "1-inproc-sync") -> str:
    """The markdown table, each rate also as a ratio against the ``baseline`` row (``-`` where it is missing)."""
    base = rows.get(baseline)
    lines = ["| row | processes | engine | schedule | episodes/s | trained tok/s | vs baseline | s/step "
             "| sync s/update | sync share of step |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        processes, engine, schedule = name.split("-")
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base and base["tokens_per_s"] else "-"
        engine = {"inproc": "in-process HF"}.get(engine, engine.replace("srv", " served"))
        lines.append(f"| {name} | {processes} | {engine} | {schedule} | {r['episodes_per_s']:.2f} "
                     f"| {r['tokens_per_s']:.0f} | {ratio} | {r['step_s']:.2f} | {r['sync_s']:.3f} "
                     f"| {100 * r['sync_share']:.1f} % |")
    return "\n".join(lines)


def weight_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], start: dict[str, torch.Tensor]
               ) -> tuple[float, float]:
    """How far two trained copies of ``start`` ended apart: ``||a - b|| / ||b - start||`` over every weight (0 when
    the runs are the same; 1 means they differ by as much as training moved ``b``), and the largest ``|a - b|``."""
    diff = torch.cat([(a[k] - b[k]).flatten() for k in b])
    moved = torch.cat([(b[k] - start[k]).flatten() for k in b])
    return float(diff.norm() / moved.norm().clamp_min(1e-30)), float(diff.abs().max())


def _initial_weights() -> dict[str, torch.Tensor]:
    from orchard.models import tiny_chat_model

    model, _ = tiny_chat_model(seed=0, **BENCH_SIZE)
    return {k: v.detach().float() for k, v in model.state_dict().items()}


def _save_model(model_dir: Path) -> int:
    from orchard.models import tiny_chat_model
    from orchard.train.model import save_causal_lm

    model, tokenizer = tiny_chat_model(seed=0, **BENCH_SIZE)
    save_causal_lm(model, model_dir, tokenizer)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"smoke: rows {QUICK_ROWS}, 2 steps")
    parser.add_argument("--rows", nargs="+", default=None, help=f"rows to run (default all: "
                        f"{[r.name for r in ROWS]}; with a GPU and vLLM also {[r.name for r in GPU_ROWS]})")
    parser.add_argument("--steps", type=int, default=4, help="RL steps per row (step 1 is not measured)")
    parser.add_argument("--tasks", type=int, default=8, help="tasks per step")
    parser.add_argument("--group", type=int, default=4, help="episodes per task")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per episode")
    parser.add_argument("--new-tokens", type=int, default=32, help="sampled tokens per episode (at most)")
    parser.add_argument("--row-timeout-s", type=float, default=900, help="limit on one row's launch")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows' summaries here")
    parser.add_argument("--unseeded", action="store_true",
                        help="rollouts send no seed (each rank's engine samples from its own generator), to compare "
                             "with the seeded default")
    # the worker's own arguments
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--async", dest="asynchronous", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine-urls", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--vllm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        torch.set_num_threads(1)
        asyncio.run(_worker_main(args))
        return
    by_name = {r.name: r for r in [*ROWS, *GPU_ROWS]}
    names = args.rows or (QUICK_ROWS if args.quick else [r.name for r in ROWS])
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"--rows must be among {list(by_name)}, got {unknown}")
    if args.quick:
        args.steps = 2
    if args.steps < 2:
        raise ValueError(f"--steps must be >= 2 (step 1 is not measured), got {args.steps}")
    info = machine()
    summaries: dict[str, dict[str, float]] = {}
    finals: dict[str, dict[str, torch.Tensor]] = {}
    with tempfile.TemporaryDirectory(prefix="rl_scaling_") as tmp:
        model_dir = Path(tmp) / "model"
        params = _save_model(model_dir)
        if any(by_name[n].processes > 1 for n in names):
            # DeepSpeed's CPU shared-memory op, built once before two ranks race to build it (tests/stages/test_ranks)
            subprocess.run([sys.executable, "-c", "from deepspeed.ops.op_builder.cpu.comm import "
                            "ShareMemCommBuilder; ShareMemCommBuilder().load()"], env=_env(), check=True,
                           capture_output=True, timeout=600)
        for name in names:
            out = Path(tmp) / name
            out.mkdir()
            summaries[name] = summarize(run_row(by_name[name], model_dir, out, args))
            finals[name] = torch.load(out / "final.pt")
            print(f"{name}: {json.dumps({k: round(v, 4) for k, v in summaries[name].items()})}", flush=True)
    print(f"\n{info['machine']}; python {info['python']}; commit {info['commit']}")
    print(f"tiny Qwen3 ({params / 1e6:.2f} M parameters, float32, {params * 4 / 2**20:.1f} MiB of weights), "
          f"{args.tasks} tasks x {args.group} episodes per step, {args.prompt_len} prompt + <= {args.new_tokens} "
          f"sampled tokens each; steps 2..{args.steps} measured; torch threads 1 per process\n")
    print(table(summaries))
    start = _initial_weights()
    for name in finals:
        one = "1-" + name.split("-", 1)[1]
        if name.startswith("1-") or one not in finals:
            continue
        gap, max_abs = weight_gap(finals[name], finals[one], start)
        print(f"{name} vs {one}: final weights differ by {100 * gap:.3f} % of the distance trained "
              f"(max |dw| {max_abs:.2e}; rollouts {'unseeded' if args.unseeded else 'seeded'})")
    worst = max(summaries, key=lambda n: summaries[n]["sync_share"])
    print(f"\nweight sync: at most {100 * summaries[worst]['sync_share']:.1f} % of a step ({worst}); "
          f"target <= 10 %")
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": info, "args": vars(args) | {"json": str(args.json)},
                                         "rows": summaries}, default=str, indent=1))


if __name__ == "__main__":
    main()
