"""policy_loss: hand-computed cases, a plain reference over random shapes, gradcheck, garbage, GSPO, IS."""

import math

import pytest
import torch

from orchard.losses import aggregate_loss, policy_loss

from ._reference import aggregate_reference

LN = math.log


def _inputs(ratios, adv):
    old = torch.zeros(1, len(ratios), dtype=torch.float64)
    logp = torch.tensor([[LN(r) for r in ratios]], dtype=torch.float64, requires_grad=True)
    return logp, old, torch.tensor([adv], dtype=torch.float64), torch.ones(1, len(ratios))


def test_hand_computed_asymmetric_clip():
    logp, old, adv, mask = _inputs([1.5, 0.5, 1.1, 0.7], [1.0, -1.0, -2.0, 2.0])
    loss, metrics = policy_loss(logp, old, adv, mask)  # eps 0.2 / 0.28
    # t0: r=1.5, A=+1: max(-1.5, -1.28) = -1.28 (clipped high, no grad)
    # t1: r=0.5, A=-1: max(0.5, 0.8)    =  0.8  (clipped low, no grad)
    # t2: r=1.1, A=-2: max(2.2, 2.2)    =  2.2  (inside the range: grad -A r = 2.2)
    # t3: r=0.7, A=+2: max(-1.4, -1.6)  = -1.4  (ratio below the range but A > 0: not clipped, grad -1.4)
    # token-mean: (-1.28 + 0.8 + 2.2 - 1.4) / 4 = 0.08
    assert loss.item() == pytest.approx(0.08)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.55, -0.35]], dtype=torch.float64))
    assert metrics["clip/low_frac"].item() == pytest.approx(0.25)
    assert metrics["clip/high_frac"].item() == pytest.approx(0.25)
    assert metrics["clip/dual_frac"].item() == 0.0
    assert metrics["ratio/mean"].item() == pytest.approx(0.95)  # (1.5 + 0.5 + 1.1 + 0.7) / 4
    assert metrics["ratio/max"].item() == pytest.approx(1.5)
    assert metrics["ratio/min"].item() == pytest.approx(0.5)
    # k3 = r - 1 - ln r: 0.094535 + 0.193147 + 0.004690 + 0.056675 = 0.349047; / 4
    assert metrics["kl/approx"].item() == pytest.approx(0.0872618, abs=1e-6)
    assert all(not v.requires_grad for v in metrics.values())


def test_hand_computed_dual_clip():
    logp, old, adv, mask = _inputs([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0])
    loss, metrics = policy_loss(logp, old, adv, mask, dual_clip=3.0)
    # t0: A=-1, r=5: max(5, 1.28) = 5, dual min(5, 3) = 3 (no grad)
    # t1: A=-1, r=2: max(2, 1.28) = 2 < 3, kept (grad -A r = 2)
    # t2: A=+1, r=5: max(-5, -1.28) = -1.28; dual clip never touches A > 0
    # (3 + 2 - 1.28) / 3 = 1.24
    assert loss.item() == pytest.approx(1.24)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2 / 3, 0.0]], dtype=torch.float64))
    assert metrics["clip/dual_frac"].item() == pytest.approx(1 / 3)
    assert metrics["clip/high_frac"].item() == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    ("is_mode", "expected", "weight_mean"),
    [
        # weights min(w, 2) = [1, 2, 0.5, 2]: (-1.28*1 + 0.8*2 + 2.2*0.5 - 1.4*2) / 4 = -1.38 / 4
        ("truncate", -0.345, 1.375),
        # weights w * 1[w <= 2] = [1, 0, 0.5, 0]: (-1.28 + 0 + 1.1 + 0) / 4 = -0.18 / 4
        ("mask", -0.045, 0.375),
    ],
)
def test_hand_computed_importance_weights(is_mode, expected, weight_mean):
    logp, old, adv, mask = _inputs([1.5, 0.5, 1.1, 0.7], [1.0, -1.0, -2.0, 2.0])
    old = old + 0.3  # w = exp(old - rollout): only the IS weight and the PPO ratio move together
    logp = (logp.detach() + 0.3).requires_grad_()
    rollout = old - torch.tensor(
        [[0.0, LN(3.0), LN(0.5), LN(2.5)]], dtype=torch.float64
    )  # w = [1, 3, .5, 2.5]
    loss, metrics = policy_loss(
        logp, old, adv, mask, rollout_logprobs=rollout, tis_threshold=2.0, is_mode=is_mode
    )
    assert loss.item() == pytest.approx(expected)
    assert metrics["is/weight_mean"].item() == pytest.approx(weight_mean)
    assert metrics["is/weight_max"].item() == pytest.approx(3.0)
    assert metrics["is/clipped_frac"].item() == pytest.approx(0.5)


