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

What an assistant turn generates (its content, its tool calls and its ``<|im_end|>``) sits between Jinja
``{% generation %}`` and ``{% endgeneration %}`` markers, which emit nothing, so
``tokenizer.apply_chat_template(messages, tokenize=True, return_assistant_tokens_mask=True, return_dict=True)``
gives ``assistant_masks`` equal to the ``action_mask`` of :func:`orchard.data.render_trajectory` for the same
conversation (when the assistant turns carry no sampled ``token_ids`` that the template would split differently).
TRL's ``assistant_only_loss`` and other trainers that read that mask train on the same tokens we do.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

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
    "{%- macro render_tool_calls(message) -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if not loop.first or message.content -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' -}}"
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
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
    "{%- if message.role == 'assistant' -%}"
    # What the policy generates, and what orchard.data.render marks as actions; the markers emit nothing.
    "{%- generation -%}"
    "{{- render_content(message.content) -}}"
    "{%- if message.tool_calls -%}{{- render_tool_calls(message) -}}{%- endif -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{%- else -%}"
    "{{- render_content(message.content) + '<|im_end|>' -}}"
    "{%- endif -%}"
    "{{- '\\n' -}}"
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


TEMPLATE_TOKENS = ("<|im_start|>", "<|im_end|>")
"""The control tokens :data:`CHAT_TEMPLATE` writes: each must be one token of a tokenizer that takes the template,
and ``<|im_end|>`` its eos (the token a policy samples to end its turn)."""

_PROBE_TOOL = "orchard_template_probe"
_PROBE_ARGUMENT = "zq7_probe_value"


class ChatTemplateError(ValueError):
    """A tokenizer whose chat template cannot render tools and whose special tokens do not fit the project's."""


def renders_tools(tokenizer: Any) -> bool:
    """True when ``tokenizer``'s chat template lists the ``tools`` it is given and renders an assistant turn's tool
    calls (name and arguments); False when it has no template, drops either, or raises on them.

    The check renders a probe conversation (a user turn, an assistant turn with one tool call and no text, the
    tool's result) with one probe tool, as `orchard.data.render` renders every trajectory.
    """
    if not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError(f"tokenizer must be a transformers tokenizer, got {type(tokenizer).__name__}")
    if not getattr(tokenizer, "chat_template", None):
        return False
    tools = [{"type": "function", "function": {
        "name": _PROBE_TOOL, "description": "probe",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": _PROBE_TOOL, "arguments": {"q": _PROBE_ARGUMENT}}}
        ]},
        {"role": "tool", "tool_call_id": "c0", "content": "ok"},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    except Exception:  # a template that cannot take tool calls (jinja errors of every kind) does not render them
        return False
    # the tool listed once and called once, with its argument
    return isinstance(text, str) and text.count(_PROBE_TOOL) >= 2 and _PROBE_ARGUMENT in text


def ensure_tool_template(tokenizer: Any, *, source: str = "the tokenizer", warn: bool = True) -> bool:
    """Give ``tokenizer`` the project's tool-calling :data:`CHAT_TEMPLATE` when its own cannot render tools.

    A checkpoint whose template lists tools and renders tool calls (Qwen3, Qwen2.5, ...) keeps it. One whose template
    renders neither (SmolLM2-Instruct's, which also raises on an assistant message without ``content``) gets the
    project's ChatML template, which needs :data:`TEMPLATE_TOKENS` as single tokens and ``<|im_end|>`` as eos.

    Args:
        tokenizer: a transformers tokenizer; changed in place.
        source: what the tokenizer was loaded from, for the warning and the error.
        warn: print one ``warning:`` line to stderr when the template is replaced.

    Returns:
        True when the template was replaced, False when the tokenizer's own was kept.

    Raises:
        ChatTemplateError: the template cannot render tools and the special tokens do not fit the project's
            template (naming the tokens that are missing or the eos it has).
    """
    if not isinstance(source, str) or not source:
        raise ValueError(f"source must be a non-empty string, got {source!r}")
    if renders_tools(tokenizer):
        return False
    problems = []
    for token in TEMPLATE_TOKENS:
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            problems.append(f"{token} is not one token (it encodes to {len(ids)})")
    if tokenizer.eos_token != "<|im_end|>":
        problems.append(f"its eos token is {tokenizer.eos_token!r}, not '<|im_end|>'")
    if problems:
        raise ChatTemplateError(
            f"{source}: its chat template cannot render tools, and the project's ChatML tool template does not fit "
            f"its special tokens: {'; '.join(problems)}; give a checkpoint whose template renders tools"
        )
    tokenizer.chat_template = CHAT_TEMPLATE
    if warn:
        print(f"warning: {source}: its chat template cannot render tools; using orchard's ChatML tool template",
              file=sys.stderr)
    return True


class TokenizerMismatch(ValueError):
    """Two tokenizers that must be the same (a student and the teacher that reads or writes its token ids) differ."""


_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def _special_tokens(tokenizer: Any) -> dict[str, Any]:
    """The special tokens a token-id exchange depends on: the named ones' ids, and every added token's text and
    whether it is special."""
    out: dict[str, Any] = {name: getattr(tokenizer, name, None) for name in _SPECIAL_IDS}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    out["added"] = {int(i): (str(t), bool(getattr(t, "special", False))) for i, t in added.items()}
    return out


def check_same_tokenizer(student: Any, teacher: Any, *, student_name: str = "the student",
                         teacher_name: str = "the teacher") -> None:
    """``TokenizerMismatch`` (a ``ValueError``) naming both tokenizers unless ``teacher`` has ``student``'s
    vocabulary (every token string to the same id) and special tokens (bos / eos / pad / unk ids, every added token's
    text and special flag).

    A teacher exchanges token ids with the student: on-policy distillation scores the student's ids as they are,
    and a teacher sampled through the student's harnesses is sent prompts rendered with the student's tokenizer and
    answers ids that train the student. Different vocabularies make both silently wrong, so the paper's student and
    teacher share one (Qwen3.5-35B-A3B and Qwen3.5-397B-A17B); the chat template is not compared (the harness renders
    with the student's).

    Args:
        student, teacher: transformers tokenizers (``get_vocab()``).
        student_name, teacher_name: how the message names each (a path, a model name).
    """
    for name, tok in (("student", student), ("teacher", teacher)):
        if not callable(getattr(tok, "get_vocab", None)):
            raise ValueError(f"{name} must be a transformers tokenizer with get_vocab(), got {type(tok).__name__}")
    if student is teacher:
        return
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    problem = None
    if ours != theirs:
        differ = sorted(t for t in ours.keys() | theirs.keys() if ours.get(t) != theirs.get(t))
        problem = (f"vocabularies differ ({len(ours)} vs {len(theirs)} tokens, {len(differ)} tokens with another id or "
                   f"missing, e.g. {differ[:3]!r})")
    else:
        s, t = _special_tokens(student), _special_tokens(teacher)
        differ = [k for k in s if s[k] != t[k]]
        if differ:
            problem = "special tokens differ: " + "; ".join(
                f"{k} {s[k]!r:.80} vs {t[k]!r:.80}" for k in differ)
    if problem is not None:
        raise TokenizerMismatch(f"{student_name} and {teacher_name} must share one tokenizer (their token ids are "
                                f"exchanged as they are): {problem}")
