"""How fast does the rollout layer generate and act?

1. Generation: tokens per second of `HFEngine` (continuous batching over the KV cache, log-probs included)
   against plain ``model.generate(do_sample=True, output_scores=True)`` with the log-probs of the sampled tokens
   (``compute_transition_scores(normalize_logits=True)``) on the same batch, same model, same number of new tokens
   (no stop token, so every row generates exactly ``--new-tokens``); the engine also with ``fast_decode=False``
   (its prefill and decode steps on the model's own forward). Model: a random Qwen3 from a config (``--shape
   bench``: hidden 256, 4 layers, 8 heads / 4 KV heads, vocab 8192; ``--shape claw``: the Claw recipe's policy,
   hidden 128, 4 layers, vocab 1024; ``--shape smollm2``: the real SmolLM2-135M-Instruct, fetched by name), float32
   on CPU or bf16 on GPU. Baseline: HF.
2. Episodes: ``--episodes`` concurrent multi-turn episodes of ``--turns`` turns. Each turn samples up to
   ``--new-tokens`` tokens, cut at a per-episode, per-turn length (uniform in [4, --new-tokens], as stop tokens
   would) and appends ``--obs-tokens`` observation tokens; the next turn's prompt is the whole history. Baseline:
   a static-batch loop over plain ``generate`` (all episodes' histories left-padded into one call per turn,
   ``max_new_tokens`` = the longest cut, log-probs as above). `HFEngine` runs the episodes as concurrent tasks,
   with and without its prefix store. Useful tokens (up to each cut) per second.

   ``--compile-decode``: both tables get a column for the engine with ``compile_decode=True`` (its fast decode
   step through ``torch.compile``). Its one-time compile (when the first compiled engine is built) is left out
   of the timed runs and printed apart: generation, the engine's construction plus its warm-up run (the first
   batch size's row holds the compile); episodes, one untimed run of a compiled engine first (each timed run
   builds its own engine, whose warm-up step then finds the graph compiled); and the graphs dynamo built.
3. Streaming: time to first token and tokens/s of streamed ``/v1/completions`` (``--stream-requests`` requests
   of ``--new-tokens`` tokens, one at a time) straight to the model server (`build_app` over `HFEngine`, the
   benchmark's shape over the offline chat tokenizer) and through the recording proxy, which forwards each chunk
   as it arrives and records the call's token ids and log-probs. Baseline: direct. Target: proxy TTFT <= 1.1 x.
4. Acting: agent-loop rollouts per minute against the embedded sandbox service (LocalBackend, bubblewrap), with
   a scripted policy (three ``exec`` turns and an answer: the loop's and the sandboxes' cost alone) and with the
   tiny model above as the policy (``--steps`` turns of up to 24 tokens; a random model rarely emits a tool
   call, so most of its rollouts answer once and end), ``--rollouts`` rollouts, ``--concurrency`` at a time.

    python benchmarks/rollout.py                           # CPU, 1 thread, batch 1 and 16, 64 new tokens
    python benchmarks/rollout.py --device cuda --batch 1 16 64 --new-tokens 128
    python benchmarks/rollout.py --skip-rollouts           # no agent loop (no bwrap needed)
    python benchmarks/rollout.py --batch 16 64 --new-tokens 32 --shape claw --skip-rollouts --skip-streaming
    python benchmarks/rollout.py --shape smollm2 --threads 2 --batch 16 --episodes 16 --prompt-len 256 \
        --new-tokens 64 --obs-tokens 48 --repeats 1 --skip-rollouts --skip-streaming
    python benchmarks/rollout.py --batch 16 64 --new-tokens 32 --skip-rollouts --skip-streaming --compile-decode
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from env_latency import machine

BENCH_SIZE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
)
"""The benchmark's Qwen3 shape (overrides of ``orchard.train.tiny.tiny_qwen3_config``)."""

SHAPES = {
    "bench": (8192, BENCH_SIZE),
    "claw": (1024, dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32)),
}
"""``--shape``: vocabulary size and Qwen3 shape. ``claw`` is the Claw recipe's policy
(``recipes/configs/claw_tiny.yaml``: vocab 1024, hidden 128, 4 layers; the rest as ``orchard.stages.policy``
builds it: MLP 3 x hidden, 4 heads / 2 KV heads, head dim hidden / 4)."""


PRETRAINED_SHAPES = {"smollm2": "smollm2-135m-instruct"}
"""``--shape`` values that load a real pretrained checkpoint by name (`orchard models fetch NAME` first):
``smollm2`` is SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49,152)."""


