"""Per-step token sampling of `HFEngine` (and the model server's scoring of its samples): the distribution a row
samples from, and one inverse-CDF draw per row from a uniform of the row's own stream."""

from __future__ import annotations

import torch

__all__ = ["inverse_cdf_sample", "nucleus_logprobs"]

_BLOCK = 128
"""Tokens per block of `inverse_cdf_sample`'s two-level search."""


def nucleus_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Log-probs of the distribution a row samples from: tempered softmax restricted to its top-p nucleus.

    Args:
        logits: ``[B, V]`` raw next-token logits.
        temperature: ``[B]`` temperatures; a row with 0 is greedy and gets the untempered ``log_softmax(logits)``.
        top_p: ``[B]`` nucleus masses in (0, 1]. The nucleus is the smallest set of most likely tokens whose
            tempered probability reaches ``top_p`` (always at least the top token); outside it the result is -inf.

    Returns:
        ``[B, V]`` float32 log-probs, ``log softmax(logits / T)`` renormalised over the nucleus.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    if temperature.shape != (batch,) or top_p.shape != (batch,):
        raise ValueError(
            f"temperature and top_p must be [B]={batch}, got {tuple(temperature.shape)} and {tuple(top_p.shape)}"
        )
    temp_B = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    logp_BV = torch.log_softmax(logits.float() / temp_B[:, None], dim=-1)  # [B, V]
    if bool((top_p < 1).any()):
        sorted_BV, order_BV = logp_BV.sort(dim=-1, descending=True)
        mass_before_BV = sorted_BV.exp().cumsum(dim=-1) - sorted_BV.exp()  # probability mass strictly above
        drop_sorted_BV = mass_before_BV >= top_p.float()[:, None]
        drop_sorted_BV[:, 0] = False
        # a row with top_p = 1 keeps every token: its float32 cumulative sum may reach 1.0 before its tail does
        drop_sorted_BV &= (top_p < 1)[:, None]
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
        logp_BV = torch.log_softmax(logp_BV.masked_fill(drop_BV, float("-inf")), dim=-1)
    return logp_BV


def inverse_cdf_sample(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: per row, the first token whose cumulative weight exceeds ``u`` times the row's total
    weight (so a row's token depends on its own uniform only, never on its batch mates).

    Two levels, so that no ``[B, V]`` cumulative sum is taken: the row's block of ``128`` tokens is found on the
    cumulative sums of the block weights, then the token within that block. The cumulative sums within a block
    are in float64, so that a token's slice of ``[0, 1)`` keeps its width however far down the vocabulary it lies
    (the block sums are float32: a block boundary moves by ~1e-7 of its block's weight). A token of weight 0
    (outside a top-p nucleus) is never drawn.

    Args:
        weights: ``[B, V]`` unnormalised probabilities (e.g. ``exp(logits - max)``), each row with a positive one.
        u: ``[B]`` uniforms in ``[0, 1)``.

    Returns:
        ``[B]`` long token ids.
    """
    if weights.dim() != 2:
        raise ValueError(f"weights must be [B, V], got shape {tuple(weights.shape)}")
    batch, vocab = weights.shape
    if u.shape != (batch,):
        raise ValueError(f"u must be [B]={batch}, got shape {tuple(u.shape)}")
    blocks = -(-vocab // _BLOCK)
    w_BV = weights.float()
    if vocab % _BLOCK:
        w_BV = torch.nn.functional.pad(w_BV, (0, blocks * _BLOCK - vocab))
    w_BNK = w_BV.reshape(batch, blocks, _BLOCK)
    cdf_BN = w_BNK.sum(dim=-1).double().cumsum(dim=-1)  # [B, blocks]
    target_B1 = u.double()[:, None] * cdf_BN[:, -1:]
    block_B1 = torch.searchsorted(cdf_BN, target_B1, right=True).clamp_(max=blocks - 1)
    # weight before the block, read off the same cumulative sums, so the target within it is >= 0
    before_B1 = torch.where(block_B1 > 0, cdf_BN.gather(1, (block_B1 - 1).clamp(min=0)), 0.0)
    w_BK = w_BNK.gather(1, block_B1[:, :, None].expand(batch, 1, _BLOCK))[:, 0]  # [B, K]
    cdf_BK = w_BK.double().cumsum(dim=-1)
    within_B = torch.searchsorted(cdf_BK, target_B1 - before_B1, right=True)[:, 0]
    # rounding may put the target past the block's own sum: then its last token of nonzero weight
    last_B = (cdf_BK >= cdf_BK[:, -1:]).int().argmax(dim=-1)
    return block_B1[:, 0] * _BLOCK + torch.minimum(within_B, last_B)
