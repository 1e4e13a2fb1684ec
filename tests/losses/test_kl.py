"""kl_penalty and KL_ESTIMATORS: hand values, gradcheck, masking, which divergence each gradient follows."""

import math

import pytest
import torch

from orchard.losses import KL_ESTIMATORS, kl_penalty

from ._reference import expected_sampled_gradient


def _per_token(kind, lp, ref):
    return KL_ESTIMATORS.get(kind, "kind")(lp - ref)


def test_hand_computed_values():
    lp = torch.tensor([[math.log(0.5), math.log(0.2)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.4)]])
    # δ = log π − log π_ref = [ln 2, −ln 2]; ρ = π_ref / π = [0.5, 2]
    ln2 = math.log(2)
    torch.testing.assert_close(_per_token("k1", lp, ref), torch.tensor([[ln2, -ln2]]))
    torch.testing.assert_close(_per_token("k2", lp, ref), torch.tensor([[ln2**2 / 2, ln2**2 / 2]]))
    # k3 = ρ − 1 − ln ρ: [0.5 − 1 + ln 2, 2 − 1 − ln 2] = [0.193147, 0.306853]
    k3 = torch.tensor([[ln2 - 0.5, 1 - ln2]])
    torch.testing.assert_close(_per_token("k3", lp, ref), k3)
    torch.testing.assert_close(_per_token("k3+", lp, ref), k3)
    mask = torch.ones(1, 2, dtype=torch.bool)
    # the loss: token mean of k3 = (ln 2 − 0.5 + 1 − ln 2) / 2 = 0.25; k1's mean = (ln 2 − ln 2) / 2 = 0
    loss, metrics = kl_penalty(lp, ref, mask)
    assert loss.item() == pytest.approx(0.25)
    assert metrics["kl/k3_mean"].item() == pytest.approx(0.25)
    assert metrics["kl/k1_mean"].item() == pytest.approx(0.0, abs=1e-7)
    # seq-mean-token-sum over one row: the sum, 0.5; k2 sum: 2 · ln²2 / 2 = ln²2
    assert kl_penalty(lp, ref, mask, agg="seq-mean-token-sum")[0].item() == pytest.approx(0.5)
    assert kl_penalty(lp, ref, mask, kind="k2", agg="token-sum-norm", normalizer=1.0)[0].item() == pytest.approx(
        ln2**2
    )


def test_k3_plus_has_k3_value_and_k2_gradient():
    torch.manual_seed(0)
    lp = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(3, 4, dtype=torch.float64)
    mask = torch.ones(3, 4, dtype=torch.bool)
    st, _ = kl_penalty(lp, ref, mask, kind="k3+")
    torch.testing.assert_close(st, kl_penalty(lp, ref, mask, kind="k3")[0])
    (g_st,) = torch.autograd.grad(st, lp)
    (g_k2,) = torch.autograd.grad(kl_penalty(lp, ref, mask, kind="k2")[0], lp)
    torch.testing.assert_close(g_st, g_k2)
    torch.testing.assert_close(g_k2, (lp - ref).detach() / 12)  # ∂(½δ²)/∂ log π = δ, over 12 tokens


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_gradcheck(kind):
    lp = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(2, 5, dtype=torch.float64)
    mask = torch.rand(2, 5) < 0.6
    assert torch.autograd.gradcheck(lambda x: kl_penalty(x, ref, mask, kind=kind)[0], (lp,))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "k3+"])
def test_masked_garbage_is_zero_value_and_gradient(kind):
    lp = torch.tensor([[-1.0, float("nan"), -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -float("inf"), float("inf")]])
    mask = torch.tensor([[True, False, False]])
    out, metrics = kl_penalty(lp, ref, mask, kind=kind)
    out.backward()
    assert torch.isfinite(out) and all(torch.isfinite(v) for v in metrics.values())
    assert torch.isfinite(lp.grad).all() and (lp.grad[0, 1:] == 0).all()
    torch.testing.assert_close(out, kl_penalty(lp[:, :1], ref[:, :1], mask[:, :1], kind=kind)[0])


def test_reference_gets_no_gradient():
    lp = torch.randn(2, 3, requires_grad=True)
    ref = torch.randn(2, 3, requires_grad=True)
    kl_penalty(lp, ref, torch.ones(2, 3, dtype=torch.bool), kind="k2")[0].backward()
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
        theta, lambda lp: _per_token(kind, lp, ref_logp_PV.reshape(-1, 1)).sum()
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
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="logprobs must have shape"):
        kl_penalty(torch.zeros(3), torch.zeros(3), torch.ones(3))
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_penalty(x, torch.zeros(3, 2), m)
    with pytest.raises(ValueError, match=r"kind must be one of \['k1', 'k2', 'k3', 'k3\+'"):
        kl_penalty(x, x, m, kind="k4")
    with pytest.raises(ValueError, match="mask"):
        kl_penalty(x, x, torch.ones(2))
    with pytest.raises(ValueError, match=r"mask must be a torch\.Tensor, got str"):
        kl_penalty(x, x, "k3+")  # the old per-token call shape fails loudly
    with pytest.raises(ValueError, match="agg must be one of"):
        kl_penalty(x, x, m, agg="mean")
    assert KL_ESTIMATORS.names()[:4] == ["k1", "k2", "k3", "k3+"]


def test_delta_min_names_the_token_that_drives_k3():
    # Issue 16's pattern: 99 counted tokens where π = π_ref (δ = 0) and one 17 nats below the reference.
    # k3 = e^17 − 1 − 17 = 24154934.5 on that token, 0 elsewhere: mean 241549.3; k1's mean is only −17 / 100.
    lp = torch.zeros(2, 51, dtype=torch.float64)
    lp[1, 7] = -17.0
    ref = torch.zeros(2, 51, dtype=torch.float64)
    mask = torch.ones(2, 51, dtype=torch.bool)
    mask[:, 0] = False  # 2 · 50 = 100 counted tokens
    lp[0, 0] = -1e9  # masked: changes no metric
    _, metrics = kl_penalty(lp, ref, mask)
    assert metrics["kl/k3_mean"].item() == pytest.approx((math.exp(17) - 18) / 100)
    assert metrics["kl/k1_mean"].item() == pytest.approx(-0.17)
    assert metrics["kl/delta_min"].item() == -17.0


def test_delta_min_is_zero_without_a_counted_token():
    lp = torch.full((1, 3), -5.0)
    _, metrics = kl_penalty(lp, torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.bool))
    assert metrics["kl/delta_min"].item() == 0.0
