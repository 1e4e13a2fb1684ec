"""Ranks and sharding: the launcher's environment, task blocks, and the RL stage on 2 CPU ranks (gloo) against
one process, plus a rank that dies.

The child-process tests launch ``rl_worker.py``; each start of torch and DeepSpeed costs ~10-30 s on a busy
2-core machine, the RL steps themselves well under a second.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from orchard.stages import RLConfig, RolloutConfig, rl_stage
from orchard.stages.ranks import Ranks, all_gather_concat, all_reduce_sum, ranks_from_env, shard_range
from orchard.train.trainer import TrainConfig

HERE = Path(__file__).parent
REPO = HERE.parent.parent
WORKER = HERE / "rl_worker.py"
LAUNCH_TIMEOUT_S = 200


def test_shard_range_blocks_by_hand():
    # 5 tasks on 2 ranks: 5*0//2 = 0, 5*1//2 = 2, 5*2//2 = 5 -> [0, 2) and [2, 5).
    assert [list(shard_range(5, r, 2)) for r in range(2)] == [[0, 1], [2, 3, 4]]
    # 2 tasks on 3 ranks: bounds 0, 0, 1, 2 -> one rank plays nothing (a defined, empty block).
    assert [list(shard_range(2, r, 3)) for r in range(3)] == [[], [0], [1]]
    assert list(shard_range(0, 0, 1)) == []


@pytest.mark.parametrize("n", [0, 1, 7, 64, 101])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_shard_range_partitions_in_order_and_balances(n, world):
    blocks = [shard_range(n, r, world) for r in range(world)]
    assert [i for b in blocks for i in b] == list(range(n))  # rank order is task order: gathers need no sort
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_shard_range_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rank"):
        shard_range(4, 2, 2)
    with pytest.raises(ValueError, match="world_size"):
        shard_range(4, 0, 0)
    with pytest.raises(ValueError, match=r"^n "):
        shard_range(-1, 0, 1)


def test_ranks_from_env():
    assert ranks_from_env({}) == Ranks(0, 1, 0)
    assert ranks_from_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}) == Ranks(5, 8, 1)
    assert ranks_from_env({"RANK": "0", "WORLD_SIZE": "2"}).is_main
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        ranks_from_env({"WORLD_SIZE": "two"})
    with pytest.raises(ValueError, match="rank"):
        ranks_from_env({"RANK": "2", "WORLD_SIZE": "2"})


def test_collectives_are_identities_on_one_process():
    assert all_gather_concat(("a", 1)) == ["a", 1]
    assert all_reduce_sum({"b": 2, "a": 1.5}) == {"a": 1.5, "b": 2.0}


def test_rl_stage_under_several_ranks_needs_deepspeed(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = RLConfig(steps=1, tasks_per_step=1, group_size=2, train=TrainConfig(engine="plain"))
    with pytest.raises(ValueError, match="engine must be 'deepspeed' under 2 ranks"):
        asyncio.run(rl_stage(torch.nn.Linear(1, 1), None, {"a": None}, [0], cfg, rollout=RolloutConfig(),
                             pad_id=0, seed=0, output_dir="unused"))


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "build" / "torch_extensions"))
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(args: list[str]) -> None:
    proc = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 60)
def test_two_ranks_train_the_parameters_of_one_process(tmp_path, deepspeed_cpu_comm_op):
    """2 RL steps (5 tasks x 3 members, 2 mini-batches each, one flat group dropped in step 2) on 2 gloo ranks
    under ZeRO-2 give the weights of one plain-torch process with the same seeds, to float summation order."""
    _run([sys.executable, str(WORKER), str(tmp_path / "one"), "plain"])
    torchrun = Path(sys.executable).parent / "torchrun"
    _run([str(torchrun), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
          str(WORKER), str(tmp_path / "two"), "deepspeed"])
    one = torch.load(tmp_path / "one" / "rank0.pt")
    ranks = [torch.load(tmp_path / "two" / f"rank{r}.pt") for r in range(2)]
    # Each rank played its own block of every step's tasks: together exactly the tasks of the one process.
    for name in ("a", "b"):
        assert sorted(ranks[0]["played"][name] + ranks[1]["played"][name]) == sorted(one["played"][name])
        assert ranks[0]["played"][name] and ranks[1]["played"][name]
    assert one["weights"].keys() == ranks[0]["weights"].keys()
    for name, value in one["weights"].items():
        # Adam normalises each coordinate, so summation-order noise shows as ~1e-7 of lr=1e-3 updates; a lost
        # group or a rank-local normaliser moves weights by ~lr.
        torch.testing.assert_close(ranks[0]["weights"][name], value, rtol=0, atol=2e-5, msg=name)
        assert torch.equal(ranks[1]["weights"][name], ranks[0]["weights"][name]), name
    for mine, ref in zip(ranks[0]["history"], one["history"], strict=True):
        for key in ("rl/episodes", "rl/groups", "rl/groups_with_signal", "rl/sequences", "rl/success",
                    "tokens/action", "batch/sequences"):
            assert mine[key] == ref[key], key
        assert mine["loss/policy"] == pytest.approx(ref["loss/policy"], rel=1e-5)
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    # Evaluation shards its 7 tasks (3 + 4) and gathers: every rank reports the rows of the one process.
    # Tasks 0-6 x 3 attempts: member j of task t passes when (t + j) mod 3 == 0 and t != 3, so 6 tasks pass once
    # -> success (6 / 3) / 7 = 0.2857, pass@3 6/7, pass^3 0.
    assert ranks[0]["eval"] == ranks[1]["eval"] == one["eval"]
    assert one["eval"]["a"]["success"] == pytest.approx(2 / 7) and one["eval"]["a"]["tasks"] == 7
    assert one["history"][1]["rl/groups_with_signal"] == 4.0  # the flat group (task t mod 4 == 3) was dropped
    # The task filter shards its 7 tasks too, and every rank keeps the same ones: 6 attempts = 3 per harness
    # (members 0-2), so each task passes once per harness, p̂ = 2/6, except task 3 (t mod 4 == 3, never): 0.
    assert ranks[0]["filter"] == ranks[1]["filter"] == one["filter"]
    assert one["filter"]["tasks"] == [0, 1, 2, 4, 5, 6]
    assert one["filter"]["pass_rate"] == pytest.approx([1 / 3] * 3 + [0.0] + [1 / 3] * 3)
    assert one["filter"]["stats"]["filter/episodes"] == 42.0  # 7 tasks x 6, over both ranks


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_a_sigkilled_rank_ends_the_job_within_a_bounded_time(tmp_path):
    """Rank 1 dies mid-rollout of step 2 with no launcher agent to stop rank 0: rank 0, waiting in the gather of
    step 2, must fail (a dead peer, or at the latest the process group's 60 s timeout), not hang."""
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), "deepspeed", "1"],
                              env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=port),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
             for r in range(2)]
    try:
        assert procs[1].wait(timeout=LAUNCH_TIMEOUT_S) == -signal.SIGKILL
        died = time.monotonic()
        code = procs[0].wait(timeout=60 + 30)  # rl_worker.TIMEOUT_S plus slack for a busy machine
        assert code != 0 and time.monotonic() - died < 90
        assert not (tmp_path / "rank0.pt").exists()
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
