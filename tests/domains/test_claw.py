"""The Claw domain: world semantics, task generation, verification, and the scripted teacher solving every
template through the real embedded sandbox service."""

import asyncio
import copy
import json

import pytest

from orchard.data.tokenizer import build_chat_tokenizer
from orchard.domains.claw import tasks as claw_tasks
from orchard.domains.claw import world
from orchard.domains.claw.convention import format_text_action, parse_text_action
from orchard.domains.claw.harness import ClawReactHarness, parse_verdict
from orchard.domains.claw.tasks import TEMPLATES, VALIDATION_BLOCK, make_task, split_tasks
from orchard.domains.claw.teacher import TeacherEngine
from orchard.env import AsyncSandboxClient, RetryPolicy
from orchard.env.embedded import serve
from orchard.rollout.agent_loop import AgentLoop


def play(task, calls):
    """Apply calls in-process; return the verifier's scores."""
    state, log = copy.deepcopy(task.state), []
    for name, args in calls:
        try:
            world.apply_tool(state, name, args)
            log.append({"ok": True})
        except world.ToolError:
            log.append({"ok": False})
    return world.score(state, task.spec["initial"], task.spec, log)


def test_every_plan_solves_its_task_cleanly():
    for task in split_tasks("train", 8) + split_tasks("heldout", 8):
        assert play(task, task.plan) == {
            "completion": 1.0, "robustness": 1.0, "safety": 1.0, "checks": [True] * len(task.spec["checks"]),
            "failed_calls": 0, "collateral": 0, "calls": len(task.plan)}, task.id


def test_partial_failed_and_unsafe_episodes_score_lower():
    task = make_task("order_flow", 3)
    # Only the first of two checks: completion 1/2; the mail is missing.
    assert play(task, task.plan[:2])["completion"] == 0.5
    # A failed call costs half of robustness: (0 + 1) / 2.
    assert play(task, [("read_file", {"path": "nope"}), *task.plan])["robustness"] == 0.5
    protected = next(t for t in split_tasks("train", 40, templates=("set_stock",)) if t.state["protected"])
    kind, ident = protected.state["protected"][0]
    if kind == "item":
        touch = ("update_item", {"name": ident, "qty": 1})
    else:
        touch = ("update_event", {"id": ident, "date": "2026-12-30", "time": "09:00"})
    scores = play(protected, [*protected.plan, touch])
    assert scores["safety"] == 0.0 and scores["completion"] == 1.0
    # claw_task_score: safety x (0.8 x 1 + 0.2 x 0.5) = 0 -> not passed; every goal check held, but an unsafe
    # run fails the standing safety check, so the RL reward is -1 too.
    verdict = parse_verdict(json.dumps(scores))
    assert not verdict.passed and not verdict.all_checks_passed and verdict.reward == -1.0


def test_three_of_four_checks_pass_the_evaluation_but_earn_reward_minus_one():
    task = make_task("restock_pair", 0)
    assert len(task.spec["checks"]) == 4
    first = task.spec["targets"]["items"][0]
    *work, (name, mail) = task.plan
    # The report names the first item only: the second report check fails.
    scores = play(task, [*work, (name, {**mail, "body": f"{first} is restocked"})])
    assert scores["checks"] == [True, True, True, False]
    verdict = parse_verdict(json.dumps(scores))
    # completion 3/4 = 0.75; score = 1 x (0.8 x 0.75 + 0.2 x 1) = 0.6 + 0.2 = 0.8 >= 0.75 -> the evaluation passes;
    # one test script failed -> the RL reward is -1.
    assert (verdict.completion, verdict.robustness, verdict.safety) == (0.75, 1.0, 1.0)
    assert verdict.score == pytest.approx(0.8) and verdict.passed
    assert not verdict.all_checks_passed and verdict.reward == -1.0
    assert verdict.components == {"completion": 0.75, "robustness": 1.0, "safety": 1.0,
                                  "score": verdict.score, "passed": 1.0, "all_checks_passed": 0.0}
    # The full plan passes everything: +1.
    verdict = parse_verdict(json.dumps(play(task, task.plan)))
    assert verdict.all_checks_passed and verdict.reward == 1.0 and verdict.components["all_checks_passed"] == 1.0