def bench_model(device: str, dtype: torch.dtype, shape: str = "bench"):
    from orchard.train.tiny import tiny_qwen3

    if shape in PRETRAINED_SHAPES:
        from orchard.train.model import load_causal_lm

        return load_causal_lm(PRETRAINED_SHAPES[shape]).to(device=device, dtype=dtype).eval()
    vocab, size = SHAPES[shape]
    model = tiny_qwen3(vocab, seed=0, eos_token_id=2, pad_token_id=0, bos_token_id=None, **size)
    return model.to(device=device, dtype=dtype).eval()


def time_generation(
    model, batch: int, prompt_len: int, new_tokens: int, repeats: int, compile_decode: bool = False
) -> dict[str, float]:
    from orchard.rollout.engine import GenerateRequest, SamplingParams
    from orchard.rollout.hf_engine import HFEngine

    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, model.config.vocab_size, (batch, prompt_len), generator=gen)
    engines = {
        "hf_engine": HFEngine(model, max_batch_size=batch, batch_wait_s=0.0),
        "hf_engine_hf_forward": HFEngine(model, max_batch_size=batch, batch_wait_s=0.0, fast_decode=False),
    }
    build_s = 0.0
    if compile_decode:  # the engine compiles when built (DecodeForward.warm_up): timed with the warm-up run
        t0 = time.perf_counter()
        engines["hf_engine_compiled"] = HFEngine(model, max_batch_size=batch, batch_wait_s=0.0, compile_decode=True)
        build_s = time.perf_counter() - t0
    requests = [
        GenerateRequest(p.tolist(), SamplingParams(temperature=1.0, max_tokens=new_tokens)) for p in prompts
    ]

    def ours(name: str) -> int:
        results = asyncio.run(engines[name].generate(requests))
        return sum(len(r.completions[0].token_ids) for r in results)

    def plain() -> int:
        ids = prompts.to(device)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
            logprobs = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        return int(logprobs.shape[0] * logprobs.shape[1])

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    runs = {"hf_generate": plain, **{name: lambda name=name: ours(name) for name in engines}}
    times: dict[str, list[float]] = {name: [] for name in runs}
    tokens = {}
    warm_up_s = {}
    for name, fn in runs.items():  # warm-up (the compiled engine's compiles here)
        t0 = time.perf_counter()
        fn()
        warm_up_s[name] = time.perf_counter() - t0
    for _ in range(repeats):
        for name, fn in runs.items():
            sync()
            t0 = time.perf_counter()
            tokens[name] = fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    assert all(n == batch * new_tokens for n in tokens.values()), tokens
    out = {name: tokens[name] / statistics.median(ts) for name, ts in times.items()}
    if compile_decode:
        out["compiled_warm_up_s"] = build_s + warm_up_s["hf_engine_compiled"]
    return out


