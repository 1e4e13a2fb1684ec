"""Rendering: exact action masks on multi-turn tool conversations, perturbation invariance, mismatch handling."""

import copy
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchard.data import (
    RenderedSample,
    RenderReport,
    Trajectory,
    render_trajectory,
    render_turns,
)
from orchard.data.render import _segments_exact, _segments_windowed

from .strategies import conversations
from .strategies import text as any_text

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "exec",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
]

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "List the files, then read a.txt."},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "exec", "arguments": {"command": "ls -la"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "a.txt\nb.txt"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "read_file", "arguments": '{"path": "a.txt"}'},
            },
            {
                "id": "c3",
                "type": "function",
                "function": {"name": "exec", "arguments": {"command": "wc -l a.txt"}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c2", "content": "hello"},
    {"role": "tool", "tool_call_id": "c3", "content": "1 a.txt"},
    {"role": "assistant", "content": "The file says hello."},
]

# What the policy generated in each assistant turn, written out by hand from the template's format: content,
# then each call as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call> (a newline before every call but a
# first one without content), then the end-of-turn token. The generation prompt and the "\n" after <|im_end|>
# belong to the template, not to the policy.
ACTIONS = [
    'Let me look.\n<tool_call>\n{"name": "exec", "arguments": {"command": "ls -la"}}\n</tool_call><|im_end|>',
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "exec", "arguments": {"command": "wc -l a.txt"}}\n</tool_call><|im_end|>',
    "The file says hello.<|im_end|>",
]
ASSISTANT_AT = [2, 4, 7]


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def sampled_trajectory(tok, messages=MESSAGES, actions=ACTIONS, reward=1.0):
    """A trajectory as an engine would record it: each assistant turn carries the ids it sampled (here the
    canonical tokenization of its text) and one distinct log-prob per id."""
    msgs = copy.deepcopy(messages)
    at = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    for k, (i, text) in enumerate(zip(at, actions, strict=True)):
        ids = encode(tok, text)
        msgs[i]["token_ids"] = ids
        msgs[i]["logprobs"] = [-(k + 1) - j / 64 for j in range(len(ids))]
    return Trajectory(messages=msgs, tools=TOOLS, reward=reward, task_id="t", group_id="g")


def template_text(tok, traj, upto=None, gen=False):
    msgs = traj.openai_messages()[:upto]
    return tok.apply_chat_template(msgs, tools=traj.tools or None, tokenize=False, add_generation_prompt=gen)


def test_masks_exact_for_multi_turn_tool_conversation(tokenizer):
    tok = tokenizer
    traj = sampled_trajectory(tok)
    s = render_trajectory(traj, tok)
    assert s.report.ok and not s.report.truncated and s.report.full_length == len(s)
    full = template_text(tok, traj)
    # With canonical sampled ids the spliced sequence is exactly the template's tokenization.
    assert s.input_ids.tolist() == encode(tok, full)
    for k, text in enumerate(ACTIONS):
        assert tok.decode(s.input_ids[s.turn_index == k]) == text
    assert torch.equal(s.action_mask, s.turn_index >= 0)
    # Everything else -- system (with tools), user, tool turns, generation prompts, the "\n" after each
    # <|im_end|> -- is the full text with the three action texts cut out, and none of it is an action.
    rest = full
    for text in ACTIONS:
        assert rest.count(text) == 1
        rest = rest.replace(text, "")
    assert tok.decode(s.input_ids[~s.action_mask]) == rest
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert not s.action_mask[s.input_ids == im_start].any()
    eos_positions = (s.input_ids == tok.eos_token_id).nonzero().flatten()
    # 8 turns end with <|im_end|> (system, user, 3 assistant, 3 tool); only the 3 assistant ones are actions.
    assert len(eos_positions) == 8 and int(s.action_mask[eos_positions].sum()) == 3
    # Sampling log-probs land on their tokens, 0 elsewhere.
    expected_lp = torch.tensor([lp for i in ASSISTANT_AT for lp in traj.messages[i].logprobs])
    assert torch.equal(s.old_logprobs[s.action_mask], expected_lp)
    assert torch.equal(s.logprob_mask, s.action_mask)
    assert not s.old_logprobs[~s.action_mask].any()
    assert s.input_ids.dtype == torch.long and s.old_logprobs.dtype == torch.float32
    assert (s.reward, s.task_id, s.group_id) == (1.0, "t", "g")


