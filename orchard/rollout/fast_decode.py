"""`DecodeForward`: `HFEngine`'s own one-token forward (and prefill) for the Llama family, without the per-step
overhead of the Hugging Face forward.

A decode step feeds one token per row. The HF forward spends most of such a step outside its matmuls: building a
4-D mask, the rotary module, per-module dispatch, and the ``DynamicCache`` concatenating every layer's keys and
values (a copy that grows with the sequence). This forward does the same arithmetic as the HF modules, reading
their parameters in place each step (no weight copies, so ``load_state_dict`` / `HFEngine.update_weights` keep
working and GPU memory is not doubled), over a `orchard.rollout.kv_cache.BatchCache` whose spare column it fills
in place:

    embed -> per layer: RMSNorm, q/k/v projections (+ bias: Qwen2), per-head RMSNorm of q and k (Qwen3), rotary at
    each row's position, attention of the new token over the row's cached columns (GQA; padding masked),
    o_proj, residual, RMSNorm, SiLU-gated MLP, residual -> final RMSNorm -> lm head (the last token only)

Prefill (`DecodeForward.prefill`: a group of new rows' prompt tokens, once per row, after any reused prefix)
does the same per token, with causal attention through ``F.scaled_dot_product_attention``; it replaces the HF
forward's per-call work (its 4-D mask, rotary module, cache wrappers), which dominates a short prefill such as
an agent turn's observation (on the HF forward, prefill was ~28 % of an episode's time, `benchmarks/README.md`).

Choices: rotary angles are computed per step from the model's own ``inv_freq`` buffer exactly as the HF rotary
module does (``position * inv_freq``, cos and sin in float32), so there is no table to size or grow. A decode
step's attention is two batched matmuls per layer with the query heads of a KV head grouped ``[B, Hkv, G, D]``.
The lm head is a plain ``F.linear``: ``W @ x^T`` was faster alone on one CPU thread, but its ``[V, B]`` result
must be transposed for the sampler, and in the engine neither form won beyond noise (measured at batch 16 and
64). Supported: ``model_type`` qwen3, qwen2, llama, mistral with the default rope, full attention in every layer,
SiLU MLP, and the modules of those HF classes; anything else is refused by `unsupported_reason` and runs on the
HF forward. Checked against the HF forward on CPU in float32; the ops are
plain torch, device-agnostic, but this forward has not been run on CUDA here.

Compiled (``DecodeForward(model, compiled=True)``, ``HFEngine(compile_decode=True)``): the step's arithmetic
runs through ``torch.compile`` (inductor), which fuses the element-wise ops between the matmuls (norms, rotary,
SiLU, residuals, mask, softmax) into a few generated kernels; the matmuls stay library calls.

- The cache write stays outside the graph, so that the graph mutates nothing: the compiled step attends over the
  ``L`` cached columns and the new token apart (one softmax over both scores, then ``probs[:L] @ values +
  probs[L] * v``) and returns every layer's new key and value with the logits; the caller then writes them into
  the buffers (two slice copies a layer). Same arithmetic as the eager step up to the order of a sum: logits
  within 4e-6 of it on a randomized tiny Qwen3 over 100 steps (the tests assert 1e-4 and equal greedy tokens).
- Shapes: the batch (rows join and leave) and the cache length (a column a step; buffers regrown by 64 columns,
  relaid when rows move) change, so both are marked as unbacked symbols before each call (plain dynamic sizes
  would still be specialized at 1: a one-row batch or a one-token prompt would compile a graph of its own). One
  graph then serves every batch and length. Measured (``TORCH_LOGS=recompiles`` and dynamo's graph counter): one
  compile in all for two one-token prompts, then 4 rows of 200 tokens (the cache grows from 5 to 205 columns,
  regrown 3 times), then rows of 50 to 200 tokens (the batch shrinks from 4 rows to 1).
- Weights: the model's parameters are inputs of the graph, read in place at each call (inductor's freezing,
  which would bake them in as constants, is off by default), so ``load_state_dict`` / `HFEngine.update_weights`
  reach the compiled step; the graph depends on the model's structure, not its instance, so a second engine over
  a model of the same shape reuses it. Dynamo keeps at most ``torch._dynamo.config.recompile_limit`` graphs per
  function (8): more model structures than that in one process fall back to eager steps (with a warning).
- Cost: the first call compiles; `HFEngine` makes that call when built (`DecodeForward.warm_up`, a throw-away
  one-token prompt), so no request waits on it and a compile that fails raises there. On the
  2-core CPU of this repository's CI, at load average 8-16, that took 30-80 s (the tiny test model and the bench
  and claw shapes of ``benchmarks/decode_step.py``), and 10-15 s for a graph already in inductor's on-disk
  cache (a later process, same structure). It pays for a run that decodes many thousands of tokens (an RL run),
  not for a short script.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from orchard.rollout.kv_cache import BatchCache, prefill_inputs

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")

_SDPA_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)
"""Whether ``F.scaled_dot_product_attention`` takes ``enable_gqa`` (torch >= 2.5): prefill then passes one mask per
row rather than one per query head of a KV head."""


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
        compiled: run the step's arithmetic through ``torch.compile`` (see the module docstring: a one-time
            compile of tens of seconds, then fewer, fused kernels per step). Default False.
    """

    def __init__(self, model: nn.Module, *, compiled: bool = False) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"model is not supported by the fast decode forward: {reason}")
        if not isinstance(compiled, bool):
            raise ValueError(f"compiled must be True or False, got {compiled!r}")
        if compiled and not hasattr(torch._dynamo.decorators, "mark_unbacked"):
            raise ValueError(f"compiled=True needs torch._dynamo.decorators.mark_unbacked, which torch "
                             f"{torch.__version__} lacks (the compiled step was checked on torch 2.13)")
        self.model = model
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = model.model.layers[0].self_attn.head_dim
        self.compiled = compiled
        self._compiled = torch.compile(self._step_apart_from_cache) if compiled else None

    def warm_up(self) -> None:
        """Compile the step now, on a one-row, one-token prompt that is thrown away, rather than on a first request
        (whose episode's time budget the compile would spend). A compile that fails raises here. No-op when not
        ``compiled``."""
        if self._compiled is None:
            return
        device = next(self.model.parameters()).device
        inputs = prefill_inputs(self.model.config, [None], [[0]], 0, device)
        cache = inputs.cache
        with torch.no_grad():
            self.prefill(inputs.input_ids, inputs.attention_mask, inputs.position_ids, cache)
            cache.advance(1)
            cache.reserve(1)
            cache.mask[:, cache.length] = 1
            self(torch.zeros(1, dtype=torch.long, device=device), torch.ones(1, dtype=torch.long, device=device),
                 cache)

    def __call__(self, ids_B: torch.Tensor, positions_B: torch.Tensor, cache: BatchCache) -> torch.Tensor:
        """Logits ``[B, V]`` of the token after ``ids_B`` (at ``positions_B``), whose keys and values are written
        to column ``cache.length`` (reserved, its ``mask`` column set by the caller); the caller then advances
        the cache by one column."""
        if self._compiled is None:
            return self._step_in_cache(ids_B, positions_B, cache)
        length = cache.length
        cached = [
            (k[:, :, :length], v[:, :, :length]) for k, v in zip(cache.keys, cache.values, strict=True)
        ]
        mask_BL = cache.mask[:, :length]
        # The batch and the cache length change from step to step: traced as symbols from the first compile on.
        # Unbacked ones, for which dynamo assumes no value: a plain dynamic size is still specialized when it is
        # 1 (a batch of one row, a one-token prompt), which would compile a graph of its own.
        for t in (ids_B, positions_B):
            torch._dynamo.decorators.mark_unbacked(t, 0)
        for t in (mask_BL, *(t for pair in cached for t in pair)):
            torch._dynamo.decorators.mark_unbacked(t, 0)
            torch._dynamo.decorators.mark_unbacked(t, t.dim() - 2 if t.dim() == 4 else 1)
        logits, new_kv = self._compiled(ids_B, positions_B, mask_BL, cached)
        for i, (k, v) in enumerate(new_kv):
            cache.write(i, k, v)
        return logits

    def _inputs(self, ids_B: torch.Tensor, positions_B: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The embedded tokens ``[B, hidden]`` and the rotary ``cos``, ``sin`` ``[B, 1, D]`` at their positions."""
        base = self.model.model
        # through the module with the HF forward's [B, 1] ids, so that hooks on it see every forward alike
        x_BH = base.embed_tokens(ids_B[:, None])[:, 0]  # [B, hidden]
        return (x_BH, *self._rotary(positions_B, x_BH.dtype))

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``[B, 1, *, D]`` at ``positions`` ``[B, *]``, broadcast over heads, as the HF rotary
        module computes them (``position * inv_freq`` in float32)."""
        inv_freq = self.model.model.rotary_emb.inv_freq.to(device=positions.device, dtype=torch.float32)
        freqs = positions[..., None].float() * inv_freq  # [B, *, D / 2]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, *, D]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _qkv(
        self, layer: nn.Module, x_BH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The new token's query ``[B, Hkv, G, D]`` (query heads grouped by KV head), key and value
        ``[B, Hkv, 1, D]``, after the q/k norms and the rotary."""
        attn, batch = layer.self_attn, x_BH.shape[0]
        h_BH = _rms_norm(x_BH, layer.input_layernorm)
        q = F.linear(h_BH, attn.q_proj.weight, attn.q_proj.bias).view(batch, self.heads, self.head_dim)
        k = F.linear(h_BH, attn.k_proj.weight, attn.k_proj.bias).view(batch, self.kv_heads, self.head_dim)
        v = F.linear(h_BH, attn.v_proj.weight, attn.v_proj.bias).view(batch, self.kv_heads, 1, self.head_dim)
        if hasattr(attn, "q_norm"):
            q, k = _rms_norm(q, attn.q_norm), _rms_norm(k, attn.k_norm)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        groups = self.heads // self.kv_heads
        return q.view(batch, self.kv_heads, groups, self.head_dim), k[:, :, None, :], v

    def _rest_of_layer(self, layer: nn.Module, x_BH: torch.Tensor, out_BKGD: torch.Tensor) -> torch.Tensor:
        """The layer's output ``[B, hidden]`` (``[B, S, hidden]`` in prefill) from its input and its attention's
        output: o_proj, residual, the MLP block, residual."""
        attn, mlp = layer.self_attn, layer.mlp
        out_BH = out_BKGD.reshape(*x_BH.shape[:-1], self.heads * self.head_dim)  # [B, Hq * D]
        x_BH = x_BH + F.linear(out_BH, attn.o_proj.weight, attn.o_proj.bias)
        h_BH = _rms_norm(x_BH, layer.post_attention_layernorm)
        gate = F.linear(h_BH, mlp.gate_proj.weight, mlp.gate_proj.bias)
        up = F.linear(h_BH, mlp.up_proj.weight, mlp.up_proj.bias)
        return x_BH + F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)

    def _logits(self, x_BH: torch.Tensor) -> torch.Tensor:
        head = self.model.lm_head
        return F.linear(_rms_norm(x_BH, self.model.model.norm), head.weight, head.bias)  # [B, V], last token only

    def prefill(
        self, ids_BS: torch.Tensor, mask_BC: torch.Tensor, positions_BS: torch.Tensor, cache: BatchCache
    ) -> torch.Tensor:
        """Logits ``[B, V]`` after the last of ``S`` new tokens per row, the HF forward's prefill on the fast path.

        Args:
            ids_BS: ``[B, S]`` new tokens, left-padded (`orchard.rollout.kv_cache.prefill_inputs`).
            mask_BC: ``[B, P + S]``, 1 on the columns of real tokens: ``P = cache.length`` cached ones (a reused
                prefix), then the new ones.
            positions_BS: ``[B, S]`` each new token's position.
            cache: room reserved for the ``S`` columns the new keys and values are written to; the caller
                advances it by ``S``.

        A new token attends causally over its row's real columns; a padding token only to itself (so that its
        keys and values, masked later, stay finite). Attention through ``F.scaled_dot_product_attention``, as
        the HF forward's default, which does not hold a ``[S, P + S]`` score matrix per head where a fused kernel
        exists. Eager, never compiled.
        """
        base = self.model.model
        batch, new = ids_BS.shape
        x = base.embed_tokens(ids_BS)  # [B, S, hidden]
        cos, sin = self._rotary(positions_BS, x.dtype)  # [B, 1, S, D]
        end = cache.length + new
        column = torch.arange(end, device=x.device)
        query_column = column[cache.length :, None]  # [S, 1]
        allowed_BSC = (mask_BC[:, None, :end] != 0) & (column <= query_column)
        allowed_BSC = allowed_BSC | (column == query_column)
        groups = self.heads // self.kv_heads
        if _SDPA_GQA:  # one [S, P + S] mask per row, whatever the number of query heads per KV head
            allowed_B1QC = allowed_BSC[:, None]
        else:
            # before torch 2.5 (no enable_gqa): the G query heads of a KV head go along the query axis,
            # [B, Hkv, G * S, D], with the mask repeated G times along it
            allowed_B1QC = allowed_BSC[:, None].expand(batch, groups, new, end).reshape(batch, 1, groups * new, end)
        for i, layer in enumerate(base.layers):
            attn = layer.self_attn
            h = _rms_norm(x, layer.input_layernorm)
            q = F.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(batch, new, self.heads, self.head_dim)
            k = F.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(batch, new, self.kv_heads, self.head_dim)
            v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(batch, new, self.kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):
                q, k = _rms_norm(q, attn.q_norm), _rms_norm(k, attn.k_norm)
            q = _rotate(q.transpose(1, 2), cos, sin)  # [B, Hq, S, D]
            k = _rotate(k.transpose(1, 2), cos, sin)  # [B, Hkv, S, D]
            keys, values = cache.write(i, k, v.transpose(1, 2))  # [B, Hkv, P + S, D]
            if _SDPA_GQA:
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed_B1QC, scale=attn.scaling,
                                                     enable_gqa=True)
            else:
                q_BKQD = q.reshape(batch, self.kv_heads, groups * new, self.head_dim)
                out = F.scaled_dot_product_attention(q_BKQD, keys, values, attn_mask=allowed_B1QC,
                                                     scale=attn.scaling)
            out_BSHD = out.view(batch, self.heads, new, self.head_dim).transpose(1, 2)  # [B, S, Hq, D]
            x = self._rest_of_layer(layer, x, out_BSHD)
        return self._logits(x[:, -1])

    def _step_in_cache(self, ids_B: torch.Tensor, positions_B: torch.Tensor, cache: BatchCache) -> torch.Tensor:
        """The eager step: each layer writes its new key and value into the cache, then attends over the
        cache's columns up to them (two matmuls)."""
        x_BH, cos, sin = self._inputs(ids_B, positions_B)
        end = cache.length + 1
        # additive mask over the row's columns: 0 where real, -inf on padding (the new column is always real)
        bias_B11L = torch.zeros(cache.mask.shape[0], end, dtype=x_BH.dtype, device=x_BH.device)
        bias_B11L = bias_B11L.masked_fill_(cache.mask[:, :end] == 0, float("-inf"))[:, None, None, :]
        for i, layer in enumerate(self.model.model.layers):
            q_BKGD, k, v = self._qkv(layer, x_BH, cos, sin)
            keys, values = cache.write(i, k, v)  # [B, Hkv, L + 1, D]
            scores = torch.matmul(q_BKGD, keys.transpose(2, 3)) * layer.self_attn.scaling  # [B, Hkv, G, L + 1]
            probs = torch.softmax((scores + bias_B11L).float(), dim=-1).to(x_BH.dtype)
            x_BH = self._rest_of_layer(layer, x_BH, torch.matmul(probs, values))
        return self._logits(x_BH)

    def _step_apart_from_cache(
        self,
        ids_B: torch.Tensor,
        positions_B: torch.Tensor,
        mask_BL: torch.Tensor,
        cached: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The compiled step: the same arithmetic without writing the cache, so that the compiled graph mutates
        nothing. Attention covers the ``L`` cached columns (``cached``: per layer keys and values
        ``[B, Hkv, L, D]``, ``mask_BL``) and the new token apart: one softmax over both, then ``probs[:L] @
        values + probs[L] * v``. Returns the logits ``[B, V]`` and each layer's new key and value
        ``[B, Hkv, 1, D]``, which the caller writes."""
        x_BH, cos, sin = self._inputs(ids_B, positions_B)
        bias_B11L = torch.where(mask_BL != 0, 0.0, float("-inf")).to(x_BH.dtype)[:, None, None, :]
        new_kv = []
        for layer, (keys, values) in zip(self.model.model.layers, cached, strict=True):
            q_BKGD, k, v = self._qkv(layer, x_BH, cos, sin)
            scaling = layer.self_attn.scaling
            scores = torch.matmul(q_BKGD, keys.transpose(2, 3)) * scaling + bias_B11L  # [B, Hkv, G, L]
            score_new = torch.matmul(q_BKGD, k.transpose(2, 3)) * scaling  # [B, Hkv, G, 1]
            probs = torch.softmax(torch.cat((scores, score_new), dim=-1).float(), dim=-1).to(x_BH.dtype)
            out_BKGD = torch.matmul(probs[..., :-1], values) + probs[..., -1:] * v  # [B, Hkv, G, D]
            x_BH = self._rest_of_layer(layer, x_BH, out_BKGD)
            new_kv.append((k, v))
        return self._logits(x_BH), new_kv
