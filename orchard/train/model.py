"""Loading a causal language model for training: local path or config, attention kernel, dtype, checkpointing."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

import torch

from orchard._extras import requires_extra

with requires_extra("train"):
    from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

__all__ = ["DTYPES", "best_attn_implementation", "load_causal_lm"]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The parameter dtypes a trainer accepts by name."""


def best_attn_implementation() -> str:
    """``"flash_attention_2"`` when the ``flash_attn`` package is importable and CUDA is present, else ``"sdpa"``."""
    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def load_causal_lm(
    source: str | Path | PretrainedConfig,
    *,
    dtype: Literal["float32", "bfloat16"] = "float32",
    attn_implementation: str = "auto",
    gradient_checkpointing: bool = False,
    seed: int = 0,
) -> PreTrainedModel:
    """A Hugging Face causal LM in train mode, from a local checkpoint directory or a config (random weights).

    Args:
        source: a local directory holding a checkpoint (nothing is downloaded) or a ``PretrainedConfig``.
        dtype: parameter dtype, ``"float32"`` (CPU default) or ``"bfloat16"`` (GPU).
        attn_implementation: ``"auto"`` picks ``best_attn_implementation()`` (flash-attention 2 when importable,
            SDPA otherwise); any value transformers accepts (``"eager"``, ``"sdpa"``, ...) is passed through.
        gradient_checkpointing: recompute activations in backward (non-reentrant), trading compute for memory;
            also turns the KV cache off, which training never uses.
        seed: the torch seed of the random initialisation when ``source`` is a config (the global RNG is
            left untouched).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not isinstance(attn_implementation, str) or not attn_implementation:
        raise ValueError(f"attn_implementation must be a non-empty string, got {attn_implementation!r}")
    attn = best_attn_implementation() if attn_implementation == "auto" else attn_implementation
    torch_dtype = DTYPES[dtype]
    if isinstance(source, PretrainedConfig):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(source, dtype=torch_dtype, attn_implementation=attn)
    elif isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_dir():
            raise ValueError(f"source must be a local checkpoint directory or a config, got missing path {str(path)!r}")
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, attn_implementation=attn, local_files_only=True
        )
    else:
        raise ValueError(f"source must be a path or a PretrainedConfig, got {type(source).__name__}")
    model = model.to(torch_dtype)
    if gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5 name
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    model.train()
    return model
