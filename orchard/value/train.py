"""Training the value model on the historical pool with GAE targets, and its reranking evaluation.

Each iteration draws a batch of rendered trajectories, reads ``V(s_t)`` at every decision step's last token,
builds GAE targets from the verified outcome (the terminal step's reward) with the current values held fixed,
and regresses the values on them::

    r_t = outcome · [t is the last step]            (orchard.value.terminal_rewards)
    A, R = gae(r, sg(V), step_mask; γ = 0.98, λ = 0.95)
    L = ½ · mean over real steps of (V_t − R_t)²     (value_loss)

Samples are whole rendered trajectories. With ``max_len``, one longer than that is read through
``orchard.value.windows.value_windows`` (left-truncated windows that keep the head), and its step values are
reassembled before GAE, so the outcome always sits on the true last step: a cut trajectory never looks finished.
Monte-Carlo values (``step_targets``: per trajectory ``{state index: V̂}``, `orchard.rollout.TurnValues`) replace
the GAE target of the steps they value: step ``t``'s target is ``V̂(s_{t+1})`` in reward units
(``orchard.value.monte_carlo_step_targets``); the other steps keep theirs. The command line lives in
``orchard.value.cli``.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from orchard.data import RenderedSample, collate
from orchard.value.gae import gae, terminal_rewards
from orchard.value.model import ValueModel
from orchard.value.monte_carlo import monte_carlo_step_targets
from orchard.value.rerank import rerank_report
from orchard.value.windows import value_windows

__all__ = ["candidate_values", "evaluate_reranking", "train_value_model", "value_loss", "value_targets"]


def value_loss(
    values: Tensor, returns: Tensor, mask: Tensor, *, old_values: Tensor | None = None, clip_range: float | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """``½ · mean_{mask} (V − R)²``; with ``old_values`` and ``clip_range`` the PPO clipped form
    ``½ · mean max((V − R)², (clip(V, V_old ± ε) − R)²)``.

    Args:
        values: predicted step values, with grad. Shape: ``[B, S]``.
        returns: targets ``R`` (detached). Shape: ``[B, S]``.
        mask: 1/True on real steps. Shape: ``[B, S]``; masked positions may hold anything.
        old_values: values at sampling time, for clipping. Shape: ``[B, S]``.
        clip_range: ε > 0 of the clipped form; needs ``old_values``.

    Returns:
        ``(loss, metrics)`` with ``value/mse``, ``value/mean``, ``value/target_mean`` (detached); 0 loss when no
        step counts.
    """
    for name, x in (("values", values), ("returns", returns), ("mask", mask)):
        if not isinstance(x, Tensor) or x.dim() != 2 or x.shape != values.shape:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a tensor of shape [B, S] = {tuple(values.shape)}, got {got}")
    if (clip_range is None) != (old_values is None):
        raise ValueError("clip_range and old_values must be given together, got only one of them")
    if clip_range is not None and not clip_range > 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range!r}")
    m = mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(m, values, zero)
    r = torch.where(m, returns.detach().to(values.dtype), zero)
    err = (v - r).square()  # [B, S]
    if clip_range is not None and old_values is not None:
        old = torch.where(m, old_values.detach().to(values.dtype), zero)
        clipped = old + (v - old).clamp(-clip_range, clip_range)
        err = torch.maximum(err, (clipped - r).square())
    n = m.sum().clamp(min=1)
    loss = 0.5 * torch.where(m, err, zero).sum() / n
    with torch.no_grad():
        metrics = {
            "value/mse": torch.where(m, (v - r).square(), zero).sum() / n,
            "value/mean": v.sum() / n,
            "value/target_mean": r.sum() / n,
        }
    return loss, metrics


def _outcomes(samples: Sequence[RenderedSample]) -> Tensor:
    rewards = []
    for i, s in enumerate(samples):
        if s.reward is None:
            raise ValueError(f"samples[{i}] has no reward; the value pool needs verified trajectories")
        rewards.append(float(s.reward))
    return torch.tensor(rewards, dtype=torch.float32)


def _windowed(samples: Sequence[RenderedSample], max_len: int | None) -> list[list[RenderedSample]]:
    """Each sample as the windows its steps are read in: itself alone when it fits (or ``max_len`` is None)."""
    if not samples:
        raise ValueError("samples must be a non-empty sequence of RenderedSample, got an empty one")
    out = []
    for i, s in enumerate(samples):
        if not isinstance(s, RenderedSample):
            raise ValueError(f"samples[{i}] must be a RenderedSample, got {type(s).__name__}")
        if max_len is None:
            if s.report.truncated:
                raise ValueError(
                    f"samples[{i}] was cut to its first {len(s)} of {s.report.full_length} tokens at rendering and "
                    "its last visible step would be trained as final; render with max_len=None and pass max_len="
                )
            out.append([s])
        else:
            out.append(value_windows(s, max_len=max_len))
    return out


def _check_step_targets(step_targets: Sequence[Mapping[int, float] | None] | None, count: int) -> None:
    if step_targets is not None and (isinstance(step_targets, Mapping) or not isinstance(step_targets, Sequence)
                                     or len(step_targets) != count):
        got = len(step_targets) if isinstance(step_targets, Sequence) else type(step_targets).__name__
        raise ValueError(f"step_targets must be a sequence with one entry per sample ({count}), got {got}")


def _with_monte_carlo(returns: Tensor, step_mask: Tensor, step_targets: Sequence[Mapping[int, float] | None] | None,
                      reward_range: tuple[float, float]) -> Tensor:
    """``returns`` with the Monte-Carlo target in place of the GAE one at every real step that has one."""
    if step_targets is None:
        return returns
    targets, has = monte_carlo_step_targets(step_targets, returns.shape[1], reward_range=reward_range)  # [B, S]
    has = has.to(returns.device) & step_mask.bool()
    return torch.where(has, targets.to(returns), returns)


def _step_values(model: ValueModel, items: Sequence[Sequence[RenderedSample]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Step values ``[B, S]`` and step mask ``[B, S]`` of ``B`` trajectories, each read through its windows."""
    rows = [w for windows in items for w in windows]
    owner = torch.tensor([b for b, windows in enumerate(items) for _ in windows])  # [R]
    batch = collate(rows, pad_id)
    values_RS, mask_RS = model.step_values(batch["input_ids"], batch["attention_mask"], batch["turn_index"])
    device = values_RS.device
    owner = owner.to(device)
    # Each step is read in exactly one window, so summing a trajectory's rows puts every step's value in place.
    values = torch.zeros((len(items), values_RS.shape[1]), dtype=values_RS.dtype, device=device)
    values = values.index_add(0, owner, values_RS)  # [B, S]
    mask = torch.zeros(values.shape, dtype=torch.long, device=device).index_add(0, owner, mask_RS.long()) > 0
    return values, mask


