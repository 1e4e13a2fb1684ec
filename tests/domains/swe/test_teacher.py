"""The scripted SWE teacher: gold-patch hunks as edits, seeded noise (rate, determinism, the kinds an instance
allows), the convention read from the prompt, and each failure kind through the eval harness against the real
embedded sandbox service, unresolved in its own way."""

import asyncio

import pytest

from orchard.data import Message
from orchard.data.tokenizer import build_chat_tokenizer
from orchard.domains.swe.convention import (
    BASH_SYSTEM,
    EVAL_SCHEMAS,
    EVAL_SYSTEM,
    TOOL_SCHEMAS,
    TOOL_SYSTEM,
    task_prompt,
)
from orchard.domains.swe.generator import make_instance
from orchard.domains.swe.harness import SWEEvalHarness
from orchard.domains.swe.teacher import (
    FAILURE_KINDS,
    Edit,
    SWETeacherEngine,
    patch_edits,
    teacher_trajectories,
)
from orchard.env import AsyncSandboxClient, RetryPolicy
from orchard.env.embedded import serve
from orchard.rollout import AgentLoopRollouts

TWO_HUNKS = """diff --git a/pkg/a.py b/pkg/a.py
--- a/pkg/a.py
+++ b/pkg/a.py
@@ -1,3 +1,3 @@
 def f(x):
-    return x - 1
+    return x + 1
 Y = 0
@@ -9,2 +9,3 @@
 def g():
+    pass
     return 2
diff --git a/pkg/new.py b/pkg/new.py
new file mode 100644
--- /dev/null
+++ b/pkg/new.py
@@ -0,0 +1 @@
+X = 1
"""


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


@pytest.fixture(scope="module")
def level3():
    return make_instance("ledger", 5, level=3)


def test_patch_edits_are_one_replacement_per_hunk():
    assert patch_edits(TWO_HUNKS) == [
        Edit("pkg/a.py", "def f(x):\n    return x - 1\nY = 0\n", "def f(x):\n    return x + 1\nY = 0\n"),
        Edit("pkg/a.py", "def g():\n    return 2\n", "def g():\n    pass\n    return 2\n"),
        Edit("pkg/new.py", "", "X = 1\n"),  # a created file: empty old side
    ]


def test_noise_rate_and_determinism(tokenizer, level3):
    def kinds(rate, seed=0, n=200):
        teacher = SWETeacherEngine(tokenizer, [level3], failure_rate=rate, kinds=("wrong_file", "partial"), seed=seed)
        return [teacher.attempt_kind(level3, a) for a in range(n)]

    assert set(kinds(0.0)) == {"careful"} and "careful" not in kinds(1.0)
    drawn = kinds(0.3)
    assert drawn == kinds(0.3) and drawn != kinds(0.3, seed=1)  # seeded by (seed, instance, attempt)
    failures = sum(k != "careful" for k in drawn)
    assert 40 <= failures <= 80  # 200 x 0.3 = 60 expected, sd sqrt(200 x 0.3 x 0.7) ~ 6.5: within 3 sd
    assert {k for k in drawn if k != "careful"} == {"wrong_file", "partial"}


def test_partial_needs_two_places(tokenizer):
    level1 = make_instance("ledger", 5, level=1)  # one hunk
    teacher = SWETeacherEngine(tokenizer, [level1], kinds=("partial", "wrong_file"))
    assert teacher.allowed_kinds(level1) == ["wrong_file"]
    with pytest.raises(ValueError, match="failure_rate"):
        SWETeacherEngine(tokenizer, [level1], failure_rate=1.5)
    with pytest.raises(ValueError, match="kinds"):
        SWETeacherEngine(tokenizer, [level1], kinds=("typo",))


