"""Output of the plain CPU engine: progress redrawn on a terminal, a line at the first and last step (then one per
interval) in a log; no DeepSpeed import, no transformers bars."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import textwrap
from pathlib import Path

CHILD = textwrap.dedent(
    """
    import sys, tempfile
    from functools import partial
    import torch
    from orchard.data import collate
    from orchard.train.model import load_causal_lm, save_causal_lm
    from orchard.train.tiny import tiny_qwen3
    from orchard.train.trainer import TrainConfig, Trainer

    out = sys.argv[1]
    model = tiny_qwen3(32, seed=0)
    ids = torch.arange(24).reshape(3, 8) % 32
    samples = [{"input_ids": ids[i].tolist(), "action_mask": [0] * 3 + [1] * 5} for i in range(3)]
    trainer = Trainer(model, TrainConfig(total_steps=3, global_batch_size=2, micro_batch_size=2, output_dir=out + "/t"))
    trainer.fit(samples, lambda rows: {
        "input_ids": torch.tensor([r["input_ids"] for r in rows]),
        "attention_mask": torch.ones(len(rows), 8, dtype=torch.long),
        "action_mask": torch.tensor([r["action_mask"] for r in rows], dtype=torch.bool),
    })
    trainer.close()
    save_causal_lm(model, out + "/ckpt")
    load_causal_lm(out + "/ckpt")
    print("deepspeed imported:", "deepspeed" in sys.modules, flush=True)
    """
)


def run_child(tmp_path: Path, *, tty: bool) -> tuple[str, str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    if not tty:
        proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                              timeout=300, check=True)
        return proc.stdout, proc.stderr
    controller, terminal = pty.openpty()
    # A fresh pty is 0 columns wide, where tqdm draws nothing; give it a real terminal's size.
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, stderr=terminal,
                            text=True)
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the child closed the terminal (EIO)
            break
        if not chunk:
            break
        chunks.append(chunk)
    stdout = proc.stdout.read() if proc.stdout else ""
    assert proc.wait(timeout=300) == 0
    os.close(controller)
    return stdout, b"".join(chunks).decode(errors="replace")


def test_plain_engine_on_a_pipe_writes_progress_lines_and_never_imports_deepspeed(tmp_path: Path) -> None:
    stdout, stderr = run_child(tmp_path, tty=False)
    lines = stdout.strip().splitlines()
    # the first step and the last (3 steps take well under the 30 s interval), then the child's own line
    assert [line.split("  ")[0] for line in lines] == ["t: step 1/3", "t: step 3/3", "deepspeed imported: False"]
    assert "loss " in lines[0] and "tok/s" in lines[0] and "ETA " in lines[0] and lines[1].endswith("done")
    for noise in ("Setting accelerator", "ds_accelerator", "Loading weights", "Writing model shards", "step/s",
                  "it/s"):
        assert noise not in stderr, (noise, stderr)


def test_fit_draws_a_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    stdout, stderr = run_child(tmp_path, tty=True)
    assert stdout.strip() == "deepspeed imported: False"  # on a terminal, progress is redrawn on stderr only
    assert "step 3/3" in stderr and "loss" in stderr and "\r" in stderr  # redrawn up to the last step
    assert "Loading weights" not in stderr and "Writing model shards" not in stderr
