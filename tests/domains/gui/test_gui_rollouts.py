"""The GUI policy's rollouts in a real headless Chromium in real sandboxes: a policy replaying the teacher's tool
calls solves the task (checker and programmatic judge agree), malformed turns end the run as format_error with -1,
a browser killed in the middle of an episode makes it an env_error (unscored, untrained) while the loop goes on,
and no sandbox or browser process is left (about a minute; one browser at a time)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchard.data.tokenizer import build_chat_tokenizer
from orchard.domains.gui.judge import JudgedGUIRollouts, ProgrammaticJudge
from orchard.domains.gui.rollouts import DONE_OBSERVATION, BrowserSandboxes, GUIHarness, gui_rollouts
from orchard.domains.gui.session import BrowserSession
from orchard.domains.gui.tasks import make_task
from orchard.domains.gui.teacher import teacher_trajectories
from orchard.env import SandboxClient
from orchard.env.embedded import serve
from orchard.rollout.scripted import ScriptedEngine


def _require_browser() -> None:
    # as test_gui_browser: CI promises Chromium and Playwright, so a missing one fails, never skips
    if shutil.which("/usr/bin/chromium") is None or importlib.util.find_spec("playwright") is None:
        pytest.fail("the GUI tests need chromium (apt) and playwright (the [gui] extra): run scripts/setup",
                    pytrace=False)


@pytest.fixture(scope="module")
def client():
    _require_browser()
    with serve(reap_interval_s=0.5) as (url, key), SandboxClient(url, key) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


def call(name, **arguments):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def play(client, tokenizer, script, tasks, *, judge=False, **kwargs):
    rollouts = gui_rollouts(client, tokenizer, max_steps=kwargs.pop("max_steps", 30), concurrency=1,
                            start_jitter_s=0.0, progress=False, seed=0, **kwargs)
    if judge:
        rollouts = JudgedGUIRollouts(rollouts, ProgrammaticJudge(tokenizer))
    engine = ScriptedEngine(tokenizer, script)
    return asyncio.run(rollouts(engine, tasks, group_size=1, temperature=1.0)), rollouts


def test_a_policy_replaying_the_teacher_solves_the_task_and_the_judge_confirms(client, tokenizer):
    # a state task (the cart) and a two-tab answer task, both on site seed 0
    for task in (make_task("shop_cart", 3), make_task("multi_city", 4)):
        [teacher] = teacher_trajectories(client, [task], attempts=1, failure_rate=0.0)
        assert teacher.reward == 1.0, teacher.metadata
        calls = [m.tool_calls[0] for m in teacher.messages if m.role == "assistant"]
        script = [call(c.name, **c.arguments_dict()) for c in calls]
        [traj], judged = play(client, tokenizer, script, [task], judge=True)
        assert traj.termination_reason == "done" and traj.task_id == traj.group_id == task.id, traj.metadata
        # the policy saw what the teacher saw: the same first page and the same observation after every action
        assert traj.messages[0].content == teacher.messages[0].content
        assert traj.messages[1].content == teacher.messages[1].content
        observations = [m.content for m in traj.messages if m.role == "tool"]
        assert observations[:-1] == [m.content for m in teacher.messages if m.role == "tool"]
        assert observations[-1] == DONE_OBSERVATION
        assert [c.name for m in traj.messages for c in m.tool_calls] == [c.name for c in calls]
        # the checker passed it, and the programmatic two-stage judge confirmed it: +1
        assert traj.metadata["check"] == teacher.metadata["check"] and not traj.metadata["blocked"]
        assert traj.metadata["site_state"] == teacher.metadata["site_state"]
        assert traj.metadata["response"] == calls[-1].arguments_dict()["response"]
        assert traj.reward == 1.0 and traj.passed and traj.metadata["judge"]["outcome"] == 1.0
        assert judged.stats["rl/judge_completed"] == 1.0
        assert traj.samples and int(traj.samples[0].action_mask.sum()) > 0  # trainable
    assert client.list_sandboxes() == []  # every browser's sandbox was deleted


def test_malformed_turns_end_the_run_as_format_error(client, tokenizer):
    task = make_task("info_fact", 5)
    script = [
        call("click", x=5000, y=5),  # well formed; the browser refuses it: an error observation, no format error
        "I think the answer is 42.",  # no tool call: a format error, not the end
        call("click", x=5),  # a required argument missing
        call("fly", x=1),  # no such tool (two actions in one turn would be well formed: issue 33)
    ]
    [traj], _ = play(client, tokenizer, script, [task])
    assert traj.termination_reason == "format_error"
    assert traj.metadata["steps"] == 4 and traj.metadata["format_errors"] == 3
    tool = [m.content for m in traj.messages if m.role == "tool"]
    assert tool[0].startswith("Error:") and "outside" in tool[0]  # the browser's own refusal
    assert "a tool call a turn is required" in tool[1]
    assert "missing_required" in tool[2] and "unknown tool 'fly'" in tool[3]
    # -1 (gui_rollout_reward: ended by repeated format failures), and the final site state is recorded
    assert traj.reward == -1.0 and not traj.passed and traj.metadata["reward_reason"] == "format_failure"
    assert traj.metadata["site_state"]["captcha_hits"] == 0
    assert client.list_sandboxes() == []


def test_an_answer_the_agent_typed_into_the_page_is_no_evidence(client, tokenizer):
    # issue 33: a policy that knows Lorwick's population by heart types it into the shop's search box, or books a
    # room under it (the confirmation repeats the name), then answers: the checker accepts the number, but the
    # page text that holds it is the agent's own, and the judge must not confirm the run; the honest run, which
    # opens the article, is confirmed
    task = make_task("info_fact", 4)
    answer = task.answer

    def at(role, name):
        def act(prompt):
            *_, (x, y) = re.findall(rf'\[{role}\] {re.escape(json.dumps(name))}(?: \w+)* @\((\d+),(\d+)\)', prompt)
            return call("click", x=int(x), y=int(y))
        return act

    def say(text):
        return lambda prompt: text

    search = [say(call("goto_url", url=BrowserSession.url("/shop/"))), at("textbox", "Search"),
              say(call("write", text=answer)), say(call("press_keys", keys=["Enter"])),
              say(call("done", response=answer))]
    booking = [say(call("goto_url", url=BrowserSession.url("/forms/booking"))), at("textbox", "name"),
               say(call("write", text=answer)), at("textbox", "YYYY-MM-DD"), say(call("write", text="2026-01-02")),
               at("button", "Book"), say(call("done", response=answer))]
    honest = [at("link", "Lorwick"), say(call("done", response=f"{int(answer):,} people live there."))]
    steps = iter([*search, *booking, *honest])
    [typed, booked, read], judged = play(client, tokenizer, lambda prompt: next(steps)(prompt), [task] * 3,
                                         judge=True)
    assert next(steps, None) is None  # every step was played
    booked_page = next(m.content for m in booked.messages if m.role == "tool" and "Booking confirmed" in m.content)
    assert answer in next(m.content for m in typed.messages if m.role == "tool" and "?q=" in m.content)
    assert booked.metadata["site_state"]["bookings"][0]["name"] == answer
    assert f'[text] "{answer}, 2026-01-02" entered @(' in booked_page  # the site marks its echo of the name
    # the checker passes all three; the judge confirms only the run that read the answer from the site
    assert [t.metadata["check"] for t in (typed, booked, read)] == ["right number"] * 3
    assert [t.reward for t in (typed, booked, read)] == [0.0, 0.0, 1.0]
    assert typed.reward_components["process_judge"] <= 0.5 and booked.reward_components["process_judge"] <= 0.5
    assert judged.stats["rl/judge_completed"] == 1.0
    assert client.list_sandboxes() == []


def uid_processes(uid):
    """pid -> command line of every process running as `uid` (each sandbox has a uid of its own)."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                # Chromium rewrites its children's argv into one string: split on spaces too
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").split()
        except OSError:
            continue  # gone meanwhile
    return found


