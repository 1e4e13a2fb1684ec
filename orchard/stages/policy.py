"""The policy a recipe trains and the engine that samples it: a local checkpoint, or a tiny random Qwen3 for CPU."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["ModelConfig", "load_image_processor", "load_policy", "make_engine", "save_policy"]


@dataclass
class ModelConfig:
    path: str | None = None
    """Local HF checkpoint directory (weights and tokenizer), or a named pretrained checkpoint
    (`orchard models list`, e.g. smollm2-135m-instruct); null builds a tiny random Qwen3 and an offline tokenizer
    from the domain's text."""
    vocab_size: int = 1024
    """Offline tokenizer's vocabulary size (tiny model only)."""
    split_words: bool = False
    """Offline tokenizer: False lets BPE merges span words, so the fixed prompts cost a few tokens (tiny only)."""
    hidden_size: int = 128
    """Tiny model width."""
    num_layers: int = 4
    """Tiny model depth."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the trained model and the HF engine."""
    engine: Literal["hf", "vllm"] = "hf"
    """Rollout engine: hf (this process, CPU or GPU) or vllm (GPU extra)."""
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of vllm.LLM (tensor_parallel_size, gpu_memory_utilization, ...)."""
    freeze_vision: bool = False
    """A vision-language checkpoint's vision encoder and projector stay frozen in training (`load_causal_lm`'s
    ``freeze_vision``; the paper's GUI agent trains this way); needs ``path``."""
    compile_decode: bool = False
    """HF engine: run its fast decode step through torch.compile (`HFEngine`'s ``compile_decode``: a one-time
    compile of tens of seconds on CPU, then cheaper decode steps)."""

    def __post_init__(self) -> None:
        if self.path is not None:
            from orchard.models.pretrained import PRETRAINED, resolve_checkpoint

            if self.path not in PRETRAINED and not Path(self.path).is_dir():
                raise ValueError(f"path must be a local checkpoint directory or a named checkpoint "
                                 f"({', '.join(sorted(PRETRAINED))}), got {self.path!r} (no such directory)")
            resolve_checkpoint(self.path)  # a named one must be fetched: checked before any work
        for name in ("vocab_size", "hidden_size", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.hidden_size % 4:
            raise ValueError(f"hidden_size must be a multiple of 4 (4 attention heads), got {self.hidden_size}")
        if self.engine == "vllm" and self.path is None:
            raise ValueError("engine=vllm needs path (vLLM loads a checkpoint)")
        if not isinstance(self.freeze_vision, bool):
            raise ValueError(f"freeze_vision must be true or false, got {self.freeze_vision!r}")
        if self.freeze_vision and self.path is None:
            raise ValueError("freeze_vision needs path (a vision-language checkpoint); the tiny model has no vision "
                             "tower")
        if not isinstance(self.compile_decode, bool):
            raise ValueError(f"compile_decode must be true or false, got {self.compile_decode!r}")
        if self.engine == "vllm" and self.compile_decode:
            raise ValueError("compile_decode applies to engine=hf only (vLLM compiles its own forward)")


def load_policy(cfg: ModelConfig, corpus: Sequence[str], *, seed: int) -> tuple[Any, Any]:
    """``(model, tokenizer)``: from ``cfg.path``, or a tiny random Qwen3 with an offline tokenizer trained on
    ``corpus`` (the domain's text)."""
    if cfg.path is not None:
        from orchard.models.pretrained import load_chat_tokenizer
        from orchard.train.model import load_causal_lm

        return (load_causal_lm(cfg.path, dtype=cfg.dtype, freeze_vision=cfg.freeze_vision),
                load_chat_tokenizer(cfg.path))
    from orchard.data.tokenizer import build_chat_tokenizer
    from orchard.models import tiny_qwen3

    tokenizer = build_chat_tokenizer(list(corpus), vocab_size=cfg.vocab_size, split_words=cfg.split_words)
    h = cfg.hidden_size
    model = tiny_qwen3(tokenizer, seed=seed, hidden_size=h, intermediate_size=3 * h,
                       num_hidden_layers=cfg.num_layers, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=h // 4)
    return model, tokenizer


def load_image_processor(cfg: ModelConfig) -> Any:
    """The image processor of ``cfg.path`` (a Qwen-VL family checkpoint's ``preprocessor_config.json``), which
    rendering needs for samples with screenshots (`orchard.data.render_turns`' ``processor``). Nothing is
    downloaded; a checkpoint without one is a ``ValueError`` naming ``model.path``."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    if cfg.path is None:
        raise ValueError("model.path is null: screenshots need a vision-language checkpoint with an image processor")
    from orchard._extras import requires_extra
    from orchard.models.pretrained import resolve_checkpoint

    with requires_extra("data"):
        from transformers import AutoImageProcessor

    directory = resolve_checkpoint(cfg.path)
    try:
        return AutoImageProcessor.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model.path {cfg.path!r} has no image processor (preprocessor_config.json) for the "
                         f"screenshots: {exc}") from exc


def make_engine(cfg: ModelConfig, model: Any, tokenizer: Any, *, seed: int) -> Any:
    """The rollout engine: vLLM on ``cfg.path`` (GPU extra), or an `HFEngine` over a copy of ``model``."""
    if cfg.engine == "vllm":
        from orchard.models.pretrained import resolve_checkpoint
        from orchard.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(str(resolve_checkpoint(cfg.path)), **cfg.vllm_kwargs)
    from orchard.rollout.hf_engine import HFEngine

    return HFEngine(
        copy.deepcopy(model).eval(), pad_token_id=tokenizer.pad_token_id, max_batch_size=64, seed=seed,
        compile_decode=cfg.compile_decode,
    )


def save_policy(model: Any, tokenizer: Any, path: str | Path, *, processor: Any = None) -> None:
    """A checkpoint ``ModelConfig.path`` can load (e.g. to start RL from the SFT model with ``sft.enabled=false``);
    saved quietly, without importing DeepSpeed on the plain engine (`orchard.train.model.save_causal_lm`). A
    vision-language policy's image ``processor``, when given, is saved beside, so the checkpoint loads with
    screenshots too (`load_image_processor`)."""
    from orchard.train.model import save_causal_lm

    save_causal_lm(model, path, tokenizer)
    if processor is not None:
        processor.save_pretrained(path)
