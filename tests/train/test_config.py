"""Typed config loading: defaults, YAML, dotted overrides, type checks with errors that name the key."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from orchard.train.config import field_docs, format_help, load_config, parse_overrides
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
        ("steps=1.5", "'steps' expects int"),
        ("steps=true", "'steps' expects int"),
        ("mode=c", r"'mode' must be one of \['a', 'b'\]"),
        ("inner.rate=fast", "'inner.rate' expects float"),
        ("inner.nope=1", "unknown config key 'inner.nope'; valid keys here: name, rate"),
        ("tags=[1]", r"'tags\[0\]' expects str"),
        ("pair=[1]", "'pair' expects 2 items"),
        ("steps", "key=value"),
    ],
)
def test_bad_values_name_the_key(override: str, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        load_config(Outer, None, [override])


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
    with pytest.raises(ValueError, match="loss term name 'polcy' is not registered"):
        load_config(TrainConfig, None, ["objective=[{name: polcy}]"])
    with pytest.raises(ValueError, match="zero_stage must be 2 or 3"):
        load_config(TrainConfig, None, ["zero_stage=1"])


def test_parse_overrides_nested() -> None:
    assert parse_overrides(["a.b.c=1", "a.d=[x, y]", "e="]) == {"a": {"b": {"c": 1}, "d": ["x", "y"]}, "e": ""}
    with pytest.raises(ValueError, match="overrides"):
        parse_overrides("a=1")
