"""The KL penalty to a reference model, on tokens sampled from the policy, and its per-token estimators.

Notation: ``y ~ π`` is a sampled token, ``δ = log π(y) − log π_ref(y)`` and ``ρ = π_ref(y) / π(y) = exp(−δ)``.
Schulman's estimators of ``KL(π ‖ π_ref) = E_π[δ]`` ("Approximating KL divergence", 2020):

| kind    | value                       | unbiased? | ``E_π[∇ value]`` when used as a loss                  |
|---------|-----------------------------|-----------|-------------------------------------------------------|
| ``k1``  | ``δ``                       | yes       | ``E_π[∇ log π] = 0``: no signal in expectation        |
| ``k2``  | ``½ δ²``                    | no        | ``E_π[δ ∇ log π] = ∇ KL(π ‖ π_ref)`` (reverse)        |
| ``k3``  | ``ρ − 1 − log ρ``           | yes, ≥ 0  | ``E_π[(1 − ρ) ∇ log π] = ∇ KL(π_ref ‖ π)`` (forward)  |
| ``k3+`` | k3's value, k2's gradient   | yes, ≥ 0  | ``∇ KL(π ‖ π_ref)`` (straight-through)                |

(The expectations treat the sampling distribution as fixed, which is how a penalty added to a loss is
differentiated.) ``k3+`` is what one usually wants from a KL penalty in the loss: a low-variance, unbiased,
non-negative value to log and the reverse-KL gradient to follow.

``kl_penalty`` is a loss like every other (``(loss, metrics)``, ``agg``, ``normalizer``); the per-token
estimators are the entries of ``KL_ESTIMATORS`` (``KL_ESTIMATORS.get("k3", "kind")(delta_BT)``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from orchard._registry import Registry
from orchard.losses._validation import (
    as_weighted_mask,
    check_bt,
    check_float,
    check_same_shape,
    masked_mean,
    masked_min,
    validate_counted,
    zero_outside,
)
from orchard.losses.aggregate import reduce_masked, resolve_agg

KLFn = Callable[[Tensor], Tensor]
"""A per-token KL estimator: ``fn(delta [B, T]) -> value [B, T]`` where ``delta = log π − log π_ref``."""

KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")
"""The per-token estimators ``kl_penalty(kind=...)`` accepts; add one with ``KL_ESTIMATORS.register``."""


def _k1(delta: Tensor) -> Tensor:
    return delta


def _k2(delta: Tensor) -> Tensor:
    return 0.5 * delta.square()


def _k3(delta: Tensor) -> Tensor:
    # ρ − 1 − log ρ with ρ = exp(−δ); expm1 keeps precision when δ is near 0.
    return (-delta).expm1() + delta


def _k3_value_k2_grad(delta: Tensor) -> Tensor:
    k2 = _k2(delta)
    return _k3(delta).detach() + (k2 - k2.detach())


KL_ESTIMATORS.register("k1", _k1)
KL_ESTIMATORS.register("k2", _k2)
KL_ESTIMATORS.register("k3", _k3)
KL_ESTIMATORS.register("k3+", _k3_value_k2_grad)


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    *,
    kind: str = "k3+",
    agg: str = "token-mean",
    normalizer: float | Tensor | None = None,
    validate: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL penalty to a reference model: the estimator ``kind`` per token, reduced with ``agg``.

    Args:
        logprobs: ``log π(y_t)`` of the sampled tokens under the policy, with grad. Shape: ``[B, T]``.
        ref_logprobs: ``log π_ref(y_t)`` under the reference model; detached here, so no gradient reaches it.
            Shape: ``[B, T]``.
        mask: 1/True on action tokens that count. Shape: ``[B, T]``. Masked positions may hold anything (NaN,
            ±inf): they change neither the loss nor its gradient. A non-bool mask's value weights the token.
        kind: one of ``KL_ESTIMATORS.names()``: ``"k1"``, ``"k2"``, ``"k3"``, ``"k3+"`` (default; value k3,
            gradient k2).
        agg: aggregation mode; default ``"token-mean"``.
        normalizer: the aggregation's global normaliser (required for ``"token-sum-norm"``).
        validate: check (one device sync) that both log-prob tensors are finite and ``<= 1e-4`` where counted
            and the mask's weights finite and ``>= 0``; default off.

    Returns:
        ``(loss, metrics)``, added to a policy loss as ``pg_loss + beta * loss``. Metrics (detached, means over
        counted tokens, both unbiased for ``KL(π ‖ π_ref)``): ``kl/k1_mean`` (``mean δ``) and ``kl/k3_mean``
        (``mean(ρ − 1 − log ρ)``, non-negative per token); and ``kl/delta_min``, the most negative ``δ`` (0
        when no token counts). k3 grows as ``e^{−δ}``: one token ``d`` nats below the reference adds about
        ``e^d / n`` to ``kl/k3_mean`` over ``n`` tokens (17 nats among 100 tokens: 2.4e5) while ``kl/k1_mean``
        barely moves, so ``kl/delta_min`` says whether a large k3 is one such token or a broad drift.
    """
    logprobs = check_float("logprobs", check_bt("logprobs", logprobs))
    ref_logprobs = check_float(
        "ref_logprobs", check_same_shape("ref_logprobs", ref_logprobs, "logprobs", logprobs)
    )
    raw_mask = mask
    mask, weight = as_weighted_mask("mask", mask, "logprobs", logprobs)
    fn = KL_ESTIMATORS.get(kind, "kind")
    agg_fn = resolve_agg(agg, normalizer)
    if validate:
        validate_counted(raw_mask, mask, logprobs={"logprobs": logprobs, "ref_logprobs": ref_logprobs})
    ref = zero_outside(mask, ref_logprobs.detach().to(logprobs.dtype))
    delta = zero_outside(mask, logprobs) - ref  # [B, T], 0 where masked
    loss = reduce_masked(fn(delta), mask, agg_fn, normalizer, weight)
    with torch.no_grad():
        d = delta.detach()
        metrics = {"kl/k1_mean": masked_mean(d, mask), "kl/k3_mean": masked_mean(_k3(d), mask),
                   "kl/delta_min": masked_min(d, mask)}
    return loss, metrics
