"""Hybrid verification rules that decide whether a synthesized task / trajectory is kept.

Two named rules live in :data:`HYBRID_RULES`; :func:`hybrid_select` dispatches on ``rule=``:

- ``"workforge"`` (WorkForge): a semantic judge score ``S_sem`` and a programmatic check score ``S_prog``, kept
  when ``S_sem >= 0.7``, ``S_prog >= 0.7`` and ``0.5 * S_sem + 0.5 * S_prog >= 0.7``.
- ``"softwaregym_two_stage"`` (SoftwareGym): an outcome judge then a process judge, kept when both ``>= 0.8``.

All scores are in ``[0, 1]``; inputs may be scalars or arrays (broadcast together).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from orchard._registry import Registry
from orchard.rewards._checks import unit_interval, unit_number

HYBRID_RULES: Registry[Callable[..., bool | np.ndarray]] = Registry("hybrid rule")


def _result(keep: np.ndarray) -> bool | np.ndarray:
    return bool(keep) if keep.ndim == 0 else keep


def workforge_select(
    semantic: float | np.ndarray,
    programmatic: float | np.ndarray,
    *,
    semantic_threshold: float = 0.7,
    programmatic_threshold: float = 0.7,
    combined_threshold: float = 0.7,
    semantic_weight: float = 0.5,
) -> bool | np.ndarray:
    """WorkForge hybrid rule: ``S_sem >= 0.7 and S_prog >= 0.7 and w S_sem + (1 - w) S_prog >= 0.7``, ``w = 0.5``.

    Args:
        semantic: semantic (LLM judge) score ``S_sem`` in ``[0, 1]``. Shape: ``()`` or ``(T,)``.
        programmatic: programmatic (checker) score ``S_prog`` in ``[0, 1]``, broadcast against ``semantic``.
        semantic_threshold, programmatic_threshold, combined_threshold: the three bars, default 0.7 each.
        semantic_weight: ``w`` in the combined score; default 0.5.

    Returns:
        A bool for scalar inputs, else a bool array of the broadcast shape.
    """
    t_sem = unit_number(semantic_threshold, "semantic_threshold")
    t_prog = unit_number(programmatic_threshold, "programmatic_threshold")
    t_comb = unit_number(combined_threshold, "combined_threshold")
    w = unit_number(semantic_weight, "semantic_weight")
    s_sem, s_prog = unit_interval(semantic, "semantic"), unit_interval(programmatic, "programmatic")
    try:
        s_sem, s_prog = np.broadcast_arrays(s_sem, s_prog)
    except ValueError as e:
        raise ValueError(f"semantic and programmatic must broadcast: {e}") from e
    combined = w * s_sem + (1.0 - w) * s_prog
    # 1e-12 slack so that 0.5 * 0.7 + 0.5 * 0.7 (= 0.69999...) meets a 0.7 bar.
    return _result((s_sem >= t_sem) & (s_prog >= t_prog) & (combined >= t_comb - 1e-12))


def two_stage_select(
    outcome: float | np.ndarray,
    process: float | np.ndarray,
    *,
    outcome_threshold: float = 0.8,
    process_threshold: float = 0.8,
) -> bool | np.ndarray:
    """SoftwareGym two-stage rule: kept when the outcome score ``>= 0.8`` and the process score ``>= 0.8``.

    Args:
        outcome: outcome-judge score in ``[0, 1]``. Shape: ``()`` or ``(T,)``.
        process: process-judge score in ``[0, 1]``, broadcast against ``outcome``.
        outcome_threshold, process_threshold: the two bars, default 0.8 each.

    Returns:
        A bool for scalar inputs, else a bool array of the broadcast shape.
    """
    t_out = unit_number(outcome_threshold, "outcome_threshold")
    t_proc = unit_number(process_threshold, "process_threshold")
    s_out, s_proc = unit_interval(outcome, "outcome"), unit_interval(process, "process")
    try:
        s_out, s_proc = np.broadcast_arrays(s_out, s_proc)
    except ValueError as e:
        raise ValueError(f"outcome and process must broadcast: {e}") from e
    return _result((s_out >= t_out) & (s_proc >= t_proc))


HYBRID_RULES.register("workforge", workforge_select)
HYBRID_RULES.register("softwaregym_two_stage", two_stage_select)


def hybrid_select(
    first: float | np.ndarray,
    second: float | np.ndarray,
    *,
    rule: str = "workforge",
    **thresholds: float,
) -> bool | np.ndarray:
    """Apply the named hybrid rule from :data:`HYBRID_RULES` to two score streams.

    ``first``/``second`` are ``(semantic, programmatic)`` for ``"workforge"`` and ``(outcome, process)`` for
    ``"softwaregym_two_stage"``; ``thresholds`` are that rule's keyword arguments (see :func:`workforge_select`,
    :func:`two_stage_select`). An unknown ``rule`` raises ``ValueError`` listing the valid names.
    """
    fn = HYBRID_RULES.get(rule, "rule")
    try:
        return fn(first, second, **thresholds)
    except TypeError as e:
        raise ValueError(f"thresholds: {e} (rule {rule!r})") from e