@torch.no_grad()
def value_targets(
    model: ValueModel,
    samples: Sequence[RenderedSample],
    *,
    pad_id: int,
    max_len: int | None = None,
    gamma: float = 0.98,
    lam: float = 0.95,
    step_targets: Sequence[Mapping[int, float] | None] | None = None,
    reward_range: tuple[float, float] = (0.0, 1.0),
) -> tuple[Tensor, Tensor, Tensor]:
    """``(returns, values, step_mask)``, each ``[B, S]``: GAE targets from the current model's step values.

    ``samples`` are whole rendered trajectories with a reward; ``max_len`` reads longer ones through
    :func:`~orchard.value.windows.value_windows`. Step ``s`` of row ``b`` is the trajectory's own step ``s``.
    ``step_targets`` (one ``{state index: V̂}`` or None per sample) replace the GAE target of the steps they
    value, a success rate ``p`` as ``low + (high − low) · p`` for ``reward_range = (low, high)``, the rewards of
    failure and success (module docstring).
    """
    items = _windowed(samples, max_len)
    _check_step_targets(step_targets, len(samples))
    values, step_mask = _step_values(model, items, pad_id)
    outcome = _outcomes(samples).to(values.device)
    _, returns = gae(terminal_rewards(outcome, step_mask), values, step_mask, gamma=gamma, lam=lam)
    return _with_monte_carlo(returns, step_mask, step_targets, reward_range), values, step_mask


