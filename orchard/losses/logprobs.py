"""Log-probabilities of label tokens from logits, computed in chunks of tokens.

``log p(y) = z_y − logsumexp(z)`` with ``z = logits / temperature``, and optionally the entropy
``H = logsumexp(z) − Σ_v p_v z_v``. A float32 copy of ``[T, V]`` logits for a 150k vocabulary is 0.6 MB per
token; a plain ``log_softmax(logits.float())`` materialises it (and autograd keeps it for backward). Here the
forward pass upcasts ``chunk_size`` tokens at a time and keeps only the per-token results; the backward pass
recomputes each chunk's softmax and writes the gradient straight into a tensor of the logits' dtype:

    ``∂ log p(y)/∂z_v = 1[v = y] − p_v``,  ``∂H/∂z_v = −p_v (z_v − Σ_u p_u z_u)``,  ``∂z/∂logits = 1/τ``.

Peak extra memory is one float32 ``[chunk_size, V]`` buffer (two with the entropy) instead of ``[T, V]``
copies: with the default 1024-token chunks and a 151,936-token vocabulary, 0.6 GB (1.2 GB).
This is the exact reference path; ``orchard.losses.fused`` fuses it with the lm-head matmul.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from orchard.losses._validation import check_positive_number, check_tensor


def _tempered(logits_chunk: Tensor, temperature: float) -> Tensor:
    """A fresh float32-or-wider ``[n, V]`` buffer holding ``logits / τ`` (safe to modify in place)."""
    z = logits_chunk.to(torch.promote_types(logits_chunk.dtype, torch.float32), copy=True)
    return z.div_(temperature) if temperature != 1.0 else z


def _shift_exp_(z: Tensor, *, keep_shifted: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax pieces of a tempered chunk ``z`` ``[n, V]``, reusing its buffer.

    Returns ``(e, m, s)``: ``e = exp(z − m)`` (in ``z``'s own buffer unless ``keep_shifted``, in which case ``z``
    is left holding ``z − m`` and ``e`` is a second buffer), the row max ``m`` ``[n, 1]`` and ``s = Σ_v e``
    ``[n, 1]``; so ``p = e / s`` and ``logsumexp(z) = m + log s``.
    """
    m = z.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # an all −inf row stays −inf, not NaN
    z.sub_(m)
    e = z.exp() if keep_shifted else z.exp_()
    return e, m, e.sum(dim=-1, keepdim=True)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """Label log-probs (and entropy) of ``[T, V]`` logits, ``chunk_size`` rows at a time.

    Working set per chunk: one float32 ``[n, V]`` buffer, two when the entropy is requested (its gradient needs
    ``p`` and ``z`` together). Nothing of size ``[T, V]`` but the gradient itself is allocated.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
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
        safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
        for start in range(0, n, chunk_size):
            sl = slice(start, start + chunk_size)
            z = _tempered(logits[sl], temperature)  # [n, V]
            label_z = z.gather(-1, safe_labels[sl, None])  # [n, 1]
            e, m, s = _shift_exp_(z, keep_shifted=want_entropy)
            lse = m + s.log()  # [n, 1]
            logp[sl] = torch.where(valid[sl], (label_z - lse).squeeze(-1), 0.0)
            if want_entropy:
                # H = log s − Σ_v e (z − m) / s, with z now holding z − m
                chunk_entropy = (s.log() - e.mul_(z).sum(dim=-1, keepdim=True) / s).squeeze(-1)
                entropy[sl] = torch.where(valid[sl], chunk_entropy, 0.0)
            del z, e
        ctx.save_for_backward(logits, safe_labels, valid)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.want_entropy = want_entropy
        if not want_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_logp: Tensor, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        logits, safe_labels, valid = ctx.saved_tensors
        with_entropy = ctx.want_entropy and grad_entropy is not None
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_size):
            sl = slice(start, start + ctx.chunk_size)
            z = _tempered(logits[sl], ctx.temperature)  # [n, V]
            g = torch.where(valid[sl], grad_logp[sl], 0.0).to(z.dtype)[:, None]  # [n, 1]
            p, _, s = _shift_exp_(z, keep_shifted=with_entropy)
            p.div_(s)  # softmax
            if grad_entropy is not None and with_entropy:
                ge = torch.where(valid[sl], grad_entropy[sl], 0.0).to(z.dtype)[:, None]  # [n, 1]
                mean_z = (p[:, None, :] @ z[:, :, None]).squeeze(-1)  # [n, 1]: Σ p (z − m)
                z.sub_(mean_z).mul_(p).mul_(ge)  # ge · p (z − E_p z)
                p.mul_(-g).sub_(z)  # −g p − ge p (z − E_p z)
            else:
                p.mul_(-g)
            p.scatter_add_(-1, safe_labels[sl, None], g)  # + g at the label
            if ctx.temperature != 1.0:
                p.div_(ctx.temperature)
            # Rows with an ignored label get exactly 0, even if their logits hold NaN.
            p.masked_fill_(~valid[sl, None], 0.0)
            grad_logits[sl].copy_(p)
            del z, p
        return grad_logits, None, None, None, None, None


def token_logprobs(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    ignore_index: int = -100,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact ``log softmax(logits / temperature)[label]`` per token, in chunks of ``chunk_size`` tokens.

    Args:
        logits: Shape: ``[..., V]`` (e.g. ``[B, T, V]``); any floating dtype (bf16 is upcast chunk by chunk).
            Labels must already be aligned with the logits (shift by one for next-token prediction).
        labels: token ids in ``[0, V)``, or ``ignore_index``. Integer; shape ``[...]`` (``logits`` without V).
        temperature: ``τ > 0``; the sampling temperature, so the log-probs match the engine's; default 1.0.
        chunk_size: tokens upcast at a time; default 1024. It bounds the float32 working set, not the result.
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
    flat_logits = logits.reshape(-1, vocab)  # [T, V]
    flat_labels = labels.reshape(-1).long()  # [T]
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
