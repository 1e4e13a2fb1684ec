"""The service is honest about isolation, and easy to find: tested as a server, with real processes.

Fail closed: without bubblewrap (the "local-process-group" backend asks for the fallback explicitly) a create
with `block_network: true` is refused with 501 unless the operator opted in; with the opt-in the sandbox says
`isolation: "process-group"` and `block_network: false`, and its commands do reach the service's port, which
a network-blocked sandbox under bubblewrap cannot. Paths: what `pwd` prints is a path the file API takes, in
both modes. The command line: `orchard env serve` prints the variables the client reads.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from urllib.parse import urlsplit

import httpx
import pytest
from _box import requires

from orchard.env import RetryPolicy, SandboxClient, SandboxConnectionError, ServerError
from orchard.env.agent.isolation import probe_bubblewrap
from orchard.env.backends.local import DEFAULT_UID_RANGE
from orchard.env.embedded import KEY_PREFIX, READY_PREFIX, parse_printed, serve

IS_ROOT = os.geteuid() == 0
needs_bwrap = requires(probe_bubblewrap((DEFAULT_UID_RANGE[0],) * 2 if IS_ROOT else None), "bubblewrap")
NO_RETRY = RetryPolicy(max_attempts=1)


def connect_command(url: str) -> str:
    """A shell command that prints "reached" only if it can open a TCP connection to the service at `url`."""
    parts = urlsplit(url)
    return f"(exec 3<>/dev/tcp/{parts.hostname}/{parts.port}) 2>/dev/null && echo reached || echo refused"


@pytest.fixture(scope="module")
def weak_service():
    # a child process: the opt-in travels on its command line, the URL comes back on its printed line
    with serve(backend="local-process-group", allow_weak_isolation=True, in_process=False) as svc:
        yield svc


def test_without_bubblewrap_a_blocked_network_is_refused_with_the_cause_and_the_fix():
    with serve(backend="local-process-group") as svc:
        answer = httpx.post(svc.url + "/sandboxes", headers={"X-API-Key": svc.api_key}, timeout=30,
                            json={"sandbox_id": "net-blocked"})
        assert answer.status_code == 501
        detail = answer.json()["detail"]
        assert detail["error"] == "isolation_unavailable"
        for words in ("block_network=true cannot be enforced", "bubblewrap", "--allow-weak-isolation"):
            assert words in detail["message"]
        with SandboxClient(svc.url, svc.api_key, retry=NO_RETRY, auto_cleanup=False) as client:
            with pytest.raises(ServerError) as info:
                client.create()
            assert info.value.status_code == 501 and "--allow-weak-isolation" in str(info.value)
            assert client.list_sandboxes() == []  # nothing was left half-made
            # asking for the network is not refused: nothing is promised that does not hold
            with client.create(block_network=False) as sb:
                view = sb.refresh()
                assert (view["isolation"], view["block_network"]) == ("process-group", False)


def test_with_the_opt_in_the_weak_isolation_is_reported_and_real(weak_service):
    with SandboxClient(weak_service.url, weak_service.api_key, auto_cleanup=False) as client:
        with client.create() as sb:  # block_network=True asked for ...
            view = sb.refresh()
            # ... but not enforced, so not reported
            assert (view["isolation"], view["block_network"]) == ("process-group", False)
            assert client.list_sandboxes()[0]["isolation"] == "process-group"
            assert sb.exec(connect_command(weak_service.url)).stdout == "reached\n"
        health = httpx.get(weak_service.url + "/health").json()
        assert health["isolation"] == "process-group"


@needs_bwrap
def test_under_bubblewrap_a_blocked_network_cannot_reach_the_service():
    with (serve() as svc, SandboxClient(svc.url, svc.api_key, auto_cleanup=False) as client,
          client.create() as blocked, client.create(block_network=False) as open_):
        view = blocked.refresh()
        assert (view["isolation"], view["block_network"]) == ("bubblewrap", True)
        assert blocked.exec(connect_command(svc.url)).stdout == "refused\n"
        # the same command does connect where the network is allowed: the probe can tell the two apart
        assert open_.refresh()["block_network"] is False
        assert open_.exec(connect_command(svc.url)).stdout == "reached\n"


@pytest.fixture(scope="module")
def strong_service():
    with serve() as svc:
        yield svc


@pytest.mark.parametrize("mode", [pytest.param("bubblewrap", marks=needs_bwrap), "process-group"])
def test_the_path_pwd_prints_is_a_path_the_file_api_takes(mode, request):
    svc = request.getfixturevalue("strong_service" if mode == "bubblewrap" else "weak_service")
    with SandboxClient(svc.url, svc.api_key, auto_cleanup=False) as client, client.create() as sb:
        assert sb.refresh()["isolation"] == mode
        assert sb.exec("mkdir sub").exit_code == 0
        here = sb.exec("cd sub && pwd").stdout.strip()
        assert sb.upload(f"{here}/from-pwd.txt", "uploaded\n") == 9  # len("uploaded\n")
        assert sb.exec("cat sub/from-pwd.txt").stdout == "uploaded\n"
        assert sb.download(f"{here}/from-pwd.txt") == b"uploaded\n"
        assert [e.name for e in sb.list_files(here)] == ["from-pwd.txt"]
        assert sb.exec("pwd", cwd=here).stdout.strip() == here  # and as an exec's cwd
        # the documented form works in both modes too
        assert sb.download("/workspace/sub/from-pwd.txt") == b"uploaded\n"


def test_a_client_that_cannot_reach_the_service_says_where_it_tried_and_how_to_fix_it(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens here once the socket closes
    monkeypatch.setenv("SANDBOX_BASE_URL", url)
    with SandboxClient(retry=NO_RETRY, auto_cleanup=False) as client, pytest.raises(SandboxConnectionError) as info:
        client.health()
    message = str(info.value)
    for words in (f"GET {url}/health", f"$SANDBOX_BASE_URL={url}", "orchard env serve", "SANDBOX_API_KEY"):
        assert words in message


def run_orchard(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchard", *args], capture_output=True, text=True, timeout=120)


def test_orchard_env_alone_prints_its_help():
    done = run_orchard("env")
    assert done.returncode == 2 and "serve" in done.stdout and "Traceback" not in done.stderr


def test_serve_help_shows_the_defaults():
    done = run_orchard("env", "serve", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())  # argparse wraps lines where the terminal width says
    for default in ("(default: 127.0.0.1)", "(default: 64)", "(default: 600.0)", "(default: local)"):
        assert default in text


def test_serve_prints_lines_a_shell_can_export_for_the_client():
    root = tempfile.mkdtemp(prefix="orchard-env-cli-")
    proc = subprocess.Popen([sys.executable, "-m", "orchard", "env", "serve", "--root", root,
                             "--backend", "local-process-group", "--allow-weak-isolation"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        printed = {}
        while len(printed) < 2:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            for prefix in (READY_PREFIX, KEY_PREFIX):
                if line.startswith(prefix):
                    printed[prefix] = line.strip()
        # the lines as a user pastes them after `export`, in a shell that then runs a client with no arguments
        script = "import sys; from orchard.env import SandboxClient; c = SandboxClient(); " \
                 "sys.stdout.write(c.resources()['status'] + ' ' + c.base_url)"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_")}
        shell = f"export {printed[READY_PREFIX]} {printed[KEY_PREFIX]} && {shlex.quote(sys.executable)} -c " \
                f"{shlex.quote(script)}"
        done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=60, env=env)
        assert done.stdout == f"ok {parse_printed(printed[READY_PREFIX], READY_PREFIX)}", done.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        stderr = proc.stderr.read()
        shutil.rmtree(root, ignore_errors=True)
    assert "not isolated" in stderr


def test_printed_values_are_unquoted_as_a_shell_would():
    assert parse_printed("SANDBOX_BASE_URL=http://127.0.0.1:80\n", READY_PREFIX) == "http://127.0.0.1:80"
    assert parse_printed("SANDBOX_BASE_URL='http://[::1]:80'", READY_PREFIX) == "http://[::1]:80"
    with pytest.raises(ValueError, match="line"):
        parse_printed("ORCHARD_ENV_URL=x", READY_PREFIX)
