"""The clipped policy-gradient loss of PPO / GRPO, with the variants RL on LLM agents uses.

Notation (per token ``t`` of sequence ``i``; all ``[B, T]`` unless marked):
    ``r = π(y_t) / π_old(y_t) = exp(log π − log π_old)``   importance ratio against the sampling policy
    ``A``                                              advantage, ``[B]`` broadcast over tokens or ``[B, T]``
    ``ℓ = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))``     clipped surrogate (PPO, Schulman et al. 2017)

Variants:
    * Asymmetric clipping ``ε_low = 0.2``, ``ε_high = 0.28`` ("clip-higher", DAPO; the Orchard paper's
      defaults).
    * Dual clip (Ye et al. 2020): for ``A < 0``, ``ℓ = min(ℓ, −A·c)`` with a constant ``c > 1``, so a token
      whose ratio exploded cannot dominate the update.
    * Rollout/trainer mismatch: the engine that sampled (vLLM, ...) and the trainer disagree slightly on
      ``π_old``. With ``rollout_logprobs`` the loss is weighted per token by ``w = π_old / π_rollout``
      (detached): ``is_mode="truncate"`` uses ``min(w, C)`` (truncated IS), ``is_mode="mask"`` uses
      ``w · 1[w ≤ C]`` (tokens past the threshold drop out), with ``C = tis_threshold``.
    * ``ratio_level="sequence"`` (GSPO, Zheng et al. 2025): every token of sequence ``i`` uses the
      length-normalised sequence ratio ``s_i = exp(mean_t(log π − log π_old))``, in its token form
      ``s_i · π(y_t) / sg(π(y_t))`` (value ``s_i``, gradient ``s_i ∇ log π(y_t)``); clipping acts on ``s_i``.
      With ``agg="seq-mean-token-mean"`` and ``[B]`` advantages this is exactly GSPO's objective. The IS
      weight is then also taken per sequence, as ``exp(mean_t log w)``. GSPO's paper uses much smaller clip
      ranges (``ε ≈ 3e-4 / 4e-4``); pass them explicitly.

The log-ratio is clamped to ``[−20, 20]`` before ``exp`` as an overflow guard; it never binds for ratios in
``[2e-9, 4.8e8]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from orchard.losses._validation import (
    as_weighted_mask,
    check_bt,
    check_float,
    check_positive_number,
    check_real,
    check_same_shape,
    check_tensor,
    masked_max,
    masked_mean,
    masked_min,
    validate_counted,
    zero_outside,
)
from orchard.losses.aggregate import reduce_masked, resolve_agg

_LOG_RATIO_BOUND = 20.0
_IS_MODES = ("truncate", "mask")
_RATIO_LEVELS = ("token", "sequence")


def _broadcast_advantages(advantages: object, logprobs: Tensor) -> Tensor:
    advantages = check_float("advantages", check_tensor("advantages", advantages))
    batch = logprobs.shape[0]
    if advantages.shape == logprobs.shape:
        return advantages
    if advantages.shape == (batch,):
        return advantages[:, None].expand_as(logprobs)  # [B] -> [B, T]
    raise ValueError(
        f"advantages must have shape [B] = ({batch},) or [B, T] = {tuple(logprobs.shape)}, "
        f"got shape {tuple(advantages.shape)}"
    )


def _row_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean over the counted tokens of each row, ``[B, T] -> [B]``; 0 for a row with none."""
    return zero_outside(mask, x).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    normalizer: float | Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
    tis_threshold: float = 2.0,
    is_mode: str = "truncate",
    ratio_level: str = "token",
    validate: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy-gradient loss (formulas in the module docstring), reduced with ``agg``.

    Args:
        logprobs: ``log π(y_t)`` under the policy being trained, with grad. Shape: ``[B, T]``.
        old_logprobs: ``log π_old(y_t)`` recomputed by the trainer before the update (detached here).
            Shape: ``[B, T]``.
        advantages: per sequence ``[B]`` (broadcast over tokens) or per token ``[B, T]`` (detached here).
        mask: 1/True on action tokens that count. Shape: ``[B, T]``. Masked positions of every input may hold
            anything (NaN, ±inf): they change neither the loss nor its gradient. A non-bool mask's value is the
            token's weight: it multiplies the token's loss, denominators still count tokens
            (``orchard.losses.aggregate``); metrics are unweighted.
        eps_low: lower clip range, ratio floor ``1 − eps_low``; default 0.2, in ``[0, 1)``.
        eps_high: upper clip range, ratio ceiling ``1 + eps_high``; default 0.28, ``≥ 0``.
        dual_clip: constant ``c > 1`` bounding the loss of negative-advantage tokens by ``−A·c``; default off.
        agg: aggregation mode (see ``orchard.losses.aggregate``); default ``"token-mean"``.
        normalizer: the aggregation's global normaliser (required for ``"token-sum-norm"``).
        rollout_logprobs: ``log π_rollout(y_t)`` reported by the inference engine; enables the IS correction.
            Shape: ``[B, T]``.
        tis_threshold: IS threshold ``C``; default 2.0. Used only with ``rollout_logprobs``.
        is_mode: ``"truncate"`` (weight ``min(w, C)``, default) or ``"mask"`` (weight ``w·1[w ≤ C]``).
        ratio_level: ``"token"`` (default) or ``"sequence"`` (GSPO).
        validate: check the inputs' values at counted positions (one device sync, so off by default): the
            log-probs finite and ``<= 1e-4``, the advantages finite, the mask's weights finite and ``>= 0``; a
            ``ValueError`` names the tensor and the first bad position. Off, a NaN or inf at a counted position
            gives a NaN or inf loss.

    Returns:
        ``(loss, metrics)``: the scalar loss, and detached scalars, each a mean over counted tokens:
        ``clip/low_frac`` (``A < 0`` and ``r < 1 − ε_low``: clipped from below), ``clip/high_frac``
        (``A > 0`` and ``r > 1 + ε_high``), ``clip/dual_frac`` (``A < 0`` and ``r > c``; 0 without dual
        clip), ``kl/approx`` (k3 estimate of ``KL(π_old ‖ π)`` from the token ratios:
        ``mean(r − 1 − log r)``), ``ratio/mean``, ``ratio/max``, ``ratio/min`` (of the ratio that is clipped:
        ``s_i`` for GSPO; 1 when no token counts);
        with ``rollout_logprobs`` also ``is/weight_mean`` (of the weight applied), ``is/weight_max``
        (raw ``w``) and ``is/clipped_frac`` (tokens where ``w > C``).
    """
    logprobs = check_float("logprobs", check_bt("logprobs", logprobs))
    old_logprobs = check_float(
        "old_logprobs", check_same_shape("old_logprobs", old_logprobs, "logprobs", logprobs)
    )
    advantages_BT = _broadcast_advantages(advantages, logprobs)
    raw_mask = mask
    mask, mask_weight = as_weighted_mask("mask", mask, "logprobs", logprobs)
    agg_fn = resolve_agg(agg, normalizer)
    if not 0 <= check_real("eps_low", eps_low, " in [0, 1)") < 1:
        raise ValueError(f"eps_low must be a finite number in [0, 1), got {eps_low!r}")
    if not check_real("eps_high", eps_high, " >= 0") >= 0:
        raise ValueError(f"eps_high must be a finite number >= 0, got {eps_high!r}")
    if dual_clip is not None:
        check_positive_number("dual_clip", dual_clip)
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip!r}")
    if is_mode not in _IS_MODES:
        raise ValueError(f"is_mode must be one of {list(_IS_MODES)}, got {is_mode!r}")
    if ratio_level not in _RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {list(_RATIO_LEVELS)}, got {ratio_level!r}")
    if rollout_logprobs is not None:
        rollout_logprobs = check_float(
            "rollout_logprobs", check_same_shape("rollout_logprobs", rollout_logprobs, "logprobs", logprobs)
        )
        check_positive_number("tis_threshold", tis_threshold)
    if validate:
        named_logprobs = {"logprobs": logprobs, "old_logprobs": old_logprobs}
        if rollout_logprobs is not None:
            named_logprobs["rollout_logprobs"] = rollout_logprobs
        validate_counted(raw_mask, mask, logprobs=named_logprobs, values={"advantages": advantages_BT})

    logp = zero_outside(mask, logprobs)
    old = zero_outside(mask, old_logprobs.detach().to(logprobs.dtype))
    adv = zero_outside(mask, advantages_BT.detach().to(logprobs.dtype))

    token_log_ratio = (logp - old).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)  # [B, T]
    log_ratio = token_log_ratio
    if ratio_level == "sequence":
        seq_log_ratio_B = _row_mean(logp - old, mask).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        log_ratio = seq_log_ratio_B.detach()[:, None] + (logp - logp.detach())  # [B, T], value s_i per token
    ratio = log_ratio.exp()  # [B, T]

    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - eps_low, 1 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * dual_clip), per_token)

    metrics: dict[str, Tensor] = {}
    if rollout_logprobs is not None:
        log_w = old - zero_outside(mask, rollout_logprobs.detach().to(logprobs.dtype))  # [B, T]
        if ratio_level == "sequence":
            log_w = _row_mean(log_w, mask)[:, None].expand_as(log_w)  # [B] -> [B, T]
        w = log_w.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND).exp()
        over = w > tis_threshold
        if is_mode == "truncate":
            weight = w.clamp(max=tis_threshold)
        else:
            weight = torch.where(over, torch.zeros_like(w), w)
        per_token = weight * per_token
        metrics["is/weight_mean"] = masked_mean(weight, mask)
        metrics["is/weight_max"] = masked_max(w, mask)
        metrics["is/clipped_frac"] = masked_mean(over.to(w.dtype), mask)

    loss = reduce_masked(per_token, mask, agg_fn, normalizer, mask_weight)

    with torch.no_grad():
        r = ratio.detach()
        low = (adv < 0) & (r < 1 - eps_low)
        high = (adv > 0) & (r > 1 + eps_high)
        dual = (adv < 0) & (r > dual_clip) if dual_clip is not None else torch.zeros_like(mask)
        metrics["clip/low_frac"] = masked_mean(low.to(r.dtype), mask)
        metrics["clip/high_frac"] = masked_mean(high.to(r.dtype), mask)
        metrics["clip/dual_frac"] = masked_mean(dual.to(r.dtype), mask)
        lr = token_log_ratio.detach()
        metrics["kl/approx"] = masked_mean(lr.expm1() - lr, mask)  # r − 1 − log r, token level
        metrics["ratio/mean"] = masked_mean(r, mask, empty=1.0)
        metrics["ratio/max"] = masked_max(r, mask, empty=1.0)
        metrics["ratio/min"] = masked_min(r, mask, empty=1.0)
    return loss, metrics
