import pytest

from orchard._registry import Registry
from orchard.losses import AGG_MODES, KL_ESTIMATORS
from orchard.rewards import HYBRID_RULES
from orchard.sampling import ADVANTAGE_ESTIMATORS, GROUP_FILTER_RULES
from orchard.train.objective import LOSS_TERMS


def _double(x: int) -> int:
    return 2 * x


def test_register_get_and_order():
    reg: Registry = Registry("widget")
    assert reg.register("b", _double) is _double  # returned unchanged, usable as a decorator body
    reg.register("a", abs)
    assert reg.names() == ["b", "a"]  # registration order, not sorted
    assert reg.get("b", "kind")(21) == 42
    assert "a" in reg and "c" not in reg and 3 not in reg


def test_errors_name_the_argument_and_list_valid_names():
    reg: Registry = Registry("widget")
    reg.register("x", abs)
    reg.register("y", _double)
    with pytest.raises(ValueError, match=r"mode must be one of \['x', 'y'\], got 'z'"):
        reg.get("z", "mode")
    with pytest.raises(ValueError, match=r"mode must be one of \['x', 'y'\], got None"):
        reg.get(None, "mode")
    with pytest.raises(ValueError, match=r"widget 'x' is already registered; registered: \['x', 'y'\]"):
        reg.register("x", _double)
    assert reg.get("x", "mode") is abs  # the rejected duplicate did not replace the original
    with pytest.raises(ValueError, match="widget name must be a non-empty string, got ''"):
        reg.register("", abs)
    with pytest.raises(ValueError, match="widget 'w' must be callable, got int"):
        reg.register("w", 3)  # type: ignore[arg-type]
    assert reg.names() == ["x", "y"]
    with pytest.raises(ValueError, match="kind must be a non-empty string"):
        Registry("")


def test_every_registry_is_one_public_registry_object():
    # One pattern everywhere: a public Registry constant with .register / .get / .names.
    for reg in (AGG_MODES, KL_ESTIMATORS, ADVANTAGE_ESTIMATORS, GROUP_FILTER_RULES, HYBRID_RULES, LOSS_TERMS):
        assert type(reg) is Registry
    assert "token-mean" in AGG_MODES and "k3" in KL_ESTIMATORS and "policy" in LOSS_TERMS
    assert "all_equal" in GROUP_FILTER_RULES
