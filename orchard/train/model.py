"""Loading a causal language model for training: local path or config, attention kernel, dtype, checkpointing."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal

import torch

from orchard._extras import requires_extra

with requires_extra("train"):
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        PretrainedConfig,
        PreTrainedModel,
    )

from orchard.models.quiet import quiet_transformers

__all__ = [
    "DTYPES",
    "CheckpointNotFoundError",
    "best_attn_implementation",
    "freeze_vision_tower",
    "load_causal_lm",
    "quiet_transformers",
    "save_causal_lm",
]


class CheckpointNotFoundError(FileNotFoundError, ValueError):
    """A model path that is not a directory: a ``FileNotFoundError`` (so a command line runner reports the path the
    user wrote in one line) that is also the ``ValueError`` every bad argument raises."""

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
    freeze_vision: bool = False,
) -> PreTrainedModel:
    """A Hugging Face causal LM in train mode, from a local checkpoint directory or a config (random weights).

    A vision-language model (a config with a ``vision_config``, e.g. Qwen3-VL) loads as an image-text-to-text
    model, whose forward also takes ``pixel_values`` / ``image_grid_thw`` / ``mm_token_type_ids``.

    Args:
        source: a local directory holding a checkpoint (nothing is downloaded), a named pretrained checkpoint that
            is fetched (`orchard.models.PRETRAINED`), or a ``PretrainedConfig``.
        dtype: parameter dtype, ``"float32"`` (CPU default) or ``"bfloat16"`` (GPU).
        attn_implementation: ``"auto"`` picks ``best_attn_implementation()`` (flash-attention 2 when importable,
            SDPA otherwise); any value transformers accepts (``"eager"``, ``"sdpa"``, ...) is passed through.
        gradient_checkpointing: recompute activations in backward (non-reentrant), trading compute for memory;
            also turns the KV cache off, which training never uses.
        seed: the torch seed of the random initialisation when ``source`` is a config (the global RNG is
            left untouched).
        freeze_vision: a vision-language model's vision encoder and projector get ``requires_grad=False``
            (``freeze_vision_tower``), as the paper trains its GUI agent; ``ValueError`` for a model without one.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not isinstance(attn_implementation, str) or not attn_implementation:
        raise ValueError(f"attn_implementation must be a non-empty string, got {attn_implementation!r}")
    attn = best_attn_implementation() if attn_implementation == "auto" else attn_implementation
    torch_dtype = DTYPES[dtype]
    if not isinstance(freeze_vision, bool):
        raise ValueError(f"freeze_vision must be a bool, got {freeze_vision!r}")
    if isinstance(source, PretrainedConfig):
        auto = _auto_class(source)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = auto.from_config(source, dtype=torch_dtype, attn_implementation=attn)
    elif isinstance(source, (str, Path)):
        from orchard.models.pretrained import PRETRAINED, resolve_checkpoint

        path = resolve_checkpoint(source) if isinstance(source, str) and source in PRETRAINED else Path(source)
        if not path.is_dir():
            raise CheckpointNotFoundError(
                2, "source must be a local checkpoint directory or a config; no such directory", str(path)
            )
        with quiet_transformers():
            auto = _auto_class(AutoConfig.from_pretrained(path, local_files_only=True))
            model = auto.from_pretrained(path, dtype=torch_dtype, attn_implementation=attn, local_files_only=True)
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
    if freeze_vision:
        freeze_vision_tower(model)
    model.train()
    return model


def _auto_class(config: PretrainedConfig) -> Any:
    return AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM


VISION_MODULES = ("visual", "vision_tower", "vision_model", "multi_modal_projector")
"""Submodule names of a vision-language model's vision side: Qwen-VL's ``visual`` (the ViT with its patch merger,
the projector, inside), LLaVA-style ``vision_tower`` / ``vision_model`` with a ``multi_modal_projector``."""


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Set ``requires_grad=False`` on the vision encoder and projector of a vision-language model; return how many
    parameters (elements) were frozen.

    The paper freezes both while training its GUI agent (Qwen3-VL), so only the language model learns; for Qwen-VL
    models that is the ``visual`` module (patch embedding, ViT blocks, the 2 x 2 merger and the DeepStack mergers).
    The optimizer skips frozen parameters (``param_groups`` takes trainable ones only).

    Raises:
        ValueError: naming ``model`` when it has none of the submodules in :data:`VISION_MODULES` (a text model).
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch module, got {type(model).__name__}")
    towers = [module for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in VISION_MODULES]
    if not towers:
        raise ValueError(
            f"model has no vision encoder to freeze (no submodule named one of {list(VISION_MODULES)}): "
            f"{type(model).__name__}"
        )
    frozen = 0
    for tower in towers:
        for param in tower.parameters():
            if param.requires_grad:
                param.requires_grad_(False)
                frozen += param.numel()
    return frozen


def save_causal_lm(model: PreTrainedModel, path: str | Path, tokenizer: Any = None) -> Path:
    """Save ``model`` (and ``tokenizer``, if given) with ``save_pretrained`` into directory ``path``, quietly.

    A checkpoint ``load_causal_lm(path)`` loads. Unlike a bare ``model.save_pretrained`` it draws no progress bar
    and, when DeepSpeed has not been imported (the plain engine), does not import it (see ``quiet_transformers``).
    Returns the directory.
    """
    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    directory = Path(path)
    with quiet_transformers():
        model.save_pretrained(directory)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
    return directory
