"""A rollout group: one task's rollouts, with the arrays the sampling functions take as they are.

GRPO's group is ``N`` rollouts of one task. A :class:`RolloutGroup` keeps them as `Trajectory` objects (from
either harness path: the in-process agent loop or a harness program recorded by the proxy) and exposes::

    group.rewards_N   # float [N], NaN where a member is not trainable   -> group_advantages(..., mask_GN=)
    group.mask_N      # bool  [N], True where a member trains            -> group_advantages, filter_groups
    group.passed_N    # bool  [N], the evaluation's pass rule            -> pass_at_k / pass_hat_k counts

and :func:`stack_groups` pads several groups into ``[G, N]`` arrays. A member trains when it is valid (scored, no
environment failure), has training samples, was not cut by the wall-clock budget (the paper drops timeouts;
``drop_timeouts=False`` keeps them) and was not removed (``remove_sample``: a judge that failed on it marks it in
``metadata["removed"]``, so it leaves the loss without being scored 0). The trajectories themselves satisfy
`orchard.sampling.BARRollout` (``reward``, ``terminated``, ``length``), so BAR reads them without key functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from orchard.data.schema import Trajectory

__all__ = ["RolloutGroup", "stack_groups", "trainable"]


def trainable(traj: Trajectory, *, drop_timeouts: bool = True) -> bool:
    """Whether ``traj`` may enter the loss: valid, with samples, not removed, and (by default) not timed out."""
    if not isinstance(traj, Trajectory):
        raise ValueError(f"traj must be a Trajectory, got {type(traj).__name__}")
    if not traj.valid or not traj.samples or traj.metadata.get("removed"):
        return False
    return not (drop_timeouts and traj.termination_reason == "time_budget")


@dataclass(frozen=True)
class RolloutGroup:
    """``N`` rollouts of one task (GRPO's group), as `Trajectory` objects with their samples.

    Fields:
        task_id: the task all members attempted.
        trajectories: the members, in arrival order.
        drop_timeouts: members ended by ``time_budget`` do not train (the paper's "timeouts dropped"); default True.
    """

    task_id: str
    trajectories: tuple[Trajectory, ...]
    drop_timeouts: bool = True
    _mask: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.task_id, str):
            raise ValueError(f"task_id must be a str, got {type(self.task_id).__name__}")
        trajs = tuple(self.trajectories)
        for i, t in enumerate(trajs):
            if not isinstance(t, Trajectory):
                raise ValueError(f"trajectories[{i}] must be a Trajectory, got {type(t).__name__}")
        object.__setattr__(self, "trajectories", trajs)
        mask = np.array([trainable(t, drop_timeouts=self.drop_timeouts) for t in trajs], dtype=bool)
        object.__setattr__(self, "_mask", mask)

    def __len__(self) -> int:
        return len(self.trajectories)

    @property
    def mask_N(self) -> np.ndarray:
        """Bool ``[N]``: True where the member trains (see `trainable`)."""
        return self._mask.copy()

    @property
    def rewards_N(self) -> np.ndarray:
        """Float64 ``[N]``: each member's reward, NaN where it does not train."""
        return np.array([t.reward if m else np.nan for t, m in zip(self.trajectories, self._mask, strict=True)],
                        dtype=np.float64)

    @property
    def valid_N(self) -> np.ndarray:
        """Bool ``[N]``: scored and not an environment failure (what evaluation counts)."""
        return np.array([t.valid for t in self.trajectories], dtype=bool)

    @property
    def passed_N(self) -> np.ndarray:
        """Bool ``[N]``: the evaluation's pass rule (`Trajectory.passed`; False for invalid members)."""
        return np.array([t.passed for t in self.trajectories], dtype=bool)

    @property
    def num_env_errors(self) -> int:
        """Members whose environment failed (dropped, never scored)."""
        return sum(t.is_env_error for t in self.trajectories)

    @property
    def trained(self) -> list[Trajectory]:
        """The members that train, in order."""
        return [t for t, m in zip(self.trajectories, self._mask, strict=True) if m]


def stack_groups(groups: Sequence[RolloutGroup]) -> tuple[np.ndarray, np.ndarray]:
    """``(rewards_GN, mask_GN)`` of several groups, padded to the largest ``N`` (pads are masked out, NaN)."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
        raise ValueError(f"groups must be a sequence of RolloutGroup, got {type(groups).__name__}")
    for i, g in enumerate(groups):
        if not isinstance(g, RolloutGroup):
            raise ValueError(f"groups[{i}] must be a RolloutGroup, got {type(g).__name__}")
    n = max((len(g) for g in groups), default=0)
    rewards_GN = np.full((len(groups), n), np.nan)
    mask_GN = np.zeros((len(groups), n), dtype=bool)
    for i, g in enumerate(groups):
        rewards_GN[i, :len(g)] = g.rewards_N
        mask_GN[i, :len(g)] = g.mask_N
    return rewards_GN, mask_GN
