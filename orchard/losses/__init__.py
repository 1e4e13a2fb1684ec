"""orchard.losses: policy, KL, distillation and SFT losses as pure functions over ``[B, T]`` tensors.

Every loss returns ``(loss, metrics)``: a scalar tensor and a dict of detached tensors with namespaced keys,
and takes ``agg`` (see ``aggregate_loss``; the modes are ``AGG_MODES``) and ``normalizer`` keywords. Named
variants live in ``orchard._registry.Registry`` objects: ``AGG_MODES``, ``KL_ESTIMATORS``. See ``docs/losses.md``.
"""

from orchard.losses.aggregate import AGG_MODES, aggregate_loss
from orchard.losses.distill import js_opd_loss, k2_opd_loss, k3_opd_loss
from orchard.losses.fused import fused_token_logprobs, fused_token_loss
from orchard.losses.kl import KL_ESTIMATORS, kl_penalty
from orchard.losses.logprobs import token_logprobs
from orchard.losses.policy import policy_loss
from orchard.losses.sft import (
    credit_assigned_sft_mask,
    credit_runs,
    interpolate_step_values,
    sft_loss,
    td_credit,
)

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "aggregate_loss",
    "credit_assigned_sft_mask",
    "credit_runs",
    "fused_token_logprobs",
    "fused_token_loss",
    "interpolate_step_values",
    "js_opd_loss",
    "k2_opd_loss",
    "k3_opd_loss",
    "kl_penalty",
    "policy_loss",
    "sft_loss",
    "td_credit",
    "token_logprobs",
]
