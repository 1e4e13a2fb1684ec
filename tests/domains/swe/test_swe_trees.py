"""The trees built on the host for SWE sandboxes (issue 32, scoring speed): the base's cache is keyed without
reading the repository and never serves a changed snapshot; the scored tree is the base's archive followed by the
touched files, the same tree as `scored_tree` builds whole; an episode builds its base once and scores against
the very base it was prepared with."""

import asyncio
import dataclasses
import gzip
import io
import os
import shutil
import subprocess
import tarfile

import pytest

from orchard.domains.swe import sandbox as swe_sandbox
from orchard.domains.swe import trees
from orchard.domains.swe.generator import make_instance
from orchard.domains.swe.instances import load_instances
from orchard.domains.swe.sandbox import prepare_sandbox, score_sandbox
from orchard.domains.swe.trees import BaseTree, base_tree, scored_archive, scored_tree
from orchard.env import AsyncSandboxClient
from orchard.env.embedded import serve
from orchard.rollout.harness import EnvironmentFailure


class Counter:
    """Wraps a function of `trees` and counts its calls."""

    def __init__(self, monkeypatch, name):
        self.calls, original = 0, getattr(trees, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(trees, name, counted)


def files_of(archive):
    """path -> ("file", bytes, executable) or ("link", target) of a gzipped tar, a later member replacing an
    earlier one of the same name, as `tar -x` and the archive upload do (directories left out)."""
    out = {}
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        for member in tar:
            if member.isreg():
                out[member.name] = ("file", tar.extractfile(member).read(), bool(member.mode & 0o100))
            elif member.issym():
                out[member.name] = ("link", member.linkname)
    return out


@pytest.fixture
def snapshot(build_real_swe, tmp_path, monkeypatch):
    """The real fixture's clone (cachetools #130) as a ``repo_dir`` instance; its files count as settled."""
    monkeypatch.setattr(trees, "RECENT_CHANGE_S", 0.0)
    real = build_real_swe(tmp_path)
    [instance] = load_instances(real.path, repo_root=real.repo_root)
    return real, instance


def test_a_snapshot_is_read_once_and_looked_up_without_reading_it_again(snapshot, monkeypatch):
    _, instance = snapshot
    reads, builds = Counter(monkeypatch, "repository_archive"), Counter(monkeypatch, "_build_base")
    first = base_tree(instance)
    # a copy of the instance hits too: the key is the snapshot's, not the object's
    again = [base_tree(instance), base_tree(dataclasses.replace(instance))]
    assert all(base is first for base in again)
    assert (reads.calls, builds.calls) == (1, 1)  # the old key read and compressed the whole repository each time


def test_a_changed_snapshot_never_gets_an_earlier_build(snapshot, fixture_git):
    real, instance = snapshot
    keys = real.repo / "cachetools" / "keys.py"
    seen = [base_tree(instance)]

    def rebuilt():
        base = base_tree(instance)
        assert all(base is not earlier for earlier in seen)
        seen.append(base)
        on_disk = {p.relative_to(real.repo).as_posix(): p for p in real.repo.rglob("*")
                   if ".git" not in p.relative_to(real.repo).parts and (p.is_file() or p.is_symlink())}
        built = {name: entry for name, entry in files_of(base.archive).items() if not name.startswith(".git/")}
        assert set(built) == set(on_disk)
        for name, path in on_disk.items():
            assert built[name] == (("link", os.readlink(path)) if path.is_symlink() else
                                   ("file", path.read_bytes(), bool(path.stat().st_mode & 0o100)))
        return base

    # an edit of the same size, its modification time put back: the inode's change time still moves
    text, stamp = keys.read_text(), keys.stat()
    keys.write_text(text.replace("_kwmark", "_kwMARK"))
    os.utime(keys, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert keys.stat().st_size == stamp.st_size and keys.stat().st_mtime_ns == stamp.st_mtime_ns
    assert "_kwMARK" in files_of(rebuilt().archive)["cachetools/keys.py"][1].decode()
    # back to the base commit's file, then another commit checked out, a file added, one removed, one a link
    fixture_git(real.repo, "checkout", "-q", "--", "cachetools/keys.py")
    assert rebuilt().commit == seen[0].commit  # the same files: the same base commit, but built anew
    (real.repo / "fix.diff").write_text(instance.patch)
    fixture_git(real.repo, "apply", "fix.diff")
    (real.repo / "fix.diff").unlink()
    fixture_git(real.repo, "commit", "-qam", "the fix")
    assert rebuilt().commit != seen[0].commit
    (real.repo / "NOTES.md").write_text("mine\n")
    rebuilt()
    (real.repo / "LICENSE").unlink()
    rebuilt()
    (real.repo / "NOTES.md").unlink()
    (real.repo / "NOTES.md").symlink_to("cachetools/keys.py")
    rebuilt()


def test_a_snapshot_changed_just_now_is_built_but_not_cached(build_real_swe, tmp_path, monkeypatch):
    # its files were written a moment ago: a rewrite within the clock's step could keep every time and size
    real = build_real_swe(tmp_path)
    [instance] = load_instances(real.path, repo_root=real.repo_root)
    assert trees.RECENT_CHANGE_S == 2.0
    builds = Counter(monkeypatch, "_build_base")
    (real.repo / "LICENSE").touch()
    assert base_tree(instance) is not base_tree(instance)
    assert builds.calls == 2
    # once settled (here: the window shrunk to nothing) it is cached, and the next look-up hits
    monkeypatch.setattr(trees, "RECENT_CHANGE_S", 0.0)
    assert base_tree(instance) is base_tree(instance)
    assert builds.calls == 3


def test_files_in_memory_are_keyed_by_their_content():
    toy = make_instance("graph", 4, level=1)
    instance = dataclasses.replace(toy, files=dict(toy.files))  # changed below: not the generator's own dict
    base = base_tree(instance)
    assert base_tree(dataclasses.replace(instance, files=dict(instance.files))) is base
    instance.files["NOTES.md"] = "changed in place\n"  # the same dict, changed: another key
    changed = base_tree(instance)
    assert changed is not base and changed.commit != base.commit
    assert files_of(changed.archive)["NOTES.md"][1] == b"changed in place\n"


def diff_of(base_files, change, tmp_path):
    """The ``git diff --binary`` an agent's change gives: ``change(repo)`` run in the base's files."""
    repo = tmp_path / "agent"
    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), **trees.GIT_ENV}
    for path, text in base_files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "base"]):
        subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True)
    change(repo)
    subprocess.run(["git", "add", "-A"], cwd=repo, env=env, check=True)
    return subprocess.run(["git", "diff", "--cached", "--binary", "HEAD"], cwd=repo, env=env, check=True,
                          capture_output=True, text=True).stdout


