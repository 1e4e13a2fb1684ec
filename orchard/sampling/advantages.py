"""Group-relative advantages: GRPO, Dr.GRPO and RLOO baselines over ``[G, N]`` reward groups.

Notation: ``G`` groups (one per task / prompt), ``N`` rollouts per group, ``r_gi`` the scalar reward of rollout
``i`` in group ``g``, ``m_gi`` its validity (a rollout dropped for an environment error is invalid), ``n_g`` the
number of valid members of group ``g``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from orchard._registry import Registry

ArrayT = TypeVar("ArrayT", torch.Tensor, np.ndarray)

ADVANTAGE_ESTIMATORS: Registry[Callable[..., object]] = Registry("advantage estimator")


def _as_tensor(x: object, arg: str) -> tuple[torch.Tensor, bool]:
    """Convert a ``[G, N]`` torch tensor / numpy array / nested list to a float tensor; remember numpy-ness."""
    if isinstance(x, torch.Tensor):
        t, was_numpy = x, False
    else:
        try:
            arr = np.asarray(x)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{arg} must be a [G, N] array, got {type(x).__name__}: {e}") from e
        if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
            raise ValueError(f"{arg} must be a numeric [G, N] array, got dtype {arr.dtype}")
        t, was_numpy = torch.from_numpy(arr.astype(np.float64, copy=False)), True
    if t.dim() != 2:
        raise ValueError(f"{arg} must have shape [G, N], got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        t = t.to(torch.float32 if not was_numpy else torch.float64)
    return t, was_numpy


def _prepare(
    rewards_GN: object, mask_GN: object | None
) -> tuple[torch.Tensor, torch.Tensor, bool, torch.dtype | None]:
    r_GN, was_numpy = _as_tensor(rewards_GN, "rewards_GN")
    out_dtype = None if was_numpy else r_GN.dtype
    if mask_GN is None:
        m_GN = torch.ones_like(r_GN, dtype=torch.bool)
    else:
        m_GN = mask_GN if isinstance(mask_GN, torch.Tensor) else torch.as_tensor(np.asarray(mask_GN))
        if tuple(m_GN.shape) != tuple(r_GN.shape):
            raise ValueError(
                f"mask_GN must have the shape of rewards_GN {tuple(r_GN.shape)}, got {tuple(m_GN.shape)}"
            )
        m_GN = m_GN.to(device=r_GN.device).bool()
    r_GN = r_GN.to(torch.float64)
    valid = r_GN[m_GN]
    if not torch.isfinite(valid).all():
        raise ValueError("rewards_GN must be finite on valid members, got NaN or inf")
    # Masked members may hold garbage (NaN, inf); zero them so they cannot leak into sums.
    r_GN = torch.where(m_GN, r_GN, torch.zeros_like(r_GN))
    return r_GN, m_GN, was_numpy, out_dtype


def _finish(adv_GN: torch.Tensor, was_numpy: bool, dtype: torch.dtype | None) -> torch.Tensor | np.ndarray:
    if was_numpy:
        return adv_GN.cpu().numpy()
    return adv_GN.to(dtype)


def _group_stats(
    r_GN: torch.Tensor, m_GN: torch.Tensor, unbiased: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group valid count, mean, std and an "all equal" flag, each ``[G, 1]``."""
    mf_GN = m_GN.to(r_GN.dtype)
    n_G1 = mf_GN.sum(dim=1, keepdim=True)  # [G, 1]
    mean_G1 = r_GN.sum(dim=1, keepdim=True) / n_G1.clamp(min=1)
    centred_GN = (r_GN - mean_G1) * mf_GN
    dof_G1 = (n_G1 - 1).clamp(min=1) if unbiased else n_G1.clamp(min=1)
    std_G1 = (centred_GN.square().sum(dim=1, keepdim=True) / dof_G1).sqrt()
    if r_GN.shape[1] == 0:
        return n_G1, mean_G1, std_G1, torch.ones_like(n_G1, dtype=torch.bool)
    big = torch.finfo(r_GN.dtype).max
    hi_G1 = torch.where(m_GN, r_GN, torch.full_like(r_GN, -big)).amax(dim=1, keepdim=True)
    lo_G1 = torch.where(m_GN, r_GN, torch.full_like(r_GN, big)).amin(dim=1, keepdim=True)
    # Exact test, not std == 0: the mean of equal floats can differ from them by one ulp.
    flat_G1 = (hi_G1 <= lo_G1) | (n_G1 <= 1)
    return n_G1, mean_G1, std_G1, flat_G1


