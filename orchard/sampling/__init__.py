"""orchard.sampling: which rollouts train and with what weight (layer 1: pure functions, no I/O).

Advantages (GRPO / Dr.GRPO / RLOO), Balanced Adaptive Rollout, dynamic-sampling and difficulty filters,
and evaluation metrics (pass@k, pass^k, avg@k, best-of-N).
"""

from orchard.sampling.advantages import (
    ADVANTAGE_ESTIMATORS,
    broadcast_to_tokens,
    dr_grpo_advantages,
    group_advantages,
    rloo_advantages,
)
from orchard.sampling.bar import (
    BARConfig,
    BARReason,
    BARResult,
    BARRollout,
    abar_select,
    balanced_subset,
    bar_select,
)
from orchard.sampling.filters import (
    GROUP_FILTER_RULES,
    DifficultyFilterResult,
    GroupFilterResult,
    difficulty_filter,
    filter_groups,
)
from orchard.sampling.metrics import (
    BestOfNResult,
    avg_at_k,
    best_of_n,
    mean_std,
    oracle_best_of_n,
    pass_at_k,
    pass_hat_k,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "GROUP_FILTER_RULES",
    "BARConfig",
    "BARReason",
    "BARResult",
    "BARRollout",
    "BestOfNResult",
    "DifficultyFilterResult",
    "GroupFilterResult",
    "abar_select",
    "avg_at_k",
    "balanced_subset",
    "bar_select",
    "best_of_n",
    "broadcast_to_tokens",
    "difficulty_filter",
    "dr_grpo_advantages",
    "filter_groups",
    "group_advantages",
    "mean_std",
    "oracle_best_of_n",
    "pass_at_k",
    "pass_hat_k",
    "rloo_advantages",
]
