"""A policy's best sampling temperature: success on a validation split at each temperature of a grid, through the
harnesses it trains in, and the temperature of the best mean over them.

This is the baseline RL has to beat (issue 16: an SFT policy sampled cold can beat RL at 1.0), and with
`orchard.models.fold_temperature` where RL can start from (`start_at_best_temperature`, a recipe's step before RL).
The validation split must be disjoint from the tasks the policy trains on and from the held-out set, or the choice
is fitted to the tasks it is then judged on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchard.models import fold_temperature
from orchard.rollout.rollouts import Rollouts
from orchard.stages.evaluate import evaluate
from orchard.stages.ranks import barrier
from orchard.stages.report import RunLog

__all__ = ["TEMPERATURE_GRID", "TemperatureSearch", "best_temperature", "check_temperatures", "search_temperature",
           "start_at_best_temperature"]

TEMPERATURE_GRID = (0.3, 0.45, 0.6, 0.75, 0.9, 1.05, 1.2)
"""The default grid: 0.3 to 1.2 by 0.15 (on the tiny Claw config the SFT policy's best lay at 0.3-0.75)."""


def check_temperatures(temperatures: Sequence[float], name: str = "temperatures") -> None:
    """ValueError naming ``name`` unless ``temperatures`` is a non-empty sequence of distinct finite numbers > 0."""
    if isinstance(temperatures, (str, bytes)) or not isinstance(temperatures, Sequence) or not temperatures:
        raise ValueError(f"{name} must be a non-empty list of numbers > 0, got {temperatures!r}")
    for t in temperatures:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"{name} must hold finite numbers > 0, got {t!r} in {list(temperatures)}")
    if len(set(temperatures)) != len(temperatures):
        raise ValueError(f"{name} must not repeat a temperature, got {list(temperatures)}")


def best_temperature(success_by_temperature: Mapping[float, float], *, reference: float) -> float:
    """The temperature of highest validation success; ties go to the one nearest ``reference`` (the temperature the
    policy is sampled at afterwards: of equally good choices, the smallest change to how it is sampled), and of two
    equally near, the lower.

    Args:
        success_by_temperature: ``{temperature: success}``, at least one entry.
        reference: the temperature ties are broken towards, a number >= 0.
    """
    if not success_by_temperature:
        raise ValueError("success_by_temperature must hold at least one temperature, got none")
    if isinstance(reference, bool) or not isinstance(reference, (int, float)) or not reference >= 0:
        raise ValueError(f"reference must be a number >= 0, got {reference!r}")
    best = max(success_by_temperature.values())
    return min((t for t, v in success_by_temperature.items() if v == best), key=lambda t: (abs(t - reference), t))


@dataclass
class TemperatureSearch:
    """What `search_temperature` found.

    Attributes:
        rows: ``{temperature: {harness: success_row}}`` on the validation split, in grid order.
        mean_success: ``{temperature: mean over the harnesses of success}``.
        temperature: the chosen one (`best_temperature` of ``mean_success``).
    """

    rows: dict[float, dict[str, dict[str, float]]]
    mean_success: dict[float, float]
    temperature: float

    def log_rows(self, prefix: str = "temperature") -> list[dict[str, float]]:
        """One metrics row per temperature (``<prefix>/value``, ``<prefix>/mean_success``,
        ``<prefix>/<harness>/<key>``) and a last one with ``<prefix>/chosen``, for a `RunLog`."""
        out: list[dict[str, float]] = []
        for t, by_harness in self.rows.items():
            row = {f"{prefix}/value": float(t), f"{prefix}/mean_success": self.mean_success[t]}
            row.update({f"{prefix}/{h}/{k}": float(v) for h, r in by_harness.items() for k, v in r.items()})
            out.append(row)
        out.append({f"{prefix}/chosen": float(self.temperature)})
        return out


