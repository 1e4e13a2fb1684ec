"""The layers read one way: no import circle between orchard's modules.

Every import statement counts, wherever it stands: at module level, under ``if TYPE_CHECKING:``, and inside a
function. An import inside a function runs late and so cannot fail at start-up, but it still makes the two modules
depend on each other, which is what the layering forbids; both circles this test was written against were closed
through such a lazy import (``rollout.program`` -> ``rollout.proxy``, ``stages.report`` -> ``stages.evaluate``).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_files(root: Path, package: str = "orchard") -> dict[str, Path]:
    """Dotted module name -> file, a package named by its ``__init__.py``."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph(root: Path, package: str = "orchard") -> dict[str, dict[str, int]]:
    """Module -> {module it imports: line of the first such import}, over the modules of ``package`` only.

    ``from a.b import c`` reaches module ``a.b.c`` when there is one, else the module (or package) ``a.b``;
    relative imports are resolved against the importing module's package.
    """
    modules = module_files(root, package)
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        own_package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = own_package.split(".")[: len(own_package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            for target in targets:
                if target in modules and target != module:
                    edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def import_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted; sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph.get(module, {}):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(circles)


def describe(graph: dict[str, dict[str, int]], circle: list[str]) -> str:
    """The circle's imports, one ``a -> b (line n)`` per edge inside it."""
    members = set(circle)
    return "; ".join(f"{module} -> {target} (line {line})" for module in circle
                     for target, line in sorted(graph[module].items()) if target in members)


def test_circles_are_found_through_lazy_and_relative_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    # a -> b at module level; b -> a inside a function: one circle
    (package / "a.py").write_text("from pkg.b import thing\n")
    (package / "b.py").write_text("def f():\n    from pkg import a\n    return a\nthing = 1\n")
    # c -> sub.d relatively, sub.d -> c relatively two levels up: a second circle
    (package / "c.py").write_text("from .sub import d\n")
    (package / "sub" / "d.py").write_text("from .. import c\n")
    # e -> f only: no circle
    (package / "e.py").write_text("import pkg.f\n")
    (package / "f.py").write_text("import json\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.b": 1}
    assert graph["pkg.b"] == {"pkg.a": 2}
    assert graph["pkg.sub.d"] == {"pkg.c": 1}
    assert import_circles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.sub.d"]]
    assert describe(graph, ["pkg.a", "pkg.b"]) == "pkg.a -> pkg.b (line 1); pkg.b -> pkg.a (line 2)"


def test_no_import_circle_between_orchard_modules():
    graph = import_graph(ROOT)
    assert len(graph) > 100  # the walk saw the package
    assert [describe(graph, circle) for circle in import_circles(graph)] == []
