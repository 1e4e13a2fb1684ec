"""Generalised advantage estimation over decision steps (layer 1: pure tensor math).

A decision step is one assistant response; environment tokens are never steps. For step tensors ``[B, S]`` with
rewards ``r``, values ``V`` and a step mask ``m`` (1: a real step), let ``next(t)`` be the first ``t' > t`` with
``m[t'] = 1`` (masked holes are skipped, not treated as terminal), and ``V(next) = 0`` / ``A(next) = 0`` past the
last real step (the episode ends there)::

    δ_t = r_t + γ · V_next(t) − V_t
    A_t = δ_t + γ λ · A_next(t)
    R_t = A_t + V_t                      (the value target, "returns")

With the verified outcome as the reward of the last step and 0 elsewhere, the terminal reward propagates backwards
discounted by γ per step (Orchard: γ = 0.98, λ = 0.95). Masked steps get advantage and return 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["gae", "terminal_rewards"]


def _check_steps(name: str, x: object, like: Tensor | None = None) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape [B, S], got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must have shape [B, S], got {tuple(x.shape)}")
    if like is not None and x.shape != like.shape:
        raise ValueError(f"{name} must have the shape of rewards {tuple(like.shape)}, got {tuple(x.shape)}")
    return x


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 0.98, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Advantages and returns by GAE over steps, skipping masked steps (formula in the module docstring).

    Args:
        rewards: per-step rewards ``r_t``. Shape: ``[B, S]``, float.
        values: per-step value estimates ``V(s_t)``; not differentiated through. Shape: ``[B, S]``.
        mask: 1/True on real decision steps. Shape: ``[B, S]``. Masked positions may hold anything (NaN).
        gamma: discount γ in [0, 1]; default 0.98 (Orchard).
        lam: GAE λ in [0, 1]; default 0.95 (Orchard).

    Returns:
        ``(advantages, returns)``, each ``[B, S]`` in the dtype of ``values`` (float32 at least), 0 where masked.
        Vectorised over the batch: one pass over the ``S`` steps.
    """
    rewards = _check_steps("rewards", rewards)
    values = _check_steps("values", values, rewards)
    mask = _check_steps("mask", mask, rewards)
    if not rewards.is_floating_point() or not values.is_floating_point():
        raise ValueError(f"rewards and values must be floating point, got {rewards.dtype} and {values.dtype}")
    for name, v in (("gamma", gamma), ("lam", lam)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")
    dtype = torch.promote_types(values.dtype, torch.float32)
    m = mask.bool()
    zero = torch.zeros((), dtype=dtype, device=values.device)
    r = torch.where(m, rewards.detach().to(dtype), zero)  # [B, S]; masked garbage never enters
    v = torch.where(m, values.detach().to(dtype), zero)  # [B, S]
    B, S = r.shape
    adv = torch.zeros((B, S), dtype=dtype, device=values.device)
    next_value = torch.zeros(B, dtype=dtype, device=values.device)  # V of the next real step, per row
    next_adv = torch.zeros(B, dtype=dtype, device=values.device)  # A of the next real step, per row
    for t in range(S - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]  # [B]
        a_t = delta + gamma * lam * next_adv  # [B]
        real = m[:, t]
        adv[:, t] = torch.where(real, a_t, zero)
        next_value = torch.where(real, v[:, t], next_value)  # a hole leaves the successor unchanged
        next_adv = torch.where(real, a_t, next_adv)
    returns = torch.where(m, adv + v, zero)
    return adv, returns


def terminal_rewards(outcome: Tensor, mask: Tensor) -> Tensor:
    """Step rewards ``[B, S]`` that put each row's verified ``outcome[b]`` on its last real step, 0 elsewhere.

    A row without a real step gets all zeros.
    """
    mask = _check_steps("mask", mask)
    if not isinstance(outcome, Tensor) or outcome.shape != (mask.shape[0],):
        got = tuple(outcome.shape) if isinstance(outcome, Tensor) else type(outcome).__name__
        raise ValueError(f"outcome must be a tensor of shape [B]=[{mask.shape[0]}], got {got}")
    m = mask.bool()
    S = m.shape[1]
    idx = torch.arange(S, device=m.device).expand_as(m)  # [B, S]
    last = torch.where(m, idx, torch.full_like(idx, -1)).amax(dim=1)  # [B]
    out = torch.zeros(m.shape, dtype=torch.promote_types(outcome.dtype, torch.float32), device=m.device)
    has = last >= 0
    rows = torch.nonzero(has).flatten()
    out[rows, last[has]] = outcome[has].to(out.dtype)
    return out
