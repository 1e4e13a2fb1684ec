"""The Claw text harness as a separate program behind the recording proxy, against the real embedded sandbox
service: the scripted teacher solves one task per template, malformed replies end in format_error, a sandbox
deleted mid-run gives env_error, and the proxy's samples equal rendering the same conversations directly; with a
sandbox that hangs (a fake), a tool call past the episode's deadline ends it in time_budget."""

import asyncio
import copy
import json
import signal

import httpx
import pytest
import torch
from fastapi import FastAPI

from orchard.data import Message, Trajectory, render_turns
from orchard.data.tokenizer import build_chat_tokenizer
from orchard.domains.claw import text_harness, text_rollout, world
from orchard.domains.claw.convention import TEXT_SYSTEM
from orchard.domains.claw.tasks import TEMPLATES, make_task
from orchard.domains.claw.teacher import TeacherEngine
from orchard.domains.claw.text_rollout import run_text_episodes, summarize_text_episodes
from orchard.env import AsyncSandboxClient, RetryPolicy
from orchard.env.embedded import serve
from orchard.rollout.engine import Completion, GenerateResult
from orchard.rollout.proxy import RecordingProxy
from orchard.rollout.serving import serve_app

RUN_ID = "texttest"
MALFORMED = "Let me look at the mail first."
MALFORMED_LOGPROB = -0.5
LOOPING = "Action: list_items {}"


def first_user_turn(prompt_text: str) -> str:
    return prompt_text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]


class FaultyTeacher:
    """The scripted teacher, except on three tasks: on ``malformed`` it always answers prose (log-prob -0.5 per
    token); on ``looping`` it lists the inventory forever; on ``doomed`` it deletes the episode's sandbox before
    answering the second call."""

    def __init__(self, teacher, tokenizer, *, malformed, looping, doomed, doom):
        self.teacher, self.tokenizer = teacher, tokenizer
        self.malformed, self.looping, self.doomed, self.doom = malformed, looping, doomed, doom
        self.doomed_at_call = None

    async def generate(self, requests):
        out = []
        for request in requests:
            text = self.tokenizer.decode(list(request.prompt_ids))
            user = first_user_turn(text)
            if user in (self.malformed, self.looping):
                reply = MALFORMED if user == self.malformed else LOOPING
                ids = self.tokenizer.encode(reply + self.tokenizer.eos_token, add_special_tokens=False)
                completion = Completion(ids, [MALFORMED_LOGPROB] * len(ids), "stop")
                out.append(GenerateResult(tuple(request.prompt_ids), [completion]))
                continue
            turns_done = text.count("<|im_start|>assistant\n") - 1
            if user == self.doomed and turns_done == 1 and self.doomed_at_call is None:
                self.doomed_at_call = turns_done
                await self.doom()
            out.extend(await self.teacher.generate([request]))
        return out

    async def update_weights(self, weights):
        raise NotImplementedError

    async def close(self):
        return None


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


@pytest.fixture(scope="module")
def service():
    with serve() as svc:
        yield svc


def sandbox_client(service):
    retry = RetryPolicy(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.01)
    return AsyncSandboxClient(service.url, service.api_key, retry=retry)


@pytest.fixture(scope="module")
def batch(tokenizer, service):
    """One batch through the program: one task per template (the teacher), one malformed, one looping, one
    doomed (in this order, last)."""
    solved = [make_task(t, 7) for t in TEMPLATES]
    malformed, looping, doomed = make_task("set_stock", 8), make_task("set_stock", 9), make_task("order_flow", 8)
    tasks = [*solved, malformed, looping, doomed]
    assert len({t.prompt for t in tasks}) == len(tasks)
    argvs = []
    run_program = text_rollout._run_program

    async def spy(argv, env, timeout_s):
        argvs.append((argv, env))
        return await run_program(argv, env, timeout_s)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(text_rollout, "_run_program", spy)

        async def main():
            async with sandbox_client(service) as client:
                doomed_id = f"{RUN_ID}-{len(tasks) - 1}"  # episode i is named f"{run_id}-{i}"

                async def doom():
                    await client.request("DELETE", f"/sandboxes/{doomed_id}")

                engine = FaultyTeacher(TeacherEngine(tokenizer, tasks), tokenizer,
                                       malformed=malformed.prompt, looping=looping.prompt, doomed=doomed.prompt,
                                       doom=doom)
                proxy = RecordingProxy(engine, tokenizer)
                try:
                    episodes = await run_text_episodes(
                        tasks, client=client, proxy=proxy, concurrency=3, run_id=RUN_ID)
                    left = [s["sandbox_id"] for s in await client.list_sandboxes()]
                    return episodes, engine, proxy.sessions(), left
                finally:
                    await proxy.aclose()

        episodes, engine, sessions_after, sandboxes_after = asyncio.run(main())
    return {"episodes": episodes, "tasks": tasks, "solved": solved, "engine": engine, "argvs": argvs, "api_key": service.api_key,
            "sessions_after": sessions_after, "sandboxes_after": sandboxes_after}


