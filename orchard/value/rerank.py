"""Value-model reranking of N candidate trajectories per task (layer 1), and its evaluation.

``rerank`` picks ``argmax_i V_gi`` per task ``g`` among its valid candidates (ties to the lower index). The
evaluation compares three success rates on held-out groups:

- reranked: success of the value-chosen candidate (``orchard.sampling.best_of_n``);
- random: the expected success of a uniformly random candidate, ``mean_g mean_i s_gi`` (exact, no sampling);
- oracle: pass@N, a task counts when any candidate succeeds (``orchard.sampling.oracle_best_of_n``).

random ≤ oracle always; a useful value model lands between them, and reranked − random is its gain.
"""

from __future__ import annotations

import torch
from torch import Tensor

from orchard.sampling import best_of_n, oracle_best_of_n

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

    Args:
        values_per_candidate: value per candidate. Shape: ``[G, N]``.
        success: verified outcome per candidate, 0/1 (or a score in [0, 1]). Shape: ``[G, N]``.

    Returns:
        ``{"rerank/success", "rerank/random", "rerank/oracle", "rerank/gain", "rerank/groups", "rerank/n"}``
        (``gain`` = reranked − random); zeros for ``G = 0``.
    """
    values = _check_gn("values_per_candidate", values_per_candidate).detach().double().cpu()
    succ = _check_gn("success", success).detach().double().cpu()
    if succ.shape != values.shape:
        raise ValueError(f"success must have the shape of values_per_candidate {tuple(values.shape)}, got {tuple(succ.shape)}")
    G, N = values.shape
    if G == 0:
        return {"rerank/success": 0.0, "rerank/random": 0.0, "rerank/oracle": 0.0, "rerank/gain": 0.0,
                "rerank/groups": 0.0, "rerank/n": float(N)}
    if N == 0:
        raise ValueError("values_per_candidate must have at least one candidate per group, got N=0")
    picked = best_of_n(values.numpy(), succ.numpy()).success_rate  # argmax, ties to the lower index, as rerank
    random_rate = float(succ.mean())
    return {
        "rerank/success": picked,
        "rerank/random": random_rate,
        "rerank/oracle": oracle_best_of_n(succ.numpy()),
        "rerank/gain": picked - random_rate,
        "rerank/groups": float(G),
        "rerank/n": float(N),
    }
