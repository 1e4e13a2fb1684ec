"""Bug injection by AST mutation: where a module can be mutated (`mutation_sites`) and the mutated source
(`apply_mutation`).

The families are the ones public bug-injection generators use (mutation testing's operators, SWE-smith's
procedural modifications):

    operator      a wrong arithmetic operator (+ <-> -, * -> /, / -> *, // -> /, % -> //, ** -> *), += <-> -=
    comparison    a wrong comparison (< <-> <=, > <-> >=, == <-> !=, in <-> not in), and <-> or
    constant      an integer constant one off (n -> n + 1, n -> n - 1), True <-> False
    default       the same, in a parameter's default value
    swap          swapped operands of a non-commutative operator or of a comparison (a - b -> b - a)
    invert        an inverted condition (if a < b -> if a >= b, if c -> if not c: the branches trade places)
    remove        a removed statement: an assignment, a call, a raise, a branch (if) or a loop (for)

A mutation edits only the text of the node it changes (or deletes the statement's lines), so the rest of the
file keeps its formatting and the gold patch is a small diff. Each edit is checked by parsing the result and
comparing its AST with the AST mutated directly; a site where the two differ is not offered.
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass

_BINOPS: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
    ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult}
_CMPOPS: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.In: ast.NotIn, ast.NotIn: ast.In}
_COMPLEMENTS: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.LtE: ast.Gt, ast.Gt: ast.LtE, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_NON_COMMUTATIVE = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
_REMOVABLE = (ast.Assign, ast.AugAssign, ast.Expr, ast.Raise, ast.If, ast.For)

FAMILIES = ("operator", "comparison", "constant", "default", "swap", "invert", "remove")


@dataclass(frozen=True, order=True)
class Mutation:
    """One mutation of one module: the ``node``-th node of ``ast.walk`` over it, changed as ``change`` says."""

    module: str
    """The module's path in the repository."""
    node: int
    change: str
    """What happens to the node: ``op``, ``plus``, ``minus``, ``flip``, ``swap``, ``not`` or ``remove``."""
    family: str
    function: str
    """The enclosing function (``Class.method``), or ``<module>``."""
    line: int

    @property
    def key(self) -> str:
        """A stable name of the mutation (module, node, change)."""
        return f"{self.module}:{self.node}:{self.change}"


def _parents(tree: ast.AST) -> dict[ast.AST, tuple[ast.AST, str]]:
    parents = {}
    for parent in ast.walk(tree):
        for name, value in ast.iter_fields(parent):
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.AST):
                    parents[child] = (parent, name)
    return parents


def _function_of(node: ast.AST, parents: dict[ast.AST, tuple[ast.AST, str]]) -> str:
    names = []
    while node in parents:
        node = parents[node][0]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
    return ".".join(reversed(names)) or "<module>"


def _changes(node: ast.AST, parent: ast.AST | None, field: str) -> list[tuple[str, str]]:
    """(change, family) pairs that apply to ``node``."""
    out: list[tuple[str, str]] = []
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        out.append(("op", "operator"))
        if isinstance(node.op, _NON_COMMUTATIVE):
            out.append(("swap", "swap"))
    elif isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.Add, ast.Sub)):
        out.append(("op", "operator"))
    elif isinstance(node, ast.Compare) and len(node.ops) == 1:
        if type(node.ops[0]) in _CMPOPS:
            out.append(("op", "comparison"))
        if isinstance(node.ops[0], (ast.Lt, ast.LtE, ast.Gt, ast.GtE)):
            out.append(("swap", "swap"))
    elif isinstance(node, ast.BoolOp):
        out.append(("op", "comparison"))
    elif isinstance(node, ast.Constant) and type(node.value) is bool:
        out.append(("flip", "default" if field in ("defaults", "kw_defaults") else "constant"))
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        family = "default" if field in ("defaults", "kw_defaults") else "constant"
        out += [("plus", family), ("minus", family)]
    if isinstance(node, ast.If) and not (isinstance(parent, ast.If) and field == "orelse"):
        out.append(("not", "invert"))
    if isinstance(node, _REMOVABLE) and field in ("body", "orelse") and not (
            isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)) and not (
            isinstance(node, ast.If) and isinstance(parent, ast.If) and field == "orelse"):
        out.append(("remove", "remove"))
    return out


