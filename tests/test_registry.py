import pytest

from orchard._registry import Registry
from orchard.losses.aggregate import agg_modes
from orchard.losses.kl import kl_kinds
from orchard.rewards import HYBRID_RULES
from orchard.sampling.advantages import ADVANTAGE_ESTIMATORS


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


def test_algorithm_packages_share_one_registry_class():
    from orchard.losses import aggregate, kl

    for reg in (aggregate._AGG_MODES, kl._KL_KINDS, ADVANTAGE_ESTIMATORS, HYBRID_RULES):
        assert type(reg) is Registry
    assert "token-mean" in agg_modes() and "k3" in kl_kinds()
