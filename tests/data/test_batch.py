"""Batching: right-padded collation with broadcast advantages, merging per-call samples of one session, left
truncation of a rendered sample."""

import pytest
import torch

from orchard.data import (
    Message,
    RenderedSample,
    RenderReport,
    ToolCall,
    Trajectory,
    collate,
    merge_prefix_samples,
    render_trajectory,
    render_turns,
    truncate_sample,
)

from .test_render import MESSAGES, sampled_trajectory


def conversation():
    return Trajectory(
        messages=[
            Message("system", "Be brief."),
            Message("user", "list files"),
            Message("assistant", "", tool_calls=[ToolCall("exec", {"command": "ls"}, id="c1")]),
            Message("tool", "a.txt", tool_call_id="c1"),
            Message("assistant", "", tool_calls=[ToolCall("exec", {"command": "cat a.txt"}, id="c2")]),
            Message("tool", "hi", tool_call_id="c2"),
            Message("assistant", "done"),
        ]
    )


def test_prefix_consistent_calls_merge_into_the_trajectory_rendering(tokenizer):
    traj = conversation()
    calls = render_turns(traj, tokenizer)
    assert len(calls) == 3
    merged = merge_prefix_samples(calls)
    assert len(merged) == 1
    whole = render_trajectory(traj, tokenizer)
    n = merged[0].input_ids.numel()
    # The merged sequence is the whole rendering minus the template's tail after the last end-of-turn token.
    assert torch.equal(whole.input_ids[:n], merged[0].input_ids)
    assert not whole.action_mask[n:].any()
    assert torch.equal(whole.action_mask[:n], merged[0].action_mask)
    assert torch.equal(whole.turn_index[:n], merged[0].turn_index)
    # Every call's action tokens survive exactly once.
    assert int(merged[0].action_mask.sum()) == sum(int(c.action_mask.sum()) for c in calls)


def test_diverging_calls_stay_separate_and_bad_input_is_named(tokenizer):
    calls = render_turns(conversation(), tokenizer)
    tampered = calls[2]
    ids = tampered.input_ids.clone()
    ids[3] = (ids[3] + 1) % len(tokenizer)  # history rewritten: call 2 no longer extends call 1
    calls[2] = type(tampered)(ids, tampered.action_mask, tampered.turn_index, tampered.old_logprobs,
                              tampered.logprob_mask, tampered.report)
    merged = merge_prefix_samples(calls)
    assert len(merged) == 2  # calls 0 and 1 merged, then call 2 alone
    assert torch.equal(merged[0].input_ids, calls[1].input_ids)
    assert torch.equal(merged[1].input_ids, calls[2].input_ids)
    assert int(merged[0].action_mask.sum()) == int(calls[0].action_mask.sum()) + int(calls[1].action_mask.sum())
    assert merge_prefix_samples([]) == []
    with pytest.raises(ValueError, match="samples"):
        merge_prefix_samples(calls[0])


def _sample(ids, mask, lps, turn):
    return RenderedSample(
        input_ids=torch.tensor(ids),
        action_mask=torch.tensor(mask, dtype=torch.bool),
        turn_index=torch.tensor(turn),
        old_logprobs=torch.tensor(lps, dtype=torch.float32),
        logprob_mask=torch.tensor(mask, dtype=torch.bool),
        report=RenderReport(),
    )


def test_collate_hand_case():
    a = _sample([5, 6, 7], [0, 1, 1], [0.0, -0.5, -0.25], [-1, 0, 0])
    b = _sample([8, 9, 10, 11, 12], [0, 0, 1, 0, 1], [0.0, 0.0, -1.0, 0.0, -2.0], [-1, -1, 0, -1, 1])
    batch = collate([a, b], pad_id=99, advantages=[2.0, -1.0])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 99, 99], [8, 9, 10, 11, 12]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["action_mask"].tolist() == [
        [False, True, True, False, False],
        [False, False, True, False, True],
    ]
    assert batch["turn_index"].tolist() == [[-1, 0, 0, -1, -1], [-1, -1, 0, -1, 1]]
    assert batch["old_logprobs"].tolist() == [[0.0, -0.5, -0.25, 0.0, 0.0], [0.0, 0.0, -1.0, 0.0, -2.0]]
    # advantages broadcast on action tokens only: row 0 -> 2.0 at positions 1, 2; row 1 -> -1.0 at 2, 4.
    assert batch["advantages"].tolist() == [[0.0, 2.0, 2.0, 0.0, 0.0], [0.0, 0.0, -1.0, 0.0, -1.0]]
    padded = collate([a], pad_id=0, pad_to_multiple_of=8)
    assert padded["input_ids"].shape == (1, 8) and "advantages" not in padded
    empty = collate([_sample([], [], [], [])], pad_id=0)
    assert empty["input_ids"].shape == (1, 1) and not empty["attention_mask"].any()


