import pytest
import torch

from orchard.data.tokenizer import CHAT_TEMPLATE, build_chat_tokenizer
from orchard.train.tiny import tiny_qwen3

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "exec",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "list files"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "exec", "arguments": {"command": "ls"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
    {"role": "assistant", "content": "Let me look", "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "exec", "arguments": '{"command": "cat a.txt"}'}},
        {"id": "c3", "type": "function", "function": {"name": "exec", "arguments": {"command": "pwd"}}}]},
    {"role": "tool", "tool_call_id": "c2", "content": "hi"},
    {"role": "assistant", "content": "done"},
]


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


def test_template_renders_turns_and_tool_calls(tok):
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    # Tools render as compact signatures; a parameter not listed as required is marked optional with "?".
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n- exec(command?: string)\n<|im_end|>\n")
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "exec", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>\n' in text
    # A string `arguments` is emitted verbatim, a dict as JSON; both read the same.
    assert 'Let me look\n<tool_call>\n{"name": "exec", "arguments": {"command": "cat a.txt"}}\n</tool_call>\n<tool_call>' in text
    assert text.endswith("<|im_start|>assistant\ndone<|im_end|>\n")


def test_template_is_prefix_consistent(tok):
    for k in range(1, len(CONVERSATION)):
        shorter = tok.apply_chat_template(CONVERSATION[:k], tools=TOOLS, tokenize=False)
        longer = tok.apply_chat_template(CONVERSATION[: k + 1], tools=TOOLS, tokenize=False)
        assert longer.startswith(shorter), k
    prompt = tok.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


# The rendering of CONVERSATION with TOOLS before the generation markers were added, byte for byte.
RENDERED = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n- exec(command?: string)\n<|im_end|>\n"
    "<|im_start|>user\nlist files<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>\n{"name": "exec", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>tool\na.txt<|im_end|>\n"
    '<|im_start|>assistant\nLet me look\n<tool_call>\n{"name": "exec", "arguments": {"command": "cat a.txt"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "exec", "arguments": {"command": "pwd"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>tool\nhi<|im_end|>\n"
    "<|im_start|>assistant\ndone<|im_end|>\n"
)


def test_generation_markers_emit_nothing(tok):
    assert "{%- generation -%}" in CHAT_TEMPLATE and "{%- endgeneration -%}" in CHAT_TEMPLATE
    assert tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False) == RENDERED
    unmarked = build_chat_tokenizer()
    unmarked.chat_template = CHAT_TEMPLATE.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    for tools in (None, TOOLS):
        for gen in (False, True):
            for k in range(1, len(CONVERSATION) + 1):
                kw = {"tools": tools, "tokenize": False, "add_generation_prompt": gen}
                assert tok.apply_chat_template(CONVERSATION[:k], **kw) == (
                    unmarked.apply_chat_template(CONVERSATION[:k], **kw)
                ), (tools, gen, k)


def test_assistant_masks_equal_our_action_mask(tok):
    from orchard.data import Trajectory, render_trajectory

    out = tok.apply_chat_template(
        CONVERSATION, tools=TOOLS, tokenize=True, return_assistant_tokens_mask=True, return_dict=True
    )
    sample = render_trajectory(Trajectory(messages=CONVERSATION, tools=TOOLS), tok)
    assert sample is not None and sample.report.ok
    assert out["input_ids"] == sample.input_ids.tolist()
    assert out["assistant_masks"] == sample.action_mask.long().tolist()
    # What the mask covers, run by run: each assistant turn's text and its <|im_end|>, never the "\n" after it,
    # the "<|im_start|>assistant\n" before it, or a system, user or tool token.
    runs, run = [], []
    for token, trained in zip(out["input_ids"], out["assistant_masks"], strict=True):
        if trained:
            run.append(token)
        elif run:
            runs.append(tok.decode(run))
            run = []
    assert runs == [
        '<tool_call>\n{"name": "exec", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>',
        'Let me look\n<tool_call>\n{"name": "exec", "arguments": {"command": "cat a.txt"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "exec", "arguments": {"command": "pwd"}}\n</tool_call><|im_end|>',
        "done<|im_end|>",
    ]


