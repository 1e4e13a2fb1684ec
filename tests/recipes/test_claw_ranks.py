"""The Claw recipe, unchanged, on 2 CPU ranks (gloo, DeepSpeed ZeRO-2): rank 0 writes every output, rank 1 none but
the trajectories of the episodes it played.

The two ranks are started the way ``torchrun --nproc_per_node 2`` starts them (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) but each with its own ``output_dir``, so whatever rank 1 wrote
would be found under its own directory instead of hiding among rank 0's files.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from orchard.domains.claw.tasks import TEMPLATES

ROOT = Path(__file__).resolve().parents[2]

TINY = [
    "harnesses=[react]", "eval.harnesses=[react]", "tasks.train_per_template=1", "tasks.heldout_per_template=1",
    "eval.attempts=1", "sft.epochs=1", "sft.train.global_batch_size=4", "sft.train.micro_batch_size=2",
    "sft.train.engine=deepspeed", "rl.steps=1", "rl.tasks_per_step=2", "rl.group_size=2", "rl.reward=score",
    "rl.train.global_batch_size=4", "rl.train.micro_batch_size=2", "rl.train.engine=deepspeed",
    "model.hidden_size=32", "model.num_layers=1", "rollout.max_steps=3", "rollout.max_tokens=16",
    "rollout.concurrency=8", "threads=1",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.timeout(560)
def test_claw_recipe_on_two_ranks_writes_only_from_rank_0_but_its_episodes(tmp_path, deepspeed_cpu_comm_op):
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "build" / "torch_extensions"))
    procs = [subprocess.Popen([sys.executable, str(ROOT / "recipes/claw.py"), "--config",
                               str(ROOT / "recipes/configs/claw_tiny.yaml"), f"output_dir={tmp_path / f'rank{r}'}",
                               *TINY],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        outputs = [p.communicate(timeout=500) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    # Rank 1 writes only the episodes it played, each rank to files of its own (no collective in a rollout call)
    rank1 = [p.relative_to(tmp_path / "rank1").as_posix() for p in (tmp_path / "rank1").rglob("*") if p.is_file()]
    assert rank1 and all(name.startswith("trajectories/") and name.endswith(".rank1.jsonl.gz") for name in rank1)
    out = tmp_path / "rank0"
    from orchard.data import read_jsonl

    # the RL step's 4 episodes, split between the ranks' files
    assert len(read_jsonl(out / "trajectories" / "rl.rank0.jsonl.gz")) + \
        len(read_jsonl(tmp_path / "rank1" / "trajectories" / "rl.rank1.jsonl.gz")) == 4
    for name in ("metrics.jsonl", "results.json", "learning_curve.png", "sft_model", "rl_model",
                 "sft/metrics.jsonl", "rl/metrics.jsonl"):
        assert (out / name).exists(), name
    results = json.loads((out / "results.json").read_text())["results"]
    # Evaluation is sharded over the ranks and gathered: rank 0 reports every held-out task (1 per template).
    assert {stage: row["react"]["tasks"] for stage, row in results.items()} == \
        {"base": len(TEMPLATES), "sft": len(TEMPLATES), "rl": len(TEMPLATES)}
    rl_rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
               if "rl/episodes" in line]
    assert [r["rl/episodes"] for r in rl_rows] == [4.0]  # 2 tasks x 2 members, over both ranks
    assert "rl step 1" in outputs[0][0] and "rl step" not in outputs[1][0]  # rank 1 prints no progress either
