"""SFT modes over a teacher's trajectories: resolved-only, all, and credit-assigned SFT from hindsight values; the
SFT stage's context length and its step count."""

import asyncio

import pytest
import torch

from orchard.data import Message, RenderedSample, RenderReport, ToolCall, Trajectory
from orchard.models import tiny_qwen3
from orchard.stages import SFTConfig, curate_sft, demonstrations, sft_samples, sft_stage, sft_steps
from orchard.train.trainer import OptimConfig, TrainConfig

# [system, a0, a0, obs, a1, a1, obs, a2]: three steps (assistant turns), observations never supervised.
TURN = torch.tensor([-1, 0, 0, -1, 1, 1, -1, 2])
ACTION = TURN >= 0


def traj(reward, reason="done"):
    sample = RenderedSample(input_ids=torch.arange(8), action_mask=ACTION.clone(), turn_index=TURN.clone(),
                            old_logprobs=torch.zeros(8), logprob_mask=ACTION.clone(), report=RenderReport())
    messages = [Message("user", "fix it")] + [m for _ in range(3) for m in (Message("assistant", "a"),
                                                                          Message("tool", "o", tool_call_id="c"))]
    return Trajectory(messages=messages[:-1], reward=reward, termination_reason=reason,
                      samples=[] if reason == "env_error" else [sample])


def test_resolved_and_all_modes():
    good, bad, broken = traj(1.0), traj(-1.0), traj(None, "env_error")
    samples, stats = sft_samples([good, bad, broken])
    assert samples == good.samples and stats["sft/resolved"] == 1 and stats["sft/failed"] == 1
    samples, _ = sft_samples([good, bad, broken], mode="all")
    assert samples == [*good.samples, *bad.samples]  # never the environment failure


def test_reward_zero_is_not_resolved():
    # the boundary of "reward > 0": a 0.0 (e.g. a partial score that rounds to nothing) is a failure, not a demo
    samples, stats = sft_samples([traj(0.0), traj(1e-9)])
    assert stats["sft/resolved"] == 1 and stats["sft/failed"] == 1 and len(samples) == 1


