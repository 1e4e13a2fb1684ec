"""A seeded, offline generator of toy SWE instances: a real bug in a small Python package, an issue written from
its failing behaviour, the gold fix and the hidden tests, verified with pytest. The CPU default of the SWE
domain: no network, no images, no GPU.

How one instance is made (`make_instance(template, seed, level=...)`):

1. The template's modules (`orchard.domains.swe.templates`) pass their whole suite (checked with pytest).
2. The seed picks a mutation family (uniformly, so the many integer constants of a month table do not
   dominate), then mutations of it (`orchard.domains.swe.mutations`) in a seeded order, each run against the
   suite (a fast child process, cached); the first that breaks at least one test and leaves at least one
   passing is the bug.
3. The tests the bug breaks are ``FAIL_TO_PASS``; they are taken out of the repository's test files and come
   back only in ``test_patch`` (the agent cannot read them). The rest of the suite is ``PASS_TO_PASS``.
4. The issue shows a snippet a user ran (a failing test's set-up and call) and what it gave against what it
   should give, read from running the snippet on the buggy code; it never names the line.
5. Verification, with ``python -m pytest -q -p no:cacheprovider`` in a temporary directory, the patches applied
   with ``git apply``: with ``test_patch``, ``FAIL_TO_PASS`` fails and ``PASS_TO_PASS`` passes; with ``patch``
   too, all pass.

Difficulty levels (our reading of the issue's "1 the fix is in the module the issue names; 2 the module must be
found; 3 the fix spans two places"):

    1  one mutation; the issue names its module, and shows a failing test of that module where there is one;
    2  one mutation; the issue names no module, and shows a failing test of another module where there is one;
    3  two mutations in two modules; the issue names no module and shows one failing behaviour of each; fixing
       only one of them leaves a test failing (checked).

Splits: a mutation belongs to the held-out split when a hash of (template, mutation) is 0 mod 4, else to train,
so no held-out bug is ever a train bug; held-out instances use seeds from `HELDOUT_SEED_OFFSET` on. Whole
templates can be held out as well (`generate_instances(heldout_templates=...)`).
"""

from __future__ import annotations

import ast
import copy
import difflib
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from orchard.domains._splits import split_plan
from orchard.domains.swe import _screen
from orchard.domains.swe.instances import SWEInstance
from orchard.domains.swe.mutations import Mutation, apply_mutation, mutation_sites
from orchard.domains.swe.templates import TEMPLATES, Case, RepoTemplate
from orchard.domains.swe.testrun import PYTEST_ENV, parse_test_results, pytest_argv

LEVELS = (1, 2, 3)
HELDOUT_SEED_OFFSET = 1_000_000
"""Held-out instances use seeds from here on; train instances use seeds below it."""
HELDOUT_BUCKETS = 4
"""One mutation in this many (by hash) belongs to the held-out split."""

PYTEST_TIMEOUT_S = 60.0
GENERATION_ENV = {**PYTEST_ENV, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
"""Local verification runs load no installed pytest plugin: the toy suites need none, and the plugins of a
development environment cost seconds per run."""
SCREEN_TIMEOUT_S = 2.0
"""Per case of the fast screen; a mutant slower than this is dropped (none of the templates loops unboundedly)."""
SCREEN_BATCH = 6

_CACHE: dict[tuple[str, int, int], SWEInstance] = {}
_SINGLES: dict[tuple[str, Mutation | None], list[dict] | None] = {}
_PYTEST: dict[str, dict[str, bool]] = {}


class GenerationError(RuntimeError):
    """A generated instance failed its verification (a bug in a template or in the generator, never the seed's)."""


def render_test_file(template: RepoTemplate, module: str, names: set[str] | None = None) -> str:
    """The test file of ``module``: its cases (only those in ``names`` when given), one function each."""
    cases = [c for c in template.cases if c.module == module]
    out = ("import pytest\n" if any(c.raises for c in cases) else "") + template.imports[module] + "\n"
    for case in cases:
        if names is not None and case.name not in names:
            continue
        body = [line for line in case.setup.splitlines() if line.strip()]
        if case.raises:
            body += [f"with pytest.raises({case.raises}):", f"    {case.call}"]
        else:
            body.append(f"assert {_operand(case.call)} == {case.expected}")
        out += f"\n\ndef test_{case.name}():\n" + "".join(f"    {line}\n" for line in body)
    return out


def _operand(expression: str) -> str:
    """``expression`` as the left operand of ``==``: parenthesised where it would chain or bind looser
    (``'a' in xs == False`` is ``'a' in xs and xs == False``)."""
    node = ast.parse(expression, mode="eval").body
    loose = (ast.Compare, ast.BoolOp, ast.IfExp, ast.Lambda, ast.NamedExpr)
    if isinstance(node, loose) or (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)):
        return f"({expression})"
    return expression


