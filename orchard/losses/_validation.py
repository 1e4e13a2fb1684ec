"""Input checks and masking helpers shared by the loss functions.

Every check raises ``ValueError`` naming the argument and what it got. None of them reads tensor values, so
none forces a device sync.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def check_tensor(name: str, value: object) -> Tensor:
    """Return ``value`` if it is a tensor, else raise naming ``name``."""
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_bt(name: str, value: object) -> Tensor:
    """Return ``value`` if it is a 2-D ``[B, T]`` tensor."""
    tensor = check_tensor(name, value)
    if tensor.dim() != 2:
        raise ValueError(f"{name} must have shape [B, T], got shape {tuple(tensor.shape)}")
    return tensor


def check_float(name: str, value: object) -> Tensor:
    """Return ``value`` if it is a floating-point tensor."""
    tensor = check_tensor(name, value)
    if not tensor.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")
    return tensor


def check_same_shape(name: str, value: object, ref_name: str, ref: Tensor) -> Tensor:
    """Return ``value`` if it is a tensor shaped like ``ref``."""
    tensor = check_tensor(name, value)
    if tensor.shape != ref.shape:
        raise ValueError(
            f"{name} must have the shape of {ref_name} {tuple(ref.shape)}, got shape {tuple(tensor.shape)}"
        )
    return tensor


def as_bool_mask(name: str, mask: object, ref_name: str, ref: Tensor) -> Tensor:
    """Check that ``mask`` matches ``ref`` in shape and return it as a bool tensor (nonzero means counted)."""
    mask = check_same_shape(name, mask, ref_name, ref)
    if mask.is_complex():
        raise ValueError(f"{name} must be bool, integer or float, got dtype {mask.dtype}")
    return mask if mask.dtype == torch.bool else mask != 0


def check_real(name: str, value: object, condition: str = "") -> float:
    """Return ``value`` as a float if it is a finite real number (not a bool), else raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number{condition}, got {value!r}")
    return float(value)


def check_positive_number(name: str, value: object, *, allow_tensor: bool = False) -> None:
    """Check a positive finite hyperparameter. A 0-dim tensor is accepted when ``allow_tensor`` (unread)."""
    if allow_tensor and isinstance(value, Tensor):
        if value.dim() != 0:
            raise ValueError(f"{name} must be a scalar, got tensor of shape {tuple(value.shape)}")
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def zero_outside(mask: Tensor, value: Tensor) -> Tensor:
    """``value`` where ``mask`` else 0, by selection rather than multiplication.

    ``0 * nan`` is ``nan``; selection drops whatever the masked positions hold, in the value and in the
    gradient, which is zero there.
    """
    return torch.where(mask, value, torch.zeros((), dtype=value.dtype, device=value.device))


def masked_mean(value: Tensor, mask: Tensor, *, empty: float = 0.0) -> Tensor:
    """Mean of ``value`` over ``mask`` (any shape); ``empty`` when the mask selects nothing."""
    count = mask.sum()
    total = zero_outside(mask, value).sum()
    mean = total / count.clamp(min=1)
    return torch.where(count > 0, mean, torch.full_like(mean, empty))


def masked_max(value: Tensor, mask: Tensor, *, empty: float = 0.0) -> Tensor:
    """Max of ``value`` over ``mask``; ``empty`` when the mask selects nothing."""
    filled = torch.where(mask, value, torch.full_like(value, -math.inf))
    out = (
        filled.max() if filled.numel() else torch.full((), -math.inf, dtype=value.dtype, device=value.device)
    )
    return torch.where(mask.any(), out, torch.full_like(out, empty))


def masked_min(value: Tensor, mask: Tensor, *, empty: float = 0.0) -> Tensor:
    """Min of ``value`` over ``mask``; ``empty`` when the mask selects nothing."""
    return -masked_max(-value, mask, empty=-empty)
