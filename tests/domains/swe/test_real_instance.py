"""A real SWE-bench-format instance end to end: cachetools issue #130 (a public fix, see `cachetools_130/README.md`),
its repository a local git clone at ``base_commit`` built at test time. Loaded from JSONL with ``repo_root``; a
snapshot not at its base commit refused naming the instance; scored in the real embedded sandbox service (no patch
-1, the real fix +1); the scripted teacher (which replays the gold patch) through the bash, tool and eval harnesses
into SFT samples; an instance whose snapshot is gone is an environment failure that keeps its batch."""

import asyncio
import dataclasses
import shutil
import subprocess

import pytest

from orchard.data.tokenizer import build_chat_tokenizer
from orchard.domains.swe.harness import SWEEvalHarness
from orchard.domains.swe.instances import check_snapshot, check_snapshots, load_instances
from orchard.domains.swe.sandbox import prepare_sandbox, score_sandbox
from orchard.domains.swe.teacher import SWETeacherEngine, patch_edits, teacher_trajectories
from orchard.domains.swe.tool_rollout import SWEBashRollouts, SWEToolRollouts
from orchard.env import AsyncSandboxClient, RetryPolicy
from orchard.env.embedded import serve
from orchard.rollout import AgentLoopRollouts
from orchard.stages import sft_samples

ID = "tkem__cachetools-130"
F2P = "tests/test_keys.py::CacheKeysTest::test_pickle"


def test_the_real_fix_loads_from_jsonl_with_its_clone_at_base_commit(build_real_swe, tmp_path, fixture_git):
    real = build_real_swe(tmp_path / "a")
    # the commit is made with a fixed identity and date: the same hash wherever it is built
    assert build_real_swe(tmp_path / "b").base_commit == real.base_commit
    assert fixture_git(real.repo, "rev-parse", "HEAD").strip() == real.base_commit
    [instance] = load_instances(real.path, repo_root=real.repo_root)
    assert (instance.instance_id, instance.base_commit, instance.files) == (ID, real.base_commit, None)
    assert instance.repo_dir == str(real.repo) and instance.FAIL_TO_PASS == [F2P] and len(instance.PASS_TO_PASS) == 3
    assert instance.paths() == ["LICENSE", "cachetools/keys.py", "tests/test_keys.py"]  # .git left out
    assert "_kwmark = (object(),)" in instance.read("cachetools/keys.py")  # the bug, as the base has it
    assert instance.read("cachetools/__init__.py") is None
    check_snapshots([instance])  # a clone at its base commit, unchanged


def test_a_snapshot_not_at_its_base_commit_is_refused_naming_the_instance(build_real_swe, tmp_path, fixture_git):
    real = build_real_swe(tmp_path)
    [instance] = load_instances(real.path, repo_root=real.repo_root)

    def refused(match):
        with pytest.raises(ValueError, match=match) as info:
            check_snapshot(instance)
        assert str(info.value).startswith(f"{ID}: ")

    # the fix committed on top: HEAD is another commit
    (real.repo / "fix.diff").write_text(instance.patch)
    fixture_git(real.repo, "apply", "fix.diff")
    (real.repo / "fix.diff").unlink()
    fixture_git(real.repo, "commit", "-qam", "the fix")
    refused(rf"is at commit [0-9a-f]{{40}}, not at its base_commit {real.base_commit}")
    # checked out at the base again (detached): accepted; an abbreviated base_commit names the same commit
    fixture_git(real.repo, "checkout", "-q", real.base_commit)
    check_snapshot(instance)
    check_snapshot(dataclasses.replace(instance, base_commit=real.base_commit[:12]))
    # a changed tracked file, then an untracked one
    keys = real.repo / "cachetools" / "keys.py"
    keys.write_text(keys.read_text() + "\n")
    refused(r"has 1 changed or untracked file\(s\): cachetools/keys.py")
    fixture_git(real.repo, "checkout", "-q", "--", "cachetools/keys.py")
    (real.repo / "notes.txt").write_text("mine")
    refused(r"changed or untracked file\(s\): notes.txt")
    (real.repo / "notes.txt").unlink()
    check_snapshot(instance)
    # a base_commit the clone does not have
    other = dataclasses.replace(instance, base_commit="0123456789" * 4)
    with pytest.raises(ValueError, match=f"{ID}: the snapshot .* has no commit 0123456789"):
        check_snapshot(other)
    # a plain copy of the files cannot be checked; a missing directory is named
    plain = tmp_path / "plain"
    shutil.copytree(real.repo, plain, ignore=shutil.ignore_patterns(".git"))
    with pytest.raises(ValueError, match=f"{ID}: .* is not a git repository of its own"):
        check_snapshot(dataclasses.replace(instance, repo_dir=str(plain)))
    with pytest.raises(ValueError, match=f"{ID}: .* does not exist"):
        check_snapshot(dataclasses.replace(instance, repo_dir=str(tmp_path / "gone")))


def test_a_git_worktree_at_base_commit_is_a_snapshot(build_real_swe, tmp_path, fixture_git):
    real = build_real_swe(tmp_path / "clone")
    fixture_git(real.repo, "commit", "-q", "--allow-empty", "-m", "later work")  # the clone has moved on
    root = tmp_path / "worktrees"
    fixture_git(real.repo, "worktree", "add", "-q", "--detach", str(root / ID), real.base_commit)
    [instance] = load_instances(real.path, repo_root=root)
    check_snapshot(instance)  # its .git is a file pointing at the clone
    assert instance.paths() == ["LICENSE", "cachetools/keys.py", "tests/test_keys.py"]