def test_hand_computed_gspo():
    # row 0 log-ratios [ln 2, 0] -> s = exp(ln2 / 2) = 1.41421 > 1.28, A = +1: clipped, loss -1.28, no grad
    # row 1 log-ratios [0.1, -0.1] -> s = 1, A = +1: loss -1 per token, grad -A s = -1 on each token
    logp = torch.tensor([[LN(2.0), 0.0], [0.1, -0.1]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(2, 2, dtype=torch.float64)
    adv = torch.ones(2, dtype=torch.float64)
    loss, metrics = policy_loss(
        logp, old, adv, torch.ones(2, 2), ratio_level="sequence", agg="seq-mean-token-mean"
    )
    # (-1.28 + -1) / 2 rows = -1.14
    assert loss.item() == pytest.approx(-1.14)
    loss.backward()
    # row 1: d/dlogp of mean over 2 tokens / 2 rows = -1 / 2 / 2 = -0.25
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0], [-0.25, -0.25]], dtype=torch.float64))
    assert metrics["ratio/max"].item() == pytest.approx(math.sqrt(2))
    assert metrics["clip/high_frac"].item() == pytest.approx(0.5)


def reference_policy_loss(
    logp,
    old,
    adv_BT,
    mask,
    *,
    eps_low,
    eps_high,
    dual_clip,
    agg,
    normalizer,
    rollout,
    tis_threshold,
    is_mode,
    ratio_level,
):
    """The PPO/GRPO formulas row by row, on boolean-selected tokens."""
    rows = []
    for i in range(logp.shape[0]):
        sel = mask[i].bool()
        lp, o, a = logp[i][sel], old[i][sel], adv_BT[i][sel]
        if ratio_level == "sequence" and lp.numel():
            s = torch.exp((lp - o).mean()).detach()
            r = s * torch.exp(lp - lp.detach())
        else:
            r = torch.exp(lp - o)
        surrogate = torch.maximum(-a * r, -a * torch.clamp(r, 1 - eps_low, 1 + eps_high))
        if dual_clip is not None:
            surrogate = torch.where(a < 0, torch.minimum(surrogate, -a * dual_clip), surrogate)
        if rollout is not None:
            log_w = o - rollout[i][sel]
            if ratio_level == "sequence" and lp.numel():
                log_w = log_w.mean().expand_as(log_w)
            w = torch.exp(log_w)
            w = torch.clamp(w, max=tis_threshold) if is_mode == "truncate" else w * (w <= tis_threshold)
            surrogate = w * surrogate
        rows.append(surrogate)
    # rows hold the counted tokens in row-major order, which is the order masked_scatter fills
    per_token = torch.zeros_like(logp).masked_scatter(mask.bool(), torch.cat(rows))
    return aggregate_reference(per_token, mask, agg, normalizer)


