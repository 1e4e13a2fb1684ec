"""aggregate_loss: hand-computed modes, a reference, masked garbage, micro-batch invariance, registry."""

import pytest
import torch

from orchard.losses import AGG_MODES, aggregate_loss

from ._reference import aggregate_reference as reference

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum-norm"]


def test_modes_registered():
    assert AGG_MODES.names()[:4] == MODES


def test_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # counted: row 0 -> 1, 2; row 1 -> 4
    assert aggregate_loss(x, m, "token-mean").item() == pytest.approx(7 / 3)  # (1+2+4)/3
    assert aggregate_loss(x, m, "seq-mean-token-mean").item() == pytest.approx(2.75)  # (1.5 + 4)/2
    assert aggregate_loss(x, m, "seq-mean-token-sum").item() == pytest.approx(3.5)  # (3 + 4)/2
    assert aggregate_loss(x, m, "token-sum-norm", normalizer=6).item() == pytest.approx(7 / 6)  # 7 / (2*3)
    assert aggregate_loss(x, m, "token-mean", normalizer=10).item() == pytest.approx(0.7)  # 7 / 10


def test_empty_row_does_not_dilute_seq_means():
    x = torch.tensor([[2.0, 4.0], [9.0, 9.0]])
    m = torch.tensor([[1, 1], [0, 0]])
    # only row 0 counts: mean 3, sum 6
    assert aggregate_loss(x, m, "seq-mean-token-mean").item() == pytest.approx(3.0)
    assert aggregate_loss(x, m, "seq-mean-token-sum").item() == pytest.approx(6.0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", MODES)
def test_matches_reference_value_and_grad(seed, mode):
    g = torch.Generator().manual_seed(seed)
    B, T = int(torch.randint(1, 8, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
    x = torch.randn(B, T, generator=g, dtype=torch.float64, requires_grad=True)
    m = torch.rand(B, T, generator=g) < 0.6
    z = 7.0 if mode == "token-sum-norm" else None
    out = aggregate_loss(x, m, mode, normalizer=z)
    ref = reference(x, m, mode, z)
    torch.testing.assert_close(out, ref)
    (g_out,) = torch.autograd.grad(out, x)
    (g_ref,) = torch.autograd.grad(ref, x)
    torch.testing.assert_close(g_out, g_ref)


@pytest.mark.parametrize("mode", MODES)
def test_gradcheck(mode):
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    m = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    z = 4.0 if mode == "token-sum-norm" else None
    assert torch.autograd.gradcheck(lambda t: aggregate_loss(t, m, mode, normalizer=z), (x,))


@pytest.mark.parametrize("mode", MODES)
def test_masked_garbage_changes_nothing(mode):
    torch.manual_seed(0)
    x = torch.randn(4, 7, dtype=torch.float64)
    m = torch.rand(4, 7) < 0.5
    m[0] = False
    garbage = x.clone()
    garbage[~m] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=torch.float64).repeat(64)[
        : int((~m).sum())
    ]
    z = 9.0 if mode == "token-sum-norm" else None
    a, b = x.clone().requires_grad_(), garbage.clone().requires_grad_()
    la, lb = aggregate_loss(a, m, mode, normalizer=z), aggregate_loss(b, m, mode, normalizer=z)
    la.backward()
    lb.backward()
    assert torch.isfinite(lb)
    torch.testing.assert_close(la, lb)
    torch.testing.assert_close(a.grad, b.grad)
    assert (b.grad[~m] == 0).all()


@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_invariance_with_global_normalizer(mode):
    torch.manual_seed(1)
    B, T = 7, 9
    x = torch.randn(B, T, dtype=torch.float64, requires_grad=True)
    m = torch.rand(B, T) < 0.6
    m[3] = False  # an empty row
    if mode == "token-mean":
        z = float(m.sum())
    elif mode.startswith("seq-mean"):
        z = float((m.sum(-1) > 0).sum())
    else:
        z = float(B * T)
    whole = aggregate_loss(x, m, mode, normalizer=z)
    (g_whole,) = torch.autograd.grad(whole, x)
    parts = [slice(0, 2), slice(2, 3), slice(3, 7)]  # uneven micro-batches
    summed = sum(aggregate_loss(x[s], m[s], mode, normalizer=z) for s in parts)
    (g_parts,) = torch.autograd.grad(summed, x)
    torch.testing.assert_close(summed, whole)
    torch.testing.assert_close(g_parts, g_whole)
    if mode == "token-mean":
        # without the global normaliser each micro-batch divides by its own count, and the sum differs
        local = sum(aggregate_loss(x[s], m[s], mode) for s in parts)
        assert not torch.allclose(local, whole)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_empty_mask_is_zero_with_zero_grad(mode):
    x = torch.full((2, 3), float("nan"), requires_grad=True)
    out = aggregate_loss(x, torch.zeros(2, 3, dtype=torch.bool), mode)
    out.backward()
    assert out.item() == 0.0
    assert (x.grad == 0).all()


def test_zero_sized_batch():
    x = torch.zeros(0, 5, requires_grad=True)
    assert aggregate_loss(x, torch.zeros(0, 5), "token-mean").item() == 0.0


def test_tensor_normalizer_accepted():
    x = torch.ones(2, 2)
    assert aggregate_loss(x, torch.ones(2, 2), "token-sum-norm", normalizer=torch.tensor(8.0)).item() == 0.5


def test_errors_name_the_argument():
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="per_token"):
        aggregate_loss(torch.zeros(6), torch.ones(6))
    with pytest.raises(ValueError, match="per_token"):
        aggregate_loss(torch.zeros(2, 3, dtype=torch.long), m)
    with pytest.raises(ValueError, match=r"mask .*\(2, 3\).*\(3, 2\)"):
        aggregate_loss(x, torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"agg must be one of.*token-mean.*got 'mean'"):
        aggregate_loss(x, m, "mean")
    with pytest.raises(ValueError, match="normalizer is required"):
        aggregate_loss(x, m, "token-sum-norm")
    for bad in (0, -1.0, float("nan"), float("inf"), True, "3"):
        with pytest.raises(ValueError, match="normalizer"):
            aggregate_loss(x, m, "token-mean", normalizer=bad)
    with pytest.raises(ValueError, match="normalizer must be a scalar"):
        aggregate_loss(x, m, "token-mean", normalizer=torch.ones(2))


def test_registry_rejects_duplicates_and_accepts_new_modes():
    with pytest.raises(ValueError, match="already registered"):
        AGG_MODES.register("token-mean", lambda x, m, z: x.sum())
    name = "test-token-max"
    if name not in AGG_MODES:
        AGG_MODES.register(name, lambda x, m, z: x.max())
    assert aggregate_loss(torch.tensor([[1.0, 5.0]]), torch.tensor([[1, 0]]), name).item() == 1.0  # 5 masked
