"""Every single-machine config the repository ships (``recipes/configs/*_tiny.yaml`` and ``*_smollm2.yaml``) loads
as shipped with its recipe's config class, derived keys filled, before any work: a key renamed in a config class
breaks the file's users at once, not hours into a learning run. (The paper configs need checkpoints given as
overrides; each recipe's tests load its own.)"""

from pathlib import Path

import pytest

from orchard.train.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p.name for p in (ROOT / "recipes/configs").glob("*.yaml")
                 if p.stem.endswith(("_tiny", "_smollm2")))
CONFIG_CLASS = {"claw": "ClawConfig", "gui": "GUIConfig", "swe": "SWEConfig"}


def test_each_recipe_ships_a_cpu_config():
    assert {name.split("_")[0] for name in CONFIGS} == set(CONFIG_CLASS)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_shipped_cpu_config_loads(name, recipe_module):
    recipe = recipe_module(name.split("_")[0])
    cfg = load_config(getattr(recipe, CONFIG_CLASS[name.split("_")[0]]), ROOT / "recipes/configs" / name, [],
                      derived=recipe.DERIVED)
    assert cfg.output_dir == f"runs/{Path(name).stem}"  # each config writes a folder of its own
    if name.endswith("_smollm2.yaml"):
        assert cfg.model.path == "smollm2-135m-instruct"
