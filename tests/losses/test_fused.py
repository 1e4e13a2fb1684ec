"""fused_token_logprobs against a float64 log_softmax reference, plus gradcheck, invariances and memory shape."""

from __future__ import annotations

import math

import pytest
import torch

from orchard.losses import token_logprobs
from orchard.losses.fused import fused_token_logprobs

from ._reference import LargestTensor, lm_head_inputs, lm_head_reference

# Tolerances per input dtype. bf16 rounds each logit to 8 significant bits: with |z| ≲ 4 that is up to
# 4 × 2⁻⁸ ≈ 0.016 on a label logit, and the log-sum-exp moves by a p-weighted mean of such errors.
FORWARD_ATOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 4e-2}
GRAD_RTOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 4e-2}  # relative to the largest grad


def grads_of(outputs, leaves, coefs):
    """Gradients of Σ_k coef_k · output_k, a random linear functional that exercises every upstream grad."""
    total = sum((out.double() * c).sum() for out, c in zip(outputs, coefs, strict=True))
    return torch.autograd.grad(total, leaves)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    ("n", "v", "h", "chunk", "vchunk", "temperature", "bias"),
    [
        (37, 101, 13, 8, 16, 1.0, False),  # odd sizes, chunks that do not divide N or V
        (37, 101, 13, 8, 16, 0.7, True),
        (5, 7, 3, 64, 64, 1.3, True),  # one block holds everything
        (64, 33, 17, 1, 1, 2.0, False),  # one token × one vocab entry per block
        (50, 257, 24, 17, 50, 0.6, True),
    ],
)
def test_matches_float64_reference_forward_and_grads(dtype, n, v, h, chunk, vchunk, temperature, bias):
    for seed in range(2):
        leaves, labels, _ = lm_head_inputs(n, v, h, dtype, seed=seed, bias=bias, scale=2.0)
        kwargs = dict(bias=leaves[2] if bias else None, temperature=temperature)
        logp, ent = fused_token_logprobs(
            leaves[0],
            leaves[1],
            labels,
            chunk_size=chunk,
            vocab_chunk_size=vchunk,
            return_entropy=True,
            **kwargs,
        )
        assert logp.dtype == ent.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
        ref_logp, ref_ent = lm_head_reference(ref_leaves, labels, temperature)
        atol = FORWARD_ATOL[dtype]
        torch.testing.assert_close(logp.double(), ref_logp, atol=atol, rtol=0)
        torch.testing.assert_close(ent.double(), ref_ent, atol=atol, rtol=0)

        gen = torch.Generator().manual_seed(100 + seed)
        coefs = [torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(2)]
        got = grads_of([logp, ent], leaves, coefs)
        want = grads_of([ref_logp, ref_ent], ref_leaves, coefs)
        for g, w, leaf in zip(got, want, leaves, strict=True):
            assert g.dtype == leaf.dtype and g.shape == leaf.shape
            scale = w.abs().max().item()
            torch.testing.assert_close(g.double(), w, atol=GRAD_RTOL[dtype] * scale, rtol=0)


@pytest.mark.parametrize(("use_logp", "use_entropy"), [(True, True), (True, False), (False, True)])
def test_each_output_alone_gets_its_own_gradient(use_logp, use_entropy):
    # the backward sees None for an unused output; each combination must still match the reference
    leaves, labels, _ = lm_head_inputs(23, 41, 7, torch.float64, seed=3, bias=True)
    logp, ent = fused_token_logprobs(
        leaves[0],
        leaves[1],
        labels,
        bias=leaves[2],
        temperature=0.9,
        chunk_size=5,
        vocab_chunk_size=9,
        return_entropy=True,
    )
    ref_leaves = [t.detach().requires_grad_() for t in leaves]
    ref_logp, ref_ent = lm_head_reference(ref_leaves, labels, 0.9)
    pick = [use_logp, use_entropy]
    got = torch.autograd.grad(sum(o.sum() for o, k in zip([logp, ent], pick, strict=True) if k), leaves)
    want = torch.autograd.grad(
        sum(o.sum() for o, k in zip([ref_logp, ref_ent], pick, strict=True) if k), ref_leaves
    )
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=0)


def test_gradcheck_float64_with_entropy_bias_and_temperature():
    leaves, labels, _ = lm_head_inputs(5, 7, 3, torch.float64, seed=0, bias=True, scale=3.0)

    def fn(hidden, weight, bias):
        return fused_token_logprobs(
            hidden,
            weight,
            labels,
            bias=bias,
            temperature=1.3,
            chunk_size=2,
            vocab_chunk_size=3,
            return_entropy=True,
        )

    assert torch.autograd.gradcheck(fn, tuple(leaves))


