"""``fused_token_logprobs``: log-probs (and entropy) of chosen tokens from hidden states, logits never built.

The forward walks (vocabulary, token) blocks with an online log-sum-exp and keeps ``lse`` and ``E_p[z]`` per
token; the backward rebuilds each block of logits from ``hidden`` and ``weight``: four ``T × H × V`` matmuls.
Notation and the gradient formulas: ``orchard.losses.fused``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from orchard.losses._fused_common import (
    DEFAULT_VOCAB_CHUNK_SIZE,
    accumulate_dtype,
    check_chunk,
    validate_head_inputs,
)

__all__ = ["DEFAULT_CHUNK_SIZE", "DEFAULT_VOCAB_CHUNK_SIZE", "fused_token_logprobs"]

DEFAULT_CHUNK_SIZE = 1024
"""Tokens per block. With ``DEFAULT_VOCAB_CHUNK_SIZE`` a float32 block is 1024 × 4096 × 4 B = 16 MiB, small
beside the weight gradient (V × H) that every path must hold; a GPU wants larger blocks (fewer launches)."""



def _block_logits(hidden_c: Tensor, weight_v: Tensor, bias_v: Tensor | None, inv_temperature: float) -> Tensor:
    """Tempered logits of one block, ``[n, v]`` in the accumulation dtype (a fresh tensor, safe to modify)."""
    if bias_v is None:
        logits = hidden_c @ weight_v.T  # [n, v], input dtype
    else:
        logits = torch.addmm(bias_v, hidden_c, weight_v.T)  # [n, v], input dtype
    z = logits.to(accumulate_dtype(logits.dtype))
    if inv_temperature != 1.0:
        z.mul_(inv_temperature)
    return z


def _label_columns(labels: Tensor, v0: int, v1: int) -> tuple[Tensor, Tensor]:
    """For block ``[v0, v1)``: which labels fall in it, and their column in the block (clamped when outside)."""
    in_block = (labels >= v0) & (labels < v1)  # [T]
    column = (labels - v0).clamp_(0, v1 - v0 - 1)  # [T]
    return in_block, column


def _forward_stats(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    inv_temperature: float,
    chunk_size: int,
    vocab_chunk_size: int,
    with_entropy: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One pass over the blocks with an online log-sum-exp; returns ``lse``, ``z_label`` and ``E_p[z]``, ``[T]``.

    Per token the pass keeps the running max ``m``, ``S = Σ exp(z − m)`` and ``R = Σ exp(z − m)(z − m)``. When
    a block raises the max from ``m`` to ``m'``: ``S ← S e^{m−m'} + S_blk`` and
    ``R ← e^{m−m'} (R + (m − m') S) + R_blk``. At the end ``lse = m + log S`` and ``E_p[z] = m + R / S``.
    """
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    acc = accumulate_dtype(hidden.dtype)
    running_max = torch.zeros(n_tokens, dtype=acc, device=hidden.device)
    sum_exp = torch.zeros(n_tokens, dtype=acc, device=hidden.device)
    sum_exp_shifted = torch.zeros(n_tokens, dtype=acc, device=hidden.device) if with_entropy else None
    label_logit = torch.zeros(n_tokens, dtype=acc, device=hidden.device)

    for v0 in range(0, vocab, vocab_chunk_size):
        v1 = min(v0 + vocab_chunk_size, vocab)
        weight_v = weight[v0:v1]
        bias_v = None if bias is None else bias[v0:v1]
        in_block, column = _label_columns(labels, v0, v1)
        for n0 in range(0, n_tokens, chunk_size):
            n1 = min(n0 + chunk_size, n_tokens)
            z = _block_logits(hidden[n0:n1], weight_v, bias_v, inv_temperature)  # [n, v]
            picked = z.gather(1, column[n0:n1].unsqueeze(1)).squeeze(1)  # [n]
            label_logit[n0:n1] = torch.where(in_block[n0:n1], picked, label_logit[n0:n1])

            block_max = z.amax(dim=1)  # [n]
            if v0 == 0:
                new_max, scale, shift = block_max, None, None
            else:
                old_max = running_max[n0:n1]
                new_max = torch.maximum(old_max, block_max)
                shift = old_max - new_max  # [n], <= 0
                scale = shift.exp()
            shifted = z.sub_(new_max.unsqueeze(1))  # [n, v], <= 0, in place
            exp_shifted = shifted.exp()  # [n, v]
            block_sum = exp_shifted.sum(dim=1)
            if sum_exp_shifted is not None:
                block_weighted = exp_shifted.mul_(shifted).sum(dim=1)
                if scale is None:
                    sum_exp_shifted[n0:n1] = block_weighted
                else:
                    old = sum_exp_shifted[n0:n1]
                    sum_exp_shifted[n0:n1] = scale * (old + shift * sum_exp[n0:n1]) + block_weighted
            if scale is None:
                sum_exp[n0:n1] = block_sum
            else:
                sum_exp[n0:n1] = sum_exp[n0:n1] * scale + block_sum
            running_max[n0:n1] = new_max
            del z, shifted, exp_shifted

    lse = running_max + sum_exp.log()
    mean_z = None if sum_exp_shifted is None else running_max + sum_exp_shifted / sum_exp
    return lse, label_logit, mean_z


