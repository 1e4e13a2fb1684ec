"""Plain references shared by the loss tests, written from the formulas."""

import torch


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
