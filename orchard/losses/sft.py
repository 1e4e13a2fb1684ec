"""Supervised fine-tuning on agent trajectories, and the Orchard paper's credit-assigned SFT masks.

Plain SFT on a trajectory supervises every action token (the model's own turns); observations (tool outputs,
user turns) are context only. Credit-assigned SFT also learns from *unresolved* trajectories, but only from
the steps that moved the task forward:

1. A trajectory has ``S`` decision steps (assistant turns) ``a_0 … a_{S−1}`` and states ``s_0 … s_S``: ``s_t`` is
   the state before step ``t``, ``s_S`` the state after the last one. A value estimate ``V(s_t)`` (the probability
   of eventually resolving the task) is available at some keyed states; ``interpolate_step_values`` fills in
   the rest.
2. ``td_credit``: the credit of step ``t`` is ``c_t = V(s_{t+1}) − V(s_t)``.
3. ``credit_runs``: the maximal contiguous runs of steps with ``c_t ≥ ε`` (``ε = 0.05``).
4. ``credit_assigned_sft_mask``: a resolved trajectory supervises all its action tokens; an unresolved one
   only the action tokens of the steps inside its runs. Observation tokens are never supervised. The mask
   removes supervision only: the earlier history stays in the input as context.
5. ``sft_loss`` on that mask.

Pipeline for one unresolved trajectory::

    values = interpolate_step_values({0: 0.1, 4: 0.6, 9: 0.2}, num_steps=9)   # [10] values of s_0..s_9
    runs = credit_runs(td_credit(values), eps=0.05)                        # [(0, 4)]
    mask = credit_assigned_sft_mask(action_mask, turn_index, resolved=False, runs=runs)
    loss, metrics = sft_loss(logprobs, mask)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from orchard.losses._validation import (
    as_bool_mask,
    as_weighted_mask,
    check_bt,
    check_float,
    check_real,
    check_tensor,
    masked_mean,
    validate_counted,
)
from orchard.losses.aggregate import reduce_masked, resolve_agg

Run = tuple[int, int]
"""A half-open range ``[start, end)`` of step (assistant turn) indices."""

CREDIT_TOL = 1e-6
"""Slack of the credit threshold: a step counts when ``c_t ≥ ε − CREDIT_TOL``.

Credits are differences of probabilities in ``[0, 1]``, so rounding, not the data, decides an exact tie:
``0.35 − 0.30`` is ``0.04999999999999999`` in float64 and ``0.0499999821`` in float32. ``1e-6`` covers the
rounding of either precision (float32 rounds a value in ``[0, 1]`` by at most ``6e-8``) and is far below any
credit that matters next to the paper's ``ε = 0.05``. The same idea as BAR's ``ρ·n`` slack and the Claw pass
rule's."""


def _check_count(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def interpolate_step_values(keyed_values: Mapping[int, float], num_steps: int) -> Tensor:
    """Values of all states ``s_0 … s_S`` of an ``S``-step trajectory from values at some keyed states.

    Linear interpolation between consecutive keys; before the first key and after the last the nearest keyed
    value is held (no credit is invented outside the keyed span).

    Args:
        keyed_values: ``{state index: V(s)}`` with indices in ``[0, num_steps]`` and finite values; at least
            one entry.
        num_steps: ``S``, the number of steps (assistant turns, ``≥ 0``).

    Returns:
        ``V(s_0) … V(s_S)``, float64. Shape: ``[S + 1]``.
    """
    num_steps = _check_count("num_steps", num_steps, minimum=0)
    if not isinstance(keyed_values, Mapping) or not keyed_values:
        raise ValueError(
            f"keyed_values must be a non-empty mapping of state index to value, got {keyed_values!r}"
        )
    keys, values = [], []
    for key, value in sorted(keyed_values.items()):
        if isinstance(key, bool) or not isinstance(key, int | np.integer) or not 0 <= key <= num_steps:
            raise ValueError(f"keyed_values keys must be state indices in [0, {num_steps}], got key {key!r}")
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float | np.floating)
            or not math.isfinite(value)
        ):
            raise ValueError(f"keyed_values values must be finite numbers, got {value!r} at key {key}")
        keys.append(int(key))
        values.append(float(value))
    filled = np.interp(np.arange(num_steps + 1), keys, values)
    return torch.from_numpy(filled)


