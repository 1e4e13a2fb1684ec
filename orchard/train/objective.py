"""The training objective: a declarative weighted sum of orchard losses over a rendered batch.

An objective is a list of ``LossTerm(name, weight, kwargs)``; YAML writes it as::

    objective:
      - {name: policy, weight: 1.0, kwargs: {eps_low: 0.2, eps_high: 0.28}}
      - {name: js_opd, weight: 0.1, kwargs: {lam: 0.5}}

Each registered term reads the per-token log-probs ``[B, T]`` of the current model and named batch tensors, and
calls an ``orchard.losses`` function with ``agg="token-sum-norm"`` and a *global* ``normalizer``: the number of
tokens its mask counts in the whole global batch (all micro-batches, all ranks). Summing micro-batch losses then
gives the whole-batch token mean exactly, so the gradient does not depend on how the batch is split.

| term | loss | batch keys it reads (besides ``action_mask``) | mask |
|---|---|---|---|
| ``sft`` | ``sft_loss`` (inputs masked: only assistant tokens) | — | ``action_mask`` |
| ``credit_sft`` | ``sft_loss`` on the credit-assigned mask | ``sft_mask`` (from ``credit_assigned_sft_mask``) | ``sft_mask`` |
| ``policy`` | ``policy_loss`` (GRPO/PPO, clip 0.2 / 0.28) | ``old_logprobs``, ``advantages`` (and ``rollout_logprobs`` when present: the IS correction) | ``policy_mask`` |
| ``k2_opd`` / ``k3_opd`` / ``js_opd`` | on-policy distillation | ``teacher_logprobs`` | ``action_mask`` |
| ``kl`` | ``kl_penalty`` to a reference (kwarg ``kind``, default ``k3+``) | ``ref_logprobs`` | ``action_mask`` |

``policy_mask`` is derived (``with_derived_masks``): ``action_mask & logprob_mask`` when the batch has
``logprob_mask`` (rendering marks where the sampling log-prob is known; a ratio needs it), else ``action_mask``.

The terms are the entries of ``LOSS_TERMS`` (an ``orchard._registry.Registry``, like every named variant).

Metrics of a term keep the loss's own keys (``clip/low_frac``); ``loss/<term>`` is the term's unweighted value.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from orchard._registry import Registry

__all__ = [
    "LOSS_TERMS",
    "LossTerm",
    "TermSpec",
    "objective_loss",
    "term_mask_key",
    "with_derived_masks",
]


@dataclass
class LossTerm:
    """One weighted term of the objective."""

    name: str
    """Registered term name: sft, credit_sft, policy, k2_opd, k3_opd, js_opd, kl (see ``LOSS_TERMS.names()``)."""
    weight: float = 1.0
    """Coefficient of this term in the summed loss."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the loss function (e.g. eps_low, eps_high for policy; lam for js_opd)."""


TermFn = Callable[..., "tuple[Tensor, dict[str, Tensor]]"]


@dataclass(frozen=True)
class TermSpec:
    """How a term is computed: ``fn(logprobs [B, T], batch, normalizer, **kwargs) -> (loss, metrics)``.

    ``fn`` must aggregate with ``agg="token-sum-norm"`` and the given ``normalizer`` (the global count of
    ``batch[mask_key]``) for micro-batch invariance. Calling a spec calls ``fn``.
    """

    fn: TermFn
    mask_key: str = "action_mask"
    """Batch key of the mask whose global token count normalises the term."""
    needs: tuple[str, ...] = ()
    """Batch keys the term reads besides its mask."""
    loss: str | Callable[..., Any] | None = None
    """The loss ``fn`` hands a term's ``kwargs`` to (a function, or its name in ``orchard.losses``):
    ``check_objective`` checks the kwargs against its keyword parameters, so a misspelt one is a config error, not
    a ``TypeError`` at the first step with signal. None leaves them unchecked."""
    sets: tuple[str, ...] = ("agg", "normalizer")
    """Keyword parameters of ``loss`` that ``fn`` passes itself: a term's kwargs may not name them."""

    def __call__(self, logprobs: Tensor, batch: Mapping[str, Tensor], normalizer: float, **kwargs: Any) -> Any:
        return self.fn(logprobs, batch, normalizer, **kwargs)


