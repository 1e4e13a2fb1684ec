"""Log-probs (and entropy) of chosen tokens straight from hidden states, never materialising the logits.

An RL or SFT loss needs ``log p(y_i)`` of one token per position, sometimes the entropy too, but the plain path
first builds the ``[T, V]`` logits: 65,536 tokens × 151,936 vocabulary entries is 20 GB in bf16 and twice that
as float32, and autograd keeps as much again for the backward. Here the lm head, the log-sum-exp and the gather
run block by block over (vocabulary, tokens); only one ``[chunk_size, vocab_chunk_size]`` block of logits is
alive at a time, and the backward recomputes each block instead of storing it.

Two entry points, one module each (this module re-exports both):

- ``fused_token_logprobs`` (``fused_logprobs.py``) returns the log-probs (and entropy) ``[T]``, for any loss.
  Its forward cannot know the upstream gradient, so the backward recomputes the logits: four ``T × H × V``
  matmuls against the plain path's three, and 4/3 of its time on a machine whose time is the matmuls.
- ``fused_token_loss`` (``fused_loss.py``) takes the per-token loss as a function and, one token chunk × the
  whole vocabulary at a time, computes the loss and its gradients in the forward: three matmuls (logits,
  ``G W``, ``Gᵀ h``), the backward only scales the stored gradients by the upstream scalar. For losses that are
  sums of per-token terms with constant side inputs (SFT, token-level policy losses, KL or distillation against
  given log-probs).

Notation, per token ``i`` and vocabulary entry ``j``:

    z_ij   = (h_i · W_j + b_j) / temperature                  tempered logits   [T, V] (never stored)
    lse_i  = log Σ_j exp(z_ij)                                 running max and sum, float32
    logp_i = z_{i, y_i} − lse_i                                log-prob of the label
    ℋ_i    = lse_i − Σ_j p_ij z_ij,    p_ij = exp(z_ij − lse_i)   entropy

Gradients, with ``g`` the upstream gradient of ``logp`` and ``e`` that of ``ℋ``:

    ∂logp_i/∂z_ij = 1[j = y_i] − p_ij
    ∂ℋ_i/∂z_ij    = p_ij (E_p[z_i] − z_ij)
    ∂/∂h_i = Σ_j G_ij W_j / temperature,   ∂/∂W_j = Σ_i G_ij h_i / temperature,   ∂/∂b_j = Σ_i G_ij / temperature

where ``G_ij = g_i ∂logp_i/∂z_ij + e_i ∂ℋ_i/∂z_ij``. ``fused_token_logprobs``'s forward keeps only ``lse`` and
``E_p[z]`` per token (``[T]`` each); its backward rebuilds ``z`` block by block from ``hidden`` and ``weight``.
``fused_token_loss`` gets ``g`` and ``e`` of a chunk in its forward, from autograd through the caller's
per-token loss on that chunk's ``logp`` and ``ℋ``, and applies ``G`` while the chunk's logits are alive.

Precision: the matmuls run in the input dtype (bf16 on a GPU uses its tensor cores); every reduction (max, sum
of exponentials, the weighted sums, the gradient accumulators) runs in float32 (float64 for float64 inputs).
Outputs are float32 (float64 for float64 inputs); gradients come back in the dtype of the tensor they belong to.
"""

from orchard.losses._fused_common import DEFAULT_VOCAB_CHUNK_SIZE
from orchard.losses.fused_logprobs import DEFAULT_CHUNK_SIZE, fused_token_logprobs
from orchard.losses.fused_loss import (
    DEFAULT_LOSS_CHUNK_SIZE,
    DEFAULT_LOSS_CHUNK_SIZE_CUDA,
    TokenLoss,
    fused_token_loss,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_LOSS_CHUNK_SIZE",
    "DEFAULT_LOSS_CHUNK_SIZE_CUDA",
    "DEFAULT_VOCAB_CHUNK_SIZE",
    "TokenLoss",
    "fused_token_logprobs",
    "fused_token_loss",
]
