"""benchmarks/gpu_check.sh on a machine whose torch cannot see a GPU: the log-probs section fails rather than passing
on tests that skipped their CUDA cases. Every command the script runs is stood in for by a fake interpreter that
succeeds (pytest reporting the CUDA test skipped, each benchmark exiting 0), except ``-c`` snippets, which the real
Python runs with no CUDA device visible: only the script's own checks can make it fail."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/usr/bin/env bash
if [[ "$1" == "-c" ]]; then CUDA_VISIBLE_DEVICES="" exec "$REAL_PYTHON" "$@"; fi
if [[ "$1 $2" == "-m pytest" ]]; then
    echo "SKIPPED [2] tests/losses/test_fused.py:335: needs a CUDA device (run by benchmarks/gpu_check.sh)"
    echo "40 passed, 2 skipped in 1.00s"
fi
exit 0
"""


def test_the_log_probs_section_fails_without_a_visible_gpu(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=str(fake), REAL_PYTHON=sys.executable, OUT=str(out),
               WHEELS_DIR=str(tmp_path / "no_wheels"))
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "logprobs_cuda_missing.txt").read_text().startswith(
        "the log-probs section needs a CUDA device: torch here cannot see one")
    # the skipped CUDA test fails the section on its own too
    assert (out / "logprobs_tests.txt").read_text().endswith("a log-probs test skipped on the device (listed above)\n")
