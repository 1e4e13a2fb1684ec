"""action_logprobs on a tiny random Qwen3 against log_softmax of the full model's logits."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import orchard.train.action_logprobs as module
from orchard.train.action_logprobs import action_logprobs, action_token_loss
from orchard.train.tiny import tiny_qwen3

VOCAB = 97  # odd, and not a multiple of the vocabulary chunks used below


def make_batch(seed, batch=3, seq=13):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[1, -3:] = 0  # right padding
    attention_mask[2, :2] = 0  # left padding
    action_mask = torch.rand(batch, seq, generator=gen) < 0.5
    action_mask[:, 0] = False
    action_mask &= attention_mask.bool()
    action_mask[0, 1:4] = True  # at least a few actions, including t = 1
    return input_ids, action_mask, attention_mask


def reference(model, input_ids, action_mask, attention_mask, temperature):
    """log_softmax of the full model's logits, shifted (token t from position t − 1) and kept at actions."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # [B, T, V]
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)[:, :-1]  # [B, T − 1, V]
    picked = logp_all.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, T − 1]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [B, T − 1]
    keep = action_mask[:, 1:]
    zero = torch.zeros(input_ids.shape[0], 1, dtype=torch.float64)
    return (
        torch.cat([zero, torch.where(keep, picked, 0.0)], dim=1),
        torch.cat([zero, torch.where(keep, entropy, 0.0)], dim=1),
    )


def param_grads(model, total):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(total, params, allow_unused=True)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_full_logits_reference_with_gradients(tied, temperature):
    model = tiny_qwen3(VOCAB, seed=1, tie_word_embeddings=tied)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    input_ids, action_mask, attention_mask = make_batch(seed=2)
    logp, ent = action_logprobs(
        model, input_ids, action_mask, attention_mask=attention_mask, temperature=temperature,
        return_entropy=True, chunk_size=5, vocab_chunk_size=16,
    )
    ref_logp, ref_ent = reference(model, input_ids, action_mask, attention_mask, temperature)
    assert logp.shape == ent.shape == input_ids.shape and logp.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref_logp, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=0)
    assert torch.equal(logp[~action_mask], torch.zeros(int((~action_mask).sum())))

    # gradients of a random linear functional of both outputs, for every parameter (tied ones included)
    gen = torch.Generator().manual_seed(3)
    coef_lp, coef_ent = torch.randn(2, *input_ids.shape, generator=gen, dtype=torch.float64)
    got = param_grads(model, (logp.double() * coef_lp + ent.double() * coef_ent).sum())
    want = param_grads(model, (ref_logp * coef_lp + ref_ent * coef_ent).sum())
    for (name, _), g, w in zip(model.named_parameters(), got, want, strict=True):
        assert (g is None) == (w is None), name
        if w is not None:
            torch.testing.assert_close(g, w, atol=1e-4 * w.abs().max().item() + 1e-7, rtol=0, msg=name)


def test_lm_head_with_bias_is_used():
    model = tiny_qwen3(VOCAB, seed=4, tie_word_embeddings=False)
    old = model.lm_head
    model.lm_head = nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        model.lm_head.weight.copy_(old.weight)
        model.lm_head.bias.normal_(0.0, 1.0)
    input_ids, action_mask, attention_mask = make_batch(seed=5)
    logp = action_logprobs(model, input_ids, action_mask, attention_mask=attention_mask, vocab_chunk_size=10)
    ref_logp, _ = reference(model, input_ids, action_mask, attention_mask, 1.0)
    torch.testing.assert_close(logp.double(), ref_logp, atol=2e-5, rtol=0)
    (grad_bias,) = torch.autograd.grad(logp.sum(), model.lm_head.bias)
    # Σ over actions of (onehot(y) − p): each action row sums to 1 − 1 = 0, so the bias gradient sums to 0
    assert abs(grad_bias.sum().item()) < 1e-4 and grad_bias.abs().max().item() > 1e-3


def test_only_action_positions_reach_the_lm_head(monkeypatch):
    model = tiny_qwen3(VOCAB, seed=6)
    input_ids, action_mask, attention_mask = make_batch(seed=7)
    seen = []

    def recording(hidden, weight, labels, **kwargs):
        seen.append(hidden.shape[0])
        return module.fused_token_logprobs.__wrapped__(hidden, weight, labels, **kwargs)

    recording.__wrapped__ = module.fused_token_logprobs
    monkeypatch.setattr(module, "fused_token_logprobs", recording)
    clean = action_logprobs(model, input_ids, action_mask, attention_mask=attention_mask)
    assert seen == [int(action_mask.sum())]

    # poison the final hidden state of every position that does not predict an action: the lm head would
    # turn any of them into NaN log-probs, so finite, unchanged output proves they were never scored
    predicts_action = torch.zeros_like(action_mask)
    predicts_action[:, :-1] = action_mask[:, 1:]

    def poison(_module, _args, output):
        output.last_hidden_state = output.last_hidden_state.masked_fill(~predicts_action.unsqueeze(-1), float("nan"))
        return output

    handle = model.get_decoder().register_forward_hook(poison)
    try:
        poisoned = action_logprobs(model, input_ids, action_mask, attention_mask=attention_mask)
        full_logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    finally:
        handle.remove()
    assert torch.isnan(full_logits[~predicts_action]).all()  # the poison does reach the plain lm-head path
    assert torch.isfinite(poisoned).all()
    torch.testing.assert_close(poisoned, clean, atol=0, rtol=0)