def td_credit(values: Tensor | Sequence[float]) -> Tensor:
    """TD credit of each step: ``c_t = V(s_{t+1}) − V(s_t)``.

    Args:
        values: ``V(s_0) … V(s_S)``. Shape: ``[..., S + 1]`` with ``S + 1 ≥ 1``; finite.

    Returns:
        Shape: ``[..., S]``, the dtype of ``values`` (float64 for a sequence).
    """
    if not isinstance(values, Tensor):
        values = torch.as_tensor(values, dtype=torch.float64)
    if values.dim() == 0 or values.shape[-1] == 0 or not values.is_floating_point():
        raise ValueError(
            f"values must be a floating tensor of shape [..., S + 1] with S + 1 >= 1, "
            f"got shape {tuple(values.shape)} dtype {values.dtype}"
        )
    if not bool(torch.isfinite(values).all()):
        raise ValueError("values must be finite, got a NaN or an infinity")
    return values[..., 1:] - values[..., :-1]


def credit_runs(credit: Tensor | Sequence[float], eps: float = 0.05) -> list[Run]:
    """Maximal contiguous runs of steps whose credit is at least ``eps`` (up to ``CREDIT_TOL``).

    A credit equal to ``eps`` in exact arithmetic counts even when floating point lands it a hair below:
    teacher values on a 0.05 grid (0.30, 0.35, …) give credits of exactly ``ε``, and the run stays whole.

    Args:
        credit: ``c_0 … c_{S−1}``. Shape: ``[S]``; NaN counts as below ``eps``.
        eps: the credit threshold ``ε``; default 0.05 (the paper's).

    Returns:
        Half-open ``(start, end)`` step ranges, in order, disjoint and non-adjacent. E.g. credit
        ``[0.1, 0.2, 0.0, 0.05]`` with ``eps=0.05`` gives ``[(0, 2), (3, 4)]``.
    """
    eps = check_real("eps", eps)
    credit_t = credit if isinstance(credit, Tensor) else torch.as_tensor(credit, dtype=torch.float64)
    if credit_t.dim() != 1:
        raise ValueError(f"credit must have shape [S], got shape {tuple(credit_t.shape)}")
    above = (credit_t >= eps - CREDIT_TOL).tolist()
    runs: list[Run] = []
    start = None
    for t, good in enumerate([*above, False]):
        if good and start is None:
            start = t
        elif not good and start is not None:
            runs.append((start, t))
            start = None
    return runs


def _check_runs(name: str, runs: object) -> list[Run]:
    if not isinstance(runs, Sequence) or isinstance(runs, str):
        raise ValueError(f"{name} must be a sequence of (start, end) step ranges, got {runs!r}")
    checked = []
    for run in runs:
        ok = (
            isinstance(run, Sequence)
            and len(run) == 2
            and all(isinstance(x, int | np.integer) and not isinstance(x, bool) for x in run)
        )
        if not ok or not 0 <= run[0] < run[1]:
            raise ValueError(f"{name} must hold (start, end) ranges with 0 <= start < end, got {run!r}")
        checked.append((int(run[0]), int(run[1])))
    return checked


