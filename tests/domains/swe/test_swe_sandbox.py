"""SWE sandboxes against the real embedded sandbox service: the repository at its base commit with git and pytest,
and the reward: the gold patch resolves (also once committed), no patch and a partial patch do not, a patch that
edits the tests to pass does not (the SWE-bench reset), and a deleted sandbox raises instead of scoring."""

import asyncio
import base64
import dataclasses
import io
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
import zlib

import pytest

from orchard.domains.swe import trees
from orchard.domains.swe.generator import make_instance
from orchard.domains.swe.sandbox import (
    GIT_ENV,
    MAX_PATCH_WRITE_BYTES,
    SHARED_PYTEST,
    base_archive,
    base_tree,
    patch_write_bound,
    patched_paths,
    prepare_sandbox,
    pytest_bundle,
    pytest_env,
    repository_archive,
    score_sandbox,
    scored_tree,
    write_pytest_bundle,
)
from orchard.env import AsyncSandboxClient, RetryPolicy
from orchard.env.embedded import serve
from orchard.env.errors import BadRequestError, SandboxError
from orchard.rollout.harness import EnvironmentFailure


@pytest.fixture(scope="module")
def service():
    with serve() as svc:
        yield svc


def file_hunks(patch):
    """The per-file parts of a unified diff."""
    parts = patch.split("diff --git ")
    return ["diff --git " + part for part in parts if part]


def tampered_tests(instance):
    """The test files as an agent who guessed the hidden test names would rewrite them: every test passes."""
    out = {}
    for path in patched_paths(instance.test_patch):
        names = [t.split("::")[1] for t in instance.tests if t.startswith(path + "::")]
        out[path] = "".join(f"def {name}():\n    pass\n\n\n" for name in names)
    return out


def test_patches_are_scored_as_swe_bench_does(service):
    instance = make_instance("ledger", 5, level=3)  # two bugs in two modules
    gold_parts = file_hunks(instance.patch)
    assert len(gold_parts) == 2

    async def episode(client, name, act):
        async with await client.create(sandbox_id=f"swe-{name}") as sandbox:
            base = await prepare_sandbox(sandbox, instance)
            await act(sandbox)
            return name, base, await score_sandbox(sandbox, instance, timeout_s=120)

    async def nothing(sandbox):
        # the agent's view: one commit, a clean tree, pytest works, the hidden tests are absent
        status = await sandbox.exec("git log --oneline | wc -l; git status --porcelain; "
                                    "python3 -m pytest -q -p no:cacheprovider 2>&1 | tail -n 1")
        lines = status.stdout.splitlines()
        assert lines[0] == "1" and lines[-1].endswith(f"{len(instance.PASS_TO_PASS)} passed in "
                                                      f"{lines[-1].split(' in ')[1]}"), status.stdout
        hidden = instance.FAIL_TO_PASS[0].split("::")[1]
        assert (await sandbox.exec(["grep", "-r", hidden, "."])).exit_code == 1

    async def gold_committed(sandbox):
        assert (await sandbox.exec(["git", "apply", "-"], stdin=instance.patch)).exit_code == 0
        assert (await sandbox.exec("git commit -qam fix")).exit_code == 0  # history rewritten: the diff still counts

    async def partial(sandbox):
        assert (await sandbox.exec(["git", "apply", "-"], stdin=gold_parts[0])).exit_code == 0

    async def tamper(sandbox):
        for path, text in tampered_tests(instance).items():
            await sandbox.upload(path, text)

    async def main():
        retry = RetryPolicy(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.01)
        async with AsyncSandboxClient(service.url, service.api_key, retry=retry) as client:
            return await asyncio.gather(*(episode(client, name, act) for name, act in (
                ("none", nothing), ("gold", gold_committed), ("partial", partial), ("tamper", tamper))))

    verdicts = {name: (base, verdict) for name, base, verdict in asyncio.run(main())}
    bases = {base for base, _ in verdicts.values()}
    assert len(bases) == 1  # fixed identity and date: the base commit's hash is the files' alone

    gold = verdicts["gold"][1]
    assert gold.resolved and gold.reward == 1.0 and all(gold.tests.values())
    assert gold.patch.count("diff --git") == 2
    assert gold.components == {"resolved": 1.0, "fail_to_pass": 1.0, "pass_to_pass": 1.0, "patch_applied": 1.0,
                               "empty_patch": 0.0}

    none = verdicts["none"][1]
    assert not none.resolved and none.reward == -1.0 and none.patch == ""
    assert not any(none.fail_to_pass.values()) and all(none.pass_to_pass.values())
    assert none.components["empty_patch"] == 1.0 and none.components["fail_to_pass"] == 0.0

    partial_verdict = verdicts["partial"][1]
    assert not partial_verdict.resolved and partial_verdict.patch_applied
    assert not all(partial_verdict.tests.values())

    # The tampered test files are reset before test_patch applies: the real tests run against the bugs.
    tampered = verdicts["tamper"][1]
    assert not tampered.resolved and tampered.patch_applied and "def test_" in tampered.patch
    assert tampered.fail_to_pass == none.fail_to_pass


