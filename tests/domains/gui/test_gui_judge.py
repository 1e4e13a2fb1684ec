"""The two-stage GUI judge: which messages and screenshots each judge sees (exact positions), the programmatic
judge's scores on hand-built runs, the RL reward (+1 / 0 / -1 / removed) with its counters and dynamic sampling,
and the judge reached in process, by URL with data-URL screenshots, and on a text-only server."""

import asyncio
import base64
import json
import random

import pytest
from fastapi import FastAPI, Request

from orchard.data import Message, RolloutGroup, ToolCall, Trajectory
from orchard.data.tokenizer import build_chat_tokenizer
from orchard.domains.gui.evidence import (
    NOT_SHOWN,
    evenly_spaced,
    flatten_images,
    judge_reference,
    outcome_evidence,
    outcome_judge_messages,
    parse_judge_score,
    post_action_screenshots,
    process_evidence,
    process_judge_messages,
)
from orchard.domains.gui.judge import (
    JudgedGUIRollouts,
    ProgrammaticJudge,
    gui_rollout_reward,
    judge_gui_trajectories,
    judge_gui_trajectory,
    programmatic_judge_text,
    turn_format_ok,
)
from orchard.domains.gui.tasks import GUITask, make_task
from orchard.domains.gui.tools import GUI_TOOLS
from orchard.rollout.scripted import ScriptedEngine
from orchard.rollout.server import build_app, serve_in_thread
from orchard.sampling import filter_groups

STATE = {"cart": [], "orders": [], "bookings": [], "settings": {}, "captcha_hits": 0}
TASK = GUITask("gui-info_fact-1", "info_fact", 1, 0, "/info/", "How many people live in Avalon?", answer="52000")
REPORT = make_task("captcha_report", 0)
PAGE = 'Viewport: 1280x720\nTab 0 (active): \'Avalon\' http://127.0.0.1:8000/info/city/avalon\n' \
       'Page elements (role, name, centre):\n[cell] "52,000" @(300,200)'
PROMO = "Viewport: 1280x720\nTab 0 (active): 'Deals' http://127.0.0.1:8000/promo/1"


def image(k):
    """Screenshot k as a content part whose data URL decodes to b"shot-k"."""
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
        f"shot-{k}".encode()).decode()}}


def shot_of(part):
    return base64.b64decode(part["image_url"]["url"].split(",", 1)[1]).decode()


def run(actions, *, answer="Avalon has 52,000 inhabitants.", pages=None, images=True, termination="done",
        first_page=PAGE):
    """System, the user's intent with screenshot 0, then per action an assistant call and its tool answer with
    screenshot k (k = 1, 2, ...), then done(answer) when answer is not None."""
    first = [{"type": "text", "text": TASK.intent}, {"type": "text", "text": first_page}] + (
        [image(0)] if images else [])
    messages = [Message("system", "You operate a browser."), Message("user", first)]
    for k, (name, args) in enumerate(actions, start=1):
        page = (pages or {}).get(k, PAGE)
        messages.append(Message("assistant", None, tool_calls=[ToolCall(name, args, id=f"c{k}")]))
        messages.append(Message("tool", [{"type": "text", "text": page}] + ([image(k)] if images else []),
                                tool_call_id=f"c{k}", name=name))
    if answer is not None:
        messages.append(Message("assistant", None, tool_calls=[ToolCall("done", {"response": answer}, id="end")]))
    return Trajectory(messages, GUI_TOOLS, None, task_id=TASK.id, termination_reason=termination,
                      metadata={"site_state": dict(STATE)}, samples=["a sample"])


SCROLLS = [("scroll", {"direction": "down", "amount": 0.1 * (k % 9 + 1)}) for k in range(22)]


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


# ---- evidence selection -----------------------------------------------------------------------------------------


def test_evenly_spaced_by_hand_and_as_properties():
    # round(i * 22 / 9): 0, 2.44, 4.89, 7.33, 9.78, 12.2, 14.7, 17.1, 19.6, 22 -> 0 2 5 7 10 12 15 17 20 22
    assert evenly_spaced(23, 10) == [0, 2, 5, 7, 10, 12, 15, 17, 20, 22]
    # round(i * 10 / 9): ... 4.44, 5.56 -> 4, 6: the one index left out of 11 is 5
    assert evenly_spaced(11, 10) == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]
    assert evenly_spaced(3, 10) == [0, 1, 2] and evenly_spaced(0, 10) == [] and evenly_spaced(7, 1) == [6]
    rng = random.Random(0)
    for _ in range(200):
        n, k = rng.randint(0, 60), rng.randint(2, 15)
        idx = evenly_spaced(n, k)
        assert len(idx) == min(n, k) and idx == sorted(set(idx)) and all(0 <= i < n for i in idx)
        if n > k:
            assert idx[0] == 0 and idx[-1] == n - 1


