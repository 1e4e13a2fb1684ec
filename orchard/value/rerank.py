"""Value-model reranking of N candidate trajectories per task (layer 1), and its evaluation.

``rerank`` picks ``argmax_i V_gi`` per task ``g`` among its valid candidates (ties to the lower index). The
evaluation compares three success rates on held-out groups:

- reranked: success of the value-chosen candidate (as ``orchard.sampling.best_of_n``);
- random: the expected success of a uniformly random candidate, ``mean_g mean_i s_gi`` (exact, no sampling);
- oracle: pass@N, a task counts when any candidate succeeds (as ``orchard.sampling.oracle_best_of_n``).

Both skip a candidate whose value is NaN (it has no decision step to read a value at).

random ≤ oracle always; a useful value model lands between them, and reranked − random is its gain.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["rerank", "rerank_report"]


def _check_gn(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        x = torch.as_tensor(x)
    if x.dim() != 2:
        raise ValueError(f"{name} must have shape [G, N], got {tuple(x.shape)}")
    return x


def rerank(values_per_candidate: Tensor, mask: Tensor | None = None) -> Tensor:
    """Index of the highest-value candidate per task.

    Args:
        values_per_candidate: value of each candidate (e.g. its final step's value). Shape: ``[G, N]``.
        mask: 1/True on valid candidates (default all). Shape: ``[G, N]``. Invalid ones are never chosen and
            may hold NaN.

    Returns:
        Long ``[G]``: the chosen index, ties to the lower index; ``-1`` for a task with no valid candidate.
    """
    values = _check_gn("values_per_candidate", values_per_candidate)
    if not values.is_floating_point():
        values = values.float()
    if mask is None:
        mask = torch.ones(values.shape, dtype=torch.bool, device=values.device)
    mask = _check_gn("mask", mask).bool()
    if mask.shape != values.shape:
        raise ValueError(f"mask must have the shape of values_per_candidate {tuple(values.shape)}, got {tuple(mask.shape)}")
    if values.shape[1] == 0:
        return torch.full((values.shape[0],), -1, dtype=torch.long, device=values.device)
    valid = mask & ~torch.isnan(values)
    scores = torch.where(valid, values, torch.full_like(values, -torch.inf))  # [G, N]
    # argmax on a max-equality mask gives the first (lowest) index among ties, including all -inf rows.
    best = scores.amax(dim=1, keepdim=True)  # [G, 1]
    chosen = (scores == best).to(torch.int8).argmax(dim=1)  # [G]
    return torch.where(valid.any(dim=1), chosen, torch.full_like(chosen, -1))


def rerank_report(values_per_candidate: Tensor, success: Tensor) -> dict[str, float]:
    """Reranked vs random vs oracle (pass@N) success on groups of N candidates (definitions in the module doc).

    A candidate whose value is NaN (a sample with no decision step, so nothing to read a value at) is skipped, as
    :func:`rerank` skips it: it is neither chosen nor counted in that group's random or oracle rate, so all three
    rates compare choices among the same candidates (``random`` is then ``mean_g`` of each group's mean over its
    valid candidates). A group with no valid candidate is left out of the report.

    Args:
        values_per_candidate: value per candidate, NaN for one that has none. Shape: ``[G, N]``.
        success: verified outcome per candidate, 0/1 (or a score in [0, 1]); finite. Shape: ``[G, N]``.

    Returns:
        ``{"rerank/success", "rerank/random", "rerank/oracle", "rerank/gain", "rerank/groups", "rerank/n",
        "rerank/skipped"}`` (``gain`` = reranked − random, ``groups`` the groups scored, ``skipped`` the
        candidates skipped); rates are 0 when no group is scored.
    """
    values = _check_gn("values_per_candidate", values_per_candidate).detach().double().cpu()
    succ = _check_gn("success", success).detach().double().cpu()
    if succ.shape != values.shape:
        raise ValueError(f"success must have the shape of values_per_candidate {tuple(values.shape)}, got {tuple(succ.shape)}")
    if not torch.isfinite(succ).all():
        raise ValueError("success must be finite, got NaN or inf")
    G, N = values.shape
    if G > 0 and N == 0:
        raise ValueError("values_per_candidate must have at least one candidate per group, got N=0")
    valid = ~torch.isnan(values)  # [G, N]
    chosen = rerank(values)  # [G], -1 where no candidate is valid
    scored = chosen >= 0  # [G]
    report = {"rerank/groups": float(scored.sum()), "rerank/n": float(N), "rerank/skipped": float((~valid).sum())}
    if not scored.any():
        return {"rerank/success": 0.0, "rerank/random": 0.0, "rerank/oracle": 0.0, "rerank/gain": 0.0, **report}
    v_succ, v_valid = succ[scored], valid[scored]  # [G', N]
    picked = float(v_succ.gather(1, chosen[scored][:, None]).mean())
    zero = torch.zeros((), dtype=v_succ.dtype)
    random_rate = float((torch.where(v_valid, v_succ, zero).sum(1) / v_valid.sum(1)).mean())
    oracle = float(torch.where(v_valid, v_succ, torch.full((), -torch.inf, dtype=v_succ.dtype)).amax(1).mean())
    return {
        "rerank/success": picked,
        "rerank/random": random_rate,
        "rerank/oracle": oracle,
        "rerank/gain": picked - random_rate,
        **report,
    }
