import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.rewards import RPR_WEIGHTS, parse_rubric_judgement, rubric_reward

DIMS = list(RPR_WEIGHTS)
SCORES = {
    "fix_quality": 7,
    "self_test_relevance": 8,
    "coverage": 6,
    "rigor": 5,
    "discriminativeness": 9,
    "regression_guard": 4,
    "verification_integrity": 10,
}
# .15*.7 + .18*.8 + .12*.6 + .15*.5 + .14*.9 + .12*.4 + .14*1.0 = .105+.144+.072+.075+.126+.048+.140 = .710
EXPECTED = 0.71


def test_weights_are_the_papers_and_sum_to_one():
    assert dict(RPR_WEIGHTS) == {
        "fix_quality": 0.15,
        "self_test_relevance": 0.18,
        "coverage": 0.12,
        "rigor": 0.15,
        "discriminativeness": 0.14,
        "regression_guard": 0.12,
        "verification_integrity": 0.14,
    }
    assert math.isclose(sum(RPR_WEIGHTS.values()), 1.0)
    with pytest.raises(TypeError):
        RPR_WEIGHTS["rigor"] = 1.0  # read-only


def test_rubric_reward_hand_computed_and_extremes():
    assert rubric_reward(SCORES) == pytest.approx(EXPECTED)
    assert rubric_reward(dict.fromkeys(DIMS, 0)) == 0.0
    assert rubric_reward(dict.fromkeys(DIMS, 10)) == pytest.approx(1.0)
    # on a 1..5 scale: every dimension 3 -> (3-1)/4 = .5
    assert rubric_reward(dict.fromkeys(DIMS, 3), scale=(1, 5)) == pytest.approx(0.5)
    # custom weights are normalised: {a: 1, b: 3}, a=10, b=0 -> 1/4
    assert rubric_reward({"a": 10, "b": 0}, {"a": 1, "b": 3}) == pytest.approx(0.25)


def test_rubric_reward_batched_matches_mapping():
    rng = np.random.default_rng(1)
    s = rng.uniform(0, 10, size=(5, 3, 7))
    got = rubric_reward(s)
    assert got.shape == (5, 3)
    ref = [[rubric_reward(dict(zip(DIMS, row.tolist(), strict=True))) for row in mat] for mat in s]
    np.testing.assert_allclose(got, ref)
    t = rubric_reward(torch.tensor(s, dtype=torch.float32))
    assert t.dtype == torch.float32
    np.testing.assert_allclose(t.numpy(), ref, rtol=1e-5)


def test_rubric_reward_bad_inputs():
    with pytest.raises(ValueError, match="missing"):
        rubric_reward({k: v for k, v in SCORES.items() if k != "rigor"})
    with pytest.raises(ValueError, match=r"scores\['rigor'\]"):
        rubric_reward({**SCORES, "rigor": 11})
    with pytest.raises(ValueError, match=r"scores\['rigor'\]"):
        rubric_reward({**SCORES, "rigor": float("nan")})
    with pytest.raises(ValueError, match="scores"):
        rubric_reward(np.zeros((2, 6)))
    with pytest.raises(ValueError, match="scale"):
        rubric_reward(SCORES, scale=(10, 0))
    with pytest.raises(ValueError, match="weights"):
        rubric_reward(SCORES, {**RPR_WEIGHTS, "rigor": -0.1})


def fence(obj, lang="json"):
    return f"```{lang}\n{json.dumps(obj)}\n```"