def test_23_screenshots_the_process_judge_sees_10_evenly():
    traj = run(SCROLLS)  # screenshot 0 in the user message, 1..22 after the 22 scrolls: 23
    # messages: system 0, user 1 (image part 2), assistant 2k and its tool answer 2k+1 (image part 1), done 46
    assert process_evidence(traj) == [(1, 2), (5, 1), (11, 1), (15, 1), (21, 1), (25, 1), (31, 1), (35, 1),
                                      (41, 1), (45, 1)]
    user = process_judge_messages(traj, reference=judge_reference(TASK, STATE))[1]["content"]
    assert [shot_of(p) for p in user if p["type"] == "image_url"] == [f"shot-{k}" for k in evenly_spaced(23, 10)]
    text = "\n".join(p["text"] for p in user if p["type"] == "text")
    assert text.count(NOT_SHOWN) == 13 and text.count("### Step ") == 23  # every step, 22 scrolls + done
    # every observation's text is kept, shown screenshot or not, each line after a label indented
    assert text.count("  " + PAGE.replace("\n", "\n  ")) == 23


def test_the_outcome_judge_sees_the_last_5_turns_and_their_screenshots():
    traj = run(SCROLLS)
    # the last 5 assistant messages: scrolls 19-22 (messages 38..44) and done (46), answered by nothing
    assert outcome_evidence(traj) == [(38, (39, 1)), (40, (41, 1)), (42, (43, 1)), (44, (45, 1)), (46, None)]
    user = outcome_judge_messages(traj)[1]["content"]
    assert [shot_of(p) for p in user if p["type"] == "image_url"] == ["shot-19", "shot-20", "shot-21", "shot-22"]
    text = "\n".join(p["text"] for p in user if p["type"] == "text")
    assert "### Step 19\n" in text and "### Step 18\n" not in text and "### Step 23\nAction: done" in text
    assert "The last 5 of 23 steps" in text and "Avalon has 52,000 inhabitants." in text
    assert "## Reference" not in text  # no task given: no reference block
    # a short run: every turn
    assert [i for i, _ in outcome_evidence(run(SCROLLS[:2]))] == [2, 4, 6]


def test_the_post_action_screenshot_is_the_last_answer_to_a_turn():
    two_calls = Message("assistant", None, tool_calls=[ToolCall("go_back", {}, id="a"), ToolCall("wait", {
        "seconds": 1}, id="b")])
    messages = [Message("user", [image(0)]), two_calls,
                Message("tool", [{"type": "text", "text": "x"}, image(1)], tool_call_id="a"),
                Message("tool", [{"type": "text", "text": "y"}, image(2)], tool_call_id="b"),
                Message("assistant", "no call"), Message("tool", "Error: no tool was run this turn")]
    assert post_action_screenshots(messages) == [(1, (3, 1)), (4, None)]
    assert process_evidence(messages, max_screenshots=2) == [(0, 0), (3, 1)]  # round(0), round(2): first, last


def test_flatten_images_for_a_text_only_judge():
    flat = flatten_images([{"role": "user", "content": [{"type": "text", "text": "a"}, image(3)]},
                           {"role": "system", "content": "s"}])
    assert flat == [{"role": "user", "content": "a\n[image]"}, {"role": "system", "content": "s"}]


def test_parse_judge_score():
    assert parse_judge_score('Looks done. {"score": 0.85, "reason": "cart holds it"}') == (0.85, "cart holds it")
    assert parse_judge_score('```json\n{"score": 1}\n```') == (1.0, "")
    for bad in ("8/10", '{"score": 1.5}', '{"score": true}', '{"verdict": "yes"}'):
        score, why = parse_judge_score(bad)
        assert score is None and "no JSON object" in why


# ---- the programmatic judge --------------------------------------------------------------------------------------


def answer_of(messages):
    return json.loads(programmatic_judge_text("\n".join(m["content"] for m in flatten_images(messages))))


