"""Per-token KL estimators between the policy and a reference model, on tokens sampled from the policy.

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
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from orchard._registry import Registry
from orchard.losses._validation import as_bool_mask, check_bt, check_float, check_same_shape, zero_outside

KLFn = Callable[[Tensor], Tensor]
"""A KL estimator: ``fn(delta [B, T]) -> per-token value [B, T]`` where ``delta = log π − log π_ref``."""

_KL_KINDS: Registry[KLFn] = Registry("KL estimator")


def register_kl_kind(name: str, fn: KLFn) -> KLFn:
    """Register a KL estimator ``fn(delta) -> per-token value`` under ``name`` (``ValueError`` if taken)."""
    return _KL_KINDS.register(name, fn)


def kl_kinds() -> list[str]:
    """Names of the registered KL estimators."""
    return _KL_KINDS.names()


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


register_kl_kind("k1", _k1)
register_kl_kind("k2", _k2)
register_kl_kind("k3", _k3)
register_kl_kind("k3+", _k3_value_k2_grad)


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    kind: str = "k3+",
    *,
    mask: Tensor | None = None,
) -> Tensor:
    """Per-token KL estimate between the policy and a reference model (formulas in the module docstring).

    Args:
        logprobs: ``log π(y_t)`` of the sampled tokens under the policy, with grad. Shape: ``[B, T]``.
        ref_logprobs: ``log π_ref(y_t)`` under the reference model; detached here, so no gradient reaches it.
            Shape: ``[B, T]``.
        kind: one of ``kl_kinds()``: ``"k1"``, ``"k2"``, ``"k3"``, ``"k3+"`` (default; value k3, gradient k2).
        mask: optional ``[B, T]``; where it is 0/False the output is 0 with zero gradient, whatever the inputs
            hold there (NaN, ±inf).

    Returns:
        The per-token estimate, shape ``[B, T]``. Reduce it with ``aggregate_loss`` and add it to a loss as
        ``loss = pg_loss + beta * aggregate_loss(kl_penalty(lp, ref, "k3+"), mask)``.
    """
    logprobs = check_float("logprobs", check_bt("logprobs", logprobs))
    ref_logprobs = check_float(
        "ref_logprobs", check_same_shape("ref_logprobs", ref_logprobs, "logprobs", logprobs)
    )
    fn = _KL_KINDS.get(kind, "kind")
    ref_logprobs = ref_logprobs.detach()
    if mask is None:
        return fn(logprobs - ref_logprobs)
    mask = as_bool_mask("mask", mask, "logprobs", logprobs)
    delta = zero_outside(mask, logprobs) - zero_outside(mask, ref_logprobs)  # [B, T], 0 where masked
    return zero_outside(mask, fn(delta))