def _targets(s: RenderedSample):
    """The next-token targets the loss reads (position t predicts input_ids[t+1] where action_mask[t+1])."""
    return (
        s.input_ids[1:][s.action_mask[1:]],
        s.turn_index[1:][s.action_mask[1:]],
        s.old_logprobs[s.action_mask],
    )


def test_observation_perturbation_same_length_changes_only_non_action_positions(tokenizer):
    tok = tokenizer
    base = sampled_trajectory(tok)
    a = render_trajectory(base, tok)
    # Change a tool observation and the user prompt to texts of the same token length, so positions compare one
    # to one (which candidates qualify depends on the tokenizer's merges).
    perturbed_msgs = copy.deepcopy(MESSAGES)
    for index, candidates in (
        (5, ["jello", "hallo", "hellp", "HELLO", "12345"]),
        (1, [f"List the files, then read {f}." for f in ("b.txt", "c.txt", "a.txz", "a.TXT")]),
    ):
        for text in candidates:
            perturbed_msgs[index]["content"] = text
            b = render_trajectory(sampled_trajectory(tok, perturbed_msgs), tok)
            if len(b) == len(a):
                break
        else:
            raise AssertionError(f"no same-length perturbation of message {index}")
    changed = (a.input_ids != b.input_ids).nonzero().flatten()
    assert len(changed) > 0
    assert not a.action_mask[changed].any() and not b.action_mask[changed].any()
    for name in ("action_mask", "turn_index", "old_logprobs", "logprob_mask"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for x, y in zip(_targets(a), _targets(b), strict=True):
        assert torch.equal(x, y)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(observation=any_text, user=any_text.filter(bool))
def test_observation_perturbation_any_text_leaves_action_targets(tokenizer, observation, user):
    tok = tokenizer
    msgs = copy.deepcopy(MESSAGES)
    msgs[3]["content"] = observation
    msgs[1]["content"] = user
    a = render_trajectory(sampled_trajectory(tok), tok)
    b = render_trajectory(sampled_trajectory(tok, msgs), tok)
    assert b.report.ok
    for x, y in zip(_targets(a), _targets(b), strict=True):
        assert torch.equal(x, y)
    assert tok.decode(b.input_ids[~b.action_mask]).count(observation) >= 1


def _reference_action_text(message: dict) -> str:
    """The shipped template's assistant turn, rebuilt by hand in Python."""
    content = message.get("content") or ""
    out = content
    for j, call in enumerate(message.get("tool_calls") or []):
        fn = call["function"]
        args = (
            fn["arguments"]
            if isinstance(fn["arguments"], str)
            else json.dumps(fn["arguments"], ensure_ascii=False)
        )
        if j > 0 or content:
            out += "\n"
        out += '<tool_call>\n{"name": "' + fn["name"] + '", "arguments": ' + args + "}\n</tool_call>"
    return out + "<|im_end|>"


def _reference_pieces(msgs: list[dict], tools: list[dict]) -> list[tuple[str, int]]:
    """The shipped template's rendering, rebuilt by hand in Python as (text, assistant turn or -1) pieces."""
    pieces: list[tuple[str, int]] = []
    if tools:
        # The first system message and the tool signatures share the system turn; TOOLS render as below.
        system = msgs[0]["content"] + "\n\n" if msgs[0]["role"] == "system" else ""
        assert tools == TOOLS
        pieces.append(("<|im_start|>system\n" + system + "# Tools\n- exec(command: string)\n"
                       "- read_file(path: string)\n<|im_end|>\n", -1))
        msgs = msgs[1:] if system else msgs
    turn = -1
    for m in msgs:
        pieces.append(("<|im_start|>" + m["role"] + "\n", -1))
        if m["role"] == "assistant":
            turn += 1
            pieces += [(_reference_action_text(m), turn), ("\n", -1)]
        else:
            pieces.append((m["content"] + "<|im_end|>\n", -1))
    return pieces


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=conversations(), with_tools=st.booleans())
def test_masks_match_hand_built_reference_on_random_conversations(tokenizer, msgs, with_tools):
    # Contents, observations and tool arguments hold chat markup as text (a fake <|im_end|> or generation
    # prompt), control characters and U+2028 / U+2029: the masks must still follow the messages, not the markup.
    tok = tokenizer
    actions = [_reference_action_text(m) for m in msgs if m["role"] == "assistant"]
    traj = sampled_trajectory(tok, msgs, actions)
    traj.tools = TOOLS if with_tools else []
    s = render_trajectory(traj, tok)
    assert s.report.ok
    pieces = _reference_pieces(msgs, traj.tools)
    assert template_text(tok, traj) == "".join(text for text, _ in pieces)
    assert tok.decode(s.input_ids) == "".join(text for text, _ in pieces)
    assert torch.equal(s.action_mask, s.turn_index >= 0)
    for k, (i, action) in enumerate(zip(traj.assistant_indices, actions, strict=True)):
        at = (s.turn_index == k).nonzero().flatten()
        assert at.tolist() == list(range(int(at[0]), int(at[0]) + len(at)))  # one contiguous run per turn
        assert tok.decode(s.input_ids[at]) == action
        assert s.old_logprobs[at].tolist() == traj.messages[i].logprobs
    assert tok.decode(s.input_ids[~s.action_mask]) == "".join(text for text, turn in pieces if turn < 0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=conversations())