@pytest.mark.parametrize(
    "text",
    [
        json.dumps(SCORES),
        "Assessment follows.\n" + fence(SCORES) + "\nOverall the agent did well.",
        "My scores: " + json.dumps(SCORES) + " -- hope this helps {not json}",
        fence({"scores": SCORES, "rationale": "fine"}),
        json.dumps({k.replace("_", " ").title(): v for k, v in SCORES.items()}),
        json.dumps({k: f"{v}/10" for k, v in SCORES.items()}),
        json.dumps({k: {"score": v, "reason": "x"} for k, v in SCORES.items()}),
        json.dumps(SCORES)[:-1] + ",}",  # trailing comma
        "\n".join(f"- **{k.replace('_', ' ').title()}**: {v}/10" for k, v in SCORES.items()),
        json.dumps([{"dimension": k.replace("_", " "), "score": v, "why": "-"} for k, v in SCORES.items()]),
        fence({"evaluation": [{"name": k, "score": str(v)} for k, v in SCORES.items()]}),
        "Scores:\n" + "\n".join(f"{k.replace('_', '-')} = {v}" for k, v in SCORES.items()) + "\nDone.",
    ],
)
def test_parser_survives_formats(text):
    j = parse_rubric_judgement(text)
    assert j.scorable and j.error is None
    assert j.scores == {k: float(v) for k, v in SCORES.items()}
    assert j.reward == pytest.approx(EXPECTED)


# The paper's grading prompt labels the dimensions R1..R7 in RPR_WEIGHTS order (R1 Fix Quality, R2 Self-test
# Relevance, ..., R7 Verification integrity).
RUBRIC_IDS = {f"R{k}": v for k, v in enumerate(SCORES.values(), start=1)}
NAMES = ["Fix Quality", "Self-test Relevance", "Coverage", "Rigor", "Discriminativeness", "Regression guard",
         "Verification integrity"]


@pytest.mark.parametrize(
    "text",
    [
        json.dumps(RUBRIC_IDS),
        fence({"scores": {k.lower(): f"{v}/10" for k, v in RUBRIC_IDS.items()}, "evidence": "ran the tests"}),
        json.dumps({f"{k} {n}": v for (k, v), n in zip(RUBRIC_IDS.items(), NAMES, strict=True)}),
        json.dumps([{"dimension": k, "score": v} for k, v in RUBRIC_IDS.items()]),
        "\n".join(f"{k} {n}: {v}" for (k, v), n in zip(RUBRIC_IDS.items(), NAMES, strict=True)),
        "Scores:\n"
        + "\n".join(f"- **{k} ({n})**: {v}/10" for (k, v), n in zip(RUBRIC_IDS.items(), NAMES, strict=True)),
        "\n".join(f"{k}: {v}" for k, v in RUBRIC_IDS.items()),
    ],
)
def test_parser_reads_rubric_ids(text):
    j = parse_rubric_judgement(text)
    assert j.scorable and j.error is None
    assert j.scores == {k: float(v) for k, v in SCORES.items()}
    assert j.reward == pytest.approx(EXPECTED)


def test_parser_rubric_ids_that_name_nothing():
    # R8 is no dimension of seven; "R1 Coverage" gives an id and a name that disagree: neither is read.
    j = parse_rubric_judgement(json.dumps({**{k: v for k, v in RUBRIC_IDS.items() if k != "R1"}, "R8": 9}))
    assert not j.scorable and j.missing == ("fix_quality",) and j.extra == {"R8": 9}
    lines = ["R1 Coverage: 8", *(f"{k}: {v}" for k, v in RUBRIC_IDS.items() if k != "R1")]
    j = parse_rubric_judgement("\n".join(lines))
    assert not j.scorable and j.missing == ("fix_quality",)
    # Custom weights: Rk is the k-th of them ({"a": 1, "b": 3}; a=10, b=0 -> 1/4).
    j = parse_rubric_judgement('{"R1": 10, "R2": 0}', weights={"a": 1, "b": 3})
    assert j.scorable and j.reward == pytest.approx(0.25)


