"""The recipe tests' way to run a script's command line in process: ``recipes/<name>.py`` loaded as a module and its
``main`` called under ``run_main``, exactly what its ``if __name__ == "__main__"`` line does. A case that only
checks the command line (a config mistake, ``--show-config``) then costs no Python start and no torch import of its
own; each recipe keeps one real subprocess that proves the same line and exit status end to end."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from orchard._cli import run_main

ROOT = Path(__file__).resolve().parents[2]


def load_recipe(name: str) -> ModuleType:
    """``recipes/<name>.py`` as the module ``<name>_recipe`` (loaded once per session)."""
    module_name = f"{name}_recipe"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, ROOT / "recipes" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses resolve the recipe's annotations there
        spec.loader.exec_module(module)
    return sys.modules[module_name]


@pytest.fixture
def recipe_main(capsys):
    """``recipe_main(name, *argv)`` -> (exit status, stdout, stderr) of ``recipes/<name>.py``'s command line."""

    def call(name: str, *argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        status = run_main(load_recipe(name).main, list(argv))
        out, err = capsys.readouterr()
        return status, out, err

    return call


@pytest.fixture
def recipe_module():
    """``recipe_module(name)``: `load_recipe` as a fixture (a test module's ``from conftest import`` breaks when
    another folder's conftest is collected in the same run)."""
    return load_recipe