def test_gradcheck_float64_logprobs_only_no_bias():
    leaves, labels, _ = lm_head_inputs(4, 6, 5, torch.float64, seed=1)

    def fn(hidden, weight):
        return fused_token_logprobs(hidden, weight, labels, temperature=0.5, chunk_size=3, vocab_chunk_size=4)

    assert torch.autograd.gradcheck(fn, tuple(leaves))


def test_hand_computed_two_token_case():
    # z = h @ W.T: token 0 → [1, 0, 0], token 1 → [0, 2, 0] (W picks coordinates; the third row is zero)
    hidden = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    labels = torch.tensor([0, 2])
    logp, ent = fused_token_logprobs(hidden, weight, labels, vocab_chunk_size=2, return_entropy=True)
    # token 0: lse = log(e + 2) = log 4.718282 = 1.551445; logp = 1 − 1.551445 = −0.551445
    #   H = lse − Σ p z = 1.551445 − e/(e + 2) = 1.551445 − 0.576117 = 0.975328
    # token 1: lse = log(e² + 2) = log 9.389056 = 2.239545; logp = 0 − 2.239545 = −2.239545
    #   H = 2.239545 − 2e²/(e² + 2) = 2.239545 − 14.778112/9.389056 = 2.239545 − 1.573972 = 0.665573
    torch.testing.assert_close(logp, torch.tensor([-0.551445, -2.239545]), atol=2e-6, rtol=0)
    torch.testing.assert_close(ent, torch.tensor([0.975328, 0.665573]), atol=2e-6, rtol=0)


def test_uniform_logits_give_log_v_entropy_and_zero_weight_gradient_mean():
    # all-zero hidden states: z = 0, p = 1/V, logp = −log V, H = log V for every token
    v = 11
    hidden = torch.zeros(4, 3, requires_grad=True)
    weight = torch.randn(v, 3, requires_grad=True)
    logp, ent = fused_token_logprobs(
        hidden, weight, torch.tensor([0, 3, 10, 3]), vocab_chunk_size=4, return_entropy=True
    )
    torch.testing.assert_close(logp, torch.full((4,), -math.log(v)))
    torch.testing.assert_close(ent, torch.full((4,), math.log(v)))
    # ∂(Σ logp)/∂h_i = W_{y_i} − mean_j W_j at uniform p
    logp.sum().backward()
    expected = weight.detach()[[0, 3, 10, 3]] - weight.detach().mean(0)
    torch.testing.assert_close(hidden.grad, expected, atol=1e-6, rtol=0)


def test_chunk_sizes_do_not_change_the_result():
    leaves, labels, _ = lm_head_inputs(45, 130, 9, torch.float32, seed=7, bias=True, scale=3.0)
    results = []
    for chunk, vchunk in [(1, 1), (4, 7), (45, 130), (1000, 1000), (16, 64)]:
        logp, ent = fused_token_logprobs(
            leaves[0],
            leaves[1],
            labels,
            bias=leaves[2],
            chunk_size=chunk,
            vocab_chunk_size=vchunk,
            return_entropy=True,
        )
        grads = torch.autograd.grad((logp - 0.3 * ent).sum(), leaves)
        results.append((logp, ent, *grads))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def test_large_logits_stay_finite_and_exact():
    # logits in the thousands: a naive exp would overflow; the running max keeps every term <= 1
    leaves, labels, _ = lm_head_inputs(19, 67, 6, torch.float64, seed=4, scale=2000.0)
    logp, ent = fused_token_logprobs(*leaves, labels, chunk_size=4, vocab_chunk_size=8, return_entropy=True)
    ref_logp, ref_ent = lm_head_reference([t.detach() for t in leaves], labels)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    torch.testing.assert_close(logp, ref_logp, atol=1e-9, rtol=1e-12)
    torch.testing.assert_close(ent, ref_ent, atol=1e-9, rtol=0)


