"""fused_token_loss (the one-pass loss) against plain float64 autograd through the full logits."""

from __future__ import annotations

import pytest
import torch

from orchard.losses import fused_token_logprobs, fused_token_loss

from ._reference import LargestTensor, lm_head_inputs, lm_head_reference

# bf16 rounds each logit to 8 significant bits (≈ 0.016 on |z| ≲ 4), so per-token log-probs and entropies move
# by up to ~0.04 (as in test_fused.py); the loss moves by at most Σ_i (|∂ℓ/∂logp_i| + |∂ℓ/∂H_i|) times that.
LOGP_ATOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 4e-2}
GRAD_RTOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2}  # relative to the largest grad

# log-ratios log(π/π_old) at least 0.1 away from the clip edges log 0.8 = −0.22 and log 1.28 = 0.25, so a
# bf16 rounding of the log-prob cannot move a token across an edge and flip its gradient
LOG_RATIOS = torch.tensor([-0.6, -0.35, -0.1, 0.0, 0.12, 0.4, 0.7])


def side_inputs(kind, ref_logp, gen):
    """Per-token constants a loss of `kind` looks up by index (built from the float64 reference log-probs)."""
    n = ref_logp.shape[0]
    if kind == "sft":
        weights = torch.rand(n, generator=gen)
        weights[::3] = 0.0  # rows that do not count
        return {"weights": weights}
    pick = torch.randint(0, len(LOG_RATIOS), (n,), generator=gen)
    old = (ref_logp.detach() - LOG_RATIOS[pick].double()).float()  # π_old with known log-ratios
    return {"old": old, "adv": torch.randn(n, generator=gen), "ref": old + 0.3 * torch.randn(n, generator=gen)}


def make_token_loss(kind, side, n_total):
    """The per-token losses under test, written once and applied to both the fused and the reference path."""

    def token_loss(logp, entropy, index):
        if kind == "sft":  # weighted NLL, a global normaliser
            return -side["weights"][index].to(logp.dtype) * logp / n_total
        ratio = (logp - side["old"][index].to(logp.dtype)).exp()  # [n]
        adv = side["adv"][index].to(logp.dtype)
        ppo = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))  # clip-higher surrogate
        if kind == "ppo":
            return ppo
        if kind == "ppo_entropy":
            return ppo - 0.05 * entropy
        if kind == "k2_kl":
            return 0.5 * (logp - side["ref"][index].to(logp.dtype)) ** 2
        assert kind == "entropy_only"  # logp unused: its coefficient must be zero, not an error
        return -entropy

    return token_loss


NEEDS_ENTROPY = {"sft": False, "ppo": False, "ppo_entropy": True, "k2_kl": False, "entropy_only": True}


def assert_close_to_reference(loss, ref_loss, sensitivity, leaves, ref_leaves, dtype):
    """``sensitivity`` = Σ_i |∂ℓ/∂logp_i| + |∂ℓ/∂H_i| of the reference: first-order bound on the loss error."""
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert abs(loss.item() - ref_loss.item()) <= LOGP_ATOL[dtype] * (sensitivity + 1e-3) + 1e-12
    for leaf, ref_leaf in zip(leaves, ref_leaves, strict=True):
        assert leaf.grad.dtype == dtype
        expected = ref_leaf.grad
        err = (leaf.grad.double() - expected).abs().max().item()
        assert err <= GRAD_RTOL[dtype] * expected.abs().max().item() + 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("kind", ["sft", "ppo", "ppo_entropy", "k2_kl", "entropy_only"])
@pytest.mark.parametrize(
    ("n", "v", "h", "chunk", "temperature", "bias"),
    [
        (37, 101, 13, 8, 1.0, False),  # odd sizes, chunks that do not divide N
        (29, 67, 9, 5, 0.7, True),
        (5, 7, 3, 64, 1.3, True),  # one chunk holds everything
        (9, 4133, 5, 4, 0.8, True),  # V beyond the 4096-row slices of the entropy and bf16 weight-grad sums
    ],
)
def test_matches_float64_full_logits_reference(dtype, kind, n, v, h, chunk, temperature, bias):
    leaves, labels, gen = lm_head_inputs(n, v, h, dtype, seed=n + v, bias=bias, scale=2.0)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_logp, ref_entropy = lm_head_reference(ref_leaves, labels, temperature)
    token_loss = make_token_loss(kind, side_inputs(kind, ref_logp, gen), n)
    ref_logp.retain_grad()
    ref_entropy.retain_grad()
    per_token_ref = token_loss(ref_logp, ref_entropy, torch.arange(n))  # [T], float64
    per_token_ref.sum().backward()
    sensitivity = sum(t.grad.abs().sum().item() for t in (ref_logp, ref_entropy) if t.grad is not None)

    loss = fused_token_loss(
        leaves[0], leaves[1], labels, token_loss, temperature=temperature, chunk_size=chunk,
        bias=leaves[2] if bias else None, need_entropy=NEEDS_ENTROPY[kind],
    )
    loss.backward()
    assert_close_to_reference(loss, per_token_ref.sum(), sensitivity, leaves, ref_leaves, dtype)


