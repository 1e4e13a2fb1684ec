"""Shared helpers of the trainer tests: a tiny model and synthetic rendered batches."""

from __future__ import annotations

import torch

from orchard.train.tiny import tiny_qwen3

VOCAB = 97


def make_model(seed: int = 0) -> torch.nn.Module:
    """A tiny random Qwen3 (vocabulary 97) in float32, eager attention for bitwise-stable CPU runs."""
    return tiny_qwen3(VOCAB, seed=seed, attn_implementation="eager").train()


def make_batch(B: int, T: int, *, seed: int) -> dict[str, torch.Tensor]:
    """A right-padded batch shaped like ``orchard.data.collate``'s, with every tensor a term may read.

    Row lengths vary in [T//2, T]; action tokens are two contiguous runs per row (two assistant turns);
    ``sft_mask`` keeps the second run only; advantages are per row, broadcast on action tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(2, T // 2), T + 1, (B,), generator=gen)
    lengths[0] = T
    input_ids = torch.randint(0, VOCAB, (B, T), generator=gen)
    attention = torch.arange(T)[None, :] < lengths[:, None]  # [B, T]
    input_ids[~attention] = 0
    action = torch.zeros(B, T, dtype=torch.bool)
    turn = torch.full((B, T), -1, dtype=torch.long)
    sft = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        n = int(lengths[b])
        a0, a1 = n // 4, n // 2
        action[b, a0:a1] = True
        turn[b, a0:a1] = 0
        b0 = (3 * n) // 4
        action[b, b0:n] = True
        turn[b, b0:n] = 1
        sft[b, b0:n] = True
    adv_B = torch.randn(B, generator=gen)
    return {
        "input_ids": input_ids,
        "attention_mask": attention.long(),
        "action_mask": action,
        "turn_index": turn,
        "old_logprobs": torch.where(action, -torch.rand(B, T, generator=gen) * 3 - 0.5, torch.zeros(())),
        "teacher_logprobs": torch.where(action, -torch.rand(B, T, generator=gen) * 3 - 0.5, torch.zeros(())),
        "ref_logprobs": torch.where(action, -torch.rand(B, T, generator=gen) * 3 - 0.5, torch.zeros(())),
        "advantages": adv_B[:, None] * action.float(),
        "sft_mask": sft,
    }
