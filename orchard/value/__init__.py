"""orchard.value: GAE over decision steps, Monte-Carlo state values, the scalar-head value model, and best-of-N
reranking.

The math (``gae``, ``terminal_rewards``, step positions, ``monte_carlo_values``, ``rerank``) is layer 1;
``ValueModel``, the historical pool and value training are layer 5 and import transformers and ``orchard.data``
lazily. The estimator that samples the continuations is I/O and lives in ``orchard.rollout.turn_values``.
"""

from typing import TYPE_CHECKING, Any

from orchard.value.gae import gae, terminal_rewards
from orchard.value.monte_carlo import (
    MonteCarloValues,
    monte_carlo_step_targets,
    monte_carlo_step_values,
    monte_carlo_values,
)
from orchard.value.rerank import rerank, rerank_report
from orchard.value.steps import gather_step_values, step_end_positions

if TYPE_CHECKING:
    from orchard.value.model import ValueModel
    from orchard.value.pool import build_value_pool

__all__ = [
    "MonteCarloValues",
    "ValueModel",
    "build_value_pool",
    "gae",
    "gather_step_values",
    "monte_carlo_step_targets",
    "monte_carlo_step_values",
    "monte_carlo_values",
    "rerank",
    "rerank_report",
    "step_end_positions",
    "terminal_rewards",
]


def __getattr__(name: str) -> Any:
    if name == "ValueModel":
        from orchard.value.model import ValueModel

        return ValueModel
    if name == "build_value_pool":
        from orchard.value.pool import build_value_pool

        return build_value_pool
    raise AttributeError(f"module 'orchard.value' has no attribute {name!r}")
