"""Monte-Carlo turn values of a SWE episode on the embedded service: a failed episode (the right fix, then a
"tidy-up" that reverts it, then a submission) is replayed on its toy instance, and continuations that submit at
once are scored by the instance's hidden tests. The state after the fix is worth 1, the states before it and after
the revert 0; those values credit exactly the fix in credit-assigned SFT. The same plan in the tool convention,
recorded by the separate harness program, is valued in process with `SWEToolHarness`."""

import asyncio

import pytest

from orchard.data import Message, Trajectory
from orchard.data.tokenizer import build_chat_tokenizer
from orchard.domains.swe.generator import make_instance
from orchard.domains.swe.harness import SWEEvalHarness, SWEToolHarness
from orchard.domains.swe.teacher import Edit, Step, SWETeacherEngine, patch_edits
from orchard.domains.swe.tool_rollout import run_swe_episodes
from orchard.domains.swe.turn_values import resolved_success, swe_turn_value_estimator, swe_turn_values
from orchard.env import AsyncSandboxClient, RetryPolicy
from orchard.rollout import AgentLoopRollouts, ScriptedEngine, step_value_lookup
from orchard.rollout.proxy import RecordingProxy
from orchard.stages import sft_samples

FAST = RetryPolicy(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.01)
SUBMIT = '<tool_call>\n{"name": "done", "arguments": {"summary": "Submitting."}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


def failed_plan(tokenizer, convention):
    """A toy instance and a failed episode's script of it in ``convention``: the careful plan's view, edit and
    submission (its test runs only cost time here), with a revert of the fix before the submission."""
    instance = make_instance("ledger", 5, level=1)
    teacher = SWETeacherEngine(tokenizer, [instance], failure_rate=0.0)
    [fix] = patch_edits(instance.patch)
    careful = [step for step in teacher.plan(instance, "careful") if step.kind in ("view", "edit", "submit")]
    revert = Step("While here, put that line back as it was.", "edit", edit=Edit(fix.path, fix.new, fix.old))
    plan = [*careful[:-1], revert, careful[-1]]  # view, fix, revert, submit
    assert [step.kind for step in plan] == ["view", "edit", "edit", "submit"]
    return instance, [teacher.render(step, convention) for step in plan]


@pytest.mark.slow
def test_the_fix_is_worth_one_and_gets_the_credit(embedded_service, tokenizer, sandbox_ids):
    instance, script = failed_plan(tokenizer, "eval")
    states = [1, 2, 3]  # before the fix, after it, after the revert

    async def main():
        async with AsyncSandboxClient(embedded_service.url, embedded_service.api_key, retry=FAST) as client:
            rollouts = AgentLoopRollouts(client, SWEEvalHarness(), tokenizer, max_tokens=4096)
            [traj] = await rollouts(ScriptedEngine(tokenizer, script), [instance], group_size=1, temperature=0.0)
            estimator = swe_turn_value_estimator(ScriptedEngine(tokenizer, lambda prompt: SUBMIT), client, tokenizer,
                                                 k=2, concurrency=4, retry_backoff_s=0.01)
            [values] = await swe_turn_values([traj], [instance], estimator=estimator, states=[states], seed=0)
            return traj, values, await sandbox_ids(client), await client.list_snapshots()

    traj, values, left, snapshots = asyncio.run(main())
    assert traj.reward == -1.0 and traj.num_steps == 4 and traj.termination_reason == "done"
    assert values.error is None and values.valid.all() and values.terminal == [False, False, False]
    # submitting at once resolves the issue exactly from the state whose workspace holds the fix: 2 of 2 there,
    # 0 of 2 before it and after the revert (the hidden tests decide, after the replayed edits)
    assert values.step_values() == {1: 0.0, 2: 1.0, 3: 0.0}
    # cost: 3 snapshots, 2 forks each; the replay ran the 3 recorded calls before state 3; one model call each
    assert (values.cost["mc/snapshots"], values.cost["mc/forks"], values.cost["mc/env_errors"]) == (3, 6, 0)
    assert values.cost["mc/replayed_calls"] == 3 and values.cost["mc/model_calls"] == 6
    assert left == set() and snapshots == []
    # credit-assigned SFT: V = 0, 0, 1, 0, 0 over states 0..4 (held before the first key and after the last), so
    # c = 0, 1, -1, 0: the fix (step 1) is the one credited step, and the failed episode trains on it alone
    samples, stats = sft_samples([traj], mode="credit", step_values=step_value_lookup([traj], [values]))
    assert stats["sft/credit_trajectories"] == 1 and stats["sft/credit_steps"] == 1
    [sample] = samples
    assert set(sample.turn_index[sample.action_mask.bool()].tolist()) == {1}


