"""What SoftwareGym's two GUI judges see of a run, and the grading prompts that show it.

SoftwareGym judges a browser run in two stages (keep iff both scores >= 0.8):

- the **outcome judge** sees the final 5 assistant messages, each with its paired post-action screenshot
  (`outcome_evidence`);
- the **process judge** sees every message, with at most 10 screenshots evenly sampled over the run
  (`process_evidence`; the others are replaced by a placeholder, their text kept).

A *screenshot* is an ``image_url`` content part of a user or tool message, counted in message order. The
post-action screenshot of an assistant message is the last screenshot of the messages that answer it (the
messages after it, up to the next assistant message); the final ``done`` is answered by nothing, so it pairs with
none (the page it ended on is the previous action's screenshot). Both selections are pure functions of the
messages.

The prompts (`outcome_judge_messages`, `process_judge_messages`) are ours: the papers give the judges' inputs
and the 0.8 bar, not their wording. Each is a system message with the rubric and one user message whose content
parts are the task, the steps (action, the observation's text, the chosen screenshots as data URLs, each after a
``Screenshot after step k:`` label) and, when known, a reference block with the task's checker data, the site
state the run ended in, which the agent never saw, and which of the task's evidence no page the site served showed
(`judge_reference`). A judge answers with one JSON object ``{"score": s, "reason": "..."}``, ``s`` in [0, 1]
(`parse_judge_score`).

What the agent wrote cannot pass for the prompt's own parts: its final answer and the text of a turn without a
tool call are JSON strings on one line, and every further line of an action or an observation is indented, so a
line that starts at the margin (a section, a step, a label) is always ours. What the site served is told apart
by provenance, not by reading text (`browser_observations`, `site_text`): the browser's answers to well-formed
actions, without form fields and without text the site marks as repeating what the visitor entered.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from orchard.data import Message, Trajectory
from orchard.data.curation import check_tool_calls
from orchard.domains.gui.tasks import _NUMBER, GUITask
from orchard.domains.gui.tools import GUI_TOOLS, TEXT_VIEW_HEADER
from orchard.rewards import find_json

__all__ = [
    "OUTCOME_LAST_TURNS",
    "OUTCOME_SYSTEM",
    "PROCESS_MAX_SCREENSHOTS",
    "PROCESS_SYSTEM",
    "browser_observations",
    "evenly_spaced",
    "flatten_images",
    "judge_reference",
    "outcome_evidence",
    "outcome_judge_messages",
    "parse_judge_score",
    "post_action_screenshots",
    "process_evidence",
    "process_judge_messages",
    "screenshot_positions",
    "site_text",
    "unseen_evidence",
]

OUTCOME_LAST_TURNS = 5
"""The outcome judge sees the final 5 assistant messages (SoftwareGym)."""
PROCESS_MAX_SCREENSHOTS = 10
"""The process judge sees at most 10 evenly sampled screenshots (SoftwareGym)."""

OUTCOME_SYSTEM = (
    "# Outcome judge\n"
    "You judge whether a browser agent completed its task. You see the task, the agent's last steps (each action, "
    "the page text after it and, where given, the screenshot after it), its final answer and, when given, a "
    "reference with what the task's checker accepts and the site state the run ended in (the agent never saw it). "
    "Score 1 when the final page state and answer complete the task exactly as asked, 0 when they do not; use a "
    "value in between only when the evidence is inconclusive. Reply with one JSON object: "
    '{"score": <number in [0, 1]>, "reason": "<one sentence>"}.'
)
PROCESS_SYSTEM = (
    "# Process judge\n"
    "You judge how a browser agent worked, not only where it ended. You see the task, every step (action and page "
    "text) and a sample of the screenshots. Score 1 for a run whose every action follows from what the page "
    "showed, whose answer is read from a page it visited, and which wastes no step (invalid actions, detours to "
    "unrelated pages, repeating an action that changed nothing); lower the score for each lapse and score at most "
    "0.5 for an answer that no page it visited supports (what the agent typed into a page is not the site's text; "
    "the reference's evidence_unseen, when given, lists what no page the site served showed). Reply with one JSON "
    "object: "
    '{"score": <number in [0, 1]>, "reason": "<one sentence>"}.'
)
OUTCOME_END = "Score the outcome as JSON."
PROCESS_END = "Score the process as JSON."
REFERENCE_HEADER = "## Reference (the task's checker and the final site state; not seen by the agent)"
FINAL_HEADER = "## Final answer"
FIRST_PAGE = "### The first page"
NOT_SHOWN = "[screenshot not shown]"
IMAGE_TEXT = "[image]"
INDENT = "  "
"""Every line of an action or an observation after its label's own line starts with this (`_indented`)."""
NO_DONE = "(the run ended without done: "
"""How the final answer reads when the run never called done (the termination reason follows, then ")")."""
FORM_ROLES = frozenset({"textbox", "searchbox", "combobox", "listbox", "option", "checkbox", "radio", "switch",
                        "slider", "spinbutton"})