def time_episodes(
    model, episodes: int, turns: int, prompt_len: int, new_tokens: int, obs_tokens: int, repeats: int,
    compile_decode: bool = False,
) -> dict[str, float]:
    from orchard.rollout.engine import GenerateRequest, SamplingParams
    from orchard.rollout.hf_engine import HFEngine

    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(1000 + episodes)
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (episodes, prompt_len), generator=gen).tolist()
    cuts = torch.randint(4, new_tokens + 1, (episodes, turns), generator=gen).tolist()
    observations = torch.randint(3, vocab, (episodes, turns, obs_tokens), generator=gen).tolist()
    useful = sum(sum(row) for row in cuts)

    def static() -> int:
        histories = [list(p) for p in prompts]
        for turn in range(turns):
            width = max(len(h) for h in histories)
            ids = torch.zeros((episodes, width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for e, history in enumerate(histories):
                ids[e, width - len(history) :] = torch.tensor(history)
                mask[e, width - len(history) :] = 1
            longest = max(cuts[e][turn] for e in range(episodes))
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=longest,
                    min_new_tokens=longest,
                    eos_token_id=None,
                    pad_token_id=0,
                    output_scores=True,
                    return_dict_in_generate=True,
                )
                model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
            sampled = out.sequences[:, width:].tolist()
            for e in range(episodes):
                histories[e] += sampled[e][: cuts[e][turn]] + observations[e][turn]
        return useful

    def ours(prefix_cache_tokens: int, compiled: bool = False) -> int:
        engine = HFEngine(
            model, max_batch_size=episodes, prefix_cache_tokens=prefix_cache_tokens, compile_decode=compiled
        )
        sampled = 0

        async def episode(e: int) -> None:
            nonlocal sampled
            history = list(prompts[e])
            for turn in range(turns):
                params = SamplingParams(temperature=1.0, max_tokens=cuts[e][turn])
                [result] = await engine.generate([GenerateRequest(history, params)])
                history += result.completions[0].token_ids + observations[e][turn]
                sampled += len(result.completions[0].token_ids)

        async def run_all() -> None:
            await asyncio.gather(*(episode(e) for e in range(episodes)))
            await engine.close()

        asyncio.run(run_all())
        return sampled

    runs = {
        "static_generate": static,
        "engine_no_prefix": lambda: ours(0),
        "engine": lambda: ours(65536),
    }
    out = {}
    if compile_decode:
        runs["engine_compiled"] = lambda: ours(65536, compiled=True)
        t0 = time.perf_counter()
        ours(65536, compiled=True)
        out["compiled_warm_up_s"] = time.perf_counter() - t0
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            tokens = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
            assert tokens == useful, (name, tokens, useful)
    return {**out, **{name: useful / statistics.median(ts) for name, ts in times.items()}}


def time_streaming(device: str, dtype: torch.dtype, requests: int, prompt_len: int, new_tokens: int,
                   processes: bool = False) -> dict:
    """Median TTFT (s) and tokens/s of streamed completions, direct and through the recording proxy (requests
    alternate between the two, after one warm-up each); also checks that the proxy recorded every token.

    ``processes``: the model server (``orchard serve-model``) and the proxy (``orchard serve-proxy``) each run in
    their own process, as deployed; otherwise both are threads of this process, sharing its interpreter lock with
    the client."""
    import httpx

    from orchard.data.tokenizer import build_chat_tokenizer
    from orchard.rollout.hf_engine import HFEngine
    from orchard.rollout.proxy import RecordingProxy
    from orchard.rollout.server import build_app, serve_in_thread
    from orchard.train.tiny import tiny_qwen3

    tokenizer = build_chat_tokenizer()
    model = tiny_qwen3(tokenizer, seed=0, **BENCH_SIZE).to(device=device, dtype=dtype).eval()

    def stream(url: str, seed: int) -> tuple[float, float, int]:
        body = {"model": "orchard", "prompt": [5 + k % 500 for k in range(prompt_len)], "max_tokens": new_tokens,
                "temperature": 1.0, "seed": seed, "ignore_eos": True, "logprobs": 0, "stream": True}
        t0, first, n = time.perf_counter(), None, 0
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                got = sum(len(c.get("token_ids") or []) for c in json.loads(line[6:])["choices"])
                if got and first is None:
                    first = time.perf_counter() - t0
                n += got
        total = time.perf_counter() - t0
        return first or total, n / total, n

    out: dict = {"direct": {"ttft": [], "tps": []}, "proxy": {"ttft": [], "tps": []}}
    if processes:
        return _time_streaming_processes(model, tokenizer, device, stream, requests, new_tokens, out)
    with serve_in_thread(build_app(HFEngine(model), tokenizer)) as upstream:
        proxy = RecordingProxy(upstream)
        with serve_in_thread(proxy.app) as via:
            _alternate(stream, upstream, via, requests, new_tokens, out)
    recorded = [len(r.choices[0].token_ids) == len(r.choices[0].logprobs) == new_tokens
                for r in proxy.calls("default")]
    assert len(recorded) == requests + 1 and all(recorded), "the proxy did not record every streamed token"
    return {name: {k: statistics.median(v) for k, v in d.items()} for name, d in out.items()}


def _alternate(stream, upstream: str, via: str, requests: int, new_tokens: int, out: dict) -> None:
    """One warm-up each, then ``requests`` streamed requests alternating direct / through the proxy."""
    for url in (upstream, via):
        stream(url, -1)
    for i in range(requests):
        for name, url in (("direct", upstream), ("proxy", via)):
            ttft, tps, n = stream(url, i)
            out[name]["ttft"].append(ttft)
            out[name]["tps"].append(tps)
            assert n == new_tokens, (name, n)


def _time_streaming_processes(model, tokenizer, device, stream, requests: int, new_tokens: int, out: dict) -> dict:
    import subprocess
    import tempfile

    import httpx

    from orchard.rollout.cli import READY_PREFIX

    def start(args: list[str]) -> tuple[subprocess.Popen, str]:
        proc = subprocess.Popen([sys.executable, "-m", "orchard", *args, "--port", "0", "--log-level", "warning"],
                                stdout=subprocess.PIPE, text=True)
        for line in proc.stdout:
            if line.startswith(READY_PREFIX):
                return proc, line.strip().removeprefix(READY_PREFIX)
        raise RuntimeError(f"orchard {args[0]} exited with {proc.wait()} before it listened")

    procs = []
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        try:
            server, upstream = start(["serve-model", "--model", folder, "--model-name", "orchard",
                                      "--device", device])
            procs.append(server)
            proxy, via = start(["serve-proxy", "--upstream", upstream])
            procs.append(proxy)
            _alternate(stream, upstream, via, requests, new_tokens, out)
            calls = httpx.get(f"{via}/sessions/default/calls", timeout=60).json()["calls"]
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=30)
    recorded = [len(c["choices"][0]["token_ids"]) == len(c["choices"][0]["logprobs"]) == new_tokens for c in calls]
    assert len(recorded) == requests + 1 and all(recorded), "the proxy did not record every streamed token"
    return {name: {k: statistics.median(v) for k, v in d.items()} for name, d in out.items()}


