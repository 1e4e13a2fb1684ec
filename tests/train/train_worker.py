"""A training run the tests launch as a child process (plain, or DeepSpeed under ``torchrun``).

Usage: ``python train_worker.py OUT_DIR ENGINE ZERO_STAGE STEPS [MICRO] [KILL_AFTER]``. It trains the tiny model
from ``train_helpers.make_model`` for STEPS optimizer steps on ``train_helpers.make_batch`` data, with a
checkpoint every 2 steps, and writes ``metrics.jsonl`` and (rank 0) ``OUT_DIR/final.pt`` with the full weights
and the weights handed to the ``on_weights`` callback. With KILL_AFTER=k it stops dead (no clean exit) once step
k is done (logged; checkpointed when k is even), saves the weights after step k to ``OUT_DIR/killed.pt``, writes
``OUT_DIR/killme`` (rank 0) and waits for the test's SIGKILL.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)

from train_helpers import make_batch, make_model  # noqa: E402

from orchard.train.objective import LossTerm  # noqa: E402
from orchard.train.trainer import OptimConfig, TrainConfig, Trainer  # noqa: E402


def main() -> None:
    out, engine, stage, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    micro = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    kill_after = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    cfg = TrainConfig(
        total_steps=steps, global_batch_size=6, micro_batch_size=micro, engine=engine, zero_stage=stage,
        output_dir=out, checkpoint_every=2, keep_checkpoints=2, seed=3,
        optim=OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=1, weight_decay=0.01, eps=1e-6, grad_clip=0.5),
        objective=[LossTerm("policy", 1.0), LossTerm("sft", 0.3), LossTerm("k3_opd", 0.1)],
    )
    handed: dict[int, dict[str, torch.Tensor]] = {}
    trainer = Trainer(make_model(seed=1), cfg, on_weights=lambda step, sd: handed.__setitem__(step, sd))
    # Data of step s depends on s and on the RNG (dropout-free model, so the RNG shows only here).
    while trainer.step < steps:
        batch = make_batch(6, 21, seed=100 + trainer.step)
        noise = torch.rand(6)  # drawn from the global RNG: a resumed run reproduces it only if RNG state is restored
        batch["advantages"] = batch["advantages"] * (1 + noise[:, None])
        trainer.train_step(batch)
        if kill_after and trainer.step == kill_after:
            if trainer.engine.rank == 0:
                # The weights after the kill step, for the test to compare the resumed run's replay with.
                torch.save({"full": handed[kill_after]}, Path(out) / "killed.pt")
                Path(out, "killme").write_text(str(os.getpid()))
            time.sleep(600)
    full = trainer.full_state_dict()
    if trainer.engine.rank == 0:
        torch.save({"full": full, "handed_last": handed[steps]}, Path(out) / "final.pt")
    trainer.close()


if __name__ == "__main__":
    main()
