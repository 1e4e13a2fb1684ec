"""find_json: the JSON a judge's free-form answer holds, each case an LLM judge has been seen to write."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.rewards import RPR_WEIGHTS, find_json, parse_rubric_judgement


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"a": 1}', [{"a": 1}]),  # the whole text, listed once though it is also an embedded span
        ('Here you go:\n```json\n{"a": 1}\n```\nDone.', [{"a": 1}]),
        ('```\n[1, 2]\n```', [[1, 2]]),  # a fence without a language tag, an array
        ('I rate it {"a": 1} -- hope this helps {not json}', [{"a": 1}]),
        ('values: [[0, 0.5], [1, 0.7]] done', [[[0, 0.5], [1, 0.7]]]),  # an array inside prose
        ('x {"a": "}{", "b": "say \\"{\\""} y', [{"a": "}{", "b": 'say "{"'}]),  # braces and quotes in strings
        ('{"a": 1, "b": [1, 2,],}', [{"a": 1, "b": [1, 2]}]),  # trailing commas
        ('{"a": "x,}", "b": 1,}', [{"a": "x,}", "b": 1}]),  # the repair leaves a ",}" inside a string alone
        ("{'a': 1, 'b': (1, 2), 3: None, 'c': True,}", [{"a": 1, "b": [1, 2], "3": None, "c": True}]),
        ("{'why': 'it\\'s fine'}", [{"why": "it's fine"}]),
        ('[see {"a": 1}]', [{"a": 1}]),  # a value inside a span that does not parse
        ('{"a": {"b": 1}}', [{"a": {"b": 1}}]),  # ... but not one inside a value found
        ('set {x " } then {"a": 1}', [{"a": 1}]),  # a stray quote in prose braces hides nothing after it
    ],
)
def test_find_json_reads(text: str, expected: list) -> None:
    assert find_json(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 1, "b": ',  # truncated: cut off by the token limit
        '```json\n{"a": [1, 2\n```',
        "{1, 2}",  # a Python set is no JSON value
        "{'a': {1, 2}}",
        "'just a string'",
        "Scores: fix quality seven, rigor five.",
        "",
    ],
)
def test_find_json_leaves_out_what_does_not_parse(text: str) -> None:
    assert find_json(text) == []


def test_two_values_come_in_order_fences_first() -> None:
    assert find_json('{"a": 1} then {"b": 2}') == [{"a": 1}, {"b": 2}]
    # A fenced block is the judge's deliberate answer: it comes before a value met earlier in the prose.
    assert find_json('draft {"a": 1}\n```json\n{"b": 2}\n```') == [{"b": 2}, {"a": 1}]
    # The rubric parser takes the first that names a dimension: the second object here.
    first = {k: 5 for k in RPR_WEIGHTS}
    second = {k: 10 for k in RPR_WEIGHTS}
    j = parse_rubric_judgement(f'notes {{"length": 3}} then {json.dumps(first)} or {json.dumps(second)}')
    assert j.scores == {k: 5.0 for k in RPR_WEIGHTS}


def test_rubric_records_in_prose_are_read_as_one_list() -> None:
    records = [{"dimension": k.replace("_", " "), "score": 6} for k in RPR_WEIGHTS]
    j = parse_rubric_judgement(f"My grades: {json.dumps(records)} -- that is all.")
    assert j.scorable and j.scores == {k: 6.0 for k in RPR_WEIGHTS}


def test_truncated_judgement_is_unscorable_with_a_reason() -> None:
    j = parse_rubric_judgement('{"fix_quality": 7, "rigor":')
    assert not j.scorable and j.reward is None and j.error


def test_nesting_past_the_recursion_limit_does_not_raise() -> None:
    assert find_json("[" * 100_000) == []
    assert find_json("[" * 100_000 + "]" * 100_000 + ' and {"a": 1}') == [{"a": 1}]
    assert not parse_rubric_judgement("{" * 100_000).scorable


def test_find_json_rejects_non_text() -> None:
    with pytest.raises(ValueError, match="text must be a str"):
        find_json(None)  # type: ignore[arg-type]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
PROSE = st.text(alphabet=st.characters(blacklist_characters="{}[]\"'`"), max_size=40)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=6), JSON_VALUES, min_size=1, max_size=4), PROSE, PROSE, st.booleans())
def test_an_object_in_prose_is_found_whatever_its_layout(obj: dict, before: str, after: str, indent: bool) -> None:
    text = json.dumps(obj, indent=2 if indent else None)
    assert obj in find_json(f"{before} {text} {after}")
    assert obj in find_json(f"{before}\n```json\n{text}\n```\n{after}")
