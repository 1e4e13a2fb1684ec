"""Decision steps read at their last token, and value reranking against random choice and the oracle."""

from __future__ import annotations

import pytest
import torch

from orchard.value import gather_step_values, rerank, rerank_report, step_end_positions


def test_step_end_positions_skip_environment_tokens() -> None:
    # Row 0: system/user (-1), step 0 at 2..3, tool output (-1) at 4..5, step 1 at 6..7, padding.
    # Row 1: only step 0 at 1; step 1 absent (masked).
    ti = torch.tensor([[-1, -1, 0, 0, -1, -1, 1, 1, -1], [-1, 0, -1, -1, -1, -1, -1, -1, -1]])
    pos, mask = step_end_positions(ti)
    assert pos.tolist() == [[3, 7], [1, 0]]
    assert mask.tolist() == [[True, True], [True, False]]
    token_values = torch.arange(18, dtype=torch.float32).reshape(2, 9)
    vals, m2 = gather_step_values(token_values, ti)
    assert vals.tolist() == [[3.0, 7.0], [10.0, 0.0]] and torch.equal(m2, mask)


def test_step_gap_is_a_hole() -> None:
    ti = torch.tensor([[0, -1, 2, 2]])
    pos, mask = step_end_positions(ti)
    assert pos.tolist() == [[0, 0, 3]] and mask.tolist() == [[True, False, True]]


def test_steps_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="turn_index"):
        step_end_positions(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="turn_index"):
        step_end_positions(torch.zeros(2, 3))


def test_rerank_argmax_ties_and_invalid() -> None:
    v = torch.tensor([[0.1, 0.9, 0.9], [float("nan"), 0.2, -1.0], [3.0, 4.0, 5.0]])
    m = torch.tensor([[True, True, True], [True, True, True], [False, False, False]])
    assert rerank(v, m).tolist() == [1, 1, -1]  # tie -> lower index; NaN never chosen; nothing valid -> -1
    assert rerank(torch.zeros(2, 0)).tolist() == [-1, -1]


def test_report_hand_computed() -> None:
    # Group 0: values pick candidate 2 (success); group 1: pick candidate 0 (failure).
    v = torch.tensor([[0.1, 0.2, 0.9], [0.8, 0.1, 0.3]])
    s = torch.tensor([[0, 0, 1], [0, 1, 0]])
    rep = rerank_report(v, s)
    assert rep["rerank/success"] == pytest.approx(0.5)  # (1 + 0) / 2
    assert rep["rerank/random"] == pytest.approx(2 / 6)  # mean success
    assert rep["rerank/oracle"] == pytest.approx(1.0)  # each group has a success
    assert rep["rerank/gain"] == pytest.approx(0.5 - 1 / 3)
    assert rep["rerank/groups"] == 2 and rep["rerank/skipped"] == 0
    empty = rerank_report(torch.zeros(0, 4), torch.zeros(0, 4))
    assert empty["rerank/groups"] == 0 and empty["rerank/success"] == 0.0 and empty["rerank/n"] == 4


def test_report_skips_nan_candidates_as_rerank_does() -> None:
    nan = float("nan")
    # Group 0: candidate 1 has no value (NaN, a success): rerank picks 2 (failure) among {0, 2}.
    # Group 1: no NaN; picks candidate 0 (success). Group 2: every value NaN: not scored.
    v = torch.tensor([[0.1, nan, 0.5], [0.9, 0.2, 0.3], [nan, nan, nan]])
    s = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    assert rerank(v).tolist() == [2, 0, -1]
    rep = rerank_report(v, s)
    assert rep["rerank/groups"] == 2 and rep["rerank/n"] == 3 and rep["rerank/skipped"] == 4
    assert rep["rerank/success"] == pytest.approx(0.5)  # (0 + 1) / 2
    assert rep["rerank/random"] == pytest.approx(5 / 12)  # (1/2 over {0, 2} + 1/3) / 2
    assert rep["rerank/oracle"] == pytest.approx(1.0)  # candidate 0 of group 0, candidate 0 of group 1
    assert rep["rerank/gain"] == pytest.approx(0.5 - 5 / 12)
    none = rerank_report(torch.full((2, 3), nan), torch.ones(2, 3))
    assert none["rerank/groups"] == 0 and none["rerank/success"] == 0.0 and none["rerank/skipped"] == 6
    with pytest.raises(ValueError, match="success"):
        rerank_report(v, s.double().masked_fill(s == 0, nan))


@pytest.mark.parametrize("seed", range(3))
def test_known_value_signal_beats_random(seed: int) -> None:
    # Synthetic pool: candidate success ~ Bernoulli(p), the value is p plus noise: reranking must beat random
    # choice by a wide margin and never beat the oracle.
    gen = torch.Generator().manual_seed(seed)
    G, N = 400, 8
    p = torch.rand(G, N, generator=gen)
    success = (torch.rand(G, N, generator=gen) < p).double()
    values = p + 0.1 * torch.randn(G, N, generator=gen)
    rep = rerank_report(values, success)
    assert rep["rerank/success"] > rep["rerank/random"] + 0.2
    assert rep["rerank/success"] <= rep["rerank/oracle"]
    # A value signal carrying no information does not beat random beyond noise.
    rep0 = rerank_report(torch.rand(G, N, generator=gen), success)
    assert abs(rep0["rerank/success"] - rep0["rerank/random"]) < 0.1
