"""Plain references shared by the loss tests, written from the formulas."""

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def aggregate_reference(x, mask, mode, normalizer=None):
    """From the formulas, by boolean selection of each row's counted tokens."""
    rows = [x[i][mask[i].bool()] for i in range(x.shape[0])]
    nonempty = [r for r in rows if r.numel() > 0]
    if mode == "token-mean":
        total = sum((r.sum() for r in rows), x.new_zeros(()))
        denom = normalizer if normalizer is not None else max(sum(r.numel() for r in rows), 1)
        return total / denom
    if mode == "seq-mean-token-mean":
        total = sum((r.mean() for r in nonempty), x.new_zeros(()))
        return total / (normalizer if normalizer is not None else max(len(nonempty), 1))
    if mode == "seq-mean-token-sum":
        total = sum((r.sum() for r in nonempty), x.new_zeros(()))
        return total / (normalizer if normalizer is not None else max(len(nonempty), 1))
    assert mode == "token-sum-norm"
    return sum((r.sum() for r in rows), x.new_zeros(())) / normalizer


def expected_sampled_gradient(theta, per_token_grad_fn):
    """``E_{y~π}[∇_θ ℓ(y)]`` exactly, for ``π = softmax(θ)`` over a small vocabulary.

    ``theta`` is ``[P, V]`` (P contexts). ``per_token_grad_fn(logp_N)`` gets the log-probs of every (context,
    token) pair as ``[P*V, 1]`` (one token per row) and returns the scalar sum of the per-token losses; since
    each loss depends on θ only through its own ``log π(y)``, its gradient ``g_y`` with respect to that
    log-prob, weighted by ``π(y)`` and chained through ``∂ log π(y) / ∂θ``, is the exact expectation.
    """
    logp_PV = torch.log_softmax(theta, dim=-1)
    leaf = logp_PV.detach().reshape(-1, 1).requires_grad_()
    total = per_token_grad_fn(leaf)
    (g_N,) = torch.autograd.grad(total, leaf)
    weights_PV = logp_PV.detach().exp() * g_N.reshape(logp_PV.shape)
    (grad_theta,) = torch.autograd.grad(logp_PV, theta, grad_outputs=weights_PV)
    return grad_theta


def lm_head_inputs(n, v, h, dtype, *, seed, bias=False, scale=1.0):
    """Leaves ``[hidden (N, H), weight (V, H)(, bias (V,))]`` in ``dtype`` requiring grad, labels ``(N,)``, and
    the generator (for further seeded draws); weight entries ~ scale / sqrt(H), so logits are O(scale)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64) * (scale / math.sqrt(h))
    b = torch.randn(v, generator=gen, dtype=torch.float64) * 0.5 if bias else None
    labels = torch.randint(0, v, (n,), generator=gen)
    leaves = [t.to(dtype).requires_grad_() for t in (hidden, weight)]
    if b is not None:
        leaves.append(b.to(dtype).requires_grad_())
    return leaves, labels, gen


def lm_head_reference(leaves, labels, temperature=1.0):
    """Plain float64 path over the whole ``[N, V]`` logits of ``leaves = [hidden, weight(, bias)]``: log-probs of
    the labels and entropy ``−Σ p log p`` of every row."""
    z = leaves[0].double() @ leaves[1].double().T  # [N, V]
    if len(leaves) > 2 and leaves[2] is not None:
        z = z + leaves[2].double()
    logp_all = torch.log_softmax(z / temperature, dim=-1)  # [N, V]
    logp = logp_all.gather(1, labels.unsqueeze(1)).squeeze(1)  # [N]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [N]
    return logp, entropy


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out