class ScriptedTeacherRollouts:
    """A harness whose teacher episodes have the given rewards, in task order; records how it was called."""

    def __init__(self, rewards):
        self.rewards, self.calls = rewards, []

    async def __call__(self, engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
        self.calls.append((list(tasks), group_size, temperature))
        return [traj(r, "env_error" if r is None else "done") for r in self.rewards]


def test_demonstrations_keep_only_the_teachers_successes():
    # harness a: rewards 1, -1, 0, None (env_error), 0.5 -> passed 2 (1 and 0.5); harness b: -1, -1, 1, 0, 1 ->
    # passed 2; samples: one per passed episode, 2 + 2 = 4, never a failed, zero or broken episode's
    a, b = ScriptedTeacherRollouts([1.0, -1.0, 0.0, None, 0.5]), ScriptedTeacherRollouts([-1.0, -1.0, 1.0, 0.0, 1.0])
    samples, stats = asyncio.run(demonstrations({"a": a, "b": b}, "teacher", list(range(5))))
    assert stats == {"sft/teacher_a_episodes": 5.0, "sft/teacher_a_passed": 2.0,
                     "sft/teacher_b_episodes": 5.0, "sft/teacher_b_passed": 2.0}
    assert len(samples) == 4
    assert a.calls == b.calls == [(list(range(5)), 1, 0.0)]  # one greedy episode per task


def test_credit_mode_supervises_only_the_runs_of_failed_trajectories():
    # Values of s_0..s_3: 0.3, 0.4, 0.4, 0.1 -> credits 0.1, 0.0, -0.3 -> one run, step 0 (eps 0.05):
    # only the two tokens of turn 0 stay supervised in the failed trajectory; the resolved one keeps all five.
    good, bad, unvalued = traj(1.0), traj(-1.0), traj(-1.0)
    values = {id(bad): {0: 0.3, 1: 0.4, 2: 0.4, 3: 0.1}, id(unvalued): None}
    samples, stats = sft_samples([good, bad, unvalued], mode="credit", step_values=lambda t: values[id(t)])
    assert len(samples) == 2 and torch.equal(samples[0].action_mask, ACTION)
    assert samples[1].action_mask.tolist() == [False, True, True, False, False, False, False, False]
    assert samples[1].logprob_mask.tolist() == samples[1].action_mask.tolist()
    assert torch.equal(samples[1].input_ids, torch.arange(8))  # the history stays as context
    assert stats["sft/credit_trajectories"] == 1 and stats["sft/credit_steps"] == 1 and stats["sft/unvalued"] == 1
    # Values on a 0.05 grid: 0.30 -> 0.35 is exactly eps in exact arithmetic and counts (one run over steps 0-1).
    values[id(bad)] = {0: 0.30, 1: 0.35, 2: 0.40, 3: 0.10}
    samples, _ = sft_samples([bad], mode="credit", step_values=lambda t: values[id(t)])
    assert samples[0].action_mask.tolist() == [False, True, True, False, True, True, False, False]


TOOLS = [{"type": "function", "function": {"name": "exec", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


def called(name, arguments, **kw):
    t = traj(1.0, **kw)
    t.messages[1].tool_calls = [ToolCall(name, arguments, id="c")]
    t.tools = TOOLS
    return t


def test_curate_sft_drops_each_kind_and_counts_it():
    clean = called("exec", {"command": "ls"})
    undefined = called("rm", {})  # a tool the trajectory's list does not define
    invalid = called("exec", {"command": 7})  # does not validate: command must be a string
    unparsed = called("exec", {"command": "ls"})
    unparsed.messages[3].content = '<tool_call>\n{"name": "exec", "arguments": {</tool_call>'  # did not parse
    by_domain = called("exec", {"command": "ls"})  # clean for the generic check, not for the domain's format
    env = traj(None, "env_error")  # never trains: passes through uncounted
    kept, stats = curate_sft([clean, undefined, invalid, unparsed, by_domain, env],
                             unparseable=lambda t: [3] if t is by_domain else [])
    assert kept == [clean, env]
    assert stats == {"sft/dropped_over_length": 0, "sft/dropped_invalid_calls": 4}
    # Over length: the sample has 8 tokens; the limit is inclusive (8 kept, 7 dropped). A trajectory that is both
    # over length and invalid counts once, as over length.
    assert curate_sft([clean], max_len=8) == ([clean], {"sft/dropped_over_length": 0, "sft/dropped_invalid_calls": 0})
    kept, stats = curate_sft([clean, invalid], max_len=7)
    assert kept == [] and stats == {"sft/dropped_over_length": 2, "sft/dropped_invalid_calls": 0}
    assert curate_sft([]) == ([], {"sft/dropped_over_length": 0, "sft/dropped_invalid_calls": 0})


def test_curate_sft_bad_arguments():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_len"):
            curate_sft([], max_len=bad)
    with pytest.raises(ValueError, match="unparseable"):
        curate_sft([], unparseable=[3])
    with pytest.raises(ValueError, match=r"trajectories\[0\]"):
        curate_sft([{"reward": 1.0}])


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        sft_samples([], mode="credits")
    with pytest.raises(ValueError, match="step_values"):
        sft_samples([], mode="credit")
    with pytest.raises(ValueError, match=r"trajectories\[0\]"):
        sft_samples([{"reward": 1.0}])


def test_sft_stage_left_truncates_to_max_len(tmp_path):
    # Two 8-token samples [system, a0, a0, obs, a1, a1, obs, a2], max_len 5: head min(first action 1, 5 // 2) = 1,
    # then the newest 4 tokens: positions [0, 4, 5, 6, 7], of which 4, 5, 7 are actions. One step of batch 2:
    # 2 x 5 = 10 tokens, 2 x 3 = 6 actions.
    model = tiny_qwen3(16, hidden_size=16, num_hidden_layers=1)
    cfg = SFTConfig(epochs=1, max_len=5, train=TrainConfig(global_batch_size=2, micro_batch_size=2,
                                                           optim=OptimConfig(lr=1e-3)))
    [step] = sft_stage(model, traj(1.0).samples * 2, cfg, pad_id=0, seed=0, output_dir=str(tmp_path / "a"))
    assert (step["tokens/total"], step["tokens/action"]) == (10, 6)
    whole = SFTConfig(epochs=1, train=cfg.train)
    [step] = sft_stage(model, traj(1.0).samples * 2, whole, pad_id=0, seed=0, output_dir=str(tmp_path / "b"))
    assert (step["tokens/total"], step["tokens/action"]) == (16, 10)  # 2 x 8 tokens, 2 x 5 actions


def test_sft_config_rejects_a_bad_max_len():
    with pytest.raises(ValueError, match="max_len must be an int >= 1, got 0"):
        SFTConfig(max_len=0)


@pytest.mark.parametrize(("epochs", "samples", "batch", "steps"), [
    (2, 10, 4, 5),     # 2 x 10 / 4 = 5
    (1, 6, 4, 2),      # 1.5: a half goes to the even neighbour, 2
    (1, 10, 4, 2),     # 2.5 -> 2, not 3
    (1, 1, 16, 1),     # 0.0625 rounds to 0: at least one step
    (1, 0, 16, 1),
    (0.5, 44, 6, 4),   # 3.67 -> 4
])
def test_sft_steps_is_the_stages_count(epochs, samples, batch, steps):
    assert sft_steps(SFTConfig(epochs=epochs, train=TrainConfig(global_batch_size=batch, micro_batch_size=batch)),
                     samples) == steps


def test_sft_stage_takes_sft_steps_steps(tmp_path):
    # 3 samples x 1 epoch / batch 2 = 1.5 -> 2 steps
    cfg = SFTConfig(epochs=1, train=TrainConfig(global_batch_size=2, micro_batch_size=2, optim=OptimConfig(lr=1e-3)))
    model = tiny_qwen3(16, hidden_size=16, num_hidden_layers=1)
    history = sft_stage(model, traj(1.0).samples * 3, cfg, pad_id=0, seed=0, output_dir=str(tmp_path))
    assert len(history) == sft_steps(cfg, 3) == 2


def test_sft_steps_bad_arguments():
    with pytest.raises(ValueError, match=r"^cfg must be an SFTConfig, got dict$"):
        sft_steps({}, 3)
    with pytest.raises(ValueError, match=r"^samples must be an int >= 0, got -1$"):
        sft_steps(SFTConfig(), -1)
