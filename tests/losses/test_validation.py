"""Opt-in input validation (``validate=True``) and mask weights, across the losses."""

import math

import pytest
import torch

from orchard.losses import aggregate_loss, js_opd_loss, k2_opd_loss, kl_penalty, policy_loss, sft_loss

NAN, INF = float("nan"), float("inf")


def test_a_half_weight_halves_the_tokens_contribution():
    lp = torch.tensor([[-1.0, -2.0, -4.0]], requires_grad=True)
    # NLL 1, 2, 4; weights 1, 0.5, 0: 1·1 + 0.5·2 = 2 (a bool mask over the first two gives 1 + 2 = 3)
    loss, metrics = sft_loss(lp, torch.tensor([[1.0, 0.5, 0.0]]), agg="token-sum-norm", normalizer=1.0)
    assert loss.item() == pytest.approx(2.0)
    assert sft_loss(lp, torch.tensor([[True, True, False]]), agg="token-sum-norm", normalizer=1.0)[0].item() == 3.0
    loss.backward()
    assert lp.grad.tolist() == [[-1.0, -0.5, 0.0]]  # ∂(−w·logp)/∂logp = −w
    # token-mean still divides by the token count: (1 + 0.5·2) / 2 = 1; metrics are unweighted: (1 + 2) / 2
    loss, metrics = sft_loss(lp, torch.tensor([[1.0, 0.5, 0.0]]))
    assert loss.item() == pytest.approx(1.0) and metrics["sft/nll"].item() == pytest.approx(1.5)


def test_a_half_weight_in_the_policy_loss():
    zero = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, 2.0]])
    # ratio 1, so ℓ = −A = [−1, −2]; weights [1, 0.5]: −1 + 0.5·(−2) = −2 (unweighted −3)
    kw = dict(agg="token-sum-norm", normalizer=1.0)
    assert policy_loss(zero, zero, adv, torch.tensor([[1.0, 0.5]]), **kw)[0].item() == pytest.approx(-2.0)
    assert policy_loss(zero, zero, adv, torch.tensor([[1.0, 1.0]]), **kw)[0].item() == pytest.approx(-3.0)
    # aggregate_loss itself: [3, 5] with weights [2, 0.5]: (6 + 2.5) / 2 tokens = 4.25
    assert aggregate_loss(torch.tensor([[3.0, 5.0]]), torch.tensor([[2.0, 0.5]])).item() == pytest.approx(4.25)


def test_nan_at_a_counted_position_is_named_with_its_position():
    lp = torch.tensor([[-1.0, -1.0], [-1.0, NAN]])
    old = torch.full((2, 2), -1.0)
    mask = torch.ones(2, 2, dtype=torch.bool)
    # default: no sync, the NaN passes through as the loss
    assert math.isnan(policy_loss(lp, old, torch.ones(2), mask)[0].item())
    with pytest.raises(ValueError, match=r"logprobs must be finite and <= 0\.0001 .* got nan at position \(1, 1\)"):
        policy_loss(lp, old, torch.ones(2), mask, validate=True)
    # the same NaN where the mask is 0 is fine: masked positions may hold anything
    mask[1, 1] = False
    loss, _ = policy_loss(lp, old, torch.ones(2), mask, validate=True)
    assert math.isfinite(loss.item())


def test_advantages_and_logprobs_above_zero_are_refused_when_validating():
    lp = torch.full((2, 3), -1.0)
    mask = torch.ones(2, 3, dtype=torch.bool)
    # [B] advantages are checked after broadcasting: row 1's inf is first bad at (1, 0)
    with pytest.raises(ValueError, match=r"advantages must be finite at counted positions, got inf at position \(1, 0\)"):
        policy_loss(lp, lp, torch.tensor([1.0, INF]), mask, validate=True)
    old = lp.clone()
    old[0, 2] = 0.5  # log p = 0.5 means p = 1.65: not a probability
    with pytest.raises(ValueError, match=r"old_logprobs must be .*got 0\.5 at position \(0, 2\)"):
        policy_loss(lp, old, torch.ones(2), mask, validate=True)
    old[0, 2] = 5e-5  # within the 1e-4 rounding allowance (a bf16 log p of a near-certain token)
    policy_loss(lp, old, torch.ones(2), mask, validate=True)
    rollout = lp.clone()
    rollout[1, 1] = -INF
    with pytest.raises(ValueError, match=r"rollout_logprobs .* at position \(1, 1\)"):
        policy_loss(lp, lp, torch.ones(2), mask, rollout_logprobs=rollout, validate=True)


def test_every_loss_validates_its_inputs_and_mask():
    lp = torch.full((1, 2), -1.0)
    bad = torch.tensor([[-1.0, 0.3]])
    mask = torch.ones(1, 2)
    with pytest.raises(ValueError, match=r"^logprobs must be .* at position \(0, 1\)"):
        sft_loss(bad, mask, validate=True)
    with pytest.raises(ValueError, match=r"teacher_logprobs must be .*got -inf at position \(0, 0\)"):
        js_opd_loss(lp, torch.tensor([[-INF, -1.0]]), mask, validate=True)
    with pytest.raises(ValueError, match=r"student_logprobs must be .* at position \(0, 1\)"):
        k2_opd_loss(bad, lp, mask, validate=True)
    with pytest.raises(ValueError, match=r"ref_logprobs must be .* at position \(0, 1\)"):
        kl_penalty(lp, bad, mask, validate=True)
    with pytest.raises(ValueError, match=r"per_token must be finite at counted positions, got inf at position \(0, 0\)"):
        aggregate_loss(torch.tensor([[INF, 1.0]]), mask, validate=True)
    with pytest.raises(ValueError, match=r"mask must hold finite weights >= 0, got -0\.5 at position \(0, 1\)"):
        sft_loss(lp, torch.tensor([[1.0, -0.5]]), validate=True)
    with pytest.raises(ValueError, match=r"mask must hold finite weights >= 0, got nan"):
        kl_penalty(lp, lp, torch.tensor([[NAN, 1.0]]), validate=True)