@pytest.mark.parametrize("upstream", [3.0, -0.5, 0.0])
def test_upstream_gradient_scales_the_stored_gradients(upstream):
    n, v, h = 23, 41, 7
    leaves, labels, gen = lm_head_inputs(n, v, h, torch.float64, seed=5, bias=True, scale=2.0)
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    ref_logp, ref_entropy = lm_head_reference(ref_leaves, labels, 0.9)
    token_loss = make_token_loss("ppo_entropy", side_inputs("ppo", ref_logp, gen), n)
    # the loss in a larger graph: scaled, plus a term of hidden's own
    (token_loss(ref_logp, ref_entropy, torch.arange(n)).sum() * upstream + (ref_leaves[0] ** 2).sum()).backward()
    loss = fused_token_loss(
        leaves[0], leaves[1], labels, token_loss, temperature=0.9, chunk_size=6, bias=leaves[2], need_entropy=True
    )
    (loss * upstream + (leaves[0] ** 2).sum()).backward()
    for leaf, ref_leaf in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-10, atol=1e-10)


def test_chunk_size_does_not_change_loss_or_gradients():
    n, v, h = 31, 53, 11
    results = []
    for chunk in (1, 4, 31, 100):
        leaves, labels, gen = lm_head_inputs(n, v, h, torch.float64, seed=2, bias=True, scale=2.0)
        ref_logp, _ = lm_head_reference(leaves, labels, 1.0)
        token_loss = make_token_loss("ppo_entropy", side_inputs("ppo", ref_logp, gen), n)
        loss = fused_token_loss(leaves[0], leaves[1], labels, token_loss, chunk_size=chunk, bias=leaves[2],
                                need_entropy=True)
        loss.backward()
        results.append([loss.detach(), *(t.grad for t in leaves)])
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_sft_sum_agrees_with_fused_token_logprobs_and_sees_every_row_once():
    # −Σ logp through both fused paths: same loss and gradients; token_loss records each row's log-prob once
    n, v, h = 45, 77, 10
    leaves, labels, _ = lm_head_inputs(n, v, h, torch.float32, seed=4, scale=2.0)
    seen = torch.zeros(n, dtype=torch.long)
    recorded = torch.full((n,), float("nan"))

    def nll(logp, entropy, index):
        assert entropy is None and logp.dtype == torch.float32 and logp.requires_grad and logp.is_leaf
        seen[index] += 1
        recorded[index] = logp.detach()
        return -logp

    loss = fused_token_loss(leaves[0], leaves[1], labels, nll, temperature=1.5, chunk_size=8)
    loss.backward()
    other = [t.detach().clone().requires_grad_() for t in leaves]
    logp = fused_token_logprobs(other[0], other[1], labels, temperature=1.5)
    (-logp.sum()).backward()
    assert torch.equal(seen, torch.ones(n, dtype=torch.long))
    torch.testing.assert_close(recorded, logp.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, -logp.sum(), rtol=1e-5, atol=1e-4)
    for a, b in zip(leaves, other, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_empty_batch_gives_zero_loss_and_zero_gradients_without_calling_token_loss():
    leaves, labels, _ = lm_head_inputs(0, 9, 4, torch.float32, seed=0, bias=True, scale=2.0)
    calls = []
    loss = fused_token_loss(leaves[0], leaves[1], labels, lambda lp, e, i: calls.append(1) or -lp, bias=leaves[2])
    loss.backward()
    assert loss.item() == 0.0 and not calls
    assert leaves[0].grad.shape == (0, 4)
    assert torch.equal(leaves[1].grad, torch.zeros(9, 4)) and torch.equal(leaves[2].grad, torch.zeros(9))


def test_frozen_head_and_no_grad_mode():
    n, v, h = 12, 19, 5
    leaves, labels, _ = lm_head_inputs(n, v, h, torch.float64, seed=8, scale=2.0)
    weight = leaves[1].detach()  # frozen head: only hidden gets a gradient
    loss = fused_token_loss(leaves[0], weight, labels, lambda lp, e, i: -lp, chunk_size=5)
    loss.backward()
    ref_hidden = leaves[0].detach().clone().requires_grad_()
    ref_logp, _ = lm_head_reference([ref_hidden, weight], labels, 1.0)
    (-ref_logp.sum()).backward()
    torch.testing.assert_close(leaves[0].grad, ref_hidden.grad, rtol=1e-10, atol=1e-12)
    assert weight.grad is None
    with torch.no_grad():  # evaluation: the same value, nothing to differentiate
        value = fused_token_loss(leaves[0], leaves[1], labels, lambda lp, e, i: -lp, chunk_size=5)
    assert not value.requires_grad
    torch.testing.assert_close(value, -ref_logp.sum().detach(), rtol=1e-12, atol=1e-12)


def test_second_backward_is_refused():
    leaves, labels, _ = lm_head_inputs(6, 11, 3, torch.float32, seed=1, scale=2.0)
    loss = fused_token_loss(leaves[0], leaves[1], labels, lambda lp, e, i: -lp)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_token_by_vocabulary_tensor_is_ever_built(dtype):
    n, v, h, chunk = 96, 160, 4, 8
    leaves, labels, _ = lm_head_inputs(n, v, h, dtype, seed=9, bias=True, scale=2.0)
    with LargestTensor() as mode:
        loss = fused_token_loss(leaves[0], leaves[1], labels, lambda lp, e, i: -lp - e, bias=leaves[2],
                                chunk_size=chunk, need_entropy=True)
        loss.backward()
    # the largest things alive are one block (8 × 160 = 1280) and the [V, H] / [T, H] gradients (640, 384)
    assert mode.largest == max(chunk * v, v * h, n * h)
    assert mode.largest < n * v // 10


def _ok_loss(lp, e, i):
    return -lp


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"hidden": torch.zeros(4)}, "hidden must have shape"),
        ({"weight": torch.zeros(5, 4)}, "weight must have shape"),
        ({"labels": torch.zeros(4, dtype=torch.long)}, "labels must have shape"),
        ({"labels": torch.tensor([0, 1, -100])}, "labels must lie in"),
        ({"labels": torch.tensor([0, 1, 7])}, "labels must lie in"),
        ({"bias": torch.zeros(3)}, "bias must have shape"),
        ({"temperature": 0.0}, "temperature must be"),
        ({"chunk_size": 0}, "chunk_size must be"),
        ({"token_loss": "nll"}, "token_loss must be callable"),
        ({"need_entropy": 1}, "need_entropy must be a bool"),
        ({"token_loss": lambda lp, e, i: -lp.sum()}, "token_loss must return a float tensor of shape"),
        ({"token_loss": lambda lp, e, i: -lp.detach()}, "does not require grad"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(kwargs, needle):
    args = {"hidden": torch.zeros(3, 2), "weight": torch.zeros(7, 2), "labels": torch.tensor([0, 1, 2]),
            "token_loss": _ok_loss}
    args.update(kwargs)
    positional = [args.pop(k) for k in ("hidden", "weight", "labels", "token_loss")]
    with pytest.raises(ValueError, match=needle):
        fused_token_loss(*positional, **args)


@pytest.mark.parametrize("side_is_leaf", [True, False])
def test_side_input_that_requires_grad_is_refused(side_is_leaf):
    leaves, labels, _ = lm_head_inputs(6, 11, 3, torch.float32, seed=3, scale=2.0)
    param = torch.randn(6, requires_grad=True)
    adv = param if side_is_leaf else param * 2  # a value-model output that was not detached
    with pytest.raises(ValueError, match="token_loss's output depends on a tensor that requires grad"):
        fused_token_loss(leaves[0], leaves[1], labels, lambda lp, e, i: -adv[i] * lp)
    # detached, the same loss is accepted and no gradient reaches the side input
    fused_token_loss(leaves[0], leaves[1], labels, lambda lp, e, i: -adv.detach()[i] * lp).backward()
    assert param.grad is None