def group_advantages(
    rewards_GN: ArrayT,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    unbiased: bool = True,
    mask_GN: ArrayT | None = None,
) -> ArrayT:
    """GRPO group-relative advantage (Shao et al. 2024), or Dr.GRPO's unscaled variant (Liu et al. 2025).

    ``A_gi = (r_gi - mean_g) / (std_g + eps)`` with ``normalize_std=True`` (GRPO), and ``A_gi = r_gi - mean_g``
    with ``normalize_std=False`` (Dr.GRPO), where mean and std run over the valid members of group ``g``;
    ``std_g`` is the sample std (divisor ``n_g - 1``) when ``unbiased`` (as ``torch.std``), else divisor ``n_g``.

    Degenerate groups are defined, never NaN: a group whose valid rewards are all equal, a group with a single
    valid member and an empty group all give 0 for every member. Invalid (masked) members get 0 and may hold
    any value, NaN included.

    Args:
        rewards_GN: scalar rewards. Shape: ``(G, N)``; torch tensor, numpy array or nested list.
        normalize_std: divide by the group std (GRPO, default) or not (Dr.GRPO).
        eps: added to the std before dividing; default ``1e-6``.
        unbiased: sample std (default) or population std.
        mask_GN: optional validity of each member, True = counts. Shape: ``(G, N)``.

    Returns:
        Advantages, shape ``(G, N)``: a tensor of the input's floating dtype (float32 for integer tensors) or a
        float64 numpy array for numpy / list input.
    """
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    r_GN, m_GN, was_numpy, dtype = _prepare(rewards_GN, mask_GN)
    _, mean_G1, std_G1, flat_G1 = _group_stats(r_GN, m_GN, unbiased)
    adv_GN = r_GN - mean_G1  # [G, N]
    if normalize_std:
        adv_GN = adv_GN / (std_G1 + eps)
    adv_GN = torch.where(m_GN & ~flat_G1, adv_GN, torch.zeros_like(adv_GN))
    return _finish(adv_GN, was_numpy, dtype)  # type: ignore[return-value]


def dr_grpo_advantages(rewards_GN: ArrayT, *, mask_GN: ArrayT | None = None) -> ArrayT:
    """Dr.GRPO advantage ``A_gi = r_gi - mean_g`` (no std division); ``group_advantages(normalize_std=False)``."""
    return group_advantages(rewards_GN, normalize_std=False, mask_GN=mask_GN)


def rloo_advantages(rewards_GN: ArrayT, *, mask_GN: ArrayT | None = None) -> ArrayT:
    """Leave-one-out baseline (RLOO, Ahmadian et al. 2024): ``A_gi = r_gi - (sum_j r_gj - r_gi) / (n_g - 1)``.

    Equivalently ``n_g / (n_g - 1) * (r_gi - mean_g)``. Groups with fewer than two valid members, or all-equal
    rewards, give 0. Shapes and types as in :func:`group_advantages`.
    """
    r_GN, m_GN, was_numpy, dtype = _prepare(rewards_GN, mask_GN)
    n_G1, _, _, flat_G1 = _group_stats(r_GN, m_GN, unbiased=True)
    loo_mean_GN = (r_GN.sum(dim=1, keepdim=True) - r_GN) / (n_G1 - 1).clamp(min=1)  # [G, N]
    adv_GN = r_GN - loo_mean_GN
    adv_GN = torch.where(m_GN & ~flat_G1, adv_GN, torch.zeros_like(adv_GN))
    return _finish(adv_GN, was_numpy, dtype)  # type: ignore[return-value]


ADVANTAGE_ESTIMATORS.register("grpo", group_advantages)
ADVANTAGE_ESTIMATORS.register("dr_grpo", dr_grpo_advantages)
ADVANTAGE_ESTIMATORS.register("rloo", rloo_advantages)


def broadcast_to_tokens(adv_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Spread one advantage per sequence over its action tokens: ``A_bt = A_b * mask_bt``.

    Args:
        adv_B: per-sequence advantages (e.g. ``group_advantages(...).reshape(-1)``). Shape: ``(B,)``.
        mask_BT: action mask, 1/True = action token. Shape: ``(B, T)``.

    Returns:
        ``(B, T)`` tensor in ``adv_B``'s dtype, zero off the mask.
    """
    if not isinstance(adv_B, torch.Tensor) or adv_B.dim() != 1:
        raise ValueError(f"adv_B must be a 1-D tensor [B], got {getattr(adv_B, 'shape', type(adv_B).__name__)}")
    if not isinstance(mask_BT, torch.Tensor) or mask_BT.dim() != 2 or mask_BT.shape[0] != adv_B.shape[0]:
        raise ValueError(
            f"mask_BT must be a [B, T] tensor with B={adv_B.shape[0]}, "
            f"got {getattr(mask_BT, 'shape', type(mask_BT).__name__)}"
        )
    m_BT = mask_BT.to(torch.bool)
    return torch.where(m_BT, adv_B[:, None].expand_as(m_BT), torch.zeros((), dtype=adv_B.dtype))  # [B, T]