def test_parser_id_and_name_that_disagree_name_neither_dimension():
    # "R1 Coverage" (R1 is fix_quality) and no R3: neither fix_quality (by the id) nor coverage (by the name) is read
    ids = {k: v for k, v in RUBRIC_IDS.items() if k not in ("R1", "R3")}
    j = parse_rubric_judgement(json.dumps({"R1 Coverage": 8, **ids}))
    assert not j.scorable and j.missing == ("fix_quality", "coverage") and "fix_quality" not in j.scores
    # an id with a name that is no dimension names nothing either: R3 (coverage) stays missing
    j = parse_rubric_judgement(json.dumps({**{k: v for k, v in RUBRIC_IDS.items() if k != "R3"}, "R3 Banana": 8}))
    assert not j.scorable and j.missing == ("coverage",) and j.extra == {"R3 Banana": 8}


def test_parser_fraction_is_rescaled_onto_a_scale_not_starting_at_zero():
    # scale 1..5: "3/4" -> 1 + 3/4 x (5 - 1) = 4.0 (not 3/4 x 5 = 3.75); "2/5" has the scale's own denominator: 2.
    # reward: every other dimension 3 -> (3 - 1) / 4 = 0.5; self_test_relevance (w 0.18) (4 - 1) / 4 = 0.75,
    # regression_guard (w 0.12) (2 - 1) / 4 = 0.25 -> 0.5 + 0.18 x 0.25 - 0.12 x 0.25 = 0.515
    scores = {**dict.fromkeys(DIMS, 3), "self_test_relevance": "3/4", "regression_guard": "2/5"}
    j = parse_rubric_judgement(json.dumps(scores), scale=(1, 5))
    assert j.scores["self_test_relevance"] == 4.0 and j.scores["regression_guard"] == 2.0
    assert j.scorable and j.reward == pytest.approx(0.515)


def test_parser_fraction_is_rescaled():
    # "4/5" on a 0..10 scale -> 8
    j = parse_rubric_judgement(json.dumps({**SCORES, "self_test_relevance": "4/5"}))
    assert j.scores["self_test_relevance"] == 8.0 and j.reward == pytest.approx(EXPECTED)


@pytest.mark.parametrize(
    "text, missing, out_of_range",
    [
        ("I cannot evaluate this trajectory.", tuple(DIMS), ()),
        ("", tuple(DIMS), ()),
        ("```json\n{broken\n```", tuple(DIMS), ()),
        (json.dumps({k: v for k, v in SCORES.items() if k != "coverage"}), ("coverage",), ()),
        (json.dumps({**SCORES, "rigor": 12}), (), ("rigor",)),
        (json.dumps({**SCORES, "rigor": -1}), (), ("rigor",)),
    ],
)
def test_parser_reports_unscorable_never_zero(text, missing, out_of_range):
    j = parse_rubric_judgement(text)
    assert not j.scorable and j.reward is None and j.error
    assert j.missing == missing and j.out_of_range == out_of_range


def test_parser_non_numeric_and_extra_keys():
    j = parse_rubric_judgement(json.dumps({**SCORES, "rigor": "excellent", "comment": "ok"}))
    assert not j.scorable and "non-numeric" in j.error and j.reward is None
    j = parse_rubric_judgement(json.dumps({**SCORES, "comment": "ok"}))
    assert j.scorable and j.extra == {"comment": "ok"}
    with pytest.raises(ValueError, match="text"):
        parse_rubric_judgement(None)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_parser_never_raises_on_arbitrary_text(text):
    j = parse_rubric_judgement(text)
    assert (j.reward is None) == (not j.scorable)
    if j.scorable:
        assert 0.0 <= j.reward <= 1.0


@settings(max_examples=100, deadline=None)
@given(st.fixed_dictionaries({d: st.integers(0, 10) for d in DIMS}), st.text(max_size=40), st.text(max_size=40))
def test_parser_roundtrip_with_noise(scores, before, after):
    text = before.replace("{", "").replace("`", "") + "\n" + fence(scores) + "\n" + after.replace("{", "")
    j = parse_rubric_judgement(text)
    assert j.scorable and j.reward == pytest.approx(rubric_reward(scores))