CASES = [
    dict(),
    dict(eps_low=0.1, eps_high=0.1, agg="seq-mean-token-mean"),
    dict(dual_clip=2.5, agg="seq-mean-token-sum"),
    dict(rollout=True, tis_threshold=1.2, is_mode="truncate"),
    dict(rollout=True, tis_threshold=1.1, is_mode="mask", agg="token-sum-norm"),
    dict(ratio_level="sequence", agg="seq-mean-token-mean", eps_low=0.05, eps_high=0.05),
    dict(ratio_level="sequence", rollout=True, tis_threshold=1.05, dual_clip=1.5),
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_matches_reference(seed, case, per_token_adv):
    g = torch.Generator().manual_seed(seed)
    B, T = int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
    f64 = dict(generator=g, dtype=torch.float64)
    old = torch.randn(B, T, **f64) - 2
    logp = (old + 0.4 * torch.randn(B, T, **f64)).requires_grad_()
    adv = torch.randn(B, T, **f64) if per_token_adv else torch.randn(B, **f64)
    mask = torch.rand(B, T, generator=g) < 0.7
    rollout = old + 0.2 * torch.randn(B, T, **f64) if case.get("rollout") else None
    kw = dict(
        eps_low=0.2,
        eps_high=0.28,
        dual_clip=None,
        agg="token-mean",
        normalizer=None,
        tis_threshold=2.0,
        is_mode="truncate",
        ratio_level="token",
    )
    kw.update({k: v for k, v in case.items() if k != "rollout"})
    if kw["agg"] == "token-sum-norm":
        kw["normalizer"] = float(B * T)
    loss, _ = policy_loss(logp, old, adv, mask, rollout_logprobs=rollout, **kw)
    adv_BT = adv if per_token_adv else adv[:, None].expand(B, T)
    ref = reference_policy_loss(logp, old, adv_BT, mask, rollout=rollout, **kw)
    torch.testing.assert_close(loss, ref)
    (g_loss,) = torch.autograd.grad(loss, logp)
    (g_ref,) = torch.autograd.grad(ref, logp)
    torch.testing.assert_close(g_loss, g_ref)


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(dual_clip=3.0, agg="seq-mean-token-mean"), dict(rollout=True, agg="seq-mean-token-sum")],
)
def test_gradcheck(kw):
    torch.manual_seed(3)
    old = torch.randn(3, 5, dtype=torch.float64)
    logp = (old + 0.5 * torch.randn(3, 5, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(3, 5, dtype=torch.float64)
    mask = torch.rand(3, 5) < 0.7
    rollout = old + 0.3 * torch.randn(3, 5, dtype=torch.float64) if kw.pop("rollout", False) else None
    assert torch.autograd.gradcheck(
        lambda lp: policy_loss(lp, old, adv, mask, rollout_logprobs=rollout, **kw)[0], (logp,)
    )


def _with_garbage(x, mask, pattern):
    x = x.clone()
    x[~mask] = torch.tensor(pattern, dtype=x.dtype).repeat(x.numel())[: int((~mask).sum())]
    return x


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_masked_garbage_changes_nothing(ratio_level):
    torch.manual_seed(4)
    B, T = 4, 7
    old = torch.randn(B, T, dtype=torch.float64)
    logp = old + 0.3 * torch.randn(B, T, dtype=torch.float64)
    adv = torch.randn(B, T, dtype=torch.float64)
    rollout = old + 0.1 * torch.randn(B, T, dtype=torch.float64)
    mask = torch.rand(B, T) < 0.6
    mask[1] = False
    nan, inf = float("nan"), float("inf")
    clean_lp, dirty_lp = (
        logp.clone().requires_grad_(),
        _with_garbage(logp, mask, [nan, -inf, inf]).requires_grad_(),
    )
    kw = dict(dual_clip=3.0, ratio_level=ratio_level, agg="seq-mean-token-mean")
    clean, m_clean = policy_loss(clean_lp, old, adv, mask, rollout_logprobs=rollout, **kw)
    dirty, m_dirty = policy_loss(
        dirty_lp,
        _with_garbage(old, mask, [-inf, nan]),
        _with_garbage(adv, mask, [inf, nan, -inf]),
        mask,
        rollout_logprobs=_with_garbage(rollout, mask, [nan, inf]),
        **kw,
    )
    clean.backward()
    dirty.backward()
    torch.testing.assert_close(clean, dirty)
    torch.testing.assert_close(clean_lp.grad, dirty_lp.grad)
    for key in m_clean:
        torch.testing.assert_close(m_clean[key], m_dirty[key], msg=key)


def test_sequence_advantages_equal_broadcast_token_advantages():
    torch.manual_seed(5)
    old = torch.randn(3, 6)
    logp = old + 0.3 * torch.randn(3, 6)
    adv = torch.randn(3)
    mask = torch.rand(3, 6) < 0.7
    a, _ = policy_loss(logp, old, adv, mask)
    b, _ = policy_loss(logp, old, adv[:, None].expand(3, 6).clone(), mask)
    torch.testing.assert_close(a, b)


def test_gspo_gradient_is_the_sequence_objective_gradient():
    # GSPO: J = mean_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log r_it). Inside the clip range the
    # token form with agg seq-mean-token-mean must have exactly the gradient of -J.
    torch.manual_seed(6)
    B, T = 3, 5
    old = torch.randn(B, T, dtype=torch.float64)
    logp = (old + 0.01 * torch.randn(B, T, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(B, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:] = False
    loss, metrics = policy_loss(logp, old, adv, mask, ratio_level="sequence", agg="seq-mean-token-mean")
    assert metrics["clip/high_frac"].item() == 0 and metrics["clip/low_frac"].item() == 0
    s = torch.stack([torch.exp((logp[i][mask[i]] - old[i][mask[i]]).mean()) for i in range(B)])
    objective = -(s * adv).mean()
    torch.testing.assert_close(loss, objective)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(objective, logp)[0])


def test_degenerate_inputs_are_finite():
    lp = torch.full((2, 3), -float("inf"), requires_grad=True)
    loss, metrics = policy_loss(lp, lp.detach(), torch.zeros(2), torch.zeros(2, 3, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and (lp.grad == 0).all()
    assert metrics["ratio/mean"].item() == 1.0 and metrics["ratio/max"].item() == 1.0
    assert metrics["ratio/min"].item() == 1.0 and metrics["kl/approx"].item() == 0.0
    assert all(torch.isfinite(v) for v in metrics.values())
    empty, _ = policy_loss(torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, 4))
    assert empty.item() == 0.0


def test_agg_and_normalizer_pass_through():
    torch.manual_seed(7)
    old = torch.randn(4, 5)
    logp = old + 0.1 * torch.randn(4, 5)
    adv = torch.randn(4)
    mask = torch.rand(4, 5) < 0.8
    a, _ = policy_loss(logp, old, adv, mask, agg="token-sum-norm", normalizer=20.0)
    b, _ = policy_loss(logp, old, adv, mask, agg="token-sum-norm", normalizer=10.0)
    torch.testing.assert_close(a * 2, b)
    ratio = (logp - old).exp()
    unclipped = -adv[:, None] * ratio
    clipped = -adv[:, None] * ratio.clamp(0.8, 1.28)
    torch.testing.assert_close(
        a, aggregate_loss(torch.maximum(unclipped, clipped), mask, "token-sum-norm", normalizer=20.0)
    )


def test_errors_name_the_argument():
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    adv = torch.zeros(2)
    cases = [
        (dict(logprobs=torch.zeros(6)), "logprobs"),
        (dict(old_logprobs=torch.zeros(2, 4)), "old_logprobs"),
        (dict(advantages=torch.zeros(3)), r"advantages must have shape \[B\] = \(2,\)"),
        (dict(advantages=torch.zeros(2, 3, dtype=torch.long)), "advantages"),
        (dict(mask=torch.ones(3, 2)), "mask"),
        (dict(eps_low=1.0), "eps_low"),
        (dict(eps_high=-0.1), "eps_high"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(agg="sum"), "agg must be one of"),
        (dict(agg="token-sum-norm"), "normalizer is required"),
        (dict(is_mode="clip", rollout_logprobs=x), "is_mode"),
        (dict(ratio_level="turn"), "ratio_level"),
        (dict(rollout_logprobs=torch.zeros(2)), "rollout_logprobs"),
        (dict(rollout_logprobs=x, tis_threshold=0.0), "tis_threshold"),
    ]
    for override, pattern in cases:
        args = dict(logprobs=x, old_logprobs=x, advantages=adv, mask=m) | override
        with pytest.raises(ValueError, match=pattern):
            policy_loss(**args)


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_micro_batches_sum_to_the_whole_batch_with_a_global_normalizer(ratio_level):
    torch.manual_seed(8)
    B, T = 5, 7
    old = torch.randn(B, T, dtype=torch.float64)
    logp = (old + 0.3 * torch.randn(B, T, dtype=torch.float64)).requires_grad_()
    adv, rollout = torch.randn(B, dtype=torch.float64), old + 0.2 * torch.randn(B, T, dtype=torch.float64)
    mask = torch.rand(B, T) < 0.7
    kw = dict(agg="token-mean", normalizer=float(mask.sum()), dual_clip=2.0, ratio_level=ratio_level)
    whole, _ = policy_loss(logp, old, adv, mask, rollout_logprobs=rollout, **kw)
    parts = [slice(0, 1), slice(1, 4), slice(4, 5)]
    summed = sum(
        policy_loss(logp[s], old[s], adv[s], mask[s], rollout_logprobs=rollout[s], **kw)[0] for s in parts
    )
    torch.testing.assert_close(summed, whole)
    torch.testing.assert_close(torch.autograd.grad(summed, logp)[0], torch.autograd.grad(whole, logp)[0])