def _mutate_node(node: ast.AST, change: str) -> ast.AST:
    """The node after ``change`` (a new node; ``node`` is left as it was)."""
    new = copy.deepcopy(node)
    if change == "op" and isinstance(new, (ast.BinOp, ast.AugAssign)):
        new.op = (_BINOPS[type(new.op)] if isinstance(new, ast.BinOp) else
                  ast.Sub if isinstance(new.op, ast.Add) else ast.Add)()
    elif change == "op" and isinstance(new, ast.Compare):
        new.ops = [_CMPOPS[type(new.ops[0])]()]
    elif change == "op" and isinstance(new, ast.BoolOp):
        new.op = ast.Or() if isinstance(new.op, ast.And) else ast.And()
    elif change == "swap" and isinstance(new, ast.BinOp):
        new.left, new.right = new.right, new.left
    elif change == "swap" and isinstance(new, ast.Compare):
        new.left, new.comparators = new.comparators[0], [new.left]
    elif change == "flip" and isinstance(new, ast.Constant):
        new.value = not new.value
    elif change in ("plus", "minus") and isinstance(new, ast.Constant):
        new.value = new.value + (1 if change == "plus" else -1)
    elif change == "not" and isinstance(new, ast.If):
        new.test = _negation(new.test)
    else:
        raise ValueError(f"change {change!r} does not apply to {type(node).__name__}")
    return new


def _negation(test: ast.expr) -> ast.expr:
    """``not test`` as a programmer would write it: ``a >= b`` for ``a < b``, ``x`` for ``not x``."""
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        return ast.Compare(test.left, [_COMPLEMENTS[type(test.ops[0])]()], test.comparators)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return test.operand
    return ast.UnaryOp(ast.Not(), test)


def _edit_text(source: str, node: ast.AST, change: str, parens: bool) -> str:
    lines = source.splitlines(keepends=True)
    if change == "remove":
        indent = " " * node.col_offset
        start, end = node.lineno - 1, node.end_lineno
        return "".join(lines[:start]) + (f"{indent}pass\n" if parens else "") + "".join(lines[end:])
    target = node.test if change == "not" else node  # type: ignore[attr-defined]
    if target.lineno != target.end_lineno:
        raise ValueError("multi-line node")
    new = _mutate_node(node, change)
    text = ast.unparse(new.test if change == "not" else new)  # type: ignore[attr-defined]
    if parens:
        text = f"({text})"
    row = lines[target.lineno - 1]
    encoded = row.encode()
    row = (encoded[: target.col_offset].decode() + text + encoded[target.end_col_offset:].decode())
    return "".join(lines[: target.lineno - 1]) + row + "".join(lines[target.lineno:])


def _expected_tree(source: str, index: int, change: str) -> ast.Module:
    tree = ast.parse(source)
    nodes = list(ast.walk(tree))
    node = nodes[index]
    parent, field = _parents(tree)[node]
    siblings = getattr(parent, field)
    if change == "remove":
        siblings.remove(node)
        if not siblings and field == "body":
            siblings.append(ast.Pass())
        return tree
    new = _mutate_node(node, change)
    if isinstance(siblings, list):
        siblings[siblings.index(node)] = new
    else:
        setattr(parent, field, new)
    return tree


def apply_mutation(source: str, mutation: Mutation) -> str:
    """The module's source with ``mutation`` applied (raises ValueError when the site cannot be edited as text)."""
    tree = ast.parse(source)
    nodes = list(ast.walk(tree))
    if not 0 <= mutation.node < len(nodes):
        raise ValueError(f"mutation.node {mutation.node} is not a node of {mutation.module}")
    node = nodes[mutation.node]
    parents = _parents(tree)
    if node not in parents or mutation.change not in {c for c, _ in _changes(node, *parents[node])}:
        raise ValueError(f"mutation {mutation.key} cannot be written: {mutation.change!r} does not apply to "
                         f"{type(node).__name__}")
    parent, field = parents[node]
    expected = ast.dump(_expected_tree(source, mutation.node, mutation.change))
    # a removed statement leaves `pass` only where its block would be empty; an expression gets parentheses
    # only where its context binds tighter than the new operator
    attempts = [len(getattr(parent, field)) == 1 and field == "body"] if mutation.change == "remove" else [False, True]
    for parens in attempts:
        try:
            text = _edit_text(source, node, mutation.change, parens)
            if ast.dump(ast.parse(text)) == expected:
                return text
        except (SyntaxError, ValueError):
            continue
    raise ValueError(f"mutation {mutation.key} cannot be written as a text edit")


def mutation_sites(module: str, source: str) -> list[Mutation]:
    """Every mutation of ``source`` that `apply_mutation` can write, in a fixed order (node, then change)."""
    tree = ast.parse(source)
    parents = _parents(tree)
    sites = []
    for index, node in enumerate(ast.walk(tree)):
        if isinstance(node, (ast.Import, ast.ImportFrom)) or node not in parents:
            continue
        parent, field = parents[node]
        for change, family in _changes(node, parent, field):
            mutation = Mutation(module, index, change, family, _function_of(node, parents),
                                getattr(node, "lineno", 0))
            try:
                apply_mutation(source, mutation)
            except ValueError:
                continue
            sites.append(mutation)
    return sites
