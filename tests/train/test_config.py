"""Typed config loading: defaults, YAML, dotted overrides, type checks with errors that name the key."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from orchard.train.config import (
    ConfigError,
    config_to_dict,
    field_docs,
    format_config,
    format_help,
    load_config,
    parse_overrides,
)
from orchard.train.objective import LossTerm
from orchard.train.trainer import OptimConfig, TrainConfig


@dataclass
class Inner:
    """A nested block."""

    rate: float = 0.5
    """A float."""
    name: str = "x"
    """A string."""


@dataclass
class Outer:
    """A config."""

    steps: int = 3
    """An int."""
    mode: Literal["a", "b"] = "a"
    """A literal."""
    tags: list[str] = field(default_factory=list)
    """A list."""
    pair: tuple[float, float] = (1.0, 2.0)
    """A pair."""
    maybe: int | None = None
    """Optional."""
    inner: Inner = field(default_factory=Inner)
    """Nested."""


def test_defaults_yaml_then_overrides(tmp_path: Path) -> None:
    y = tmp_path / "c.yaml"
    y.write_text("steps: 7\ninner:\n  name: from_yaml\n  rate: 2\ntags: [p, q]\n")
    cfg = load_config(Outer, y, ["inner.rate=3e-4", "mode=b", "maybe=null", "pair=[0.1, 0.2]"])
    assert cfg == Outer(steps=7, mode="b", tags=["p", "q"], pair=(0.1, 0.2), maybe=None,
                        inner=Inner(rate=3e-4, name="from_yaml"))
    assert isinstance(load_config(Outer, y).inner.rate, float)  # YAML int 2 widened to float
    assert load_config(Outer) == Outer()


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("steps=1.5", "^steps expects int, got 1.5"),
        ("steps=true", "^steps expects int"),
        ("mode=c", r"^mode must be one of \['a', 'b'\]"),
        ("inner.rate=fast", "^inner.rate expects float"),
        ("inner.nope=1", "^inner.nope is not a config key; valid keys here: name, rate$"),
        ("tags=[1]", r"^tags\[0\] expects str"),
        ("pair=[1]", "^pair expects 2 items"),
        ("steps", "key=value"),
    ],
)
def test_bad_values_name_the_key(override: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern) as info:
        load_config(Outer, None, [override])
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)  # callers that catch ValueError keep working


def test_field_docs_and_help() -> None:
    docs = field_docs(Outer)
    assert docs["steps"] == "An int." and docs["inner"] == "Nested."
    text = format_help(Outer)
    assert "inner.rate: float = 0.5  # A float." in text
    # Every TrainConfig / OptimConfig / LossTerm field carries a doc line.
    for cls in (TrainConfig, OptimConfig, LossTerm):
        import dataclasses

        missing = [f.name for f in dataclasses.fields(cls) if not field_docs(cls).get(f.name)]
        assert not missing, (cls.__name__, missing)


def test_train_config_from_yaml_with_objective(tmp_path: Path) -> None:
    y = tmp_path / "t.yaml"
    y.write_text(
        "total_steps: 10\nglobal_batch_size: 4\noptim: {lr: 1.0e-6, min_lr: 1.0e-7}\n"
        "objective:\n  - {name: policy, kwargs: {eps_low: 0.2, eps_high: 0.28}}\n  - {name: js_opd, weight: 0.1}\n"
    )
    cfg = load_config(TrainConfig, y, ["optim.warmup_steps=2", "engine=deepspeed", "zero_stage=3"])
    assert cfg.optim.lr == 1e-6 and cfg.optim.min_lr == 1e-7 and cfg.optim.warmup_steps == 2
    assert cfg.optim.betas == (0.9, 0.999)  # untouched nested default survives a partial override
    assert cfg.objective == [LossTerm("policy", 1.0, {"eps_low": 0.2, "eps_high": 0.28}), LossTerm("js_opd", 0.1)]
    with pytest.raises(ValueError, match=r"objective\[0\]\.name must be one of \[.*'policy'.*\], got 'polcy'"):
        load_config(TrainConfig, None, ["objective=[{name: polcy}]"])
    with pytest.raises(ConfigError, match=r"^zero_stage must be 2 or 3, got 1$"):
        load_config(TrainConfig, None, ["zero_stage=1"])


def test_parse_overrides_nested() -> None:
    assert parse_overrides(["a.b.c=1", "a.d=[x, y]", "e="]) == {"a": {"b": {"c": 1}, "d": ["x", "y"]}, "e": ""}
    with pytest.raises(ValueError, match="overrides"):
        parse_overrides("a=1")


# A recipe-shaped config: a stage whose nested TrainConfig-like block gets recipe defaults from a default_factory
# that differ from the nested class's own, a validate() hook, and a field the recipe derives.


@dataclass
class Optim:
    """Optimizer."""

    lr: float = 1e-3
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""


@dataclass
class Train:
    """Trainer settings."""

    total_steps: int = 1
    """Optimizer steps."""
    batch: int = 128
    """Sequences per step."""
    optim: Optim = field(default_factory=Optim)
    """Optimizer."""
    objective: list[str] = field(default_factory=lambda: ["sft"])
    """Loss terms."""

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"batch must be an int >= 1, got {self.batch}")


@dataclass
class Stage:
    """A stage."""

    steps: int = 150
    """Optimizer steps of the stage; sets train.total_steps."""
    train: Train = field(default_factory=lambda: Train(batch=64, optim=Optim(lr=1e-6), objective=["policy"]))
    """Trainer settings."""

    def validate(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {self.steps}")
        if self.train.batch > 64:
            # Not about one field: the prefix goes in front with a colon.
            raise ValueError(f"this stage trains at most 64 sequences per step, got train.batch={self.train.batch}")


@dataclass
class Recipe:
    """A recipe config."""

    seed: int = 0
    """Seed."""
    rl: Stage = field(default_factory=Stage)
    """The RL stage."""


DERIVED = {"rl.train.total_steps": "rl.steps"}


def test_format_config_shows_the_resolved_instance(tmp_path: Path) -> None:
    y = tmp_path / "r.yaml"
    y.write_text("rl:\n  train:\n    optim: {lr: 2.0e-6}\n")
    cfg = load_config(Recipe, y, ["rl.steps=3", "seed=7"], derived=DERIVED)
    lines = format_config(cfg, derived=DERIVED).splitlines()
    text = "\n".join(lines)
    # The stage's factory defaults (batch 64, objective [policy]) show, not Train's own (128, [sft]); the YAML lr
    # and the overrides show; untouched nested defaults (betas) survive.
    assert "rl.steps: 3" in text and "seed: 7" in text
    assert "rl.train.batch: 64" in text and "rl.train.objective: [policy]" in text
    assert "rl.train.optim.lr: 2.0e-06" in text and "rl.train.optim.betas: [0.9, 0.999]" in text
    assert "rl.train.batch: 128" not in text  # what format_help(Recipe) would print
    # Doc lines are aligned after the values; a nested block is a header line; derived keys are marked.
    (steps_line,) = [ln for ln in lines if ln.startswith("rl.steps:")]
    assert steps_line.endswith("# Optimizer steps of the stage; sets train.total_steps.")
    assert len({ln.index("  # ") for ln in lines}) == 1
    assert any(ln.startswith("rl.train:") and ln.endswith("# Trainer settings.") for ln in lines)
    # A derived key says what it comes from where its value would be, not the placeholder default (1) it holds.
    (derived_line,) = [ln for ln in lines if ln.startswith("rl.train.total_steps:")]
    assert derived_line.split("  # ") == ["rl.train.total_steps: (derived from rl.steps)".ljust(
        derived_line.index("  # ")), "Optimizer steps."]
    assert format_config(cfg, derived=["rl.train.total_steps"]).count("rl.train.total_steps: (derived by the recipe)") == 1
    # Each value line pasted back as an override rebuilds the same config.
    values = [ln.split("  # ")[0].rstrip() for ln in lines]
    overrides = [v.replace(": ", "=", 1) for v in values if not v.endswith(":")]
    overrides = [o for o in overrides if not o.startswith("rl.train.total_steps=")]
    assert load_config(Recipe, None, overrides, derived=DERIVED) == cfg
    assert format_config(cfg) == format_config(load_config(Recipe, None, overrides))
    assert config_to_dict(cfg)["rl"]["train"]["batch"] == 64


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # validate() names the dotted key: "steps ..." inside rl becomes "rl.steps ...".
        (["rl.steps=-3"], "rl.steps must be an int >= 1, got -3"),
        # __post_init__ of a nested class, two levels down.
        (["rl.train.batch=0"], "rl.train.batch must be an int >= 1, got 0"),
        # A message that does not start with a field name gets the block's key and a colon.
        (["rl.train.batch=65"], "rl: this stage trains at most 64 sequences per step, got train.batch=65"),
        (["rl.train.total_steps=10"], "rl.train.total_steps is derived from rl.steps; set that instead"),
        (["rl.stesp=3"], "rl.stesp is not a config key; did you mean 'rl.steps'?"),
        # The right name at the wrong level: found elsewhere in the tree.
        (["lr=1e-5"], "lr is not a config key; did you mean 'rl.train.optim.lr'?"),
        (["rl.train.optim.betas=[1]"], "rl.train.optim.betas expects 2 items (tuple[float, float]), got [1]"),
    ],
)
def test_validation_errors_are_one_line_starting_with_the_dotted_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(Recipe, None, overrides, derived=DERIVED)
    assert str(info.value) == message


def test_derived_keys_are_rejected_from_yaml_too_and_may_come_without_a_source(tmp_path: Path) -> None:
    y = tmp_path / "r.yaml"
    y.write_text("rl:\n  train:\n    total_steps: 5\n")
    with pytest.raises(ConfigError, match=r"^rl.train.total_steps is derived from rl.steps; set that instead$"):
        load_config(Recipe, y, derived=DERIVED)
    with pytest.raises(ConfigError, match=r"^seed is derived by the recipe; leave it out$"):
        load_config(Recipe, None, ["seed=1"], derived=["seed"])
    # Not setting a derived key is fine, and its value stays the default for the recipe to replace.
    assert load_config(Recipe, None, ["rl.steps=4"], derived=DERIVED).rl.train.total_steps == 1
    with pytest.raises(ValueError, match="derived must be a mapping or a list"):
        load_config(Recipe, None, [], derived="seed")


def test_config_file_errors_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^config file '.*missing.yaml' does not exist or is not a file$"):
        load_config(Recipe, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rl: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML") as info:
        load_config(Recipe, bad)
    assert "\n" not in str(info.value)


@dataclass
class Scaled:
    """A config whose dict field has a non-empty default."""

    factors: dict[str, float] = field(default_factory=lambda: {"norm": 30.0})
    """Factors by name."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr_multipliers={"head": 2.0}))
    """Optimizer."""