def credit_assigned_sft_mask(
    action_mask: Tensor,
    turn_index: Tensor,
    resolved: bool | Sequence[bool] | Tensor,
    runs: Sequence[Run] | Sequence[Sequence[Run]],
) -> Tensor:
    """Which tokens credit-assigned SFT supervises.

    ``out = action_mask ∧ (resolved ∨ turn_index ∈ ⋃ runs)``, per row.

    Args:
        action_mask: 1/True on tokens the model generated. Shape: ``[T]`` for one trajectory or ``[B, T]``.
        turn_index: the step (assistant turn) each token belongs to (``≥ 0``), ``−1`` for tokens of no step
            (system prompt, task, padding), as ``orchard.data`` collates it. Integer; shape of ``action_mask``.
        resolved: whether each trajectory solved its task: a bool for ``[T]`` inputs, ``[B]`` bools for
            ``[B, T]``. A resolved trajectory supervises every action token, runs or not.
        runs: half-open ``(start, end)`` step ranges from ``credit_runs``: one list for ``[T]`` inputs, one
            list per row for ``[B, T]``.

    Returns:
        Bool mask of ``action_mask``'s shape.
    """
    action_mask = check_tensor("action_mask", action_mask)
    single = action_mask.dim() == 1
    if not single and action_mask.dim() != 2:
        raise ValueError(f"action_mask must have shape [T] or [B, T], got shape {tuple(action_mask.shape)}")
    turn_index = check_tensor("turn_index", turn_index)
    if turn_index.shape != action_mask.shape:
        raise ValueError(
            f"turn_index must have the shape of action_mask {tuple(action_mask.shape)}, "
            f"got shape {tuple(turn_index.shape)}"
        )
    if turn_index.is_floating_point() or turn_index.is_complex() or turn_index.dtype == torch.bool:
        raise ValueError(f"turn_index must be an integer tensor, got dtype {turn_index.dtype}")
    action_BT = as_bool_mask("action_mask", action_mask, "action_mask", action_mask)
    turns_BT = turn_index
    if single:
        if not isinstance(resolved, bool | np.bool_) and not (
            isinstance(resolved, Tensor) and resolved.dim() == 0
        ):
            raise ValueError(f"resolved must be a bool for a [T] action_mask, got {resolved!r}")
        resolved_rows = [bool(resolved)]
        runs_rows = [_check_runs("runs", runs)]
        action_BT, turns_BT = action_BT[None], turns_BT[None]
    else:
        batch = action_mask.shape[0]
        resolved_list = resolved.tolist() if isinstance(resolved, Tensor) else resolved
        if not isinstance(resolved_list, Sequence) or len(resolved_list) != batch:
            raise ValueError(
                f"resolved must hold one bool per row ({batch}) for a [B, T] action_mask, got {resolved!r}"
            )
        resolved_rows = [bool(r) for r in resolved_list]
        if not isinstance(runs, Sequence) or len(runs) != batch:
            raise ValueError(f"runs must hold one list of runs per row ({batch}), got {runs!r}")
        runs_rows = [_check_runs(f"runs[{i}]", row) for i, row in enumerate(runs)]

    supervised_BT = torch.zeros_like(action_BT)
    for i, (is_resolved, row_runs) in enumerate(zip(resolved_rows, runs_rows, strict=True)):
        if is_resolved:
            supervised_BT[i] = True
            continue
        for start, end in row_runs:
            supervised_BT[i] |= (turns_BT[i] >= start) & (turns_BT[i] < end)
    out = action_BT & supervised_BT
    return out[0] if single else out


def sft_loss(
    logprobs: Tensor,
    mask: Tensor,
    *,
    agg: str = "token-mean",
    normalizer: float | Tensor | None = None,
    validate: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Negative log-likelihood of the supervised tokens: ``ℓ_t = −log π(y_t)``, reduced with ``agg``.

    Args:
        logprobs: ``log π(y_t)`` of the target tokens, with grad. Shape: ``[B, T]``.
        mask: 1/True on supervised tokens (e.g. from ``credit_assigned_sft_mask``). Shape: ``[B, T]``. Masked
            positions may hold anything (NaN, −inf). A non-bool mask's value weights the token's NLL.
        agg: aggregation mode; default ``"token-mean"``.
        normalizer: the aggregation's global normaliser (required for ``"token-sum-norm"``).
        validate: check (one device sync) that ``logprobs`` is finite and ``<= 1e-4`` where counted and the
            mask's weights are finite and ``>= 0``; default off.

    Returns:
        ``(loss, metrics)`` with ``sft/nll`` (mean NLL over supervised tokens) and ``sft/tokens`` (their
        count), both detached.
    """
    logprobs = check_float("logprobs", check_bt("logprobs", logprobs))
    raw_mask = mask
    mask, weight = as_weighted_mask("mask", mask, "logprobs", logprobs)
    agg_fn = resolve_agg(agg, normalizer)
    if validate:
        validate_counted(raw_mask, mask, logprobs={"logprobs": logprobs})
    nll = -logprobs  # [B, T]
    loss = reduce_masked(nll, mask, agg_fn, normalizer, weight)
    with torch.no_grad():
        metrics = {"sft/nll": masked_mean(nll, mask), "sft/tokens": mask.sum().to(logprobs.dtype)}
    return loss, metrics
