"""One episode type, one group type: RolloutGroup's masks, group_batch's advantages, BAR reading trajectories."""

import asyncio
import math

import numpy as np
import pytest
import torch

from orchard.data import RenderedSample, RenderReport, RolloutGroup, Trajectory, stack_groups, trainable
from orchard.sampling import BARConfig, abar_select
from orchard.stages import RLConfig, group_batch, trajectory_reward


def sample(tag: int) -> RenderedSample:
    ids = torch.tensor([tag, tag + 1, tag + 2])
    return RenderedSample(input_ids=ids, action_mask=torch.tensor([False, True, True]),
                          turn_index=torch.tensor([-1, 0, 0]), old_logprobs=torch.zeros(3),
                          logprob_mask=torch.tensor([False, True, True]), report=RenderReport())


def traj(reward, reason="done", samples=1, **components) -> Trajectory:
    return Trajectory(reward=reward, termination_reason=reason, task_id="t", reward_components=components,
                      samples=[sample(10 * i) for i in range(samples)])


def test_group_masks_env_errors_timeouts_removed_and_unrecorded_members():
    members = (traj(1.0), traj(None, "env_error", samples=0), traj(-1.0, "time_budget"), traj(-1.0, samples=0),
               traj(-1.0), Trajectory(reward=1.0, metadata={"removed": True}, samples=[sample(0)]))
    group = RolloutGroup("t", members)
    assert group.mask_N.tolist() == [True, False, False, False, True, False]
    assert np.isnan(group.rewards_N[[1, 2, 3, 5]]).all() and group.rewards_N[[0, 4]].tolist() == [1.0, -1.0]
    assert group.valid_N.tolist() == [True, False, True, True, True, True]
    assert group.num_env_errors == 1 and group.trained == [members[0], members[4]]
    # The paper drops timeouts; a recipe may keep them.
    assert RolloutGroup("t", members, drop_timeouts=False).mask_N.tolist()[2] is True
    assert trainable(members[2], drop_timeouts=False) and not trainable(members[2])
    with pytest.raises(ValueError, match=r"trajectories\[0\]"):
        RolloutGroup("t", ({"reward": 1.0},))


def test_stack_groups_pads_with_masked_nan():
    rewards_GN, mask_GN = stack_groups([RolloutGroup("a", (traj(1.0),)), RolloutGroup("b", (traj(0.0), traj(1.0)))])
    assert mask_GN.tolist() == [[True, False], [True, True]]
    assert rewards_GN[0, 0] == 1.0 and math.isnan(rewards_GN[0, 1]) and rewards_GN[1].tolist() == [0.0, 1.0]
    assert stack_groups([])[0].shape == (0, 0)


def test_group_batch_advantages_by_hand():
    # Trained rewards [1, -1, -1] (the env error is out): mean -1/3, sample std sqrt((16/9 + 4/9 + 4/9) / 2)
    # = sqrt(4/3) = 1.1547; advantages (4/3) / 1.1547 = 1.1547 and (-2/3) / 1.1547 = -0.5774 (eps 1e-6 aside).
    signal = RolloutGroup("a", (traj(1.0, samples=2), traj(None, "env_error", samples=0), traj(-1.0), traj(-1.0)))
    flat = RolloutGroup("b", (traj(-1.0), traj(-1.0)))
    lone = RolloutGroup("c", (traj(1.0), traj(None, "env_error", samples=0)))
    samples, advantages, stats = group_batch([signal, flat, lone])
    # Two samples of the first member, one of each other trained member; the flat and lone groups drop out.
    assert len(samples) == 4 and torch.equal(samples[1].input_ids, torch.tensor([10, 11, 12]))
    assert advantages == pytest.approx([1.1547, 1.1547, -0.5774, -0.5774], abs=1e-4)
    assert stats == {"rl/groups": 3.0, "rl/groups_with_signal": 1.0, "rl/groups_with_spread": 1.0,
                     "rl/sequences": 4.0}
    # Without dynamic sampling the flat group trains with zero advantages (GRPO's defined degenerate case): it
    # counts as trained, not as spread
    _, advantages, stats = group_batch([flat], group_filter="none")
    assert advantages == [0.0, 0.0] and stats["rl/groups_with_signal"] == 1.0 and stats["rl/groups_with_spread"] == 0
    # The paper's GUI rule keeps an all -1 group (it drops all-0 and all-positive ones), with zero advantages too
    stats = group_batch([flat, signal], group_filter="all_zero_or_all_positive")[2]
    assert (stats["rl/groups_with_signal"], stats["rl/groups_with_spread"]) == (2.0, 1.0)
    with pytest.raises(ValueError, match="group_filter"):
        group_batch([flat], group_filter="some")