"""Text-view roles of form fields: their names show what was typed or picked in them, not what the site wrote."""

# one text-view element as the browser host writes it: [role] "JSON name" flags @(x,y)
_ELEMENT_LINE = re.compile(r'^\[([\w-]+)\] ("(?:[^"\\]|\\.)*")((?: [a-z]+)*) @\(-?\d+,-?\d+\)$')

Position = tuple[int, int]
"""A screenshot: (message index, content-part index)."""


def _messages(trajectory: Trajectory | Sequence[Message]) -> list[Message]:
    if isinstance(trajectory, Trajectory):
        return trajectory.messages
    if isinstance(trajectory, (str, bytes)) or not isinstance(trajectory, Sequence) \
            or not all(isinstance(m, Message) for m in trajectory):
        raise ValueError(f"trajectory must be a Trajectory or a list of Message, got {type(trajectory).__name__}")
    return list(trajectory)


def _is_image(part: object) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "image_url"


def screenshot_positions(trajectory: Trajectory | Sequence[Message]) -> list[Position]:
    """Every screenshot of the run (an ``image_url`` part of a non-assistant message), in order."""
    return [(m, p) for m, message in enumerate(_messages(trajectory))
            if message.role != "assistant" and isinstance(message.content, list)
            for p, part in enumerate(message.content) if _is_image(part)]


def post_action_screenshots(trajectory: Trajectory | Sequence[Message]) -> list[tuple[int, Position | None]]:
    """``(assistant message index, its post-action screenshot or None)`` for every assistant message, in order.

    The post-action screenshot is the last screenshot among the messages after the assistant message and before
    the next one (several tool answers to one turn: the last shows the page the turn left)."""
    messages = _messages(trajectory)
    shots = screenshot_positions(messages)
    turns = [i for i, m in enumerate(messages) if m.role == "assistant"]
    out = []
    for k, i in enumerate(turns):
        stop = turns[k + 1] if k + 1 < len(turns) else len(messages)
        after = [s for s in shots if i < s[0] < stop]
        out.append((i, after[-1] if after else None))
    return out


def outcome_evidence(trajectory: Trajectory | Sequence[Message], *,
                     last_turns: int = OUTCOME_LAST_TURNS) -> list[tuple[int, Position | None]]:
    """What the outcome judge sees: the final ``last_turns`` (5, SoftwareGym's) assistant messages with their
    post-action screenshots (`post_action_screenshots`); fewer when the run had fewer turns."""
    if isinstance(last_turns, bool) or not isinstance(last_turns, int) or last_turns < 1:
        raise ValueError(f"last_turns must be an int >= 1, got {last_turns!r}")
    return post_action_screenshots(trajectory)[-last_turns:]


