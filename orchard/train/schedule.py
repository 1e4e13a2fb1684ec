"""Learning-rate schedule: linear warm-up, then cosine decay to a floor (the paper's SFT and RL schedules).

For optimizer step ``s`` (0-based), peak ``lr``, floor ``min_lr``, ``W`` warm-up steps and ``S`` total steps::

    lr(s) = lr · (s + 1) / W                                              s < W
    lr(s) = min_lr + (lr − min_lr) · ½ · (1 + cos(π · (s − W) / max(1, S − W − 1)))   W ≤ s < S
    lr(s) = min_lr                                                        s ≥ S

so the first step after warm-up runs at the peak and the last scheduled step (``S − 1``) at exactly ``min_lr``
(a decay of one step, ``S − W = 1``, is that one step at the peak).
The paper's defaults: SFT ``1e-5 → 1e-6``, RL ``1e-6 → 1e-7``.

Why not transformers' ``get_cosine_with_min_lr_schedule_with_warmup(opt, W, S, min_lr=...)``: with the same
``W`` and ``S`` it differs in three places:

- its warm-up is ``lr · s / W``: step 0 trains at lr 0 (ours starts at ``lr / W`` and reaches the peak at
  ``W − 1``; ours at ``s`` is its ``s + 1``);
- its decay's progress is ``(s − W) / (S − W)``: the last step ``S − 1`` still runs above ``min_lr`` (ours is
  its decay with ``S − 1`` training steps);
- past ``S`` its cosine rises again towards the peak; ours holds ``min_lr``.

``tests/train/test_schedule_metrics.py`` pins each difference, and that there is no other.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["cosine_lr", "cosine_schedule"]


def cosine_lr(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """The learning rate at optimizer step ``step`` (formula in the module docstring)."""
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    if not (0 <= min_lr <= lr):
        raise ValueError(f"min_lr must be in [0, lr={lr}], got {min_lr!r}")
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be an int >= 1, got {total_steps!r}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps - 1))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def cosine_schedule(
    optimizer: torch.optim.Optimizer, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int
) -> LambdaLR:
    """A ``LambdaLR`` following ``cosine_lr``; the optimizer's param groups must start at ``lr``.

    Its state (the step count) round-trips through ``state_dict`` / ``load_state_dict`` for checkpoints.
    """
    cosine_lr(0, lr=lr, min_lr=min_lr, warmup_steps=warmup_steps, total_steps=total_steps)  # validates
    return LambdaLR(
        optimizer,
        lambda s: cosine_lr(s, lr=lr, min_lr=min_lr, warmup_steps=warmup_steps, total_steps=total_steps) / lr,
    )
