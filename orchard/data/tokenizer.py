"""An offline-trained chat tokenizer: byte-level BPE with a Qwen3-style chat template that renders tool calls.

Nothing is downloaded. Tests, tiny recipes and benchmarks build it from a built-in corpus plus any domain texts
they pass, so its merges fit the text the tiny model will see.

Chat format (one turn)::

    <|im_start|>{role}\n{content}<|im_end|>\n

An assistant turn renders its tool calls after its content, each as
``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``; a string ``arguments`` is emitted as given, a dict
as JSON. Tool results are turns of role ``tool``. Content given as a list of OpenAI content parts renders its
text parts in order and each image part (``image_url`` or ``image``) as
``<|vision_start|><|image_pad|><|vision_end|>``, the Qwen-VL family's marker, which rendering with an image
processor expands into the image's vision tokens (a tokenizer built with ``vision=True`` has the markers as atomic
special tokens). ``tools=`` are listed in the system turn, after the first system message's content, one compact signature per line (``- name(param: type, optional?: type): description``) rather
than their JSON schemas, so a tiny model's context is not spent on schema boilerplate. ``add_generation_prompt`` appends ``<|im_start|>assistant\n``.
The rendering of ``messages[:k]`` is a prefix of the rendering of ``messages[:k+1]``, so a trajectory can be
rendered turn by turn and spliced with the sampled token ids. The end-of-turn token the model samples is
``<|im_end|>`` (the tokenizer's eos); the newline after it belongs to the template, not to the model.
"""

from __future__ import annotations

from collections.abc import Iterable

from orchard._extras import requires_extra

with requires_extra("data"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Control tokens: padding, turn start, turn end (= eos)."""

MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
"""Atomic tokens that appear in decoded text (not skipped by ``skip_special_tokens``)."""

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""The Qwen-VL family's vision markers (``build_chat_tokenizer(vision=True)``): an image renders as
``<|vision_start|><|image_pad|><|vision_end|>`` and its ``<|image_pad|>`` stands for the image's vision tokens;
``<|video_pad|>`` is there because the models' configs name a video token (videos are not rendered)."""

IMAGE_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"
"""What the chat template writes for one image part."""
IMAGE_TOKEN = "<|image_pad|>"
"""The token that stands for an image's vision tokens (one in the template, expanded when rendering)."""

CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is iterable -%}"
    "{%- for part in content -%}"
    "{%- if part.type == 'text' -%}{{- part.text -}}"
    "{%- elif part.type == 'image_url' or part.type == 'image' -%}{{- '" + IMAGE_MARKER + "' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(start=0) -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{{- render_content(messages[0].content) + '\\n\\n' -}}"
    "{%- set ns.start = 1 -%}"
    "{%- endif -%}"
    "{{- '# Tools\\n' -}}"
    "{%- for tool in tools -%}"
    "{%- set fn = tool.function if tool.function is defined else tool -%}"
    "{{- '- ' + fn.name + '(' -}}"
    "{%- if fn.parameters is defined and fn.parameters.properties is defined -%}"
    "{%- set required = fn.parameters.required if fn.parameters.required is defined else [] -%}"
    "{%- for pname, prop in fn.parameters.properties.items() -%}"
    "{{- (', ' if not loop.first else '') + pname + ('' if pname in required else '?') + ': ' + "
    "(prop.type if prop.type is defined else 'any') -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- ')' + (': ' + fn.description if fn.description else '') + '\\n' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages[ns.start:] -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{{- render_content(message.content) -}}"
    "{%- if message.role == 'assistant' and message.tool_calls -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if not loop.first or message.content -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' -}}"
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_BUILTIN_CORPUS = (
    "You are a helpful assistant. Use the tools to complete the task, then reply with a short summary.",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > ; : , . ! ? ' \" _ # @ $ % &",
    '{"name": "exec", "arguments": {"command": "ls -la /workspace"}}',
    '{"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": '
    '{"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}',
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "diff --git a/src/main.py b/src/main.py\n--- a/src/main.py\n+++ b/src/main.py\n@@ -1,3 +1,3 @@\n-x = 1\n+x = 2\n",
    "Error: file not found. Exit code 1. stdout: ok stderr: Traceback (most recent call last):",
    "Subject: Meeting on Monday at 10:00. From: alice@example.com To: bob@example.com",
    "The task is done. I have updated the calendar, replied to the email and saved the report.",
)


def build_chat_tokenizer(
    texts: Iterable[str] | None = None, *, vocab_size: int = 1024, split_words: bool = True, vision: bool = False
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE chat tokenizer offline.

    Args:
        texts: extra training text (e.g. a domain's prompts, tool schemas and observations); the built-in corpus is
            always included, so every byte is representable and common markup merges exist.
        vocab_size: target vocabulary size including the 256 byte tokens and the special tokens; >= 300.
        split_words: True (GPT-2 style) splits text into words, numbers and punctuation before BPE, so merges never
            span them. False lets merges span words: text that recurs verbatim in ``texts`` (a domain's system
            prompt, its JSON keys) compresses to a few tokens, which keeps a tiny model's sequences short.
        vision: add :data:`VISION_TOKENS` as special tokens (the last four ids), for a tiny vision-language model
            (``orchard.models.tiny_qwen_vl``); the vocabulary stays ``vocab_size`` in all. Off by default, so text
            tokenizers keep their ids.

    Returns:
        A ``PreTrainedTokenizerFast`` with ``chat_template`` set, ``eos_token="<|im_end|>"``,
        ``pad_token="<|endoftext|>"`` and ``padding_side="left"`` (as generation wants). Deterministic for the
        same inputs.
    """
    if not isinstance(vocab_size, int) or vocab_size < 300:
        raise ValueError(f"vocab_size must be an int >= 300, got {vocab_size!r}")
    if not isinstance(split_words, bool):
        raise ValueError(f"split_words must be a bool, got {split_words!r}")
    if not isinstance(vision, bool):
        raise ValueError(f"vision must be a bool, got {vision!r}")
    corpus = list(_BUILTIN_CORPUS)
    if texts is not None:
        if isinstance(texts, str):
            raise ValueError("texts must be an iterable of strings, got a single str")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(f"texts[{i}] must be a str, got {type(text).__name__}")
            corpus.append(text)

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split_words)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKUP_TOKENS) - (len(VISION_TOKENS) if vision else 0),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    wrapped.add_tokens(list(MARKUP_TOKENS), special_tokens=False)
    if vision:
        wrapped.add_tokens(list(VISION_TOKENS), special_tokens=True)
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped
