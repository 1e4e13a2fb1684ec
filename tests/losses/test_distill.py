"""On-policy distillation losses: hand values, exact expected gradients over a small vocabulary, teacher
isolation, garbage, references and degenerate inputs."""

import math

import pytest
import torch

from orchard.losses import js_opd_loss, k2_opd_loss, k3_opd_loss, policy_loss

from ._reference import aggregate_reference, expected_sampled_gradient

LOSSES = [k2_opd_loss, k3_opd_loss, js_opd_loss]
LN2 = math.log(2)


def test_hand_computed_values_and_gradients():
    # student π = [0.5, 0.2], teacher π_T = [0.25, 0.4]: δ = [ln 2, −ln 2], ρ = [0.5, 2]
    s = torch.tensor([[math.log(0.5), math.log(0.2)]], dtype=torch.float64, requires_grad=True)
    t = torch.tensor([[math.log(0.25), math.log(0.4)]], dtype=torch.float64)
    mask = torch.ones(1, 2)

    loss, metrics = k2_opd_loss(s, t, mask)
    assert loss.item() == pytest.approx(LN2**2 / 2)  # mean of ½δ² = ½ ln²2 each
    (g,) = torch.autograd.grad(loss, s)
    torch.testing.assert_close(g, torch.tensor([[LN2 / 2, -LN2 / 2]], dtype=torch.float64))  # δ / 2 tokens
    assert metrics["opd/reverse_kl_k1"].item() == pytest.approx(0.0)  # (ln 2 − ln 2) / 2

    loss, metrics = k3_opd_loss(s, t, mask)
    # K3 = ρ − 1 − ln ρ = [ln 2 − 0.5, 1 − ln 2]; mean = 0.25
    assert loss.item() == pytest.approx(0.25)
    assert metrics["opd/reverse_kl_k3"].item() == pytest.approx(0.25)
    (g,) = torch.autograd.grad(loss, s)
    torch.testing.assert_close(g, torch.tensor([[LN2 / 2, -LN2 / 2]], dtype=torch.float64))  # same as K2

    loss, metrics = js_opd_loss(s, t, mask)
    # M = ½π + ½π_T = [0.375, 0.3]; log(π/M) = [ln(4/3), ln(2/3)]
    a = [math.log(4 / 3), math.log(2 / 3)]
    # surrogate value: mean(a · log π) = (ln(4/3)·ln 0.5 + ln(2/3)·ln 0.2) / 2
    assert loss.item() == pytest.approx((a[0] * math.log(0.5) + a[1] * math.log(0.2)) / 2)
    (g,) = torch.autograd.grad(loss, s)
    torch.testing.assert_close(g, torch.tensor([[a[0] / 2, a[1] / 2]], dtype=torch.float64))
    # JS estimate per token: ½ log(π/M) + ½ ρ log(π_T/M)
    # token 0: ½ ln(4/3) + ½·0.5·ln(2/3); token 1: ½ ln(2/3) + ½·2·ln(4/3)
    js = (0.5 * a[0] + 0.25 * math.log(2 / 3) + 0.5 * a[1] + math.log(4 / 3)) / 2
    assert metrics["opd/js"].item() == pytest.approx(js)


def _enumerate_setup(seed, P=3, V=6):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(P, V, generator=g, dtype=torch.float64, requires_grad=True)
    teacher_PV = torch.log_softmax(1.5 * torch.randn(P, V, generator=g, dtype=torch.float64), dim=-1)
    return theta, teacher_PV


def _sum_of_token_losses(loss_fn, teacher_PV, **kw):
    # token-sum-norm with normaliser 1 is the plain sum of the per-token losses
    def total(leaf_N1):
        mask = torch.ones_like(leaf_N1, dtype=torch.bool)
        return loss_fn(leaf_N1, teacher_PV.reshape(-1, 1), mask, agg="token-sum-norm", normalizer=1.0, **kw)[
            0
        ]

    return total


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("loss_fn", [k2_opd_loss, k3_opd_loss], ids=["k2", "k3"])
def test_k2_k3_expected_gradient_is_reverse_kl_gradient(seed, loss_fn):
    theta, teacher_PV = _enumerate_setup(seed)
    expected = expected_sampled_gradient(theta, _sum_of_token_losses(loss_fn, teacher_PV))
    logp_PV = torch.log_softmax(theta, dim=-1)
    reverse_kl = (logp_PV.exp() * (logp_PV - teacher_PV)).sum()  # Σ_contexts KL(π ‖ π_T)
    (true,) = torch.autograd.grad(reverse_kl, theta)
    torch.testing.assert_close(expected, true)
    forward_kl = (teacher_PV.exp() * (teacher_PV - torch.log_softmax(theta, dim=-1))).sum()
    (wrong,) = torch.autograd.grad(forward_kl, theta)
    assert not torch.allclose(expected, wrong, atol=1e-3)  # the two divergences are distinguishable here


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("lam", [0.5, 0.2, 0.9])
def test_js_expected_gradient_is_js_gradient_over_lambda(seed, lam):
    theta, teacher_PV = _enumerate_setup(seed)
    expected = expected_sampled_gradient(theta, _sum_of_token_losses(js_opd_loss, teacher_PV, lam=lam))
    logp_PV = torch.log_softmax(theta, dim=-1)
    p, q = logp_PV.exp(), teacher_PV.exp()
    log_m = torch.log(lam * p + (1 - lam) * q)
    js = lam * (p * (logp_PV - log_m)).sum() + (1 - lam) * (q * (teacher_PV - log_m)).sum()  # Σ_contexts JS_λ
    (true,) = torch.autograd.grad(js, theta)
    torch.testing.assert_close(expected, true / lam)
    assert true.abs().max() > 1e-3


