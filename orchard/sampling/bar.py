"""Balanced Adaptive Rollout (BAR), after the Orchard paper (Orchard-SWE RL, Algorithm 1).

GRPO learns nothing from a group whose rollouts all succeed or all fail, and little from a group with one success
in sixteen. BAR generates rollouts for one task in strides and stops as soon as the pool holds a *balanced* set:
``n`` rollouts whose fraction of positives lies in ``[rho_min, rho_max]``. It then trains on exactly ``n`` of them.

Algorithm (one task; ``pos``/``neg`` = positives/negatives in the pool so far)::

    pool, spent = [], 0
    while spent < n_max:
        k = min(stride, n_max - spent)              # a stride never overshoots the budget
        pool += source(k); spent += k               # the budget counts rollouts *requested*
        if some k+ in [ceil(rho_min n), floor(rho_max n)] has k+ <= pos and n - k+ <= neg: break
    if pos == 0 or neg == 0:    drop                   ("no_signal")
    elif balanced:              k+ = feasible count nearest n (rho_min + rho_max) / 2     ("balanced")
    elif pos + neg < n:         drop                   ("insufficient")
    else:                       k+ = count in [max(0, n - neg), min(n, pos)] nearest the middle ("relaxed")
    choose the best k+ positives and the best n - k+ negatives, best = normally terminated first, then shorter,
    then earlier arrival.

With the paper's defaults (``n=8, n_max=16, stride=16, rho in [0.375, 0.625]``) a balanced set has 3, 4 or 5
positives out of 8 and the whole budget is one stride; smaller strides let easy-to-balance tasks stop early.

Budget: ``n_max`` is the most rollouts *requested* from the source for one task. A request for ``k`` spends
``k`` even when the source returns fewer (rollouts it dropped for environment errors) or the ``valid`` key
function discards some, so a source that keeps failing cannot loop forever; a source returning more than ``k``
is an error.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

R = TypeVar("R")

_RATIO_TOL = 1e-9  # rho * n is compared with this slack so that 0.375 * 8 counts as exactly 3


@runtime_checkable
class BARRollout(Protocol):
    """What BAR reads from a rollout by default (attributes, or keys of a mapping).

    ``reward`` (float; positive when ``> 0``) or ``success`` (bool; wins when present), ``terminated`` (True when
    the episode ended on its own, False when it was truncated by a turn / token / time limit) and ``length``
    (tokens or turns; shorter is preferred), and optionally ``valid`` (False: an environment failure, discarded).
    `orchard.data.Trajectory` has all of these. Pass ``positive=``, ``terminated=``, ``length=``, ``valid=`` key
    functions to read any other rollout type.
    """

    reward: float
    terminated: bool
    length: int


class BARReason(str, Enum):  # not StrEnum: it needs 3.11, and setup.cfg allows 3.10
    """Why BAR selected what it selected."""

    BALANCED = "balanced"  # a set with positive ratio in [rho_min, rho_max] was found
    RELAXED = "relaxed"  # budget spent without one; filled from the side that has members
    NO_SIGNAL = "no_signal"  # every rollout had the same outcome: group dropped
    INSUFFICIENT = "insufficient"  # fewer than n rollouts arrived (dropped or exhausted): group dropped


@dataclass(frozen=True)
class BARConfig:
    """Balanced Adaptive Rollout hyperparameters; defaults are the Orchard paper's (8, 16, 16, [0.375, 0.625])."""

    n: int = 8
    """Rollouts kept for training per task (the GRPO group size N)."""
    n_max: int = 16
    """Budget: the most rollouts requested from the source per task (>= n)."""
    stride: int = 16
    """Rollouts requested per generation call; the last stride is cut so the budget is never exceeded."""
    rho_min: float = 0.375
    """Smallest fraction of positives in a balanced set."""
    rho_max: float = 0.625
    """Largest fraction of positives in a balanced set."""

    def __post_init__(self) -> None:
        for name in ("n", "n_max", "stride"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an int, got {v!r}")
        if self.n < 2:
            raise ValueError(f"n must be >= 2 (a group needs a positive and a negative), got {self.n}")
        if self.n_max < self.n:
            raise ValueError(f"n_max must be >= n={self.n}, got {self.n_max}")
        if self.stride < 1:
            raise ValueError(f"stride must be >= 1, got {self.stride}")
        for name in ("rho_min", "rho_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v < 1.0:
                raise ValueError(f"{name} must be a number in (0, 1), got {v!r}")
        if self.rho_min > self.rho_max:
            raise ValueError(f"rho_min must be <= rho_max={self.rho_max}, got {self.rho_min}")
        lo, hi = self.positive_range
        if lo > hi:
            raise ValueError(
                f"rho_min={self.rho_min}, rho_max={self.rho_max}: no count of positives k with "
                f"1 <= k <= n-1={self.n - 1} has k/n in [rho_min, rho_max]"
            )

    @property
    def positive_range(self) -> tuple[int, int]:
        """``(k_lo, k_hi)``: the counts of positives out of ``n`` that make a balanced set, clipped to [1, n-1]."""
        lo = max(1, math.ceil(self.rho_min * self.n - _RATIO_TOL))
        hi = min(self.n - 1, math.floor(self.rho_max * self.n + _RATIO_TOL))
        return lo, hi

    @property
    def target_positives(self) -> float:
        """The middle of the balanced range in counts: ``n * (rho_min + rho_max) / 2``."""
        return self.n * (self.rho_min + self.rho_max) / 2


@dataclass(frozen=True)
class BARResult(Generic[R]):
    """The outcome of BAR for one task.

    ``selected`` holds exactly ``config.n`` rollouts, in arrival order, or none when the group is dropped
    (``reason`` ``no_signal`` or ``insufficient``). ``selected_indices`` index into ``pool``.
    """

    selected: list[R]
    selected_indices: list[int]
    pool: list[R]
    reason: BARReason
    num_positive: int
    """Positives in the selection."""
    generated: int
    """Rollouts accepted into the pool (received minus discarded)."""
    requested: int
    """Budget spent: rollouts requested, <= n_max."""
    strides: int
    """Generation calls made."""
    exhausted: bool = False
    """True when an iterator source ran dry before the budget was spent."""
    pool_positive: list[bool] = field(default_factory=list)
    """Outcome of every pool member, as BAR read it."""
    discarded: list[R] = field(default_factory=list)
    """Rollouts the ``valid`` key function rejected (environment failures): not in the pool, budget spent."""

    @property
    def kept(self) -> bool:
        """Whether the group trains (a selection was made)."""
        return bool(self.selected_indices)

    @property
    def positive_ratio(self) -> float:
        """Fraction of positives in the selection; 0.0 when nothing was selected."""
        return self.num_positive / len(self.selected_indices) if self.selected_indices else 0.0


def _read(rollout: object, name: str) -> Any:
    if isinstance(rollout, Mapping):
        return rollout[name]
    return getattr(rollout, name)


def _has(rollout: object, name: str) -> bool:
    return name in rollout if isinstance(rollout, Mapping) else hasattr(rollout, name)


def _default_positive(rollout: object) -> bool:
    if _has(rollout, "success"):
        return bool(_read(rollout, "success"))
    return float(_read(rollout, "reward")) > 0.0


def _default_terminated(rollout: object) -> bool:
    return bool(_read(rollout, "terminated"))


def _default_length(rollout: object) -> float:
    return _read(rollout, "length")


def _default_valid(rollout: object) -> bool:
    return bool(_read(rollout, "valid")) if _has(rollout, "valid") else True


def balanced_subset(
    positive: Sequence[bool],
    terminated: Sequence[bool],
    length: Sequence[float],
    config: BARConfig = BARConfig(),
    *,
    final: bool = True,
) -> tuple[list[int], BARReason | None]:
    """BAR's selection step over an already generated pool (pure; no generation).

    Args:
        positive: outcome of each pool member. Shape: ``(N,)``, ``N`` the pool's size.
        terminated: True when the member ended normally (not truncated). Shape: ``(N,)``.
        length: its length, shorter preferred. Shape: ``(N,)``.
        config: n and the ratio interval (n_max / stride are not used here).
        final: whether the budget is spent. When False and no balanced set exists, returns ``([], None)``:
            keep generating.

    Returns:
        ``(indices, reason)``: ascending pool indices of the ``n`` chosen members (empty when dropped) and why.
        The count of positives is the feasible one nearest ``config.target_positives`` (ties: fewer positives);
        within each side, members are ranked by (truncated, length, arrival).
    """
    if not isinstance(config, BARConfig):
        raise ValueError(f"config must be a BARConfig, got {type(config).__name__}")
    m = len(positive)
    if len(terminated) != m or len(length) != m:
        raise ValueError(
            f"positive, terminated and length must have equal lengths, got {m}, {len(terminated)}, {len(length)}"
        )
    pos_idx = [i for i in range(m) if positive[i]]
    neg_idx = [i for i in range(m) if not positive[i]]
    n_pos, n_neg, n = len(pos_idx), len(neg_idx), config.n
    k_lo, k_hi = config.positive_range
    lo, hi = max(k_lo, n - n_neg), min(k_hi, n_pos)
    reason: BARReason | None
    if lo <= hi:
        reason = BARReason.BALANCED
    elif not final:
        return [], None
    elif n_pos == 0 or n_neg == 0:
        return [], BARReason.NO_SIGNAL
    elif m < n:
        return [], BARReason.INSUFFICIENT
    else:
        reason = BARReason.RELAXED
        lo, hi = max(0, n - n_neg), min(n, n_pos)
    target = config.target_positives
    k_pos = min(range(lo, hi + 1), key=lambda k: (abs(k - target), k))

    def rank(i: int) -> tuple[bool, float, int]:
        return (not terminated[i], float(length[i]), i)

    chosen = sorted(pos_idx, key=rank)[:k_pos] + sorted(neg_idx, key=rank)[: n - k_pos]
    return sorted(chosen), reason


class _BARRun(Generic[R]):
    """The sans-IO state machine shared by the sync and async drivers, so both decide identically."""

    def __init__(
        self,
        config: BARConfig,
        positive: Callable[[R], bool] | None,
        terminated: Callable[[R], bool] | None,
        length: Callable[[R], float] | None,
        valid: Callable[[R], bool] | None = None,
    ) -> None:
        if not isinstance(config, BARConfig):
            raise ValueError(f"config must be a BARConfig, got {type(config).__name__}")
        for arg, fn in (("positive", positive), ("terminated", terminated), ("length", length), ("valid", valid)):
            if fn is not None and not callable(fn):
                raise ValueError(f"{arg} must be a callable key function or None, got {type(fn).__name__}")
        self.config = config
        self._positive = positive or _default_positive
        self._terminated = terminated or _default_terminated
        self._length = length or _default_length
        self._valid = valid or _default_valid
        self.pool: list[R] = []
        self.discarded: list[R] = []
        self.pos: list[bool] = []
        self.term: list[bool] = []
        self.len: list[float] = []
        self.requested = 0
        self.strides = 0
        self.exhausted = False
        self.done = False

    def next_request(self) -> int:
        """How many rollouts to ask for next; 0 when generation is over."""
        if self.done:
            return 0
        return min(self.config.stride, self.config.n_max - self.requested)

    def _extract(self, rollout: R, index: int) -> tuple[bool, bool, float]:
        try:
            p = bool(self._positive(rollout))
            t = bool(self._terminated(rollout))
            ln = self._length(rollout)
        except (KeyError, AttributeError) as e:
            raise ValueError(
                f"source: rollout {index} ({type(rollout).__name__}) lacks a field BAR reads ({e}); give it "
                f"reward/success, terminated and length, or pass positive=, terminated=, length= key functions"
            ) from e
        if isinstance(ln, bool) or not isinstance(ln, numbers.Real) or not math.isfinite(ln) or ln < 0:
            raise ValueError(f"source: rollout {index} length must be a finite number >= 0, got {ln!r}")
        return p, t, float(ln)

    def feed(self, asked: int, batch: Iterable[R], *, exhausted: bool = False) -> None:
        items = list(batch)
        if len(items) > asked:
            raise ValueError(f"source returned {len(items)} rollouts when {asked} were requested")
        self.requested += asked
        self.strides += 1
        for rollout in items:
            if self._valid is not None and not self._valid(rollout):
                self.discarded.append(rollout)
                continue
            p, t, ln = self._extract(rollout, len(self.pool))
            self.pool.append(rollout)
            self.pos.append(p)
            self.term.append(t)
            self.len.append(ln)
        self.exhausted = self.exhausted or exhausted
        if self.exhausted or self.requested >= self.config.n_max:
            self.done = True
        else:
            idx, _ = balanced_subset(self.pos, self.term, self.len, self.config, final=False)
            self.done = bool(idx)

    def result(self) -> BARResult[R]:
        idx, reason = balanced_subset(self.pos, self.term, self.len, self.config, final=True)
        assert reason is not None
        return BARResult(
            selected=[self.pool[i] for i in idx],
            selected_indices=idx,
            pool=list(self.pool),
            reason=reason,
            num_positive=sum(self.pos[i] for i in idx),
            generated=len(self.pool),
            requested=self.requested,
            strides=self.strides,
            exhausted=self.exhausted,
            pool_positive=list(self.pos),
            discarded=list(self.discarded),
        )


def _take(it: Iterator[R], k: int) -> tuple[list[R], bool]:
    out: list[R] = []
    for _ in range(k):
        try:
            out.append(next(it))
        except StopIteration:
            return out, True
    return out, False


async def _atake(it: AsyncIterator[R], k: int) -> tuple[list[R], bool]:
    out: list[R] = []
    for _ in range(k):
        try:
            out.append(await it.__anext__())
        except StopAsyncIteration:
            return out, True
    return out, False


def _feed_from_iterator(run: _BARRun[R], it: Iterator[R]) -> None:
    """Pull what ``run`` asks for from ``it``, ``k`` at a time, until it asks for nothing or ``it`` runs dry."""
    while k := run.next_request():
        batch, dry = _take(it, k)
        run.feed(k, batch, exhausted=dry)


def _as_batch(res: object, asked: int) -> Iterable[R]:
    if isinstance(res, (str, bytes, Mapping)) or not isinstance(res, Iterable):
        raise ValueError(f"source({asked}) must return a list of rollouts, got {type(res).__name__}")
    return res


def bar_select(
    source: Callable[[int], Iterable[R]] | Iterable[R],
    config: BARConfig = BARConfig(),
    *,
    positive: Callable[[R], bool] | None = None,
    terminated: Callable[[R], bool] | None = None,
    length: Callable[[R], float] | None = None,
    valid: Callable[[R], bool] | None = None,
) -> BARResult[R]:
    """Run Balanced Adaptive Rollout for one task with a synchronous source (see the module docstring).

    Args:
        source: either a callable ``source(k) -> list`` returning at most ``k`` new rollouts (fewer when some were
            dropped for environment errors), or an iterable / iterator of rollouts pulled ``k`` at a time (running
            dry ends generation). For coroutine functions and async generators use :func:`abar_select`.
        config: ``BARConfig(n=8, n_max=16, stride=16, rho_min=0.375, rho_max=0.625)`` by default.
        positive: key function, rollout -> outcome; default reads ``success``, else ``reward > 0``.
        terminated: key function, rollout -> ended normally; default reads ``terminated``.
        length: key function, rollout -> length (shorter preferred); default reads ``length``.
        valid: optional key function, rollout -> usable. A rollout it rejects (its sandbox died, the judge
            failed) goes to ``result.discarded``, never into the pool: an environment failure is not a negative.
            Default reads ``valid`` where the rollout has it (`orchard.data.Trajectory` does), else keeps all.

    Returns:
        :class:`BARResult` with the selection (exactly ``config.n`` or none), the pool, the reason and counts.
    """
    run: _BARRun[R] = _BARRun(config, positive, terminated, length, valid)
    if callable(source):
        if inspect.iscoroutinefunction(source):
            raise ValueError("source is a coroutine function; use abar_select for async sources")
        while k := run.next_request():
            res = source(k)
            if inspect.isawaitable(res):
                if inspect.iscoroutine(res):
                    res.close()
                raise ValueError("source returned an awaitable; use abar_select for async sources")
            run.feed(k, _as_batch(res, k))
    elif isinstance(source, AsyncIterable):
        raise ValueError("source is an async iterable; use abar_select for async sources")
    elif isinstance(source, Iterable):
        _feed_from_iterator(run, iter(source))
    else:
        raise ValueError(
            f"source must be a callable source(k) or an iterable of rollouts, got {type(source).__name__}"
        )
    return run.result()


async def abar_select(
    source: Callable[[int], Any] | Iterable[R] | AsyncIterable[R],
    config: BARConfig = BARConfig(),
    *,
    positive: Callable[[R], bool] | None = None,
    terminated: Callable[[R], bool] | None = None,
    length: Callable[[R], float] | None = None,
    valid: Callable[[R], bool] | None = None,
) -> BARResult[R]:
    """Async Balanced Adaptive Rollout: same decisions as :func:`bar_select` for the same stream.

    ``source`` may be an async callable ``await source(k) -> list`` (generate a stride concurrently inside it),
    an async iterable / async generator of rollouts pulled ``k`` at a time, or any synchronous source that
    :func:`bar_select` accepts. Other arguments and the result as in :func:`bar_select`.
    """
    run: _BARRun[R] = _BARRun(config, positive, terminated, length, valid)
    if callable(source):
        while k := run.next_request():
            res = source(k)
            if inspect.isawaitable(res):
                res = await res
            run.feed(k, _as_batch(res, k))
    elif isinstance(source, AsyncIterable):
        ait = aiter(source)
        while k := run.next_request():
            batch, dry = await _atake(ait, k)
            run.feed(k, batch, exhausted=dry)
    elif isinstance(source, Iterable):
        _feed_from_iterator(run, iter(source))
    else:
        raise ValueError(
            f"source must be a callable, an iterable or an async iterable of rollouts, got {type(source).__name__}"
        )
    return run.result()
