"""The toy SWE generator: AST mutations written as small text edits, and over ~20 instances of every template and
level the SWE-bench invariants re-checked here with our own pytest runs (the bug fails FAIL_TO_PASS, the gold
patch resolves, PASS_TO_PASS passes both), hidden tests, issues that name no line, determinism and splits."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from orchard.domains.swe import generator
from orchard.domains.swe.generator import HELDOUT_SEED_OFFSET, generate_instances, make_instance
from orchard.domains.swe.mutations import Mutation, apply_mutation, mutation_sites
from orchard.domains.swe.templates import TEMPLATES
from orchard.domains.swe.testrun import parse_test_results, pytest_argv

SOURCE = "def f(a, b=2):\n    if a < 3:\n        a = a * 2\n    return a - b\n"


def site(change, family, line):
    return next(m for m in mutation_sites("m.py", SOURCE) if (m.change, m.family, m.line) == (change, family, line))


@pytest.mark.parametrize("change, family, line, expected_line, new", [
    ("op", "operator", 4, 3, "    return a + b\n"),
    ("swap", "swap", 4, 3, "    return b - a\n"),
    ("plus", "default", 1, 0, "def f(a, b=3):\n"),
    ("minus", "constant", 2, 1, "    if a < 2:\n"),
    ("op", "comparison", 2, 1, "    if a <= 3:\n"),
    ("not", "invert", 2, 1, "    if a >= 3:\n"),  # the complement, not `not a < 3`
    ("remove", "remove", 3, 2, "        pass\n"),  # the only statement of its block becomes `pass`
])
def test_a_mutation_edits_only_its_line(change, family, line, expected_line, new):
    mutated = apply_mutation(SOURCE, site(change, family, line))
    lines, old = mutated.splitlines(keepends=True), SOURCE.splitlines(keepends=True)
    assert lines[expected_line] == new
    assert lines[:expected_line] + lines[expected_line + 1:] == old[:expected_line] + old[expected_line + 1:]


def test_every_family_is_offered_and_a_foreign_node_is_refused():
    assert {m.family for m in mutation_sites("m.py", SOURCE)} == {
        "operator", "swap", "default", "constant", "comparison", "invert", "remove"}
    with pytest.raises(ValueError, match="cannot be written"):
        apply_mutation(SOURCE, Mutation("m.py", 0, "op", "operator", "<module>", 0))  # node 0: the Module


def write(root, files):
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)


def run_tests(root, test_ids):
    proc = subprocess.run(pytest_argv(sys.executable, test_ids), cwd=root, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    return parse_test_results(proc.stdout, test_ids)


def git_apply(root, patch):
    subprocess.run(["git", "apply", "-"], cwd=root, input=patch, text=True, check=True,
                   env={**os.environ, "GIT_CEILING_DIRECTORIES": str(root.parent)})


# A train seed per template. ledger 5 and graph 2 are the instances the other SWE test modules build on: the
# generator's in-memory cache makes each of those once per session instead of once here and once there.
SEEDS = {"inventory": 11, "textutil": 12, "stats": 13, "calendar": 14, "ledger": 5, "graph": 2}


@pytest.fixture(scope="module")
def instances():
    # 20 instances: every template at every level, both splits (6 x 3 + 2); each verified with pytest as it is
    # made. One at a time: CPython 3.11's ast keeps its recursion-depth check per interpreter, so two threads
    # parsing at once can fail with "AST constructor recursion depth mismatch" (seen in CI).
    assert set(SEEDS) == set(TEMPLATES)
    keys = [(t, SEEDS[t], level) for t in TEMPLATES for level in (1, 2, 3)]
    keys += [("ledger", HELDOUT_SEED_OFFSET + 3, 1), ("stats", HELDOUT_SEED_OFFSET + 4, 3)]
    return [make_instance(template, seed, level=level) for template, seed, level in keys]


def test_bug_fails_gold_resolves_and_pass_to_pass_passes_both(instances, tmp_path):
    fixed_trees = {}  # the gold patch restores the template, so instances of a template share their fixed tree

    def check(n):
        inst, root = instances[n], tmp_path / str(n)
        root.mkdir()
        # the repository as the agent gets it, then the hidden tests: the bug fails FAIL_TO_PASS only
        write(root, inst.files)
        git_apply(root, inst.test_patch)
        before = run_tests(root, inst.tests)
        git_apply(root, inst.patch)
        key = (tuple(sorted((p.relative_to(root).as_posix(), p.read_text()) for p in root.rglob("*.py"))),
               tuple(sorted(inst.tests)))
        if key not in fixed_trees:
            fixed_trees[key] = run_tests(root, inst.tests)
        return inst, before, fixed_trees[key]

    with ThreadPoolExecutor(2) as pool:  # each check is a child process; two at a time halve the wall time
        for inst, before, after in pool.map(check, range(len(instances))):
            assert not any(before[t] for t in inst.FAIL_TO_PASS), (inst.instance_id, before)
            assert all(before[t] for t in inst.PASS_TO_PASS), (inst.instance_id, before)
            assert all(after.values()), (inst.instance_id, after)
    assert len(fixed_trees) < len(instances)


def test_hidden_tests_live_only_in_test_patch_and_the_fix_only_in_code(instances):
    for inst in instances:
        template = TEMPLATES[inst.extras["template"]]
        visible_tests = "".join(text for path, text in inst.files.items() if path.startswith("tests/"))
        for test_id in inst.FAIL_TO_PASS:
            name = test_id.split("::")[1]
            assert f"def {name}(" not in visible_tests and f"+def {name}(" in inst.test_patch, inst.instance_id
        assert all(line.startswith(("diff --git a/tests/", "diff --git a/tests/")) for line in
                   inst.test_patch.splitlines() if line.startswith("diff --git")), inst.instance_id
        changed = [line.split(" b/")[1] for line in inst.patch.splitlines() if line.startswith("diff --git")]
        assert changed and all(path in template.modules for path in changed), inst.instance_id
        assert len(changed) == (2 if inst.extras["level"] == 3 else 1), inst.instance_id


def test_issues_read_like_a_user_report(instances):
    for inst in instances:
        text, level = inst.problem_statement, inst.extras["level"]
        modules = [m["module"] for m in inst.extras["mutations"]]
        # never the line or the function of the bug
        for m in inst.extras["mutations"]:
            assert f"line {m['line']}" not in text and f"def {m['function'].split('.')[-1]}" not in text
        assert ("```python" in text) and ("but it should" in text), inst.instance_id
        if level == 1:
            assert f"`{modules[0]}`" in text, inst.instance_id
        else:
            assert not any(f"`{m}`" in text for m in TEMPLATES[inst.extras["template"]].modules), inst.instance_id
        assert text.count("but it should") == (2 if level == 3 else 1), inst.instance_id


def test_generation_is_deterministic_and_cached_copies_are_independent(instances, monkeypatch):
    first = instances[0]
    first.files["tests/extra.py"] = "mutating a returned copy"
    assert "tests/extra.py" not in make_instance("inventory", SEEDS["inventory"], level=1).files
    # Regenerated from nothing (every in-memory cache empty): the same instances.
    for name in ("_CACHE", "_SINGLES", "_PYTEST"):
        monkeypatch.setattr(generator, name, {})
    again = [make_instance(t, SEEDS[t], level=2) for t in ("inventory", "textutil")]
    assert again == [instances[1], instances[4]]


def test_splits_never_share_a_bug_and_cap_every_template():
    train = generate_instances("train", 2, levels=(1,), templates=("ledger", "graph"), heldout_templates=("graph",))
    heldout = generate_instances("heldout", 2, levels=(1,), templates=("ledger", "graph"))
    assert [i.extras["template"] for i in train] == ["ledger", "ledger"]
    assert [i.extras["template"] for i in heldout] == ["ledger", "ledger", "graph", "graph"]
    assert not {i.patch for i in train} & {i.patch for i in heldout}
    assert len({i.patch for i in heldout}) == 4  # distinct bugs within a template too
    assert all(i.extras["split"] == "heldout" and i.extras["seed"] >= HELDOUT_SEED_OFFSET for i in heldout)


def test_about_one_mutation_in_four_is_held_out_in_every_template():
    # HELDOUT_BUCKETS = 4: a hash 0 mod 4 holds a mutation out, ~1/4 of a template's sites (binomial sd for the
    # smallest template, 58 sites: sqrt(0.25 x 0.75 / 58) = 0.057); today 171 of 620 sites = 0.276 in all
    total = held = 0
    for template in TEMPLATES.values():
        sites = generator._sites(template)
        out = sum(generator._heldout(template, m) for m in sites)
        assert 0.15 <= out / len(sites) <= 0.40, (template.name, out, len(sites))
        total, held = total + len(sites), held + out
    assert 0.22 <= held / total <= 0.33


@pytest.mark.parametrize("kwargs, message", [
    ({"split": "test", "n_per_template": 1}, "split must be"),
    ({"split": "train", "n_per_template": -1}, "n_per_template must be"),
    ({"split": "train", "n_per_template": 1, "levels": (4,)}, "levels must be"),
    ({"split": "train", "n_per_template": 1, "templates": ("nope",)}, "templates must be among"),
])
def test_bad_arguments_name_themselves(kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate_instances(**kwargs)
    with pytest.raises(ValueError, match="level must be"):
        make_instance("ledger", 0, level=0)
    with pytest.raises(ValueError, match="seed must be"):
        make_instance("ledger", -1)
