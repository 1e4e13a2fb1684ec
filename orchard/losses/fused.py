"""Log-probs (and entropy) of chosen tokens straight from hidden states, never materialising the logits.

An RL or SFT loss needs ``log p(y_i)`` of one token per position, sometimes the entropy too, but the plain path
first builds the ``[N, V]`` logits: 65,536 tokens × 151,936 vocabulary entries is 20 GB in bf16 and twice that
as float32, and autograd keeps as much again for the backward. Here the lm head, the log-sum-exp and the gather
run block by block over (vocabulary, tokens); only one ``[chunk_size, vocab_chunk_size]`` block of logits is
alive at a time, and the backward recomputes each block instead of storing it.

Two entry points:

- ``fused_token_logprobs`` returns the log-probs (and entropy) ``[N]``, for any loss. Its forward cannot know
  the upstream gradient, so the backward recomputes the logits: four ``N × H × V`` matmuls against the plain
  path's three, and 4/3 of its time on a machine whose time is the matmuls.
- ``fused_token_loss`` takes the per-token loss as a function and, one token chunk × the whole vocabulary at a
  time, computes the loss and its gradients in the forward: three matmuls (logits, ``G W``, ``Gᵀ h``), the
  backward only scales the stored gradients by the upstream scalar. For losses that are sums of per-token
  terms with constant side inputs (SFT, token-level policy losses, KL or distillation against given log-probs).

Notation, per token ``i`` and vocabulary entry ``j``:

    z_ij   = (h_i · W_j + b_j) / temperature                  tempered logits   [N, V] (never stored)
    lse_i  = log Σ_j exp(z_ij)                                 running max and sum, float32
    logp_i = z_{i, y_i} − lse_i                                log-prob of the label
    H_i    = lse_i − Σ_j p_ij z_ij,    p_ij = exp(z_ij − lse_i)   entropy

Gradients, with ``g`` the upstream gradient of ``logp`` and ``e`` that of ``H``:

    ∂logp_i/∂z_ij = 1[j = y_i] − p_ij
    ∂H_i/∂z_ij    = p_ij (E_p[z_i] − z_ij)
    ∂/∂h_i = Σ_j G_ij W_j / temperature,   ∂/∂W_j = Σ_i G_ij h_i / temperature,   ∂/∂b_j = Σ_i G_ij / temperature

where ``G_ij = g_i ∂logp_i/∂z_ij + e_i ∂H_i/∂z_ij``. ``fused_token_logprobs``'s forward keeps only ``lse`` and
``E_p[z]`` per token (``[N]`` each); its backward rebuilds ``z`` block by block from ``hidden`` and ``weight``.
``fused_token_loss`` gets ``g`` and ``e`` of a chunk in its forward, from autograd through the caller's
per-token loss on that chunk's ``logp`` and ``H``, and applies ``G`` while the chunk's logits are alive.

Precision: the matmuls run in the input dtype (bf16 on a GPU uses its tensor cores); every reduction (max, sum
of exponentials, the weighted sums, the gradient accumulators) runs in float32 (float64 for float64 inputs).
Outputs are float32 (float64 for float64 inputs); gradients come back in the dtype of the tensor they belong to.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_LOSS_CHUNK_SIZE",
    "DEFAULT_LOSS_CHUNK_SIZE_CUDA",
    "DEFAULT_VOCAB_CHUNK_SIZE",
    "fused_token_logprobs",
    "fused_token_loss",
]

DEFAULT_CHUNK_SIZE = 1024
"""Tokens per block. With ``DEFAULT_VOCAB_CHUNK_SIZE`` a float32 block is 1024 × 4096 × 4 B = 16 MiB, small
beside the weight gradient (V × H) that every path must hold; a GPU wants larger blocks (fewer launches)."""

DEFAULT_VOCAB_CHUNK_SIZE = 4096
"""Vocabulary entries per block (151,936 / 4096 → 38 blocks for Qwen3's vocabulary)."""

_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _block_logits(hidden_c: Tensor, weight_v: Tensor, bias_v: Tensor | None, inv_temperature: float) -> Tensor:
    """Tempered logits of one block, ``[n, v]`` in the accumulation dtype (a fresh tensor, safe to modify)."""
    if bias_v is None:
        logits = hidden_c @ weight_v.T  # [n, v], input dtype
    else:
        logits = torch.addmm(bias_v, hidden_c, weight_v.T)  # [n, v], input dtype
    z = logits.to(_accumulate_dtype(logits.dtype))
    if inv_temperature != 1.0:
        z.mul_(inv_temperature)
    return z


def _label_columns(labels: Tensor, v0: int, v1: int) -> tuple[Tensor, Tensor]:
    """For block ``[v0, v1)``: which labels fall in it, and their column in the block (clamped when outside)."""
    in_block = (labels >= v0) & (labels < v1)  # [N]
    column = (labels - v0).clamp_(0, v1 - v0 - 1)  # [N]
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
    """One pass over the blocks with an online log-sum-exp; returns ``lse``, ``z_label`` and ``E_p[z]``, ``[N]``.

    Per token the pass keeps the running max ``m``, ``S = Σ exp(z − m)`` and ``R = Σ exp(z − m)(z − m)``. When
    a block raises the max from ``m`` to ``m'``: ``S ← S e^{m−m'} + S_blk`` and
    ``R ← e^{m−m'} (R + (m − m') S) + R_blk``. At the end ``lse = m + log S`` and ``E_p[z] = m + R / S``.
    """
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    acc = _accumulate_dtype(hidden.dtype)
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
    """Autograd wrapper: forward keeps ``[N]`` statistics, backward recomputes the logits block by block."""

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
        valid = labels != ignore_index  # [N]
        logprobs = torch.where(valid, label_logit - lse, 0.0)  # [N]
        if return_entropy:
            return logprobs, torch.where(valid, lse - mean_z, 0.0)  # [N], [N]
        return logprobs

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None = None):
        hidden, weight, bias, labels, lse, mean_z = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        if grad_logprobs is None and grad_entropy is None:
            return (None,) * 9
        acc = lse.dtype
        valid = labels != ctx.ignore_index  # [N]; ignored rows get no gradient
        g_lp = None if grad_logprobs is None else torch.where(valid, grad_logprobs.to(acc), 0.0)  # [N]
        g_ent = None if grad_entropy is None else torch.where(valid, grad_entropy.to(acc), 0.0)  # [N]
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


