"""The value-model stage on a pool with a known signal: the outcome is written in the last assistant turn."""

import asyncio
import contextlib
import json
import math

import pytest
import torch

from orchard.data import Trajectory
from orchard.data.tokenizer import build_chat_tokenizer
from orchard.stages import RecordedRollouts, plot_value_curves, value_rerank_stage
from orchard.train.tiny import tiny_qwen3
from orchard.value import ValueModel


def traj(task, ok, reason="done"):
    """Two decision steps; the second says "pass" on a resolved trajectory (+1) and "fail" on a failed one (-1)."""
    return Trajectory(messages=[{"role": "user", "content": f"task {task}: fix it"},
                                {"role": "assistant", "content": "looking"},
                                {"role": "tool", "content": "output of a tool", "tool_call_id": "c"},
                                {"role": "assistant", "content": "pass" if ok else "fail"}],
                      reward=None if reason == "env_error" else (1.0 if ok else -1.0), task_id=task,
                      termination_reason=reason)


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer(["pass fail looking task fix it output of a tool"])


@pytest.mark.slow
def test_value_reranking_finds_the_resolved_candidate(tok, tmp_path):
    torch.manual_seed(0)
    # Pool: 24 tasks, alternately resolved and failed, plus dead sandboxes that must not train.
    pool = [traj(f"t{i}", i % 2 == 0) for i in range(24)] + [traj("dead", True, "env_error")]
    # Held out: 6 groups of N = 6 with exactly 2 resolved each, at different places.
    # random = 2/6 = 1/3 exactly; oracle = 1 (every group has a resolved candidate).
    held = [traj(f"h{g}", i in (g % 6, (g + 3) % 6)) for g in range(6) for i in range(6)]
    vm = ValueModel.from_causal_lm(tiny_qwen3(tok, seed=0), seed=0)
    result = value_rerank_stage(pool, held, vm, tok, max_per_task=4, steps=40, batch_size=8, lr=3e-3, seed=0)
    rep = result.report
    assert rep["rerank/groups"] == 6 and rep["rerank/n"] == 6
    assert rep["rerank/random"] == pytest.approx(1 / 3) and rep["rerank/oracle"] == 1.0
    # The head read the outcome: argmax V is a resolved candidate in every group.
    assert rep["rerank/success"] == 1.0
    # Balanced pool: 12 resolved + 12 failed, the dead sandbox left out.
    assert rep["value/pool"] == 24 and rep["value/pool_success"] == 0.5 and rep["value/candidates"] == 36
    assert result.history[-1]["value/mse"] < result.history[0]["value/mse"]
    # Curves: two decision steps per candidate; by the last step resolved ones are valued above failed ones.
    assert len(result.curves) == 36 and all(len(c["values"]) == 2 for c in result.curves)
    last = {ok: [c["values"][-1] for c in result.curves if c["resolved"] == ok] for ok in (True, False)}
    assert min(last[True]) > max(last[False])
    plot_value_curves(result.curves, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 5_000


def test_empty_pool_trains_nothing_and_reports_defined_rates(tok):
    vm = ValueModel.from_causal_lm(tiny_qwen3(tok, seed=0), seed=0)
    # Only a dead sandbox in the pool; held-out groups of 2 with one resolved each: random 1/2, oracle 1.
    held = [traj(f"h{g}", i == 0) for g in range(2) for i in range(2)]
    result = value_rerank_stage([traj("dead", True, "env_error")], held, vm, tok, steps=3)
    assert result.history == [] and result.report["value/pool"] == 0 and result.report["value/pool_success"] == 0
    assert result.report["rerank/random"] == 0.5 and result.report["rerank/oracle"] == 1.0
    assert all(math.isfinite(v) for v in result.report.values())
    nothing = value_rerank_stage([], [], vm, tok, steps=3)
    assert nothing.report["rerank/groups"] == 0 and nothing.curves == []


def test_recorded_rollouts_keep_every_call():
    class Two:
        async def __call__(self, engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
            return [traj(t, True) for t in tasks for _ in range(group_size)]

    rec = RecordedRollouts(Two())
    first = asyncio.run(rec(None, ["a"], group_size=2, temperature=1.0))
    asyncio.run(rec(None, ["b", "c"], group_size=1, temperature=1.0))
    assert [len(c) for c in rec.calls] == [2, 2] and rec.calls[0] == first
    assert [t.task_id for t in rec.trajectories] == ["a", "a", "b", "c"]
    # Two recorders on one list keep the calls' common order.
    shared = []
    bash, tool = RecordedRollouts(Two(), shared), RecordedRollouts(Two(), shared)
    asyncio.run(tool(None, ["x"], group_size=1, temperature=1.0))
    asyncio.run(bash(None, ["y"], group_size=1, temperature=1.0))
    assert [c[0].task_id for c in shared] == ["x", "y"] and bash.calls is tool.calls is shared


def test_value_rerank_phase_plays_candidates_in_their_pool_and_writes_its_report(tok, tmp_path):
    from orchard.stages import ValueRerankConfig, value_rerank_phase

    asked, sizes, lines, rows = [], [], [], []

    async def harness(engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
        asked.append((list(tasks), group_size, temperature))
        return [traj(t, i == 0) for t in tasks for i in range(group_size)]  # the first candidate of each resolves

    class Pools:
        def stage(self, n):
            sizes.append(n)
            return contextlib.nullcontext()

    class Log:
        def log(self, metrics, step):
            rows.append((dict(metrics), step))

        def print(self, line):
            lines.append(line)

    policy = tiny_qwen3(tok, seed=0)
    cfg = ValueRerankConfig(candidates=3, steps=1, batch_size=2)
    result = asyncio.run(value_rerank_phase(cfg, harness, None, ["h0", "h1"], [traj("t0", True), traj("t1", False)],
                                            tok, policy=policy, temperature=0.7, output_dir=tmp_path, log=Log(),
                                            sandboxes=Pools()))
    # 2 held-out tasks x 3 candidates, in one pool of that size, at the evaluation temperature
    assert asked == [(["h0", "h1"], 3, 0.7)] and sizes == [6]
    # one training step logged, then the report (step 0) and its line; random = 1/3, oracle = 1 (by construction)
    assert len(result.history) == 1 and rows[-1] == (result.report, 0)
    assert result.report["rerank/random"] == pytest.approx(1 / 3) and result.report["rerank/oracle"] == 1.0
    assert lines[-1].startswith("best-of-3 on 2 held-out tasks: value ")
    saved = json.loads((tmp_path / "rerank.json").read_text())
    assert saved["report"] == result.report and len(saved["curves"]) == 6
    assert (tmp_path / "value_curves.png").stat().st_size > 5_000
    with pytest.raises(ValueError, match="candidates must be an int >= 2, got 1"):
        ValueRerankConfig(candidates=1)