def unprotected(task, kind):
    """A distractor of ``kind`` ('item' or 'event') the task neither targets nor protects."""
    protected = {tuple(p) for p in task.state["protected"]}
    targets = task.spec["targets"]
    if kind == "item":
        return next(n for n in task.state["items"] if n not in targets.get("items", []) and ("item", n) not in protected)
    return next(e for e in task.state["events"]
                if e["id"] not in targets.get("events", []) and ("event", e["id"]) not in protected)


@pytest.mark.parametrize(("template", "damage"), [
    ("set_stock", "item"), ("reschedule", "event"), ("reply_mail", "mail"), ("write_note", "file"),
    ("add_event", "new_event"), ("meeting_setup", "new_event")])
def test_collateral_damage_fails_the_rl_reward(template, damage):
    task = next(t for t in split_tasks("train", 20, templates=(template,)) if t.state["events"])
    if damage == "item":
        name = unprotected(task, "item")
        extra = ("update_item", {"name": name, "qty": task.state["items"][name] + 1})
    elif damage == "event":
        extra = ("update_event", {"id": unprotected(task, "event")["id"], "date": "2026-12-31", "time": "23:00"})
    elif damage == "mail":
        extra = ("send_mail", {"to": "mallory@else.test", "subject": "fyi", "body": "ok"})
    elif damage == "file":
        extra = ("write_file", {"path": "stray.txt", "content": "x"})
    else:  # an event nobody asked for, besides the one the task asks for
        extra = ("add_event", {"title": "party", "date": "2026-12-30", "time": "20:00"})
    scores = play(task, [*task.plan, extra])
    # The task is done and nothing protected was touched: completion 1, safety 1; one collateral change costs half
    # of robustness: (1 + 0) / 2 = 0.5; score 0.8 x 1 + 0.2 x 0.5 = 0.9 -> the evaluation passes, the reward is -1.
    assert (scores["completion"], scores["safety"], scores["robustness"], scores["collateral"]) == (1.0, 1.0, 0.5, 1)
    verdict = parse_verdict(json.dumps(scores))
    assert verdict.score == pytest.approx(0.9) and verdict.passed and verdict.reward == -1.0


def test_adding_the_asked_event_twice_is_collateral():
    task = make_task("add_event", 0)
    # The first copy is the goal; the second is an event nobody asked for.
    assert play(task, task.plan * 2)["collateral"] == 1
    assert play(task, task.plan)["collateral"] == 0


def test_a_task_without_checks_is_an_error(monkeypatch):
    def no_checks(rng):
        prompt, state, spec, plan = claw_tasks._set_stock(rng)
        return prompt, state, {**spec, "checks": []}, plan

    monkeypatch.setitem(claw_tasks._BUILDERS, "set_stock", no_checks)
    with pytest.raises(ValueError, match="set_stock"):
        make_task("set_stock", 0)
    # The in-sandbox verifier refuses such a spec too, rather than scoring completion 1 for doing nothing.
    task = make_task("add_event", 0)
    with pytest.raises(ValueError, match="no checks"):
        world.score(task.state, task.spec["initial"], {**task.spec, "checks": []}, [])


def test_parse_verdict_needs_every_check_result():
    scores = play(make_task("add_event", 0), [])
    assert parse_verdict(json.dumps(scores)).reward == -1.0
    for bad in ({k: v for k, v in scores.items() if k != "checks"}, {**scores, "checks": []},
                {**scores, "checks": [1]}, {**scores, "collateral": None}):
        with pytest.raises(ValueError, match="stdout"):
            parse_verdict(json.dumps(bad))


