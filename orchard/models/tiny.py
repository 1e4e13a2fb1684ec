"""A tiny random Qwen3 built from a config: the model of tests, CPU recipes, benchmarks and ``orchard serve-model
--model tiny`` (nothing downloaded).

It lives in layer 2 (beside ``orchard.data``, whose offline chat tokenizer it pairs with) so that both rollout
(layer 4) and training (layer 5) build the same model from one definition.
"""

from __future__ import annotations

from typing import Any

import torch

from orchard._extras import requires_extra

with requires_extra("data"):
    from transformers import PreTrainedTokenizerBase, Qwen3Config, Qwen3ForCausalLM


def tiny_qwen3_config(vocab_size: int, **overrides: Any) -> Qwen3Config:
    """A Qwen3 config small enough for a CPU test (~100k parameters at vocab 1024).

    Args:
        vocab_size: the tokenizer's vocabulary size (``len(tokenizer)``).
        **overrides: any ``Qwen3Config`` field, e.g. ``hidden_size=128, num_hidden_layers=4``.
    """
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    fields.update(overrides)
    return Qwen3Config(**fields)


def tiny_qwen3(
    vocab_size_or_tokenizer: int | PreTrainedTokenizerBase, *, seed: int = 0, **overrides: Any
) -> Qwen3ForCausalLM:
    """A randomly initialised tiny Qwen3 in float32, deterministic for ``seed``.

    With a tokenizer, the vocabulary size and the eos / pad ids come from it.
    """
    if isinstance(vocab_size_or_tokenizer, PreTrainedTokenizerBase):
        tok = vocab_size_or_tokenizer
        overrides.setdefault("eos_token_id", tok.eos_token_id)
        overrides.setdefault("pad_token_id", tok.pad_token_id)
        overrides.setdefault("bos_token_id", tok.bos_token_id)
        vocab_size = len(tok)
    elif isinstance(vocab_size_or_tokenizer, int) and not isinstance(vocab_size_or_tokenizer, bool):
        vocab_size = vocab_size_or_tokenizer
    else:
        raise ValueError(
            f"vocab_size_or_tokenizer must be an int or a tokenizer, got {type(vocab_size_or_tokenizer).__name__}"
        )
    config = tiny_qwen3_config(vocab_size, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    return model.float().eval()


def tiny_chat_model(seed: int = 0, **overrides: Any) -> tuple[Qwen3ForCausalLM, PreTrainedTokenizerBase]:
    """``tiny_qwen3`` over the offline chat tokenizer (``orchard.data.tokenizer.build_chat_tokenizer()``):
    a model and a tokenizer that can chat, for smoke tests and demos. ``overrides`` as in ``tiny_qwen3``."""
    from orchard.data.tokenizer import build_chat_tokenizer

    tokenizer = build_chat_tokenizer()
    return tiny_qwen3(tokenizer, seed=seed, **overrides), tokenizer


def tiny_image_processor(**overrides: Any) -> Any:
    """A Qwen2-VL-style image processor (the one Qwen2-VL, Qwen2.5-VL and Qwen3-VL use) with Qwen3-VL's geometry:
    16-pixel patches, 2 x 2 patches merged into one vision token, and small images, so a 64 x 64 screenshot is
    ``grid_thw = (1, 4, 4)``: 16 patches, 4 vision tokens. Built offline on PIL (no torchvision).

    Args:
        **overrides: any ``Qwen2VLImageProcessorPil`` argument, e.g. ``max_pixels=128 * 128``.
    """
    with requires_extra("data"):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    fields: dict[str, Any] = dict(
        patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=128 * 128,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )
    fields.update(overrides)
    return Qwen2VLImageProcessorPil(**fields)


def tiny_qwen_vl(tokenizer: PreTrainedTokenizerBase, *, seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised tiny Qwen3-VL (the paper's GUI model family) in float32, deterministic for ``seed``.

    The language model is ``tiny_qwen3_config``'s (64 wide, 2 layers, M-RoPE sections 2 / 3 / 3 over the 8 rotary
    frequencies); the vision encoder has 2 blocks 32 wide, 16-pixel patches, a 2 x 2 merger (the projector) into
    the language width and one DeepStack merger. The tokenizer must have the vision tokens
    (``build_chat_tokenizer(vision=True)``); their ids, eos and pad come from it.

    Args:
        tokenizer: the tokenizer, with ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``,
            ``<|video_pad|>``.
        seed: the torch seed of the initialisation (the global RNG is left untouched).
        **overrides: ``Qwen3VLConfig`` fields, e.g. ``vision_config={...}`` or ``text_config={...}`` (merged over
            the defaults).
    """
    with requires_extra("data"):
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from orchard.data.tokenizer import VISION_TOKENS

    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise ValueError(f"tokenizer must be a transformers tokenizer, got {type(tokenizer).__name__}")
    vocab = tokenizer.get_vocab()
    missing = [t for t in VISION_TOKENS if t not in vocab]
    if missing:
        raise ValueError(f"tokenizer has no vision tokens {missing}; build it with build_chat_tokenizer(vision=True)")
    start, end, image, video = (vocab[t] for t in VISION_TOKENS)
    text = tiny_qwen3_config(len(tokenizer)).to_dict()
    text.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True},
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    text.update(overrides.pop("text_config", {}))
    vision: dict[str, Any] = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                  out_hidden_size=text["hidden_size"], patch_size=16, spatial_merge_size=2,
                                  temporal_patch_size=2, deepstack_visual_indexes=[0], num_position_embeddings=64)
    vision.update(overrides.pop("vision_config", {}))
    config = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=image, video_token_id=video,
                           vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=True,
                           **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3VLForConditionalGeneration(config)
    return model.float().eval()


def tiny_vl_chat_model(seed: int = 0, **overrides: Any) -> tuple[Any, PreTrainedTokenizerBase, Any]:
    """``(model, tokenizer, image_processor)``: ``tiny_qwen_vl`` over ``build_chat_tokenizer(vision=True)`` and
    ``tiny_image_processor()``, a vision-language model that can chat about images, for tests and demos."""
    from orchard.data.tokenizer import build_chat_tokenizer

    tokenizer = build_chat_tokenizer(vision=True)
    return tiny_qwen_vl(tokenizer, seed=seed, **overrides), tokenizer, tiny_image_processor()