@pytest.mark.parametrize("lam", [0.5, 0.3])
def test_js_metric_is_unbiased_for_js(lam):
    # E_{y~π}[per-token opd/js] = JS_λ: enumerate one context, weight the per-token estimate by π(y)
    _, teacher_PV = _enumerate_setup(5, P=1, V=9)
    student = torch.log_softmax(torch.randn(1, 9, dtype=torch.float64), dim=-1)
    per_token = [
        js_opd_loss(student[:, y : y + 1], teacher_PV[:, y : y + 1], torch.ones(1, 1), lam=lam)[1]["opd/js"]
        for y in range(9)
    ]
    estimate = sum(student[0, y].exp() * per_token[y] for y in range(9))
    p, q = student.exp(), teacher_PV.exp()
    m = lam * p + (1 - lam) * q
    js = lam * (p * (p / m).log()).sum() + (1 - lam) * (q * (q / m).log()).sum()
    torch.testing.assert_close(estimate, js)


def test_k3_gradient_equals_literal_stabilized_product():
    # ℓ = K3 · π/sg(π) written literally and differentiated by autograd, in float64 at moderate ρ
    torch.manual_seed(2)
    s = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    t = torch.randn(3, 5, dtype=torch.float64)
    mask = torch.rand(3, 5) < 0.7
    loss, _ = k3_opd_loss(s, t, mask)
    rho = (t - s).exp()
    literal = (rho - 1 - rho.log()) * (s - s.detach()).exp()
    ref = aggregate_reference(literal, mask, "token-mean")
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(torch.autograd.grad(loss, s)[0], torch.autograd.grad(ref, s)[0])


def test_k3_gradient_stays_exact_when_teacher_ratio_is_huge():
    # ρ = e^40: autograd on the literal product cancels −ρ against +ρ in float32; the closed form does not
    s = torch.tensor([[-45.0]], requires_grad=True)
    t = torch.tensor([[-5.0]])
    loss, _ = k3_opd_loss(s, t, torch.ones(1, 1))
    (g,) = torch.autograd.grad(loss, s)
    assert g.item() == pytest.approx(-40.0)  # δ = log π − log π_T


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_identical_distributions_give_zero_loss_gradient(loss_fn):
    lp = torch.log_softmax(torch.randn(2, 4, dtype=torch.float64), -1).requires_grad_()
    loss, metrics = loss_fn(lp, lp.detach(), torch.ones(2, 4))
    (g,) = torch.autograd.grad(loss, lp)
    assert torch.allclose(g, torch.zeros_like(g), atol=1e-12)
    if loss_fn is not js_opd_loss:  # the JS surrogate's value is not a divergence; its gradient is
        assert loss.item() == pytest.approx(0.0, abs=1e-12)
    else:
        assert metrics["opd/js"].item() == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_gradients_never_reach_the_teacher(loss_fn):
    s = torch.randn(2, 3, requires_grad=True)
    t = torch.randn(2, 3, requires_grad=True)
    loss, metrics = loss_fn(s, t, torch.ones(2, 3))
    loss.backward()
    assert t.grad is None and s.grad is not None
    assert all(not v.requires_grad for v in metrics.values())


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum-norm"])
def test_matches_reference(seed, agg):
    g = torch.Generator().manual_seed(seed)
    B, T = int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
    s = (torch.randn(B, T, generator=g, dtype=torch.float64) - 1).requires_grad_()
    t = torch.randn(B, T, generator=g, dtype=torch.float64) - 1
    mask = torch.rand(B, T, generator=g) < 0.7
    z = 13.0 if agg == "token-sum-norm" else None
    lam = 0.35
    per_token_refs = {
        k2_opd_loss: 0.5 * (s - t) ** 2,
        k3_opd_loss: ((t - s).exp() - 1 - (t - s)) * torch.exp(s - s.detach()),
        js_opd_loss: (s - torch.log(lam * s.exp() + (1 - lam) * t.exp())).detach() * s,
    }
    for loss_fn, per_token in per_token_refs.items():
        kw = dict(lam=lam) if loss_fn is js_opd_loss else {}
        loss, _ = loss_fn(s, t, mask, agg=agg, normalizer=z, **kw)
        ref = aggregate_reference(per_token, mask, agg, z)
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(torch.autograd.grad(loss, s)[0], torch.autograd.grad(ref, s)[0])