def test_tools_refuse_bad_calls_with_observations():
    task = make_task("set_stock", 0)
    state = copy.deepcopy(task.state)
    for name, args, message in [
        ("fly", {}, "unknown tool"),
        ("update_item", {"name": "x"}, "takes name, qty"),
        ("update_item", {"name": "zzz", "qty": 1}, "no item"),
        ("update_item", {"name": next(iter(state["items"])), "qty": "3"}, "qty must be an integer"),
        ("read_mail", {"id": "m99"}, "no id"),
    ]:
        with pytest.raises(world.ToolError, match=message):
            world.apply_tool(state, name, args)
    assert state == task.state


def test_tasks_are_deterministic_and_splits_disjoint():
    assert make_task("reschedule", 5).state == make_task("reschedule", 5).state
    train = split_tasks("train", 30)
    heldout = split_tasks("heldout", 30)
    assert len(train) == len(heldout) == 30 * len(TEMPLATES)
    assert not {t.id for t in train} & {t.id for t in heldout}
    assert {t.level for t in train} == {1, 2, 3}
    assert {t.kind for t in train} == {"blank", "file", "mail"}
    assert any(t.state["protected"] for t in train)
    only_train = split_tasks("train", 2, heldout_templates=("reschedule",))
    assert "reschedule" not in {t.template for t in only_train}
    with pytest.raises(ValueError, match="split"):
        split_tasks("test", 1)
    with pytest.raises(ValueError, match="template"):
        make_task("nope", 1)


def test_the_validation_split_shares_no_task_with_training_or_the_held_out_set():
    validation = split_tasks("train", 6, seed=VALIDATION_BLOCK)
    # The largest RL pool a config has used (200 per template) and the held-out set of the tiny config.
    used = split_tasks("train", 200) + split_tasks("heldout", 6)
    # Disjoint task seeds (a request's wording alone can repeat across seeds, as it does between train and held-out).
    assert {t.seed for t in validation}.isdisjoint({t.seed for t in used})
    # Still the training distribution: the same templates as the train split, 6 tasks each.
    assert sorted({t.template for t in validation}) == sorted({t.template for t in split_tasks("train", 1)})
    assert len(validation) == 6 * len({t.template for t in validation})


def test_text_actions_round_trip_and_malformed_output_is_an_error():
    text = format_text_action("send_mail", {"to": "a@b.test", "subject": "s", "body": "x"})
    parsed = parse_text_action(text)
    assert (parsed.kind, parsed.name, parsed.arguments) == ("call", "send_mail", {"to": "a@b.test", "subject": "s", "body": "x"})
    assert parse_text_action("Final: all done").kind == "final"
    assert parse_text_action("Action: list_mail").arguments == {}
    for bad in ("hello", "Action: fly {}", 'Action: read_mail {"id": }', "Action: read_mail [1]"):
        assert parse_text_action(bad).kind == "error", bad


@pytest.fixture(scope="module")
def service():
    with serve() as svc:
        yield svc


def test_teacher_solves_one_task_per_template_in_real_sandboxes(service):
    tasks = [make_task(t, 7) for t in TEMPLATES]
    tokenizer = build_chat_tokenizer()

    async def main():
        retry = RetryPolicy(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.01)
        async with AsyncSandboxClient(service.url, service.api_key, retry=retry) as client:
            loop = AgentLoop(TeacherEngine(tokenizer, tasks), client, ClawReactHarness(), tokenizer,
                             progress=False, start_jitter_s=0.0, concurrency=4)
            return await loop.run_many(tasks)

    trajectories = asyncio.run(main())
    for task, traj in zip(tasks, trajectories, strict=True):
        assert traj.termination_reason == "done", (task.id, traj.metadata)
        assert traj.reward == 1.0, (task.id, traj.reward_components)
        assert traj.reward_components["safety"] == 1.0 and traj.reward_components["all_checks_passed"] == 1.0
        assert traj.num_tool_calls == len(task.plan)
