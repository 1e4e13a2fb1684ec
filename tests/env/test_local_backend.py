"""The local backend: lifecycle, restart, images, per-sandbox uids, delete ending processes, concurrency."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from _box import needs_root, requires

from orchard.env.agent.isolation import BUBBLEWRAP, PROCESS_GROUP, Limits, probe_bubblewrap
from orchard.env.backends.base import (
    Backend,
    CapacityError,
    ExecRequest,
    ImageNotFoundError,
    IsolationUnavailableError,
    PathEscapeError,
    SandboxNotFoundError,
    SandboxSpec,
)
from orchard.env.backends.images import ImageRegistry
from orchard.env.backends.local import DEFAULT_UID_RANGE, LocalBackend
from orchard.env.embedded import serve

IS_ROOT = os.geteuid() == 0
BWRAP_PROBLEM = probe_bubblewrap((DEFAULT_UID_RANGE[0],) * 2 if IS_ROOT else None)
needs_bwrap = requires(BWRAP_PROBLEM, "bubblewrap")
MODES = [
    pytest.param(True, marks=needs_bwrap, id="bubblewrap"),
    pytest.param(False, id="process-group"),
]


@pytest.fixture
def root_dir():
    # Under the system temp directory (world-searchable), as the sandbox uids must reach their workspaces.
    d = tempfile.mkdtemp(prefix="orchard-local-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def sleepers(text: str) -> list[int]:
    out = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                with open(f"/proc/{e}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        out.append(int(e))
            except OSError:
                pass
    return out


def make_rootfs(path: str) -> None:
    """A minimal image: the host's `sh` with the libraries `ldd` lists, and a marker file."""
    sh = os.path.realpath(shutil.which("sh") or "/bin/sh")
    files = [sh]
    for line in subprocess.run(["ldd", sh], capture_output=True, text=True, check=True).stdout.splitlines():
        m = re.search(r"(/\S+)", line.split("=>")[-1])
        if m:
            files.append(m.group(1))
    for f in files:
        dst = os.path.join(path, f.lstrip("/"))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(f, dst)
    os.makedirs(os.path.join(path, "bin"), exist_ok=True)
    if not os.path.exists(os.path.join(path, "bin", "sh")):
        shutil.copy2(sh, os.path.join(path, "bin", "sh"))
    with open(os.path.join(path, "marker"), "w") as f:
        f.write("inside-the-image\n")
    os.chmod(path, 0o755)


def test_is_a_backend_and_reports_isolation(root_dir, caplog):
    b = LocalBackend(root_dir)
    assert isinstance(b, Backend)
    expected = BUBBLEWRAP if BWRAP_PROBLEM is None else PROCESS_GROUP
    assert b.isolation == expected and b.health()["isolation"] == expected
    with caplog.at_level(logging.WARNING):
        fb = LocalBackend(root_dir, use_bwrap=False)
    assert fb.isolation == PROCESS_GROUP and fb.isolation_warning
    assert "NOT ISOLATED" in caplog.text


async def test_a_blocked_network_the_fallback_cannot_enforce_is_refused_unless_allowed(root_dir):
    strict = LocalBackend(root_dir, use_bwrap=False)
    assert (strict.isolation, strict.blocks_network) == (PROCESS_GROUP, False)
    with pytest.raises(IsolationUnavailableError, match="--allow-weak-isolation"):
        await strict.create("blocked", SandboxSpec(network=False))
    assert await strict.list_ids() == []  # refused before anything was made
    await strict.create("open", SandboxSpec(network=True))  # promises nothing it cannot keep
    weak = LocalBackend(root_dir, use_bwrap=False, allow_weak_isolation=True)
    await weak.create("blocked", SandboxSpec(network=False))
    assert (await weak.exec("blocked", ExecRequest("echo ran"))).stdout == b"ran\n"
    # a service restarted without the opt-in (or, alike, one that lost bubblewrap since the sandbox was made)
    # does not run commands in a sandbox whose network it cannot block
    with pytest.raises(IsolationUnavailableError):
        await strict.exec("blocked", ExecRequest("echo ran"))
    assert (await strict.exec("open", ExecRequest("echo ran"))).stdout == b"ran\n"
    with pytest.raises(ValueError, match="allow_weak_isolation"):
        LocalBackend(root_dir, allow_weak_isolation="yes")  # type: ignore[arg-type]
    await weak.close()
    await strict.close()


