"""The value-model stage: a scalar-head value model trained on a run's verified rollouts, then best-of-N reranking.

The Orchard paper's "distilling historical rollouts" (Orchard-SWE)::

    pool       = build_value_pool(earlier verified rollouts)    # successes and failures balanced, capped per task
    V          = ValueModel(small backbone) trained on the pool  # each assistant turn a decision step, environment
                                                                 # tokens excluded, GAE targets (gamma 0.98,
                                                                 # lambda 0.95) from the final verified reward
    candidates = N rollouts per held-out task from a policy whose rollouts are not in the pool (the paper: N = 6)
    pick       = argmax_i V(candidate i) at its final step;  reported beside a random pick and the oracle (pass@N)

The math is `orchard.value` (`build_value_pool`, `train_value_model`, `evaluate_reranking`); this stage renders the
trajectories, runs it in order and keeps what the plots need. `RecordedRollouts` keeps every rollout a stage
generates, so a recipe can hand the RL stage's rollouts to this one without the RL stage knowing.
`value_rerank_phase` is a recipe's whole step: the final policy's candidates, the value model, this stage, and
its report written.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchard._extras import requires_extra
from orchard.data import RenderedSample, Trajectory, render_trajectory
from orchard.rollout.rollouts import Rollouts
from orchard.stages.report import RunLog
from orchard.stages.sandboxes import PooledSandboxes

__all__ = ["RecordedRollouts", "ValueRerankConfig", "ValueRerankResult", "plot_value_curves", "value_rerank_phase", "value_rerank_stage"]


class RecordedRollouts:
    """A `Rollouts` that plays through ``inner`` and keeps every call's trajectories in ``calls`` (one list per
    call, in call order): the rollouts a stage generated, BAR's discarded ones included. Several recorders may
    share one ``calls`` list, so calls through different harnesses keep their common order."""

    def __init__(self, inner: Rollouts, calls: list[list[Trajectory]] | None = None) -> None:
        self.inner = inner
        self.calls: list[list[Trajectory]] = [] if calls is None else calls

    async def __call__(self, engine: Any, tasks: Sequence[Any], *, group_size: int, temperature: float,
                       max_tokens: int | None = None, seed: int | None = None) -> list[Trajectory]:
        trajs = await self.inner(engine, tasks, group_size=group_size, temperature=temperature,
                                 max_tokens=max_tokens, seed=seed)
        self.calls.append(list(trajs))
        return trajs

    @property
    def trajectories(self) -> list[Trajectory]:
        """Every trajectory recorded, in call order."""
        return [t for call in self.calls for t in call]


@dataclass
class ValueRerankConfig:
    enabled: bool = True
    """Train the value model on the run's verified train rollouts and rerank held-out candidates."""
    backbone: str | None = None
    """Local causal-LM checkpoint of the value backbone (the paper: 4B), checked before any work to have the
    student's tokenizer (it reads the student's rollouts); null: the recipe's SFT model where it trained one, else a
    fresh model shaped like the policy."""
    candidates: int = 6
    """Candidates per held-out instance from the final policy, whose rollouts are not in the pool (the paper: 6)."""
    max_per_task: int = 8
    """Pool cap per task."""
    steps: int = 100
    """Value training steps."""
    batch_size: int = 8
    """Trajectories per value training step."""
    lr: float = 1.0e-4
    """AdamW learning rate of value training."""
    gamma: float = 0.98
    """GAE discount over decision steps (the paper: 0.98)."""
    lam: float = 0.95
    """GAE lambda (the paper: 0.95)."""
    max_len: int = 4096
    """Longest sequence the value model reads; longer trajectories are read in left-truncated windows."""

    def __post_init__(self) -> None:
        if isinstance(self.candidates, bool) or not isinstance(self.candidates, int) or self.candidates < 2:
            raise ValueError(f"candidates must be an int >= 2, got {self.candidates!r}")