def test_a_dict_field_is_replaced_whole_so_it_can_be_cleared(tmp_path: Path) -> None:
    y = tmp_path / "s.yaml"
    y.write_text("optim:\n  lr: 0.5\n  lr_multipliers: {'^model[.]norm[.]weight$': 300}\n")
    # The YAML's mapping replaces the factory's {"head": 2.0} instead of joining it.
    assert load_config(Scaled, y).optim.lr_multipliers == {"^model[.]norm[.]weight$": 300.0}
    # An override {} clears the YAML's entry; the nested dataclass still merges field by field (lr stays).
    cleared = load_config(Scaled, y, ["optim.lr_multipliers={}", "factors={}"])
    assert (cleared.optim.lr_multipliers, cleared.factors, cleared.optim.lr) == ({}, {}, 0.5)
    assert load_config(Scaled, y, ["optim.lr_multipliers={embed: 3}"]).optim.lr_multipliers == {"embed": 3.0}
    # A dotted key into the mapping sets one entry and keeps the others, over the YAML's and over a default.
    assert load_config(Scaled, y, ["optim.lr_multipliers.embed=3"]).optim.lr_multipliers == {
        "^model[.]norm[.]weight$": 300.0, "embed": 3.0}
    assert load_config(Scaled, None, ["factors.head=2"]).factors == {"norm": 30.0, "head": 2.0}
    assert load_config(Scaled, None, ["optim.lr_multipliers.embed=3"]).optim.lr_multipliers == {"head": 2.0,
                                                                                               "embed": 3.0}
    assert Scaled().factors == {"norm": 30.0}  # the default's mapping itself is untouched
    # from YAML too: an explicit {} over a non-empty default
    y.write_text("factors: {}\noptim: {lr_multipliers: {}}\n")
    assert (load_config(Scaled, y).factors, load_config(Scaled, y).optim.lr_multipliers) == ({}, {})


