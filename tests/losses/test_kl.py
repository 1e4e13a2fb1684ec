"""kl_penalty: hand values, gradcheck, masking, and which divergence each estimator's gradient follows."""

import math

import pytest
import torch

from orchard.losses import kl_kinds, kl_penalty

from ._reference import expected_sampled_gradient


def test_hand_computed_values():
    lp = torch.tensor([[math.log(0.5), math.log(0.2)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.4)]])
    # δ = log π − log π_ref = [ln 2, −ln 2]; ρ = π_ref / π = [0.5, 2]
    ln2 = math.log(2)
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), torch.tensor([[ln2, -ln2]]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), torch.tensor([[ln2**2 / 2, ln2**2 / 2]]))
    # k3 = ρ − 1 − ln ρ: [0.5 − 1 + ln 2, 2 − 1 − ln 2] = [0.193147, 0.306853]
    k3 = torch.tensor([[ln2 - 0.5, 1 - ln2]])
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), k3)
    torch.testing.assert_close(kl_penalty(lp, ref, "k3+"), k3)


def test_k3_plus_has_k3_value_and_k2_gradient():
    torch.manual_seed(0)
    lp = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(3, 4, dtype=torch.float64)
    st = kl_penalty(lp, ref, "k3+")
    torch.testing.assert_close(st, kl_penalty(lp, ref, "k3"))
    (g_st,) = torch.autograd.grad(st.sum(), lp)
    (g_k2,) = torch.autograd.grad(kl_penalty(lp, ref, "k2").sum(), lp)
    torch.testing.assert_close(g_st, g_k2)
    torch.testing.assert_close(g_k2, (lp - ref).detach())  # ∂(½δ²)/∂ log π = δ


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_gradcheck(kind):
    lp = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(2, 5, dtype=torch.float64)
    mask = torch.rand(2, 5) < 0.6
    assert torch.autograd.gradcheck(lambda x: kl_penalty(x, ref, kind, mask=mask), (lp,))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "k3+"])
def test_masked_garbage_is_zero_value_and_gradient(kind):
    lp = torch.tensor([[-1.0, float("nan"), -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -float("inf"), float("inf")]])
    mask = torch.tensor([[True, False, False]])
    out = kl_penalty(lp, ref, kind, mask=mask)
    out.sum().backward()
    assert torch.isfinite(out).all() and out[0, 1] == 0 and out[0, 2] == 0
    assert torch.isfinite(lp.grad).all() and (lp.grad[0, 1:] == 0).all()
    torch.testing.assert_close(out[0, 0], kl_penalty(lp[:, :1], ref[:, :1], kind)[0, 0])


def test_reference_gets_no_gradient():
    lp = torch.randn(2, 3, requires_grad=True)
    ref = torch.randn(2, 3, requires_grad=True)
    kl_penalty(lp, ref, "k2").sum().backward()
    assert ref.grad is None


# E_{y~π}[∇ℓ] for each estimator used as a loss, against the exact gradient of the divergence it follows.
@pytest.mark.parametrize(
    ("kind", "divergence"),
    [
        ("k1", "zero"),
        ("k2", "reverse"),
        ("k3", "forward"),
        ("k3+", "reverse"),
    ],
)
def test_expected_gradient_under_sampling(kind, divergence):
    g = torch.Generator().manual_seed(11)
    P, V = 3, 7
    theta = torch.randn(P, V, generator=g, dtype=torch.float64, requires_grad=True)
    ref_logp_PV = torch.log_softmax(torch.randn(P, V, generator=g, dtype=torch.float64), dim=-1)
    expected = expected_sampled_gradient(
        theta, lambda lp: kl_penalty(lp, ref_logp_PV.reshape(-1, 1), kind).sum()
    )
    logp_PV = torch.log_softmax(theta, dim=-1)
    p_PV, q_PV = logp_PV.exp(), ref_logp_PV.exp()
    if divergence == "zero":
        torch.testing.assert_close(expected, torch.zeros_like(expected))
        return
    if divergence == "reverse":
        kl = (p_PV * (logp_PV - ref_logp_PV)).sum()  # Σ_contexts KL(π ‖ π_ref)
    else:
        kl = (q_PV * (ref_logp_PV - logp_PV)).sum()  # Σ_contexts KL(π_ref ‖ π)
    (true,) = torch.autograd.grad(kl, theta)
    torch.testing.assert_close(expected, true)
    assert true.abs().max() > 1e-3  # the check is not vacuous


def test_errors_name_the_argument():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="logprobs must have shape"):
        kl_penalty(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_penalty(x, torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"kind must be one of \['k1', 'k2', 'k3', 'k3\+'"):
        kl_penalty(x, x, "k4")
    with pytest.raises(ValueError, match="mask"):
        kl_penalty(x, x, "k1", mask=torch.ones(2))
    assert kl_kinds()[:4] == ["k1", "k2", "k3", "k3+"]