def test_the_scored_archive_is_the_whole_tree_built_for_the_touched_files_only(monkeypatch, tmp_path):
    instance = make_instance("ledger", 5, level=3)
    test_file = trees.patched_paths(instance.test_patch)[0]
    module = trees.patched_paths(instance.patch)[0]
    base = base_tree(instance)

    def gold(repo):
        subprocess.run(["git", "apply", "-"], cwd=repo, input=instance.patch, text=True, check=True)

    def new_package(repo):
        (repo / "extra" / "deep").mkdir(parents=True)
        (repo / "extra" / "deep" / "tool.py").write_text("X = 1\n")

    def executable(repo):
        (repo / module).chmod(0o755)

    def tampered_tests(repo):
        (repo / test_file).write_text("def test_nothing():\n    pass\n")

    def link_in_tree(repo):
        (repo / "alias.py").symlink_to(module)

    def deleted(repo):
        (repo / module).unlink()

    def renamed(repo):
        (repo / module).rename(repo / "moved.py")

    def file_over_directory(repo):
        shutil.rmtree(repo / os.path.dirname(test_file))
        (repo / os.path.dirname(test_file)).write_text("not a directory\n")

    whole = Counter(monkeypatch, "scored_tree")
    for change, fast in ((gold, True), (new_package, True), (executable, True), (tampered_tests, True),
                         (link_in_tree, True), (deleted, False), (renamed, False), (file_over_directory, False)):
        patch = diff_of(instance.files, change, tmp_path)
        assert patch, change.__name__
        calls = whole.calls
        archive = scored_archive(base, patch, instance.test_patch)
        expected = scored_tree(base.archive, patch, instance.test_patch)
        assert files_of(archive) == files_of(expected), change.__name__
        # the fast path: the repository is not unpacked whole again; what follows the base is the touched files
        assert (whole.calls == calls) is fast, change.__name__
        if fast:
            touched = set(trees.patched_paths(patch)) | set(trees.patched_paths(instance.test_patch))
            assert archive.startswith(base.body) and set(files_of(archive[len(base.body):])) <= touched