def train_value_model(
    model: ValueModel,
    samples: Sequence[RenderedSample],
    *,
    pad_id: int,
    max_len: int | None = None,
    steps: int = 100,
    batch_size: int = 8,
    lr: float = 1e-5,
    gamma: float = 0.98,
    lam: float = 0.95,
    seed: int = 0,
    log: Callable[[dict[str, float], int], None] | None = None,
    step_targets: Sequence[Mapping[int, float] | None] | None = None,
    reward_range: tuple[float, float] = (0.0, 1.0),
) -> list[dict[str, float]]:
    """Regress the value model on GAE targets over ``samples`` (module docstring) with AdamW at a constant ``lr``.

    ``samples`` are whole rendered trajectories (``max_len=None`` at rendering; one cut there is rejected); with
    ``max_len`` a longer one is read through its windows, which all go into the step's one forward: a batch of
    ``batch_size`` trajectories has one row per window, about ``length / (max_len - head)`` for a long one.

    ``step_targets`` and ``reward_range`` as in :func:`value_targets`: Monte-Carlo values replace the GAE targets of
    the steps they value.

    Returns the per-step metrics (``value/loss``, ``value/mse``, ``value/mean``, ``value/target_mean``).
    """
    items = _windowed(samples, max_len)
    _check_step_targets(step_targets, len(samples))
    for name, v in (("steps", steps), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    outcomes = _outcomes(samples)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    history = []
    order: list[int] = []
    for step in range(1, steps + 1):
        if len(order) < batch_size:
            fresh = list(range(len(samples)))
            rng.shuffle(fresh)
            order += fresh
        idx, order = order[:batch_size], order[batch_size:]
        values, step_mask = _step_values(model, [items[i] for i in idx], pad_id)
        # Targets from the same forward's values, held fixed (gae detaches them): one forward per step.
        rewards = terminal_rewards(outcomes[idx].to(values.device), step_mask)
        _, returns = gae(rewards, values, step_mask, gamma=gamma, lam=lam)
        if step_targets is not None:
            returns = _with_monte_carlo(returns, step_mask, [step_targets[i] for i in idx], reward_range)
        loss, metrics = value_loss(values, returns, step_mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        row = {"value/loss": float(loss.detach()), **{k: float(v) for k, v in metrics.items()}}
        history.append(row)
        if log is not None:
            log(row, step)
    return history


@torch.no_grad()
def candidate_values(
    model: ValueModel,
    samples: Sequence[RenderedSample],
    *,
    pad_id: int,
    max_len: int | None = None,
    batch_size: int = 8,
) -> Tensor:
    """Value of each trajectory: ``V`` at its final decision step (its predicted outcome), ``[len(samples)]``.

    NaN for a trajectory without a decision step. With ``max_len`` a longer trajectory is read in the window that
    ends at its final step (left-truncated, head kept).
    """
    if not samples:
        return torch.zeros(0)
    items = [windows[-1:] for windows in _windowed(samples, max_len)]
    model.eval()
    out = []
    for lo in range(0, len(items), batch_size):
        values, step_mask = _step_values(model, items[lo : lo + batch_size], pad_id)
        S = step_mask.shape[1]
        steps = torch.arange(S, device=step_mask.device).expand_as(step_mask)  # [b, S]
        last = torch.where(step_mask, steps, -1).amax(dim=1)  # [b]
        picked = values.gather(1, last.clamp(min=0)[:, None])[:, 0]
        out.append(torch.where(last >= 0, picked, torch.nan).cpu())
    return torch.cat(out)


def evaluate_reranking(
    model: ValueModel,
    samples: Sequence[RenderedSample],
    *,
    pad_id: int,
    max_len: int | None = None,
    success_threshold: float = 0.5,
    group_key: Callable[[RenderedSample], object] | None = None,
) -> dict[str, float]:
    """Value-reranked success vs random choice vs oracle pass@N on held-out groups (``rerank_report``).

    Candidates are grouped by ``group_key`` (default ``task_id``); only groups of the most common size N are
    scored, so every group offers the same number of choices. A candidate is valued at its final step
    (:func:`candidate_values`, ``max_len`` as there); one without a decision step is skipped.
    """
    key = group_key or (lambda s: s.task_id)
    groups: dict[object, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        groups[key(s)].append(i)
    if not groups:
        return rerank_report(torch.zeros(0, 0), torch.zeros(0, 0))
    sizes = [len(g) for g in groups.values()]
    n = max(set(sizes), key=sizes.count)
    kept = [g for g in groups.values() if len(g) == n]
    values = candidate_values(model, samples, pad_id=pad_id, max_len=max_len)
    success = (_outcomes(samples) > success_threshold).double()
    return rerank_report(values[torch.tensor(kept)], success[torch.tensor(kept)])
