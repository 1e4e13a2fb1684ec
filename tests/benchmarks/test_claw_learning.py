"""benchmarks/claw_learning.py's baseline "SFT at its best temperature": how the temperature is chosen, and that
the validation split it is chosen on shares no task with what trains or with the held-out set."""

import importlib.util
from pathlib import Path

import pytest

from orchard.domains.claw.tasks import split_tasks

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("claw_learning", ROOT / "benchmarks/claw_learning.py")
claw_learning = importlib.util.module_from_spec(spec)
spec.loader.exec_module(claw_learning)
best_temperature = claw_learning.best_temperature


def test_the_highest_validation_success_wins():
    # 0.35 at T=0.6 beats 0.30 at T=1.0 (the reference) and 0.20 at T=0.3.
    assert best_temperature({0.3: 0.20, 0.6: 0.35, 1.0: 0.30}, reference=1.0) == 0.6


def test_ties_go_to_the_temperature_nearest_the_reference():
    # All three at 0.30: |0.9 - 1.0| = 0.1 < |0.6 - 1.0| = 0.4 and |1.2 - 1.0| = 0.2.
    assert best_temperature({0.6: 0.3, 0.9: 0.3, 1.2: 0.3}, reference=1.0) == 0.9
    # Equally near (|0.5 - 1.0| = |1.5 - 1.0| = 0.5): the cooler one, so the answer never depends on dict order.
    assert best_temperature({1.5: 0.3, 0.5: 0.3}, reference=1.0) == 0.5
    assert best_temperature({0.5: 0.3, 1.5: 0.3}, reference=1.0) == 0.5
    # A policy that never succeeds (all 0.0) keeps the evaluation's temperature.
    assert best_temperature({0.3: 0.0, 1.0: 0.0, 1.2: 0.0}, reference=1.0) == 1.0


def test_an_empty_grid_is_refused_by_name():
    with pytest.raises(ValueError, match="success_by_temperature"):
        best_temperature({}, reference=1.0)


def test_the_validation_split_shares_no_task_with_training_or_the_held_out_set():
    validation = split_tasks("train", 6, seed=claw_learning.VALIDATION_BLOCK)
    # The largest RL pool a config has used (200 per template) and the held-out set of the tiny config.
    used = split_tasks("train", 200) + split_tasks("heldout", 6)
    # Disjoint task seeds (a request's wording alone can repeat across seeds, as it does between train and held-out).
    assert {t.seed for t in validation}.isdisjoint({t.seed for t in used})
    # Still the training distribution: the same templates as the train split, 6 tasks each.
    assert sorted({t.template for t in validation}) == sorted({t.template for t in split_tasks("train", 1)})
    assert len(validation) == 6 * len({t.template for t in validation})
