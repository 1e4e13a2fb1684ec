"""orchard.train: model loading, the training step (plain torch or DeepSpeed ZeRO-2/3), checkpoints that resume
exactly, metric loggers, and typed configs (layer 5). See ``docs/training.md`` and ``docs/metrics.md``.

DeepSpeed is imported only when a DeepSpeed engine is built.
"""

from orchard.train.config import (
    ConfigError,
    config_to_dict,
    field_docs,
    format_config,
    format_help,
    load_config,
)
from orchard.train.model import freeze_vision_tower, load_causal_lm
from orchard.train.objective import LOSS_TERMS, LossTerm, TermSpec, objective_loss
from orchard.train.schedule import cosine_lr, cosine_schedule
from orchard.train.trainer import DataCursor, OptimConfig, TrainConfig, Trainer

__all__ = [
    "LOSS_TERMS",
    "ConfigError",
    "DataCursor",
    "LossTerm",
    "OptimConfig",
    "TermSpec",
    "TrainConfig",
    "Trainer",
    "config_to_dict",
    "cosine_lr",
    "cosine_schedule",
    "field_docs",
    "format_config",
    "format_help",
    "freeze_vision_tower",
    "load_causal_lm",
    "load_config",
    "objective_loss",
]
