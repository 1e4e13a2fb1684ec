"""Decision steps of rendered sequences: a step is one assistant response, its value read at its last token.

``orchard.data.collate`` gives ``turn_index`` ``[B, T]``: the assistant step ``k = 0, 1, ...`` of each action
token, ``-1`` on every other token (system, user, tool output, padding). Step ``k`` of row ``b`` ends at the
largest position ``t`` with ``turn_index[b, t] == k``; environment tokens are never steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["gather_step_values", "step_end_positions"]


def step_end_positions(turn_index: Tensor) -> tuple[Tensor, Tensor]:
    """Last-token position of every decision step.

    Args:
        turn_index: assistant step index per token, ``-1`` off steps. Shape: ``[B, T]``, integer.

    Returns:
        ``(positions, step_mask)``, both ``[B, S]`` with ``S = max step index + 1`` (at least 1):
        ``positions[b, k]`` is the last token of step ``k`` (0 where absent) and ``step_mask[b, k]`` says whether
        row ``b`` has step ``k``. A step index that is missing in a row (a gap) is a masked hole.
    """
    if not isinstance(turn_index, Tensor) or turn_index.dim() != 2:
        got = tuple(turn_index.shape) if isinstance(turn_index, Tensor) else type(turn_index).__name__
        raise ValueError(f"turn_index must be an integer tensor of shape [B, T], got {got}")
    if turn_index.is_floating_point() or turn_index.dtype == torch.bool:
        raise ValueError(f"turn_index must be an integer tensor, got dtype {turn_index.dtype}")
    if (turn_index < -1).any():
        raise ValueError(f"turn_index must be >= -1, got min {int(turn_index.min())}")
    B, T = turn_index.shape
    S = max(1, int(turn_index.max()) + 1) if turn_index.numel() else 1
    on_step = turn_index >= 0  # [B, T]
    pos = torch.arange(T, device=turn_index.device).expand(B, T)  # [B, T]
    # Scatter each step token's position into slot [b, k]; amax keeps the last one. Off-step tokens go to a
    # spare slot S that is dropped.
    slot = torch.where(on_step, turn_index, torch.full_like(turn_index, S))  # [B, T]
    ends = torch.full((B, S + 1), -1, dtype=torch.long, device=turn_index.device)
    ends.scatter_reduce_(1, slot, torch.where(on_step, pos, torch.full_like(pos, -1)), reduce="amax")
    ends = ends[:, :S]  # [B, S]
    step_mask = ends >= 0
    return ends.clamp(min=0), step_mask


def gather_step_values(token_values: Tensor, turn_index: Tensor) -> tuple[Tensor, Tensor]:
    """Per-step values ``[B, S]`` read from per-token values ``[B, T]`` at each step's last token, and the step mask.

    Masked steps hold 0.
    """
    if not isinstance(token_values, Tensor) or token_values.shape != turn_index.shape:
        got = tuple(token_values.shape) if isinstance(token_values, Tensor) else type(token_values).__name__
        raise ValueError(f"token_values must have the shape of turn_index {tuple(turn_index.shape)}, got {got}")
    positions, step_mask = step_end_positions(turn_index)
    values = token_values.gather(1, positions)  # [B, S]
    return torch.where(step_mask, values, torch.zeros((), dtype=values.dtype, device=values.device)), step_mask
