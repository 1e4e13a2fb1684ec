import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.rewards import (
    HYBRID_RULES,
    MIN_MAX_CHARS,
    claw_task_score,
    compress_observation,
    gui_reward,
    hybrid_select,
    two_stage_select,
    workforge_llm_select,
    workforge_programmatic_select,
    workforge_select,
)


def test_claw_hand_computed():
    # 1 * (.8 * .75 + .2 * .75) = .75 -> passes (the bar is inclusive)
    res = claw_task_score(1.0, 0.75, 0.75)
    assert res.score == pytest.approx(0.75) and res.passed is True
    # 1 * (.8 * .9 + .2 * .3) = .72 + .06 = .78 -> pass; with robustness 0: .72 -> fail
    assert claw_task_score(1, 0.9, 0.3).score == pytest.approx(0.78) and claw_task_score(1, 0.9, 0.3).passed
    assert not claw_task_score(1, 0.9, 0.0).passed
    # unsafe: 0 * (...) = 0
    assert claw_task_score(0, 1, 1).score == 0.0 and not claw_task_score(0, 1, 1).passed
    # half safe: .5 * 1 = .5
    assert claw_task_score(0.5, 1, 1).score == pytest.approx(0.5)


def test_claw_vectorised_and_bad_inputs():
    res = claw_task_score(np.array([1, 1, 0]), np.array([1.0, 0.5, 1.0]), 1.0)
    # [.8 + .2, .4 + .2, 0] = [1, .6, 0]
    np.testing.assert_allclose(res.score, [1.0, 0.6, 0.0])
    assert res.passed.tolist() == [True, False, False]
    with pytest.raises(ValueError, match="completion"):
        claw_task_score(1, 1.2, 1)
    with pytest.raises(ValueError, match="safety"):
        claw_task_score("yes", 1, 1)
    with pytest.raises(ValueError, match="pass_threshold"):
        claw_task_score(1, 1, 1, pass_threshold=2)
    with pytest.raises(ValueError, match="broadcast"):
        claw_task_score([1, 1], [1, 1, 1], 1)


@pytest.mark.parametrize(
    "fmt, judge, kwargs, reward, dropped, reason",
    [
        ([True, True, True], True, {}, 1.0, False, "success"),
        ([True, False, True], True, {}, 0.0, False, "malformed_turn"),
        ([True, True], False, {}, 0.0, False, "incomplete"),
        ([True, False, False, False], True, {}, -1.0, False, "format_failure"),  # last 3 malformed -> inferred
        ([True, False, False, False], None, {}, -1.0, False, "format_failure"),  # policy's fault beats judge failure
        ([False, False], False, {}, 0.0, False, "incomplete"),  # only 2 < 3 malformed
        ([False, False], False, {"max_format_failures": 2}, -1.0, False, "format_failure"),
        ([True], True, {"ended_by_format_failure": True}, -1.0, False, "format_failure"),
        ([False, False, False], False, {"ended_by_format_failure": False}, 0.0, False, "incomplete"),
        ([True, True], None, {}, None, True, "judge_failure"),
        ([True, True], True, {"page_blocked": True}, None, True, "blocked_page"),
        ([False, False, False], True, {"page_blocked": True}, None, True, "blocked_page"),
        ([], True, {}, 0.0, False, "no_assistant_turn"),
    ],
)
def test_gui_reward_rules(fmt, judge, kwargs, reward, dropped, reason):
    res = gui_reward(fmt, judge, **kwargs)
    assert (res.reward, res.dropped, res.reason) == (reward, dropped, reason)


def test_gui_reward_bad_inputs():
    with pytest.raises(ValueError, match="format_ok"):
        gui_reward("ok", True)
    with pytest.raises(ValueError, match="format_ok"):
        gui_reward([1, 0], True)
    with pytest.raises(ValueError, match="judge_completed"):
        gui_reward([True], "yes")
    with pytest.raises(ValueError, match="max_format_failures"):
        gui_reward([True], True, max_format_failures=0)


@pytest.mark.parametrize(
    "semantic, programmatic, llm, programmatic_only, hybrid",
    [
        # hybrid: .5 * S_sem + .5 * S_prog against .7
        (1.0, 0.5, True, False, True),  # .5 + .25 = .75
        (0.5, 0.9, False, True, True),  # .25 + .45 = .7, exactly the bar
        (0.95, 0.69, True, False, True),  # .475 + .345 = .82
        (0.7, 0.7, True, True, True),  # .35 + .35 = .7
        (0.7, 0.69, True, False, False),  # .35 + .345 = .695
        (0.69, 0.69, False, False, False),  # .69
        (0.4, 1.0, False, True, True),  # .2 + .5 = .7
        (0.0, 1.0, False, True, False),  # .5
    ],
)
def test_workforge_three_rules_from_the_table(semantic, programmatic, llm, programmatic_only, hybrid):
    assert workforge_llm_select(semantic, programmatic) is llm  # S_sem >= .7 alone
    assert workforge_programmatic_select(semantic, programmatic) is programmatic_only  # S_prog >= .7 alone
    assert workforge_select(semantic, programmatic) is hybrid
    assert hybrid_select(semantic, programmatic, rule="workforge_llm") is llm
    assert hybrid_select(semantic, programmatic, rule="workforge_programmatic") is programmatic_only
    assert hybrid_select(semantic, programmatic, rule="workforge_hybrid") is hybrid
    assert hybrid_select(semantic, programmatic) is hybrid  # the hybrid rule is the default