@pytest.mark.slow
def test_teacher_solves_every_template_through_the_program(batch):
    episodes = batch["episodes"]
    assert [e.task_id for e in episodes[: len(batch["solved"])]] == [t.id for t in batch["solved"]]
    for episode, task in zip(episodes, batch["solved"], strict=False):
        meta, messages = episode.metadata, [m.to_openai() for m in episode.messages]
        assert episode.termination_reason == "done", (task.id, meta["error"], messages[-2:])
        assert episode.reward == 1.0 and episode.valid, (task.id, episode.reward_components)
        assert episode.reward_components["passed"] == 1.0 and episode.reward_components["safety"] == 1.0
        # len(plan) tool turns then the Final turn; 2 + 2 * len(plan) + 1 messages.
        assert meta["steps"] == episode.num_steps == len(task.plan) + 1 and meta["tool_calls"] == len(task.plan)
        assert meta["format_errors"] == 0 and meta["harness"] == "text"
        assert len(messages) == 2 + 2 * len(task.plan) + 1
        assert messages[0] == {"role": "system", "content": TEXT_SYSTEM}
        assert messages[1] == {"role": "user", "content": task.prompt}
        assert messages[-1]["content"].startswith("Final:")
        for observation in messages[3:-1:2]:
            assert observation["role"] == "user" and observation["content"].startswith("Observation: ")
            assert not observation["content"].startswith("Observation: error"), (task.id, observation)
    # Every session's calls were taken out of the proxy, and every sandbox was deleted.
    assert batch["sessions_after"] == []
    assert not [s for s in batch["sandboxes_after"] if s.startswith(RUN_ID)]


@pytest.mark.slow
def test_proxy_samples_equal_rendering_the_conversation(batch, tokenizer):
    for episode in batch["episodes"]:
        if episode.termination_reason == "env_error":
            continue
        # Text only (no token ids): the template's own ids of every assistant turn.
        traj = Trajectory(messages=[Message.from_dict(m.to_openai()) for m in episode.messages])
        reference = render_turns(traj, tokenizer)
        assert len(episode.samples) == len(reference) == episode.metadata["steps"], episode.task_id
        for k, (got, want) in enumerate(zip(episode.samples, reference, strict=True)):
            assert torch.equal(got.input_ids, want.input_ids), (episode.task_id, k)
            assert torch.equal(got.action_mask, want.action_mask), (episode.task_id, k)
            assert torch.equal(got.turn_index[got.action_mask], torch.full_like(got.turn_index[got.action_mask], k))
            # The prompt is masked, the sampled output (ending in the end-of-turn token) supervised.
            n_out = int(got.action_mask.sum())
            assert n_out > 0 and bool(got.action_mask[-n_out:].all()) and not got.action_mask[:-n_out].any()
            assert got.input_ids[-1].item() == tokenizer.eos_token_id
            assert bool(got.logprob_mask[got.action_mask].all())
        # The trajectory's assistant turns carry the recorded ids, so it renders to the same samples too.
        for got, want in zip(episode.samples, render_turns(episode, tokenizer), strict=True):
            assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.old_logprobs, want.old_logprobs)


@pytest.mark.slow
def test_malformed_replies_end_in_format_error_with_reward_minus_one(batch, tokenizer):
    episode = batch["episodes"][-3]
    assert episode.termination_reason == "format_error"
    assert episode.reward == -1.0 and episode.valid
    # Nothing was done: completion 0 (the stock check fails), so the verdict fails.
    assert episode.reward_components["completion"] == 0.0 and episode.reward_components["passed"] == 0.0
    meta = episode.metadata
    assert (meta["steps"], meta["format_errors"], meta["tool_calls"]) == (3, 3, 0)
    assert [m.content for m in episode.messages[2::2]] == [MALFORMED] * 3
    assert all(m.content.startswith("Observation: error: expected") for m in episode.messages[3::2])
    # The sampling log-probs travel through the proxy onto the action tokens (-0.5 each), 0 on the prompt.
    expected_ids = tokenizer.encode(MALFORMED + tokenizer.eos_token, add_special_tokens=False)
    for sample in episode.samples:
        assert sample.input_ids[sample.action_mask].tolist() == expected_ids
        assert torch.allclose(sample.old_logprobs[sample.action_mask], torch.tensor(MALFORMED_LOGPROB))
        assert bool((sample.old_logprobs[~sample.action_mask] == 0).all())


