import copy
import math
import random

import numpy as np
import pytest
import torch

from orchard.data import (
    RenderedSample,
    RenderReport,
    Trajectory,
    cap_per_key,
    check_tool_calls,
    dedup_by_embedding,
    drop_env_errors,
    drop_invalid_tool_calls,
    drop_over_token_limit,
    flag_invalid_tool_calls,
    sequence_length,
    shortest_successful_per_task,
    token_count,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "exec",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
                "required": ["command"],
            },
        },
    },
    # A bare function dict (no "type"/"function" wrapper) is read too.
    {
        "name": "click",
        "parameters": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "y": {"type": "number"}, "double": {"type": "boolean"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
    },
]


def _call(name, arguments, call_id="c"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _traj(*calls, task="t", reward=None, steps=1, reason="done", **meta):
    messages = [{"role": "user", "content": "go"}]
    for i in range(steps):
        messages.append(
            {"role": "assistant", "content": f"step {i}", "tool_calls": list(calls) if i == 0 else []}
        )
    return Trajectory(
        messages=messages, tools=TOOLS, task_id=task, reward=reward, termination_reason=reason, metadata=meta
    )


def test_check_tool_calls_each_kind():
    clean = _traj(
        _call("exec", {"command": "ls"}),
        _call("exec", '{"command": "ls", "timeout": 5}'),
        _call("click", {"x": 1, "y": 2.5, "double": True}),
        _call("exec", {"command": "ls", "timeout": 5.0}),  # 5.0 is an integer in JSON Schema
    )
    assert check_tool_calls(clean) == []
    bad = _traj(
        _call("rm_rf", {}),  # 0: undefined
        _call("exec", '{"command": "ls"'),  # 1: not JSON
        _call("exec", "[1]"),  # 2: not an object
        _call("exec", {"timeout": 3}),  # 3: missing required
        _call("click", {"x": 1, "y": 2, "z": 3}),  # 4: undeclared + additionalProperties false
        _call("exec", {"command": 7, "timeout": True, "extra": 1}),  # 5: two wrong types; extra allowed
        _call("click", {"x": "1", "y": False}),  # 6: two wrong types (bool is not a number)
    )
    issues = check_tool_calls(bad)
    assert [(i.call_index, i.kind) for i in issues] == [
        (0, "undefined_tool"),
        (1, "unparseable_arguments"),
        (2, "unparseable_arguments"),
        (3, "missing_required"),
        (4, "unexpected_argument"),
        (5, "wrong_type"),
        (5, "wrong_type"),
        (6, "wrong_type"),
        (6, "wrong_type"),
    ]
    assert all(i.message_index == 1 for i in issues)
    assert issues[0].name == "rm_rf" and "defined: ['click', 'exec']" in issues[0].detail
    assert "'command'" in issues[3].detail
    # Explicit tools override the trajectory's own: with only `click` defined, exec calls are undefined.
    only_click = check_tool_calls(clean, [TOOLS[1]])
    assert [i.kind for i in only_click] == ["undefined_tool"] * 3


EDITOR = {"name": "edit", "parameters": {"type": "object", "required": ["command", "path"], "properties": {
    "command": {"type": "string", "enum": ["view", "insert"]},
    "path": {"type": "string"},
    "view_range": {"type": "array", "items": {"type": "integer"}},
    "ratio": {"type": "number", "minimum": 0, "maximum": 1},
    "options": {"type": "object", "properties": {"depth": {"type": "integer"}}, "required": ["depth"]},
}}}


def test_check_tool_calls_validates_enum_bounds_and_nested_values():
    ok = {"command": "view", "path": "/a", "view_range": [1, -1], "ratio": 1, "options": {"depth": 2}}
    assert check_tool_calls(_traj(_call("edit", ok)), [EDITOR]) == []  # the bounds are inclusive: ratio 1 <= 1
    bad = _traj(
        _call("edit", {**ok, "command": "delete"}),  # 0: not in the enum
        _call("edit", {**ok, "ratio": 1.5}),  # 1: above the maximum 1
        _call("edit", {**ok, "ratio": -0.5}),  # 2: below the minimum 0
        _call("edit", {**ok, "view_range": [1, "end"]}),  # 3: an item of the wrong type
        _call("edit", {**ok, "options": {}}),  # 4: a nested required property missing
        _call("edit", {**ok, "options": {"depth": "2"}}),  # 5: a nested property of the wrong type
        _call("edit", {**ok, "command": True}),  # 6: wrong type; the enum is not checked on top of it
    )
    issues = check_tool_calls(bad, [EDITOR])
    assert [(i.call_index, i.kind) for i in issues] == [
        (0, "invalid_value"), (1, "invalid_value"), (2, "invalid_value"), (3, "wrong_type"),
        (4, "missing_required"), (5, "wrong_type"), (6, "wrong_type"),
    ]
    assert "'view_range[1]'" in issues[3].detail and "'options.depth'" in issues[4].detail
    assert "'options.depth'" in issues[5].detail and "['view', 'insert']" in issues[0].detail


def test_check_tool_calls_flags_call_tags_left_in_the_text():
    # A parser moves every call it reads into tool_calls: a tag left in the text is a call that did not parse.
    raw = '<tool_call>\n{"name": "exec", "arguments": {"command": "ls"\n</tool_call>'
    traj = _traj(_call("exec", {"command": "ls"}), steps=3)
    traj.messages[2].content = f"let me look\n{raw}"  # the second assistant turn (message 2)
    traj.messages[3].content = "a stray </tool_call>"  # the third: an unclosed or stray tag counts too
    issues = check_tool_calls(traj)
    assert [(i.message_index, i.call_index, i.name, i.kind) for i in issues] == [
        (2, -1, "", "unparseable_call"), (3, -1, "", "unparseable_call")]
    assert check_tool_calls(traj, tags=()) == []  # the parsed call itself is valid
    traj.messages[0].content = raw  # a user message quoting a call is not the policy's attempt
    assert len(check_tool_calls(traj)) == 2
    assert drop_invalid_tool_calls([traj]) == [] and drop_invalid_tool_calls([traj], tags=()) == [traj]
    with pytest.raises(ValueError, match="tags"):
        check_tool_calls(traj, tags="<tool_call>")


def test_sequence_length_is_the_longest_recorded_sample(tokenizer):
    def sample(n):
        return RenderedSample(input_ids=torch.arange(n), action_mask=torch.ones(n, dtype=torch.bool),
                              turn_index=torch.zeros(n, dtype=torch.long), old_logprobs=torch.zeros(n),
                              logprob_mask=torch.ones(n, dtype=torch.bool), report=RenderReport())

    traj = _traj(steps=2)
    assert sequence_length(traj, tokenizer) == token_count(traj, tokenizer)  # no samples: the rendering
    traj.samples = [sample(5), sample(9), sample(7)]  # per-call samples: the context the longest call needed
    assert sequence_length(traj) == 9
    with pytest.raises(ValueError, match="tokenizer"):
        sequence_length(_traj())
    with pytest.raises(ValueError, match="traj"):
        sequence_length("not a trajectory")


def test_drop_and_flag_invalid_tool_calls():
    good, bad = _traj(_call("exec", {"command": "ls"})), _traj(_call("nope", {}))
    assert drop_invalid_tool_calls([bad, good, bad]) == [good]
    flagged = flag_invalid_tool_calls([good, bad])
    assert flagged[0].metadata["tool_call_issues"] == []
    assert flagged[1].metadata["tool_call_issues"][0]["kind"] == "undefined_tool"
    assert "tool_call_issues" not in bad.metadata  # inputs are not mutated


def test_shortest_successful_per_task():
    a_fail = _traj(task="A", reward=0.0, steps=1)
    a_long = _traj(task="A", reward=1.0, steps=3)
    a_short = _traj(task="A", reward=1.0, steps=2)
    a_env = _traj(task="A", reward=1.0, steps=1, reason="env_error")  # never counts
    a_unscored = _traj(task="A", reward=None, steps=1)
    b_fail = _traj(task="B", reward=0.5, steps=1)
    c_first = _traj(task="C", reward=1.0, steps=2, tag=1)
    c_tie = _traj(task="C", reward=1.0, steps=2, tag=2)
    trajs = [c_first, a_fail, a_long, a_env, a_short, a_unscored, b_fail, c_tie]
    got = shortest_successful_per_task(trajs)
    # A: successes have 3 and 2 steps -> the 2-step one; B: 0.5 < 1.0 -> none; C: tie -> first seen.
    assert got == [c_first, a_short]
    assert shortest_successful_per_task(trajs, success_threshold=0.5) == [c_first, a_short, b_fail]
    # A custom length: total characters of assistant text. a_long ("step 0".."step 2") = 18 > a_short 12.
    by_chars = shortest_successful_per_task(
        trajs, length_fn=lambda t: sum(len(m.text) for m in t.messages if m.role == "assistant")
    )
    assert by_chars == [c_first, a_short]
    with pytest.raises(ValueError, match=r"trajs\[0\].task_id is None"):
        shortest_successful_per_task([Trajectory(reward=1.0)])


def test_drop_env_errors():
    ok, env = _traj(reason="time_budget"), _traj(reason="env_error")
    assert drop_env_errors([env, ok, env]) == [ok]


def test_token_limit(tokenizer):
    short, long = _traj(steps=1), _traj(steps=4)
    n_short = len(
        tokenizer.apply_chat_template(
            short.openai_messages(), tools=short.tools, tokenize=True, return_dict=True
        )["input_ids"]
    )
    assert token_count(short, tokenizer) == n_short
    n_long = token_count(long, tokenizer)
    assert n_long > n_short
    assert drop_over_token_limit([long, short], tokenizer, limit=n_short) == [short]  # limit is inclusive
    assert drop_over_token_limit([long, short], tokenizer, limit=n_short - 1) == []
    assert drop_over_token_limit([long, short], tokenizer) == [long, short]  # 64K default
    # Sampled ids count as rendered: a turn whose engine used a non-canonical split is longer.
    split = copy.deepcopy(short)
    ids = tokenizer("step 0<|im_end|>", add_special_tokens=False)["input_ids"]
    split.messages[1].token_ids = [*ids[:-1], *ids]  # 6 more (duplicated) tokens than the template's
    assert token_count(split, tokenizer) == n_short + len(ids) - 1
    with pytest.raises(ValueError, match="limit must be a positive int"):
        drop_over_token_limit([short], tokenizer, limit=0)


def test_cap_per_key():
    items = [(site, i) for i, site in enumerate("aabacaaab")]  # a: 6 items, b: 2, c: 1
    got = cap_per_key(items, key_fn=lambda x: x[0], cap=2, seed=0)
    assert [x[0] for x in got].count("a") == 2 and [x[0] for x in got].count("b") == 2
    assert [x[0] for x in got].count("c") == 1
    assert got == sorted(got, key=lambda x: x[1])  # input order kept
    assert got == cap_per_key(items, key_fn=lambda x: x[0], cap=2, seed=0)  # deterministic
    choices = {tuple(cap_per_key(items, key_fn=lambda x: x[0], cap=2, seed=s)) for s in range(20)}
    assert len(choices) > 1  # the seed matters
    assert cap_per_key(items, key_fn=lambda x: x[0], cap=0) == []
    assert cap_per_key(items, key_fn=lambda x: x[0], cap=100) == items
    with pytest.raises(ValueError, match="cap must be"):
        cap_per_key(items, key_fn=lambda x: x[0], cap=-1)
    with pytest.raises(ValueError, match="key_fn must be callable"):
        cap_per_key(items, key_fn=None, cap=1)


def test_dedup_by_embedding_hand_case():
    vectors = {
        "a": [1.0, 0.0],
        "a_near": [0.99, 0.14],  # cos = 0.99 / sqrt(0.99^2 + 0.14^2) = 0.99 / 0.99985 = 0.9901 to "a"
        "b": [0.0, 1.0],  # cos 0 to "a", 0.14 / 0.99985 = 0.140 to "a_near"
        "a_scaled": [3.0, 0.0],  # cos exactly 1 to "a"
        "zero": [0.0, 0.0],  # similarity 0 to everything
    }
    names = list(vectors)
    calls = []

    def embed(batch):
        calls.append(len(batch))
        return np.array([vectors[n] for n in batch])

    assert dedup_by_embedding(names, embed, 0.95) == ["a", "b", "zero"]
    assert dedup_by_embedding(names, embed, 0.995) == ["a", "a_near", "b", "zero"]
    assert dedup_by_embedding(names, embed, 1.0) == [
        "a",
        "a_near",
        "b",
        "zero",
    ]  # exact duplicate despite rounding
    assert dedup_by_embedding(names, embed, 0.95, return_indices=True) == [0, 2, 4]
    assert calls == [5, 5, 5, 5]  # one batched call each
    # threshold 0: anything not pointing away is a duplicate; "b" (cos 0) and "zero" (0) go too.
    assert dedup_by_embedding(names, embed, 0.0) == ["a"]
    assert dedup_by_embedding([], embed, 0.9) == []


def _reference_dedup(emb, threshold):
    kept = []
    for i, v in enumerate(emb):
        duplicate = False
        for j in kept:
            w = emb[j]
            nv, nw = math.sqrt(sum(x * x for x in v)), math.sqrt(sum(x * x for x in w))
            cos = 0.0 if nv == 0 or nw == 0 else sum(x * y for x, y in zip(v, w, strict=True)) / (nv * nw)
            duplicate = duplicate or cos >= threshold - 1e-9
        if not duplicate:
            kept.append(i)
    return kept


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_dedup_matches_reference_on_random_embeddings(seed):
    rng = random.Random(seed)
    n, d = rng.choice([7, 13, 31]), rng.choice([3, 5])
    # Clusters of near-duplicates around a few centres, plus exact repeats.
    centres = [[rng.gauss(0, 1) for _ in range(d)] for _ in range(4)]
    emb = [[c + rng.gauss(0, 0.05) for c in rng.choice(centres)] for _ in range(n)]
    emb[-1] = list(emb[0])
    for threshold in (0.5, 0.9, 0.99, 1.0):
        got = dedup_by_embedding(list(range(n)), lambda items: np.array([emb[i] for i in items]), threshold)
        assert got == _reference_dedup(emb, threshold)
        assert (n - 1) not in got  # the exact repeat of item 0 is always dropped


def test_dedup_validation():
    with pytest.raises(ValueError, match="threshold"):
        dedup_by_embedding(["a"], lambda b: [[1.0]], 1.5)
    with pytest.raises(ValueError, match=r"shape \[N, D\] = \[2, D\]"):
        dedup_by_embedding(["a", "b"], lambda b: [[1.0]], 0.9)
    with pytest.raises(ValueError, match="non-finite"):
        dedup_by_embedding(["a"], lambda b: [[float("nan")]], 0.9)
    with pytest.raises(ValueError, match="items must be a sequence"):
        dedup_by_embedding("ab", lambda b: [[1.0], [1.0]], 0.9)
