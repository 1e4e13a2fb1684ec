"""The core install is the algorithms on torch and numpy; a missing extra fails with the extra's name.

Each check runs in a fresh interpreter: ``sys.modules`` of this one already holds whatever other tests imported.
A package is made "not installed" with ``sys.modules[name] = None``, which makes ``import name`` raise
``ModuleNotFoundError`` exactly as an absent package does.
"""

import ast
import configparser
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchard._extras import EXTRAS, requires_extra

ROOT = Path(__file__).resolve().parents[1]
CORE = ("orchard.losses", "orchard.sampling", "orchard.rewards", "orchard.value")
HEAVY = ("transformers", "deepspeed", "fastapi", "aiohttp", "httpx", "uvicorn", "matplotlib", "accelerate",
         "datasets", "tokenizers", "pyarrow", "scipy", "yaml", "rich", "safetensors", "pydantic", "websockets")


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_core_packages_load_no_optional_package():
    out = run_python(
        f"import sys, json\nimport {', '.join(CORE)}\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_the_command_line_parser_loads_neither_torch_nor_transformers():
    # `orchard --help`, `--version` and `orchard models ...` build the whole parser: every subcommand module is
    # imported. It used to pull in torch and transformers through orchard.models (~4 s per call on 2 cores).
    out = run_python(
        "import sys, json\nfrom orchard.cli import build_parser\nbuild_parser()\n"
        "import orchard.models\n"
        "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))"
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_the_model_builders_load_when_first_used():
    out = run_python(
        "import orchard.models as models\n"
        "print(models.tiny_qwen3_config(64).model_type, models.fold_temperature.__name__, "
        "'Qwen3ForCausalLM' in models.FOLDABLE_MODELS)\n"
        "try:\n    models.no_such_builder\nexcept AttributeError as exc:\n    print(exc)"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["qwen3 fold_temperature True",
                                       "module 'orchard.models' has no attribute 'no_such_builder'"]


def test_core_works_with_every_optional_package_absent():
    # Not only importable: the algorithms run. js_opd_loss over identical distributions is 0 (JS(p, p) = 0).
    out = run_python(
        f"import sys\nfor name in {HEAVY!r}: sys.modules[name] = None\n"
        "import torch\n"
        "from orchard.losses import js_opd_loss\n"
        "from orchard.sampling import group_advantages\n"
        "from orchard.rewards import claw_task_score\n"
        "from orchard.value import gae\n"
        "logp = torch.log(torch.full((1, 3), 0.5))\n"
        "loss, _ = js_opd_loss(logp, logp, torch.ones(1, 3))\n"
        "print(float(loss), group_advantages(torch.tensor([[1.0, 1.0]])).tolist())\n"
    )
    assert out.returncode == 0, out.stderr
    loss, adv = out.stdout.split(" ", 1)
    assert float(loss) == pytest.approx(0.0, abs=1e-7)
    assert adv.strip() == "[[0.0, 0.0]]"  # an all-equal group carries no signal


@pytest.mark.parametrize(
    ("missing", "module", "extra"),
    [
        ("fastapi", "orchard.env.server", "env"),
        ("httpx", "orchard.env", "env"),
        ("pyarrow", "orchard.data", "data"),
        ("transformers", "orchard.models.tiny", "data"),
        ("fastapi", "orchard.rollout.server", "rollout"),
        ("yaml", "orchard.train.config", "train"),
        ("transformers", "orchard.train.model", "train"),
    ],
)
def test_a_missing_package_names_its_extra(missing, module, extra):
    out = run_python(
        f"import sys\nsys.modules[{missing!r}] = None\n"
        f"try:\n    import {module}\n"
        "except ModuleNotFoundError as exc:\n    print(exc.name)\n    print(exc)\n"
        "else:\n    print('imported')\n"
    )
    assert out.returncode == 0, out.stderr
    name, message = out.stdout.splitlines()
    assert name == missing  # callers that test exc.name keep working
    assert f"pip install 'orchard-rl[{extra}]'" in message and repr(missing) in message


def test_the_value_model_loads_lazily_and_names_the_train_extra():
    out = run_python(
        "import sys\nsys.modules['transformers'] = None\n"
        "import orchard.value\n"
        "try:\n    orchard.value.ValueModel\n"
        "except ModuleNotFoundError as exc:\n    print(exc)\n"
    )
    assert out.returncode == 0, out.stderr
    assert "pip install 'orchard-rl[train]'" in out.stdout


def test_requires_extra_passes_other_errors_through():
    # A missing module of orchard itself is a bug, not an extra to install: unchanged.
    with pytest.raises(ModuleNotFoundError, match=r"No module named 'orchard\.no_such_module'"), requires_extra("env"):
        import orchard.no_such_module  # noqa: F401
    with pytest.raises(ValueError, match=r"extra must be one of .*got 'envs'"), requires_extra("envs"):
        pass
    with requires_extra("env"):
        value = 1  # no error: the block runs as written
    assert value == 1


# Import names whose distribution is spelled otherwise, and packages that come with a declared one.
DISTRIBUTION = {"_pytest": "pytest", "yaml": "pyyaml", "flash_attn": "flash-attn", "liger_kernel": "liger-kernel",
                "kubernetes_validate": "kubernetes-validate", "PIL": "pillow"}
TRANSITIVE = {"safetensors": "transformers", "uvloop": "uvicorn", "starlette": "fastapi",
              "urllib3": "kubernetes", "httpcore": "httpx"}
# Used only by one benchmark that says so; accelerate is probed by orchard.models.quiet.quiet_transformers only to
# stop it importing DeepSpeed when transformers brings it along.
OPTIONAL = {"liger_kernel", "accelerate"}


def declared_requirements() -> dict[str, set[str]]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    groups = {"core": cfg["options"]["install_requires"]}
    groups.update(cfg["options.extras_require"])
    return {
        group: {re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower() for line in text.split("\n") if line.strip()}
        for group, text in groups.items()
    }


def third_party_imports(*folders: str) -> set[str]:
    found = set()
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                found.update(name.partition(".")[0] for name in names)
    # the repository's own modules (benchmarks import the tests' emulators and helpers by path)
    local = {path.stem for folder in (*folders, "tests") for path in (ROOT / folder).rglob("*.py")}
    return {name for name in found - set(sys.stdlib_module_names) - local if name != "orchard"}


def test_core_requirements_are_torch_and_numpy():
    assert declared_requirements()["core"] == {"torch", "numpy"}


def test_every_import_is_declared_and_every_declared_package_is_imported():
    groups = declared_requirements()
    declared = set().union(*(reqs for group, reqs in groups.items() if group != "dev"))
    imported = third_party_imports("orchard", "recipes", "benchmarks")
    wanted = {DISTRIBUTION.get(name, name).lower() for name in imported - set(TRANSITIVE) - OPTIONAL}
    assert wanted - declared == set()
    assert {TRANSITIVE[name] for name in imported & set(TRANSITIVE)} <= declared
    # nothing declared that nothing imports (extras that name other extras are the orchard-rl[...] lines)
    assert declared - wanted - {"orchard-rl"} == set()


def test_extras_compose_and_dev_has_everything_the_tests_import():
    groups = declared_requirements()
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = cfg["options.extras_require"]
    # [all] is every extra a site names except the CUDA-only [gpu]; [dev] installs [all]
    assert set(re.findall(r"orchard-rl\[([^\]]+)\]", extras["all"])[0].split(",")) == set(EXTRAS) - {"gpu", "all"}
    assert "orchard-rl[all]" in extras["dev"]
    below_all = set().union(*(groups[name] for name in set(EXTRAS) - {"gpu", "all"}), groups["core"], groups["dev"])
    # the tests' own helpers, and the recipes and benchmarks they import as scripts do
    ours = {"_box", "claw", "swe", "train_helpers", "_seeds", "gui_learning"}
    test_imports = third_party_imports("tests") - ours
    wanted = {DISTRIBUTION.get(name, name).lower() for name in test_imports - set(TRANSITIVE) - OPTIONAL}
    assert wanted - below_all == set()
