"""Aggregation of per-token losses into a scalar: the named ``agg`` modes every loss accepts.

Notation: ``x`` is the per-token loss ``[B, T]``, ``m`` the mask ``[B, T]`` (1/True: an action token that
counts), ``n_i = Σ_t m_it`` the number of counted tokens of row ``i``, and ``Z`` the optional ``normalizer``.

| mode                  | value                                   | default denominator         |
|-----------------------|-----------------------------------------|-----------------------------|
| ``token-mean``        | ``Σ_it m x / D``                        | ``D = Σ_it m`` (all tokens) |
| ``seq-mean-token-mean``| ``Σ_i (Σ_t m x / n_i) / D``            | ``D = #{i : n_i > 0}``      |
| ``seq-mean-token-sum``| ``Σ_i Σ_t m x / D``                     | ``D = #{i : n_i > 0}``      |
| ``token-sum-norm``    | ``Σ_it m x / Z``                        | ``Z`` is required           |

``normalizer`` replaces ``D`` in every mode. Given a *global* normaliser (the token count of the whole batch
for ``token-mean``, its number of non-empty sequences for the ``seq-mean`` modes, or any constant such as
``batch_size × max_len`` for ``token-sum-norm``, as in DAPO and Dr.GRPO), each row's contribution does not
depend on which micro-batch it lands in, so summing the micro-batch losses gives exactly the whole-batch loss
and gradient. Without one, each micro-batch normalises by its own count and the sum differs.

Masked positions may hold anything (NaN, ±inf): they are dropped by selection, never multiplied by zero, so
they change neither the value nor the gradient. A batch with no counted token aggregates to 0.

A mask is also a weight: a nonzero value counts the token and multiplies its loss (``x ← m·x``), while every
denominator above still counts tokens. A bool or 0/1 mask is the plain case; a float mask of 0.5 halves a
token's contribution without changing ``D``, so micro-batch invariance is unchanged. Metrics are unweighted.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from orchard._registry import Registry
from orchard.losses._validation import (
    as_weighted_mask,
    check_bt,
    check_counted,
    check_float,
    check_mask_weights,
    check_positive_number,
    zero_outside,
)

AggFn = Callable[[Tensor, Tensor, "float | Tensor | None"], Tensor]
"""An aggregation mode: ``fn(per_token [B, T] with masked positions already zero, mask [B, T] bool,
normalizer) -> scalar``."""

AGG_MODES: Registry[AggFn] = Registry("aggregation mode")
"""The named ``agg`` modes every loss accepts; add one with ``AGG_MODES.register(name, fn)``.

``fn(per_token, mask, normalizer)`` receives the per-token loss ``[B, T]`` with masked positions already set to 0
(and weighted by a float mask), the bool mask ``[B, T]``, and the caller's normaliser or ``None``; it returns a
scalar tensor."""


def _denominator(default: Tensor, normalizer: float | Tensor | None) -> Tensor | float:
    return default.clamp(min=1) if normalizer is None else normalizer


def _token_mean(x: Tensor, mask: Tensor, normalizer: float | Tensor | None) -> Tensor:
    return x.sum() / _denominator(mask.sum(), normalizer)


def _seq_mean_token_mean(x: Tensor, mask: Tensor, normalizer: float | Tensor | None) -> Tensor:
    n_B = mask.sum(dim=-1)
    row_mean_B = x.sum(dim=-1) / n_B.clamp(min=1)
    return row_mean_B.sum() / _denominator((n_B > 0).sum(), normalizer)


def _seq_mean_token_sum(x: Tensor, mask: Tensor, normalizer: float | Tensor | None) -> Tensor:
    n_B = mask.sum(dim=-1)
    return x.sum() / _denominator((n_B > 0).sum(), normalizer)


def _token_sum_norm(x: Tensor, mask: Tensor, normalizer: float | Tensor | None) -> Tensor:
    if normalizer is None:
        raise ValueError("normalizer is required for agg='token-sum-norm', got None")
    return x.sum() / normalizer


AGG_MODES.register("token-mean", _token_mean)
AGG_MODES.register("seq-mean-token-mean", _seq_mean_token_mean)
AGG_MODES.register("seq-mean-token-sum", _seq_mean_token_sum)
AGG_MODES.register("token-sum-norm", _token_sum_norm)


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    agg: str = "token-mean",
    *,
    normalizer: float | Tensor | None = None,
    validate: bool = False,
) -> Tensor:
    """Reduce a per-token loss to a scalar over the counted tokens (formulas in the module docstring).

    Args:
        per_token: per-token loss. Shape: ``[B, T]``, floating point.
        mask: where the token counts (nonzero) and its weight (the value). Shape: ``[B, T]``; bool, integer or
            float.
        agg: one of ``AGG_MODES.names()``; default ``"token-mean"``.
        normalizer: a positive constant replacing the mode's denominator (required by ``"token-sum-norm"``);
            a Python number or a 0-dim tensor (a tensor is not read, so it is not checked for sign).
        validate: check (one device sync) that ``per_token`` is finite where counted and the mask's weights are
            finite and ``>= 0``; default off, so a NaN at a counted position gives a NaN loss.

    Returns:
        A scalar tensor of ``per_token``'s dtype. 0 when no token counts.
    """
    per_token = check_float("per_token", check_bt("per_token", per_token))
    counted, weight = as_weighted_mask("mask", mask, "per_token", per_token)
    fn = resolve_agg(agg, normalizer)
    if validate:
        check_mask_weights("mask", mask)
        check_counted("per_token", per_token, counted)
    return reduce_masked(per_token, counted, fn, normalizer, weight)


def resolve_agg(agg: object, normalizer: object) -> AggFn:
    """Check an aggregation mode and normaliser before any work is done; return the mode's function."""
    fn = AGG_MODES.get(agg, "agg")
    if normalizer is not None:
        check_positive_number("normalizer", normalizer, allow_tensor=True)
    elif agg == "token-sum-norm":
        raise ValueError("normalizer is required for agg='token-sum-norm', got None")
    return fn


def reduce_masked(
    x: Tensor, mask: Tensor, fn: AggFn, normalizer: float | Tensor | None, weight: Tensor | None = None
) -> Tensor:
    """Aggregate an already validated ``x`` over a bool ``mask`` with a function from ``resolve_agg``, each
    counted token's value multiplied by ``weight`` (from ``as_weighted_mask``) when given."""
    x = zero_outside(mask, x)
    if weight is not None:
        x = x * zero_outside(mask, weight)  # [B, T]; selection first, so neither factor's garbage leaks
    return fn(x, mask, normalizer)