def test_a_sandbox_failure_raises_instead_of_scoring(service):
    instance = make_instance("graph", 2, level=1)

    async def main():
        async with AsyncSandboxClient(service.url, service.api_key) as client:
            sandbox = await client.create()
            await prepare_sandbox(sandbox, instance)
            await client.request("DELETE", f"/sandboxes/{sandbox.sandbox_id}")
            with pytest.raises(SandboxError):
                await score_sandbox(sandbox, instance, timeout_s=30)
            async with await client.create() as fresh:
                with pytest.raises(EnvironmentFailure, match="the sandbox has no"):
                    await prepare_sandbox(fresh, instance, python="no-such-python3")

    asyncio.run(main())


def test_a_timeout_while_taking_the_patch_raises_instead_of_scoring(service):
    """Taking the patch (``git add -A; git diff``) is a set-up step: when it runs out of time there is no patch to
    score, and the episode is the environment's failure (``env_error``), never the policy's -1."""
    instance = make_instance("graph", 2, level=1)
    # a clean filter that outlasts the command's limit: git add -A runs it on the new file
    slow_git = ("git config filter.slow.clean 'sleep 30; cat' && echo '*.txt filter=slow' > .gitattributes && "
                "echo note > note.txt")

    async def main():
        async with AsyncSandboxClient(service.url, service.api_key) as client, await client.create() as sandbox:
            await prepare_sandbox(sandbox, instance)
            assert (await sandbox.exec(["bash", "-c", slow_git])).exit_code == 0
            started = time.monotonic()
            with pytest.raises(EnvironmentFailure, match="taking the patch timed out"):
                await score_sandbox(sandbox, instance, timeout_s=30, setup_timeout_s=2)
            assert time.monotonic() - started < 25  # the 2 s limit ended it, not the filter

    asyncio.run(main())


class CountingSandbox:
    """A sandbox that counts its commands (the round trips to the service)."""

    def __init__(self, sandbox):
        self.sandbox, self.execs = sandbox, 0

    def __getattr__(self, name):
        return getattr(self.sandbox, name)

    async def exec(self, *args, **kwargs):
        self.execs += 1
        return await self.sandbox.exec(*args, **kwargs)


FAKE_PYTEST = """python3 - <<'EOF'
import site, zipfile
with zipfile.ZipFile(site.getusersitepackages() + "/orchard-pytest.zip", "w") as z:
    z.writestr("pytest/__init__.py", "")
    z.writestr("pytest/__main__.py", "import sys\\nfor a in sys.argv[1:]:\\n    print('PASSED', a)\\n")
EOF
python3 -m pytest tests/x.py::test_y"""


def test_one_command_prepares_two_score_and_the_agent_cannot_fake_the_run(service):
    instance = make_instance("graph", 2, level=1)

    async def episode(client, act):
        async with await client.create() as raw:
            sandbox = CountingSandbox(raw)
            await prepare_sandbox(sandbox, instance)
            prepared = sandbox.execs
            await act(sandbox)
            sandbox.execs = 0
            verdict = await score_sandbox(sandbox, instance, timeout_s=60)
            return prepared, sandbox.execs, verdict

    async def gold(sandbox):
        assert (await sandbox.exec(["git", "apply", "-"], stdin=instance.patch)).exit_code == 0

    async def fake_pytest(sandbox):
        # the agent's own pytest, which the user site's .pth puts on its path, reports every test passed
        faked = await sandbox.exec(FAKE_PYTEST)
        assert faked.stdout == "PASSED tests/x.py::test_y\n", faked

    async def exit_127(sandbox):
        # a conftest that exits as a missing program would: the tests started, so it is the policy's failure
        await sandbox.upload("conftest.py", "import os\nos._exit(127)\n")

    async def main():
        async with AsyncSandboxClient(service.url, service.api_key) as client:
            await episode(client, gold)  # the first sandbox of the image also asks whether it has pytest
            return [await episode(client, act) for act in (gold, fake_pytest, exit_127)]

    (gold_prep, gold_score, resolved), (_, fake_score, faked), (_, _, exited) = asyncio.run(main())
    # prepare: one command (repository, git, pytest); score: the diff, then base + patches + tests in one
    assert (gold_prep, gold_score) == (1, 2) and resolved.resolved
    # the user site's zip no longer has the bundle's hash: the scoring command asks once more with a fresh copy
    assert fake_score == 3 and not faked.resolved and faked.patch == "" and not any(faked.fail_to_pass.values())
    assert all(faked.pass_to_pass.values())  # the real pytest ran: what passes at the base passed
    assert not exited.resolved and exited.patch_applied and exited.details["exit_code"] == 127


