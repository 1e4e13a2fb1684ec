import pytest
import torch

from orchard.rollout.token_sampling import inverse_cdf_sample, nucleus_logprobs


def test_inverse_cdf_sample_hand_computed():
    # weights 0.5, 0.3, 0.2 -> cumulative 0.5, 0.8, 1.0; the token is the first whose cumulative sum
    # exceeds u: u 0 and 0.49 -> 0, u 0.51 and 0.79 -> 1, u 0.81 and 0.999 -> 2 (u on a boundary exactly is
    # left out: the float32 probabilities put it within ~1e-8 on either side)
    logp = torch.tensor([[0.5, 0.3, 0.2]]).log().repeat(6, 1)
    u = torch.tensor([0.0, 0.49, 0.51, 0.79, 0.81, 0.999], dtype=torch.float64)
    assert inverse_cdf_sample(logp.exp(), u).tolist() == [0, 0, 1, 1, 2, 2]
    # 300 tokens (3 blocks, the last one short), all mass on token 5 (0.25) and token 250 (0.75): u 0.2 -> 5,
    # u 0.3 -> 250, and u just below 1 still 250, never a later token of probability 0
    sparse = torch.full((3, 300), float("-inf"))
    sparse[:, 5], sparse[:, 250] = torch.tensor(0.25).log(), torch.tensor(0.75).log()
    u = torch.tensor([0.2, 0.3, 1 - 1e-12], dtype=torch.float64)
    assert inverse_cdf_sample(sparse.exp(), u).tolist() == [5, 250, 250]


@pytest.mark.parametrize(("batch", "vocab"), [(1, 1), (3, 127), (5, 128), (7, 1000), (4, 8192)])
def test_inverse_cdf_sample_equals_a_full_cumulative_sum(batch, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = 3 * torch.randn(batch, vocab, generator=gen)
    logits[:, ::3] = float("-inf") if vocab > 1 else 0.0  # tokens of probability 0, as outside a nucleus
    logp = torch.log_softmax(logits, dim=-1)
    for _ in range(20):
        u = torch.rand(batch, generator=gen, dtype=torch.float64)
        cdf = logp.double().exp().cumsum(dim=-1)  # the plain reference over the whole vocabulary
        want = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=vocab - 1)
        got = inverse_cdf_sample(logp.exp(), u)
        assert got.tolist() == want.tolist()
        assert torch.isfinite(logp.gather(1, got[:, None])).all()


def test_inverse_cdf_sample_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="weights"):
        inverse_cdf_sample(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="u must"):
        inverse_cdf_sample(torch.zeros(2, 3), torch.zeros(3))


def test_a_top_p_1_row_keeps_its_tail_beside_a_top_p_mate():
    # Token 0 holds all but ~1e-10 of the mass (logit 30, 999 tokens at 0: each e^-30 / (1 + 999 e^-30) ~ 9e-14).
    # In float32 the cumulative sum is 1.0 from token 0 on, so "mass before >= top_p" holds for every later token
    # of a top_p = 1 row too; the row beside it with top_p 0.5 makes the nucleus code run for the whole batch.
    # A top_p = 1 row keeps all 1000 tokens, with their log_softmax log-probs (~ -30); its mate keeps token 0 only.
    logits = torch.zeros(2, 1000)
    logits[:, 0] = 30.0
    logp = nucleus_logprobs(logits, torch.ones(2), torch.tensor([1.0, 0.5]))
    assert torch.isfinite(logp[0]).all()
    torch.testing.assert_close(logp[0], torch.log_softmax(logits[0], dim=-1))
    assert logp[1, 0] == 0.0 and torch.isinf(logp[1, 1:]).all()