def chromium_browser_pid(uid):
    """Chromium's browser process: the one without a --type= (renderers, zygotes and utilities all have one)."""
    [pid] = [pid for pid, argv in uid_processes(uid).items()
             if argv and argv[0].endswith(b"chromium") and not any(a.startswith(b"--type=") for a in argv)]
    return pid


def test_a_browser_killed_mid_episode_is_an_env_error_and_the_loop_goes_on(client, tokenizer):
    crashed, fine = make_task("info_fact", 5), make_task("shop_cart", 3)
    rollouts = gui_rollouts(client, tokenizer, max_steps=5, concurrency=1, start_jitter_s=0.0, progress=False,
                            seed=0)
    opened = []
    create = rollouts.client.create

    async def recording_create(**spec):
        opened.append(await create(**spec))
        return opened[-1]

    rollouts.client.create = recording_create
    answers = iter([
        call("scroll", direction="down", amount=0.5),  # the crashed episode's first step works
        "kill",  # before its second: SIGKILL the sandbox's Chromium (its browser process), then a valid step
        call("done", response="0"),  # the next episode, in a fresh sandbox, runs as usual
    ])

    def script(prompt):
        answer = next(answers)
        if answer == "kill":
            os.kill(chromium_browser_pid(opened[0].browser.uid), signal.SIGKILL)
            answer = call("scroll", direction="up", amount=0.5)
        return answer

    judged = JudgedGUIRollouts(rollouts, ProgrammaticJudge(tokenizer))
    first, second = asyncio.run(judged(ScriptedEngine(tokenizer, script), [crashed, fine], group_size=1,
                                       temperature=1.0))
    # the killed browser: an environment failure after 2 model calls, never a reward (not even 0), no sample,
    # and not sent to the judge
    assert first.termination_reason == "env_error" and first.metadata["steps"] == 2, first.metadata
    assert "the browser is gone" in first.metadata["error"]
    assert first.reward is None and not first.valid and first.samples == []
    assert "judge" not in first.metadata and judged.stats["rl/judged"] == 1.0
    # the loop went on: the next episode ended by done and was scored (a wrong answer for the cart task: 0)
    assert second.termination_reason == "done" and second.reward == 0.0 and second.samples
    assert client.list_sandboxes() == []
    deadline = time.monotonic() + 15.0  # the sandbox's pid namespace ends with its bubblewrap, asynchronously
    while uid_processes(opened[0].browser.uid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert uid_processes(opened[0].browser.uid) == {}


def test_arguments_are_checked(client, tokenizer):
    with pytest.raises(ValueError, match="max_steps must be an int >= 1, got 0"):
        GUIHarness(max_steps=0)
    with pytest.raises(ValueError, match="client must be a SandboxClient"):
        BrowserSandboxes("http://x")
    with pytest.raises(ValueError, match="may not set 'seed'"):
        BrowserSandboxes(client, seed=1)
    with pytest.raises(ValueError, match="may not set 'one_call_per_turn'"):
        gui_rollouts(client, tokenizer, one_call_per_turn=False)
    with pytest.raises(ValueError, match="task must be a GUITask"):
        GUIHarness().sandbox_spec({"id": "x"})


def test_a_text_only_policy_browser_takes_no_screenshots(client, tokenizer, monkeypatch):
    # the browsers of a text-only policy (images=False, the CPU recipe) are opened without screenshots, those of
    # a vision policy with them (what a step then takes is counted in test_gui_browser)
    opened = []
    monkeypatch.setattr(BrowserSession, "open", staticmethod(
        lambda c, **kwargs: opened.append(kwargs) or SimpleNamespace(sandbox=SimpleNamespace(sandbox_id="s"))))
    for images in (False, True):
        asyncio.run(gui_rollouts(client, tokenizer, images=images).client.create(seed=3))
    assert [(k["seed"], k["screenshots"]) for k in opened] == [(3, False), (3, True)]
    with pytest.raises(ValueError, match="may not set 'screenshots': images sets it"):
        gui_rollouts(client, tokenizer, session_kwargs={"screenshots": True})