@pytest.mark.parametrize(("override", "message"), [
    ("loggers=[jsonl, tensorbord]", "loggers has unknown logger 'tensorbord'; did you mean 'tensorboard'? valid: "
                                    "jsonl, tensorboard, wandb, progress"),
    ("loggers=[mlflow]", "loggers has unknown logger 'mlflow'; valid: jsonl, tensorboard, wandb, progress"),
    ("objective=[{name: policy, kwargs: {eps_hgih: 0.3}}]",
     "objective[0].kwargs has 'eps_hgih', which policy_loss (the policy term) does not take; did you mean "
     "'eps_high'? it takes: eps_low, eps_high, dual_clip, tis_threshold, is_mode, ratio_level, validate"),
    ("objective=[{name: sft}, {name: js_opd, kwargs: {lambda: 0.3}}]",
     "objective[1].kwargs has 'lambda', which js_opd_loss (the js_opd term) does not take; did you mean 'lam'? "
     "it takes: lam, validate"),
    ("objective=[{name: sft, kwargs: {beta: 0.3}}]",
     "objective[0].kwargs has 'beta', which sft_loss (the sft term) does not take; it takes: validate"),
    ("objective=[{name: kl, kwargs: {normalizer: 3}}]",
     "objective[0].kwargs sets 'normalizer', which the kl term passes to kl_penalty itself"),
    ("objective=[{name: policy, kwargs: {rollout_logprobs: null}}]",
     "objective[0].kwargs sets 'rollout_logprobs', which the policy term passes to policy_loss itself"),
])
def test_logger_names_and_loss_arguments_are_checked_when_the_config_loads(override: str, message: str) -> None:
    # Before, a misspelt logger failed when the trainer was built (after a recipe's base evaluation) and a
    # misspelt loss argument at the first step with signal: a TypeError, or nothing in a run without signal.
    with pytest.raises(ConfigError) as raised:
        load_config(TrainConfig, None, [override])
    assert str(raised.value) == message
    # every keyword the losses take passes, each term's own
    ok = load_config(TrainConfig, None, ["loggers=[jsonl, progress]", "objective=[{name: policy, kwargs: "
                                         "{eps_low: 0.1, dual_clip: 3.0, is_mode: mask}}, {name: kl, kwargs: "
                                         "{kind: k2}}, {name: js_opd, kwargs: {lam: 0.1}}]"])
    assert [t.kwargs for t in ok.objective] == [{"eps_low": 0.1, "dual_clip": 3.0, "is_mode": "mask"},
                                                {"kind": "k2"}, {"lam": 0.1}]