def test_the_base_commit_is_built_once_per_instance_on_the_host(tmp_path):
    instance = make_instance("graph", 2, level=1)
    archive, commit = base_archive(instance)
    assert base_tree(instance) is base_tree(instance)  # cached: the same build, no second git run
    # the hash git gives these files committed as the sandbox did before (fixed identity and date)
    repo = tmp_path / "repo"
    with tarfile.open(fileobj=io.BytesIO(repository_archive(instance))) as tar:
        tar.extractall(repo, filter="tar")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), **GIT_ENV}
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
        subprocess.run(["git", *args], cwd=repo, env=env, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, env=env, capture_output=True, text=True)
    assert commit == head.stdout.strip()
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        names = tar.getnames()
    assert ".git/HEAD" in names and ".git/index" in names and ".git/hooks" not in names
    # another instance under the same id (its files changed) never gets this build
    changed = dataclasses.replace(instance, files={**instance.files, "NOTES.md": "changed\n"})
    assert changed.instance_id == instance.instance_id and base_archive(changed)[1] != commit


def test_the_cache_holds_whatever_the_clock_says(monkeypatch):
    # gzip stamps its header with the current second: two calls a second apart gave other bytes, so the cache
    # key (the archive's hash) missed and git ran again for nearly every sandbox
    instance = make_instance("graph", 3, level=1)
    monkeypatch.setattr(time, "time", lambda: 1_000_000_000.0)
    plain, base = repository_archive(instance), base_tree(instance)
    archive = base.archive
    monkeypatch.setattr(time, "time", lambda: 2_000_000_000.0)
    assert repository_archive(instance) == plain
    assert base_tree(instance) is base
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        names = tar.getnames()
    # the objects in one pack: no directory and file per loose object for the sandbox to write
    assert all(n.startswith((".git/objects/info", ".git/objects/pack")) for n in names if n.startswith(".git/objects/"))
    assert sum(n.endswith(".pack") for n in names) == 1


def test_with_pytest_env_nothing_runs_to_prepare_and_links_out_are_scored_on_the_host_safely(tmp_path):
    instance = make_instance("graph", 2, level=1)
    test_file = patched_paths(instance.test_patch)[0]  # tests/test_<module>.py
    test_dir = os.path.dirname(test_file)
    host_dir = tmp_path / "host"  # what a link the agent made points at: on this host, beside the service
    host_dir.mkdir()
    (host_dir / os.path.basename(test_file)).write_text("host file\n")
    folder = tempfile.mkdtemp(prefix="orchard-swe-pytest-")
    write_pytest_bundle(folder)

    async def episode(client, act):
        async with await client.create(env=pytest_env()) as raw:
            sandbox = CountingSandbox(raw)
            await prepare_sandbox(sandbox, instance)
            prepared = sandbox.execs
            view = await raw.exec("git status --porcelain; python3 -m pytest --version")
            assert (await raw.exec(["git", "apply", "-"], stdin=instance.patch)).exit_code == 0
            await act(raw)
            sandbox.execs = 0
            verdict = await score_sandbox(sandbox, instance, timeout_s=60)
            return prepared, view.stdout, sandbox.execs, verdict

    async def gold(sandbox):
        pass

    async def links_out(sandbox):
        # a link the archive upload refuses, and the tests' directory made a link to a directory of this host
        made = await sandbox.exec(f"ln -s /etc/passwd passwd_link && rm -rf {test_dir} && ln -s {host_dir} {test_dir}")
        assert made.exit_code == 0, made

    async def main(url, key):
        async with AsyncSandboxClient(url, key) as client:
            await episode(client, gold)  # the first sandbox of the image probes it
            return [await episode(client, act) for act in (gold, links_out)]

    try:
        with serve(shared={SHARED_PYTEST: folder}) as svc:
            (prepared, view, gold_score, resolved), (_, _, links_score, linked) = asyncio.run(main(svc.url,
                                                                                                   svc.api_key))
    finally:
        shutil.rmtree(folder)
    # prepare: the repository through the archive upload, pytest on the path by the sandbox's env: no command
    assert prepared == 0 and view == "pytest " + pytest.__version__ + "\n"
    # score: the diff (emptying the workspace), then pytest; the tree in between through the upload
    assert gold_score == 2 and resolved.resolved
    # the refused tree is unpacked by tar in a third command; the reset never went through the agent's link
    assert links_score == 3 and linked.patch_applied and "passwd_link" in linked.patch
    assert f"b/{test_dir}\nnew file mode 120000" in linked.patch
    assert not linked.resolved  # the agent removed the other test files: their tests cannot pass
    assert (host_dir / os.path.basename(test_file)).read_text() == "host file\n"