class _FusedTokenLogprobs(torch.autograd.Function):
    """Autograd wrapper: forward keeps ``[T]`` statistics, backward recomputes the logits block by block."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        temperature: float,
        chunk_size: int,
        vocab_chunk_size: int,
        return_entropy: bool,
        ignore_index: int,
    ):
        inv_temperature = 1.0 / temperature
        lse, label_logit, mean_z = _forward_stats(
            hidden, weight, bias, labels, inv_temperature, chunk_size, vocab_chunk_size, return_entropy
        )
        ctx.save_for_backward(hidden, weight, bias, labels, lse, mean_z)
        ctx.ignore_index = ignore_index
        ctx.inv_temperature = inv_temperature
        ctx.chunk_size = chunk_size
        ctx.vocab_chunk_size = vocab_chunk_size
        ctx.return_entropy = return_entropy
        ctx.set_materialize_grads(False)
        valid = labels != ignore_index  # [T]
        logprobs = torch.where(valid, label_logit - lse, 0.0)  # [T]
        if return_entropy:
            return logprobs, torch.where(valid, lse - mean_z, 0.0)  # [T], [T]
        return logprobs

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None = None):
        hidden, weight, bias, labels, lse, mean_z = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        if grad_logprobs is None and grad_entropy is None:
            return (None,) * 9
        acc = lse.dtype
        valid = labels != ctx.ignore_index  # [T]; ignored rows get no gradient
        g_lp = None if grad_logprobs is None else torch.where(valid, grad_logprobs.to(acc), 0.0)  # [T]
        g_ent = None if grad_entropy is None else torch.where(valid, grad_entropy.to(acc), 0.0)  # [T]
        inv_temperature = ctx.inv_temperature
        chunk_size, vocab_chunk_size = ctx.chunk_size, ctx.vocab_chunk_size
        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        same_dtype = hidden.dtype == acc

        grad_hidden_acc = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias_acc = torch.zeros(vocab, dtype=acc, device=hidden.device) if need_bias else None

        for v0 in range(0, vocab, vocab_chunk_size):
            v1 = min(v0 + vocab_chunk_size, vocab)
            weight_v = weight[v0:v1]
            bias_v = None if bias is None else bias[v0:v1]
            in_block, column = _label_columns(labels, v0, v1)
            # float32 accumulator for this block's weight rows, written back once in the weight's dtype
            grad_weight_v = None
            if grad_weight is not None:
                grad_weight_v = grad_weight[v0:v1] if same_dtype else torch.zeros_like(weight_v, dtype=acc)
            for n0 in range(0, n_tokens, chunk_size):
                n1 = min(n0 + chunk_size, n_tokens)
                z = _block_logits(hidden[n0:n1], weight_v, bias_v, inv_temperature)  # [n, v]
                lse_c = lse[n0:n1].unsqueeze(1)  # [n, 1]
                if g_ent is not None:
                    prob = (z - lse_c).exp_()  # [n, v]
                    # e·(E_p[z] − z) − g, then times p: the entropy and the log-prob parts together
                    coef = z.neg_().add_(mean_z[n0:n1].unsqueeze(1)).mul_(g_ent[n0:n1].unsqueeze(1))
                    if g_lp is not None:
                        coef.sub_(g_lp[n0:n1].unsqueeze(1))
                    grad_z = prob.mul_(coef)  # [n, v]
                    del coef
                else:
                    grad_z = z.sub_(lse_c).exp_().mul_(-g_lp[n0:n1].unsqueeze(1))  # −g·p, [n, v]
                if g_lp is not None:
                    # the indicator 1[j = y_i] of ∂logp/∂z, only for labels inside this block
                    hit = torch.where(in_block[n0:n1], g_lp[n0:n1], 0.0)  # [n]
                    grad_z.scatter_add_(1, column[n0:n1].unsqueeze(1), hit.unsqueeze(1))
                if inv_temperature != 1.0:
                    grad_z.mul_(inv_temperature)
                if grad_bias_acc is not None:
                    grad_bias_acc[v0:v1] += grad_z.sum(dim=0)
                grad_z_in = grad_z.to(hidden.dtype)  # matmuls in the input dtype
                del grad_z
                if grad_hidden_acc is not None:
                    if same_dtype:
                        grad_hidden_acc[n0:n1].addmm_(grad_z_in, weight_v)
                    else:
                        grad_hidden_acc[n0:n1] += grad_z_in @ weight_v  # [n, H]
                if grad_weight_v is not None:
                    if same_dtype:
                        grad_weight_v.addmm_(grad_z_in.T, hidden[n0:n1])
                    else:
                        grad_weight_v += grad_z_in.T @ hidden[n0:n1]  # [v, H]
                del grad_z_in, z
            if grad_weight_v is not None and not same_dtype:
                grad_weight[v0:v1] = grad_weight_v

        grad_hidden = None if grad_hidden_acc is None else grad_hidden_acc.to(hidden.dtype)
        grad_bias = None if grad_bias_acc is None else grad_bias_acc.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def fused_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK_SIZE,
    return_entropy: bool = False,
    bias: Tensor | None = None,
    ignore_index: int = -100,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probability of each label (and the entropy) under ``softmax((hidden @ weight.T + bias) / temperature)``.

    Equals ``token_logprobs(hidden @ weight.T + bias, labels, temperature=...)`` without ever building the
    ``[T, V]`` logits: the vocabulary and the tokens are walked in ``[chunk_size, vocab_chunk_size]`` blocks
    with an online log-sum-exp, and the backward recomputes each block. Peak extra memory is a few float32
    blocks plus the gradients themselves (and a float32 ``[T, H]`` accumulator for bf16/fp16 inputs).

        logp_i = z_{i, y_i} − log Σ_j exp(z_ij),     z = (hidden @ weight.T + bias) / temperature
        ℋ_i    = log Σ_j exp(z_ij) − Σ_j p_ij z_ij     (entropy of the tempered distribution, in nats)

    Args:
        hidden: final hidden states, one row per scored token. Shape: ``(T, H)``; float16, bfloat16, float32
            or float64 (float64 is for gradcheck).
        weight: the lm head (the output embedding, tied or not). Shape: ``(V, H)``; dtype of ``hidden``.
        labels: the token whose log-prob is wanted at each row. Shape: ``(T,)``; integer, each in ``[0, V)``.
        temperature: the sampling temperature the tokens were drawn at (default 1.0); logits are divided by it.
        chunk_size: tokens per block (default 1024).
        vocab_chunk_size: vocabulary entries per block (default 4096). A float32 block holds
            ``chunk_size × vocab_chunk_size`` values; larger blocks mean fewer, bigger matmuls (what a GPU
            wants) and more memory.
        return_entropy: also return the entropy ``H`` (its gradient is exact, ``∂ℋ/∂z_j = p_j (E_p[z] − z_j)``).
        bias: optional lm-head bias. Shape: ``(V,)``; dtype of ``weight``.
        ignore_index: label of rows to skip (padding), as in ``token_logprobs``: their log-prob and entropy
            are 0 with zero gradient (default −100). Cheaper still is not to pass such rows at all.

    Returns:
        ``logprobs`` of shape ``(T,)``, or ``(logprobs, entropy)`` when ``return_entropy``; float32 (float64 for
        float64 inputs). Differentiable with respect to ``hidden``, ``weight`` and ``bias``, not twice.

    Raises:
        ValueError: naming the argument, for wrong shapes, dtypes, devices, a non-positive temperature or
            chunk size, or a label outside ``[0, V)`` that is not ``ignore_index``.
    """
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    hidden, weight, labels, bias, temperature = validate_head_inputs(hidden, weight, labels, bias, temperature, ignore_index)
    chunk_size = check_chunk("chunk_size", chunk_size)
    vocab_chunk_size = check_chunk("vocab_chunk_size", vocab_chunk_size)
    return _FusedTokenLogprobs.apply(
        hidden, weight, bias, labels, temperature, chunk_size, vocab_chunk_size, bool(return_entropy), ignore_index
    )

