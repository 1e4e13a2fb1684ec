"""Log-probs (and entropy) of a causal LM's action tokens without running the lm head on anything else.

An agent trajectory is mostly observation: tool output, file contents, the prompt. Only the action tokens (what
the policy sampled) need a log-prob, and the lm head over a 150k vocabulary is the single most expensive
matmul of the step. This helper runs the backbone over the whole sequence, keeps the hidden states at the
positions that predict an action token, and scores only those with ``orchard.losses.fused_token_logprobs``,
so neither ``[B, T, V]`` logits nor the observation tokens' logits are ever built. ``action_token_loss`` does
the same for a per-token loss through the one-pass ``orchard.losses.fused_token_loss`` (its gradients formed in
the forward: three lm-head matmuls instead of four).

ZeRO-3: the backbone's parameters are gathered by DeepSpeed's module hooks, but the lm-head weight is read
here directly, outside ``lm_head.forward``. Two ways make it whole:

- Call this helper inside the forward of the module handed to ``deepspeed.initialize`` (a small wrapper whose
  ``forward`` calls ``action_logprobs(self.lm, ...)``). During an engine forward DeepSpeed detects a
  partitioned parameter read from another module, gathers it and registers it as an external parameter of the
  running module, so it is gathered again for the backward. This covers tied heads too, where the weight is
  the input embedding that the backbone has just released.
- Outside an engine forward (for example scoring under ``torch.no_grad()``), wrap the call in
  ``with deepspeed.zero.GatheredParameters(list(model.get_output_embeddings().parameters()),
  modifier_rank=None):`` (and keep any ``backward`` inside that block). With a tied head the embedding module
  may partition the shared weight again when its own forward ends; there, prefer the first way.

A weight that is still partitioned (an empty placeholder) is refused with a ``ValueError`` rather than scored.
Neither path is exercised by the test suite, which has no multi-process ZeRO-3 run.

Images: a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) scores a batch with images when it gets
``pixel_values`` and ``image_grid_thw`` (and ``mm_token_type_ids``, which Qwen3-VL's M-RoPE needs), as
``orchard.data.collate`` builds them: the backbone is then the multimodal base model (``model.model``, which
encodes the images and writes them over their ``<|image_pad|>`` tokens) rather than the text decoder.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
from torch import Tensor, nn

from orchard.losses.fused import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_VOCAB_CHUNK_SIZE,
    TokenLoss,
    fused_token_logprobs,
    fused_token_loss,
)

__all__ = ["VISION_KEYS", "action_logprobs", "action_token_loss"]

VISION_KEYS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
"""The batch keys of images (``orchard.data.collate``) that a vision-language model's forward takes."""

# Config fields of HF models whose logits are not plain ``hidden @ W.T + b``; the fused path would be wrong.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _backbone(model: nn.Module) -> nn.Module:
    get_decoder = getattr(model, "get_decoder", None)
    backbone = get_decoder() if callable(get_decoder) else None
    if backbone is None or backbone is model:
        backbone = getattr(model, "model", None)
    if not isinstance(backbone, nn.Module):
        raise ValueError(
            f"model must be an HF causal LM with a backbone (model.get_decoder() or model.model), "
            f"got {type(model).__name__}"
        )
    return backbone


def _vision_backbone(model: nn.Module) -> nn.Module:
    """The multimodal base model of a vision-language model: it encodes the images (``get_decoder()`` of a
    Qwen-VL model is its text decoder, which would read the image tokens as plain tokens)."""
    base = getattr(model, "model", None)
    if not isinstance(base, nn.Module) or "pixel_values" not in inspect.signature(base.forward).parameters:
        raise ValueError(
            f"pixel_values were given but model takes no images: {type(model).__name__} has no multimodal "
            "backbone (model.model whose forward takes pixel_values); load a vision-language model"
        )
    return base


