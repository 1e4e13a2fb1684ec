"""Training the value model on the historical pool with GAE targets, and its reranking evaluation.

Each iteration draws a batch of rendered trajectories, reads ``V(s_t)`` at every decision step's last token,
builds GAE targets from the verified outcome (the terminal step's reward) with the current values held fixed,
and regresses the values on them::

    r_t = outcome · [t is the last step]            (orchard.value.terminal_rewards)
    A, R = gae(r, sg(V), step_mask; γ = 0.98, λ = 0.95)
    L = ½ · mean over real steps of (V_t − R_t)²     (value_loss)

Script: ``python -m orchard.value.train data=pool.jsonl tokenizer=TOK_DIR model=CKPT_DIR output_dir=OUT
[eval_data=heldout.jsonl] [steps=200 ...]`` (every ``ValueTrainConfig`` field is a ``key=value`` override).
"""

from __future__ import annotations

import random
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from orchard._extras import requires_extra
from orchard.data import RenderedSample, collate
from orchard.value.gae import gae, terminal_rewards
from orchard.value.model import ValueModel
from orchard.value.rerank import rerank_report

__all__ = ["ValueTrainConfig", "evaluate_reranking", "main", "train_value_model", "value_loss", "value_targets"]


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


@torch.no_grad()
def value_targets(
    model: ValueModel, batch: dict[str, Tensor], outcome: Tensor, *, gamma: float = 0.98, lam: float = 0.95
) -> tuple[Tensor, Tensor, Tensor]:
    """``(returns, values, step_mask)``, each ``[B, S]``: GAE targets from the current model's step values."""
    values, step_mask = model.step_values(batch["input_ids"], batch["attention_mask"], batch["turn_index"])
    _, returns = gae(terminal_rewards(outcome, step_mask), values, step_mask, gamma=gamma, lam=lam)
    return returns, values, step_mask


def train_value_model(
    model: ValueModel,
    samples: Sequence[RenderedSample],
    *,
    pad_id: int,
    steps: int = 100,
    batch_size: int = 8,
    lr: float = 1e-5,
    gamma: float = 0.98,
    lam: float = 0.95,
    seed: int = 0,
    log: Callable[[dict[str, float], int], None] | None = None,
) -> list[dict[str, float]]:
    """Regress the value model on GAE targets over ``samples`` (module docstring) with AdamW at a constant ``lr``.

    Returns the per-step metrics (``value/loss``, ``value/mse``, ``value/mean``, ``value/target_mean``).
    """
    if not samples:
        raise ValueError("samples must be a non-empty sequence of RenderedSample, got an empty one")
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
        batch = collate([samples[i] for i in idx], pad_id)
        values, step_mask = model.step_values(batch["input_ids"], batch["attention_mask"], batch["turn_index"])
        # Targets from the same forward's values, held fixed (gae detaches them): one forward per step.
        rewards = terminal_rewards(outcomes[idx], step_mask)
        _, returns = gae(rewards, values, step_mask, gamma=gamma, lam=lam)
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
def candidate_values(model: ValueModel, samples: Sequence[RenderedSample], *, pad_id: int, batch_size: int = 8) -> Tensor:
    """Value of each trajectory: ``V`` at its final decision step (its predicted outcome), ``[len(samples)]``."""
    model.eval()
    out = []
    for lo in range(0, len(samples), batch_size):
        batch = collate(list(samples[lo : lo + batch_size]), pad_id)
        values, step_mask = model.step_values(batch["input_ids"], batch["attention_mask"], batch["turn_index"])
        S = step_mask.shape[1]
        last = torch.where(step_mask, torch.arange(S).expand_as(step_mask), -1).amax(dim=1)  # [b]
        out.append(torch.where(last >= 0, values.gather(1, last.clamp(min=0)[:, None])[:, 0], torch.nan))
    return torch.cat(out) if out else torch.zeros(0)


