"""`orchard serve-model` and `orchard serve-proxy` as real child processes on loopback."""

import socket
import subprocess
import sys

import httpx
import openai
import pytest

from orchard.cli import build_parser
from orchard.env.client._common import DEFAULT_BASE_URL
from orchard.rollout.cli import READY_PREFIX


def _start(argv):
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchard", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(READY_PREFIX):
            return proc, line[len(READY_PREFIX) :].strip()
    proc.wait()
    raise AssertionError("server did not start:\n" + "".join(lines))


def _stop(proc):
    """Stop a server; returns what it printed after its ready line."""
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


def _orchard(*argv):
    return subprocess.run(
        [sys.executable, "-m", "orchard", *argv], capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_serve_model_and_proxy_processes():
    model, model_url = _start(["serve-model", "--model", "tiny", "--port", "0", "--max-tokens", "8"])
    model_log = ""
    try:
        # the habit of OpenAI base URLs (a trailing /v1) works; with --tokenizer, log-prob labels are text
        proxy, proxy_url = _start(["serve-proxy", "--upstream", f"{model_url}/v1", "--port", "0", "--tokenizer", "tiny"])
        try:
            assert httpx.get(f"{model_url}/health").json() == {"status": "ok"}
            assert httpx.get(f"{model_url}/v1/models").json()["data"][0]["id"] == "tiny"
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "logprobs": True,
                "seed": 3,
            }
            direct = httpx.post(f"{model_url}/v1/chat/completions", json=body, timeout=60).json()
            via = httpx.post(f"{proxy_url}/sessions/a/v1/chat/completions", json=body, timeout=60).json()
            ids = direct["choices"][0]["token_ids"]
            assert via["choices"][0]["token_ids"] == ids  # same seed, same sample
            assert 1 <= len(ids) <= 8
            assert not any(e["token"].startswith("token_id:") for e in via["choices"][0]["logprobs"]["content"])
            # streamed through the proxy: the same sample, recorded as a second call
            client = openai.OpenAI(base_url=f"{proxy_url}/sessions/a/v1", api_key="unused", max_retries=0)
            chunks = list(client.chat.completions.create(**body, stream=True))
            assert [t for c in chunks for ch in c.choices for t in ch.model_extra.get("token_ids") or []] == ids
            calls = httpx.get(f"{proxy_url}/sessions/a/calls").json()["calls"]
            assert len(calls) == 2 and calls[0]["prompt_ids"] == [direct["prompt_token_ids"]]
            assert calls[0]["choices"][0]["token_ids"] == calls[1]["choices"][0]["token_ids"] == ids
            samples = httpx.get(f"{proxy_url}/sessions/a/samples").json()["samples"]
            assert samples[1]["input_ids"] == direct["prompt_token_ids"] + ids
            assert httpx.delete(f"{proxy_url}/sessions/a").json()["calls"] == 2
            assert httpx.get(f"{proxy_url}/sessions").json() == {"sessions": []}
            # a port in use: one line naming host and port, no traceback
            port = int(proxy_url.rsplit(":", 1)[1])
            busy = _orchard("serve-model", "--model", "tiny", "--port", str(port))
            assert busy.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in busy.stderr
            assert len(busy.stderr.strip().splitlines()) == 1, busy.stderr
        finally:
            _stop(proxy)
    finally:
        model_log = _stop(model)
    # the access log: a line per request at the default level
    assert model_log.count('"POST /v1/chat/completions HTTP/1.1" 200') == 3, model_log


def test_missing_model_path_is_one_line(tmp_path):
    done = _orchard("serve-model", "--model", str(tmp_path / "nope"), "--port", "0")
    assert done.returncode == 2 and "is not a directory" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_serve_proxy_record_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    done = _orchard("serve-proxy", "--upstream", "http://127.0.0.1:9", "--port", "0",
                    "--record-dir", str(tmp_path / "file"))
    assert done.returncode == 2 and "record_dir" in done.stderr and "is not a directory" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert build_parser().parse_args(["serve-proxy", "--upstream", "http://x"]).record_dir is None


def test_serve_proxy_record_dir_survives_a_restart_of_the_process(tmp_path):
    from orchard.rollout.proxy_records import CallRecord, RecordedChoice, SessionFiles

    record = CallRecord("s", "completions", {"prompt": [4]}, {"choices": []}, [[4]],
                        [RecordedChoice([5, 6], [-0.5, -0.25], "stop")], 1.5, 0.25)
    SessionFiles(tmp_path).append(record)  # what an earlier proxy process recorded
    argv = ["serve-proxy", "--upstream", "http://127.0.0.1:9", "--port", "0", "--record-dir", str(tmp_path)]
    body = {"model": "orchard", "prompt": [4]}
    proxy, url = _start(argv)
    try:
        assert httpx.get(f"{url}/sessions/s/calls").json()["calls"] == [record.to_dict()]
        assert httpx.post(f"{url}/sessions/s/v1/completions", json=body).status_code == 502  # dead upstream
        assert httpx.post(f"{url}/sessions/s/end").json()["ended"] is True
    finally:
        _stop(proxy)
    proxy, url = _start(argv)
    try:
        refused = httpx.post(f"{url}/sessions/s/v1/completions", json=body)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "session_ended"
        assert httpx.get(f"{url}/sessions").json() == {"sessions": ["s"]}
    finally:
        _stop(proxy)


def test_default_ports_do_not_collide_with_the_sandbox_clients_url():
    parser = build_parser()
    sandbox_port = int(DEFAULT_BASE_URL.rsplit(":", 1)[1])  # http://localhost:8000
    model = parser.parse_args(["serve-model", "--model", "tiny"]).port
    proxy = parser.parse_args(["serve-proxy", "--upstream", "http://x"]).port
    assert len({sandbox_port, model, proxy}) == 3


def test_env_serve_removes_the_temp_root_it_made_and_names_a_busy_port():
    import re
    from pathlib import Path

    proc = subprocess.Popen(
        [sys.executable, "-m", "orchard", "env", "serve", "--backend", "local-process-group"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    root = None
    for line in proc.stdout:
        if m := re.match(r"orchard env: state and sandboxes in (.+)", line):
            root = Path(m.group(1).strip())
        if line.startswith("SANDBOX_BASE_URL="):
            break
    assert root is not None and root.is_dir()
    _stop(proc)
    assert not root.exists()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        busy = _orchard("env", "serve", "--backend", "local-process-group", "--port", str(port))
    assert busy.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in busy.stderr, busy.stderr