def test_encode_decode_round_trip_and_atomic_markup(tok):
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    for marker in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"):
        assert len(tok.encode(marker)) == 1, marker
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.decode(tok.encode("ünïcödé ✓"), skip_special_tokens=True) == "ünïcödé ✓"


def test_build_is_deterministic_and_learns_domain_text():
    domain = ["send_mail to carol@corp.test about the quarterly inventory"] * 50
    a, b = build_chat_tokenizer(domain, vocab_size=600), build_chat_tokenizer(domain, vocab_size=600)
    assert a.get_vocab() == b.get_vocab()
    plain = build_chat_tokenizer(vocab_size=600)
    assert len(a.encode(domain[0])) < len(plain.encode(domain[0]))


def test_merges_may_span_words_when_asked():
    system = "You are a careful assistant. Use the tools, then answer briefly."
    corpus = [system] * 50 + ["Add the event sync on 2026-12-01."] * 20
    spanning = build_chat_tokenizer(corpus, vocab_size=600, split_words=False)
    words = build_chat_tokenizer(corpus, vocab_size=600)
    # A prompt seen verbatim 50 times becomes a handful of tokens once merges may cross spaces.
    assert len(spanning.encode(system)) <= 4 < len(words.encode(system))
    text = spanning.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert spanning.decode(spanning.encode(text)) == text
    for marker in ("<|im_start|>", "<|im_end|>", "<tool_call>"):
        assert len(spanning.encode(marker)) == 1, marker


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="vocab_size"):
        build_chat_tokenizer(vocab_size=10)
    with pytest.raises(ValueError, match="texts"):
        build_chat_tokenizer("one string")
    with pytest.raises(ValueError, match="split_words"):
        build_chat_tokenizer(split_words="no")
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_qwen3(0)


def test_tiny_qwen3_is_seeded_and_runs(tok):
    a, b = tiny_qwen3(tok, seed=3), tiny_qwen3(tok, seed=3)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert a.config.vocab_size == len(tok) and a.config.eos_token_id == tok.eos_token_id
    untied = tiny_qwen3(tok, tie_word_embeddings=False)
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([tok.encode("hello world")])
    logits = a(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()


# SmolLM2-Instruct's own template, in substance: no tools listed, and message['content'] read on every message.
NO_TOOLS_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_template_that_renders_tools_is_kept_without_a_word(capsys):
    from orchard.data.tokenizer import ensure_tool_template, renders_tools

    tok = build_chat_tokenizer()
    tok.chat_template = tok.chat_template.replace("# Tools", "## Tools")  # someone else's, but it renders tools
    assert renders_tools(tok)
    assert ensure_tool_template(tok, source="ckpt") is False
    assert "## Tools" in tok.chat_template and capsys.readouterr().err == ""


def test_a_template_without_tools_gets_the_project_template_with_one_warning_line(capsys):
    from orchard.data.tokenizer import ensure_tool_template, renders_tools

    tok = build_chat_tokenizer()
    tok.chat_template = NO_TOOLS_TEMPLATE
    assert not renders_tools(tok)
    assert ensure_tool_template(tok, source="some/checkpoint") is True
    assert tok.chat_template == CHAT_TEMPLATE and renders_tools(tok)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: some/checkpoint:")
    tok.chat_template = None  # no template at all: the same
    assert ensure_tool_template(tok, warn=False) is True and tok.chat_template == CHAT_TEMPLATE


def test_special_tokens_that_do_not_fit_the_project_template_are_refused():
    from orchard.data.tokenizer import ChatTemplateError, ensure_tool_template

    tok = build_chat_tokenizer()
    tok.chat_template = NO_TOOLS_TEMPLATE
    tok.eos_token = "<|endoftext|>"  # turns would end on a token the policy is never taught to sample
    with pytest.raises(ChatTemplateError, match="its eos token is '<\\|endoftext\\|>'"):
        ensure_tool_template(tok, source="ckpt")
    assert tok.chat_template == NO_TOOLS_TEMPLATE  # left as it was

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    plain = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>")  # no <|im_start|> token
    plain.chat_template = NO_TOOLS_TEMPLATE
    with pytest.raises(ChatTemplateError, match="<\\|im_start\\|> is not one token"):
        ensure_tool_template(plain, source="ckpt")