def test_a_patch_that_does_not_apply_or_a_broken_test_patch_decide_as_the_whole_tree_does(tmp_path):
    instance = make_instance("graph", 2, level=1)
    base = base_tree(instance)
    assert scored_archive(base, "diff --git a/nope.py b/nope.py\n--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-a\n+b\n",
                          instance.test_patch) is None
    test_file = trees.patched_paths(instance.test_patch)[0]
    broken = (f"diff --git a/{test_file} b/{test_file}\n--- a/{test_file}\n+++ b/{test_file}\n"
              "@@ -1 +1 @@\n-no such line in the base\n+x\n")
    with pytest.raises(EnvironmentFailure, match="test_patch does not apply to the base"):
        scored_archive(base, "", broken)
    with pytest.raises(EnvironmentFailure, match="test_patch names a path outside the repository"):
        scored_archive(base, "", "diff --git a/../x.py b/../x.py\n")
    with pytest.raises(ValueError, match="base must be a BaseTree"):
        scored_archive(base.archive, "", instance.test_patch)
    with pytest.raises(ValueError, match="patch must be a str"):
        scored_archive(base, None, instance.test_patch)


def test_an_episode_builds_its_base_once_and_is_scored_against_the_base_it_started_from(snapshot, monkeypatch):
    real, instance = snapshot
    reads, builds = Counter(monkeypatch, "repository_archive"), Counter(monkeypatch, "_build_base")
    keys, overlays, whole = Counter(monkeypatch, "_base_key"), Counter(monkeypatch, "_overlay"), \
        Counter(monkeypatch, "scored_tree")
    fixed_keys = real.repo / "cachetools" / "keys.py"

    async def episode(client):
        async with await client.create() as sandbox:
            await prepare_sandbox(sandbox, instance)
            counts = (reads.calls, builds.calls, keys.calls)
            key = swe_sandbox._sandbox_key(sandbox)
            assert key in swe_sandbox._PREPARED
            # mid-episode the snapshot on disk moves on (another checkout): the episode's base is the one it got
            fixed_keys.write_text("raise ImportError('another commit')\n")
            assert (await sandbox.exec(["git", "apply", "-"], stdin=instance.patch)).exit_code == 0
            verdict = await score_sandbox(sandbox, instance, timeout_s=60)
            assert key not in swe_sandbox._PREPARED  # taken by the scoring
            return counts, verdict

    async def main(service):
        async with AsyncSandboxClient(service.url, service.api_key) as client:
            return await episode(client)

    with serve() as service:
        prepared, verdict = asyncio.run(main(service))
    assert prepared == (1, 1, 1)
    # scoring looked nothing up: no key, no read, no build; the touched files only, never the whole tree
    assert (reads.calls, builds.calls, keys.calls, overlays.calls, whole.calls) == (1, 1, 1, 1, 0)
    assert verdict.resolved and verdict.reward == 1.0, verdict.details


def test_a_base_tree_is_one_archive_whose_members_can_be_followed():
    base = base_tree(make_instance("graph", 5, level=1))
    assert isinstance(base, BaseTree) and base.archive.startswith(base.body)
    names = list(files_of(base.archive))
    assert ".git/HEAD" in names and all(base.kinds[name] in ("file", "link") for name in names)
    assert dict(base.sizes) == {
        name: len(entry[1]) for name, entry in files_of(base.archive).items() if entry[0] == "file"}
    # each member is a gzip member of its own: one is read without inflating the others
    whole = files_of(base.archive)
    for name, (start, end) in base.spans.items():
        with tarfile.open(fileobj=io.BytesIO(gzip.decompress(base.body[start:end])), mode="r:") as tar:
            [member] = tar.getmembers()
            assert member.name == name and not member.pax_headers  # integer times: no PAX header each
            if member.isreg():
                assert tar.extractfile(member).read() == whole[name][1]
    assert sorted(base.spans.values()) == sorted(base.spans.values(), key=lambda span: span[0])
    assert max(end for _, end in base.spans.values()) == len(base.body)