def test_a_lone_trained_member_never_trains_even_without_dynamic_sampling():
    # group_filter="none" lifts the signal rule, not the two-member floor: a lone member has no group to be
    # relative to (its advantage 1 - 1 = 0, its std undefined). Only the flat pair trains: 2 sequences, advantage 0.
    lone = RolloutGroup("c", (traj(1.0), traj(None, "env_error", samples=0), traj(-1.0, "time_budget")))
    flat = RolloutGroup("b", (traj(-1.0), traj(-1.0)))
    for rule in ("none", "all_equal"):
        samples, advantages, stats = group_batch([lone, flat], group_filter=rule)
        trained = 1.0 if rule == "none" else 0.0  # all_equal drops the flat pair as well
        assert stats == {"rl/groups": 2.0, "rl/groups_with_signal": trained, "rl/groups_with_spread": 0.0,
                         "rl/sequences": 2 * trained}
        assert advantages == [0.0] * int(2 * trained) and len(samples) == 2 * trained


def test_dr_grpo_advantages_keep_the_reward_scale():
    # Score rewards 2 x 0.6 - 1 = 0.2 and 2 x 0.9 - 1 = 0.8: mean 0.5, so Dr.GRPO's advantages are -0.3 and +0.3,
    # where GRPO divides by the sample std 0.4243 and gives -0.7071 / +0.7071, as large as a win against a loss.
    near = RolloutGroup("a", (traj(-1.0, score=0.6), traj(-1.0, score=0.9)))
    assert group_batch([near], reward="score", normalize_std=False)[1] == pytest.approx([-0.3, 0.3])
    # A win against a loss: rewards 1 and -1, mean 0, advantages +1 / -1 unscaled.
    far = RolloutGroup("b", (traj(1.0), traj(-1.0)))
    assert group_batch([far], normalize_std=False)[1] == pytest.approx([1.0, -1.0])
    with pytest.raises(ValueError, match="normalize_std"):
        group_batch([far], normalize_std=0)
    with pytest.raises(ValueError, match="normalize_std"):
        RLConfig(normalize_std="no")


def test_score_reward_is_partial_credit():
    # 2 x 0.6 - 1 = 0.2; no score component falls back to the outcome.
    assert trajectory_reward(traj(-1.0, score=0.6), "score") == pytest.approx(0.2)
    assert trajectory_reward(traj(-1.0, score=0.6), "outcome") == -1.0
    assert trajectory_reward(traj(1.0), "score") == 1.0
    # Scores 0.6 and 0.9 give rewards 0.2 and 0.8, a signal the outcome (-1, -1) does not have.
    group = RolloutGroup("a", (traj(-1.0, score=0.6), traj(-1.0, score=0.9)))
    assert group_batch([group])[2]["rl/groups_with_signal"] == 0.0
    assert group_batch([group], reward="score")[1] == pytest.approx([-0.7071, 0.7071], abs=1e-4)
    with pytest.raises(ValueError, match="kind"):
        trajectory_reward(traj(1.0), "shaped")
    with pytest.raises(ValueError, match="no reward"):
        trajectory_reward(traj(None, "env_error"))


def test_passed_is_the_evaluation_rule_not_the_reward_sign():
    # A Claw verdict: not every check passed (reward -1) but the task score 0.8 >= 0.75 passes evaluation.
    assert traj(-1.0, passed=1.0).passed and not traj(1.0, passed=0.0).passed
    assert traj(1.0).passed and not traj(-1.0).passed and not traj(None, "env_error").passed
    # the boundary: a reward of exactly 0 (the GUI's incomplete run, a partial score of nothing) is no pass, nor is a
    # pass component of 0; the smallest positive reward is one
    assert not traj(0.0).passed and not traj(1.0, passed=0.0).passed and traj(1e-9).passed


def test_bar_reads_trajectories_without_key_functions():
    # Stride 4 of a 4-member group: 2 positives, 1 negative, 1 env error. The env error is discarded (budget
    # spent), never a negative; the second stride brings 2 more negatives, so 2 of 4 positives is balanced.
    strides = [[traj(1.0), traj(None, "env_error", samples=0), traj(-1.0), traj(1.0)],
               [traj(-1.0, "step_budget"), traj(-1.0), traj(-1.0), traj(-1.0)]]

    async def source(k):
        return strides.pop(0)[:k]

    result = asyncio.run(abar_select(source, BARConfig(n=4, n_max=8, stride=4)))
    assert result.kept and result.num_positive == 2 and len(result.discarded) == 1
    # Among negatives, normally terminated ones come first: the step_budget one is not selected.
    assert all(t.terminated for t in result.selected)