async def search_temperature(harnesses: Mapping[str, Rollouts], engine: Any, tasks: Sequence[Any], *,
                             temperatures: Sequence[float] = TEMPERATURE_GRID, attempts: int = 3,
                             reference: float = 1.0, seed: int | None = None) -> TemperatureSearch:
    """`evaluate` of ``engine``'s policy on ``tasks`` at every temperature of ``temperatures`` through each of
    ``harnesses``; the chosen temperature has the highest mean success over the harnesses (each harness weighs the
    same, whatever its task count), ties nearest ``reference``.

    Environment failures are not scored (`success_row`); a harness none of whose tasks was fully scored counts 0.
    Under several ranks `evaluate` shards and gathers, so every rank chooses the same temperature.

    Args:
        harnesses: ``{name: Rollouts}``, the harnesses the policy trains in.
        engine: the policy's engine.
        tasks: the validation split (disjoint from training and held-out tasks).
        temperatures: the grid, distinct finite numbers > 0 (default `TEMPERATURE_GRID`).
        attempts: episodes per task and temperature, >= 1.
        reference: where ties go (`best_temperature`), usually the temperature RL samples at.
        seed: every temperature's `evaluate` plays with this seed (the same draws at each temperature, so the
            grid compares temperatures, not luck). Default None: sampling is left to the engines.
    """
    check_temperatures(temperatures)
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be an int >= 1, got {attempts!r}")
    if isinstance(reference, bool) or not isinstance(reference, (int, float)) or not reference >= 0:
        raise ValueError(f"reference must be a number >= 0, got {reference!r}")
    rows: dict[float, dict[str, dict[str, float]]] = {}
    for t in temperatures:
        rows[t] = await evaluate(harnesses, engine, tasks, attempts=attempts, temperature=t, seed=seed)
    mean_success = {t: sum(r["success"] for r in by.values()) / len(by) for t, by in rows.items()}
    return TemperatureSearch(rows, mean_success, best_temperature(mean_success, reference=reference))


async def start_at_best_temperature(model: Any, engine: Any, harnesses: Mapping[str, Rollouts], tasks: Sequence[Any],
                                    *, temperatures: Sequence[float] = TEMPERATURE_GRID, attempts: int = 3,
                                    reference: float = 1.0, seed: int | None = None, log: RunLog, step: int,
                                    prefix: str = "start_temperature") -> TemperatureSearch:
    """RL's start moved to the policy's best temperature: `search_temperature` on the validation ``tasks``, each
    temperature's rows and the choice logged at ``step`` (`TemperatureSearch.log_rows` under ``prefix``) with a
    console line each, the chosen T folded into ``model`` against ``reference`` (the final norm's weight divided by
    T / reference, `orchard.models.fold_temperature`), and ``engine`` given the folded weights; every rank waits
    for rank 0's push, so no served replica samples the unfolded policy. Returns the search.

    "RL starts from the policy at its best temperature" is ambiguous when RL does not sample at 1.0; it is read here
    as RL's rollouts being the policy at T, hence the fold against ``reference``, the temperature RL samples at. The
    recipe then saves the folded model and evaluates it on its held-out tasks (the Claw recipe: ``sft_best_t``, the
    baseline RL has to beat); at an evaluation temperature of ``reference`` that row is the policy at T.

    Args:
        model: the policy (a model `fold_temperature` takes), folded in place.
        engine: its rollout engine.
        harnesses, tasks, temperatures, attempts, seed: as `search_temperature` takes them (``tasks``: the
            validation split).
        reference: the temperature RL samples at, a number > 0: ties go nearest it, and T is folded against it.
        log: the run's log (`RunLog`); ``step``: where the rows go (the SFT stage's last step).
        prefix: the rows' namespace.
    """
    if isinstance(reference, bool) or not isinstance(reference, (int, float)) or not reference > 0:
        raise ValueError(f"reference must be a number > 0 (T is folded against it), got {reference!r}")
    found = await search_temperature(harnesses, engine, tasks, temperatures=temperatures, attempts=attempts,
                                     reference=reference, seed=seed)
    for row in found.log_rows(prefix):
        log.log(row, step)
    name = prefix.replace("_", " ")
    for t, by_harness in found.rows.items():
        log.print(f"{name} T={t}: " + " ".join(f"{h} {r['success']:.3f}" for h, r in by_harness.items())
                  + f" mean {found.mean_success[t]:.3f} ({len(tasks)} validation tasks)")
    fold = found.temperature / reference
    log.print(f"{name}: T={found.temperature} (mean validation success {found.mean_success[found.temperature]:.3f}); "
              f"final norm divided by {fold:g}")
    fold_temperature(model, fold)
    await engine.update_weights(model.state_dict())
    barrier()
    return found