def _vision_inputs(
    input_ids: Tensor, pixel_values: Tensor | None, image_grid_thw: Tensor | None, mm_token_type_ids: Tensor | None
) -> dict[str, Tensor]:
    """Validate the image tensors; return the ones to pass to the backbone (empty without images)."""
    if mm_token_type_ids is not None and (
        not isinstance(mm_token_type_ids, Tensor) or mm_token_type_ids.shape != input_ids.shape
    ):
        shape = tuple(mm_token_type_ids.shape) if isinstance(mm_token_type_ids, Tensor) else mm_token_type_ids
        raise ValueError(f"mm_token_type_ids must have the shape of input_ids {tuple(input_ids.shape)}, got {shape}")
    if pixel_values is None and image_grid_thw is None:
        # Image tokens without pixels would be read as plain tokens: the images would be silently lost.
        if mm_token_type_ids is not None and bool(mm_token_type_ids.any()):
            raise ValueError("mm_token_type_ids marks image tokens but pixel_values and image_grid_thw are None")
        return {}
    if pixel_values is None or image_grid_thw is None:
        missing = "pixel_values" if pixel_values is None else "image_grid_thw"
        raise ValueError(f"{missing} is None: pixel_values and image_grid_thw go together")
    if not isinstance(image_grid_thw, Tensor) or image_grid_thw.dim() != 2 or image_grid_thw.shape[1] != 3 \
            or image_grid_thw.is_floating_point():
        shape = tuple(image_grid_thw.shape) if isinstance(image_grid_thw, Tensor) else type(image_grid_thw).__name__
        raise ValueError(f"image_grid_thw must be an integer [I, 3] tensor, got {shape}")
    patches = int(image_grid_thw.prod(dim=-1).sum())  # Σ_i t_i · h_i · w_i
    if not isinstance(pixel_values, Tensor) or pixel_values.dim() != 2 or pixel_values.shape[0] != patches:
        shape = tuple(pixel_values.shape) if isinstance(pixel_values, Tensor) else type(pixel_values).__name__
        raise ValueError(f"pixel_values must be [{patches}, D] (the patches of image_grid_thw), got {shape}")
    vision = {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}
    if mm_token_type_ids is not None:
        vision["mm_token_type_ids"] = mm_token_type_ids
    return vision


def _lm_head(model: nn.Module) -> tuple[Tensor, Tensor | None]:
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, Tensor):
        raise ValueError(
            f"model must expose its lm head via get_output_embeddings() with a .weight, got {type(head).__name__}"
        )
    status = getattr(weight, "ds_status", None)
    if weight.dim() != 2 or weight.numel() == 0 or (status is not None and status.name != "AVAILABLE"):
        raise ValueError(
            f"model's lm-head weight is partitioned (shape {tuple(weight.shape)}, ds_status {status}); under "
            "ZeRO-3 call action_logprobs inside the engine's forward, or gather it with "
            "deepspeed.zero.GatheredParameters(..., modifier_rank=None) around the call and the backward"
        )
    return weight, getattr(head, "bias", None)