def test_tied_weight_used_twice_accumulates_both_gradients():
    # a tied head: the same matrix embeds the inputs and scores the outputs
    gen = torch.Generator().manual_seed(5)
    v, h, n = 29, 8, 21
    table = (torch.randn(v, h, generator=gen, dtype=torch.float64) * 0.5).requires_grad_()
    mix = torch.randn(h, h, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, v, (n,), generator=gen)
    labels = torch.randint(0, v, (n,), generator=gen)

    def loss(fn):
        hidden = torch.tanh(table[ids] @ mix)  # [n, h], depends on the table too
        logp, ent = fn(hidden, table)
        return (logp + 0.5 * ent).sum()

    fused = loss(
        lambda hd, w: fused_token_logprobs(
            hd, w, labels, chunk_size=4, vocab_chunk_size=5, return_entropy=True
        )
    )
    (got,) = torch.autograd.grad(fused, table)
    (want,) = torch.autograd.grad(loss(lambda hd, w: lm_head_reference([hd, w], labels)), table)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def test_empty_batch_and_single_entry_vocabulary():
    hidden = torch.zeros(0, 4, requires_grad=True)
    weight = torch.randn(6, 4, requires_grad=True)
    logp, ent = fused_token_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long), return_entropy=True)
    assert logp.shape == ent.shape == (0,)
    (logp.sum() + ent.sum()).backward()
    assert hidden.grad.shape == (0, 4) and torch.equal(weight.grad, torch.zeros(6, 4))

    # V = 1: the only token has probability 1, so logp = 0, H = 0 and nothing moves
    hidden = torch.randn(3, 4, requires_grad=True)
    weight = torch.randn(1, 4, requires_grad=True)
    logp, ent = fused_token_logprobs(hidden, weight, torch.zeros(3, dtype=torch.long), return_entropy=True)
    assert torch.equal(logp, torch.zeros(3)) and torch.equal(ent, torch.zeros(3))
    (logp.sum() + ent.sum()).backward()
    assert torch.equal(hidden.grad, torch.zeros(3, 4))


def test_ignored_rows_give_zero_and_leave_the_rest_unchanged():
    leaves, labels, _ = lm_head_inputs(17, 40, 6, torch.float64, seed=11, bias=True)
    ignored = torch.tensor([0, 5, 6, 16])
    masked = labels.clone()
    masked[ignored] = -100
    logp, ent = fused_token_logprobs(leaves[0], leaves[1], masked, bias=leaves[2], chunk_size=4,
                                     vocab_chunk_size=7, return_entropy=True)
    assert torch.equal(logp[ignored], torch.zeros(4)) and torch.equal(ent[ignored], torch.zeros(4))
    keep = masked != -100
    ref_leaves = [t.detach().requires_grad_() for t in leaves]
    ref_logp, ref_ent = lm_head_reference(ref_leaves, labels)
    torch.testing.assert_close(logp[keep], ref_logp[keep], atol=1e-12, rtol=0)
    torch.testing.assert_close(ent[keep], ref_ent[keep], atol=1e-12, rtol=0)
    # the gradient is that of the kept rows alone; the ignored rows' hidden states get exactly zero
    got = torch.autograd.grad((logp + ent).sum(), leaves)
    want = torch.autograd.grad((ref_logp + ref_ent)[keep].sum(), ref_leaves)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=0)
    assert torch.equal(got[0][ignored], torch.zeros(4, 6, dtype=torch.float64))


