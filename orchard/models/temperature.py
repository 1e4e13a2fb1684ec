"""A sampling temperature folded into a causal LM's weights.

For the decoders below the logits are ``lm_head(norm(h))`` with a bias-free linear head and an RMSNorm whose output
is ``weight * h / rms(h)``; dividing ``weight`` by ``T`` divides every logit by ``T``, so the folded model sampled
at temperature 1.0 is the original sampled at ``T`` (and at ``t``, the original at ``T x t``). A recipe folds the
temperature at which a policy does best before RL, so RL starts from that policy at the temperature it samples with.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["FOLDABLE_MODELS", "fold_temperature"]

FOLDABLE_MODELS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
                   "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
"""The transformers classes whose forward is ``lm_head(model.norm(h))`` with an RMSNorm ``weight * h / rms(h)``
(Gemma's norm scales by ``1 + weight``, Cohere and Granite scale the logits: folding there would not be exact)."""

_LOGIT_CAPS = ("final_logit_softcapping",)
_LOGIT_SCALES = ("logit_scale", "logits_scaling")


def fold_temperature(model: Any, temperature: float) -> None:
    """Divides the final norm's weight of ``model`` by ``temperature`` in place: afterwards
    ``logits == original logits / temperature`` for every input, so sampling the model at 1.0 is sampling the
    original at ``temperature``.

    The division is done in float32 and rounded once to the weight's dtype (in bfloat16 the logits then match to
    bfloat16's precision, not bit for bit).

    Args:
        model: a transformers causal LM of `FOLDABLE_MODELS` (not wrapped: a DeepSpeed engine or a PEFT model
            is refused, as is a ZeRO-3 partitioned weight), with a bias-free ``lm_head`` right after
            ``model.model.norm`` and no logit soft-capping or scaling in its config.
        temperature: the temperature folded in, a finite number > 0.

    Raises:
        ValueError: naming ``temperature`` or ``model`` and why the fold would not be exact.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    cls = type(model)
    if cls.__name__ not in FOLDABLE_MODELS or not cls.__module__.startswith("transformers.models."):
        raise ValueError(f"model must be a transformers causal LM whose logits are lm_head(model.norm(h)), one of "
                         f"{list(FOLDABLE_MODELS)}, got {cls.__module__}.{cls.__name__}")
    config = model.config
    for name in _LOGIT_CAPS:
        if getattr(config, name, None) is not None:
            raise ValueError(f"model soft-caps its logits (config.{name}={getattr(config, name)!r}): a temperature "
                             "does not fold into the norm exactly")
    for name in _LOGIT_SCALES:
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ValueError(f"model scales its logits (config.{name}={getattr(config, name)!r}): fold the "
                             "temperature into that scale instead")
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"model.lm_head must be a torch.nn.Linear, got {type(head).__name__}")
    if head.bias is not None:
        raise ValueError("model.lm_head has a bias: dividing the norm's weight would not divide the bias, so the "
                         "logits would not scale by 1 / temperature")
    norm = getattr(getattr(model, "model", None), "norm", None)
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"model.model.norm must have a weight tensor (the final norm), got {type(norm).__name__}")
    if getattr(norm, "bias", None) is not None:
        raise ValueError("model.model.norm has a bias: the logits would not scale by 1 / temperature")
    if tuple(weight.shape) != (config.hidden_size,):
        raise ValueError(f"model.model.norm.weight must have shape ({config.hidden_size},) (hidden_size), got "
                         f"{tuple(weight.shape)} (a ZeRO-3 partitioned or otherwise sharded weight)")
    with torch.no_grad():
        weight.copy_((weight.float() / temperature).to(weight.dtype))
