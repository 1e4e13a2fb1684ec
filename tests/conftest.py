"""Set-up shared by test modules in different folders, paid once per session."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def deepspeed_cpu_comm_op() -> None:
    """DeepSpeed's CPU shared-memory op, loaded (JIT-built if it is not yet) in one process before a test starts two
    ranks: two ranks building it into an empty build directory at once can abort one of them (seen in CI on a fresh
    clone). Built where the ranks look: ``TORCH_EXTENSIONS_DIR``, by default the checkout's build/torch_extensions.
    Once per session: each test that starts ranks used to pay this process's DeepSpeed import itself."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "build" / "torch_extensions"))
    proc = subprocess.run([sys.executable, "-c", "from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder; "
                           "ShareMemCommBuilder().load()"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
