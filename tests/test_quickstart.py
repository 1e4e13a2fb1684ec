"""The README's python blocks run as printed, each in a fresh interpreter (as a reader would paste them)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchard.env.embedded import serve

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_the_blocks_we_run() -> None:
    blocks = python_blocks()
    assert len(blocks) >= 2
    assert any("policy_loss" in b and "backward()" in b for b in blocks)
    assert any("SandboxClient" in b for b in blocks)


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_block_runs(index: int, tmp_path: Path) -> None:
    block = python_blocks()[index]
    env = dict(os.environ)
    with contextlib.ExitStack() as stack:
        if "SandboxClient" in block:
            service = stack.enter_context(serve(in_process=False))
            # The client finds the service through the variables `orchard env serve` prints.
            env.update(SANDBOX_BASE_URL=service.url, SANDBOX_API_KEY=service.api_key)
        proc = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, env=env, cwd=tmp_path,
                              timeout=300)
    assert proc.returncode == 0, f"README block {index} failed:\n{block}\n--- stderr ---\n{proc.stderr[-3000:]}"
    if "SandboxClient" in block:
        assert proc.stdout.strip() == "hi"
    if "policy_loss" in block:
        assert proc.stdout.startswith("loss ")