def test_scored_tree_resets_the_tests_and_refuses_bad_input():
    instance = make_instance("graph", 2, level=1)
    archive, _ = base_archive(instance)
    test_file = patched_paths(instance.test_patch)[0]
    # the agent's patch empties the test file; the reset brings it back, so test_patch applies on top
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        base_text = tar.extractfile(test_file).read().decode()
    emptied = (f"diff --git a/{test_file} b/{test_file}\n--- a/{test_file}\n+++ b/{test_file}\n"
               f"@@ -1,{base_text.count(chr(10))} +0,0 @@\n" + "".join(f"-{line}\n" for line in base_text.splitlines()))
    with tarfile.open(fileobj=io.BytesIO(scored_tree(archive, emptied, instance.test_patch))) as tar:
        scored = tar.extractfile(test_file).read().decode()
    hidden = instance.FAIL_TO_PASS[0].split("::")[1]
    assert scored.startswith(base_text.splitlines()[0]) and f"def {hidden}(" in scored
    assert scored_tree(archive, "not a diff\n", instance.test_patch) is None  # does not apply: unresolved
    with pytest.raises(ValueError, match="base must be bytes"):
        scored_tree("tar", "", instance.test_patch)
    with pytest.raises(ValueError, match="test_patch must be a str"):
        scored_tree(archive, "", None)


