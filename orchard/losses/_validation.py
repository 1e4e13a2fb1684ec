"""Input checks and masking helpers shared by the loss functions.

Every check raises ``ValueError`` naming the argument and what it got. None of them reads tensor values, so
none forces a device sync, except ``check_counted``, which the losses run only when called with
``validate=True``.
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


LOGPROB_TOL = 1e-4
"""How far above 0 a log-probability may read before ``validate=True`` refuses it: engines and bf16 forward
passes round ``log p`` of a near-certain token to small positive values."""


def as_bool_mask(name: str, mask: object, ref_name: str, ref: Tensor) -> Tensor:
    """Check that ``mask`` matches ``ref`` in shape and return it as a bool tensor (nonzero means counted)."""
    mask = check_same_shape(name, mask, ref_name, ref)
    if mask.is_complex():
        raise ValueError(f"{name} must be bool, integer or float, got dtype {mask.dtype}")
    return mask if mask.dtype == torch.bool else mask != 0


def as_weighted_mask(name: str, mask: object, ref_name: str, ref: Tensor) -> tuple[Tensor, Tensor | None]:
    """``(counted, weight)``: the bool mask (nonzero counts) and, for a non-bool mask, its values as per-token
    weights in ``ref``'s dtype (``None`` for a bool mask: every counted token weighs 1)."""
    counted = as_bool_mask(name, mask, ref_name, ref)
    assert isinstance(mask, Tensor)
    return counted, None if mask.dtype == torch.bool else mask.to(ref.dtype)


def check_counted(name: str, value: Tensor, counted: Tensor, *, logprob: bool = False) -> None:
    """Opt-in anomaly check (it reads values: one device sync): ``value`` must be finite at counted positions,
    and at most ``LOGPROB_TOL`` there if it holds log-probabilities. The error names the tensor, the first bad
    position and its value. Masked positions are not looked at."""
    bad = ~torch.isfinite(value)
    condition = "finite"
    if logprob:
        bad |= value > LOGPROB_TOL
        condition = f"finite and <= {LOGPROB_TOL:g} (a log-probability)"
    bad &= counted
    if bool(bad.any()):
        position = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} must be {condition} at counted positions, got {value[position].item()!r} at position {position}"
        )


def validate_counted(
    mask: Tensor,
    counted: Tensor,
    *,
    logprobs: dict[str, Tensor] | None = None,
    values: dict[str, Tensor] | None = None,
) -> None:
    """What ``validate=True`` checks in a loss: the mask's weights, then each named log-prob tensor (finite,
    ``<= LOGPROB_TOL``) and each named value tensor (finite), at counted positions only."""
    check_mask_weights("mask", mask)
    for name, value in (logprobs or {}).items():
        check_counted(name, value, counted, logprob=True)
    for name, value in (values or {}).items():
        check_counted(name, value, counted)


def check_mask_weights(name: str, mask: Tensor) -> None:
    """Opt-in check (one device sync) that a mask's values are usable weights: finite and ``>= 0``."""
    if mask.dtype == torch.bool:
        return
    bad = ~torch.isfinite(mask) | (mask < 0) if mask.is_floating_point() else mask < 0
    if bool(bad.any()):
        position = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} must hold finite weights >= 0, got {mask[position].item()!r} at position {position}"
        )


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