def evenly_spaced(n: int, k: int) -> list[int]:
    """``min(n, k)`` indices of ``range(n)`` spread evenly, first and last included: ``round(i (n-1) / (k-1))``
    for ``i < k`` (halves rounded up), e.g. n=23, k=10 -> 0 2 5 7 10 12 15 17 20 22. ``k = 1`` gives the last."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if n <= k:
        return list(range(n))
    if k == 1:
        return [n - 1]
    # integer rounding: floor(i (n-1) / (k-1) + 1/2); the steps are >= 1 apart, so the indices are distinct
    return [(2 * i * (n - 1) + (k - 1)) // (2 * (k - 1)) for i in range(k)]


def process_evidence(trajectory: Trajectory | Sequence[Message], *,
                     max_screenshots: int = PROCESS_MAX_SCREENSHOTS) -> list[Position]:
    """The screenshots the process judge sees: at most ``max_screenshots`` (10, SoftwareGym's) of the run's,
    evenly spaced (`evenly_spaced`); it sees every message's text."""
    if isinstance(max_screenshots, bool) or not isinstance(max_screenshots, int) or max_screenshots < 1:
        raise ValueError(f"max_screenshots must be an int >= 1, got {max_screenshots!r}")
    shots = screenshot_positions(trajectory)
    return [shots[i] for i in evenly_spaced(len(shots), max_screenshots)]


def parse_judge_score(text: str) -> tuple[float | None, str]:
    """A judge's answer ``{"score": s, "reason": ...}`` read: ``(s, reason)``, or ``(None, why)`` when no JSON
    object in the text has a number ``score`` in [0, 1] (the first that has one wins)."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    for obj in find_json(text):
        if not isinstance(obj, dict):
            continue
        score = obj.get("score")
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not 0 <= score <= 1:
            continue
        return float(score), str(obj.get("reason", ""))
    return None, f"no JSON object with a score in [0, 1] in the answer: {text[:200]!r}"


def browser_observations(trajectory: Trajectory | Sequence[Message]) -> list[str]:
    """The text of every observation the browser produced in the run, told by provenance: the user messages
    before the first assistant turn (the harness's start: the intent and the first page) and each tool message
    that answers a call of a well-formed turn (one or more calls of `GUI_TOOLS` whose arguments fit their
    schemas: the only turns the harness hands to the browser), ``done`` excepted. The assistant's own messages
    are never observations, nor is what answers a malformed turn (the loop's error may repeat the agent's text).
    """
    messages = _messages(trajectory)
    bad = {issue.message_index for issue in check_tool_calls(Trajectory(messages, GUI_TOOLS), GUI_TOOLS)}
    turns = [i for i, m in enumerate(messages) if m.role == "assistant"]
    out = [_text(m.content) for m in messages[:turns[0] if turns else len(messages)] if m.role == "user"]
    for k, i in enumerate(turns):
        calls = messages[i].tool_calls
        if not calls or i in bad:
            continue
        acted = {c.id for c in calls if c.name != "done"}
        stop = turns[k + 1] if k + 1 < len(turns) else len(messages)
        out += [_text(m.content) for m in messages[i + 1:stop] if m.role == "tool" and m.tool_call_id in acted]
    return out


def site_text(trajectory: Trajectory | Sequence[Message]) -> list[str] | None:
    """The text the site served in the run: the names of the text-view elements of `browser_observations`,
    without form fields (`FORM_ROLES`: their names show what was typed or picked in them) and without elements
    flagged ``entered`` (text the site marks as repeating what the visitor entered, `orchard.domains.gui.sites`).
    None when no observation holds a text view (a screenshot-only run: its text is in the pixels)."""
    names: list[str] = []
    viewed = False
    for text in browser_observations(trajectory):
        lines = text.split("\n")  # not splitlines: a name may hold a line separator JSON leaves as it is
        if TEXT_VIEW_HEADER not in lines:
            continue
        viewed = True
        for line in lines[lines.index(TEXT_VIEW_HEADER) + 1:]:
            m = _ELEMENT_LINE.match(line)
            if m is not None and m.group(1) not in FORM_ROLES and "entered" not in m.group(3).split():
                names.append(json.loads(m.group(2)))
    return names if viewed else None


def _evidence(task: GUITask) -> tuple[str, ...]:
    if task.evidence:
        return task.evidence
    return (task.answer,) if task.answer is not None and not task.choices else ()


def unseen_evidence(task: GUITask, trajectory: Trajectory | Sequence[Message]) -> list[str] | None:
    """The numbers of the task's evidence (`GUITask.evidence`) that no text the site served in the run shows
    (`site_text`; a page's ``1,337,000`` and ``$1337`` show ``1337000`` and ``1337``), in the evidence's order;
    None when the run has no text view."""
    if not isinstance(task, GUITask):
        raise ValueError(f"task must be a GUITask, got {type(task).__name__}")
    served = site_text(trajectory)
    if served is None:
        return None
    shown = {n.replace(",", "").removesuffix(".0") for name in served for n in _NUMBER.findall(name)}
    return [n for n in _evidence(task) if n not in shown]


def judge_reference(task: GUITask, state: Mapping[str, Any] | None,
                    trajectory: Trajectory | None = None) -> dict[str, Any]:
    """The reference block's data: the checker's fields of ``task``, the final site ``state``, the task's
    ``evidence`` (the numbers a page must have shown for the answer to be read from it) and ``evidence_unseen``
    (`unseen_evidence` of ``trajectory``; None when no trajectory is given or the run has no text view)."""
    if not isinstance(task, GUITask):
        raise ValueError(f"task must be a GUITask, got {type(task).__name__}")
    if state is not None and not isinstance(state, Mapping):
        raise ValueError(f"state must be a site_state() dict or None, got {type(state).__name__}")
    if trajectory is not None and not isinstance(trajectory, Trajectory):
        raise ValueError(f"trajectory must be a Trajectory or None, got {type(trajectory).__name__}")
    return {"task_id": task.id, "template": task.template, "answer": task.answer, "choices": list(task.choices),
            "expected_state": task.expected_state, "final_state": None if state is None else dict(state),
            "evidence": list(_evidence(task)),
            "evidence_unseen": None if trajectory is None else unseen_evidence(task, trajectory)}


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("type") == "text")


def _action(message: Message) -> str:
    if not message.tool_calls:
        return f"(no tool call) {json.dumps(message.text)}"
    return "; ".join(f"{c.name} {c.arguments_json()}" for c in message.tool_calls)


def _indented(text: str) -> str:
    """Each line after the first indented by `INDENT` (the first follows a label of ours on its line)."""
    return text.replace("\n", "\n" + INDENT)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}\n[... {len(text) - limit} characters cut]"


def _final_answer(messages: list[Message], termination: str) -> str:
    last = next((m for m in reversed(messages) if m.role == "assistant"), None)
    call = next((c for c in last.tool_calls if c.name == "done"), None) if last is not None else None
    if call is not None:
        response = call.arguments_dict().get("response")
        return json.dumps(response if isinstance(response, str) else json.dumps(response))
    return f"{NO_DONE}{termination})"


def _intent(messages: list[Message], intent: str | None) -> str:
    if intent is not None:
        return intent
    first = next((m for m in messages if m.role == "user"), None)
    if first is None:
        return ""
    # the teacher's and the agent's first user message: the intent, then the first page (a paragraph or a part)
    head = next((p for p in first.content if isinstance(p, Mapping) and p.get("type") == "text"), {}) \
        if isinstance(first.content, list) else {"text": first.content or ""}
    return str(head.get("text", "")).split("\n\n")[0]


class _Parts:
    def __init__(self) -> None:
        self.parts: list[dict[str, Any]] = []

    def text(self, text: str) -> None:
        if self.parts and self.parts[-1]["type"] == "text":
            self.parts[-1]["text"] += "\n" + text
        else:
            self.parts.append({"type": "text", "text": text})

    def image(self, part: dict[str, Any], label: str) -> None:
        self.text(label)
        self.parts.append(dict(part))


def _steps(parts: _Parts, messages: list[Message], turns: list[int], shown: set[Position], *,
           max_observation_chars: int) -> None:
    """One ``### Step k`` block per assistant message in ``turns``: its action, then what answered it."""
    all_turns = [i for i, m in enumerate(messages) if m.role == "assistant"]
    for i in turns:
        k = all_turns.index(i)
        stop = all_turns[k + 1] if k + 1 < len(all_turns) else len(messages)
        parts.text(f"### Step {k + 1}\nAction: {_indented(_action(messages[i]))}")
        for m in range(i + 1, stop):
            message = messages[m]
            parts.text(f"Observation:\n{INDENT}{_indented(_clip(_text(message.content), max_observation_chars))}")
            if isinstance(message.content, list):
                for p, part in enumerate(message.content):
                    if _is_image(part):
                        if (m, p) in shown:
                            parts.image(part, f"Screenshot after step {k + 1}:")
                        else:
                            parts.text(NOT_SHOWN)


def _close(parts: _Parts, messages: list[Message], termination: str, reference: Mapping[str, Any] | None,
           end: str) -> None:
    parts.text(f"{FINAL_HEADER}\n{_final_answer(messages, termination)}")
    if reference is not None:
        parts.text(f"{REFERENCE_HEADER}\n```json\n{json.dumps(dict(reference), sort_keys=True)}\n```")
    parts.text(end)


def _check(trajectory: object, intent: object, reference: object, max_observation_chars: object) -> None:
    if not isinstance(trajectory, Trajectory):
        raise ValueError(f"trajectory must be a Trajectory, got {type(trajectory).__name__}")
    if intent is not None and not isinstance(intent, str):
        raise ValueError(f"intent must be a str or None, got {type(intent).__name__}")
    if reference is not None and not isinstance(reference, Mapping):
        raise ValueError(f"reference must be a mapping (judge_reference) or None, got {type(reference).__name__}")
    if isinstance(max_observation_chars, bool) or not isinstance(max_observation_chars, int) \
            or max_observation_chars < 1:
        raise ValueError(f"max_observation_chars must be an int >= 1, got {max_observation_chars!r}")


def outcome_judge_messages(trajectory: Trajectory, *, intent: str | None = None,
                           reference: Mapping[str, Any] | None = None, last_turns: int = OUTCOME_LAST_TURNS,
                           max_observation_chars: int = 4000) -> list[dict[str, Any]]:
    """The outcome judge's chat messages: the task, the final ``last_turns`` steps with their post-action
    screenshots (`outcome_evidence`), the final answer and the optional reference (`judge_reference`).

    Args:
        trajectory: the run.
        intent: the task's intent; default the first paragraph of the first user message.
        reference: the checker's data and the final site state (`judge_reference`), or None.
        last_turns: how many final assistant messages the judge sees; default 5 (SoftwareGym).
        max_observation_chars: the longest observation text shown whole.
    """
    _check(trajectory, intent, reference, max_observation_chars)
    evidence = outcome_evidence(trajectory, last_turns=last_turns)
    messages = trajectory.messages
    parts = _Parts()
    parts.text(f"## Task\n{_intent(messages, intent)}\n\n## The last {len(evidence)} of "
               f"{trajectory.num_steps} steps")
    _steps(parts, messages, [i for i, _ in evidence], {s for _, s in evidence if s is not None},
           max_observation_chars=max_observation_chars)
    _close(parts, messages, trajectory.termination_reason, reference, OUTCOME_END)
    return [{"role": "system", "content": OUTCOME_SYSTEM}, {"role": "user", "content": parts.parts}]


def process_judge_messages(trajectory: Trajectory, *, intent: str | None = None,
                           reference: Mapping[str, Any] | None = None,
                           max_screenshots: int = PROCESS_MAX_SCREENSHOTS,
                           max_observation_chars: int = 4000) -> list[dict[str, Any]]:
    """The process judge's chat messages: the task, the first page, every step with its observation's text, the
    screenshots of `process_evidence` (the others as ``[screenshot not shown]``), the final answer and the
    optional reference. Arguments as `outcome_judge_messages`; ``max_screenshots`` default 10 (SoftwareGym)."""
    _check(trajectory, intent, reference, max_observation_chars)
    shown = set(process_evidence(trajectory, max_screenshots=max_screenshots))
    messages = trajectory.messages
    parts = _Parts()
    parts.text(f"## Task\n{_intent(messages, intent)}\n\n## The run ({trajectory.num_steps} steps)")
    first = next((i for i, m in enumerate(messages) if m.role == "assistant"), len(messages))
    for m in range(first):
        message = messages[m]
        if message.role == "user":
            parts.text(f"{FIRST_PAGE}\n{INDENT}{_indented(_clip(_text(message.content), max_observation_chars))}")
            for p, part in enumerate(message.content if isinstance(message.content, list) else []):
                if _is_image(part) and (m, p) in shown:
                    parts.image(part, "Screenshot before step 1:")
                elif _is_image(part):
                    parts.text(NOT_SHOWN)
    _steps(parts, messages, [i for i, m in enumerate(messages) if m.role == "assistant"], shown,
           max_observation_chars=max_observation_chars)
    _close(parts, messages, trajectory.termination_reason, reference, PROCESS_END)
    return [{"role": "system", "content": PROCESS_SYSTEM}, {"role": "user", "content": parts.parts}]


def flatten_images(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages with string content: text parts joined by newlines, each image as ``[image]``; for a
    text-only judge (an engine rendered through a text chat template, a text model's server)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "\n".join(IMAGE_TEXT if _is_image(p) else str(p.get("text", "")) for p in content)
        out.append({**message, "content": content})
    return out
