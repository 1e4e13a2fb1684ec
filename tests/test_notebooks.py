"""The notebooks run top to bottom on a small saved result, and say what to run when their data is missing."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "claw_learning.ipynb"
RUN = REPO / "tests" / "data" / "claw_run"
SWE_NOTEBOOK = REPO / "notebooks" / "swe_rl.ipynb"
# What `benchmarks/swe_rl.py --quick --seeds 0 --variants grpo_bar rpr` wrote (with RL on unfiltered instances,
# one template, groups of 2 of up to 4, 3 value candidates), its recipe outputs less models, logs and plots.
SWE_RUN = REPO / "tests" / "data" / "swe_rl_run"


def execute(run_dir: Path, monkeypatch, notebook: Path = NOTEBOOK,  # type: ignore[no-untyped-def]
            env: str = "CLAW_RUN_DIR") -> nbformat.NotebookNode:
    monkeypatch.setenv(env, str(run_dir))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend, as in Jupyter
    nb = nbformat.read(notebook, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(notebook.parent)}}).execute()
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


def test_swe_rl_notebook_runs_on_the_benchmarks_output(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    nb = execute(SWE_RUN, monkeypatch, SWE_NOTEBOOK, "SWE_RL_DIR")
    out = text_of(nb)
    assert "{'grpo_bar': [0], 'rpr': [0]}" in out  # both variants of seed 0 found
    # The saved run resolved nothing held-out: SFT, RL and the value stage all at 0.
    assert "rpr seed 0 {'base': {'bash': 0.0}, 'sft': {'bash': 0.0}, 'rl': {'bash': 0.0}}" in out
    # rpr: 2 steps x 2 tasks x a BAR budget of 4 = 16 rollouts graded, none removed (the programmatic judge).
    assert "rpr seed 0: graded 16, removed 0" in out
    # Every pool was all failed, so BAR dropped all 2 steps x 2 groups of each variant.
    assert "grpo_bar: 4 groups, 4 dropped by BAR" in out and "rpr: 4 groups, 4 dropped by BAR" in out
    assert "rpr {'rerank/success': 0.0, 'rerank/random': 0.0, 'rerank/oracle': 0.0}" in out
    # summary.md shown as Markdown, and four figures: resolve rate, judge, BAR, value curves
    assert any("text/markdown" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert len(images_of(nb)) == 4


def test_swe_rl_notebook_says_what_to_run_without_data(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    nb = execute(tmp_path, monkeypatch, SWE_NOTEBOOK, "SWE_RL_DIR")
    assert "python benchmarks/swe_rl.py --quick --seeds 0 rl.filter.enabled=false" in text_of(nb)
    assert images_of(nb) == []  # no empty plots


def test_shipped_swe_rl_notebook_has_no_outputs() -> None:
    nb = nbformat.read(SWE_NOTEBOOK, as_version=4)
    assert all(not c.outputs and c.execution_count is None for c in nb.cells if c.cell_type == "code")
