"""`orchard serve-model` and `orchard serve-proxy` as real child processes on loopback."""

import subprocess
import sys

import httpx
import pytest

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
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_serve_model_and_proxy_processes():
    model, model_url = _start(["serve-model", "--model", "tiny", "--port", "0", "--max-tokens", "8"])
    try:
        proxy, proxy_url = _start(["serve-proxy", "--upstream", model_url, "--port", "0"])
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
            assert (
                via["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
            )  # same seed, same sample
            assert 1 <= len(direct["choices"][0]["token_ids"]) <= 8
            calls = httpx.get(f"{proxy_url}/sessions/a/calls").json()["calls"]
            assert len(calls) == 1 and calls[0]["prompt_ids"] == [direct["prompt_token_ids"]]
            assert calls[0]["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
            assert httpx.delete(f"{proxy_url}/sessions/a").json()["calls"] == 1
            assert httpx.get(f"{proxy_url}/sessions").json() == {"sessions": []}
        finally:
            _stop(proxy)
    finally:
        _stop(model)