LOSS_TERMS: Registry[TermSpec | TermFn] = Registry("loss term")
"""The objective's named terms. Add one with ``LOSS_TERMS.register(name, TermSpec(fn, mask_key=..., needs=...))``;
a bare ``fn`` registers as ``TermSpec(fn)`` (mask ``action_mask``, no other keys)."""


def _spec(name: object, arg: str = "name") -> TermSpec:
    entry = LOSS_TERMS.get(name, arg)
    return entry if isinstance(entry, TermSpec) else TermSpec(entry)


def term_mask_key(name: str) -> str:
    """The batch key of the mask whose global token count normalises term ``name``."""
    return _spec(name).mask_key


def with_derived_masks(batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``batch`` plus the masks computed from others: ``policy_mask`` (module docstring), unless present."""
    out = dict(batch)
    if "policy_mask" not in out and "action_mask" in out:
        mask = out["action_mask"].bool()
        if "logprob_mask" in out:
            mask = mask & out["logprob_mask"].bool()
        out["policy_mask"] = mask
    return out


def check_objective(objective: list[LossTerm], batch_keys: set[str] | None = None) -> None:
    """Validate an objective (names, weights) and, given the batch's keys, that every term finds its inputs."""
    if not isinstance(objective, list) or not objective:
        raise ValueError(f"objective must be a non-empty list of LossTerm, got {objective!r}")
    for i, term in enumerate(objective):
        if not isinstance(term, LossTerm):
            raise ValueError(f"objective[{i}] must be a LossTerm, got {type(term).__name__}")
        spec = _spec(term.name, f"objective[{i}].name")
        if not isinstance(term.weight, (int, float)) or not torch.isfinite(torch.tensor(float(term.weight))):
            raise ValueError(f"objective[{i}].weight must be a finite number, got {term.weight!r}")
        _check_kwargs(spec, term, f"objective[{i}].kwargs")
        if batch_keys is not None:
            missing = [k for k in (spec.mask_key, *spec.needs) if k not in batch_keys]
            if missing:
                raise ValueError(
                    f"objective[{i}] ({term.name!r}) needs batch key {missing[0]!r}; batch has {sorted(batch_keys)}"
                )


def _check_kwargs(spec: TermSpec, term: LossTerm, arg: str) -> None:
    if not isinstance(term.kwargs, Mapping):
        raise ValueError(f"{arg} must be a mapping of keyword arguments, got {term.kwargs!r}")
    if spec.loss is None:
        return
    loss = spec.loss
    if isinstance(loss, str):
        import orchard.losses

        loss = getattr(orchard.losses, loss)
    name = getattr(loss, "__name__", repr(loss))
    params = inspect.signature(loss).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    # The loss's leading positional parameters are the tensors the term reads from the batch.
    takes = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in spec.sets]
    for key in term.kwargs:
        if key in spec.sets:
            raise ValueError(f"{arg} sets {key!r}, which the {term.name} term passes to {name} itself")
        if key not in takes:
            close = difflib.get_close_matches(str(key), takes, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"{arg} has {key!r}, which {name} (the {term.name} term) does not take; {hint}"
                             f"it takes: {', '.join(takes) or 'nothing'}")


def objective_loss(
    objective: list[LossTerm],
    logprobs: Tensor,
    batch: Mapping[str, Tensor],
    normalizers: Mapping[str, float],
) -> tuple[Tensor, dict[str, Tensor]]:
    """``Σ_k w_k · loss_k`` on one micro-batch, each term normalised by ``normalizers[term mask key]``.

    Args:
        objective: the terms.
        logprobs: per-token log-probs of the trained model, aligned with ``input_ids``. Shape: ``[B, T]``.
        batch: the micro-batch tensors (``[B, T]``; ``advantages`` may be ``[B]``).
        normalizers: global token count per mask key (> 0).

    Returns:
        ``(loss, metrics)``; metrics hold ``loss/<term>`` and each loss's own detached metrics.
    """
    loss, metrics, _ = objective_loss_with_sources(objective, logprobs, batch, normalizers)
    return loss, metrics