def test_the_bundles_bytecode_is_used_without_reading_its_source(tmp_path):
    # pytest's own __init__.py replaced by a source that fails: only a pyc that is never checked against its
    # source still imports (a checked one is recompiled from the changed source)
    bundle = zipfile.ZipFile(io.BytesIO(pytest_bundle()))
    altered = tmp_path / "bundle.zip"
    with zipfile.ZipFile(altered, "w") as out:
        for info in bundle.infolist():
            data = bundle.read(info)
            out.writestr(info, b"raise ImportError('source read')\n" if info.filename == "pytest/__init__.py" else data)
    run = subprocess.run([sys.executable, "-I", "-S", "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                          "import pytest; print(pytest.__version__)", str(altered)], capture_output=True, text=True)
    assert run.stdout == pytest.__version__ + "\n", run.stderr[-500:]


def test_a_shared_pytest_is_read_in_place_and_never_sent():
    instance = make_instance("graph", 2, level=1)
    folder = tempfile.mkdtemp(prefix="orchard-swe-pytest-")
    shared_zip = write_pytest_bundle(folder)
    sent = []

    class Recording(CountingSandbox):
        async def exec(self, *args, **kwargs):
            sent.append(len(kwargs.get("stdin") or ""))
            return await super().exec(*args, **kwargs)

    async def main(url, key):
        async with AsyncSandboxClient(url, key) as client, await client.create() as raw:
            sandbox = Recording(raw)
            await prepare_sandbox(sandbox, instance)
            view = await sandbox.exec("cat ~/.local/lib/python3*/site-packages/orchard-pytest.pth; "
                                      "ls ~/.local/lib/python3*/site-packages; python3 -m pytest --version")
            assert (await sandbox.exec(["git", "apply", "-"], stdin=instance.patch)).exit_code == 0
            return view, await score_sandbox(sandbox, instance, timeout_s=60)

    try:
        with serve(shared={SHARED_PYTEST: folder}) as svc:
            view, verdict = asyncio.run(main(svc.url, svc.api_key))
    finally:
        shutil.rmtree(folder)
    lines = view.stdout.splitlines()
    # the .pth names the service's copy; no zip in the user site
    assert lines[0] == f"/.orchard-shared/orchard-pytest/{os.path.basename(shared_zip)}"
    assert lines[1:3] == ["orchard-pytest.pth", "pytest " + pytest.__version__], view
    assert verdict.resolved
    # probe, prepare, the check run by the agent's view, apply, diff, score: nothing near the 3 MB bundle
    assert max(sent) < 100_000, sent


def binary_lines(data):
    """``data`` as a git binary hunk's lines: zlib, then base85 in lines of up to 52 bytes, each led by its length
    (A-Z: 1-26, a-z: 27-52)."""
    deflated = zlib.compress(data)
    chunks = [deflated[i:i + 52] for i in range(0, len(deflated), 52)]
    return "".join(chr(ord("A") + len(c) - 1 if len(c) <= 26 else ord("a") + len(c) - 27)
                   + base64.b85encode(c).decode() + "\n" for c in chunks)


def new_binary_file(path, declared, data):
    """A hand-built ``git diff --binary`` creating ``path`` whose literal declares ``declared`` bytes."""
    return (f"diff --git a/{path} b/{path}\nnew file mode 100644\nindex 0000000..1111111\nGIT binary patch\n"
            f"literal {declared}\n{binary_lines(data)}\nliteral 0\nHcmV?d00001\n\n")


def varint(n):
    """A git delta header's number: 7 bits a byte, least significant first, the high bit set on all but the last."""
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def git_diff(repo, env):
    subprocess.run(["git", "add", "-A"], cwd=repo, env=env, check=True)
    return subprocess.run(["git", "diff", "--cached", "--binary"], cwd=repo, env=env, check=True,
                          capture_output=True, text=True).stdout


def test_patch_write_bound_counts_what_git_apply_writes(tmp_path):
    # git's own binary hunks: a new file of zeros (literal) and an appended binary file (delta)
    repo, env = tmp_path / "repo", {"PATH": os.environ["PATH"], "HOME": str(tmp_path), **GIT_ENV}
    repo.mkdir()
    noise = random.Random(0).randbytes(100_000)
    (repo / "noise.bin").write_bytes(noise)
    subprocess.run(["git", "init", "-q"], cwd=repo, env=env, check=True)
    git_diff(repo, env)
    subprocess.run(["git", "commit", "-qm", "base"], cwd=repo, env=env, check=True)
    (repo / "noise.bin").write_bytes(noise + noise[:100])
    (repo / "zeros.bin").write_bytes(bytes(3_000_000))
    patch = git_diff(repo, env)
    assert "delta " in patch and "literal 3000000" in patch and len(patch) < 20_000  # 3 MB deflated to a few KB
    # the text, the zeros' forward literal 3 000 000 and reverse literal 0, noise's forward delta rebuilding
    # 100 100 bytes and its reverse rebuilding the old 100 000 (the deltas declare ~100 and ~10 bytes themselves)
    assert patch_write_bound(patch) == len(patch) + 3_000_000 + 0 + 100_100 + 100_000

    # a hand-built delta of 13 bytes whose header says its result is 1 GiB: copy operations can repeat the source
    delta = varint(3) + varint(1 << 30) + bytes([0x90, 0x00]) * 4 + b"\x03"
    forged = (f"diff --git a/noise.bin b/noise.bin\nindex 1111111..2222222 100644\nGIT binary patch\n"
              f"delta {len(delta)}\n{binary_lines(delta)}\n")
    assert patch_write_bound(forged) == len(forged) + (1 << 30)
    # a copy counts its source's base size plus everything before it (which may have written the source):
    # 10 + len(copied); three copies of a created file double the count each time
    copied = "diff --git a/a.txt b/b.txt\nsimilarity index 100%\ncopy from a.txt\ncopy to b.txt\n"
    assert patch_write_bound(copied, {"a.txt": 10}) == len(copied) + 10 + len(copied)
    created = new_binary_file("big", 1000, b"x")
    chain = created + copied.replace("a.txt", "big") * 3
    assert patch_write_bound(chain) == (len(chain) + 1000) * 8  # x2 per copy
    # 100 000 copies would double the count past any int, a literal of 5 000 digits past what int() reads:
    # both stop at 2**62, fast
    assert patch_write_bound(copied * 100_000, {"a.txt": 10}) == 1 << 62
    assert patch_write_bound(f"literal {'9' * 5000}\n") == 1 << 62
    with pytest.raises(ValueError, match="patch must be a str"):
        patch_write_bound(b"diff")
    with pytest.raises(ValueError, match="base_sizes must be a mapping"):
        patch_write_bound("", [1])


class ForgedDiff(CountingSandbox):
    """A sandbox whose diff command (emptying the workspace as ever) answers ``patch``: the policy's diff, as
    ``git diff --binary`` would write it for a file the agent made."""

    def __init__(self, sandbox, patch):
        super().__init__(sandbox)
        self.patch = patch

    async def exec(self, command, *args, **kwargs):
        result = await super().exec(command, *args, **kwargs)
        if isinstance(command, list) and "git diff --cached --binary" in command[-1]:
            return dataclasses.replace(result, stdout=self.patch)
        return result


def test_a_patch_that_inflates_past_the_cap_is_the_policys_failure_and_never_applied_here(service, monkeypatch):
    # 2 GiB of zeros declared by a literal a few bytes long: git apply would allocate and write it on this host,
    # and the tree would pass the upload's 1 GiB cap (an env_error the policy could hide a -1 behind)
    instance = make_instance("graph", 2, level=1)
    huge = new_binary_file("zeros.bin", 2 << 30, bytes(64))
    assert len(huge) < 300
    applied = []
    run = subprocess.run

    def recording(argv, *args, **kwargs):
        if argv[1:2] == ["apply"]:
            applied.append(kwargs.get("input", ""))
        return run(argv, *args, **kwargs)

    monkeypatch.setattr(trees.subprocess, "run", recording)  # where the host's git apply runs

    async def main():
        async with AsyncSandboxClient(service.url, service.api_key) as client, await client.create() as raw:
            await prepare_sandbox(raw, instance)
            return await score_sandbox(ForgedDiff(raw, huge), instance, timeout_s=60)

    verdict = asyncio.run(main())
    assert verdict.reward == -1.0 and not verdict.patch_applied and verdict.patch == huge
    assert verdict.details["reason"] == (f"the patch may write {len(huge) + (2 << 30)} bytes when applied, more "
                                         f"than MAX_PATCH_WRITE_BYTES={MAX_PATCH_WRITE_BYTES}")
    assert huge not in applied  # refused from its headers: nothing inflated or written on this host


class RefusingUpload(CountingSandbox):
    """A sandbox whose archive upload refuses the scored tree as the service does one past its 1 GiB cap."""

    async def upload_archive(self, path, tree):
        raise BadRequestError("the archive unpacks to more than max_bytes=1073741824 bytes")


def test_an_upload_refused_for_its_size_is_the_policys_failure(service):
    instance = make_instance("graph", 2, level=1)

    async def main():
        async with AsyncSandboxClient(service.url, service.api_key) as client, await client.create() as raw:
            await prepare_sandbox(raw, instance)
            assert (await raw.exec(["git", "apply", "-"], stdin=instance.patch)).exit_code == 0
            return await score_sandbox(RefusingUpload(raw), instance, timeout_s=60)

    verdict = asyncio.run(main())
    assert verdict.reward == -1.0 and not verdict.patch_applied and verdict.patch
    assert verdict.details["reason"].startswith("the patched tree is larger than the archive upload takes: ")


def test_patched_paths_reads_names_git_quotes_or_leaves_with_spaces(tmp_path):
    repo, env = tmp_path / "repo", {"PATH": os.environ["PATH"], "HOME": str(tmp_path), **GIT_ENV}
    (repo / "tests").mkdir(parents=True)
    for name in ("tests/test a.py", "tests/old name.py", "tests/t\u00e9st.py", 'tests/q"uote.py'):
        (repo / name).write_text("x = 1\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, env=env, check=True)
    git_diff(repo, env)
    subprocess.run(["git", "commit", "-qm", "base"], cwd=repo, env=env, check=True)
    for name in ("tests/test a.py", "tests/t\u00e9st.py", 'tests/q"uote.py'):
        (repo / name).write_text("x = 2\n")
    (repo / "tests/old name.py").rename(repo / "tests/new name.py")
    patch = git_diff(repo, env)
    # git writes the space verbatim, and the others quoted with C escapes: "a/tests/t\303\251st.py"
    assert '"a/tests/t\\303\\251st.py"' in patch and '"a/tests/q\\"uote.py"' in patch
    # the rename's names differ, so its diff --git line is ambiguous: they come from its rename from / to lines
    assert patched_paths(patch) == ["tests/old name.py", "tests/new name.py", 'tests/q"uote.py', "tests/test a.py",
                                    "tests/t\u00e9st.py"]
