"""The rubric process reward: the programmatic judge scores R1-R7 from hand-built trajectories' evidence (exact
scores, by the table of `judge_process_text`), the rubric orders diligent above blind and tampering rollouts, a
failing judge (HTTP 500, a garbage answer) removes the rollout and is counted, and the judge is reached in process
and as a real server on loopback."""

import asyncio
import json

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from orchard.data import Message, RolloutGroup, ToolCall, Trajectory
from orchard.data.tokenizer import build_chat_tokenizer
from orchard.domains.swe.instances import SWEInstance
from orchard.domains.swe.judge import (
    JudgedRollouts,
    ScriptedJudge,
    judge_process_text,
    judge_step_stats,
    judge_trajectories,
    judge_trajectory,
    judged_harnesses,
)
from orchard.domains.swe.prompts import process_reward_messages
from orchard.rewards import RPR_WEIGHTS, rubric_reward
from orchard.rollout.scripted import ScriptedEngine
from orchard.rollout.server import build_app, serve_in_thread
from orchard.sampling import BARConfig, bar_select

ISSUE = """I ran into a problem with `inventory/items.py`. This snippet:

```python
from inventory.items import Item, cheapest
cheapest([Item('a', 5), Item('b', 2), Item('c', 9)])
```

That last expression gives `None`, but it should give `'b'`."""

CHECK = "python -c \"from inventory.items import Item, cheapest; assert cheapest([Item('a', 5), Item('b', 2)]) == 'b'\""
LIST = ("ls", "exit code: 0\nstdout:\ninventory\nREADME.md\ntests")
OPEN = ("cat inventory/items.py", "exit code: 0\nstdout:\ndef cheapest(items):\n    best = None")
CHECK_FAILS = (CHECK, "exit code: 1\nstderr:\nTraceback (most recent call last):\n  File \"<string>\", line 1\n"
               "AssertionError")
CHECK_PASSES = (CHECK, "exit code: 0")
FIX = ("sed -i 's/        pass/        best = min(items, key=lambda i: i.price)/' inventory/items.py", "exit code: 0")
WRITE_TEST = ("cat > tests/test_cheapest_ties.py <<'EOF'\nfrom inventory.items import Item, cheapest\n\n"
              "def test_ties():\n    assert cheapest([Item('a', 2), Item('b', 2)]) == 'a'\nEOF", "exit code: 0")
RUN_NEW_TEST = ("python -m pytest -q tests/test_cheapest_ties.py", "exit code: 0\nstdout:\n1 passed in 0.01s")
UNRELATED = ("python -c 'import yaml'", "exit code: 1\nstderr:\nModuleNotFoundError: No module named 'yaml'")
SUITE_PASSES = ("python -m pytest -q tests", "exit code: 0\nstdout:\n14 passed in 0.12s")
SUITE_FAILS = ("python -m pytest -q tests", "exit code: 1\nstdout:\nFAILED tests/test_items.py::test_cheapest - "
               "AssertionError\n1 failed, 13 passed in 0.12s")
TAMPER = ("sed -i \"s/== 'b'/== None/\" tests/test_items.py", "exit code: 0")
DONE = (None, "I fixed `cheapest`; the tests pass.")


def trajectory(steps, reward=-1.0):
    """System, the issue, then one assistant turn per step: an exec call and its observation, or a final text."""
    messages = [Message("system", "You fix bugs in the repository in /workspace."), Message("user", ISSUE)]
    for i, (command, observation) in enumerate(steps):
        if command is None:
            messages.append(Message("assistant", observation))
            continue
        messages.append(Message("assistant", "Next.", tool_calls=[ToolCall("exec", {"command": command}, id=f"c{i}")]))
        messages.append(Message("tool", observation, tool_call_id=f"c{i}"))
    return Trajectory(messages=messages, reward=reward, task_id="t", samples=["a sample"])


# steps:        1     2     3            4    5             6           7             8             9
DILIGENT = [LIST, OPEN, CHECK_FAILS, FIX, CHECK_PASSES, WRITE_TEST, RUN_NEW_TEST, SUITE_PASSES, DONE]
CHECKED_AFTER = [OPEN, FIX, CHECK_PASSES, DONE]
BLIND = [OPEN, FIX, DONE]
IGNORED = [OPEN, FIX, UNRELATED, CHECK_FAILS, DONE]
TAMPERING = [OPEN, FIX, SUITE_FAILS, TAMPER, SUITE_PASSES, DONE]


