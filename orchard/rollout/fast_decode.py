"""`DecodeForward`: `HFEngine`'s own one-token forward for the Llama family, without the per-step overhead of the
Hugging Face forward.

A decode step feeds one token per row. The HF forward spends most of such a step outside its matmuls: building a
4-D mask, the rotary module, per-module dispatch, and the ``DynamicCache`` concatenating every layer's keys and
values (a copy that grows with the sequence). This forward does the same arithmetic as the HF modules, reading
their parameters in place each step (no weight copies, so ``load_state_dict`` / `HFEngine.update_weights` keep
working and GPU memory is not doubled), over a `orchard.rollout.kv_cache.BatchCache` whose spare column it fills
in place:

    embed -> per layer: RMSNorm, q/k/v projections (+ bias: Qwen2), per-head RMSNorm of q and k (Qwen3), rotary at
    each row's position, attention of the new token over the row's cached columns (GQA; padding masked),
    o_proj, residual, RMSNorm, SiLU-gated MLP, residual -> final RMSNorm -> lm head (the last token only)

Choices: prefill stays on the HF forward (multi-token, once per row; it writes into the same buffers through a
``DynamicCache`` view). Rotary angles are computed per step from the model's own ``inv_freq`` buffer exactly as
the HF rotary module does (``position * inv_freq``, cos and sin in float32), so there is no table to size or
grow. Attention is two batched matmuls per layer with the query heads of a KV head grouped ``[B, Hkv, G, D]``.
The lm head is a plain ``F.linear``: ``W @ x^T`` was faster alone on one CPU thread, but its ``[V, B]`` result
must be transposed for the sampler, and in the engine neither form won beyond noise (measured at batch 16 and
64). Supported: ``model_type`` qwen3, qwen2, llama, mistral with the default rope, full
attention in every layer, SiLU MLP, and the modules of those HF classes; anything else is refused by
`unsupported_reason` and runs on the HF forward. Checked against the HF forward on CPU in float32; the ops are
plain torch, device-agnostic, but this forward has not been run on CUDA here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from orchard.rollout.kv_cache import BatchCache

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")


def unsupported_reason(model: nn.Module) -> str | None:
    """Why `DecodeForward` cannot run ``model``, or None when it can."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {list(SUPPORTED_MODEL_TYPES)}"
    base = getattr(model, "model", None)
    if not isinstance(getattr(model, "lm_head", None), nn.Linear) or base is None:
        return "the model is not a *ForCausalLM with .model and an nn.Linear .lm_head"
    if not isinstance(getattr(base, "embed_tokens", None), nn.Embedding):
        return "model.embed_tokens is not an nn.Embedding"
    rotary = getattr(base, "rotary_emb", None)
    rope_type = getattr(rotary, "rope_type", None)
    if rope_type != "default" or getattr(rotary, "attention_scaling", None) != 1.0:
        return f"rope type {rope_type!r}: only the default rope is supported"
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or (model_type == "mistral" and config.sliding_window is not None):
        return f"layer types {sorted(layer_types)} / sliding window: only full attention is supported"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r}: only silu is supported"
    if not _is_norm(base.norm):
        return "model.norm is not an RMSNorm with .weight and .variance_epsilon"
    for i, layer in enumerate(base.layers):
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if not all(type(m) is nn.Linear for m in linears):
            return f"layer {i}: a projection is not a plain nn.Linear (adapters and quantized layers are not)"
        if not (_is_norm(layer.input_layernorm) and _is_norm(layer.post_attention_layernorm)):
            return f"layer {i}: a norm is not an RMSNorm with .weight and .variance_epsilon"
        if (model_type == "qwen3") != hasattr(attn, "q_norm") or (
            model_type == "qwen3" and not (_is_norm(attn.q_norm) and _is_norm(attn.k_norm))
        ):
            return f"layer {i}: q/k norms do not match model_type {model_type!r}"
    return None


def _is_norm(module: Any) -> bool:
    return isinstance(getattr(module, "weight", None), torch.Tensor) and hasattr(module, "variance_epsilon")


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """The HF RMSNorm: in float32, cast back, then scaled by the weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x32.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF ``apply_rotary_pos_emb`` for one tensor: ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecodeForward:
    """One decode step of a supported model (see `unsupported_reason`): next-token logits of every row.

    Args:
        model: the HF causal LM; its modules are read at each call, never copied.
    """

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"model is not supported by the fast decode forward: {reason}")
        self.model = model
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = model.model.layers[0].self_attn.head_dim

    def __call__(self, ids_B: torch.Tensor, positions_B: torch.Tensor, cache: BatchCache) -> torch.Tensor:
        """Logits ``[B, V]`` of the token after ``ids_B`` (at ``positions_B``), whose keys and values are written
        to column ``cache.length`` (reserved, its ``mask`` column set by the caller); the caller then advances
        the cache by one column."""
        base = self.model.model
        batch, heads, kv_heads, head_dim = ids_B.shape[0], self.heads, self.kv_heads, self.head_dim
        groups = heads // kv_heads
        # through the module with the HF forward's [B, 1] ids, so that hooks on it see every forward alike
        x_BH = base.embed_tokens(ids_B[:, None])[:, 0]  # [B, hidden]
        dtype = x_BH.dtype
        inv_freq = base.rotary_emb.inv_freq.to(device=x_BH.device, dtype=torch.float32)
        freqs = positions_B[:, None].float() * inv_freq  # [B, D / 2]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [B, 1, D], broadcast over heads
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        end = cache.length + 1
        # additive mask over the row's columns: 0 where real, -inf on padding (the new column is always real)
        bias_B11L = torch.zeros(cache.mask.shape[0], end, dtype=dtype, device=x_BH.device)
        bias_B11L = bias_B11L.masked_fill_(cache.mask[:, :end] == 0, float("-inf"))[:, None, None, :]
        for i, layer in enumerate(base.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h_BH = _rms_norm(x_BH, layer.input_layernorm)
            q = F.linear(h_BH, attn.q_proj.weight, attn.q_proj.bias).view(batch, heads, head_dim)
            k = F.linear(h_BH, attn.k_proj.weight, attn.k_proj.bias).view(batch, kv_heads, head_dim)
            v = F.linear(h_BH, attn.v_proj.weight, attn.v_proj.bias).view(batch, kv_heads, 1, head_dim)
            if hasattr(attn, "q_norm"):
                q, k = _rms_norm(q, attn.q_norm), _rms_norm(k, attn.k_norm)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            keys, values = cache.write(i, k[:, :, None, :], v)  # [B, Hkv, L + 1, D]
            q_BKGD = q.view(batch, kv_heads, groups, head_dim)
            scores = torch.matmul(q_BKGD, keys.transpose(2, 3)) * attn.scaling  # [B, Hkv, G, L + 1]
            probs = torch.softmax((scores + bias_B11L).float(), dim=-1).to(dtype)
            out_BH = torch.matmul(probs, values).reshape(batch, heads * head_dim)  # [B, Hq * D]
            x_BH = x_BH + F.linear(out_BH, attn.o_proj.weight, attn.o_proj.bias)
            h_BH = _rms_norm(x_BH, layer.post_attention_layernorm)
            gate = F.linear(h_BH, mlp.gate_proj.weight, mlp.gate_proj.bias)
            up = F.linear(h_BH, mlp.up_proj.weight, mlp.up_proj.bias)
            x_BH = x_BH + F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        head = self.model.lm_head
        return F.linear(_rms_norm(x_BH, base.norm), head.weight, head.bias)  # [B, V], the last token only