def objective_loss_with_sources(
    objective: list[LossTerm],
    logprobs: Tensor,
    batch: Mapping[str, Tensor],
    normalizers: Mapping[str, float],
) -> tuple[Tensor, dict[str, Tensor], dict[str, str]]:
    """``objective_loss`` plus, for every metric key, the mask key of the term that produced it (so a trainer
    can weight a per-micro-batch mean by the right token count when it combines micro-batches)."""
    batch = with_derived_masks(batch)
    check_objective(objective, set(batch))
    total = logprobs.new_zeros(())
    metrics: dict[str, Tensor] = {}
    sources: dict[str, str] = {}
    for term in objective:
        spec = _spec(term.name)
        loss, term_metrics = spec.fn(logprobs, batch, normalizers[spec.mask_key], **term.kwargs)
        total = total + float(term.weight) * loss
        metrics[f"loss/{term.name}"] = loss.detach()
        sources[f"loss/{term.name}"] = spec.mask_key
        for key, value in term_metrics.items():
            name = key if key not in metrics else f"{term.name}/{key}"
            metrics[name] = value
            sources[name] = spec.mask_key
    return total, metrics, sources


def _sft(logprobs: Tensor, batch: Mapping[str, Tensor], normalizer: float, **kw: Any) -> tuple[Tensor, dict]:
    from orchard.losses import sft_loss

    return sft_loss(logprobs, batch["action_mask"], agg="token-sum-norm", normalizer=normalizer, **kw)


def _credit_sft(logprobs: Tensor, batch: Mapping[str, Tensor], normalizer: float, **kw: Any) -> tuple[Tensor, dict]:
    from orchard.losses import sft_loss

    return sft_loss(logprobs, batch["sft_mask"], agg="token-sum-norm", normalizer=normalizer, **kw)


def _policy(logprobs: Tensor, batch: Mapping[str, Tensor], normalizer: float, **kw: Any) -> tuple[Tensor, dict]:
    from orchard.losses import policy_loss

    return policy_loss(
        logprobs, batch["old_logprobs"], batch["advantages"], batch["policy_mask"],
        rollout_logprobs=batch.get("rollout_logprobs"), agg="token-sum-norm", normalizer=normalizer, **kw,
    )


def _opd(loss_name: str) -> TermFn:
    def term(logprobs: Tensor, batch: Mapping[str, Tensor], normalizer: float, **kw: Any) -> tuple[Tensor, dict]:
        import orchard.losses

        fn = getattr(orchard.losses, loss_name)
        return fn(logprobs, batch["teacher_logprobs"], batch["action_mask"], agg="token-sum-norm",
                  normalizer=normalizer, **kw)

    return term


def _kl(logprobs: Tensor, batch: Mapping[str, Tensor], normalizer: float, **kw: Any) -> tuple[Tensor, dict]:
    from orchard.losses import kl_penalty

    return kl_penalty(logprobs, batch["ref_logprobs"], batch["action_mask"], agg="token-sum-norm",
                      normalizer=normalizer, **kw)


LOSS_TERMS.register("sft", TermSpec(_sft, loss="sft_loss"))
LOSS_TERMS.register("credit_sft", TermSpec(_credit_sft, mask_key="sft_mask", loss="sft_loss"))
LOSS_TERMS.register("policy", TermSpec(_policy, mask_key="policy_mask", needs=("old_logprobs", "advantages"),
                                       loss="policy_loss", sets=("agg", "normalizer", "rollout_logprobs")))
LOSS_TERMS.register("k2_opd", TermSpec(_opd("k2_opd_loss"), needs=("teacher_logprobs",), loss="k2_opd_loss"))
LOSS_TERMS.register("k3_opd", TermSpec(_opd("k3_opd_loss"), needs=("teacher_logprobs",), loss="k3_opd_loss"))
LOSS_TERMS.register("js_opd", TermSpec(_opd("js_opd_loss"), needs=("teacher_logprobs",), loss="js_opd_loss"))
LOSS_TERMS.register("kl", TermSpec(_kl, needs=("ref_logprobs",), loss="kl_penalty"))