def _readme(template: RepoTemplate) -> str:
    return f"# {template.package}\n\n{template.description}\n\nRun the tests with `python -m pytest`.\n"


def unified_diff(before: dict[str, str], after: dict[str, str]) -> str:
    """A ``git diff``-format patch from ``before`` to ``after`` (path -> text; files added or changed only)."""
    out = []
    for path in sorted(after):
        old, new = before.get(path), after[path]
        if old == new:
            continue
        header = f"diff --git a/{path} b/{path}\n"
        if old is None:
            header += "new file mode 100644\n"
        lines = difflib.unified_diff((old or "").splitlines(keepends=True), new.splitlines(keepends=True),
                                     "/dev/null" if old is None else f"a/{path}", f"b/{path}")
        out.append(header + "".join(lines))
    return "".join(out)


def _screen_run(package: str, variants: list[dict[str, str]], cases: Sequence[Case],
                imports: dict[str, str]) -> list[list[dict] | None]:
    request = {"package": package, "variants": variants, "timeout_s": SCREEN_TIMEOUT_S,
               "cases": [{"imports": imports[c.module], "setup": c.setup, "call": c.call, "expected": c.expected,
                          "raises": c.raises} for c in cases]}
    proc = subprocess.run([sys.executable, "-I", "-S", _screen.__file__], input=json.dumps(request),
                          capture_output=True, text=True, timeout=60 + SCREEN_TIMEOUT_S * len(variants) * len(cases))
    if proc.returncode != 0:
        raise GenerationError(f"the mutation screen failed: {proc.stderr[-500:]}")
    return json.loads(proc.stdout)


def _sites(template: RepoTemplate) -> list[Mutation]:
    return [m for path, src in template.modules.items() for m in mutation_sites(path, src)]


def _screen_singles(template: RepoTemplate, mutations: Sequence[Mutation]) -> dict[Mutation, list[dict] | None]:
    """Screen results of single mutations (each screened once per process; the template itself first)."""
    if (template.name, None) not in _SINGLES:
        own = _screen_run(template.package, [dict(template.modules)], template.cases, template.imports)[0]
        if own is None or not all(r["passed"] for r in own):
            raise GenerationError(f"template {template.name} fails its own cases: {own}")
        _SINGLES[(template.name, None)] = own
    todo = [m for m in mutations if (template.name, m) not in _SINGLES]
    if todo:
        variants = [{**template.modules, m.module: apply_mutation(template.modules[m.module], m)} for m in todo]
        for m, result in zip(todo, _screen_run(template.package, variants, template.cases, template.imports),
                             strict=True):
            _SINGLES[(template.name, m)] = result
    return {m: _SINGLES[(template.name, m)] for m in mutations}


def _usable(result: list[dict] | None) -> bool:
    """A bug worth an instance: it finishes, breaks at least one test and leaves at least one passing."""
    return result is not None and any(not r["passed"] for r in result) and any(r["passed"] for r in result)


