"""Shared by the two fused lm-head paths (``fused_logprobs``, ``fused_loss``): input checks and precisions."""

from __future__ import annotations

import math

import torch
from torch import Tensor

DEFAULT_VOCAB_CHUNK_SIZE = 4096
"""Vocabulary entries per block (151,936 / 4096 → 38 blocks for Qwen3's vocabulary)."""

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32



def check_chunk(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def validate_head_inputs(
    hidden: object, weight: object, labels: object, bias: object, temperature: object, ignore_index: int | None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, float]:
    """Checks shared by both public functions; ``ignore_index=None`` means every label must be a real token."""
    for name, value in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(value, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    assert isinstance(hidden, Tensor) and isinstance(weight, Tensor) and isinstance(labels, Tensor)
    if hidden.dim() != 2:
        raise ValueError(f"hidden must have shape [T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must have shape [V, H], got shape {tuple(weight.shape)}")
    if labels.dim() != 1:
        raise ValueError(f"labels must have shape [T], got shape {tuple(labels.shape)}")
    if hidden.dtype not in INPUT_DTYPES:
        raise ValueError(f"hidden must be float16, bfloat16, float32 or float64, got dtype {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight must have the dtype of hidden ({hidden.dtype}), got dtype {weight.dtype}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got dtype {labels.dtype}")
    if weight.shape[0] < 1:
        raise ValueError(f"weight must have at least one vocabulary row, got shape {tuple(weight.shape)}")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight must have shape [V, H] with H = hidden.shape[1] = {hidden.shape[1]}, "
            f"got shape {tuple(weight.shape)}"
        )
    if labels.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"labels must have shape [T] with T = hidden.shape[0] = {hidden.shape[0]}, got shape {tuple(labels.shape)}"
        )
    for name, value in (("weight", weight), ("labels", labels)):
        if value.device != hidden.device:
            raise ValueError(f"{name} must be on the device of hidden ({hidden.device}), got {value.device}")
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise ValueError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.shape != weight.shape[:1]:
            raise ValueError(f"bias must have shape [V] = ({weight.shape[0]},), got shape {tuple(bias.shape)}")
        if bias.dtype != weight.dtype or bias.device != weight.device:
            raise ValueError(
                f"bias must match weight's dtype {weight.dtype} and device {weight.device}, "
                f"got {bias.dtype} on {bias.device}"
            )
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    # one device sync: an out-of-range label would otherwise gather a wrong column silently
    outside = (labels < 0) | (labels >= weight.shape[0])
    if ignore_index is not None:
        outside &= labels != ignore_index
    if labels.numel() and bool(outside.any()):
        bad = labels[outside][:5].tolist()
        allowed = "" if ignore_index is None else f" or equal ignore_index={ignore_index}"
        raise ValueError(f"labels must lie in [0, V) = [0, {weight.shape[0]}){allowed}, got values such as {bad}")
    return hidden, weight, labels.long(), bias, float(temperature)  # gather and scatter want int64 indices