def _check_chunk(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _validate(
    hidden: object, weight: object, labels: object, bias: object, temperature: object, ignore_index: int | None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, float]:
    """Checks shared by both public functions; ``ignore_index=None`` means every label must be a real token."""
    for name, value in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(value, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    assert isinstance(hidden, Tensor) and isinstance(weight, Tensor) and isinstance(labels, Tensor)
    if hidden.dim() != 2:
        raise ValueError(f"hidden must have shape [N, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must have shape [V, H], got shape {tuple(weight.shape)}")
    if labels.dim() != 1:
        raise ValueError(f"labels must have shape [N], got shape {tuple(labels.shape)}")
    if hidden.dtype not in _INPUT_DTYPES:
        raise ValueError(f"hidden must be float16, bfloat16, float32 or float64, got dtype {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight must have the dtype of hidden ({hidden.dtype}), got dtype {weight.dtype}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got dtype {labels.dtype}")
    if weight.shape[0] < 1:
        raise ValueError(f"weight must have at least one vocabulary row, got shape {tuple(weight.shape)}")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight must have shape [V, H] with H = hidden.shape[1] = {hidden.shape[1]}, "
            f"got shape {tuple(weight.shape)}"
        )
    if labels.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"labels must have shape [N] with N = hidden.shape[0] = {hidden.shape[0]}, got shape {tuple(labels.shape)}"
        )
    for name, value in (("weight", weight), ("labels", labels)):
        if value.device != hidden.device:
            raise ValueError(f"{name} must be on the device of hidden ({hidden.device}), got {value.device}")
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise ValueError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.shape != weight.shape[:1]:
            raise ValueError(f"bias must have shape [V] = ({weight.shape[0]},), got shape {tuple(bias.shape)}")
        if bias.dtype != weight.dtype or bias.device != weight.device:
            raise ValueError(
                f"bias must match weight's dtype {weight.dtype} and device {weight.device}, "
                f"got {bias.dtype} on {bias.device}"
            )
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    # one device sync: an out-of-range label would otherwise gather a wrong column silently
    outside = (labels < 0) | (labels >= weight.shape[0])
    if ignore_index is not None:
        outside &= labels != ignore_index
    if labels.numel() and bool(outside.any()):
        bad = labels[outside][:5].tolist()
        allowed = "" if ignore_index is None else f" or equal ignore_index={ignore_index}"
        raise ValueError(f"labels must lie in [0, V) = [0, {weight.shape[0]}){allowed}, got values such as {bad}")
    return hidden, weight, labels.long(), bias, float(temperature)  # gather and scatter want int64 indices


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
    ``[N, V]`` logits: the vocabulary and the tokens are walked in ``[chunk_size, vocab_chunk_size]`` blocks
    with an online log-sum-exp, and the backward recomputes each block. Peak extra memory is a few float32
    blocks plus the gradients themselves (and a float32 ``[N, H]`` accumulator for bf16/fp16 inputs).

        logp_i = z_{i, y_i} − log Σ_j exp(z_ij),     z = (hidden @ weight.T + bias) / temperature
        H_i    = log Σ_j exp(z_ij) − Σ_j p_ij z_ij     (entropy of the tempered distribution, in nats)

    Args:
        hidden: final hidden states, one row per scored token. Shape: ``(N, H)``; float16, bfloat16, float32
            or float64 (float64 is for gradcheck).
        weight: the lm head (the output embedding, tied or not). Shape: ``(V, H)``; dtype of ``hidden``.
        labels: the token whose log-prob is wanted at each row. Shape: ``(N,)``; integer, each in ``[0, V)``.
        temperature: the sampling temperature the tokens were drawn at (default 1.0); logits are divided by it.
        chunk_size: tokens per block (default 1024).
        vocab_chunk_size: vocabulary entries per block (default 4096). A float32 block holds
            ``chunk_size × vocab_chunk_size`` values; larger blocks mean fewer, bigger matmuls (what a GPU
            wants) and more memory.
        return_entropy: also return the entropy ``H`` (its gradient is exact, ``∂H/∂z_j = p_j (E_p[z] − z_j)``).
        bias: optional lm-head bias. Shape: ``(V,)``; dtype of ``weight``.
        ignore_index: label of rows to skip (padding), as in ``token_logprobs``: their log-prob and entropy
            are 0 with zero gradient (default −100). Cheaper still is not to pass such rows at all.

    Returns:
        ``logprobs`` of shape ``(N,)``, or ``(logprobs, entropy)`` when ``return_entropy``; float32 (float64 for
        float64 inputs). Differentiable with respect to ``hidden``, ``weight`` and ``bias``, not twice.

    Raises:
        ValueError: naming the argument, for wrong shapes, dtypes, devices, a non-positive temperature or
            chunk size, or a label outside ``[0, V)`` that is not ``ignore_index``.
    """
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    hidden, weight, labels, bias, temperature = _validate(hidden, weight, labels, bias, temperature, ignore_index)
    chunk_size = _check_chunk("chunk_size", chunk_size)
    vocab_chunk_size = _check_chunk("vocab_chunk_size", vocab_chunk_size)
    return _FusedTokenLogprobs.apply(
        hidden, weight, bias, labels, temperature, chunk_size, vocab_chunk_size, bool(return_entropy), ignore_index
    )


# ------------------------------------------------------------------------------------------ one-pass loss

DEFAULT_LOSS_CHUNK_SIZE = 128
"""Tokens per block of ``fused_token_loss`` on a CPU. Each block spans the whole vocabulary: at V = 151,936 a
float32 block is 128 × 151,936 × 4 B = 74 MiB (two blocks with the entropy). Picked by a sweep at N = 1024 on a
2-core CPU (``docs/losses.md``): smaller chunks make the thin matmuls slower, larger ones cost memory."""

DEFAULT_LOSS_CHUNK_SIZE_CUDA = 2048
"""Tokens per block on a GPU, where each chunk re-reads the weight twice and reads and writes the ``[V, H]``
weight-gradient sum once: 2048 tokens keep that traffic well under the matmul time at H = 4096 (from that
arithmetic, not yet measured); the float32 block is 1.2 GiB at V = 151,936."""

TokenLoss = Callable[[Tensor, Tensor | None, Tensor], Tensor]


def _foreign_leaf(out: Tensor, own: tuple[Tensor, ...]) -> bool:
    """Whether ``out``'s graph reaches a tensor requiring grad other than ``own`` (a gradient we would drop)."""
    stack, seen = [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None and not any(variable is t for t in own):
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def _chunk_coefficients(
    token_loss: TokenLoss, logp: Tensor, entropy: Tensor | None, index: Tensor, check_graph: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Run ``token_loss`` on one chunk: its summed value and ``∂loss/∂logp``, ``∂loss/∂H`` per token, ``[n]``."""
    n = logp.shape[0]
    logp_leaf = logp.detach().requires_grad_()
    entropy_leaf = None if entropy is None else entropy.detach().requires_grad_()
    leaves = (logp_leaf,) if entropy_leaf is None else (logp_leaf, entropy_leaf)
    with torch.enable_grad():
        out = token_loss(logp_leaf, entropy_leaf, index)
        if not isinstance(out, Tensor) or out.shape != (n,) or not out.is_floating_point():
            got = f"shape {tuple(out.shape)}, dtype {out.dtype}" if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"token_loss must return a float tensor of shape [n] = ({n},) per chunk, got {got}")
        if not out.requires_grad:
            raise ValueError("token_loss must return per-token losses computed from logp (or entropy); its output "
                             "does not require grad (was logp detached?)")
        if check_graph and _foreign_leaf(out, leaves):
            raise ValueError("token_loss's output depends on a tensor that requires grad other than logp and "
                             "entropy; fused_token_loss treats side inputs as constants: detach them")
        grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
    coef_logp = torch.zeros_like(logp) if grads[0] is None else grads[0]
    coef_entropy = None
    if entropy_leaf is not None:
        coef_entropy = torch.zeros_like(logp) if grads[1] is None else grads[1]
    return out.detach().sum().to(logp.dtype), coef_logp, coef_entropy


def _one_pass(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    token_loss: TokenLoss,
    inv_temperature: float,
    chunk_size: int,
    need_entropy: bool,
    need: tuple[bool, bool, bool],
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Loss and its gradients to (hidden, weight, bias), one token chunk × the whole vocabulary at a time."""
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    acc = _accumulate_dtype(hidden.dtype)
    device = hidden.device
    need_hidden, need_weight, need_bias = need
    same_dtype = hidden.dtype == acc
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = torch.zeros_like(weight) if need_weight else None
    # sums over many chunks stay in float32 for half-precision weights (V × H × 4 B more), written back once
    several_chunks = n_tokens > chunk_size
    grad_weight_acc = grad_weight
    if grad_weight is not None and not same_dtype and several_chunks:
        grad_weight_acc = torch.zeros(weight.shape, dtype=acc, device=device)
    grad_bias_acc = torch.zeros(vocab, dtype=acc, device=device) if need_bias else None
    total = torch.zeros((), dtype=acc, device=device)
    any_grad = any(need)
    # z = (h W^T + b) / T = (h / T) W^T + b / T: the temperature scales [n, H] and [V], never a block, and
    # ∂/∂W = G^T (h / T) reuses the scaled rows
    tempered = inv_temperature != 1.0
    bias_t = None if bias is None else (bias * inv_temperature if tempered else bias)

    for n0 in range(0, n_tokens, chunk_size):
        n1 = min(n0 + chunk_size, n_tokens)
        labels_row = labels[n0:n1].unsqueeze(0)  # [1, n]
        hidden_t = hidden[n0:n1] * inv_temperature if tempered else hidden[n0:n1]  # [n, H]
        # the block is laid out [V, n] (vocabulary-major): W @ hᵀ splits W across threads instead of every
        # thread packing all of W for a thin [n, H] @ Wᵀ, measurably faster at small n on a CPU
        z = _vocab_major_logits(weight, hidden_t, bias_t)  # [V, n], float32, tempered
        label_z = z.gather(0, labels_row).squeeze(0)  # [n]
        col_max = z.amax(dim=0, keepdim=True)  # [1, n]
        shifted = z.sub_(col_max)  # u = z − max ≤ 0, [V, n], in place
        # e = exp(u): a second block when the entropy needs u as well, else in place
        exp_shifted = shifted.exp() if need_entropy else shifted.exp_()  # [V, n]
        sum_exp = exp_shifted.sum(dim=0)  # s, [n]
        log_sum = sum_exp.log()  # [n]; lse = max + log s
        logp = label_z - col_max.squeeze(0) - log_sum  # [n]
        entropy = mean_shifted = None
        if need_entropy:
            mean_shifted = _column_dot(exp_shifted, shifted) / sum_exp  # E_p[u], [n]
            entropy = log_sum - mean_shifted  # H = lse − E_p[z], [n]
        index = torch.arange(n0, n1, device=device)
        value, coef_logp, coef_entropy = _chunk_coefficients(token_loss, logp, entropy, index, n0 == 0)
        total += value
        if not any_grad:
            del z, shifted, exp_shifted  # the block must go before the next one is built
            continue
        # ∂loss/∂z = G = p ⊙ (c_H (E_p[u] − u) − c_logp) + c_logp · onehot, with p = e / s: per token
        # e ⊙ (a − b u), a = (c_H E_p[u] − c_logp) / s and b = c_H / s
        if need_entropy:
            col_b = coef_entropy / sum_exp  # [n]
            col_a = (coef_entropy * mean_shifted - coef_logp) / sum_exp  # [n]
            grad_z = shifted.mul_(col_b.neg()).add_(col_a).mul_(exp_shifted)  # [V, n]
        else:
            grad_z = exp_shifted.mul_(coef_logp.neg() / sum_exp)  # −c_logp · p, [V, n]
        del z, shifted, exp_shifted
        grad_z.scatter_add_(0, labels_row, coef_logp.unsqueeze(0))  # [V, n]
        if grad_bias_acc is not None:
            grad_bias_acc += grad_z.sum(dim=1)
        grad_z_in = grad_z if same_dtype else grad_z.to(hidden.dtype)  # matmuls in the input dtype
        del grad_z
        if grad_hidden is not None:
            grad_hidden_c = (weight.T @ grad_z_in).T  # [n, H], from [H, n]
            grad_hidden[n0:n1] = grad_hidden_c * inv_temperature if tempered else grad_hidden_c
        if grad_weight_acc is not None:
            _add_weight_grad(grad_weight_acc, grad_z_in, hidden_t)
        del grad_z_in

    if grad_weight is not None and grad_weight_acc is not grad_weight:
        grad_weight.copy_(grad_weight_acc)
    grad_bias = None
    if grad_bias_acc is not None:
        grad_bias = (grad_bias_acc * inv_temperature if tempered else grad_bias_acc).to(bias.dtype)
    return total, grad_hidden, grad_weight, grad_bias


def _vocab_major_logits(weight: Tensor, hidden_t: Tensor, bias_t: Tensor | None) -> Tensor:
    """``(W hᵀ + b)``, ``[V, n]`` in the accumulation dtype (a fresh tensor, safe to modify)."""
    if bias_t is None:
        logits = weight @ hidden_t.T  # [V, n], input dtype
    else:
        logits = torch.addmm(bias_t.unsqueeze(1), weight, hidden_t.T)  # [V, n], input dtype
    return logits.to(_accumulate_dtype(logits.dtype))


def _column_dot(a: Tensor, b: Tensor) -> Tensor:
    """``Σ_v a[v, i] b[v, i]``, ``[n]``, by row slices so the product's temporary stays small."""
    out = torch.zeros(a.shape[1], dtype=a.dtype, device=a.device)
    for v0 in range(0, a.shape[0], DEFAULT_VOCAB_CHUNK_SIZE):
        v1 = v0 + DEFAULT_VOCAB_CHUNK_SIZE
        out += (a[v0:v1] * b[v0:v1]).sum(dim=0)
    return out


def _add_weight_grad(grad_weight_acc: Tensor, grad_z: Tensor, hidden_t: Tensor) -> None:
    """``grad_weight_acc += grad_z hidden_t`` (``[V, n] @ [n, H]``); a float32 sum of half-precision products
    goes by row slices so the product's temporary stays ``[DEFAULT_VOCAB_CHUNK_SIZE, H]``."""
    if grad_weight_acc.dtype == grad_z.dtype:
        grad_weight_acc.addmm_(grad_z, hidden_t)  # [V, H]
        return
    for v0 in range(0, grad_weight_acc.shape[0], DEFAULT_VOCAB_CHUNK_SIZE):
        v1 = v0 + DEFAULT_VOCAB_CHUNK_SIZE
        grad_weight_acc[v0:v1] += grad_z[v0:v1] @ hidden_t  # [v, H], input dtype, summed in float32


class _FusedTokenLoss(torch.autograd.Function):
    """Forward computes the loss and its gradients; backward scales the stored gradients by the upstream scalar."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, token_loss, inv_temperature, chunk_size, need_entropy, need):
        total, grad_hidden, grad_weight, grad_bias = _one_pass(
            hidden, weight, bias, labels, token_loss, inv_temperature, chunk_size, need_entropy, need
        )
        # kept as attributes, not saved tensors: they are handed out (scaled in place) exactly once
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.set_materialize_grads(False)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError("fused_token_loss's backward can run only once: its gradients were handed out")
        ctx.grads = None
        if grad_total is None:
            return (None,) * 9
        scaled = tuple(None if g is None else g.mul_(grad_total.to(g.dtype)) for g in grads)
        return (*scaled, None, None, None, None, None, None)


def fused_token_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    token_loss: TokenLoss,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    bias: Tensor | None = None,
    need_entropy: bool = False,
) -> Tensor:
    """A per-token loss of the lm head's log-probs, with its gradients computed in the same pass (3 matmuls).

    ``fused_token_logprobs`` cannot know in its forward what will be done with the log-probs, so its backward
    rebuilds every logit block: four ``N × H × V`` matmuls against the plain path's three. When the loss is a
    sum of per-token terms, ``token_loss`` can be applied inside the forward; each token chunk then forms
    ``∂loss/∂z`` while its logits are alive, and the backward only scales the stored gradients:

        z = (hidden @ weight.T + bias) / temperature                   one [n, V] block at a time, float32
        logp_i = log softmax(z_i)[y_i],   H_i = entropy of softmax(z_i)
        loss = Σ_chunks Σ_i token_loss(logp, H, index)_i
        G_ij = c_i (1[j = y_i] − p_ij) + e_i p_ij (E_p[z_i] − z_ij),   c = ∂loss/∂logp,  e = ∂loss/∂H
        ∂/∂hidden = G W / T,   ∂/∂W = Gᵀ hidden / T,   ∂/∂b = Σ_i G_i / T

    ``token_loss(logp, entropy, index)`` receives one chunk: ``logp`` ``(n,)`` (float32; float64 for float64
    inputs; a leaf requiring grad), ``entropy`` ``(n,)`` or ``None`` (unless ``need_entropy``), and ``index``
    ``(n,)``, the chunk's rows of ``hidden`` (int64), for looking up per-token side inputs (advantages,
    old or reference or teacher log-probs, weights, masks). It returns the chunk's per-token losses ``(n,)``;
    their sum over all chunks is the loss, so a global normaliser is a constant divisor inside it. Side inputs
    are constants: no gradient reaches them, and a ``token_loss`` whose output requires grad through anything
    but ``logp`` and ``entropy`` is refused. It is called under ``torch.enable_grad()``, once per chunk, and may
    record detached values by ``index`` (for metrics).

    Args:
        hidden: final hidden states, one row per scored token. Shape: ``(N, H)``; float16, bfloat16, float32
            or float64.
        weight: the lm head. Shape: ``(V, H)``; dtype of ``hidden``.
        labels: the token scored at each row. Shape: ``(N,)``; integer, each in ``[0, V)`` (no ignore index:
            leave rows that do not count out, or give them zero loss in ``token_loss``).
        token_loss: the per-token loss, as above.
        temperature: the sampling temperature; logits are divided by it (default 1.0).
        chunk_size: tokens per block; a block is ``chunk_size × V`` float32 values (two with the entropy).
            Default ``None``: ``DEFAULT_LOSS_CHUNK_SIZE`` (128) on a CPU, ``DEFAULT_LOSS_CHUNK_SIZE_CUDA`` (2048)
            elsewhere.
        bias: optional lm-head bias. Shape: ``(V,)``; dtype of ``weight``.
        need_entropy: compute the entropy and pass it to ``token_loss`` (one more block of memory).

    Returns:
        The loss, a scalar tensor, float32 (float64 for float64 inputs). Differentiable with respect to
        ``hidden``, ``weight`` and ``bias``, once (the backward hands out the stored gradients), not twice.
        Gradients are computed in the forward only where ``torch.is_grad_enabled()`` and the tensor requires
        grad; they occupy memory from the forward to the backward. For half-precision inputs with more than
        one chunk the weight gradient is summed in a float32 ``(V, H)`` buffer. ``N = 0`` gives 0.

    Raises:
        ValueError: naming the argument, for wrong shapes, dtypes or devices, a non-positive temperature or
            chunk size, a label outside ``[0, V)``, a ``token_loss`` that is not callable, returns anything but
            a float ``(n,)`` tensor computed from ``logp``/``entropy``, or needs grad through a side input.
    """
    hidden, weight, labels, bias, temperature = _validate(hidden, weight, labels, bias, temperature, None)
    if chunk_size is None:
        chunk_size = DEFAULT_LOSS_CHUNK_SIZE if hidden.device.type == "cpu" else DEFAULT_LOSS_CHUNK_SIZE_CUDA
    chunk_size = _check_chunk("chunk_size", chunk_size)
    if not callable(token_loss):
        raise ValueError(f"token_loss must be callable (logp, entropy, index) -> Tensor[n], got {token_loss!r}")
    if not isinstance(need_entropy, bool):
        raise ValueError(f"need_entropy must be a bool, got {need_entropy!r}")
    grad_on = torch.is_grad_enabled()
    need = tuple(bool(grad_on and t is not None and t.requires_grad) for t in (hidden, weight, bias))
    return _FusedTokenLoss.apply(
        hidden, weight, bias, labels, token_loss, 1.0 / temperature, chunk_size, need_entropy, need
    )