@pytest.mark.slow
def test_valid_calls_without_an_end_run_out_of_steps(batch):
    episode, task = batch["episodes"][-2], batch["tasks"][-2]
    meta = episode.metadata
    # The default budget: 6 turns, each a valid call (no format error), then step_budget; the stock is unchanged.
    assert (episode.termination_reason, meta["steps"], meta["tool_calls"], meta["format_errors"]) == (
        "step_budget", 6, 6, 0)
    assert len(episode.samples) == 6
    assert episode.reward == -1.0 and episode.reward_components["completion"] == 0.0
    # Each observation is the world's listing of this task's initial inventory, run in the sandbox.
    listing = world.apply_tool(copy.deepcopy(task.state), "list_items", {})
    assert [m.content for m in episode.messages[3::2]] == [f"Observation: {listing}"] * 6


@pytest.mark.slow
def test_sandbox_deleted_mid_run_is_env_error_and_unscored(batch):
    episode = batch["episodes"][-1]
    assert batch["engine"].doomed_at_call == 1
    assert episode.termination_reason == "env_error" and not episode.valid
    assert episode.reward is None and episode.reward_components == {}
    assert episode.metadata["error"].startswith("sandbox: NotFoundError"), episode.metadata["error"]
    # The first call ran its tool; the second answer could not.
    assert (episode.metadata["steps"], episode.metadata["tool_calls"]) == (2, 1)
    metrics = summarize_text_episodes(batch["episodes"])
    assert metrics["text/env_errors"] == 1.0 and metrics["text/format_error_episodes"] == 1.0
    # One solved task per template (11) + 2 failed are scored (the env_error is not): success 11 / 13.
    assert len(batch["solved"]) == len(TEMPLATES) == 11
    assert metrics["text/success_rate"] == pytest.approx(11 / 13)


@pytest.mark.slow
def test_the_service_key_never_reaches_the_command_line(batch):
    [(argv, env)] = batch["argvs"]
    assert batch["api_key"] not in " ".join(argv)
    assert env[argv[argv.index("--env-key-env") + 1]] == batch["api_key"]


@pytest.mark.slow
def test_a_program_that_reports_nothing_gives_env_errors_and_cleans_up(tokenizer, service):
    tasks = [make_task("add_event", 3), make_task("write_note", 3)]

    async def main():
        async with sandbox_client(service) as client:
            proxy = RecordingProxy(TeacherEngine(tokenizer, tasks), tokenizer)
            try:
                # Not an http URL: the program refuses its arguments (exit 2) before playing anything.
                episodes = await run_text_episodes(tasks, client=client, proxy=proxy, proxy_url="ftp://nowhere",
                                                   run_id="textcrash", group_size=2)
                return episodes, proxy.sessions(), [s["sandbox_id"] for s in await client.list_sandboxes()]
            finally:
                await proxy.aclose()

    episodes, sessions, sandboxes = asyncio.run(main())
    assert [(e.task_id, e.metadata["group_index"], e.metadata["session_id"]) for e in episodes] == [
        (tasks[0].id, 0, "textcrash-0"), (tasks[0].id, 1, "textcrash-1"),
        (tasks[1].id, 0, "textcrash-2"), (tasks[1].id, 1, "textcrash-3")]
    for e in episodes:
        assert e.termination_reason == "env_error" and e.reward is None and not e.valid
        assert "no report (exit 2)" in e.metadata["error"] and "model_url" in e.metadata["error"], e.metadata
        assert e.samples == [] and e.metadata["steps"] == 0
    assert sessions == [] and not [s for s in sandboxes if s.startswith("textcrash")]


def test_serve_app_runs_on_the_callers_loop_and_leaves_signals_alone():
    app, seen = FastAPI(), []

    @app.get("/loop")
    async def which_loop():
        seen.append(asyncio.get_running_loop())
        return {"ok": True}

    async def main():
        before = signal.getsignal(signal.SIGINT)
        async with serve_app(app) as url, httpx.AsyncClient() as http:
            during = signal.getsignal(signal.SIGINT)
            status = (await http.get(url + "/loop")).status_code
        async with httpx.AsyncClient() as http:
            with pytest.raises(httpx.ConnectError):  # stopped on exit
                await http.get(url + "/loop")
        return asyncio.get_running_loop(), before, during, status

    loop, before, during, status = asyncio.run(main())
    assert status == 200 and seen == [loop] and during is before