def test_workforge_single_verifier_rules_need_only_their_score():
    assert workforge_llm_select(0.7) is True and workforge_llm_select(0.6999) is False
    assert workforge_programmatic_select(None, 0.7) is True and workforge_programmatic_select(None, 0.6999) is False
    assert hybrid_select(0.8, None, rule="workforge_llm") is True
    assert hybrid_select(None, 0.8, rule="workforge_programmatic") is True
    with pytest.raises(ValueError, match="programmatic"):
        hybrid_select(0.8, None, rule="workforge_hybrid")


def test_workforge_thresholds_and_arrays():
    # a stricter combined bar: (.75 + .75) / 2 = .75 < .8; weight .8 on semantic: .8 * .9 + .2 * .5 = .82 >= .8
    assert workforge_select(0.75, 0.75, threshold=0.8) is False
    assert workforge_select(0.9, 0.5, threshold=0.8, semantic_weight=0.8) is True
    assert workforge_llm_select(0.85, threshold=0.9) is False
    # .32 * .19 + .68 * .94 = .0608 + .6392 = .7 exactly, 0.6999999999999998 in floats: met within the tolerance
    assert workforge_select(0.19, 0.94, semantic_weight=0.32) is True
    got = workforge_select(np.array([0.7, 0.9, 0.6, 1.0]), np.array([0.7, 0.8, 0.6, 0.4]))
    assert got.tolist() == [True, True, False, True]  # .7, .85, .6, .7
    assert workforge_programmatic_select(None, np.array([0.69, 0.7])).tolist() == [False, True]
    with pytest.raises(ValueError, match="threshold"):
        workforge_select(0.9, 0.9, threshold=1.5)
    with pytest.raises(ValueError, match="semantic_weight"):
        workforge_select(0.9, 0.9, semantic_weight=-0.1)
    with pytest.raises(ValueError, match="broadcast"):
        workforge_select([0.9, 0.9], [0.9, 0.9, 0.9])


def test_two_stage_rule_and_registry():
    assert two_stage_select(0.8, 0.8) is True
    assert two_stage_select(0.79, 1.0) is False and two_stage_select(1.0, 0.79) is False
    assert hybrid_select(0.8, 0.9, rule="softwaregym_two_stage") is True
    assert hybrid_select(0.75, 0.75, rule="softwaregym_two_stage") is False
    assert hybrid_select(0.85, 0.85, rule="softwaregym_two_stage", process_threshold=0.9) is False
    names = ["workforge_llm", "workforge_programmatic", "workforge_hybrid", "softwaregym_two_stage"]
    assert HYBRID_RULES.names() == names
    with pytest.raises(ValueError, match=r"rule must be one of \['workforge_llm', 'workforge_programmatic'"):
        hybrid_select(0.9, 0.9, rule="workforge")
    with pytest.raises(ValueError, match="already registered"):
        HYBRID_RULES.register("workforge_hybrid", workforge_select)
    with pytest.raises(ValueError, match="thresholds"):
        hybrid_select(0.9, 0.9, rule="workforge_hybrid", outcome_threshold=0.5)
    with pytest.raises(ValueError, match="semantic"):
        workforge_select(1.5, 0.9)
    with pytest.raises(ValueError, match="process"):
        two_stage_select(0.9, float("nan"))


def test_compress_hand_computed():
    text = "a" * 100 + "\n" * 10 + "b" * 100  # 210 chars
    out = compress_observation(text, max_chars=100)
    # worst-case marker for 210 chars: "\n" "[... " "210" " chars, " "210" " lines omitted ...]" "\n"
    # = 1 + 5 + 3 + 8 + 3 + 19 + 1 = 40 chars -> budget 100 - 40 = 60: head 30 'a', tail 30 'b';
    # cut = 210 - 60 = 150 chars holding the 10 newlines
    assert out == "a" * 30 + "\n[... 150 chars, 10 lines omitted ...]\n" + "b" * 30
    assert compress_observation("short", max_chars=100) == "short"
    head_only = compress_observation(text, max_chars=100, head_frac=1.0)
    assert head_only.startswith("a" * 60) and head_only.endswith("omitted ...]\n")


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=2000), st.integers(MIN_MAX_CHARS, 600), st.floats(0.0, 1.0))
def test_compress_properties(text, max_chars, head_frac):
    out = compress_observation(text, max_chars=max_chars, head_frac=head_frac)
    assert len(out) <= max_chars
    if len(text) <= max_chars:
        assert out == text
        return
    start = out.index("\n[... ")
    end = out.index(" omitted ...]\n", start) + len(" omitted ...]\n")
    head, marker, tail = out[:start], out[start:end], out[end:]
    assert text.startswith(head) and text.endswith(tail)
    cut = text[len(head) : len(text) - len(tail)]
    assert marker == f"\n[... {len(cut)} chars, {cut.count(chr(10))} lines omitted ...]\n"


def test_compress_bad_inputs():
    with pytest.raises(ValueError, match="max_chars"):
        compress_observation("x", max_chars=10)
    with pytest.raises(ValueError, match="head_frac"):
        compress_observation("x", max_chars=100, head_frac=1.5)
    with pytest.raises(ValueError, match="text"):
        compress_observation(b"x", max_chars=100)