def test_programmatic_outcome_reads_the_checker_and_the_final_state():
    ref = judge_reference(TASK, STATE)
    assert answer_of(outcome_judge_messages(run(SCROLLS[:1]), reference=ref))["score"] == 1.0
    wrong = answer_of(outcome_judge_messages(run(SCROLLS[:1], answer="About 51,000."), reference=ref))
    assert wrong["score"] == 0.0 and "expected 52000" in wrong["reason"]
    # it never called done: no answer
    assert answer_of(outcome_judge_messages(run(SCROLLS[:1], answer=None, termination="step_budget"),
                                            reference=ref))["score"] == 0.0
    # screenshots counted by their labels: 2 turns (scroll + done), one post-action screenshot
    assert answer_of(outcome_judge_messages(run(SCROLLS[:1]), reference=ref))["evidence"]["screenshots"] == 1
    # a state task: the cart in the reference's final state
    cart = GUITask("c", "shop_cart", 1, 0, "/shop/", "Add it.", expected_state={"cart": [{"id": 3, "quantity": 2}]})
    full = {**STATE, "cart": [{"id": 3, "quantity": 2}]}
    assert answer_of(outcome_judge_messages(run(SCROLLS[:1], answer="Added."),
                                            reference=judge_reference(cart, full)))["score"] == 1.0
    # without a reference there is nothing to check against: prose, no score
    text = programmatic_judge_text("\n".join(m["content"] for m in flatten_images(
        outcome_judge_messages(run(SCROLLS[:1])))))
    assert parse_judge_score(text)[0] is None


def test_programmatic_process_counts_lapses():
    clean = run(SCROLLS[:3])
    clean = answer_of(process_judge_messages(clean, reference=judge_reference(TASK, STATE, clean)))
    assert clean["score"] == 1.0 and clean["evidence"]["grounded"] is True
    # step 2 answered by an error, step 3 on a promo page, step 4 repeats step 3 with the same page: 3 lapses
    actions = [("click", {"x": 5, "y": 5}), ("click", {"x": 9000, "y": 5}), ("click", {"x": 7, "y": 7}),
               ("click", {"x": 7, "y": 7})]
    pages = {2: "Error: (9000, 5) is outside the 1280x720 viewport\n" + PAGE, 3: PROMO, 4: PROMO}
    lapsed = run(actions, pages=pages)
    lapses = answer_of(process_judge_messages(lapsed, reference=judge_reference(TASK, STATE, lapsed)))
    assert lapses["evidence"] | {"screenshots": 0} == {"steps": 5, "malformed": 0, "errors": 1, "detours": 2,
                                                       "repeats": 1, "grounded": True, "screenshots": 0}
    # errors 1 + detours 2 (steps 3 and 4) + repeats 1 = 4 lapses: (10 - 4) / 10
    assert lapses["score"] == 0.6
    # an answer no page showed (52,000 is on none of them) is capped at 0.5 even with a clean process
    elsewhere = PAGE.replace("52,000", "51,000")
    made_up = run(SCROLLS[:3], first_page=elsewhere, pages=dict.fromkeys(range(1, 4), elsewhere))
    made_up = answer_of(process_judge_messages(made_up, reference=judge_reference(TASK, STATE, made_up)))
    assert made_up["score"] == 0.5 and made_up["evidence"]["grounded"] is False
    assert "showed 52000" in made_up["reason"]
    # a reference made without the run: what its pages showed is not known, and not checked
    unknown = run(SCROLLS[:3], first_page=elsewhere, pages=dict.fromkeys(range(1, 4), elsewhere))
    unknown = answer_of(process_judge_messages(unknown, reference=judge_reference(TASK, STATE)))
    assert unknown["score"] == 1.0 and unknown["evidence"]["grounded"] is None
    with pytest.raises(ValueError, match="no GUI grading prompt"):
        programmatic_judge_text("hello")


# ---- the RL reward ------------------------------------------------------------------------------------------------


def test_turn_format_and_the_rl_reward():
    good = run(SCROLLS[:2])
    assert turn_format_ok(good) == [True, True, True]
    assert gui_rollout_reward(good, True).reward == 1.0
    assert gui_rollout_reward(good, False).reward == 0.0
    assert gui_rollout_reward(good, None).dropped and gui_rollout_reward(good, True, blocked=True).dropped
    bad = run(SCROLLS[:1])
    bad.messages[2:2] = [Message("assistant", "I will scroll <tool_call>{oops"), Message("tool", "Error: bad")]
    bad.messages[4].tool_calls.append(ToolCall("wait", {"seconds": 1}, id="w"))  # two actions in one turn
    bad.messages.insert(6, Message("assistant", None, tool_calls=[ToolCall("fly", {}, id="f")]))
    bad.messages.insert(7, Message("assistant", None, tool_calls=[ToolCall("click", {"x": "left", "y": 1}, id="g")]))
    # no tool call, two valid calls, an unknown tool, a string coordinate, then done: a turn with one or more valid
    # calls is well formed (issue 33), so the two-call turn and done are
    assert turn_format_ok(bad) == [False, True, False, False, True]
    assert gui_rollout_reward(bad, True).reason == "malformed_turn" and gui_rollout_reward(bad, True).reward == 0.0
    bad.termination_reason = "format_error"
    assert gui_rollout_reward(bad, True).reward == -1.0  # repeated format failures outrank the verdict
    with pytest.raises(ValueError, match="trajectory must be a Trajectory"):
        turn_format_ok("run")


