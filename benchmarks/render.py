"""How long does rendering a trajectory to training tensors take, and does it stay linear in the number of turns?

For synthetic agent trajectories (system, task, then ``turns`` x [assistant text + one tool call, tool output of
``--obs-words`` words]) with sampled token ids on every assistant turn, times:

    baseline   tokenizer(apply_chat_template(messages))       one rendering + one tokenization, no masks: the floor
    render     orchard.data.render_trajectory                  default path: per-turn windows, one full check
    exact      the same with the windowed path disabled        renders every prefix (quadratic reference)

Median of ``--repeats`` calls after one warm-up, one thread, the offline tokenizer of the tests
(``orchard.data.tokenizer.build_chat_tokenizer``). Ratios are to ``baseline`` at the same size, in the same run.

    python benchmarks/render.py                       # turns 4 16 64 128
    python benchmarks/render.py --turns 8 256 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import orchard.data.render as render_module
from orchard.data import Trajectory, render_trajectory
from orchard.data.tokenizer import build_chat_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from env_latency import machine, timed


def make_trajectory(tokenizer, turns: int, obs_words: int) -> Trajectory:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Fix the failing test in src/main.py and report what you changed."},
    ]
    for i in range(turns):
        messages.append(
            {
                "role": "assistant",
                "content": f"Step {i}: run the tests.",
                "tool_calls": [
                    {
                        "id": f"c{i}",
                        "type": "function",
                        "function": {
                            "name": "exec",
                            "arguments": {"command": f"pytest -x tests/test_{i}.py"},
                        },
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": " ".join(["ok"] * obs_words)})
    traj = Trajectory(messages=messages)
    # Sampled ids: the template's tokenization of each assistant turn (what a canonical sampler would emit).
    for i, message in enumerate(traj.messages):
        if message.role == "assistant":
            full = tokenizer.apply_chat_template(traj.openai_messages()[: i + 1], tokenize=False)
            prompt = tokenizer.apply_chat_template(
                traj.openai_messages()[:i], tokenize=False, add_generation_prompt=True
            )
            action = full[len(prompt) :].rsplit("\n", 1)[0]
            message.token_ids = tokenizer(action, add_special_tokens=False)["input_ids"]
            message.logprobs = [-1.0] * len(message.token_ids)
    return traj


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up call."""
    return statistics.median(timed(fn, repeats, warmup=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[4, 16, 64, 128])
    parser.add_argument("--obs-words", type=int, default=100, help="words per tool output")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = build_chat_tokenizer()

    def baseline(traj: Trajectory) -> object:
        return tok(tok.apply_chat_template(traj.openai_messages(), tokenize=False), add_special_tokens=False)

    def exact(traj: Trajectory) -> object:
        windowed = render_module._segments_windowed
        render_module._segments_windowed = lambda *a, **k: None
        try:
            return render_trajectory(traj, tok)
        finally:
            render_module._segments_windowed = windowed

    info = machine()
    print(f"# machine: {info['machine']}; python {info['python']}; commit {info['commit']}")
    print(f"# tokenizer vocab {len(tok)}, {args.obs_words} words per tool output, median of {args.repeats}")
    header = f"{'turns':>6} {'tokens':>8} {'baseline ms':>12} {'render ms':>10} {'ratio':>6} {'exact ms':>10} {'ratio':>6}"
    print(header)
    for turns in args.turns:
        traj = make_trajectory(tok, turns, args.obs_words)
        sample = render_trajectory(traj, tok)
        assert sample is not None and sample.report.ok
        t_base = median_time(lambda traj=traj: baseline(traj), args.repeats)
        t_render = median_time(lambda traj=traj: render_trajectory(traj, tok), args.repeats)
        t_exact = median_time(lambda traj=traj: exact(traj), max(1, args.repeats // 2))
        print(
            f"{turns:>6} {len(sample):>8} {t_base * 1e3:>12.1f} {t_render * 1e3:>10.1f} {t_render / t_base:>6.2f} "
            f"{t_exact * 1e3:>10.1f} {t_exact / t_base:>6.2f}"
        )


if __name__ == "__main__":
    main()