@pytest.mark.parametrize("label_dtype", [torch.int32, torch.uint8, torch.int16])
def test_any_integer_label_dtype_gives_the_int64_result(label_dtype):
    leaves, labels, _ = lm_head_inputs(11, 30, 4, torch.float64, seed=13)
    want_logp, want_ent = fused_token_logprobs(*leaves, labels, vocab_chunk_size=7, return_entropy=True)
    want = torch.autograd.grad((want_logp + want_ent).sum(), leaves)
    logp, ent = fused_token_logprobs(*leaves, labels.to(label_dtype), vocab_chunk_size=7, return_entropy=True)
    got = torch.autograd.grad((logp + ent).sum(), leaves)
    assert torch.equal(logp, want_logp) and torch.equal(ent, want_ent)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_frozen_head_gets_no_gradient_and_hidden_still_does():
    leaves, labels, _ = lm_head_inputs(9, 20, 5, torch.float64, seed=8)
    weight = leaves[1].detach()
    logp = fused_token_logprobs(leaves[0], weight, labels, chunk_size=4, vocab_chunk_size=6)
    (grad,) = torch.autograd.grad(logp.sum(), leaves[0])
    ref_h = leaves[0].detach().requires_grad_()
    (want,) = torch.autograd.grad(lm_head_reference([ref_h, weight], labels)[0].sum(), ref_h)
    torch.testing.assert_close(grad, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_token_by_vocabulary_tensor_is_ever_built(dtype):
    n, v, h, chunk, vchunk = 96, 160, 4, 16, 32
    leaves, labels, _ = lm_head_inputs(n, v, h, dtype, seed=9, bias=True)
    with LargestTensor() as mode:
        logp, ent = fused_token_logprobs(
            leaves[0],
            leaves[1],
            labels,
            bias=leaves[2],
            chunk_size=chunk,
            vocab_chunk_size=vchunk,
            return_entropy=True,
        )
        (logp + ent).sum().backward()
    # the largest things alive are one block (16 × 32 = 512) and the [V, H] / [T, H] gradients (640, 384)
    assert mode.largest == max(chunk * vchunk, v * h, n * h)
    assert mode.largest < n * v // 10


def test_agrees_with_plain_token_logprobs():
    leaves, labels, _ = lm_head_inputs(31, 77, 10, torch.float32, seed=10)
    logits = leaves[0].detach() @ leaves[1].detach().T
    plain_logp, plain_ent = token_logprobs(logits, labels, temperature=0.8, return_entropy=True)
    logp, ent = fused_token_logprobs(
        leaves[0], leaves[1], labels, temperature=0.8, chunk_size=7, vocab_chunk_size=20, return_entropy=True
    )
    torch.testing.assert_close(logp, plain_logp.float(), atol=2e-5, rtol=0)
    torch.testing.assert_close(ent, plain_ent.float(), atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(hidden=torch.zeros(2, 3, 4)), "hidden must have shape [T, H]"),
        (dict(hidden=[[0.0]]), "hidden must be a torch.Tensor"),
        (dict(weight=torch.zeros(5)), "weight must have shape [V, H]"),
        (dict(weight=torch.zeros(5, 3)), "weight must have shape [V, H] with H = hidden.shape[1] = 4"),
        (dict(weight=torch.zeros(0, 4)), "weight must have at least one vocabulary row"),
        (dict(weight=torch.zeros(5, 4, dtype=torch.float64)), "weight must have the dtype of hidden"),
        (
            dict(hidden=torch.zeros(3, 4, dtype=torch.int64), weight=torch.zeros(5, 4, dtype=torch.int64)),
            "hidden must be float16, bfloat16, float32 or float64",
        ),
        (
            dict(labels=torch.zeros(2, dtype=torch.long)),
            "labels must have shape [T] with T = hidden.shape[0] = 3",
        ),
        (dict(labels=torch.zeros(3, 1, dtype=torch.long)), "labels must have shape [T]"),
        (dict(labels=torch.zeros(3)), "labels must be an integer tensor"),
        (dict(labels=torch.tensor([0, 5, 1])), "or equal ignore_index=-100, got values such as [5]"),
        (dict(labels=torch.tensor([0, -7, 1])), "labels must lie in [0, V) = [0, 5) or equal ignore_index=-100"),
        (dict(labels=torch.tensor([0, -100, 1]), ignore_index=-1), "got values such as [-100]"),
        (dict(ignore_index=None), "ignore_index must be an int"),
        (dict(bias=torch.zeros(4)), "bias must have shape [V] = (5,)"),
        (dict(bias=torch.zeros(5, dtype=torch.float64)), "bias must match weight's dtype"),
        (dict(temperature=0.0), "temperature must be a positive finite number, got 0.0"),
        (dict(temperature=float("inf")), "temperature must be a positive finite number"),
        (dict(temperature=True), "temperature must be a positive finite number"),
        (dict(chunk_size=0), "chunk_size must be a positive int, got 0"),
        (dict(vocab_chunk_size=2.5), "vocab_chunk_size must be a positive int, got 2.5"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(kwargs, needle):
    args = dict(hidden=torch.zeros(3, 4), weight=torch.zeros(5, 4), labels=torch.zeros(3, dtype=torch.long))
    args.update(kwargs)
    positional = [args.pop("hidden"), args.pop("weight"), args.pop("labels")]
    with pytest.raises(ValueError) as info:
        fused_token_logprobs(*positional, **args)
    assert needle in str(info.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run by benchmarks/gpu_check.sh)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_reference_without_a_full_logits_allocation(dtype):
    n, v, h = 1000, 20_011, 64
    leaves, labels, _ = lm_head_inputs(n, v, h, dtype, seed=12, bias=True, scale=2.0)
    cuda_leaves = [t.detach().cuda().requires_grad_() for t in leaves]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logp, ent = fused_token_logprobs(cuda_leaves[0], cuda_leaves[1], labels.cuda(), bias=cuda_leaves[2],
                                     temperature=0.9, chunk_size=256, vocab_chunk_size=2048, return_entropy=True)
    got = torch.autograd.grad((logp - 0.5 * ent).sum(), cuda_leaves)
    torch.cuda.synchronize()
    # the full float32 logits would be n × v × 4 B = 80 MB; blocks are 256 × 2048 × 4 B = 2 MB
    assert torch.cuda.max_memory_allocated() - base < n * v * 4 // 4
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_logp, ref_ent = lm_head_reference(ref_leaves, labels, 0.9)
    want = torch.autograd.grad((ref_logp - 0.5 * ref_ent).sum(), ref_leaves)
    atol = FORWARD_ATOL[dtype]
    torch.testing.assert_close(logp.double().cpu(), ref_logp, atol=atol, rtol=0)
    torch.testing.assert_close(ent.double().cpu(), ref_ent, atol=atol, rtol=0)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double().cpu(), w, atol=GRAD_RTOL[dtype] * w.abs().max().item(), rtol=0)
