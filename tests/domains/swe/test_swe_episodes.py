"""`run_swe_episodes` never scores an episode its environment failed: against the real embedded sandbox service,
with the harness program replaced by a fake that reports some episodes and exits, scoring that raises (a bug, a
deleted sandbox) and an episode the program never reported come back ``env_error`` with no reward, while the
others are scored as usual and the batch is kept."""

import asyncio
import json

import pytest

from orchard.data.tokenizer import build_chat_tokenizer
from orchard.domains.swe import tool_rollout
from orchard.domains.swe.generator import make_instance
from orchard.domains.swe.tool_rollout import run_swe_episodes
from orchard.env import AsyncSandboxClient, RetryPolicy
from orchard.env.embedded import serve
from orchard.rollout.program import read_episodes
from orchard.rollout.proxy import RecordingProxy

RUN_ID = "swe-env-errors"


class NeverCalled:
    """The policy: the fake program asks it nothing."""

    async def generate(self, requests):
        raise AssertionError("the model was called")


def fake_program(reported, status=1, env_errors=()):
    """A stand-in for the harness program: reports the episodes whose index is in ``reported`` as finished after
    one turn (those also in ``env_errors`` as the program's own ``env_error``, a sandbox that broke mid-episode),
    writes nothing for the rest, and exits with ``status``. Returns it and the episodes it read."""
    seen = {}

    async def run(argv, env, timeout_s):
        episodes = read_episodes(argv[argv.index("--episodes") + 1])  # as the real program reads them
        with open(argv[argv.index("--out") + 1], "w") as out:
            for episode in episodes:
                seen[episode["session_id"]] = episode["sandbox_id"]
                index = int(episode["session_id"].rsplit("-", 1)[1])
                if index in reported:
                    broken = index in env_errors
                    out.write(json.dumps({
                        "session_id": episode["session_id"], "sandbox_id": episode["sandbox_id"],
                        "termination_reason": "env_error" if broken else "done",
                        "error": "sandbox: SandboxGone: 404" if broken else None,
                        "steps": 1, "format_errors": 0, "tool_calls": 0,
                        "messages": [{"role": "user", "content": episode["prompt"]},
                                     {"role": "assistant", "content": "I changed nothing."}],
                        "wall_s": 0.1}) + "\n")
        return status, "the program crashed" if status else ""

    return run, seen


def play(monkeypatch, program, score=None, group_size=4, prepare=None):
    monkeypatch.setattr(tool_rollout, "_run_program", program)
    if score is not None:
        monkeypatch.setattr(tool_rollout, "score_sandbox", score)
    if prepare is not None:
        monkeypatch.setattr(tool_rollout, "prepare_sandbox", prepare)
    instance = make_instance("graph", 2, level=1)
    tokenizer = build_chat_tokenizer()

    async def main(service):
        retry = RetryPolicy(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.01)
        async with AsyncSandboxClient(service.url, service.api_key, retry=retry) as client:
            proxy = RecordingProxy(NeverCalled(), tokenizer)
            try:
                trajectories = await run_swe_episodes([instance], client=client, proxy=proxy, group_size=group_size,
                                                      run_id=RUN_ID, test_timeout_s=60.0)
            finally:
                await proxy.aclose()
            left = [s["sandbox_id"] for s in await client.list_sandboxes()]
            return trajectories, left

    with serve() as service:
        return asyncio.run(main(service))


def test_scoring_that_fails_or_an_episode_never_reported_is_env_error(monkeypatch):
    program, sandbox_of = fake_program(reported={0, 1, 2})
    real_score = tool_rollout.score_sandbox
    scored = []

    async def score(sandbox, instance, *args, **kwargs):
        scored.append(sandbox.sandbox_id)
        if sandbox.sandbox_id == sandbox_of[f"{RUN_ID}-1"]:
            raise RuntimeError("scoring broke")  # a bug while scoring: not an environment error class
        if sandbox.sandbox_id == sandbox_of[f"{RUN_ID}-2"]:
            await sandbox.delete()  # the sandbox is gone when scoring starts
        return await real_score(sandbox, instance, *args, **kwargs)

    trajectories, left = play(monkeypatch, program, score)
    assert len(trajectories) == 4 and len(scored) == 3  # the unreported episode is not scored at all
    played, broken, deleted, unreported = trajectories
    # the episode that was played and scored: nothing changed, so not resolved
    assert played.termination_reason == "done" and played.reward == -1.0 and played.metadata["error"] is None
    assert played.reward_components["empty_patch"] == 1.0
    for traj in (broken, deleted, unreported):
        assert traj.termination_reason == "env_error" and traj.reward is None and not traj.valid
        assert traj.is_env_error and not traj.passed and traj.reward_components == {}
    assert broken.metadata["error"] == "score: RuntimeError: scoring broke"
    assert deleted.metadata["error"].startswith("score: ")
    assert unreported.metadata["error"].startswith("program: no report (exit 1): the program crashed")
    assert not [s for s in left if s in sandbox_of.values()]  # every sandbox deleted