def _heldout(template: RepoTemplate, mutation: Mutation) -> bool:
    digest = hashlib.sha256(f"{template.name}:{mutation.key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_BUCKETS == 0


def _pick_single(template: RepoTemplate, rng: random.Random, candidates: list[Mutation]) -> Mutation | None:
    """A usable mutation: a family drawn uniformly among the candidates' families, then a mutation of it (the
    next family in the draw's order when none of one family is usable); None when no candidate is usable.
    Mutations are screened a few at a time, in the draw's order, so an instance screens few of them."""
    families = sorted({m.family for m in candidates})
    rng.shuffle(families)
    for family in families:
        sites = [m for m in candidates if m.family == family]
        rng.shuffle(sites)
        for start in range(0, len(sites), SCREEN_BATCH):
            batch = sites[start : start + SCREEN_BATCH]
            results = _screen_singles(template, batch)
            for m in batch:
                if _usable(results[m]):
                    return m
    return None


def _run_pytest(files: dict[str, str], test_ids: Sequence[str]) -> dict[str, bool]:
    """Per-test results of pytest over ``files`` (cached by content)."""
    key = hashlib.sha256(json.dumps([sorted(files.items()), list(test_ids)]).encode()).hexdigest()
    if key not in _PYTEST:
        with tempfile.TemporaryDirectory(prefix="orchard-swe-") as root:
            _write(Path(root), files)
            proc = subprocess.run(pytest_argv(sys.executable, test_ids), cwd=root, capture_output=True, text=True,
                                  timeout=PYTEST_TIMEOUT_S, env={**os.environ, **GENERATION_ENV})
            _PYTEST[key] = parse_test_results(proc.stdout, test_ids, exit_code=proc.returncode)
    return dict(_PYTEST[key])


def _write(root: Path, files: dict[str, str]) -> None:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)


def _read(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def _git_apply(files: dict[str, str], patch: str) -> dict[str, str]:
    """``files`` after ``git apply patch`` (run outside any repository), to prove the patch applies as git does."""
    with tempfile.TemporaryDirectory(prefix="orchard-swe-") as root:
        _write(Path(root), files)
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(Path(root).parent)}
        proc = subprocess.run(["git", "apply", "-"], cwd=root, input=patch, capture_output=True, text=True,
                              env=env, timeout=30)
        if proc.returncode != 0:
            raise GenerationError(f"git apply failed: {proc.stderr[-500:]}")
        return _read(Path(root))


def _snippet(template: RepoTemplate, case: Case) -> str:
    return "\n".join(line for line in (template.imports[case.module], case.setup, case.call) if line)


def _outcome(case: Case, got: str, rng: random.Random) -> str:
    expected = f"raise `{case.raises}`" if case.raises else f"give `{case.expected}`"
    observed = f"raises `{got}`" if _is_exception(got) else f"gives `{got}`"
    lead = rng.choice(["The last line", "That last expression", "The final call"])
    return f"{lead} {observed}, but it should {expected}."


def _is_exception(got: str) -> bool:
    head = got.split(":", 1)[0]
    return head.isidentifier() and (head.endswith("Error") or head.endswith("Exception"))


def _describe(template: RepoTemplate, failing: list[Case], got: dict[str, str], module: str | None,
              prefer_module: str, prefer_same: bool, rng: random.Random) -> tuple[Case, str]:
    """One failing case (preferably of ``prefer_module``'s tests, or of another's) and its paragraph."""
    preferred = [c for c in failing if (c.module == prefer_module) == prefer_same] or failing
    case = rng.choice(preferred)
    where = f"with `{module}`" if module else f"with the `{template.package}` package"
    return case, (f"I ran into a problem {where}. This snippet:\n\n```python\n{_snippet(template, case)}\n```\n\n"
                  f"{_outcome(case, got[case.name], rng)}")


