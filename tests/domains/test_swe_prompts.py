"""The SWE teacher prompts: what they tell the teacher, how transcripts are cut, and their parsers."""

from __future__ import annotations

import json

import pytest
import torch

from orchard.data import Trajectory
from orchard.domains.swe.prompts import (
    RUBRIC_DIMENSIONS,
    parse_rubric_judgement,
    parse_value_estimation,
    process_reward_messages,
    render_transcript,
    value_estimation_messages,
)
from orchard.losses import interpolate_step_values
from orchard.rewards import RPR_WEIGHTS


def _call(i: int, command: str) -> dict:
    return {"id": f"c{i}", "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": command})}}


def _messages(observations: list[tuple[str, str]]) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Issue: parse() drops the last field."}]
    for i, (command, out) in enumerate(observations):
        msgs.append({"role": "assistant", "content": f"thought {i + 1}", "tool_calls": [_call(i, command)]})
        msgs.append({"role": "tool", "content": out, "tool_call_id": f"c{i}"})
    msgs.append({"role": "assistant", "content": "done"})
    return msgs


def test_transcript_numbers_steps_and_cuts_long_observations() -> None:
    log = "".join(f"line {i}\n" for i in range(500))  # 500 lines, 3890 chars
    dump = "".join(f"src/pkg/module_{i}.py\n" for i in range(300))
    text, n = render_transcript(_messages([("pytest -x", log), ("cat src/parse.py", dump), ("ls", "a.py")]),
                                max_observation_chars=400)
    assert n == 4  # three tool steps and the final answer
    assert [line for line in text.splitlines() if line.startswith("### Step")] == [f"### Step {k}" for k in range(1, 5)]
    assert "## Task\nIssue: parse() drops the last field." in text
    # The test log keeps its head and tail; the cat of a big file becomes a size marker; a short output stays.
    assert "line 0\n" in text and "line 499" in text and "lines omitted ...]" in text and "line 250\n" not in text
    assert f"[file or directory dump of 301 lines, {len(dump)} chars omitted]" in text
    assert "module_1.py" not in text and "Observation:\na.py" in text
    assert f'call bash: {json.dumps({"command": "cat src/parse.py"})}' in text


def test_transcript_from_a_trajectory_and_bad_inputs() -> None:
    traj = Trajectory(messages=_messages([("ls", "a.py")]), reward=1.0)
    assert render_transcript(traj) == render_transcript(traj.openai_messages())
    with pytest.raises(ValueError, match="trajectory"):
        render_transcript("not messages")
    with pytest.raises(ValueError, match="max_observation_chars"):
        render_transcript(traj, max_observation_chars=10)


def test_value_prompt_states_the_outcome_and_the_rules() -> None:
    msgs = value_estimation_messages(_messages([("ls", "a.py"), ("pytest", "1 failed")]), resolved=False)
    assert [m["role"] for m in msgs] == ["system", "user"]
    system, user = msgs[0]["content"], msgs[1]["content"]
    assert "between 0.3 and 0.5" in system and "below 0.2" in system
    # The paper's prompt forbids a monotone rise: where the trajectory went wrong, a rise then a fall at that step.
    rules = " ".join(system.split())
    assert "Do not give monotonically increasing values" in rules
    assert "rises while the agent makes progress and then falls at the step that went wrong" in rules
    assert "interpolated" in system
    assert "has 3 steps (states 0 to 3)" in user and "did NOT resolve" in user
    assert "RESOLVED" in value_estimation_messages(_messages([]), resolved=True)[1]["content"]
    with pytest.raises(ValueError, match="resolved"):
        value_estimation_messages(_messages([]), resolved=1)


@pytest.mark.parametrize(
    "answer",
    [
        '{"values": [{"state": 0, "value": 0.4, "why": "open"}, {"state": 2, "value": 0.6}, '
        '{"state": 4, "value": 0.1}]}',
        'Here you go:\n```json\n{"values": {"0": 0.4, "2": "0.6", "4": 0.1}}\n```',
        '{"step 0": 0.4, "step 2": 0.6, "step 4": 0.1}',
        "[[0, 0.4], [2, 0.6], [4, 0.1]]",
        "State 0: 0.4\nState 2: 0.6\n- **State 4**: 0.1",
        '{"values": [{"step": 0, "value": 0.4}, {"step": 2, "value": 0.6}, {"step": 4, "value": 0.1}, '
        '{"step": 2, "value": 0.6}]}',  # a repeated state with the same value
    ],
)
def test_value_parser_reads_formats_and_feeds_interpolation(answer: str) -> None:
    est = parse_value_estimation(answer, num_steps=4)
    assert est.parseable and est.error is None and est.values == {0: 0.4, 2: 0.6, 4: 0.1}
    # Linear in between: s1 = (.4 + .6) / 2 = .5, s3 = (.6 + .1) / 2 = .35.
    torch.testing.assert_close(interpolate_step_values(est.values, 4),
                               torch.tensor([0.4, 0.5, 0.6, 0.35, 0.1], dtype=torch.float64))