def evaluate_reranking(
    model: ValueModel,
    samples: Sequence[RenderedSample],
    *,
    pad_id: int,
    success_threshold: float = 0.5,
    group_key: Callable[[RenderedSample], object] | None = None,
) -> dict[str, float]:
    """Value-reranked success vs random choice vs oracle pass@N on held-out groups (``rerank_report``).

    Candidates are grouped by ``group_key`` (default ``task_id``); only groups of the most common size N are
    scored, so every group offers the same number of choices.
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
    values = candidate_values(model, samples, pad_id=pad_id)
    success = (_outcomes(samples) > success_threshold).double()
    return rerank_report(values[torch.tensor(kept)], success[torch.tensor(kept)])


@dataclass
class ValueTrainConfig:
    """Settings of ``python -m orchard.value.train``."""

    data: str = ""
    """JSONL of past trajectories (orchard.data schema) forming the historical pool."""
    tokenizer: str = ""
    """Local tokenizer directory (with a chat template)."""
    model: str = ""
    """Local causal-LM or ValueModel checkpoint directory to start from."""
    output_dir: str = "runs/value"
    """Where the trained ValueModel and metrics.jsonl go."""
    eval_data: str | None = None
    """Held-out JSONL of grouped candidates (same task_id) for the reranking report."""
    max_per_task: int = 8
    """Pool cap per task."""
    balance: bool = True
    """Balance successes and failures in the pool."""
    max_len: int = 4096
    """Truncate rendered trajectories to this many tokens."""
    steps: int = 200
    """Optimizer steps."""
    batch_size: int = 8
    """Trajectories per step."""
    lr: float = 1e-5
    """AdamW learning rate."""
    gamma: float = 0.98
    """GAE discount (Orchard: 0.98)."""
    lam: float = 0.95
    """GAE lambda (Orchard: 0.95)."""
    success_threshold: float = 0.5
    """Reward above which a trajectory counts as a success."""
    seed: int = 0
    """Seed of the pool selection, the head initialisation and the batch order."""


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Build the pool, render, train, save, and (with ``eval_data``) report reranking; returns the report."""
    with requires_extra("train"):
        from transformers import AutoTokenizer

    from orchard.data import read_jsonl, render_trajectory
    from orchard.train.config import load_config
    from orchard.train.metrics import JsonlLogger
    from orchard.value.pool import build_value_pool

    cfg = load_config(ValueTrainConfig, None, list(sys.argv[1:] if argv is None else argv))
    for name in ("data", "tokenizer", "model"):
        if not getattr(cfg, name):
            raise ValueError(f"config key {name!r} is required")
    tok = AutoTokenizer.from_pretrained(cfg.tokenizer, local_files_only=True)

    def render(trajs: list) -> list[RenderedSample]:
        out = [render_trajectory(t, tok, max_len=cfg.max_len) for t in trajs]
        return [s for s in out if s is not None]

    pool = build_value_pool(read_jsonl(cfg.data), max_per_task=cfg.max_per_task, balance=cfg.balance,
                            success_threshold=cfg.success_threshold, seed=cfg.seed)
    samples = render(pool)
    model = ValueModel.from_pretrained(cfg.model, seed=cfg.seed)
    out = Path(cfg.output_dir)
    logger = JsonlLogger(out / "metrics.jsonl")
    train_value_model(model, samples, pad_id=int(tok.pad_token_id), steps=cfg.steps, batch_size=cfg.batch_size,
                      lr=cfg.lr, gamma=cfg.gamma, lam=cfg.lam, seed=cfg.seed, log=logger.log)
    model.save_pretrained(out / "model")
    report: dict[str, float] = {}
    if cfg.eval_data:
        held = [t for t in read_jsonl(cfg.eval_data) if t.reward is not None and t.termination_reason != "env_error"]
        report = evaluate_reranking(model, render(held), pad_id=int(tok.pad_token_id),
                                    success_threshold=cfg.success_threshold)
        logger.log(report, cfg.steps)
        for k, v in report.items():
            print(f"{k}\t{v:.4f}")
    logger.close()
    return report


if __name__ == "__main__":
    main()
