"""``fused_token_loss``: a per-token loss of the lm head's log-probs, its gradients formed in the forward.

One token chunk × the whole vocabulary at a time, the caller's per-token loss gives ``∂loss/∂logp`` (and
``∂loss/∂ℋ``) while the chunk's logits are alive, so both gradient matmuls run then: three ``T × H × V``
matmuls, the plain path's count; the backward only scales the stored gradients. Notation and the gradient
formulas: ``orchard.losses.fused``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from orchard.losses._fused_common import (
    DEFAULT_VOCAB_CHUNK_SIZE,
    accumulate_dtype,
    check_chunk,
    validate_head_inputs,
)

__all__ = ["DEFAULT_LOSS_CHUNK_SIZE", "DEFAULT_LOSS_CHUNK_SIZE_CUDA", "TokenLoss", "fused_token_loss"]

DEFAULT_LOSS_CHUNK_SIZE = 128
"""Tokens per block of ``fused_token_loss`` on a CPU. Each block spans the whole vocabulary: at V = 151,936 a
float32 block is 128 × 151,936 × 4 B = 74 MiB (two blocks with the entropy). Picked by a sweep at T = 1024 on a
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
    """Run ``token_loss`` on one chunk: its summed value and ``∂loss/∂logp``, ``∂loss/∂ℋ`` per token, ``[n]``."""
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
    acc = accumulate_dtype(hidden.dtype)
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
    # z = (h Wᵀ + b) / τ = (h / τ) Wᵀ + b / τ: the temperature scales [n, H] and [V], never a block, and
    # ∂/∂W = Gᵀ (h / τ) reuses the scaled rows
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
    return logits.to(accumulate_dtype(logits.dtype))


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
    rebuilds every logit block: four ``T × H × V`` matmuls against the plain path's three. When the loss is a
    sum of per-token terms, ``token_loss`` can be applied inside the forward; each token chunk then forms
    ``∂loss/∂z`` while its logits are alive, and the backward only scales the stored gradients:

        z = (hidden @ weight.T + bias) / temperature                   one [n, V] block at a time, float32
        logp_i = log softmax(z_i)[y_i],   ℋ_i = entropy of softmax(z_i)
        loss = Σ_chunks Σ_i token_loss(logp, H, index)_i
        G_ij = c_i (1[j = y_i] − p_ij) + e_i p_ij (E_p[z_i] − z_ij),   c = ∂loss/∂logp,  e = ∂loss/∂ℋ
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
        hidden: final hidden states, one row per scored token. Shape: ``(T, H)``; float16, bfloat16, float32
            or float64.
        weight: the lm head. Shape: ``(V, H)``; dtype of ``hidden``.
        labels: the token scored at each row. Shape: ``(T,)``; integer, each in ``[0, V)`` (no ignore index:
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
        one chunk the weight gradient is summed in a float32 ``(V, H)`` buffer. ``T = 0`` gives 0.

    Raises:
        ValueError: naming the argument, for wrong shapes, dtypes or devices, a non-positive temperature or
            chunk size, a label outside ``[0, V)``, a ``token_loss`` that is not callable, returns anything but
            a float ``(n,)`` tensor computed from ``logp``/``entropy``, or needs grad through a side input.
    """
    hidden, weight, labels, bias, temperature = validate_head_inputs(hidden, weight, labels, bias, temperature, None)
    if chunk_size is None:
        chunk_size = DEFAULT_LOSS_CHUNK_SIZE if hidden.device.type == "cpu" else DEFAULT_LOSS_CHUNK_SIZE_CUDA
    chunk_size = check_chunk("chunk_size", chunk_size)
    if not callable(token_loss):
        raise ValueError(f"token_loss must be callable (logp, entropy, index) -> Tensor[n], got {token_loss!r}")
    if not isinstance(need_entropy, bool):
        raise ValueError(f"need_entropy must be a bool, got {need_entropy!r}")
    grad_on = torch.is_grad_enabled()
    need = tuple(bool(grad_on and t is not None and t.requires_grad) for t in (hidden, weight, bias))
    return _FusedTokenLoss.apply(
        hidden, weight, bias, labels, token_loss, 1.0 / temperature, chunk_size, need_entropy, need
    )