def test_markup_sampled_as_plain_characters_is_reported_never_mis_masked(tokenizer, msgs):
    # A policy that writes "<|im_end|>" or "<|endoftext|>" inside its content or a tool argument samples them
    # character by character; the template's tokenization of the same text reads them as the special tokens.
    # Rendering must train on what was sampled, at the right positions, and report the turn as a tokenization
    # mismatch.
    tok = tokenizer
    actions = [_reference_action_text(m) for m in msgs if m["role"] == "assistant"]
    traj = sampled_trajectory(tok, msgs, actions)
    for i, action in zip(traj.assistant_indices, actions, strict=True):
        body = action[: -len("<|im_end|>")]
        ids = tok(body, add_special_tokens=False, split_special_tokens=True)["input_ids"] + [tok.eos_token_id]
        traj.messages[i].token_ids = ids
        traj.messages[i].logprobs = [-j / 8 for j in range(len(ids))]
    s = render_trajectory(traj, tok)
    sampled = [traj.messages[i].token_ids for i in traj.assistant_indices]
    expected = [k for k, (ids, a) in enumerate(zip(sampled, actions, strict=True)) if ids != encode(tok, a)]
    assert [m.turn for m in s.report.mismatches] == expected
    assert all(m.kind == "tokenization" for m in s.report.mismatches)
    pieces = _reference_pieces(msgs, traj.tools)
    assert tok.decode(s.input_ids[~s.action_mask]) == "".join(text for text, turn in pieces if turn < 0)
    for k, (i, action) in enumerate(zip(traj.assistant_indices, actions, strict=True)):
        at = (s.turn_index == k).nonzero().flatten()
        assert at.tolist() == list(range(int(at[0]), int(at[0]) + len(at)))
        assert s.input_ids[at].tolist() == traj.messages[i].token_ids
        assert s.old_logprobs[at].tolist() == traj.messages[i].logprobs
        assert tok.decode(s.input_ids[at]) == action
    canonical = render_trajectory(sampled_trajectory(tok, msgs, actions), tok)
    retokenized = render_trajectory(traj, tok, on_mismatch="retokenize")
    for name in ("input_ids", "action_mask", "turn_index"):
        assert torch.equal(getattr(retokenized, name), getattr(canonical, name)), name


def _split_first_multibyte(tok, ids):
    """Replace the first multi-symbol token by its single-symbol tokens: same text, other ids."""
    for j, i in enumerate(ids):
        symbols = tok.convert_ids_to_tokens(i)
        if len(symbols) >= 2 and i != tok.eos_token_id and not symbols.startswith("<"):
            split = [tok.convert_tokens_to_ids(ch) for ch in symbols]
            return j, ids[:j] + split + ids[j + 1 :]
    raise AssertionError("no multi-symbol token")