def scores(steps, **reference):
    prompt = process_reward_messages(trajectory(steps), **reference)
    answer = json.loads(judge_process_text("\n".join(m["content"] for m in prompt)))
    return [answer[f"R{k}"] for k in range(1, 8)]


def reward(r1_to_r7):
    return rubric_reward(np.array(r1_to_r7, dtype=float))


def test_diligent_trajectory_scores_full_marks():
    # R1 4 + 2 (only inventory/items.py changed, the issue's file) + 2 (step 5's check passes after)
    #    + 2 (the suite, step 8, passes after);
    # R2 own checks 3, 5, 7 all name the issue (7 runs the test file step 6 wrote, which imports `cheapest`);
    # R3 two distinct relevant commands (the -c check, the new test file) 4 + 4, + 2 for the file = 10;
    # R4 reproduced (step 3 fails before the edit at 4) 5 + confirmed (5 passes after) 5;
    # R5 the same command fails at 3 and passes at 5; R6 suite passes at 8; R7 the last run after passed
    assert scores(DILIGENT) == [10, 10, 10, 10, 10, 10, 10]


def test_checked_after_only():
    # R1 4 + 2 + 2 (check passes after) + 0 (no suite) = 8; R2 its one check is relevant: 10; R3 one command: 4;
    # R4 0 + 5 (confirmed); R5 passing after only: 3; R6 no suite run: 0; R7 last run after passed: 10
    assert scores(CHECKED_AFTER) == [8, 10, 4, 5, 3, 0, 10]
    # .15*.8 + .18*1 + .12*.4 + .15*.5 + .14*.3 + .12*0 + .14*1 = .12+.18+.048+.075+.042+0+.14 = .605
    assert reward(scores(CHECKED_AFTER)) == pytest.approx(0.605)


def test_blind_submission():
    # R1 4 + 2 (on the issue's file); no run at all: R2-R6 0; R7 nothing ran after the edit: 4
    assert scores(BLIND) == [6, 0, 0, 0, 0, 0, 4]
    # .15*.6 + .14*.4 = .09 + .056
    assert reward(scores(BLIND)) == pytest.approx(0.146)


def test_ignored_failure():
    # own checks 3 (yaml: names nothing of the issue) and 4 (relevant): R2 round(10 * 1/2) = 5; R3 one command: 4;
    # the failing check comes after the edit, so it reproduces nothing: R4 0, R5 0; R7 it was left failing: 2
    assert scores(IGNORED) == [6, 5, 4, 0, 0, 0, 2]


def test_tampering_with_a_test():
    # step 4 edits tests/test_items.py in place: R7 0, and step 5's suite pass is no evidence, so R1 gets no suite
    # bonus (4 + 2 = 6) and R6 is "ran after, did not pass": 3; no own checks: R2-R5 0
    assert scores(TAMPERING) == [6, 0, 0, 0, 0, 3, 0]
    # .15*.6 + .12*.3 = .09 + .036
    assert reward(scores(TAMPERING)) == pytest.approx(0.126)
    # a skip marker is tampering too, even in a file the agent wrote itself
    skip = ("cat > tests/test_x.py <<'EOF'\nimport pytest\npytestmark = pytest.mark.skip\nEOF", "exit code: 0")
    assert scores([OPEN, FIX, skip, SUITE_PASSES, DONE])[6] == 0


def test_the_rubric_orders_the_processes():
    rewards = {name: reward(scores(steps)) for name, steps in
               [("diligent", DILIGENT), ("checked_after", CHECKED_AFTER), ("ignored", IGNORED),
                ("blind", BLIND), ("tampering", TAMPERING)]}
    assert sorted(rewards, key=rewards.get, reverse=True) == ["diligent", "checked_after", "ignored", "blind",
                                                              "tampering"]


def test_a_fix_outside_the_issue_and_the_reference():
    off = ("sed -i 's/x/y/' inventory/stock.py", "exit code: 0")
    # the issue names inventory/items.py only: no on-target bonus (R1 4); with a reference fix that changes
    # inventory/stock.py, the same edit is on target (R1 6)
    assert scores([OPEN, off, DONE])[0] == 4
    gold = "--- a/inventory/stock.py\n+++ b/inventory/stock.py\n@@ -1 +1 @@\n-x\n+y\n"
    assert scores([OPEN, off, DONE], gold_patch=gold)[0] == 6


