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