def test_mismatch_detection_tampered_ids(tokenizer):
    tok = tokenizer
    clean = sampled_trajectory(tok)
    clean_s = render_trajectory(clean, tok)
    traj = copy.deepcopy(clean)
    turn1 = traj.messages[4]
    original = turn1.token_ids[3]
    tampered = encode(tok, "Z")[0]
    assert tampered != original
    turn1.token_ids[3] = tampered  # one wrong id in the middle of turn 1
    s = render_trajectory(traj, tok)
    assert not s.report.ok and len(s.report.mismatches) == 1
    m = s.report.mismatches[0]
    start = int((clean_s.turn_index == 1).nonzero()[0])
    assert (m.turn, m.message_index, m.kind, m.offsets, m.count) == (1, 4, "text", [3], 1)
    assert m.start == start and m.positions == [start + 3]
    assert (m.sampled_len, m.rendered_len) == (len(turn1.token_ids),) * 2
    # use_sampled (default) trains on what was sampled, log-probs still aligned.
    assert int(s.input_ids[start + 3]) == tampered
    assert torch.equal(s.old_logprobs, clean_s.old_logprobs)
    # retokenize: the template's ids; sampled log-probs only on the 3 ids before the first difference.
    r = render_trajectory(traj, tok, on_mismatch="retokenize")
    assert torch.equal(r.input_ids, clean_s.input_ids) and torch.equal(r.action_mask, clean_s.action_mask)
    lp_known_turn1 = r.logprob_mask[r.turn_index == 1]
    assert lp_known_turn1[:3].all() and not lp_known_turn1[3:].any()
    assert (
        r.logprob_mask[r.turn_index != 1].tolist() == clean_s.logprob_mask[clean_s.turn_index != 1].tolist()
    )
    assert render_trajectory(traj, tok, on_mismatch="drop") is None
    with pytest.raises(ValueError, match="1 mismatched turns"):
        render_trajectory(traj, tok, on_mismatch="raise")
    # Per-turn rendering drops only the offending turn.
    assert [x.turn_index.max().item() for x in render_turns(traj, tok, on_mismatch="drop")] == [0, 2]


def test_mismatch_non_canonical_tokenization(tokenizer):
    tok = tokenizer
    traj = sampled_trajectory(tok)
    last = traj.messages[7]
    j, split_ids = _split_first_multibyte(tok, last.token_ids)
    n_extra = len(split_ids) - len(last.token_ids)
    last.token_ids = split_ids
    last.logprobs = [-0.5] * len(split_ids)
    s = render_trajectory(traj, tok)
    (m,) = s.report.mismatches
    assert m.kind == "tokenization" and m.turn == 2 and m.offsets[0] == j
    assert m.sampled_len == m.rendered_len + n_extra
    assert tok.decode(s.input_ids[s.turn_index == 2]) == ACTIONS[2]  # same text, other ids
    assert s.input_ids[s.turn_index == 2].tolist() == split_ids


def test_turn_cut_before_end_of_turn_token(tokenizer):
    tok = tokenizer
    msgs = copy.deepcopy(MESSAGES)
    msgs[7]["content"] = "The file says"
    traj = sampled_trajectory(tok, msgs, [*ACTIONS[:2], "The file says"])  # no <|im_end|>: cut by max_tokens
    s = render_trajectory(traj, tok)
    assert s.report.ok
    assert tok.decode(s.input_ids[s.turn_index == 2]) == "The file says"
    last_action = int((s.turn_index == 2).nonzero()[-1])
    # The template's <|im_end|> follows as context: the policy never sampled it.
    assert int(s.input_ids[last_action + 1]) == tok.eos_token_id and not s.action_mask[last_action + 1]
    assert tok.decode(s.input_ids) == template_text(tok, traj)


def test_sft_turns_without_token_ids(tokenizer):
    tok = tokenizer
    sampled = render_trajectory(sampled_trajectory(tok), tok)
    text_only = render_trajectory(Trajectory(messages=MESSAGES, tools=TOOLS), tok)
    assert text_only.report.ok
    assert torch.equal(text_only.input_ids, sampled.input_ids)
    assert torch.equal(text_only.action_mask, sampled.action_mask)
    assert torch.equal(text_only.turn_index, sampled.turn_index)
    assert not text_only.logprob_mask.any() and not text_only.old_logprobs.any()


def test_trailing_messages_and_no_assistant(tokenizer):
    tok = tokenizer
    msgs = [*copy.deepcopy(MESSAGES), {"role": "user", "content": "Thanks!"}]
    traj = sampled_trajectory(tok, msgs)
    s = render_trajectory(traj, tok)
    assert s.input_ids.tolist() == encode(tok, template_text(tok, traj))
    after = int(s.action_mask.nonzero()[-1]) + 1  # everything after the last action token
    assert tok.decode(s.input_ids[after:]) == "\n<|im_start|>user\nThanks!<|im_end|>\n"
    assert not s.action_mask[after:].any()
    prompt_only = render_trajectory(Trajectory(messages=MESSAGES[:2], tools=TOOLS), tok)
    assert not prompt_only.action_mask.any() and (prompt_only.turn_index == -1).all()
    assert prompt_only.input_ids.tolist() == encode(
        tok, template_text(tok, Trajectory(messages=MESSAGES[:2], tools=TOOLS))
    )
    empty = render_trajectory(Trajectory(), tok)
    assert len(empty) == 0 and empty.report.ok


def test_max_len_truncates(tokenizer):
    tok = tokenizer
    traj = sampled_trajectory(tok)
    full = render_trajectory(traj, tok)
    cut = render_trajectory(traj, tok, max_len=50)
    assert len(cut) == 50 and cut.report.truncated and cut.report.full_length == len(full)
    for name in ("input_ids", "action_mask", "turn_index", "old_logprobs", "logprob_mask"):
        assert torch.equal(getattr(cut, name), getattr(full, name)[:50])
    assert cut.report.cut == (50, len(full))
    assert not render_trajectory(traj, tok, max_len=len(full)).report.truncated


FIELDS = ("input_ids", "action_mask", "turn_index", "old_logprobs", "logprob_mask")


def _system_len(tok, traj):
    """Tokens of the template's rendering of the first (system) message, tool list included."""
    return len(encode(tok, template_text(tok, traj, upto=1)))


def _assert_head_plus_tail(cut, full, head):
    """``cut`` is ``full``'s first ``head`` tokens then its last ``len(cut) - head``, every field bit for bit."""
    tail = len(cut) - head
    for name in FIELDS:
        a, b = getattr(cut, name), getattr(full, name)
        assert torch.equal(a[:head], b[:head]), name
        assert torch.equal(a[head:], b[len(b) - tail :]), name


def test_left_truncation_keeps_system_prompt_and_newest_turns(tokenizer):
    tok = tokenizer
    traj = sampled_trajectory(tok)
    full = render_trajectory(traj, tok)
    n, h = len(full), _system_len(tok, traj)
    last = encode(tok, ACTIONS[2])
    # Budget = system prompt + the last turn's action ids + the template's "\n" after its <|im_end|>: the cut
    # lands exactly on the last turn's start, so the kept tail is that turn and nothing older.
    cut = render_trajectory(traj, tok, max_len=h + len(last) + 1, truncation="left")
    assert len(cut) == h + len(last) + 1
    assert cut.report.truncated and cut.report.full_length == n
    assert cut.report.cut == (h, n - len(last) - 1)
    _assert_head_plus_tail(cut, full, h)
    assert tok.decode(cut.input_ids[:h]) == template_text(tok, traj, upto=1)  # "<|im_start|>system\n...# Tools..."
    assert not cut.action_mask[:h].any()
    assert cut.input_ids[h:-1].tolist() == last and cut.action_mask[h:-1].all()
    assert (cut.turn_index[h:-1] == 2).all()  # turn numbers are those of the whole trajectory, not renumbered
    assert cut.old_logprobs[h:-1].tolist() == traj.messages[7].logprobs
    assert tok.decode(cut.input_ids[-1:]) == "\n" and not cut.action_mask[-1]
    # Three tokens less: the cut falls inside the last turn; its remaining len(last) - 3 tokens stay actions
    # with their own log-probs (token granularity, no whole-turn rounding).
    inside = render_trajectory(traj, tok, max_len=h + len(last) - 2, truncation="left")
    _assert_head_plus_tail(inside, full, h)
    assert int(inside.action_mask.sum()) == len(last) - 3
    assert inside.old_logprobs[inside.action_mask].tolist() == traj.messages[7].logprobs[3:]
    # Nothing to cut: left and right truncation are the untruncated rendering.
    for truncation in ("left", "right"):
        whole = render_trajectory(traj, tok, max_len=n, truncation=truncation)
        assert not whole.report.truncated and whole.report.cut is None
        _assert_head_plus_tail(whole, full, n)