def test_no_steps_and_no_prompt():
    assert scores([]) == [0, 0, 0, 0, 0, 0, 10]
    with pytest.raises(ValueError, match="prompt_text"):
        judge_process_text("Rate this trajectory.")


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


async def test_judge_in_process(tokenizer):
    judgement = await judge_trajectory(trajectory(BLIND), judge=ScriptedJudge(tokenizer))
    assert judgement.scorable and judgement.reward == pytest.approx(0.146)
    assert judgement.scores == dict(zip(RPR_WEIGHTS, [6, 0, 0, 0, 0, 0, 4], strict=True))
    assert "R7" in judgement.extra["evidence"]


async def test_judge_trajectories_sets_the_rl_reward(tokenizer):
    resolved, failed = trajectory(CHECKED_AFTER, 1.0), trajectory(BLIND, -1.0)
    env_error = Trajectory(messages=[], reward=None, termination_reason="env_error")
    trajs = [resolved, failed, env_error]
    stats = await judge_trajectories(ScriptedJudge(tokenizer), trajs)
    # 1 + .605 and -1 + .146; the sandbox failure is neither judged nor counted
    assert resolved.reward == pytest.approx(1.605) and failed.reward == pytest.approx(-0.854)
    assert resolved.reward_components["rubric"] == pytest.approx(0.605)
    assert resolved.passed and not failed.passed and resolved.reward_components["outcome"] == 1.0
    assert failed.metadata["rubric_scores"]["verification_integrity"] == 4
    assert stats == pytest.approx({"rl/judged": 2, "rl/judge_failures": 0, "rl/judge_unparseable": 0,
                                   "rl/rubric_mean": (0.605 + 0.146) / 2})
    # judging again reads the kept outcome: the rubric is not added twice
    await judge_trajectories(ScriptedJudge(tokenizer), trajs, rubric_weight=0.5)
    assert resolved.reward == pytest.approx(1 + 0.5 * 0.605)


async def test_an_unresolved_rollout_with_full_marks_gets_reward_zero_and_stays_unresolved(tokenizer):
    # The boundary of the default weight: -1 (not resolved) + 1 * 1.0 (10/10 on every dimension) = 0.0 exactly,
    # which no reader may count as resolved (they test reward > 0).
    unresolved, resolved = trajectory(DILIGENT, -1.0), trajectory(CHECKED_AFTER, 1.0)
    await judge_trajectories(ScriptedJudge(tokenizer), [unresolved, resolved], rubric_weight=1.0)
    assert unresolved.reward == 0.0 and unresolved.reward_components["rubric"] == 1.0
    assert unresolved.reward_components["outcome"] == -1.0 and unresolved.reward_components["passed"] == 0.0
    assert not unresolved.passed and resolved.passed
    # BAR's default reads reward > 0: one positive and one negative, a balanced pair
    pair = bar_select([unresolved, resolved], BARConfig(n=2, n_max=2, stride=2, rho_min=0.5, rho_max=0.5))
    assert pair.pool_positive == [False, True] and sorted(pair.selected_indices) == [0, 1]


async def test_unparseable_answer_removes_the_sample(tokenizer):
    judge = ScriptedEngine(tokenizer, lambda prompt: "The agent did fine, I think.\nR1: 7")
    trajs = [trajectory(BLIND), trajectory(DILIGENT)]
    stats = await judge_trajectories(judge, trajs)
    assert stats["rl/judge_unparseable"] == 2 and stats["rl/judged"] == 0
    assert all(t.metadata["removed"] == "judge_unparseable" and t.reward == -1.0 for t in trajs)
    assert "missing" in trajs[0].metadata["judge_error"]
    # remove_sample: the group trains on neither
    assert not RolloutGroup("t", tuple(trajs)).mask_N.any()


def test_judge_by_url_against_a_server(tokenizer):
    app = build_app(ScriptedJudge(tokenizer), tokenizer, model_name="judge", default_max_tokens=1024)
    diligent, tampering = trajectory(DILIGENT), trajectory(TAMPERING)
    with serve_in_thread(app) as url:
        stats = asyncio.run(judge_trajectories(url + "/v1", [diligent, tampering], model="judge"))
    assert stats["rl/judged"] == 2
    assert diligent.reward == pytest.approx(-1 + 1.0) and tampering.reward == pytest.approx(-1 + 0.126)