@pytest.mark.parametrize("status", [0, 1, None])  # a clean exit, a crash, killed for time
def test_a_program_that_reports_nothing_leaves_every_episode_env_error(monkeypatch, status):
    program, sandbox_of = fake_program(reported=set(), status=status)
    scored = []

    async def score(sandbox, instance, *args, **kwargs):
        scored.append(sandbox.sandbox_id)
        raise AssertionError("an unreported episode was scored")

    trajectories, left = play(monkeypatch, program, score, group_size=2)
    assert scored == [] and len(sandbox_of) == 2
    for traj in trajectories:
        assert traj.termination_reason == "env_error" and traj.reward is None
        assert traj.metadata["error"].startswith(f"program: no report (exit {status})")
    assert not [s for s in left if s in sandbox_of.values()]


def test_a_preparation_that_raises_anything_is_env_error_and_the_batch_is_kept(monkeypatch):
    program, sandbox_of = fake_program(reported={0, 1, 2})
    real_prepare = tool_rollout.prepare_sandbox
    prepared = []

    async def prepare(sandbox, instance, **kwargs):
        prepared.append(sandbox.sandbox_id)
        if len(prepared) == 2:
            raise ValueError("instance.repo_dir '/gone' is not a directory")  # a bad instance, not a sandbox error
        return await real_prepare(sandbox, instance, **kwargs)

    trajectories, left = play(monkeypatch, program, prepare=prepare, group_size=3)
    assert len(prepared) == 3 and len(trajectories) == 3
    failed = [t for t in trajectories if t.termination_reason == "env_error"]
    played = [t for t in trajectories if t.termination_reason == "done"]
    assert len(failed) == 1 and len(played) == 2  # the other two were played and scored
    assert failed[0].reward is None and failed[0].metadata["error"] == (
        "prepare: ValueError: instance.repo_dir '/gone' is not a directory")
    assert failed[0].metadata["session_id"] not in sandbox_of  # never handed to the program
    assert all(t.reward == -1.0 for t in played)
    assert not set(prepared) & set(left)  # every sandbox deleted, the failed episode's too


def test_an_episode_the_program_reports_as_env_error_or_cuts_short_is_never_scored(monkeypatch):
    # Episode 0 broke inside the program (its own env_error), 1 was played to the end, 2's report was cut
    # mid-line by a crash (exit 1): only episode 1 is scored; 0 and 2 keep reward None, never the policy's -1.
    reporting, sandbox_of = fake_program(reported={0, 1}, status=1, env_errors={0})

    async def program(argv, env, timeout_s):
        status, stderr = await reporting(argv, env, timeout_s)
        with open(argv[argv.index("--out") + 1], "a") as out:
            out.write(json.dumps({"session_id": f"{RUN_ID}-2", "termination_reason": "done"})[:30])
        return status, stderr

    real_score = tool_rollout.score_sandbox
    scored = []

    async def score(sandbox, instance, *args, **kwargs):
        scored.append(sandbox.sandbox_id)
        return await real_score(sandbox, instance, *args, **kwargs)

    trajectories, left = play(monkeypatch, program, score, group_size=3)
    broken, played, cut = trajectories
    assert scored == [sandbox_of[f"{RUN_ID}-1"]]
    assert played.termination_reason == "done" and played.reward == -1.0  # nothing changed: not resolved
    assert broken.termination_reason == "env_error" and broken.reward is None and broken.reward_components == {}
    assert broken.metadata["error"] == "sandbox: SandboxGone: 404" and broken.metadata["tests"] == {}
    assert cut.termination_reason == "env_error" and cut.reward is None
    assert cut.metadata["error"] == "program: no report (exit 1): the program crashed"
    assert not [s for s in left if s in sandbox_of.values()]