async def test_judge_gui_trajectories_sets_rewards_and_removes(tokenizer):
    solved, wrong = run(SCROLLS[:2]), run(SCROLLS[:2], answer="51,000")
    sloppy = run([("click", {"x": 9000, "y": 5})] * 3, pages={1: "Error: outside\n" + PAGE,
                                                              2: "Error: outside\n" + PAGE, 3: PROMO})
    captcha = run(SCROLLS[:1])  # a task whose way leads through the captcha, and met it
    captcha.task_id = REPORT.id
    captcha.metadata["site_state"]["captcha_hits"] = 2
    broken = run(SCROLLS[:1], answer=None, termination="format_error")
    gone = run(SCROLLS[:1], answer=None, termination="env_error")
    trajs = [solved, wrong, sloppy, captcha, broken, gone]
    stats = await judge_gui_trajectories(ProgrammaticJudge(tokenizer), trajs, tasks=[TASK, REPORT])
    # solved +1 (outcome 1, process 1); wrong 0 (outcome 0, the process judge not asked); sloppy 0 (below);
    # captcha removed (reward untouched: None); format failure -1 unjudged; the sandbox failure left alone
    assert [t.reward for t in trajs] == [1.0, 0.0, 0.0, None, -1.0, None]
    assert solved.reward_components == {"outcome_judge": 1.0, "process_judge": 1.0, "passed": 1.0}
    assert wrong.reward_components == {"outcome_judge": 0.0, "passed": 0.0} and wrong.metadata["judge"]["process"] is None
    # sloppy: errors at steps 1 and 2, step 2 repeats step 1 on the same page, a promo page at step 3:
    # 4 lapses -> (10 - 4) / 10 = 0.6 < 0.8, not complete though the outcome judge said 1
    assert sloppy.reward_components == {"outcome_judge": 1.0, "process_judge": 0.6, "passed": 0.0}
    assert captcha.metadata["removed"] == "captcha_blocked" and "removed" not in gone.metadata
    assert stats == {"rl/judged": 3, "rl/judge_completed": 1, "rl/judge_failures": 0, "rl/judge_unparseable": 0,
                     "rl/captcha_blocked": 1, "rl/captcha_detours": 0, "rl/format_failures": 1}
    # remove_sample: the blocked run does not train; dynamic sampling keeps {+1, 0, 0, -1}
    group = RolloutGroup(TASK.id, (solved, wrong, sloppy, captcha, broken))
    assert group.mask_N.tolist() == [True, True, True, False, True]
    assert filter_groups([[1.0, 0.0, 0.0, -1.0], [0.0, 0.0], [1.0, 1.0]], rule="all_zero_or_all_positive").keep.tolist() \
        == [True, False, False]


async def test_unparseable_and_failing_judges_remove_and_count(tokenizer):
    trajs = [run(SCROLLS[:1]), run(SCROLLS[:2])]
    stats = await judge_gui_trajectories(ScriptedEngine(tokenizer, lambda prompt: "Seems fine!"), trajs, tasks=[TASK])
    assert stats["rl/judge_unparseable"] == 2 and stats["rl/judged"] == 0
    assert all(t.metadata["removed"] == "judge_unparseable" and t.reward is None for t in trajs)
    assert "outcome judge" in trajs[0].metadata["judge_error"]

    def explode(prompt):
        raise RuntimeError("judge engine died")

    fresh = [run(SCROLLS[:1])]
    stats = await judge_gui_trajectories(ScriptedEngine(tokenizer, explode), fresh, tasks=[TASK])
    assert stats["rl/judge_failures"] == 1 and fresh[0].metadata["removed"] == "judge_failure"
    assert "judge engine died" in fresh[0].metadata["judge_error"]
    # the outcome judge without the task has no reference: unparseable, removed
    lost = [run(SCROLLS[:1])]
    await judge_gui_trajectories(ProgrammaticJudge(tokenizer), lost)
    assert lost[0].metadata["removed"] == "judge_unparseable"