def test_summary_counts_by_hand():
    def episode(reason, steps, format_errors=0, reward=None):
        return Trajectory(reward=reward, termination_reason=reason, task_id="t",
                          metadata={"steps": steps, "format_errors": format_errors})

    episodes = [episode("done", 2, reward=1.0), episode("format_error", 3, 3, reward=-1.0),
                episode("step_budget", 6, 1, reward=-1.0), episode("env_error", 1)]
    metrics = summarize_text_episodes(episodes)
    # scored: a, b, c -> 1 pass / 3; steps (2 + 3 + 6 + 1) / 4 = 3; format errors 3 + 1 = 4.
    assert metrics == {
        "text/episodes": 4.0, "text/env_errors": 1.0, "text/format_error_episodes": 1.0,
        "text/format_errors": 4.0, "text/success_rate": pytest.approx(1 / 3), "text/mean_steps": 3.0,
        "text/termination/done": 1.0, "text/termination/format_error": 1.0,
        "text/termination/step_budget": 1.0, "text/termination/env_error": 1.0}
    assert summarize_text_episodes([]) == {
        "text/episodes": 0.0, "text/env_errors": 0.0, "text/format_error_episodes": 0.0,
        "text/format_errors": 0.0, "text/success_rate": 0.0, "text/mean_steps": 0.0}
    with pytest.raises(ValueError, match="trajectories"):
        summarize_text_episodes([{"reward": 1.0}])


def test_run_text_episodes_rejects_bad_arguments(tokenizer):
    task = make_task("add_event", 1)
    proxy = RecordingProxy(TeacherEngine(tokenizer, [task]), tokenizer)
    client = AsyncSandboxClient("http://127.0.0.1:9", "k")

    async def call(tasks=(task,), **kwargs):
        await run_text_episodes(list(tasks), **{"client": client, "proxy": proxy, **kwargs})

    for kwargs, name in [({"tasks": ()}, "tasks"), ({"tasks": ["x"]}, "tasks"), ({"group_size": 0}, "group_size"),
                         ({"concurrency": 0}, "concurrency"), ({"top_p": 0.0}, "top_p"),
                         ({"max_time_s": 0}, "max_time_s"), ({"run_id": "a/b"}, "run_id"),
                         ({"proxy": "http://x"}, "proxy"), ({"client": object()}, "client")]:
        with pytest.raises(ValueError, match=name):
            asyncio.run(call(**kwargs))


def test_program_refuses_unusable_input(tmp_path, monkeypatch, capsys):
    episodes = tmp_path / "episodes.jsonl"
    out = str(tmp_path / "out.jsonl")
    base = ["--model-url", "http://127.0.0.1:9", "--env-url", "http://127.0.0.1:9", "--env-key-env", "CLAW_KEY",
            "--episodes", str(episodes), "--out", out]
    monkeypatch.setenv("CLAW_KEY", "secret")
    for lines, message in [
        (['{"session_id": "s", "prompt": "p"}'], "sandbox_id"),
        (["not json"], "not JSON"),
        ([json.dumps({"session_id": "s", "sandbox_id": "b", "prompt": "p"})] * 2, "repeats session_id"),
    ]:
        episodes.write_text("\n".join(lines) + "\n")
        with pytest.raises(SystemExit) as exit_info:
            text_harness.main(base)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    episodes.write_text(json.dumps({"session_id": "s", "sandbox_id": "b", "prompt": "p"}) + "\n")
    monkeypatch.delenv("CLAW_KEY")
    with pytest.raises(SystemExit):
        text_harness.main(base)
    assert "CLAW_KEY" in capsys.readouterr().err
    assert text_harness.chat_url("http://h:1/v1/") == text_harness.chat_url("http://h:1") == \
        "http://h:1/v1/chat/completions"
    with pytest.raises(ValueError, match="model_url"):
        text_harness.chat_url("h:1")


def test_a_tool_call_past_the_episode_deadline_is_time_budget_on_python_310(python_310_timeouts, episode_against_a_hanging_sandbox):
    # Before the fix the tool's wait caught the builtin TimeoutError, which 3.10's wait_for does not raise: the 3.10
    # error escaped the episode instead of ending it in time_budget.
    reply = {"choices": [{"message": {"role": "assistant", "content": "Action: list_mail {}"}}]}
    # the episode has 1 s; the tool's wait is min(1 s left, exec_timeout_s 30 + 30) = the time left
    settings = text_harness.Settings(model_url="http://model", max_time_s=1.0)
    episode = {"session_id": "e", "sandbox_id": "s", "prompt": "Read my mail."}

    out = episode_against_a_hanging_sandbox(text_harness, settings, episode, reply)
    assert (out["termination_reason"], out["steps"], out["tool_calls"], out["error"]) == ("time_budget", 1, 0, None)