def test_left_truncation_edges(tokenizer):
    tok = tokenizer
    traj = sampled_trajectory(tok)
    full = render_trajectory(traj, tok)
    h = _system_len(tok, traj)
    # Exactly the system prompt fits: that is the sample (no action token, a defined degenerate answer).
    only_system = render_trajectory(traj, tok, max_len=h, truncation="left")
    assert torch.equal(only_system.input_ids, full.input_ids[:h]) and not only_system.action_mask.any()
    with pytest.raises(ValueError, match=rf"max_len={h - 1} is shorter than the system prompt \({h} tokens\)"):
        render_trajectory(traj, tok, max_len=h - 1, truncation="left")
    # No system message: nothing is pinned, left truncation keeps the last max_len tokens.
    no_system = sampled_trajectory(tok, MESSAGES[1:])
    no_system.tools = []
    plain = render_trajectory(no_system, tok)
    tail = render_trajectory(no_system, tok, max_len=7, truncation="left")
    assert tail.report.cut == (0, len(plain) - 7)
    _assert_head_plus_tail(tail, plain, 0)


# Plain concatenation: the system text "You are a help" and the user's "ful" merge into the token "Ġhelpful", so
# the system prompt does not end on a token boundary and cannot be kept exactly.
CONCAT_TEMPLATE = (
    "{%- for m in messages -%}{{- m.content -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def test_left_truncation_refuses_a_system_prompt_split_inside_a_token(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CONCAT_TEMPLATE
    traj = Trajectory(messages=[{"role": "system", "content": "You are a help"}, {"role": "user", "content": "ful"}])
    assert len(render_trajectory(traj, tok)) == 4  # You / Ġare / Ġa / Ġhelpful
    with pytest.raises(ValueError, match="do not begin the rendered sequence"):
        render_trajectory(traj, tok, max_len=3, truncation="left")
    assert len(render_trajectory(traj, tok, max_len=3)) == 3  # right truncation does not need the boundary


def test_render_turns_left_truncation(tokenizer):
    tok = tokenizer
    traj = sampled_trajectory(tok)
    h = _system_len(tok, traj)
    for full, cut in zip(
        render_turns(traj, tok), render_turns(traj, tok, max_len=h + 10, truncation="left"), strict=True
    ):
        assert len(cut) == min(len(full), h + 10)
        _assert_head_plus_tail(cut, full, h if cut.report.truncated else len(cut))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=conversations(), with_tools=st.booleans(), extra=st.integers(0, 200))
def test_left_truncation_keeps_exact_suffix_on_random_conversations(tokenizer, msgs, with_tools, extra):
    # Property: for any budget from the system prompt's length up, the left-truncated rendering is the
    # untruncated one's system prompt followed by its last max_len - h tokens, every field bit for bit.
    tok = tokenizer
    actions = [_reference_action_text(m) for m in msgs if m["role"] == "assistant"]
    traj = sampled_trajectory(tok, msgs, actions)
    traj.tools = TOOLS if with_tools else []
    full = render_trajectory(traj, tok)
    h = _system_len(tok, traj)
    max_len = h + extra
    cut = render_trajectory(traj, tok, max_len=max_len, truncation="left")
    assert len(cut) == min(len(full), max_len)
    assert cut.report.truncated == (len(full) > max_len)
    _assert_head_plus_tail(cut, full, h if cut.report.truncated else len(cut))
    assert torch.equal(cut.logprob_mask, cut.action_mask)  # every sampled turn's log-probs stay known


def test_render_turns_is_prompt_plus_sampled_ids(tokenizer):
    tok = tokenizer
    traj = sampled_trajectory(tok)
    full = render_trajectory(traj, tok)
    turns = render_turns(traj, tok)
    assert len(turns) == 3
    for k, (i, sample) in enumerate(zip(ASSISTANT_AT, turns, strict=True)):
        prompt_ids = encode(tok, template_text(tok, traj, upto=i, gen=True))
        n = len(prompt_ids)
        assert sample.input_ids[:n].tolist() == prompt_ids and not sample.action_mask[:n].any()
        assert sample.input_ids[n:].tolist() == traj.messages[i].token_ids and sample.action_mask[n:].all()
        assert (sample.turn_index[n:] == k).all()
        assert sample.old_logprobs[n:].tolist() == traj.messages[i].logprobs
        # With a prefix-consistent template and canonical ids, each is a prefix of the whole rendering.
        assert torch.equal(sample.input_ids, full.input_ids[: len(sample)])