def test_collate_of_rendered_batch(tokenizer):
    tok = tokenizer
    samples = [render_trajectory(sampled_trajectory(tok), tok), *render_turns(sampled_trajectory(tok), tok)]
    batch = collate(samples, tok.pad_token_id)
    for b, s in enumerate(samples):
        n = len(s)
        assert batch["input_ids"][b, :n].tolist() == s.input_ids.tolist()
        assert (batch["input_ids"][b, n:] == tok.pad_token_id).all() and not batch["action_mask"][b, n:].any()
        assert int(batch["attention_mask"][b].sum()) == n


def test_collate_rejects_bad_inputs(tokenizer):
    s = render_trajectory(Trajectory(messages=MESSAGES), tokenizer)
    with pytest.raises(ValueError, match="non-empty sequence"):
        collate([], 0)
    with pytest.raises(ValueError, match=r"samples\[1\]"):
        collate([s, "x"], 0)
    with pytest.raises(ValueError, match="pad_id"):
        collate([s], -1)
    with pytest.raises(ValueError, match=r"advantages must have shape \[B\]=\[1\]"):
        collate([s], 0, advantages=[1.0, 2.0])
    with pytest.raises(ValueError, match="finite"):
        collate([s], 0, advantages=[float("nan")])
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        collate([s], 0, pad_to_multiple_of=0)


def toy_sample(ids, action, turn):
    n = len(ids)
    return RenderedSample(torch.tensor(ids), torch.tensor(action, dtype=torch.bool), torch.tensor(turn),
                          torch.arange(n, dtype=torch.float32) / -10, torch.tensor(action, dtype=torch.bool),
                          RenderReport(), reward=1.0, task_id="t")


def test_truncate_sample_keeps_the_prompt_and_the_newest_tokens():
    # 10 tokens: prompt 0-2, actions 3-4 (turn 0), observation 5-6, actions 7-9 (turn 1).
    s = toy_sample(list(range(100, 110)), [0, 0, 0, 1, 1, 0, 0, 1, 1, 1], [-1, -1, -1, 0, 0, -1, -1, 1, 1, 1])
    cut = truncate_sample(s, 6)
    # head = min(first action 3, 6 // 2 = 3) = 3; the tail keeps 6 - 3 = 3 tokens: positions 7-9; cut (3, 7).
    assert cut.input_ids.tolist() == [100, 101, 102, 107, 108, 109]
    assert cut.action_mask.tolist() == [False, False, False, True, True, True]
    assert cut.turn_index.tolist() == [-1, -1, -1, 1, 1, 1]
    # Kept positions carry their own values: log-prob of position p is -p / 10.
    assert torch.allclose(cut.old_logprobs, torch.tensor([0, -0.1, -0.2, -0.7, -0.8, -0.9]))
    assert (cut.report.truncated, cut.report.full_length, cut.report.cut) == (True, 10, (3, 7))
    assert not s.report.truncated and (cut.reward, cut.task_id) == (1.0, "t")  # the input is unchanged
    # A cut inside an action run keeps its newest tokens: max_len 5 -> head min(3, 2) = 2, tail 3 (7-9).
    assert truncate_sample(s, 5).input_ids.tolist() == [100, 101, 107, 108, 109]
    # A sample that fits is returned as is; one without actions keeps max_len // 2 of its start.
    assert truncate_sample(s, 10) is s
    quiet = toy_sample([1, 2, 3, 4, 5], [0] * 5, [-1] * 5)
    assert truncate_sample(quiet, 3).input_ids.tolist() == [1, 4, 5]  # head 3 // 2 = 1, tail 2
    assert truncate_sample(s, 1).input_ids.tolist() == [109]  # head 1 // 2 = 0


def test_truncate_sample_rejects_bad_input():
    s = toy_sample([1, 2], [0, 1], [-1, 0])
    with pytest.raises(ValueError, match="max_len must be an int >= 1, got 0"):
        truncate_sample(s, 0)
    with pytest.raises(ValueError, match="sample must be a RenderedSample, got list"):
        truncate_sample([1, 2], 4)
