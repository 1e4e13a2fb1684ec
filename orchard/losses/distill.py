"""On-policy distillation (OPD) losses on tokens the student sampled.

The student ``π`` samples ``y_t``; a teacher ``π_T`` scores the same tokens. Each loss takes the student's
log-probs (with grad) and the teacher's (detached here: no gradient ever reaches the teacher), per token
``[B, T]``. Notation: ``δ = log π(y) − log π_T(y)``, ``ρ = π_T(y) / π(y) = exp(−δ)``, ``sg`` = stop-gradient,
``M = λπ + (1 − λ)π_T``.

| loss            | per-token loss ``ℓ``                     | per-sample ``∇ℓ``    | ``E_{y~π}[∇ℓ]``        |
|-----------------|------------------------------------------|----------------------|------------------------|
| ``k2_opd_loss`` | ``½ δ²``                                 | ``δ ∇ log π``        | ``∇ KL(π ‖ π_T)``      |
| ``k3_opd_loss`` | ``K3 · π/sg(π)``, ``K3 = ρ − 1 − log ρ`` | ``δ ∇ log π``        | ``∇ KL(π ‖ π_T)``      |
| ``js_opd_loss`` | ``sg(log(π/M)) · log π``                 | ``log(π/M) ∇ log π`` | ``∇ JS_λ(π, π_T) / λ`` |

Why (expectations over ``y ~ π`` with the sampling distribution held fixed, as when a sampled loss is
differentiated; ``Σ_y π ∇ log π = ∇ Σ_y π = 0``):

* Reverse KL: ``∇ KL(π ‖ π_T) = ∇ Σ π (log π − log π_T) = Σ ∇π · δ + Σ π ∇ log π = E_π[δ ∇ log π]``. K2's
  gradient is ``δ ∇ log π``, so K2 estimates the reverse-KL gradient although its *value* ``½ δ²`` is not an
  unbiased estimate of the KL.
* K3's value is unbiased for the same divergence, ``E_π[ρ − 1 − log ρ] = 1 − 1 + KL(π ‖ π_T)``, but its plain
  gradient ``∇K3 = (1 − ρ) ∇ log π`` has expectation ``−Σ π_T ∇ log π = ∇ KL(π_T ‖ π)``: the *forward* KL,
  because it drops the score-function term of ``∇ E_π[K3]``. Multiplying by ``π / sg(π)`` (value 1, gradient
  ``∇ log π``) restores it: ``∇ℓ = (1 − ρ + K3) ∇ log π = δ ∇ log π``, the reverse-KL gradient, with no
  ``ρ`` left in it — the "stabilized" K3. We compute that gradient in this closed form rather than letting
  autograd add ``−ρ`` and ``+ρ`` (which cancel catastrophically when ``ρ`` is large); the value stays ``K3``.
* JS: with ``JS_λ(π, π_T) = λ KL(π ‖ M) + (1 − λ) KL(π_T ‖ M)``,
  ``∇ JS_λ = λ Σ ∇π log(π / M) + λ Σ ∇π − λ Σ ∇π (λπ + (1 − λ)π_T) / M = λ E_π[log(π / M) ∇ log π]``,
  so the surrogate's expected gradient is ``∇ JS_λ / λ`` (twice the JS gradient at the default ``λ = 0.5``).
  JS is bounded (``≤ log 2`` at ``λ = 0.5``) and its per-token weight ``log(π / M) ≤ log(1/λ)`` is bounded
  above, which keeps the update tame where the teacher gives the student's token near-zero probability. The
  value of the surrogate is not a divergence; the metric ``opd/js`` is an unbiased estimate of ``JS_λ``.

Adding distillation to a GRPO outcome loss (the teacher's log-probs of the student's sampled tokens come from
a forward pass of the teacher on the rollout; they must not require grad, and are detached here regardless)::

    pg_loss, pg_metrics = policy_loss(logprobs, old_logprobs, advantages, mask)
    opd_loss, opd_metrics = js_opd_loss(logprobs, teacher_logprobs, mask)  # same mask, same agg
    loss = pg_loss + beta * opd_loss                                        # beta: the OPD coefficient
    metrics = {**pg_metrics, **opd_metrics}                                 # keys do not collide

Use the same ``agg`` (and ``normalizer``) for both terms so ``beta`` means the same thing in every batch.

Metrics (detached, means over counted tokens): ``opd/reverse_kl_k1`` (``mean δ``, unbiased for
``KL(π ‖ π_T)``), ``opd/reverse_kl_k3`` (``mean K3``, unbiased and non-negative per token),
``opd/teacher_logprob`` (``mean log π_T``); ``js_opd_loss`` adds ``opd/js``
(``mean[λ log(π/M) + (1 − λ) ρ log(π_T/M)]``, unbiased for ``JS_λ``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from orchard.losses._validation import (
    as_weighted_mask,
    check_bt,
    check_float,
    check_real,
    check_same_shape,
    masked_mean,
    validate_counted,
    zero_outside,
)
from orchard.losses.aggregate import AggFn, reduce_masked, resolve_agg


def _prepare(
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    agg: str,
    normalizer: float | Tensor | None,
    validate: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, AggFn]:
    student = check_float("student_logprobs", check_bt("student_logprobs", student_logprobs))
    teacher = check_float(
        "teacher_logprobs",
        check_same_shape("teacher_logprobs", teacher_logprobs, "student_logprobs", student),
    )
    raw_mask = mask
    mask, weight = as_weighted_mask("mask", mask, "student_logprobs", student)
    agg_fn = resolve_agg(agg, normalizer)
    if validate:
        validate_counted(raw_mask, mask, logprobs={"student_logprobs": student, "teacher_logprobs": teacher})
    student = zero_outside(mask, student)
    teacher = zero_outside(mask, teacher.detach().to(student.dtype))
    return student, teacher, mask, weight, agg_fn


def _k3(delta: Tensor) -> Tensor:
    return (-delta).expm1() + delta  # ρ − 1 − log ρ with ρ = exp(−δ)


def _metrics(student: Tensor, teacher: Tensor, mask: Tensor) -> dict[str, Tensor]:
    with torch.no_grad():
        delta = student - teacher
        return {
            "opd/reverse_kl_k1": masked_mean(delta, mask),
            "opd/reverse_kl_k3": masked_mean(_k3(delta), mask),
            "opd/teacher_logprob": masked_mean(teacher, mask),
        }


def k2_opd_loss(
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    *,
    agg: str = "token-mean",
    normalizer: float | Tensor | None = None,
    validate: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """K2 on-policy distillation: ``ℓ_t = ½ (log π(y_t) − log π_T(y_t))²``, reduced with ``agg``.

    Expected gradient under ``y ~ π``: ``∇ KL(π ‖ π_T)`` (reverse KL; see the module docstring).

    Args:
        student_logprobs: ``log π(y_t)`` of the sampled tokens, with grad. Shape: ``[B, T]``.
        teacher_logprobs: ``log π_T(y_t)`` of the same tokens; detached. Shape: ``[B, T]``.
        mask: 1/True on action tokens that count. Shape: ``[B, T]``. Masked positions may hold anything. A
            non-bool mask's value weights the token's loss (metrics stay unweighted).
        agg: aggregation mode; default ``"token-mean"``.
        normalizer: the aggregation's global normaliser (required for ``"token-sum-norm"``).
        validate: check (one device sync) that both log-prob tensors are finite and ``<= 1e-4`` where counted
            (a teacher log-prob of ``−inf`` is refused too) and the mask's weights finite and ``>= 0``; default
            off.

    Returns:
        ``(loss, metrics)`` with the ``opd/*`` metrics of the module docstring.
    """
    student, teacher, mask, weight, agg_fn = _prepare(
        student_logprobs, teacher_logprobs, mask, agg, normalizer, validate
    )
    per_token = 0.5 * (student - teacher).square()  # [B, T]
    return reduce_masked(per_token, mask, agg_fn, normalizer, weight), _metrics(student, teacher, mask)


def k3_opd_loss(
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    *,
    agg: str = "token-mean",
    normalizer: float | Tensor | None = None,
    validate: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Stabilized K3 on-policy distillation: ``ℓ_t = K3 · π/sg(π)``, ``K3 = ρ − 1 − log ρ``, ``ρ = π_T/π``.

    Value: ``K3`` (unbiased for ``KL(π ‖ π_T)``). Gradient: ``(log π − log π_T) ∇ log π``, computed in that
    closed form (equal to autograd's on the literal product, without its cancellation); its expectation under
    ``y ~ π`` is ``∇ KL(π ‖ π_T)``. Arguments and returns as ``k2_opd_loss``.
    """
    student, teacher, mask, weight, agg_fn = _prepare(
        student_logprobs, teacher_logprobs, mask, agg, normalizer, validate
    )
    delta = student - teacher  # [B, T]
    per_token = _k3(delta).detach() + delta.detach() * (student - student.detach())
    return reduce_masked(per_token, mask, agg_fn, normalizer, weight), _metrics(student, teacher, mask)


def js_opd_loss(
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    *,
    lam: float = 0.5,
    agg: str = "token-mean",
    normalizer: float | Tensor | None = None,
    validate: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Jensen-Shannon on-policy distillation surrogate: ``ℓ_t = sg(log(π/M)) · log π``, ``M = λπ + (1−λ)π_T``.

    Expected gradient under ``y ~ π``: ``∇ JS_λ(π, π_T) / λ`` with
    ``JS_λ = λ KL(π ‖ M) + (1 − λ) KL(π_T ‖ M)`` (see the module docstring).

    Args:
        student_logprobs, teacher_logprobs, mask, agg, normalizer, validate: as ``k2_opd_loss``.
        lam: the mixture weight ``λ`` of the student in ``M``, in ``(0, 1)``; default 0.5 (the paper's).

    Returns:
        ``(loss, metrics)``; metrics add ``opd/js``, an unbiased estimate of ``JS_λ``.
    """
    if not 0 < check_real("lam", lam, " in (0, 1)") < 1:
        raise ValueError(f"lam must be a finite number in (0, 1), got {lam!r}")
    student, teacher, mask, weight, agg_fn = _prepare(
        student_logprobs, teacher_logprobs, mask, agg, normalizer, validate
    )
    log_m = torch.logaddexp(student + math.log(lam), teacher + math.log1p(-lam))  # [B, T], log M(y_t)
    per_token = (student - log_m).detach() * student
    metrics = _metrics(student, teacher, mask)
    with torch.no_grad():
        rho = (teacher - student).exp()
        # ρ log(π_T/M) → 0 as π_T → 0; select so a zero-probability teacher token gives 0, not 0·(−inf).
        teacher_term = torch.where(rho > 0, rho * (teacher - log_m), torch.zeros_like(rho))
        js = lam * (student - log_m) + (1 - lam) * teacher_term
        metrics["opd/js"] = masked_mean(js, mask)
    return reduce_masked(per_token, mask, agg_fn, normalizer, weight), metrics