@pytest.mark.slow
def test_a_trajectory_the_harness_program_recorded_is_valued_in_process(embedded_service, tokenizer, sandbox_ids):
    # the same failed plan (view, fix, revert, submit) in the tool convention, played by the separate harness
    # program behind the recording proxy, then valued with SWEToolHarness: the program's calls replay one for one
    # (no observation differs) and the states are worth what they are in the evaluation convention
    instance, script = failed_plan(tokenizer, "tool")
    finish = '<tool_call>\n{"name": "finish", "arguments": {"message": "Submitting."}}\n</tool_call>'

    async def main():
        async with AsyncSandboxClient(embedded_service.url, embedded_service.api_key, retry=FAST) as client:
            proxy = RecordingProxy(ScriptedEngine(tokenizer, script), tokenizer)
            try:
                [traj] = await run_swe_episodes([instance], client=client, proxy=proxy, convention="tool",
                                                temperature=0.0, max_tokens=4096)
            finally:
                await proxy.aclose()
            estimator = swe_turn_value_estimator(ScriptedEngine(tokenizer, lambda prompt: finish), client, tokenizer,
                                                 harness=SWEToolHarness(), k=2, concurrency=4, retry_backoff_s=0.01)
            [values] = await swe_turn_values([traj], [instance], estimator=estimator, states=[[1, 2, 3]], seed=0)
            return traj, values, await sandbox_ids(client), await client.list_snapshots()

    traj, values, left, snapshots = asyncio.run(main())
    assert traj.metadata["harness"] == "tool" and traj.reward == -1.0 and traj.num_steps == 4
    assert values.error is None and values.valid.all()
    assert values.step_values() == {1: 0.0, 2: 1.0, 3: 0.0}
    assert values.cost["mc/replayed_calls"] == 3 and values.cost["mc/replay_mismatches"] == 0
    assert left == set() and snapshots == []


def test_swe_values_check_their_input(embedded_service, tokenizer):
    instance = make_instance("ledger", 5, level=1)
    assert resolved_success(1.0) == 1.0 and resolved_success(-1.0) == 0.0
    client = AsyncSandboxClient(embedded_service.url, embedded_service.api_key)
    estimator = swe_turn_value_estimator(ScriptedEngine(tokenizer, [SUBMIT]), client, tokenizer)
    stranger = Trajectory(messages=[Message("user", "x")], task_id="nope")
    with pytest.raises(ValueError, match="names none of the instances"):
        asyncio.run(swe_turn_values([stranger], [instance], estimator=estimator))
    with pytest.raises(ValueError, match=r"instances\[0\] must be a SWEInstance"):
        asyncio.run(swe_turn_values([stranger], [{"instance_id": "nope"}], estimator=estimator))
    with pytest.raises(ValueError, match="harness must be a SWEEvalHarness or a SWEToolHarness"):
        swe_turn_value_estimator(ScriptedEngine(tokenizer, [SUBMIT]), client, tokenizer, harness=object())
    # a trajectory of the tool convention cannot be replayed in the evaluation harness (SWEToolHarness replays it)
    tools = [{"type": "function", "function": {"name": name}}
             for name in ("execute_bash", "str_replace_editor", "finish")]
    program = Trajectory(messages=[Message("user", "x")], task_id=instance.instance_id, tools=tools)
    with pytest.raises(ValueError, match="cannot be replayed"):
        asyncio.run(swe_turn_values([program], [instance], estimator=estimator))
