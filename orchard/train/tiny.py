"""Moved to ``orchard.models.tiny`` (rollout builds the same model and may not import ``orchard.train``); this
re-export keeps ``from orchard.train.tiny import tiny_qwen3`` working for recipes, tests and benchmarks."""

from orchard.models.tiny import tiny_chat_model, tiny_qwen3, tiny_qwen3_config

__all__ = ["tiny_chat_model", "tiny_qwen3", "tiny_qwen3_config"]
