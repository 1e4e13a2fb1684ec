"""token_logprobs: exact against log_softmax, gradients, entropy, ignored labels, the memory property."""

import math

import pytest
import torch

from orchard.losses import token_logprobs


def reference(logits, labels, temperature=1.0):
    z = logits.double() / temperature
    logp = torch.log_softmax(z, dim=-1)
    label_logp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return label_logp, entropy


def test_hand_computed():
    logits = torch.tensor([[0.0, math.log(3.0)]])  # softmax = [1/4, 3/4]
    logp, ent = token_logprobs(logits, torch.tensor([1]), return_entropy=True)
    assert logp.item() == pytest.approx(math.log(0.75))
    assert ent.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))  # 0.562335
    # temperature 2 halves the logits: softmax([0, ln3 / 2]) = [1, √3] / (1 + √3)
    logp = token_logprobs(logits, torch.tensor([0]), temperature=2.0)
    assert logp.item() == pytest.approx(-math.log(1 + math.sqrt(3)))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("chunk_size", [1, 3, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_matches_reference_value_entropy_and_gradient(seed, chunk_size, dtype):
    g = torch.Generator().manual_seed(seed)
    B, T, V = (int(torch.randint(1, k, (1,), generator=g)) for k in (4, 8, 40))
    logits = (3 * torch.randn(B, T, V, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=g)
    temperature = [1.0, 0.7, 1.3][seed]
    logp, ent = token_logprobs(
        logits, labels, temperature=temperature, chunk_size=chunk_size, return_entropy=True
    )
    ref_logp, ref_ent = reference(logits, labels, temperature)
    assert logp.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype != torch.float64 else {}
    torch.testing.assert_close(logp.double(), ref_logp, **tol)
    torch.testing.assert_close(ent.double(), ref_ent, **tol)
    w = torch.randn(B, T, generator=g, dtype=torch.float64)
    u = torch.randn(B, T, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad((w * logp).sum() + (u * ent).sum(), logits)
    (ref_grad,) = torch.autograd.grad((w * ref_logp).sum() + (u * ref_ent).sum(), logits)
    assert grad.dtype == dtype
    gtol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad.double(), **gtol)


def test_unused_entropy_output_leaves_the_label_gradient_unchanged():
    logits = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([1, 8, 0, 4])
    logp, _ = token_logprobs(logits, labels, chunk_size=3, return_entropy=True)
    (with_entropy,) = torch.autograd.grad(logp.sum(), logits)
    (without,) = torch.autograd.grad(token_logprobs(logits, labels, chunk_size=3).sum(), logits)
    torch.testing.assert_close(with_entropy, without)


def test_gradcheck():
    logits = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 6, 3, 3, 1])
    assert torch.autograd.gradcheck(
        lambda x: token_logprobs(x, labels, temperature=0.8, chunk_size=2, return_entropy=True), (logits,)
    )
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, labels, chunk_size=3), (logits,))


def test_ignored_labels_give_zero_and_tolerate_garbage_logits():
    logits = torch.randn(2, 3, 5)
    logits[0, 1] = float("nan")
    logits[1, 2, 0] = float("inf")
    labels = torch.tensor([[1, -100, 4], [2, 0, -100]])
    x = logits.clone().requires_grad_()
    logp, ent = token_logprobs(x, labels, chunk_size=2, return_entropy=True)
    (logp.sum() + ent.sum()).backward()
    assert logp[0, 1] == 0 and logp[1, 2] == 0 and ent[0, 1] == 0 and ent[1, 2] == 0
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all() and torch.isfinite(x.grad).all()
    assert (x.grad[0, 1] == 0).all() and (x.grad[1, 2] == 0).all()
    ref_logp, _ = reference(logits[0, :1], labels[0, :1])
    torch.testing.assert_close(logp[0, :1], ref_logp.float())


def test_any_leading_shape_and_empty():
    logits = torch.randn(7, 11)
    labels = torch.randint(0, 11, (7,))
    torch.testing.assert_close(token_logprobs(logits, labels), reference(logits, labels)[0].float())
    out = token_logprobs(torch.randn(2, 0, 11), torch.zeros(2, 0, dtype=torch.long))
    assert out.shape == (2, 0)


def test_backward_never_keeps_a_float32_copy_of_the_logits():
    N, V = 64, 1000
    logits = torch.randn(N, V, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, V, (N,))
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(logits, labels, chunk_size=8, return_entropy=True)
    assert not [s for s in saved if s[0] == torch.float32 and s[1] >= N * V], saved
    # the plain path saves one: the check can fail
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[:, None])
    assert [s for s in saved if s[0] == torch.float32 and s[1] >= N * V]


def test_errors_name_the_argument():
    logits, labels = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="logits must be a floating"):
        token_logprobs(logits.long(), labels)
    with pytest.raises(ValueError, match=r"labels must have shape \(2, 3\)"):
        token_logprobs(logits, labels[:, :2])
    with pytest.raises(ValueError, match="labels must be an integer"):
        token_logprobs(logits, labels.float())
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\)"):
        token_logprobs(logits, labels + 5)
    with pytest.raises(ValueError, match=r"labels must lie"):
        token_logprobs(logits, labels - 1)
    for bad in (0.0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="temperature"):
            token_logprobs(logits, labels, temperature=bad)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="chunk_size"):
            token_logprobs(logits, labels, chunk_size=bad)
    with pytest.raises(ValueError, match="vocabulary"):
        token_logprobs(torch.zeros(2, 0), torch.zeros(2, dtype=torch.long))