@pytest.mark.parametrize("use_bwrap", MODES)
async def test_the_directory_a_command_prints_is_one_the_file_api_takes(root_dir, use_bwrap):
    b = LocalBackend(root_dir, use_bwrap=use_bwrap, allow_weak_isolation=True)
    await b.create("p", SandboxSpec())
    await b.write_file("p", "sub/keep", b"")
    # bubblewrap: /workspace/sub; process groups: the host directory (nothing mounts it at /workspace)
    here = (await b.exec("p", ExecRequest("cd sub && pwd -P"))).stdout.decode().strip()
    await b.write_file("p", f"{here}/from-pwd.txt", b"written")
    assert (await b.exec("p", ExecRequest("cat sub/from-pwd.txt"))).stdout == b"written"
    assert await b.read_file("p", f"{here}/from-pwd.txt") == b"written"
    assert (await b.exec("p", ExecRequest("pwd -P", cwd=here))).stdout.decode().strip() == here
    with pytest.raises(PathEscapeError):
        await b.read_file("p", f"{here}/../../meta.json")  # the alias does not widen the workspace
    await b.close()


def test_constructor_validation(root_dir):
    with pytest.raises(ValueError, match="use_bwrap"):
        LocalBackend(root_dir, use_bwrap="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="uid_range"):
        LocalBackend(root_dir, uid_range=(0, 10))
    with pytest.raises(ValueError, match="max_sandboxes"):
        LocalBackend(root_dir, max_sandboxes=0)
    if IS_ROOT:
        private = tempfile.mkdtemp()  # mode 0700
        try:
            with pytest.raises(ValueError, match="not searchable"):
                LocalBackend(os.path.join(private, "sandboxes"))
        finally:
            shutil.rmtree(private)


@pytest.mark.parametrize("use_bwrap", MODES)
async def test_lifecycle_files_and_restart(root_dir, use_bwrap):
    b = LocalBackend(root_dir, use_bwrap=use_bwrap, allow_weak_isolation=True)
    spec = SandboxSpec(env={"SPEC_VAR": "spec"})
    await b.create("sb-1", spec)
    await b.create("sb-1", spec)  # idempotent
    await b.create("sb-2", SandboxSpec())
    assert await b.list_ids() == ["sb-1", "sb-2"] and await b.exists("sb-1")

    await b.write_file("sb-1", "dir/hello.txt", b"hello")
    r = await b.exec("sb-1", ExecRequest('cat dir/hello.txt; echo " $SPEC_VAR"; echo made > out.txt'))
    assert (r.exit_code, r.stdout) == (0, b"hello spec\n"), r
    assert await b.read_file("sb-1", "out.txt") == b"made\n"
    assert [f.path for f in await b.list_files("sb-1", ".", recursive=True)] == [
        "dir",
        "dir/hello.txt",
        "out.txt",
    ]
    with pytest.raises(PathEscapeError):
        await b.read_file("sb-1", "../sb-2/workspace/x")
    res = await b.resources("sb-1")
    assert res.pids == 256 and res.memory_mb == 4096 and res.disk_bytes > 0
    await b.close()

    # a restarted service finds its sandboxes and their files
    b2 = LocalBackend(root_dir, use_bwrap=use_bwrap, allow_weak_isolation=True)
    assert await b2.list_ids() == ["sb-1", "sb-2"]
    r = await b2.exec("sb-1", ExecRequest(["cat", "out.txt"]))
    assert r.stdout == b"made\n"
    await b2.delete("sb-1")
    await b2.delete("sb-1")  # idempotent
    assert await b2.list_ids() == ["sb-2"] and not await b2.exists("sb-1")
    assert not any(n.startswith(".trash") for n in os.listdir(root_dir))
    with pytest.raises(SandboxNotFoundError):
        await b2.exec("sb-1", ExecRequest("true"))
    with pytest.raises(SandboxNotFoundError):
        await b2.read_file("nope", "x")


async def test_create_validation(root_dir):
    b = LocalBackend(root_dir)
    for bad in ["", "../x", "a/b", ".hidden", "x" * 200]:
        with pytest.raises(ValueError, match="sandbox_id"):
            await b.create(bad, SandboxSpec())
    with pytest.raises(ImageNotFoundError, match="known images: host"):
        await b.create("s", SandboxSpec(image="python:3.11"))
    with pytest.raises(ValueError, match="workdir"):
        await b.create("s", SandboxSpec(workdir="relative"))
    with pytest.raises(ValueError, match="pids"):
        await b.create("s", SandboxSpec(pids=0))
    with pytest.raises(ValueError, match="env"):
        await b.create("s", SandboxSpec(env={"A": 1}))  # type: ignore[dict-item]
    assert await b.list_ids() == []
    fallback = LocalBackend(root_dir, images=ImageRegistry(fallback="host"))
    await fallback.create("s", SandboxSpec(image="python:3.11"))
    r = await fallback.exec("s", ExecRequest("echo ok"))
    assert r.stdout == b"ok\n"


@needs_bwrap
async def test_custom_image_and_workdir(root_dir):
    images_dir = tempfile.mkdtemp(prefix="orchard-images-")
    try:
        os.chmod(images_dir, 0o755)
        make_rootfs(os.path.join(images_dir, "tiny:1"))
        b = LocalBackend(root_dir, images=ImageRegistry(images_dir=images_dir))
        assert "tiny:1" in b.images.names()
        await b.create("img", SandboxSpec(image="tiny:1", workdir="/srv/app"))
        probe = "read l < /marker; echo $l; pwd; [ -e /usr/bin/git ] || echo no-git"
        r = await b.exec("img", ExecRequest(["/bin/sh", "-c", probe]))
        assert (r.exit_code, r.stdout) == (0, b"inside-the-image\n/srv/app\nno-git\n"), r
        # git is not in the image: patches are applied with the host's git on the same workspace
        await b.write_file("img", "a.txt", b"1\n")
        r = await b.apply_patch("img", "--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-1\n+2\n")
        assert r.exit_code == 0 and await b.read_file("img", "/srv/app/a.txt") == b"2\n", r
    finally:
        shutil.rmtree(images_dir)


@needs_root
@pytest.mark.parametrize("use_bwrap", MODES)
async def test_sandboxes_have_their_own_uids_and_cannot_see_each_other(root_dir, use_bwrap):
    b = LocalBackend(root_dir, use_bwrap=use_bwrap, allow_weak_isolation=True)
    await b.create("a", SandboxSpec())
    await b.create("b", SandboxSpec())
    await b.write_file("b", "secret.txt", b"b's")
    ua = (await b.exec("a", ExecRequest(["id", "-u"]))).stdout
    ub = (await b.exec("b", ExecRequest(["id", "-u"]))).stdout
    assert ua != ub and int(ua) >= DEFAULT_UID_RANGE[0]
    assert os.stat(os.path.join(root_dir, "b", "workspace", "secret.txt")).st_uid == int(ub)
    other = os.path.join(root_dir, "b", "workspace", "secret.txt")
    r = await b.exec("a", ExecRequest(["cat", other]))
    assert r.exit_code != 0 and b"b's" not in r.stdout
    # uids survive a restart and are not handed out twice
    b2 = LocalBackend(root_dir, use_bwrap=use_bwrap, allow_weak_isolation=True)
    await b2.create("c", SandboxSpec())
    uc = (await b2.exec("c", ExecRequest(["id", "-u"]))).stdout
    assert uc not in (ua, ub)
    assert (await b2.exec("a", ExecRequest(["id", "-u"]))).stdout == ua


@needs_root
async def test_two_services_on_one_machine_never_give_two_sandboxes_one_uid(root_dir):
    # Two backends on two root_dirs (two test runs, a recipe beside a notebook), default uid range and claims:
    # each backend alone would give its first sandbox the range's first uid, and the two sandboxes could then
    # signal each other and share one pids limit.
    other = tempfile.mkdtemp(prefix="orchard-local-")
    try:
        b1 = LocalBackend(root_dir, use_bwrap=False, allow_weak_isolation=True)
        b2 = LocalBackend(other, use_bwrap=False, allow_weak_isolation=True)
        await b1.create("a", SandboxSpec())
        await b2.create("a", SandboxSpec())
        assert b1._load_uids()["a"] != b2._load_uids()["a"]
    finally:
        shutil.rmtree(other, ignore_errors=True)


@needs_root
async def test_uid_claims_across_services_restart_delete_and_a_removed_root_dir(root_dir, tmp_path):
    claims, first = str(tmp_path / "claims"), 3_000_000  # a private claims dir and a range nobody else uses
    other = tempfile.mkdtemp(prefix="orchard-local-")
    try:
        def backend(d: str) -> LocalBackend:
            return LocalBackend(d, use_bwrap=False, allow_weak_isolation=True, uid_range=(first, 2),
                                uid_claims_dir=claims)

        b1, b2 = backend(root_dir), backend(other)
        await b1.create("s", SandboxSpec())  # the range's first uid: first + 0
        await b2.create("t", SandboxSpec())  # first + 0 is b1's: first + 1
        assert (b1._load_uids(), b2._load_uids()) == ({"s": first}, {"t": first + 1})
        with pytest.raises(CapacityError, match="other services"):
            await b2.create("u", SandboxSpec())  # both uids of the range are held
        # a restarted b1 still holds its uid (its sandbox lives on), and b2 still gets nothing
        b1 = backend(root_dir)
        assert await b1.list_ids() == ["s"] and b1._load_uids() == {"s": first}
        with pytest.raises(CapacityError):
            await b2.create("u", SandboxSpec())
        await b1.delete("s")  # frees first + 0 for anyone
        await b2.create("u", SandboxSpec())
        assert b2._load_uids() == {"t": first + 1, "u": first}
        shutil.rmtree(other)  # a temporary root_dir removed without a delete: its claims are stale
        # the restarted b1's round robin starts again at first + 0 (u's, stale), then first + 1 (t's, stale)
        await b1.create("v", SandboxSpec())
        await b1.create("w", SandboxSpec())
        assert b1._load_uids() == {"v": first, "w": first + 1}
    finally:
        shutil.rmtree(other, ignore_errors=True)


@pytest.mark.parametrize("use_bwrap", MODES)
async def test_delete_ends_running_commands_and_terminals(root_dir, use_bwrap):
    b = LocalBackend(root_dir, use_bwrap=use_bwrap, allow_weak_isolation=True)
    await b.create("busy", SandboxSpec())
    m = f"{987_000 + os.getpid() % 1000}.{int(time.time() * 1000) % 10**6:06d}"
    task = asyncio.create_task(b.exec("busy", ExecRequest(f"setsid sleep {m} & sleep {m}", timeout_s=60)))
    pty = await b.open_pty("busy", f"sleep {m}")
    await asyncio.sleep(0.5)
    assert sleepers(m)
    t0 = time.monotonic()
    await b.delete("busy")
    r = await asyncio.wait_for(task, 10)
    assert time.monotonic() - t0 < 5 and r.exit_code != 0
    deadline = time.monotonic() + 2
    while sleepers(m) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert sleepers(m) == []

    async def drain() -> bytes:
        return b"".join([c async for c in pty.read()])

    await asyncio.wait_for(drain(), 5)  # the terminal's output ends: its processes are gone
    assert not await b.exists("busy")


@pytest.mark.parametrize("use_bwrap", MODES)
async def test_concurrent_sandboxes(root_dir, use_bwrap):
    b = LocalBackend(root_dir, use_bwrap=use_bwrap, allow_weak_isolation=True, limits=Limits(pids=64))
    n = 12
    await asyncio.gather(*(b.create(f"c{i}", SandboxSpec()) for i in range(n)))

    async def work(i: int) -> bytes:
        await b.write_file(f"c{i}", "n.txt", str(i).encode())
        r1 = await b.exec(f"c{i}", ExecRequest("cat n.txt"))
        r2 = await b.exec(f"c{i}", ExecRequest(["sh", "-c", "expr $(cat n.txt) \\* 2"]))
        return r1.stdout + b"," + r2.stdout

    out = await asyncio.gather(*(work(i) for i in range(n)))
    assert out == [f"{i},{2 * i}\n".encode() for i in range(n)]
    await asyncio.gather(*(b.delete(f"c{i}") for i in range(n)))
    assert await b.list_ids() == []


@pytest.mark.parametrize("use_bwrap", MODES)
async def test_commands_of_a_killed_service_do_not_survive_it(root_dir, use_bwrap):
    """SIGKILL the service mid-command: under bubblewrap the sandbox dies with it (--die-with-parent); in
    the fallback, the next service on the same root_dir ends what was left."""
    m = f"{975_000 + os.getpid() % 1000}.{int(time.time() * 1000) % 10**6:06d}"
    script = (
        "import asyncio, sys\n"
        "from orchard.env.backends.local import LocalBackend\n"
        "from orchard.env.backends.base import ExecRequest, SandboxSpec\n"
        "async def main():\n"
        f"    b = LocalBackend({root_dir!r}, use_bwrap={use_bwrap!r}, allow_weak_isolation=True)\n"
        "    await b.create('victim', SandboxSpec())\n"
        "    task = asyncio.create_task(b.exec('victim', ExecRequest("
        f"'setsid sleep {m} & sleep {m}', timeout_s=60)))\n"
        "    await asyncio.sleep(0.5)\n"
        "    print('running', flush=True)\n"
        "    await task\n"
        "asyncio.run(main())\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"running\n", proc.stderr.read()  # type: ignore[union-attr]
        assert len(sleepers(m)) >= 2
    finally:
        proc.kill()
        proc.wait()
    if not use_bwrap:
        LocalBackend(root_dir, use_bwrap=False, allow_weak_isolation=True)  # the restarted service
    deadline = time.monotonic() + 3
    while sleepers(m) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert sleepers(m) == []


@pytest.mark.parametrize("use_bwrap", MODES)
async def test_home_persists_outside_the_workspace(root_dir, use_bwrap):
    b = LocalBackend(root_dir, use_bwrap=use_bwrap, allow_weak_isolation=True)
    await b.create("h", SandboxSpec())
    r = await b.exec("h", ExecRequest('echo remembered > "$HOME/note"; echo $HOME'))
    assert r.exit_code == 0, r
    r = await b.exec("h", ExecRequest('cat "$HOME/note"'))
    assert r.stdout == b"remembered\n"
    assert await b.list_files("h", ".") == []  # nothing landed in the workspace
    if use_bwrap:
        # a named user with a git identity: a fresh repo can commit and stash; the host's /home is hidden
        r = await b.exec(
            "h",
            ExecRequest(
                "whoami; ls /home; git init -q r && cd r && echo 1 > f && git add f && git commit -qm one"
                " && echo 2 > f && git stash -q && cat f && git log --format=%an"
            ),
        )
        assert (r.exit_code, r.stdout) == (0, b"sandbox\nsandbox\n1\norchard sandbox\n"), r


def test_image_registry_resolution(tmp_path, caplog):
    (tmp_path / "images" / "ghcr.io_acme_py:3.11").mkdir(parents=True)
    (tmp_path / "rootfs").mkdir()
    reg = ImageRegistry({"mine": tmp_path / "rootfs"}, images_dir=tmp_path / "images")
    assert reg.resolve("host").rootfs == "/"
    assert reg.resolve("mine").rootfs == str(tmp_path / "rootfs")
    assert reg.resolve("ghcr.io/acme/py:3.11").rootfs == str(tmp_path / "images" / "ghcr.io_acme_py:3.11")
    assert reg.names() == ["ghcr.io_acme_py:3.11", "host", "mine"]
    for bad in ("python:3.11", "..", ""):
        with pytest.raises(ImageNotFoundError):
            reg.resolve(bad)
    with caplog.at_level(logging.WARNING):
        lenient = ImageRegistry(fallback="host")
        assert lenient.resolve("python:3.11").rootfs == "/"
        assert lenient.resolve("python:3.11").name == "python:3.11"
    assert caplog.text.count("python:3.11") == 1  # warned once per name
    with pytest.raises(ValueError, match="rootfs"):
        ImageRegistry({"x": tmp_path / "missing"})
    with pytest.raises(ValueError, match="fallback"):
        ImageRegistry(fallback="nope")
    with pytest.raises(ValueError, match="images_dir"):
        ImageRegistry(images_dir=tmp_path / "missing")


def test_shared_folders_that_would_expose_secrets_are_refused(root_dir, tmp_path):
    fine = tempfile.mkdtemp(prefix="orchard-shared-")
    try:
        os.makedirs(os.path.join(fine, "sub"))
        # each entry: a path every sandbox would read, and the word the refusal names
        for folder, why in (("/", "would show"), ("/etc", "would show"), ("/etc/ssl", "would show"),
                            (os.path.expanduser("~"), "would show"), (root_dir, "would show"),
                            (os.path.dirname(root_dir), "would show"), (fine + "/nope", "existing directory")):
            with pytest.raises(ValueError, match=r"shared\['tools'\].*" + why):
                LocalBackend(root_dir, use_bwrap=False, shared={"tools": folder})
        os.symlink(root_dir, os.path.join(fine, "sub", "link"))  # a link into the service: resolved, refused
        with pytest.raises(ValueError, match="would show"):
            LocalBackend(root_dir, use_bwrap=False, shared={"tools": os.path.join(fine, "sub", "link")})
        os.makedirs(os.path.join(fine, "sub", ".ssh"))
        with pytest.raises(ValueError, match=r"\.ssh.*credential"):
            LocalBackend(root_dir, use_bwrap=False, shared={"tools": fine})
        with pytest.raises(ValueError, match="shared names"):
            LocalBackend(root_dir, use_bwrap=False, shared={"../x": tmp_path})
    finally:
        shutil.rmtree(fine)


@needs_bwrap
async def test_a_shared_folder_is_read_only_in_every_sandbox(root_dir):
    folder = tempfile.mkdtemp(prefix="orchard-shared-")
    try:
        os.chmod(folder, 0o755)
        with open(os.path.join(folder, "tool.txt"), "w") as f:
            f.write("one copy\n")
        os.chmod(os.path.join(folder, "tool.txt"), 0o644)
        b = LocalBackend(root_dir, use_bwrap=True, shared={"tools": folder})
        assert b.health()["shared"] == {"tools": "/.orchard-shared/tools"}
        for sid in ("a", "b"):
            await b.create(sid, SandboxSpec())
            r = await b.exec(sid, ExecRequest("cat /.orchard-shared/tools/tool.txt; "
                                              "echo x > /.orchard-shared/tools/tool.txt || echo refused; "
                                              "touch /.orchard-shared/tools/new || echo refused"))
            assert r.stdout == b"one copy\nrefused\nrefused\n", r
        with open(os.path.join(folder, "tool.txt")) as f:
            assert f.read() == "one copy\n"
        assert sorted(os.listdir(folder)) == ["tool.txt"]
        await b.close()
    finally:
        shutil.rmtree(folder)


@pytest.mark.slow
def test_a_second_service_on_one_sandbox_root_is_refused_while_the_first_lives(root_dir, redis_url):
    # Two replicas on one Redis and one root: each would keep its own books of the sandboxes' processes, so a
    # delete through one left the other's running, and a re-created id ran the other's commands in the deleted
    # workspace. The second is refused at start, whatever store it uses.
    store = redis_url.rsplit("/", 1)[0] + "/7"  # a database of its own: the services use the default prefix
    with serve(root_dir, in_process=False, store=store, api_key="k") as first:
        with (pytest.raises(RuntimeError, match="is in use by another service") as info,
              serve(root_dir, in_process=False, store=store, api_key="k")):
            pass
        assert f"pid {first.process.pid}" in str(info.value) and os.path.join(root_dir, "sandboxes") in str(info.value)
        h = {"X-API-Key": "k"}
        assert httpx.post(f"{first.url}/sandboxes", json={"sandbox_id": "s", "block_network": False}, headers=h,
                          timeout=30).is_success
        first.process.send_signal(signal.SIGKILL)  # the lock dies with its process: no stale lock file
        first.process.wait(timeout=10)
    with serve(root_dir, in_process=False, store=store, api_key="k") as second:
        assert httpx.delete(f"{second.url}/sandboxes/s", headers=h, timeout=30).is_success
