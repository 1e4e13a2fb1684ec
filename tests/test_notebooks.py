"""The notebooks run top to bottom on a small saved result, and say what to run when their data is missing."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "claw_learning.ipynb"
RUN = REPO / "tests" / "data" / "claw_run"


def execute(run_dir: Path, monkeypatch) -> nbformat.NotebookNode:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("CLAW_RUN_DIR", str(run_dir))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend, as in Jupyter
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    return nb


def text_of(nb: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
                   for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def images_of(nb: nbformat.NotebookNode) -> list[dict]:  # type: ignore[type-arg]
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]


def test_claw_notebook_runs_on_the_saved_run(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    nb = execute(RUN, monkeypatch)
    out = text_of(nb)
    # The saved run: base / sft / rl on both harnesses, held-out success 0 everywhere; 3 RL steps.
    assert "claw_run base {'react': 0.0, 'text': 0.0}" in out
    assert "claw_run rl {'react': 0.0, 'text': 0.0}" in out
    assert len(images_of(nb)) == 2  # the held-out bars and the GRPO curve


def test_claw_notebook_says_what_to_run_without_data(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    nb = execute(tmp_path, monkeypatch)
    out = text_of(nb)
    assert "python recipes/claw.py --config recipes/configs/claw_tiny.yaml" in out
    assert images_of(nb) == []  # no empty plots


def test_shipped_notebook_holds_its_outputs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert len(images_of(nb)) == 2  # the held-out bars and the GRPO curve of tests/data/claw_run
    assert "claw_run rl {'react': 0.0, 'text': 0.0}" in text_of(nb)