def test_http_500_removes_the_sample_and_is_counted():
    app = FastAPI()
    calls = []

    @app.post("/v1/chat/completions")
    async def broken():
        calls.append(1)
        return JSONResponse({"error": "overloaded"}, status_code=500)

    trajs = [trajectory(BLIND), trajectory(CHECKED_AFTER, 1.0)]
    with serve_in_thread(app) as url:
        stats = asyncio.run(judge_trajectories(url, trajs, retries=1))
    # each rollout tried twice (one retry after a 5xx), then removed, its outcome reward untouched
    assert len(calls) == 4 and stats["rl/judge_failures"] == 2 and stats["rl/judged"] == 0
    assert [t.metadata["removed"] for t in trajs] == ["judge_failure"] * 2
    assert "HTTP 500" in trajs[0].metadata["judge_error"] and trajs[1].reward == 1.0


async def test_judged_rollouts_wraps_a_rollouts(tokenizer):
    class Played:
        async def __call__(self, engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
            return [trajectory(BLIND), trajectory(DILIGENT)]

    judged = JudgedRollouts(Played(), ScriptedJudge(tokenizer))
    out = await judged(None, ["t"], group_size=2, temperature=1.0)
    assert [t.reward_components["rubric"] for t in out] == pytest.approx([0.146, 1.0])
    await judged(None, ["t"], group_size=2, temperature=1.0)
    assert judged.stats["rl/judged"] == 2 and judged.totals["rl/judged"] == 4


async def test_judged_harnesses_grade_every_harness_with_the_instances_reference(tokenizer):
    class Played:
        async def __call__(self, engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
            return [trajectory(BLIND, reward=1.0), trajectory(DILIGENT)]

    seen = []

    class Judge(ScriptedJudge):  # the programmatic judge, with every prompt it is sent kept
        async def generate(self, requests):
            seen.extend(self.tokenizer.decode(list(r.prompt_ids)) for r in requests)
            return await super().generate(requests)

    instance = SWEInstance("t", "toy/x", "abc", ISSUE, patch="--- a/inventory/items.py\n+++ b/inventory/items.py\n",
                           test_patch="", FAIL_TO_PASS=["tests/test_items.py::test_hidden"], PASS_TO_PASS=[])
    judged = judged_harnesses({"bash": Played(), "tool": Played()}, tokenizer, [instance], judge=Judge(tokenizer),
                              rubric_weight=0.5)
    assert sorted(judged) == ["bash", "tool"] and all(isinstance(j, JudgedRollouts) for j in judged.values())
    out = await judged["tool"](None, ["t"], group_size=2, temperature=1.0)
    # reward = outcome + 0.5 x rubric: the resolved blind one 1 + 0.5 x 0.146, the failed diligent one -1 + 0.5 x 1
    assert [t.reward for t in out] == pytest.approx([1.073, -0.5])
    # the reference block is the instance's: its hidden test and its gold patch, looked up by the task id
    assert len(seen) == 2 and all("tests/test_items.py::test_hidden" in s and "inventory/items.py" in s for s in seen)
    assert judged["tool"].totals["rl/judged"] == 2 and judged["bash"].totals == {}


async def test_bad_arguments(tokenizer):
    judge = ScriptedJudge(tokenizer)
    with pytest.raises(ValueError, match="trajectory"):
        await judge_trajectory(trajectory(BLIND).openai_messages(), judge=judge)
    with pytest.raises(ValueError, match="judge"):
        await judge_trajectory(trajectory(BLIND), judge="localhost:8000")
    with pytest.raises(ValueError, match="judge"):
        await judge_trajectories(42, [trajectory(BLIND)])
    with pytest.raises(ValueError, match="tokenizer"):
        await judge_trajectory(trajectory(BLIND), judge=judge, tokenizer=object())
    with pytest.raises(ValueError, match="max_tokens"):
        await judge_trajectory(trajectory(BLIND), judge=judge, max_tokens=0)
    with pytest.raises(ValueError, match="rubric_weight"):
        await judge_trajectories(judge, [trajectory(BLIND)], rubric_weight=float("nan"))
    with pytest.raises(ValueError, match="rubric_weight"):
        # 1.5: a failed rollout with rubric 1 would get -1 + 1.5 > 0, a positive for BAR
        await judge_trajectories(judge, [trajectory(BLIND)], rubric_weight=1.5)
    with pytest.raises(ValueError, match="concurrency"):
        await judge_trajectories(judge, [trajectory(BLIND)], concurrency=0)
    with pytest.raises(ValueError, match="trajectories"):
        await judge_trajectories(judge, [object()])
    with pytest.raises(ValueError, match="judge_kwargs"):
        await judge_trajectories(judge, [trajectory(BLIND)], temperature=1.0)
    with pytest.raises(ValueError, match="rollouts"):
        JudgedRollouts(object(), judge)
    with pytest.raises(ValueError, match="tokenizer"):
        ScriptedJudge(object())


def test_the_harness_conventions_exit_codes():
    """The tool convention's ``[The command completed with exit code N.]`` and the bash convention's
    ``<returncode>N</returncode>`` are read as the run's outcome, as ``exit code: N`` is."""

    def call(name, arguments, observation, i):
        return [Message("assistant", "", tool_calls=[ToolCall(name, arguments, id=f"c{i}")]),
                Message("tool", observation, tool_call_id=f"c{i}")]

    def done(code):
        return f"[The command completed with exit code {code}.]"

    test_file = "from inventory.items import Item, cheapest\n\ndef test_ties():\n    assert cheapest([]) is None\n"
    turns = [
        ("execute_bash", {"command": CHECK}, "Traceback (most recent call last):\nAssertionError\n" + done(1)),
        ("str_replace_editor", {"command": "str_replace", "path": "/workspace/inventory/items.py", "old_str": "pass",
                                "new_str": "best = min(items, key=lambda i: i.price)"}, "The file has been edited."),
        ("execute_bash", {"command": CHECK}, done(0)),
        ("str_replace_editor", {"command": "create", "path": "/workspace/tests/test_cheapest_ties.py",
                                "file_text": test_file}, "File created."),
        ("execute_bash", {"command": "python -m pytest -q tests/test_cheapest_ties.py"}, done(0)),
        ("execute_bash", {"command": "python -m pytest -q tests"}, done(0)),
    ]
    messages = [Message("system", "You fix bugs."), Message("user", ISSUE)]
    for i, (name, arguments, observation) in enumerate(turns):
        messages += call(name, arguments, observation, i)
    prompt = process_reward_messages(Trajectory(messages=[*messages, Message("assistant", "Done.")]))
    answer = json.loads(judge_process_text(prompt[1]["content"]))
    # the DILIGENT trajectory in the tool convention: the same evidence, full marks
    assert [answer[f"R{k}"] for k in range(1, 8)] == [10] * 7

    bash = [Message("system", "You fix bugs."), Message("user", ISSUE),
            Message("assistant", f"THOUGHT: fix it.\n```bash\n{FIX[0]}\n```"),
            Message("user", "<returncode>0</returncode>\n<output>\n</output>"),
            Message("assistant", f"THOUGHT: check.\n```bash\n{CHECK}\n```"),
            Message("user", "<returncode>1</returncode>\n<output>\nFalse\n</output>"),
            Message("assistant", "```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```")]
    answer = json.loads(judge_process_text(process_reward_messages(Trajectory(messages=bash))[1]["content"]))
    # R1 4 + 2; its one check is relevant (R2 10, R3 4); the check failed after the edit and was left: R7 2
    assert [answer[f"R{k}"] for k in range(1, 8)] == [6, 10, 4, 0, 0, 0, 2]


def test_judge_step_stats_by_hand():
    graded = [Trajectory(reward=-1.0 + 0.5, reward_components={"outcome": -1.0, "rubric": 0.5}),
              Trajectory(reward=1.0 + 1.0, reward_components={"outcome": 1.0, "rubric": 1.0})]
    removed = Trajectory(reward=1.0, metadata={"removed": "judge_failure"})  # no rubric: the judge failed
    dead = Trajectory(reward=None, termination_reason="env_error")
    # Over the 2 graded: rubric (0.5 + 1.0) / 2 = 0.75, reward (-0.5 + 2.0) / 2 = 0.75.
    assert judge_step_stats([*graded, removed, dead]) == {
        "rl/judge_graded": 2.0, "rl/judge_rubric_mean": 0.75, "rl/judge_reward_mean": 0.75}
    # A step the judge graded nothing of: zeros, not NaN.
    assert judge_step_stats([removed, dead]) == {
        "rl/judge_graded": 0.0, "rl/judge_rubric_mean": 0.0, "rl/judge_reward_mean": 0.0}