def retry():
    return RetryPolicy(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.01)


def test_the_real_fix_resolves_in_a_sandbox_and_no_change_does_not(build_real_swe, tmp_path):
    real = build_real_swe(tmp_path)
    [instance] = load_instances(real.path, repo_root=real.repo_root)
    fixed = tmp_path / "fixed"
    shutil.copytree(real.repo, fixed, ignore=shutil.ignore_patterns(".git"))
    (fixed / "fix.diff").write_text(instance.patch)
    subprocess.run(["git", "apply", "fix.diff"], cwd=fixed, check=True)

    async def episode(client, name, keys_py):
        async with await client.create() as sandbox:
            await prepare_sandbox(sandbox, instance)
            if keys_py is not None:
                await sandbox.upload("cachetools/keys.py", keys_py)
            return name, await score_sandbox(sandbox, instance, timeout_s=60)

    async def main(service):
        async with AsyncSandboxClient(service.url, service.api_key, retry=retry()) as client:
            return dict(await asyncio.gather(episode(client, "none", None),
                                             episode(client, "gold", (fixed / "cachetools/keys.py").read_text())))

    with serve() as service:
        verdicts = asyncio.run(main(service))
    none, gold = verdicts["none"], verdicts["gold"]
    # at the base the hidden test fails and the others pass: the instance is real, not vacuous
    assert not none.resolved and none.reward == -1.0
    assert none.fail_to_pass == {F2P: False} and all(none.pass_to_pass.values())
    assert gold.resolved and gold.reward == 1.0 and all(gold.tests.values()), gold.details
    assert {e.path for e in patch_edits(gold.patch)} == {"cachetools/keys.py"}


@pytest.mark.slow
def test_the_scripted_teacher_replays_the_real_fix_through_every_harness_into_sft_data(build_real_swe, tmp_path):
    real = build_real_swe(tmp_path)
    [instance] = load_instances(real.path, repo_root=real.repo_root)
    tokenizer = build_chat_tokenizer()
    careful = SWETeacherEngine(tokenizer, [instance], failure_rate=0.0)
    # the gold patch has two hunks: a partial attempt applies the first only (a docstring), leaving the bug
    partial = SWETeacherEngine(tokenizer, [instance], failure_rate=1.0, kinds=("partial", "wrong_file"))
    assert partial.allowed_kinds(instance) == ["partial"]  # no other module in the repository to suspect

    async def main(service):
        async with AsyncSandboxClient(service.url, service.api_key, retry=retry()) as client:
            harnesses = {"bash": SWEBashRollouts(client, tokenizer), "tool": SWEToolRollouts(client, tokenizer),
                         "eval": AgentLoopRollouts(client, SWEEvalHarness(), tokenizer, max_tokens=4096)}
            runs = [teacher_trajectories(r, careful, [instance], attempts=1) for r in harnesses.values()]
            runs.append(teacher_trajectories(harnesses["bash"], partial, [instance], attempts=1))
            return [t for batch in await asyncio.gather(*runs) for t in batch]

    with serve() as service:
        bash, tool, evaluated, failed = asyncio.run(main(service))
    for traj in (bash, tool, evaluated):
        assert traj.termination_reason == "done" and traj.reward == 1.0, (traj.metadata.get("error"), traj.metadata)
        assert traj.metadata["tests"] == dict.fromkeys(instance.tests, True)
        # what it submitted is the real fix's change, hunk for hunk
        assert patch_edits(traj.metadata["patch"]) == patch_edits(instance.patch)
    assert failed.reward == -1.0 and failed.valid and failed.metadata["tests"][F2P] is False
    samples, stats = sft_samples([bash, tool, evaluated, failed], mode="resolved")
    # the resolved three train (the recorded samples of each, every one with action tokens); the failure does not
    assert stats["sft/resolved"] == 3 and stats["sft/failed"] == 1
    assert len(samples) == sum(len(t.samples) for t in (bash, tool, evaluated)) > 0
    assert all(s.action_mask.any() for s in samples)


def test_an_instance_whose_snapshot_is_gone_is_an_environment_failure_and_the_batch_is_kept(build_real_swe, tmp_path):
    real = build_real_swe(tmp_path)
    [instance] = load_instances(real.path, repo_root=real.repo_root)
    gone = dataclasses.replace(instance, instance_id="gone-1", repo_dir=str(tmp_path / "gone"),
                               problem_statement="Another issue.")
    tokenizer = build_chat_tokenizer()
    teacher = SWETeacherEngine(tokenizer, [instance, gone], failure_rate=0.0)

    async def main(service):
        async with AsyncSandboxClient(service.url, service.api_key, retry=retry()) as client:
            rollouts = AgentLoopRollouts(client, SWEEvalHarness(), tokenizer, max_tokens=4096)
            return await rollouts(teacher, [instance, gone], group_size=1, temperature=0.0)

    with serve() as service:
        played, failed = asyncio.run(main(service))
    assert played.reward == 1.0
    assert failed.termination_reason == "env_error" and failed.reward is None
    assert failed.metadata["error"].startswith("setup: EnvironmentFailure: prepare: ValueError: instance.repo_dir")