def test_gradcheck_k2():
    s = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    t = torch.randn(3, 4, dtype=torch.float64)
    mask = torch.rand(3, 4) < 0.7
    assert torch.autograd.gradcheck(lambda x: k2_opd_loss(x, t, mask, agg="seq-mean-token-mean")[0], (s,))


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_masked_garbage_changes_nothing(loss_fn):
    torch.manual_seed(3)
    s = torch.randn(3, 6) - 1
    t = torch.randn(3, 6) - 1
    mask = torch.rand(3, 6) < 0.5
    mask[2] = False
    dirty_s, dirty_t = s.clone(), t.clone()
    dirty_s[~mask] = float("nan")
    dirty_t[~mask] = -float("inf")
    dirty_t[0, ~mask[0]] = float("inf")
    a, b = s.clone().requires_grad_(), dirty_s.requires_grad_()
    la, ma = loss_fn(a, t, mask, agg="seq-mean-token-mean")
    lb, mb = loss_fn(b, dirty_t, mask, agg="seq-mean-token-mean")
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb)
    torch.testing.assert_close(a.grad, b.grad)
    for key in ma:
        torch.testing.assert_close(ma[key], mb[key], msg=key)


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_degenerate_inputs_are_finite(loss_fn):
    s = torch.full((2, 3), -float("inf"), requires_grad=True)
    loss, metrics = loss_fn(s, torch.full((2, 3), -float("inf")), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and (s.grad == 0).all()
    assert all(torch.isfinite(v) and v.item() == 0.0 for v in metrics.values())


def test_js_teacher_zero_probability_token_is_finite():
    # π_T(y) = 0 on a sampled token: M = λπ, log(π/M) = log(1/λ) — bounded, unlike K2/K3's δ = +inf
    s = torch.tensor([[math.log(0.3)]], requires_grad=True)
    loss, metrics = js_opd_loss(s, torch.tensor([[-float("inf")]]), torch.ones(1, 1))
    (g,) = torch.autograd.grad(loss, s)
    assert g.item() == pytest.approx(LN2)
    # JS estimate: λ log(π/M) + (1 − λ)·0 = ½ ln 2 (the KL metrics are rightly infinite)
    assert metrics["opd/js"].item() == pytest.approx(LN2 / 2)
    assert metrics["opd/reverse_kl_k1"].item() == float("inf")


def test_added_to_grpo_loss_with_a_coefficient():
    torch.manual_seed(4)
    old = torch.randn(3, 5) - 1
    lp = (old + 0.1 * torch.randn(3, 5)).requires_grad_()
    teacher = torch.randn(3, 5) - 1
    adv, mask, beta = torch.randn(3), torch.rand(3, 5) < 0.8, 0.1
    pg, pg_metrics = policy_loss(lp, old, adv, mask)
    opd, opd_metrics = js_opd_loss(lp, teacher, mask)
    (pg + beta * opd).backward()
    g_total = lp.grad.clone()
    (g_pg,) = torch.autograd.grad(policy_loss(lp, old, adv, mask)[0], lp)
    (g_opd,) = torch.autograd.grad(js_opd_loss(lp, teacher, mask)[0], lp)
    torch.testing.assert_close(g_total, g_pg + beta * g_opd)
    assert not set(pg_metrics) & set(opd_metrics)


def test_errors_name_the_argument():
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    for loss_fn in LOSSES:
        with pytest.raises(ValueError, match="student_logprobs must have shape"):
            loss_fn(torch.zeros(3), torch.zeros(3), torch.ones(3))
        with pytest.raises(ValueError, match="teacher_logprobs"):
            loss_fn(x, torch.zeros(2, 4), m)
        with pytest.raises(ValueError, match="mask"):
            loss_fn(x, x, torch.ones(2))
        with pytest.raises(ValueError, match="agg must be one of"):
            loss_fn(x, x, m, agg="mean")
    for bad in (0.0, 1.0, -0.5, float("nan"), True):
        with pytest.raises(ValueError, match="lam"):
            js_opd_loss(x, x, m, lam=bad)
