"""Verification rules that decide whether a synthesized task / trajectory is kept.

Every named rule lives in :data:`HYBRID_RULES`; :func:`hybrid_select` dispatches on ``rule=``. WorkForge verifies
a task with an LLM judge (semantic score ``S_sem``), a programmatic checker (``S_prog``) or both, and its table
has exactly three rules, one per verifier, each with one bar:

- ``"workforge_llm"`` (LLM only): kept when ``S_sem >= 0.7``;
- ``"workforge_programmatic"`` (programmatic only): kept when ``S_prog >= 0.7``;
- ``"workforge_hybrid"`` (hybrid): kept when ``0.5 * S_sem + 0.5 * S_prog >= 0.7``; neither score has a bar of
  its own, so a strong score makes up for a weak one ((1.0, 0.5) is kept).

SoftwareGym's two-stage rule, ``"softwaregym_two_stage"``: an outcome judge then a process judge, kept when both
``>= 0.8``. All scores are in ``[0, 1]``; inputs may be scalars or arrays (broadcast together). The WorkForge
rules take ``(semantic, programmatic)`` in that order; the score a single-verifier rule does not read may be
None.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from orchard._registry import Registry
from orchard.rewards._checks import unit_interval, unit_number

HYBRID_RULES: Registry[Callable[..., bool | np.ndarray]] = Registry("hybrid rule")

_SLACK = 1e-12
"""Bars are met within this tolerance: 0.5 * 0.7 + 0.5 * 0.7 is 0.69999... in floating point."""


def _result(keep: np.ndarray) -> bool | np.ndarray:
    return bool(keep) if keep.ndim == 0 else keep


def workforge_llm_select(
    semantic: float | np.ndarray, programmatic: float | np.ndarray | None = None, *, threshold: float = 0.7
) -> bool | np.ndarray:
    """WorkForge LLM-only rule: kept when ``S_sem >= 0.7``.

    Args:
        semantic: semantic (LLM judge) score ``S_sem`` in ``[0, 1]``. Shape: ``()`` or ``(T,)``.
        programmatic: not read (there is no programmatic verifier under this rule); accepted so that every
            WorkForge rule takes ``(semantic, programmatic)``.
        threshold: the bar; default 0.7 (the paper's).

    Returns:
        A bool for a scalar input, else a bool array of its shape.
    """
    bar = unit_number(threshold, "threshold")
    return _result(unit_interval(semantic, "semantic") >= bar - _SLACK)


def workforge_programmatic_select(
    semantic: float | np.ndarray | None, programmatic: float | np.ndarray, *, threshold: float = 0.7
) -> bool | np.ndarray:
    """WorkForge programmatic-only rule: kept when ``S_prog >= 0.7``.

    Args:
        semantic: not read (there is no LLM judge under this rule; pass None); accepted so that every WorkForge
            rule takes ``(semantic, programmatic)``.
        programmatic: programmatic (checker) score ``S_prog`` in ``[0, 1]``. Shape: ``()`` or ``(T,)``.
        threshold: the bar; default 0.7 (the paper's).

    Returns:
        A bool for a scalar input, else a bool array of its shape.
    """
    bar = unit_number(threshold, "threshold")
    return _result(unit_interval(programmatic, "programmatic") >= bar - _SLACK)


def workforge_select(
    semantic: float | np.ndarray,
    programmatic: float | np.ndarray,
    *,
    threshold: float = 0.7,
    semantic_weight: float = 0.5,
) -> bool | np.ndarray:
    """WorkForge hybrid rule: kept when ``w * S_sem + (1 - w) * S_prog >= 0.7`` with ``w = 0.5``.

    The combined score is the only bar: (1.0, 0.5), (0.5, 0.9) and (0.95, 0.69) are kept, (0.7, 0.69) is not.

    Args:
        semantic: semantic (LLM judge) score ``S_sem`` in ``[0, 1]``. Shape: ``()`` or ``(T,)``.
        programmatic: programmatic (checker) score ``S_prog`` in ``[0, 1]``, broadcast against ``semantic``.
        threshold: the bar on the combined score; default 0.7 (the paper's).
        semantic_weight: ``w``; default 0.5 (the paper's equal weights).

    Returns:
        A bool for scalar inputs, else a bool array of the broadcast shape.
    """
    bar = unit_number(threshold, "threshold")
    w = unit_number(semantic_weight, "semantic_weight")
    s_sem, s_prog = unit_interval(semantic, "semantic"), unit_interval(programmatic, "programmatic")
    try:
        s_sem, s_prog = np.broadcast_arrays(s_sem, s_prog)
    except ValueError as e:
        raise ValueError(f"semantic and programmatic must broadcast: {e}") from e
    combined = w * s_sem + (1.0 - w) * s_prog
    return _result(combined >= bar - _SLACK)


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


HYBRID_RULES.register("workforge_llm", workforge_llm_select)
HYBRID_RULES.register("workforge_programmatic", workforge_programmatic_select)
HYBRID_RULES.register("workforge_hybrid", workforge_select)
HYBRID_RULES.register("softwaregym_two_stage", two_stage_select)


def hybrid_select(
    first: float | np.ndarray | None,
    second: float | np.ndarray | None,
    *,
    rule: str = "workforge_hybrid",
    **thresholds: float,
) -> bool | np.ndarray:
    """Apply the named hybrid rule from :data:`HYBRID_RULES` to two score streams.

    ``first``/``second`` are ``(semantic, programmatic)`` for the ``"workforge_*"`` rules (the one a
    single-verifier rule does not read may be None) and ``(outcome, process)`` for ``"softwaregym_two_stage"``;
    ``thresholds`` are that rule's keyword arguments (see :func:`workforge_llm_select`,
    :func:`workforge_programmatic_select`, :func:`workforge_select`, :func:`two_stage_select`). An unknown
    ``rule`` raises ``ValueError`` listing the valid names.
    """
    fn = HYBRID_RULES.get(rule, "rule")
    try:
        return fn(first, second, **thresholds)
    except TypeError as e:
        raise ValueError(f"thresholds: {e} (rule {rule!r})") from e