def exec_call(command: str) -> str:
    return f'<tool_call>\n{{"name": "exec", "arguments": {json.dumps({"command": command})}}}\n</tool_call>'


async def time_rollouts(
    policy: str, rollouts: int, concurrency: int, steps: int, device: str
) -> dict[str, float]:
    from orchard.data.tokenizer import build_chat_tokenizer
    from orchard.env import AsyncSandboxClient
    from orchard.env.embedded import serve
    from orchard.rollout.agent_loop import AgentLoop
    from orchard.rollout.engine import SamplingParams
    from orchard.rollout.harness import ShellHarness
    from orchard.rollout.hf_engine import HFEngine
    from orchard.rollout.scripted import ScriptedEngine

    tokenizer = build_chat_tokenizer()
    if policy == "scripted":

        def script(prompt: str) -> str:
            turn = prompt.count("<|im_start|>tool")
            commands = ["ls -la", "echo hello > out.txt", "cat out.txt"]
            return exec_call(commands[turn]) if turn < len(commands) else "Done."

        engine = ScriptedEngine(tokenizer, script)
        harness = ShellHarness(max_steps=4)
        sampling = SamplingParams(max_tokens=256)
    else:
        from orchard.train.tiny import tiny_qwen3

        model = tiny_qwen3(tokenizer, seed=0, **BENCH_SIZE).to(device).eval()
        engine = HFEngine(model, max_batch_size=concurrency)
        harness = ShellHarness(max_steps=steps)
        sampling = SamplingParams(temperature=1.0, max_tokens=24)
    tasks = [
        {"id": f"t{i}", "prompt": f"Task {i}: make out.txt say hello.", "check": "test -s out.txt"}
        for i in range(rollouts)
    ]
    with serve() as (url, key):
        async with AsyncSandboxClient(url, key) as client:
            loop = AgentLoop(
                engine,
                client,
                harness,
                tokenizer,
                sampling=sampling,
                concurrency=concurrency,
                start_jitter_s=0.0,
                progress=False,
                seed=0,
            )
            t0 = time.perf_counter()
            trajs = await loop.run_many(tasks)
            wall = time.perf_counter() - t0
    reasons: dict[str, int] = {}
    for t in trajs:
        reasons[t.termination_reason] = reasons.get(t.termination_reason, 0) + 1
    steps_total = sum(t.metadata["steps"] for t in trajs)
    return {
        "rollouts": len(trajs),
        "wall_s": wall,
        "per_min": 60 * len(trajs) / wall,
        "steps": steps_total,
        "tokens": sum(t.num_sampled_tokens for t in trajs),
        "env_errors": reasons.get("env_error", 0),
        "reasons": reasons,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=sorted([*SHAPES, *PRETRAINED_SHAPES]), default="bench",
                        help="model of the generation and episodes tables (see SHAPES and PRETRAINED_SHAPES)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--episodes", type=int, nargs="*", default=[16], help="concurrent multi-turn episodes"
    )
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument(
        "--obs-tokens", type=int, default=16, help="observation tokens appended after each turn"
    )
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="step budget of the tiny-model rollouts")
    parser.add_argument("--stream-requests", type=int, default=8, help="streamed requests, direct and via proxy")
    parser.add_argument("--skip-streaming", action="store_true")
    parser.add_argument("--stream-processes", action="store_true",
                        help="run the model server and the proxy as their own processes (as deployed)")
    parser.add_argument("--skip-rollouts", action="store_true")
    parser.add_argument("--compile-decode", action="store_true",
                        help="add the engine with compile_decode=True to the generation and episodes tables")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    info = machine()
    print(
        f"machine: {json.dumps(info)}  torch {torch.__version__}  threads {args.threads}  device {args.device}"
    )

    model = bench_model(args.device, dtype, args.shape)
    print(
        f"\n## generation: new tokens/s, model {args.shape}, {args.prompt_len}-token prompts, {args.new_tokens} new "
        f"tokens, {str(dtype).removeprefix('torch.')}, median of {args.repeats}"
    )
    compiled = args.compile_decode
    columns = " engine, compiled tok/s | compiled / generate | compiled build + warm-up s |" if compiled else ""
    print(f"| batch | hf_generate tok/s | engine, HF forward tok/s | hf_engine tok/s | engine / generate |{columns}")
    print("|---:" * (8 if compiled else 5) + "|")
    for batch in args.batch:
        r = time_generation(model, batch, args.prompt_len, args.new_tokens, args.repeats, compiled)
        row = (
            f"| {batch} | {r['hf_generate']:.0f} | {r['hf_engine_hf_forward']:.0f} | {r['hf_engine']:.0f} | "
            f"{r['hf_engine'] / r['hf_generate']:.2f} |"
        )
        if compiled:
            row += (f" {r['hf_engine_compiled']:.0f} | {r['hf_engine_compiled'] / r['hf_generate']:.2f} | "
                    f"{r['compiled_warm_up_s']:.1f} |")
        print(row, flush=True)
    print(
        f"\n## episodes: useful new tokens/s, model {args.shape}, {args.turns} turns, {args.prompt_len}-token prompts, cuts uniform in "
        f"[4, {args.new_tokens}], {args.obs_tokens} observation tokens per turn, median of {args.repeats}"
    )
    print(
        "| episodes | static generate tok/s | engine, no prefix store tok/s | engine tok/s | engine / generate |"
        f"{columns}"
    )
    print("|---:" * (8 if compiled else 5) + "|")
    for episodes in args.episodes:
        r = time_episodes(
            model, episodes, args.turns, args.prompt_len, args.new_tokens, args.obs_tokens, args.repeats, compiled
        )
        row = (
            f"| {episodes} | {r['static_generate']:.0f} | {r['engine_no_prefix']:.0f} | {r['engine']:.0f} | "
            f"{r['engine'] / r['static_generate']:.2f} |"
        )
        if compiled:
            row += (f" {r['engine_compiled']:.0f} | {r['engine_compiled'] / r['static_generate']:.2f} | "
                    f"{r['compiled_warm_up_s']:.1f} |")
        print(row, flush=True)
    if compiled:
        from torch._dynamo.utils import counters

        print(f"\ngraphs compiled: {counters['stats']['unique_graphs']}")
    if not args.skip_streaming:
        r = time_streaming(args.device, dtype, args.stream_requests, args.prompt_len, args.new_tokens,
                           processes=args.stream_processes)
        where = "server and proxy in their own processes" if args.stream_processes else "server and proxy in threads"
        print(
            f"\n## streaming: /v1/completions, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, "
            f"median of {args.stream_requests}, one at a time, {where}; proxy records ids + log-probs"
        )
        print("| path | TTFT ms | tokens/s | TTFT / direct |")
        print("|---|---:|---:|---:|")
        for name in ("direct", "proxy"):
            print(
                f"| {name} | {1000 * r[name]['ttft']:.1f} | {r[name]['tps']:.0f} | "
                f"{r[name]['ttft'] / r['direct']['ttft']:.2f} |"
            )
    if args.skip_rollouts:
        return 0
    print(f"\n## agent loop: {args.rollouts} rollouts, concurrency {args.concurrency}, embedded sandboxes")
    print(
        "| policy | rollouts | steps | sampled tokens | wall s | rollouts/min | env errors | terminations |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for policy in ("scripted", "tiny-hf"):
        r = asyncio.run(time_rollouts(policy, args.rollouts, args.concurrency, args.steps, args.device))
        print(
            f"| {policy} | {r['rollouts']} | {r['steps']} | {r['tokens']} | {r['wall_s']:.1f} | {r['per_min']:.0f} | "
            f"{r['env_errors']} | {json.dumps(r['reasons'])} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
