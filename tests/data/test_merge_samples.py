import pytest
import torch

from orchard.data import Message, ToolCall, Trajectory, merge_prefix_samples, render_trajectory, render_turns


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
