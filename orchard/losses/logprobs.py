"""Log-probabilities of label tokens from logits, computed in chunks of tokens.

``log p(y) = z_y − logsumexp(z)`` with ``z = logits / temperature``, and optionally the entropy
``H = logsumexp(z) − Σ_v p_v z_v``. A float32 copy of ``[N, V]`` logits for a 150k vocabulary is 0.6 MB per
token; a plain ``log_softmax(logits.float())`` materialises it (and autograd keeps it for backward). Here the
forward pass upcasts ``chunk_size`` tokens at a time and keeps only the per-token results; the backward pass
recomputes each chunk's softmax and writes the gradient straight into a tensor of the logits' dtype:

    ``∂ log p(y)/∂z_v = 1[v = y] − p_v``,  ``∂H/∂z_v = −p_v (z_v − Σ_u p_u z_u)``,  ``∂z/∂logits = 1/τ``.

Peak extra memory is one float32 ``[chunk_size, V]`` block (a few of them, transiently) instead of ``[N, V]``.
This is the exact reference path; ``orchard.losses.fused`` fuses it with the lm-head matmul.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from orchard.losses._validation import check_positive_number, check_tensor


def _chunk_stats(
    logits_chunk: Tensor, labels_chunk: Tensor, valid_chunk: Tensor, temperature: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Upcast one ``[n, V]`` chunk; return ``(z, log p(labels), log-normaliser)``, all float32 or wider."""
    z = logits_chunk.to(torch.promote_types(logits_chunk.dtype, torch.float32)) / temperature  # [n, V]
    lse = torch.logsumexp(z, dim=-1)  # [n]
    safe_labels = torch.where(valid_chunk, labels_chunk, torch.zeros_like(labels_chunk))
    label_z = z.gather(-1, safe_labels[:, None]).squeeze(-1)  # [n]
    return z, label_z - lse, lse


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        logits: Tensor,
        labels: Tensor,
        valid: Tensor,
        temperature: float,
        chunk_size: int,
        want_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        n = logits.shape[0]
        out_dtype = torch.promote_types(logits.dtype, torch.float32)
        logp = torch.zeros(n, dtype=out_dtype, device=logits.device)
        entropy = torch.zeros(n if want_entropy else 0, dtype=out_dtype, device=logits.device)
        for start in range(0, n, chunk_size):
            sl = slice(start, start + chunk_size)
            z, chunk_logp, lse = _chunk_stats(logits[sl], labels[sl], valid[sl], temperature)
            logp[sl] = torch.where(valid[sl], chunk_logp, torch.zeros_like(chunk_logp))
            if want_entropy:
                probs = (z - lse[:, None]).exp()  # [n, V]
                chunk_entropy = lse - (probs * z).sum(-1)
                entropy[sl] = torch.where(valid[sl], chunk_entropy, torch.zeros_like(chunk_entropy))
        ctx.save_for_backward(logits, labels, valid)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.want_entropy = want_entropy
        if not want_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: FunctionCtx, grad_logp: Tensor, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        logits, labels, valid = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_size):
            sl = slice(start, start + ctx.chunk_size)
            z, _, lse = _chunk_stats(logits[sl], labels[sl], valid[sl], ctx.temperature)
            probs = (z - lse[:, None]).exp()  # [n, V]
            g = grad_logp[sl].to(z.dtype)
            grad_z = probs * (-g)[:, None]  # [n, V]: −p_v · g
            safe_labels = torch.where(valid[sl], labels[sl], torch.zeros_like(labels[sl]))
            grad_z.scatter_add_(
                -1, safe_labels[:, None], torch.where(valid[sl], g, torch.zeros_like(g))[:, None]
            )
            if ctx.want_entropy and grad_entropy is not None:
                mean_z = (probs * z).sum(-1, keepdim=True)  # [n, 1]
                grad_z -= probs * (z - mean_z) * grad_entropy[sl].to(z.dtype)[:, None]
            # Rows with an ignored label get exactly 0, even if their logits hold NaN.
            grad_z = torch.where(valid[sl][:, None], grad_z / ctx.temperature, torch.zeros((), dtype=z.dtype))
            grad_logits[sl] = grad_z.to(logits.dtype)
        return grad_logits, None, None, None, None, None


def token_logprobs(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 4096,
    return_entropy: bool = False,
    ignore_index: int = -100,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact ``log softmax(logits / temperature)[label]`` per token, in chunks of ``chunk_size`` tokens.

    Args:
        logits: Shape: ``[..., V]`` (e.g. ``[B, T, V]``); any floating dtype (bf16 is upcast chunk by chunk).
            Labels must already be aligned with the logits (shift by one for next-token prediction).
        labels: token ids in ``[0, V)``, or ``ignore_index``. Integer; shape ``[...]`` (``logits`` without V).
        temperature: ``τ > 0``; the sampling temperature, so the log-probs match the engine's; default 1.0.
        chunk_size: tokens upcast at a time; default 4096. It bounds the float32 working set, not the result.
        return_entropy: also return the entropy of ``softmax(logits / τ)`` at each position.
        ignore_index: label of positions to skip (padding); their log-prob (and entropy) is 0 with zero
            gradient; default −100.

    Returns:
        ``logprobs`` of shape ``[...]`` in float32 (float64 for float64 logits), or ``(logprobs, entropy)``.
        Differentiable once with respect to ``logits``.
    """
    logits = check_tensor("logits", logits)
    labels = check_tensor("labels", labels)
    if not logits.is_floating_point() or logits.dim() < 1:
        raise ValueError(
            f"logits must be a floating tensor of shape [..., V], got shape {tuple(logits.shape)} "
            f"dtype {logits.dtype}"
        )
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels must have shape {tuple(logits.shape[:-1])} (logits without the vocabulary dim), "
            f"got shape {tuple(labels.shape)}"
        )
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got dtype {labels.dtype}")
    check_positive_number("temperature", temperature)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    vocab = logits.shape[-1]
    if vocab == 0:
        raise ValueError(f"logits must have a non-empty vocabulary dim, got shape {tuple(logits.shape)}")
    flat_logits = logits.reshape(-1, vocab)  # [N, V]
    flat_labels = labels.reshape(-1).long()  # [N]
    valid = flat_labels != ignore_index
    # One device sync: an out-of-range label would be an opaque device-side assert in gather.
    if bool(((flat_labels < 0) | (flat_labels >= vocab))[valid].any()):
        raise ValueError(f"labels must lie in [0, {vocab}) or equal ignore_index={ignore_index}")
    logp, entropy = _ChunkedTokenLogprobs.apply(
        flat_logits, flat_labels, valid, float(temperature), chunk_size, return_entropy
    )
    logp = logp.reshape(labels.shape)
    if not return_entropy:
        return logp
    return logp, entropy.reshape(labels.shape)