@dataclass(frozen=True)
class ValueRerankResult:
    """What `value_rerank_stage` measured."""

    report: dict[str, float]
    """`orchard.value.rerank_report`'s ``rerank/*`` keys, plus ``value/pool`` (trajectories trained on),
    ``value/pool_success`` (their success share) and ``value/candidates`` (candidates rendered)."""
    history: list[dict[str, float]] = field(default_factory=list)
    """Value training's per-step metrics (empty when the pool was empty)."""
    curves: list[dict[str, Any]] = field(default_factory=list)
    """Per candidate: ``task_id``, ``resolved`` and ``values`` (V at each decision step), for the value curves."""


def _render(trajectories: Sequence[Trajectory], tokenizer: Any) -> list[RenderedSample]:
    """One whole sequence per verified trajectory: every assistant turn a decision step, the rest not."""
    out = []
    for t in trajectories:
        if not t.valid:
            continue
        sample = render_trajectory(t, tokenizer)
        if sample is not None:
            out.append(sample)
    return out


def value_rerank_stage(pool: Sequence[Trajectory], candidates: Sequence[Trajectory], model: Any, tokenizer: Any, *,
                       max_per_task: int = 8, balance: bool = True, steps: int = 100, batch_size: int = 8,
                       lr: float = 1e-4, gamma: float = 0.98, lam: float = 0.95, max_len: int | None = None,
                       seed: int = 0, log: Callable[[dict[str, float], int], None] | None = None) -> ValueRerankResult:
    """Train ``model`` (an `orchard.value.ValueModel`, in place) on ``pool`` and rerank ``candidates``.

    Args:
        pool: earlier rollouts; `orchard.value.build_value_pool` keeps the verified ones, at most ``max_per_task``
            per task, successes and failures balanced (``balance``).
        candidates: the held-out candidates, grouped by ``task_id``; groups of the most common size N are scored
            (`orchard.value.train.evaluate_reranking`). They must come from a policy whose rollouts are not in
            ``pool``, or the reranker has seen the answers.
        model: the value model; its head is read at each step's last token.
        tokenizer: the chat tokenizer the trajectories are rendered with.
        max_per_task: pool cap per task (>= 1).
        balance: equalise successes and failures in the pool.
        steps, batch_size, lr: value training (AdamW, constant lr).
        gamma, lam: GAE over decision steps (the paper: 0.98, 0.95).
        max_len: longest sequence the value model reads; a longer trajectory is read in left-truncated windows
            that keep its head (`orchard.value.windows`), so its outcome still sits on its true last step.
        seed: seed of the pool's choices and the batch order.
        log: called as ``log(metrics, step)`` for each training step.

    Returns:
        `ValueRerankResult`. An empty pool (no verified rollout) trains nothing and reranks with the model as it
        is: the report stays defined.
    """
    from orchard.value.pool import build_value_pool, is_success
    from orchard.value.train import evaluate_reranking, train_value_model, value_targets

    kept = build_value_pool(pool, max_per_task=max_per_task, balance=balance, seed=seed)
    samples = _render(kept, tokenizer)
    pad_id = int(tokenizer.pad_token_id)
    history: list[dict[str, float]] = []
    if samples:
        history = train_value_model(model, samples, pad_id=pad_id, max_len=max_len, steps=steps,
                                    batch_size=batch_size, lr=lr, gamma=gamma, lam=lam, seed=seed, log=log)
    held = _render(candidates, tokenizer)
    report = evaluate_reranking(model, held, pad_id=pad_id, max_len=max_len)
    report["value/pool"] = float(len(samples))
    report["value/pool_success"] = sum(is_success(t) for t in kept) / len(kept) if kept else 0.0
    report["value/candidates"] = float(len(held))
    curves: list[dict[str, Any]] = []
    if held:
        _, values_BS, mask_BS = value_targets(model, held, pad_id=pad_id, max_len=max_len, gamma=gamma, lam=lam)
        for s, v, m in zip(held, values_BS.tolist(), mask_BS.tolist(), strict=True):
            curves.append({"task_id": s.task_id, "resolved": bool(s.reward is not None and s.reward > 0.5),
                           "values": [x for x, keep in zip(v, m, strict=True) if keep]})
    return ValueRerankResult(report, history, curves)


