import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import orchard

ROOT = Path(__file__).resolve().parents[1]


def test_version_and_typed_marker():
    from importlib.resources import files

    assert orchard.__version__
    assert files("orchard").joinpath("py.typed").is_file()


def test_cli_help_runs():
    out = subprocess.run([sys.executable, "-m", "orchard", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "usage: orchard" in out.stdout


@pytest.mark.parametrize(
    ("resolved", "without_cuda"),
    [
        (["torch", "filelock", "sympy"], True),  # a CPU wheel (a configured local one, or PyPI off Linux)
        (["torch", "nvidia-cublas", "nvidia-cudnn-cu13"], False),  # PyPI's Linux torch: use the CPU index
        (None, False),  # pip could not resolve it at all: the CPU index is the remaining way
    ],
)
def test_setup_takes_the_cpu_index_only_when_torch_would_bring_cuda(tmp_path, resolved, without_cuda):
    # scripts/setup's resolves_without_cuda with a stand-in interpreter: `-m pip` writes the report pip would
    # (or fails), `-c` runs the real Python, so nothing is resolved or downloaded here.
    report = {"install": [{"metadata": {"name": name}} for name in resolved or []]}
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = -m ]; then\n'
        f"  {'exit 1' if resolved is None else ''}\n"
        '  while [ "$1" != --report ]; do shift; done\n'
        f"  printf '%s' '{json.dumps(report)}' > \"$2\"\n"
        "  exit 0\n"
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    script = (
        f"VPY={fake}\n"
        "eval \"$(sed -n '/^TORCH_CPU=/,/^}/p' scripts/setup)\"\n"
        "resolves_without_cuda\n"
    )
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert (out.returncode == 0) is without_cuda, out.stderr


def test_every_data_file_of_the_package_ships():
    # A wheel holds a package's non-Python files only where setup.cfg's package_data names them: box.c missing
    # there would leave an installed orchard unable to build the compiled box (the sandboxes fall back silently).
    from setuptools.config.setupcfg import read_configuration

    declared = read_configuration(ROOT / "setup.cfg")["options"]["package_data"]
    shipped = {path for package, patterns in declared.items() for pattern in patterns
               for path in (ROOT / package.replace(".", "/")).glob(pattern)}
    data = {path for path in (ROOT / "orchard").rglob("*")
            if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts}
    assert ROOT / "orchard/env/agent/box.c" in data
    assert sorted(str(p.relative_to(ROOT)) for p in data - shipped) == []


def test_every_module_of_the_package_ships():
    # setup.cfg's `packages = find:` takes only folders with an __init__.py: a folder of modules without one
    # imports from a checkout (a namespace package) but is left out of the wheel, so `pip install orchard-rl`
    # would lack it (orchard.domains.claw did).
    from setuptools import find_packages

    found = {ROOT.joinpath(*name.split(".")) for name in find_packages(ROOT, include=["orchard*"])}
    with_modules = {path.parent for path in (ROOT / "orchard").rglob("*.py") if "__pycache__" not in path.parts}
    assert sorted(str(p.relative_to(ROOT)) for p in with_modules - found) == []


def private_imports(tree: ast.AST) -> list[str]:
    """The dotted orchard names an import statement reaches with a private part (``a._b``, ``a._b.c``, ``_c`` from
    ``a.b``), dunders (``__init__``) aside."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [name for name in names if name.startswith("orchard.")
                  and any(p.startswith("_") and not p.startswith("__") for p in name.split("."))]
    return found


def test_no_module_reaches_into_another_packages_private_parts():
    # `a.b._c` (a module, or a name of `a.b`'s __init__) belongs to package `a.b`, and `a.b.m._c` (a name of module
    # `a.b.m`) to `a.b` too: modules of `a.b` and below may import them, the others import what `a.b` exports.
    # `orchard._extras` is the whole package's (every module is below `orchard`).
    reached = []
    for path in sorted((ROOT / "orchard").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        package = module.removesuffix(".__init__") if path.name == "__init__.py" else module.rpartition(".")[0]
        for name in private_imports(ast.parse(path.read_text())):
            parts = name.split(".")
            owner = ".".join(parts[: next(i for i, p in enumerate(parts) if p.startswith("_") and not p.startswith("__"))])
            if not (ROOT / owner.replace(".", "/")).is_dir():
                owner = owner.rpartition(".")[0]
            if package != owner and not package.startswith(owner + "."):
                reached.append(f"{module} imports {name}")
    assert reached == []
