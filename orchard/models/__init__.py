"""orchard.models: model builders shared by rollout and training (layer 2: may import transformers).

- `tiny_qwen3_config`, `tiny_qwen3`, `tiny_chat_model`: a tiny random Qwen3 (nothing downloaded)
"""

from orchard.models.tiny import tiny_chat_model, tiny_qwen3, tiny_qwen3_config

__all__ = ["tiny_chat_model", "tiny_qwen3", "tiny_qwen3_config"]