async def value_rerank_phase(cfg: ValueRerankConfig, harness: Rollouts, engine: Any, heldout: Sequence[Any],
                             pool: Sequence[Trajectory], tokenizer: Any, *, policy: Any,
                             default_backbone: str | Path | None = None, temperature: float = 1.0,
                             output_dir: str | Path, log: RunLog, sandboxes: PooledSandboxes | None = None,
                             seed: int = 0) -> ValueRerankResult:
    """``cfg.candidates`` rollouts per held-out task from ``engine`` (the final policy) through ``harness``, a value
    model trained on ``pool`` by `value_rerank_stage` (``cfg``'s settings) and the candidates reranked by it; the
    report logged (step 0) with a console line, and written under ``output_dir``: ``rerank.json`` (report, training
    history, curves) and ``value_curves.png``.

    Args:
        policy: the policy model; with no backbone, the value model is a fresh one shaped like its config.
        default_backbone: the backbone when ``cfg.backbone`` is null (a recipe's SFT model).
        sandboxes: the run's sandboxes: the candidates play in a warm pool of their own; None: the harness creates
            its sandboxes.
    """
    from orchard.value import ValueModel

    warm = sandboxes.stage(len(heldout) * cfg.candidates) if sandboxes is not None else contextlib.nullcontext()
    async with warm:
        played = await harness(engine, heldout, group_size=cfg.candidates, temperature=temperature)
    backbone = cfg.backbone if cfg.backbone is not None else default_backbone
    model = ValueModel.from_pretrained(str(backbone), seed=seed) if backbone is not None \
        else ValueModel.from_config(policy.config, seed=seed)
    result = value_rerank_stage(pool, played, model, tokenizer, max_per_task=cfg.max_per_task, steps=cfg.steps,
                                batch_size=cfg.batch_size, lr=cfg.lr, gamma=cfg.gamma, lam=cfg.lam,
                                max_len=cfg.max_len, seed=seed, log=log.log)
    r = result.report
    log.log(r, 0)
    log.print(f"best-of-{cfg.candidates} on {r['rerank/groups']:.0f} held-out tasks: value {r['rerank/success']:.3f}, "
              f"random {r['rerank/random']:.3f}, oracle {r['rerank/oracle']:.3f} (pool {r['value/pool']:.0f}, "
              f"{r['value/pool_success']:.2f} resolved)")
    out = Path(output_dir)
    (out / "rerank.json").write_text(json.dumps({"report": r, "history": result.history, "curves": result.curves},
                                                indent=2))
    plot_value_curves(result.curves, out / "value_curves.png")
    return result


def plot_value_curves(curves: Sequence[dict[str, Any]], path: str | Path) -> None:
    """V over decision steps of each candidate, resolved ones in one colour and failed ones in another, with the
    mean curve of each (a useful value model separates them by the last step)."""
    with requires_extra("plot"):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for resolved, color, label in ((True, "C2", "resolved"), (False, "C3", "failed")):
        rows = [c["values"] for c in curves if c["resolved"] == resolved and c["values"]]
        for values in rows:
            ax.plot(range(1, len(values) + 1), values, color=color, alpha=0.15)
        if rows:
            longest = max(len(r) for r in rows)
            mean = [sum(r[s] for r in rows if len(r) > s) / sum(len(r) > s for r in rows) for s in range(longest)]
            ax.plot(range(1, longest + 1), mean, color=color, linewidth=2, label=f"{label} (mean of {len(rows)})")
    ax.set(title="value of held-out candidates", xlabel="decision step", ylabel="V")
    if curves:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