def _check_plain_linear_head(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    for field in _LOGIT_TRANSFORMS:
        value = getattr(config, field, None)
        if value is not None and value != 1.0:
            raise ValueError(
                f"model's config sets {field}={value!r}: its logits are not hidden @ W.T + b, "
                "which is all the fused path computes"
            )


class _ActionRows(NamedTuple):
    hidden: Tensor  # [M, H], the backbone's states at the positions that predict an action, head dtype
    labels: Tensor  # [M], the action tokens
    weight: Tensor  # [V, H]
    bias: Tensor | None  # [V]
    place: Tensor  # [B, T] bool, the action tokens (row-major order of the M rows)


def _action_rows(
    model: nn.Module,
    input_ids: Tensor,
    action_mask: Tensor,
    attention_mask: Tensor | None,
    pixel_values: Tensor | None = None,
    image_grid_thw: Tensor | None = None,
    mm_token_type_ids: Tensor | None = None,
) -> _ActionRows | None:
    """Validate, run the backbone, keep the rows that predict action tokens; ``None`` for ``T = 0``."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a [B, T] tensor, got {shape}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
    if not isinstance(action_mask, Tensor) or action_mask.shape != input_ids.shape:
        shape = tuple(action_mask.shape) if isinstance(action_mask, Tensor) else type(action_mask).__name__
        raise ValueError(f"action_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {shape}")
    action = action_mask if action_mask.dtype == torch.bool else action_mask != 0  # [B, T]
    if attention_mask is not None:
        if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else attention_mask
            raise ValueError(
                f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {shape}"
            )
        if bool((action & (attention_mask == 0)).any()):
            raise ValueError("action_mask must be false wherever attention_mask is 0 (a padding token is no action)")
    if input_ids.shape[1] and bool(action[:, 0].any()):
        raise ValueError("action_mask must be false at t = 0: the first token has no position to be predicted from")
    vision = _vision_inputs(input_ids, pixel_values, image_grid_thw, mm_token_type_ids)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module (an HF causal LM), got {type(model).__name__}")
    backbone = _vision_backbone(model) if vision else _backbone(model)
    _check_plain_linear_head(model)

    if input_ids.shape[1] == 0:
        return None
    out = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **vision)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [B, T, H]
    weight, bias = _lm_head(model)  # read after the backbone ran: a ZeRO-3 engine gathers it on access
    targets = action[:, 1:]  # [B, T − 1]: position t − 1 predicts token t
    hidden_sel = hidden[:, :-1][targets]  # [M, H], M = number of action tokens
    labels_sel = input_ids[:, 1:][targets]  # [M]
    place = torch.zeros_like(action)
    place[:, 1:] = targets  # [B, T]: where each selected row's value belongs
    return _ActionRows(hidden_sel.to(weight.dtype), labels_sel, weight, bias, place)


def action_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    action_mask: Tensor,
    *,
    attention_mask: Tensor | None = None,
    pixel_values: Tensor | None = None,
    image_grid_thw: Tensor | None = None,
    mm_token_type_ids: Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK_SIZE,
) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token log-probs of the action tokens of a batch, computed only at the action positions.

    For every ``(b, t)`` with ``action_mask[b, t]``, with ``h[b, t − 1]`` the backbone's final hidden state
    one position earlier (token ``t`` is predicted from the prefix up to ``t − 1``):

        logp[b, t] = log softmax((h[b, t − 1] @ W.T + bias) / temperature)[input_ids[b, t]]
        entropy[b, t] = entropy of that same distribution

    and 0 everywhere else. Equal to ``log_softmax(model(input_ids, attention_mask=...).logits / τ)`` shifted and
    gathered, but the lm head never sees a non-action position. ``W`` is
    ``model.get_output_embeddings().weight`` (tied to the input embedding or not); its bias is used if present.

    Args:
        model: an HF causal LM (``Qwen3ForCausalLM`` and the like): ``get_decoder()`` or ``.model`` returns the
            backbone (its output's ``last_hidden_state`` is already final-normed) and
            ``get_output_embeddings()`` the lm head.
        input_ids: Shape: ``(B, T)``; integer token ids.
        action_mask: Shape: ``(B, T)``; true (nonzero) where the token is an action the policy sampled. Must be
            false at ``t = 0`` (nothing precedes it) and wherever ``attention_mask`` is 0.
        attention_mask: Shape: ``(B, T)``; 1 for real tokens, 0 for padding; passed to the backbone.
        pixel_values: Shape: ``(Σ_i t_i·h_i·w_i, D)``; the patches of the batch's images, all rows' images
            concatenated in row order (``orchard.data.collate``); with them the multimodal base model
            (``model.model``) is the backbone. ``None`` for a text batch.
        image_grid_thw: Shape: ``(I, 3)``; each image's patch grid ``(t, h, w)``; given with ``pixel_values``.
        mm_token_type_ids: Shape: ``(B, T)``; 1 on image tokens (Qwen3-VL's M-RoPE needs it); without
            ``pixel_values`` it must mark no token.
        temperature: the sampling temperature, so the log-probs match the engine's (default 1.0).
        return_entropy: also return the entropy at each action position.
        chunk_size, vocab_chunk_size: block sizes of ``fused_token_logprobs`` (defaults 1024 and 4096).

    Returns:
        ``logprobs`` of shape ``(B, T)`` in float32, or ``(logprobs, entropy)``; 0 at non-action positions.
        Differentiable with respect to the model's parameters.

    Raises:
        ValueError: naming the argument, for mismatched shapes, a non-integer ``input_ids``, an action at
            ``t = 0`` or on a padding token, a model without backbone or lm head, a partitioned (ZeRO-3) head
            weight, a model whose logits are not a plain linear head (soft-capping, logit scaling), image
            tensors that do not fit together (``pixel_values`` rows against ``image_grid_thw``, one without the
            other), or images for a model that takes none.
    """
    rows = _action_rows(model, input_ids, action_mask, attention_mask, pixel_values, image_grid_thw,
                        mm_token_type_ids)
    if rows is None:
        empty = torch.zeros(input_ids.shape[0], 0, device=input_ids.device)
        return (empty, empty.clone()) if return_entropy else empty
    result = fused_token_logprobs(
        rows.hidden,
        rows.weight,
        rows.labels,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        return_entropy=return_entropy,
        bias=rows.bias,
    )
    values = result if isinstance(result, tuple) else (result,)
    scattered = tuple(
        torch.zeros(rows.place.shape, dtype=v.dtype, device=v.device).masked_scatter(rows.place, v) for v in values
    )  # each [B, T]
    return scattered if return_entropy else scattered[0]


def action_token_loss(
    model: nn.Module,
    input_ids: Tensor,
    action_mask: Tensor,
    token_loss: TokenLoss,
    *,
    attention_mask: Tensor | None = None,
    pixel_values: Tensor | None = None,
    image_grid_thw: Tensor | None = None,
    mm_token_type_ids: Tensor | None = None,
    temperature: float = 1.0,
    need_entropy: bool = False,
    chunk_size: int | None = None,
) -> Tensor:
    """A per-token loss over the action tokens of a batch, through the one-pass ``fused_token_loss``.

    The backbone runs over the whole batch; only the ``M`` positions that predict an action token reach the lm
    head, in chunks, and the loss and its gradients are formed there (see ``orchard.losses.fused_token_loss``):

        loss = Σ_{(b, t) action} token_loss(logp[b, t], entropy[b, t], b·T + t)

    Args:
        model, input_ids, action_mask, attention_mask, temperature: as in ``action_logprobs``.
        pixel_values, image_grid_thw, mm_token_type_ids: a batch's images, as in ``action_logprobs``.
        token_loss: ``(logp, entropy, index) -> Tensor[n]`` on one chunk of action tokens. ``logp`` is float32
            and requires grad, ``entropy`` is ``None`` unless ``need_entropy``, and ``index`` holds the flat
            positions ``b·T + t`` of the chunk's tokens, so a ``[B, T]`` side input ``x`` is read as
            ``x.reshape(-1)[index]``. Side inputs are constants (see ``fused_token_loss``).
        need_entropy: pass the entropy to ``token_loss``.
        chunk_size: action tokens per block of ``fused_token_loss`` (default: its device-dependent default).

    Returns:
        The loss, a float32 scalar, differentiable (once) with respect to the model's parameters; 0 without
        any action token.

    Raises:
        ValueError: as ``action_logprobs`` and ``fused_token_loss``, naming the argument.
    """
    if not callable(token_loss):  # before the backbone runs
        raise ValueError(f"token_loss must be callable (logp, entropy, index) -> Tensor[n], got {token_loss!r}")
    rows = _action_rows(model, input_ids, action_mask, attention_mask, pixel_values, image_grid_thw,
                        mm_token_type_ids)
    if rows is None:
        return torch.zeros((), device=input_ids.device)
    flat_positions = rows.place.reshape(-1).nonzero().squeeze(1)  # [M], b·T + t of each selected row

    def on_positions(logp: Tensor, entropy: Tensor | None, index: Tensor) -> Tensor:
        return token_loss(logp, entropy, flat_positions[index])

    return fused_token_loss(
        rows.hidden,
        rows.weight,
        rows.labels,
        on_positions,
        temperature=temperature,
        chunk_size=chunk_size,
        bias=rows.bias,
        need_entropy=need_entropy,
    )