@pytest.mark.parametrize("system, tools, expect", [
    (BASH_SYSTEM, None, "```bash\nfind . -name '*.py'"),
    (TOOL_SYSTEM, TOOL_SCHEMAS, '"name": "str_replace_editor", "arguments": {"command": "view", "path": "/workspace"}'),
    (EVAL_SYSTEM, EVAL_SCHEMAS, '"name": "run_command"'),
])
def test_the_convention_is_read_from_the_prompt(tokenizer, level3, system, tools, expect):
    teacher = SWETeacherEngine(tokenizer, [level3], failure_rate=0.0)
    messages = [Message("system", system), Message("user", task_prompt(level3.problem_statement))]
    prompt = tokenizer.apply_chat_template([m.to_openai() for m in messages], tools=tools, tokenize=False,
                                           add_generation_prompt=True)
    first = teacher.next_turn(prompt)
    assert first.startswith("Let me start by exploring") or first.startswith("THOUGHT: Let me start")
    assert expect in first
    assert teacher._starts == {level3.instance_id: 1}  # one attempt started
    with pytest.raises(ValueError, match="does not know the harness"):
        teacher.next_turn(prompt.replace(system[:40], "You are a helpful assistant."))


def test_teacher_trajectories_plays_five_attempts(tokenizer, level3):
    calls = []

    async def rollouts(engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
        calls.append((group_size, temperature))
        return ["traj"] * (len(tasks) * group_size)

    teacher = SWETeacherEngine(tokenizer, [level3])
    assert len(asyncio.run(teacher_trajectories(rollouts, teacher, [level3]))) == 5 and calls == [(5, 0.0)]
    with pytest.raises(ValueError, match="attempts"):
        asyncio.run(teacher_trajectories(rollouts, teacher, [level3], attempts=0))


@pytest.mark.slow
def test_each_failure_kind_leaves_the_instance_unresolved(tokenizer, level3):
    teachers = {kind: SWETeacherEngine(tokenizer, [level3], failure_rate=1.0, kinds=(kind,)) for kind in FAILURE_KINDS}

    async def main(service):
        retry = RetryPolicy(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.01)
        async with AsyncSandboxClient(service.url, service.api_key, retry=retry) as client:
            rollouts = AgentLoopRollouts(client, SWEEvalHarness(), tokenizer, max_tokens=4096)
            runs = [rollouts(t, [level3], group_size=1, temperature=0.0) for t in teachers.values()]
            return dict(zip(teachers, [r[0] for r in await asyncio.gather(*runs)], strict=True))

    with serve() as service:
        trajs = asyncio.run(main(service))
    gold_files = {e.path for e in patch_edits(level3.patch)}
    for kind, traj in trajs.items():
        assert teachers[kind].kind_of(traj) == kind
        assert traj.termination_reason == "done" and traj.reward == -1.0 and traj.valid, (kind, traj.metadata)
        assert not traj.reward_components["empty_patch"], kind
    components = {kind: traj.reward_components for kind, traj in trajs.items()}
    patched = {kind: {e.path for e in patch_edits(t.metadata["patch"])} for kind, t in trajs.items()}
    # wrong file: the bug is untouched (no failing test passes), the patch touches only a module the fix does not
    assert components["wrong_file"]["fail_to_pass"] == 0.0 and not patched["wrong_file"] & gold_files
    # partial: one of the two places fixed: level 3 has one failing test per bug, so 1 of 2 passes
    assert components["partial"]["fail_to_pass"] == 0.5 and components["partial"]["pass_to_pass"] == 1.0
    # regression: the bug fixed, but a test that passed before fails now
    assert components["regression"]["fail_to_pass"] == 1.0 and components["regression"]["pass_to_pass"] < 1.0
    # untested: no command run at all, and the edit changed nothing the tests see
    commands = [c for m in trajs["untested"].messages for c in m.tool_calls if c.name == "run_command"]
    assert len(commands) == 1 and "find" in commands[0].arguments_dict()["command"]  # only the listing
    assert components["untested"]["fail_to_pass"] == 0.0