@pytest.mark.parametrize(
    "answer, error",
    [
        ("", "no state values"),
        ("I cannot tell.", "no state values"),
        ('{"values": [{"state": 5, "value": 0.3}]}', "not an integer in [0, 4]"),
        ('{"values": [{"state": 1.5, "value": 0.3}]}', "not an integer"),
        ('{"values": {"0": 1.5}}', "must be a number in [0, 1]"),
        ('{"values": {"0": "high"}}', "must be a number in [0, 1]"),
        ('{"values": {"0": "nan"}}', "must be a number in [0, 1]"),
        ('[[0, 0.4], [0, 0.5]]', "two values"),
    ],
)
def test_value_parser_reports_unparseable(answer: str, error: str) -> None:
    est = parse_value_estimation(answer, num_steps=4)
    assert not est.parseable and est.values is None and error in est.error


def test_value_parser_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_steps"):
        parse_value_estimation("{}", num_steps=-1)
    with pytest.raises(ValueError, match="text"):
        parse_value_estimation(None, num_steps=2)


def test_grading_prompt_rules_and_dimensions() -> None:
    msgs = process_reward_messages(_messages([("pytest", "1 failed")]))
    system, user = msgs[0]["content"], msgs[1]["content"]
    assert [m["role"] for m in msgs] == ["system", "user"]
    # The seven dimensions of RPR_WEIGHTS, in its order, as R1..R7 with their weights.
    assert [d[0] for d in RUBRIC_DIMENSIONS] == [f"R{k}" for k in range(1, 8)]
    for (rid, name, _), weight in zip(RUBRIC_DIMENSIONS, RPR_WEIGHTS.values(), strict=True):
        assert f"{rid} {name} (weight {weight:.2f})" in system
    # The names are the rubric's own: an answer keyed by them scores every dimension.
    assert parse_rubric_judgement(json.dumps({name: 7 for _, name, _ in RUBRIC_DIMENSIONS})).reward == pytest.approx(0.7)
    rules = " ".join(system.split())
    assert "for not running the hidden tests" in rules and "for a fix that differs from the reference fix" in rules
    assert "errors and tracebacks it met while exploring" in rules and "responded to the evidence" in rules
    assert "submitting without verification" in rules  # a fault the paper's grading rules name
    assert "Reference" not in user and "reference block" not in system  # no reference given
    assert "### Step 1" in user and "Observation:\n1 failed" in user


def test_grading_prompt_reference_block() -> None:
    patch = "--- a/parse.py\n+++ b/parse.py\n" + "+x = 1\n" * 3000  # 18033 chars
    msgs = process_reward_messages(_messages([]), fail_to_pass=["tests/test_parse.py::test_last_field"],
                                   gold_patch=patch, max_patch_chars=500)
    system, user = msgs[0]["content"], msgs[1]["content"]
    assert "only to judge R2 (relevance), R3 (coverage) and R5 (discriminativeness)" in system
    assert "- tests/test_parse.py::test_last_field" in user and "--- a/parse.py" in user
    assert "lines omitted ...]" in user and len(user) < 1500
    assert user.index("## Reference") < user.index("## Agent transcript")
    with pytest.raises(ValueError, match="fail_to_pass"):
        process_reward_messages(_messages([]), fail_to_pass="tests/test_parse.py")
    with pytest.raises(ValueError, match="max_patch_chars"):
        process_reward_messages(_messages([]), gold_patch="x", max_patch_chars=10)


def test_grading_answer_in_the_prompts_format_is_scored() -> None:
    # The format the prompt asks for: R1..R7 keys and an evidence line. All 10 except R2 = 5:
    # 1 - .18 * .5 = .91.
    answer = json.dumps({**{f"R{k}": 10 for k in range(1, 8)}, "R2": 5, "evidence": "ran pytest before and after"})
    j = parse_rubric_judgement(answer)
    assert j.scorable and j.reward == pytest.approx(0.91) and j.extra == {"evidence": "ran pytest before and after"}