def test_row_without_actions_is_zero_and_backward_still_runs():
    model = tiny_qwen3(VOCAB, seed=10)
    input_ids, _, attention_mask = make_batch(seed=11)
    action_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    logp, ent = action_logprobs(model, input_ids, action_mask, attention_mask=attention_mask, return_entropy=True)
    assert torch.equal(logp, torch.zeros(3, 13)) and torch.equal(ent, torch.zeros(3, 13))
    (logp.sum() + ent.sum()).backward()  # a graph exists; every gradient is zero
    assert all(p.grad is None or torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


def test_batched_equals_row_by_row():
    # micro-batching invariance: scoring rows separately gives the same numbers (no padding involved)
    model = tiny_qwen3(VOCAB, seed=12)
    input_ids, action_mask, _ = make_batch(seed=13)
    together = action_logprobs(model, input_ids, action_mask)
    for b in range(3):
        alone = action_logprobs(model, input_ids[b : b + 1], action_mask[b : b + 1])
        torch.testing.assert_close(alone[0], together[b], atol=1e-5, rtol=0)


def test_partitioned_head_weight_is_refused():
    model = tiny_qwen3(VOCAB, seed=14, tie_word_embeddings=False)
    model.lm_head.weight = nn.Parameter(torch.empty(0))  # what a ZeRO-3 parameter looks like outside a gather
    input_ids, action_mask, _ = make_batch(seed=15)
    with pytest.raises(ValueError, match="GatheredParameters"):
        action_logprobs(model, input_ids, action_mask)


def test_softcapped_logits_are_refused():
    model = tiny_qwen3(VOCAB, seed=16)
    model.config.final_logit_softcapping = 30.0
    input_ids, action_mask, _ = make_batch(seed=17)
    with pytest.raises(ValueError, match=re.escape("final_logit_softcapping=30.0")):
        action_logprobs(model, input_ids, action_mask)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (dict(input_ids=torch.zeros(4, dtype=torch.long)), "input_ids must be a [B, T] tensor, got (4,)"),
        (dict(input_ids=torch.zeros(2, 5)), "input_ids must be an integer tensor"),
        (dict(action_mask=torch.zeros(2, 4, dtype=torch.bool)), "action_mask must have the shape of input_ids (2, 5)"),
        (dict(attention_mask=torch.ones(2, 4)), "attention_mask must have the shape of input_ids"),
        (dict(action_mask=torch.tensor([[1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])), "action_mask must be false at t = 0"),
        (
            dict(action_mask=torch.tensor([[0, 0, 0, 0, 1], [0, 0, 0, 0, 0]]),
                 attention_mask=torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])),
            "action_mask must be false wherever attention_mask is 0",
        ),
        (dict(model=nn.Linear(2, 2)), "model must be an HF causal LM with a backbone"),
        (dict(temperature=-1.0), "temperature must be a positive finite number"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(change, needle):
    args = dict(model=tiny_qwen3(VOCAB, seed=18), input_ids=torch.zeros(2, 5, dtype=torch.long),
                action_mask=torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 1, 1]]))
    args.update(change)
    with pytest.raises(ValueError) as info:
        action_logprobs(args.pop("model"), args.pop("input_ids"), args.pop("action_mask"), **args)
    assert needle in str(info.value)


@pytest.mark.parametrize(("tied", "temperature"), [(True, 1.0), (False, 0.7)])
def test_action_token_loss_matches_the_full_logits_reference(tied, temperature):
    # a clipped policy loss with an entropy bonus, side inputs [B, T] read by the flat positions b·T + t
    model = tiny_qwen3(VOCAB, seed=20, tie_word_embeddings=tied)
    input_ids, action_mask, attention_mask = make_batch(seed=21)
    gen = torch.Generator().manual_seed(22)
    old_logprobs = -3.0 + 0.5 * torch.randn(input_ids.shape, generator=gen)
    advantages = torch.randn(input_ids.shape, generator=gen)
    seen = torch.zeros(input_ids.numel(), dtype=torch.long)

    def token_loss(logp, entropy, index):
        seen[index] += 1
        ratio = (logp - old_logprobs.reshape(-1)[index]).exp()
        adv = advantages.reshape(-1)[index]
        return torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28)) - 0.1 * entropy

    loss = action_token_loss(model, input_ids, action_mask, token_loss, attention_mask=attention_mask,
                             temperature=temperature, need_entropy=True, chunk_size=4)
    got = param_grads(model, loss)
    assert torch.equal(seen.view(input_ids.shape), action_mask.long())  # every action token once, nothing else

    ref_logp, ref_ent = reference(model, input_ids, action_mask, attention_mask, temperature)
    ratio = (ref_logp - old_logprobs.double()).exp()
    adv = advantages.double()
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28)) - 0.1 * ref_ent  # [B, T]
    ref_loss = per_token[action_mask].sum()
    want = param_grads(model, ref_loss)
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-4, rtol=1e-5)
    for (name, _), g, w in zip(model.named_parameters(), got, want, strict=True):
        assert (g is None) == (w is None), name
        if w is not None:
            torch.testing.assert_close(g, w, atol=1e-4 * w.abs().max().item() + 1e-7, rtol=0, msg=name)


def test_action_token_loss_without_actions_is_zero_and_refuses_a_non_callable_loss():
    model = tiny_qwen3(VOCAB, seed=23)
    input_ids, _, attention_mask = make_batch(seed=24)
    none = torch.zeros_like(input_ids, dtype=torch.bool)
    loss = action_token_loss(model, input_ids, none, lambda lp, e, i: -lp, attention_mask=attention_mask)
    assert loss.item() == 0.0
    loss.backward()
    assert all(p.grad is None or torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    with pytest.raises(ValueError, match="token_loss must be callable"):
        action_token_loss(model, input_ids, none, "nll")
