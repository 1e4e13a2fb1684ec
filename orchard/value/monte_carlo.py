"""Monte-Carlo state values from fresh continuations (layer 1: pure tensor math).

VinePPO (Kazemnejad et al. 2024, arXiv 2410.01679, Sec. 3) values a state by the mean return of ``K``
continuations the policy samples from it. For a trajectory's states ``s_0 … s_S`` (``s_t`` before step ``t``, as in
``orchard.losses.sft``) and success rewards ``r_{i,j} ∈ [0, 1]`` of continuation ``j`` from state ``i``::

    n_i   = Σ_j m_{i,j}                                  (continuations that finished; m = validity mask)
    V̂(s_i) = (1 / n_i) · Σ_j m_{i,j} · r_{i,j}          (the Monte-Carlo value, an unbiased estimate of V(s_i))

A continuation lost to an environment failure (``m = 0``) is dropped, never scored 0: it says nothing about the
policy. Its reward may hold anything (NaN included) and does not change the result.

The confidence interval is Wilson's score interval (Wilson 1927) at the sample mean::

    z = Φ⁻¹((1 + confidence) / 2)
    centre = (V̂ + z² / 2n) / (1 + z² / n)
    half   = z / (1 + z² / n) · sqrt(V̂ (1 − V̂) / n + z² / 4n²)
    [low, high] = [centre − half, centre + half]  ⊂ [0, 1]

For binary rewards (resolved or not) it is the score interval of a proportion. For rewards anywhere in ``[0, 1]``
a variable of mean ``μ`` has variance at most ``μ(1 − μ)`` (the Bernoulli's), so the same interval is the
conservative normal-approximation interval of a bounded mean. Unlike the Wald (normal) interval it never
collapses to a point when all ``K`` rewards are equal, which at VinePPO's small ``K`` is the common case: ``K = 4``
continuations that all succeed give ``[4 / (4 + z²), 1] ≈ [0.51, 1]`` at 95 %, not ``[1, 1]``.

Degenerate input has a defined, finite answer: a state with no valid continuation gets ``value = 0.5`` (the
midpoint of what is possible), the interval ``[0, 1]``, ``counts = 0`` and ``valued = False``; callers drop it
(``monte_carlo_step_values`` leaves it out of ``{state index: value}``).

``monte_carlo_step_targets`` lays the values out as value-model targets: step ``t`` (read after its action) gets
``V̂(s_{t+1})``, in reward units.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["MonteCarloValues", "monte_carlo_step_targets", "monte_carlo_step_values", "monte_carlo_values"]


@dataclass(frozen=True)
class MonteCarloValues:
    """Per-state Monte-Carlo values and their confidence intervals; every field has shape ``[S]``.

    Fields:
        values: ``V̂(s_i)``, the mean success of the valid continuations (0.5 where there is none), float64.
        low: the interval's lower end (0 where there is no valid continuation), float64.
        high: the interval's upper end (1 where there is no valid continuation), float64.
        counts: ``n_i``, the valid continuations, int64.
        valued: ``n_i > 0``, bool.
    """

    values: Tensor
    low: Tensor
    high: Tensor
    counts: Tensor
    valued: Tensor


def _as_2d(name: str, x: Any) -> Tensor:
    if not isinstance(x, Tensor):
        try:
            x = torch.as_tensor(np.asarray(x))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name} must be a tensor or array of shape [S, K], got {type(x).__name__}") from exc
    if x.dim() != 2:
        raise ValueError(f"{name} must have shape [S, K], got {tuple(x.shape)}")
    return x


def monte_carlo_values(rewards: Any, valid: Any = None, *, confidence: float = 0.95) -> MonteCarloValues:
    """Monte-Carlo values of ``S`` states from ``K`` continuations each, with Wilson intervals (module docstring).

    Args:
        rewards: success reward of each continuation, in ``[0, 1]`` where valid. Shape: ``[S, K]`` with ``K ≥ 1``
            (``S = 0`` gives empty results); a tensor or anything ``numpy.asarray`` takes.
        valid: True where the continuation finished (False: lost to an environment failure, dropped). Shape:
            ``[S, K]``, bool. Default: every continuation is valid.
        confidence: the interval's coverage, in ``(0, 1)``. Default 0.95.

    Returns:
        :class:`MonteCarloValues` with ``[S]`` fields.

    Raises:
        ValueError: a shape that is not ``[S, K]`` with ``K ≥ 1``, a ``valid`` of another shape or not bool, a
            valid reward that is not finite or outside ``[0, 1]``, or a ``confidence`` outside ``(0, 1)``.
    """
    rewards = _as_2d("rewards", rewards)
    if rewards.dtype == torch.bool or rewards.is_complex():
        raise ValueError(f"rewards must be real numbers, got dtype {rewards.dtype}")
    S, K = rewards.shape
    if K < 1:
        raise ValueError(f"rewards must have K >= 1 continuations per state, got shape {tuple(rewards.shape)}")
    if valid is None:
        mask = torch.ones(S, K, dtype=torch.bool)
    else:
        mask = _as_2d("valid", valid)
        if mask.dtype != torch.bool:
            raise ValueError(f"valid must be a bool tensor of shape [S, K], got dtype {mask.dtype}")
        if mask.shape != rewards.shape:
            raise ValueError(f"valid must have the shape of rewards {tuple(rewards.shape)}, got {tuple(mask.shape)}")
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
        raise ValueError(f"confidence must be a number in (0, 1), got {confidence!r}")
    mask = mask.cpu()
    r = rewards.detach().cpu().to(torch.float64)
    picked = r[mask]
    if not bool(torch.isfinite(picked).all()):
        raise ValueError("rewards must be finite where valid, got a NaN or an infinity")
    if picked.numel() and not (bool((picked >= 0).all()) and bool((picked <= 1).all())):
        raise ValueError(f"rewards must lie in [0, 1] where valid (success rewards), got min {float(picked.min())} "
                         f"max {float(picked.max())}")

    z = NormalDist().inv_cdf((1 + confidence) / 2)
    counts = mask.sum(dim=1)  # [S]
    valued = counts > 0
    n = counts.clamp(min=1).to(torch.float64)  # [S]; 1 where no continuation counts, replaced below
    total = torch.where(mask, r, torch.zeros((), dtype=torch.float64)).sum(dim=1)  # [S]; garbage never read
    mean = total / n
    shrink = 1 + z * z / n
    centre = (mean + z * z / (2 * n)) / shrink
    # p(1 - p) may round a hair below 0 at p = 1; clamp before the root
    half = z / shrink * torch.sqrt((mean * (1 - mean)).clamp(min=0) / n + z * z / (4 * n * n))
    low = (centre - half).clamp(0.0, 1.0)
    high = (centre + half).clamp(0.0, 1.0)
    return MonteCarloValues(
        values=torch.where(valued, mean, torch.full_like(mean, 0.5)),
        low=torch.where(valued, low, torch.zeros_like(low)),
        high=torch.where(valued, high, torch.ones_like(high)),
        counts=counts.to(torch.int64),
        valued=valued,
    )


def monte_carlo_step_values(states: Any, estimate: MonteCarloValues) -> dict[int, float]:
    """``{state index: V̂}`` of the valued states: the form ``orchard.losses.interpolate_step_values`` and
    ``orchard.stages.sft_samples(..., mode="credit", step_values=...)`` take. States with no valid continuation
    are left out (the interpolation fills them in; with none valued the dict is empty).

    Args:
        states: the state index of each row of ``estimate``. Shape: ``[S]``, distinct non-negative ints.
        estimate: what :func:`monte_carlo_values` returned for those rows.
    """
    if not isinstance(estimate, MonteCarloValues):
        raise ValueError(f"estimate must be a MonteCarloValues, got {type(estimate).__name__}")
    indices = list(states.tolist() if isinstance(states, Tensor) else states)
    if any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in indices):
        raise ValueError(f"states must be integer state indices, got {indices!r:.200}")
    indices = [int(i) for i in indices]
    if len(indices) != estimate.values.shape[0]:
        raise ValueError(f"states must have one index per row of estimate ({estimate.values.shape[0]}), "
                         f"got {len(indices)}")
    if any(i < 0 for i in indices) or len(set(indices)) != len(indices):
        raise ValueError(f"states must be distinct non-negative indices, got {indices}")
    return {state: float(estimate.values[row]) for row, state in enumerate(indices) if bool(estimate.valued[row])}


def monte_carlo_step_targets(step_values: Sequence[Mapping[int, float] | None], num_steps: int, *,
                             reward_range: tuple[float, float] = (0.0, 1.0)) -> tuple[Tensor, Tensor]:
    """Value-model targets ``[B, S]`` from Monte-Carlo state values, in the decision-step layout of
    ``orchard.value.gather_step_values``.

    The value model reads ``V`` at the last token of step ``t``, after the action: its target is the value of the
    state that action leads to, so step ``t``'s target is ``V̂(s_{t+1})``. A success rate ``p`` is put in reward
    units as ``low + (high − low) · p`` (SWE's −1 / +1 reward: ``reward_range=(-1, 1)``), the scale of the
    outcome the GAE targets propagate. The targets are undiscounted, as VinePPO's (γ = 1).

    Args:
        step_values: per row, ``{state index: V̂ ∈ [0, 1]}`` (`TurnValues.step_values`), or None (no target).
            Shape: ``[B]``. State 0 (before any step) has no step and is ignored; states past ``num_steps`` too.
        num_steps: ``S``, the step columns of the value model's output (``≥ 1``).
        reward_range: ``(low, high)``, the rewards of failure and success. Default ``(0, 1)``.

    Returns:
        ``(targets, mask)``: float32 ``[B, S]`` (0 where masked) and bool ``[B, S]`` (True: step ``t`` of row
        ``b`` has a target).
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or num_steps < 1:
        raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
    if (not isinstance(reward_range, tuple) or len(reward_range) != 2
            or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in reward_range)
            or not reward_range[0] < reward_range[1]):
        raise ValueError(f"reward_range must be a tuple (low, high) of finite numbers with low < high, "
                         f"got {reward_range!r}")
    if isinstance(step_values, (str, bytes, Mapping)) or not isinstance(step_values, Sequence):
        raise ValueError(f"step_values must be a sequence with one mapping (or None) per row, "
                         f"got {type(step_values).__name__}")
    low, high = float(reward_range[0]), float(reward_range[1])
    targets = torch.zeros(len(step_values), int(num_steps), dtype=torch.float32)  # [B, S]
    mask = torch.zeros(len(step_values), int(num_steps), dtype=torch.bool)  # [B, S]
    for b, keyed in enumerate(step_values):
        if keyed is None:
            continue
        if not isinstance(keyed, Mapping):
            raise ValueError(f"step_values[{b}] must be a mapping of state index to value or None, "
                             f"got {type(keyed).__name__}")
        for state, value in keyed.items():
            if isinstance(state, bool) or not isinstance(state, (int, np.integer)) or state < 0:
                raise ValueError(f"step_values[{b}] keys must be state indices >= 0, got {state!r}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"step_values[{b}][{state}] must be a value in [0, 1], got {value!r}")
            if 1 <= state <= num_steps:
                targets[b, state - 1] = low + (high - low) * float(value)
                mask[b, state - 1] = True
    return targets, mask