async def test_the_process_judge_is_asked_only_after_a_confirmed_outcome(tokenizer):
    asked = []

    def counting(prompt):
        asked.append("outcome" if "# Outcome judge" in prompt else "process")
        return programmatic_judge_text(prompt)

    judge = ScriptedEngine(tokenizer, counting)
    verdict = await judge_gui_trajectory(run(SCROLLS[:1], answer="7"), judge=judge, task=TASK)
    assert asked == ["outcome"] and verdict.completed is False and verdict.process is None
    verdict = await judge_gui_trajectory(run(SCROLLS[:1]), judge=judge, task=TASK)
    assert asked == ["outcome", "outcome", "process"] and verdict.completed and verdict.process == 1.0


def test_by_url_screenshots_go_as_data_urls():
    app, bodies = FastAPI(), []

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        bodies.append(body)
        text = "\n".join(m["content"] for m in flatten_images(body["messages"]))
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": programmatic_judge_text(text)},
                             "finish_reason": "stop"}]}

    traj = run(SCROLLS)
    with serve_in_thread(app) as url:
        stats = asyncio.run(judge_gui_trajectories(url, [traj], tasks=[TASK], model="vl-judge"))
    assert stats["rl/judge_completed"] == 1 and traj.reward == 1.0
    outcome, process = ([shot_of(p) for p in b["messages"][1]["content"] if p["type"] == "image_url"]
                        for b in bodies)
    assert outcome == ["shot-19", "shot-20", "shot-21", "shot-22"]
    assert process == [f"shot-{k}" for k in (0, 2, 5, 7, 10, 12, 15, 17, 20, 22)]
    assert bodies[0]["model"] == "vl-judge" and bodies[0]["temperature"] == 0.0


def test_a_text_only_server_takes_placeholders_and_refuses_images(tokenizer):
    app = build_app(ProgrammaticJudge(tokenizer), tokenizer, model_name="judge", default_max_tokens=512)
    with_text, with_images = run(SCROLLS[:2]), run(SCROLLS[:2])
    with serve_in_thread(app) as url:
        asyncio.run(judge_gui_trajectories(url + "/v1", [with_text], tasks=[TASK], images="placeholder",
                                           model="judge"))
        stats = asyncio.run(judge_gui_trajectories(url, [with_images], tasks=[TASK], model="judge"))
    assert with_text.reward == 1.0
    # orchard's text server answers image parts with HTTP 400: a judge failure, removed and counted
    assert stats["rl/judge_failures"] == 1 and "400" in with_images.metadata["judge_error"]


async def test_judged_gui_rollouts_wraps_a_rollouts(tokenizer):
    class Played:
        async def __call__(self, engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
            return [run(SCROLLS[:1]), run(SCROLLS[:1], answer="0")]

    judged = JudgedGUIRollouts(Played(), ProgrammaticJudge(tokenizer))
    out = await judged(None, [TASK], group_size=2, temperature=1.0)
    assert [t.reward for t in out] == [1.0, 0.0]
    await judged(None, [TASK], group_size=2, temperature=1.0)
    assert judged.stats["rl/judged"] == 2 and judged.totals["rl/judged"] == 4


async def test_bad_arguments(tokenizer):
    judge = ProgrammaticJudge(tokenizer)
    with pytest.raises(ValueError, match="images must be one of"):
        await judge_gui_trajectory(run([]), judge=judge, images="png")
    with pytest.raises(ValueError, match="judge must be an http"):
        await judge_gui_trajectory(run([]), judge="ftp://x")
    with pytest.raises(ValueError, match="outcome_threshold"):
        await judge_gui_trajectory(run([]), judge=judge, outcome_threshold=1.5)
    with pytest.raises(ValueError, match="judge_kwargs has unknown keys"):
        await judge_gui_trajectories(judge, [run([])], temperature=1.0)
    with pytest.raises(ValueError, match="tasks must hold GUITask"):
        await judge_gui_trajectories(judge, [run([])], tasks={"t": "task"})
    with pytest.raises(ValueError, match="max_screenshots must be an int >= 1"):
        process_evidence(run([]), max_screenshots=0)
    with pytest.raises(ValueError, match="last_turns must be an int >= 1"):
        outcome_evidence(run([]), last_turns=0)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        evenly_spaced(3, 0)
    with pytest.raises(ValueError, match="kwargs must not hold tasks"):
        JudgedGUIRollouts(lambda *a, **k: None, judge, tasks=[TASK])