def _choose(template: RepoTemplate, seed: int, level: int) -> tuple[list[Mutation], list[dict]]:
    """The mutation(s) of the instance and the screen's per-case results of the buggy code."""
    rng = random.Random(f"swe:{template.name}:{seed}:{level}")
    heldout = seed >= HELDOUT_SEED_OFFSET
    candidates = [m for m in _sites(template) if _heldout(template, m) == heldout]
    if level < 3:
        mutation = _pick_single(template, rng, candidates)
        if mutation is None:
            raise GenerationError(f"template {template.name} has no usable mutation for this split")
        return [mutation], _screen_singles(template, [mutation])[mutation]  # type: ignore[return-value]
    for _ in range(50):
        first = _pick_single(template, rng, candidates)
        if first is None:
            break
        second = _pick_single(template, rng, [m for m in candidates if m.module != first.module])
        if second is None:
            break
        pair = sorted([first, second])
        files = dict(template.modules)
        for m in pair:
            files[m.module] = apply_mutation(files[m.module], m)
        result = _screen_run(template.package, [files], template.cases, template.imports)[0]
        if _usable(result):
            return pair, result  # type: ignore[return-value]
    raise GenerationError(f"template {template.name}: no usable pair of mutations for seed {seed}")


def make_instance(template: str, seed: int, *, level: int = 1) -> SWEInstance:
    """The verified toy instance of ``template`` for ``seed`` at ``level`` (deterministic; cached in memory).

    Seeds below `HELDOUT_SEED_OFFSET` draw train mutations, seeds from it on held-out ones. The instance's
    ``extras`` hold ``template``, ``seed``, ``level``, ``split`` and ``mutations`` (module, function, family,
    line of each injected bug: privileged, never shown to the agent).

    Raises:
        ValueError: an unknown template, a negative seed or a level not in 1..3.
        GenerationError: the instance failed its pytest verification.
    """
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {sorted(TEMPLATES)}, got {template!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    key = (template, seed, level)
    if key not in _CACHE:
        _CACHE[key] = _build(TEMPLATES[template], seed, level)
    return copy.deepcopy(_CACHE[key])


def _build(template: RepoTemplate, seed: int, level: int) -> SWEInstance:
    mutations, result = _choose(template, seed, level)
    rng = random.Random(f"swe-issue:{template.name}:{seed}:{level}")
    failing = [c for c, r in zip(template.cases, result, strict=True) if not r["passed"]]
    got = {c.name: r["got"] for c, r in zip(template.cases, result, strict=True)}
    hidden = {c.name for c in failing}

    original = {**template.modules, "README.md": _readme(template)}
    full_tests = {template.test_path(m): render_test_file(template, m) for m in template.imports}
    base_tests = {template.test_path(m): render_test_file(template, m, {c.name for c in template.cases} - hidden)
                  for m in template.imports}
    buggy = dict(original)
    for m in mutations:
        buggy[m.module] = apply_mutation(buggy[m.module], m)
    base_files = {**buggy, **base_tests}
    patch = unified_diff(buggy, original)
    test_patch = unified_diff(base_tests, full_tests)
    fail_to_pass = [template.test_id(c) for c in failing]
    pass_to_pass = [template.test_id(c) for c in template.cases if c.name not in hidden]

    # The issue: one failing behaviour per mutation, each from the tests that mutation alone breaks.
    paragraphs = []
    singles = _screen_singles(template, mutations)
    for m in mutations:
        own = [c for c, r in zip(template.cases, singles[m], strict=True) if not r["passed"] and c.name in hidden]
        _, text = _describe(template, own or failing, got, m.module if level == 1 else None, m.module, level == 1,
                            rng)
        paragraphs.append(text)
    if len(paragraphs) > 1:
        paragraphs.insert(1, "There is a second problem as well.")
    problem = "\n\n".join(paragraphs) + "\n"

    _verify(template, base_files, patch, test_patch, fail_to_pass, pass_to_pass, mutations)
    base_commit = hashlib.sha1(json.dumps(sorted(base_files.items())).encode()).hexdigest()
    return SWEInstance(
        instance_id=f"toy__{template.name}-{level}-{seed}", repo=f"toy/{template.name}", base_commit=base_commit,
        problem_statement=problem, patch=patch, test_patch=test_patch, FAIL_TO_PASS=fail_to_pass,
        PASS_TO_PASS=pass_to_pass, files=base_files,
        extras={"template": template.name, "seed": seed, "level": level,
                "split": "heldout" if seed >= HELDOUT_SEED_OFFSET else "train",
                "mutations": [{"module": m.module, "function": m.function, "family": m.family, "line": m.line}
                              for m in mutations]})


def _verify(template: RepoTemplate, base_files: dict[str, str], patch: str, test_patch: str,
            fail_to_pass: list[str], pass_to_pass: list[str], mutations: list[Mutation]) -> None:
    tests = [*fail_to_pass, *pass_to_pass]
    before = _git_apply(base_files, test_patch)
    after = _git_apply(before, patch)
    if after != {**template.modules, "README.md": _readme(template),
                 **{template.test_path(m): render_test_file(template, m) for m in template.imports}}:
        raise GenerationError("the patches do not restore the template")
    results_before, results_after = _run_pytest(before, tests), _run_pytest(after, tests)
    wrong = ([t for t in fail_to_pass if results_before[t]] + [t for t in pass_to_pass if not results_before[t]]
             + [t for t in tests if not results_after[t]])
    if wrong:
        raise GenerationError(f"verification failed for {[m.key for m in mutations]}: {wrong}")


def generate_instances(
    split: str,
    n_per_template: int,
    *,
    levels: Sequence[int] = LEVELS,
    seed: int = 0,
    templates: Sequence[str] | None = None,
    heldout_templates: Sequence[str] = (),
) -> list[SWEInstance]:
    """Instances of one split: up to ``n_per_template`` per template, levels in turn, each bug once.

    Train instances draw seeds in [0, HELDOUT_SEED_OFFSET) and train mutations, held-out instances the rest, so
    the two never share a bug. ``heldout_templates`` appear only in "heldout" (an out-of-template test). A seed
    whose bug repeats one already drawn for the template is skipped; a template that runs out of distinct bugs
    (after ``20 x n_per_template`` seeds) gives fewer, so no template dominates the split.

    Args:
        split: "train" or "heldout".
        n_per_template: the cap per template (>= 0).
        levels: the difficulty levels, cycled over a template's instances. Default (1, 2, 3).
        seed: which block of seeds to draw (different seeds give different instances of the same split).
        templates: the templates to use (default all of `TEMPLATES`).
        heldout_templates: templates excluded from "train".
    """
    if isinstance(n_per_template, bool) or not isinstance(n_per_template, int) or n_per_template < 0:
        raise ValueError(f"n_per_template must be a non-negative int, got {n_per_template!r}")
    if isinstance(levels, (str, bytes)) or not levels or any(level not in LEVELS for level in levels):
        raise ValueError(f"levels must be a non-empty sequence of {LEVELS}, got {levels!r}")
    names, base = split_plan(split, known=TEMPLATES, templates=templates, heldout_templates=heldout_templates,
                             seed=seed, heldout_offset=HELDOUT_SEED_OFFSET)
    attempts = 20 * n_per_template
    if seed * 10_000 + attempts > HELDOUT_SEED_OFFSET:
        raise ValueError(f"seed {seed} with n_per_template {n_per_template} overflows the split's seed range")
    out = []
    for name in names:
        seen: set[str] = set()  # gold patches: one per distinct bug
        found = 0
        for i in range(attempts):
            if found == n_per_template:
                break
            instance = make_instance(name, base + i, level=levels[found % len(levels)])
            if instance.patch in seen:
                continue
            seen.add(instance.patch)
            out.append(instance)
            found += 1
    return out