# A template that, like reasoning templates that drop earlier thoughts, hides all but the last assistant turn.
HIDING_TEMPLATE = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' -}}"
    "{%- if m.role == 'assistant' and not loop.last -%}{{- '[hidden]' -}}{%- else -%}{{- m.content -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def test_prefix_break_detected_and_render_turns_exact(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = HIDING_TEMPLATE
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "one"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "two"},
    ]
    traj = sampled_trajectory(tok, msgs, ["one<|im_end|>", "two<|im_end|>"])
    s = render_trajectory(traj, tok)
    # Rendering messages[:3] hides "one", so it no longer extends messages[:2]'s rendering: break at message 3.
    assert s.report.prefix_breaks == [3] and not s.report.ok
    assert render_trajectory(traj, tok, on_mismatch="drop") is None
    with pytest.raises(ValueError, match=r"prefix breaks at messages \[3\]"):
        render_trajectory(traj, tok, on_mismatch="raise")
    turns = render_turns(traj, tok)
    assert all(t.report.ok for t in turns)
    assert (
        tok.decode(turns[1].input_ids)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n[hidden]<|im_end|>\n"
        "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\ntwo<|im_end|>"
    )
    assert tok.decode(turns[1].input_ids[turns[1].action_mask]) == "two<|im_end|>"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(max_len=0), "max_len"),
        (dict(max_len=True), "max_len"),
        (dict(on_mismatch="ignore"), "on_mismatch must be one of"),
        (dict(truncation="middle"), "truncation must be one of"),
        (dict(eot_token="<tool_call>x"), "single token"),
    ],
)
def test_render_validation(tokenizer, kwargs, match):
    with pytest.raises(ValueError, match=match):
        render_trajectory(Trajectory(messages=MESSAGES), tokenizer, **kwargs)


def test_render_rejects_bad_inputs(tokenizer):
    with pytest.raises(ValueError, match="traj must be a Trajectory"):
        render_trajectory(MESSAGES, tokenizer)
    with pytest.raises(ValueError, match="chat_template"):
        render_trajectory(Trajectory(), object())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=conversations(), with_tools=st.booleans())
def test_windowed_segments_equal_exact_segments(tokenizer, msgs, with_tools):
    # The linear-time path (windows from the previous assistant turn) against the quadratic reference that
    # renders every prefix.
    traj = Trajectory(messages=msgs, tools=TOOLS if with_tools else [])
    messages, report = traj.openai_messages(), RenderReport()
    exact = _segments_exact(tokenizer, messages, traj.tools, "<|im_end|>", report)
    assert report.ok
    assert _segments_windowed(tokenizer, messages, traj.tools, "<|im_end|>") == exact


# Prefix-consistent but not local: every turn is numbered, so windows (which restart the count) disagree with
# the full rendering and rendering must fall back to the exact path.
NUMBERED_TEMPLATE = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + ' ' + loop.index|string + '\\n' -}}"
    "{{- m.content -}}{{- '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant ' + (messages|length + 1)|string + '\\n' -}}"
    "{%- endif -%}"
)


def test_non_local_template_falls_back_to_exact(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = NUMBERED_TEMPLATE
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "one"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "bye"},
    ]
    traj = Trajectory(messages=msgs)
    messages = traj.openai_messages()
    assert _segments_windowed(tok, messages, [], "<|im_end|>") is None
    s = render_trajectory(traj, tok)
    assert s.report.ok
    assert s.input_ids.tolist() == encode(tok, template_text(tok, traj))
    assert [tok.decode(s.input_ids[s.turn_index == k]) for k in (0, 1)] == ["one<|im_end|>", "two<|im_end|>"]


def test_assistant_first_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="must not start with an assistant message"):
        render_trajectory(Trajectory(messages=[{"role": "assistant", "content": "hi"}]), tokenizer)
