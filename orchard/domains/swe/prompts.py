"""The two teacher prompts of the SWE domain, as OpenAI chat message builders, with their parsers.

- **Value estimation** (:func:`value_estimation_messages`, :func:`parse_value_estimation`): a teacher that knows
  whether the trajectory resolved the issue values its key decision steps; the parser returns
  ``{state index: value}`` for :func:`orchard.losses.interpolate_step_values`, which fills in the other states.
- **Process-reward grading** (:func:`process_reward_messages`, parsed by
  :func:`orchard.rewards.parse_rubric_judgement`): an evidence-based judge scores the seven rubric dimensions
  R1-R7 of :data:`orchard.rewards.RPR_WEIGHTS` on 0..10, the reward is :func:`orchard.rewards.rubric_reward`.

The wording is ours; the rules are the paper's: the value teacher may not answer a monotone rise (where the
trajectory went wrong, its values rise, then fall at that step), and the grader counts submitting without
verification as a fault. Our reading: the no-monotone-rise rule is stated for every trajectory, resolved ones
included (a resolved trajectory's detour dips too), since a failed one, which starts at 0.3-0.5 and ends below 0.2,
could never rise monotonically anyway. Transcripts number the agent's decision steps (its assistant
turns) from 1; state ``k`` is the state after step ``k`` and state 0 the start, so an ``N``-step trajectory has
states ``0..N`` as ``interpolate_step_values(values, N)`` expects. Long observations keep their head and tail
(:func:`orchard.rewards.compress_observation`); a long output of a file view or a directory listing is replaced
by a size marker, since its middle says nothing about the process that the command itself does not (our reading
of the paper's "large dumps are elided": a dump is recognised by the command or tool that produced it).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchard.data import Trajectory
from orchard.rewards import RPR_WEIGHTS, compress_observation, find_json, parse_rubric_judgement

__all__ = [
    "RUBRIC_DIMENSIONS",
    "ValueEstimation",
    "parse_rubric_judgement",
    "parse_value_estimation",
    "process_reward_messages",
    "render_transcript",
    "value_estimation_messages",
]

RUBRIC_DIMENSIONS: tuple[tuple[str, str, str], ...] = (
    ("R1", "Fix Quality", "the change addresses the root cause of the issue, minimally and without side effects"),
    ("R2", "Self-test Relevance", "the agent's own checks exercise the behaviour the issue is about"),
    ("R3", "Coverage", "those checks cover the cases the issue implies, edge cases included"),
    ("R4", "Rigor", "the agent reproduces the problem before fixing it and confirms the fix after"),
    ("R5", "Discriminativeness", "the checks would fail on the unfixed code and pass on the fixed code"),
    ("R6", "Regression guard", "the agent runs existing tests near the change to show nothing else broke"),
    ("R7", "Verification integrity", "claims of success match what the outputs show; no test is weakened, "
     "skipped or edited to pass"),
)
"""``(id, name, what a high score means)`` of the seven dimensions, in :data:`RPR_WEIGHTS` order (R1 is
``fix_quality`` ... R7 ``verification_integrity``)."""

_DUMP_COMMAND = re.compile(r"^\s*(?:sudo\s+)?(?:cat|ls|find|tree|nl|less|more|head|tail|du)\b")
_DUMP_TOOLS = frozenset({"view", "read_file", "open_file", "list_dir", "list_directory", "ls", "cat", "find_file"})


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return str(content)


def _messages(trajectory: Trajectory | Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    if isinstance(trajectory, Trajectory):
        return trajectory.openai_messages()
    if isinstance(trajectory, (str, bytes)) or not isinstance(trajectory, Sequence):
        raise ValueError(f"trajectory must be a Trajectory or a list of chat messages, got {type(trajectory).__name__}")
    for i, m in enumerate(trajectory):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"trajectory[{i}] must be a chat message with a 'role', got {m!r}")
    return list(trajectory)


def _is_dump(call: Mapping[str, Any] | None) -> bool:
    """Whether a tool call views a file or lists a directory (by its tool name, or its shell command)."""
    if not call:
        return False
    fn = call.get("function", call)
    name = str(fn.get("name", "")).lower()
    raw = fn.get("arguments", "")
    try:
        args = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        args = raw
    if name in _DUMP_TOOLS:
        return True
    if isinstance(args, Mapping):
        if str(args.get("command", "")).lower() in ("view", "list"):
            return True
        command = args.get("command", args.get("cmd", ""))
        return isinstance(command, str) and bool(_DUMP_COMMAND.match(command))
    return isinstance(args, str) and bool(_DUMP_COMMAND.match(args))


def _observation(text: str, call: Mapping[str, Any] | None, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    if _is_dump(call):
        return f"[file or directory dump of {text.count(chr(10)) + 1} lines, {len(text)} chars omitted]"
    return compress_observation(text, max_chars=max_chars)


def render_transcript(
    trajectory: Trajectory | Sequence[Mapping[str, Any]], *, max_observation_chars: int = 4000
) -> tuple[str, int]:
    """The trajectory as text with numbered decision steps, and the number of steps ``N``.

    Each assistant turn is ``### Step k`` (its text and tool calls); each observation follows its step, kept whole
    when it fits in ``max_observation_chars``, else head and tail, or a size marker for a file / directory dump.
    System and user messages before the first step are the task; later user messages are shown as feedback.
    """
    if isinstance(max_observation_chars, bool) or not isinstance(max_observation_chars, int):
        raise ValueError(f"max_observation_chars must be an int, got {max_observation_chars!r}")
    if max_observation_chars < 80:
        raise ValueError(f"max_observation_chars must be >= 80, got {max_observation_chars}")
    parts: list[str] = []
    step = 0
    calls: dict[str, Mapping[str, Any]] = {}
    last_call: Mapping[str, Any] | None = None
    for m in _messages(trajectory):
        role, text = m["role"], _text(m.get("content"))
        if role == "assistant":
            step += 1
            lines = [f"### Step {step}", text] if text else [f"### Step {step}"]
            last_call = None
            for call in m.get("tool_calls") or []:
                fn = call.get("function", call)
                lines.append(f"call {fn.get('name', '?')}: {fn.get('arguments', '')}")
                calls[str(call.get("id", ""))] = call
                last_call = call
            parts.append("\n".join(lines))
        elif role == "tool":
            call = calls.get(str(m.get("tool_call_id", "")), last_call)
            parts.append("Observation:\n" + _observation(text, call, max_observation_chars))
        elif step == 0:
            parts.append(f"## {'System' if role == 'system' else 'Task'}\n{text}")
        else:
            parts.append("Feedback:\n" + _observation(text, None, max_observation_chars))
    return "\n\n".join(parts), step


_VALUE_SYSTEM = """You estimate the value of states in a software-engineering agent's trajectory: the chance,
from that state on, that the agent ends with a fix that resolves the issue. You are told how the trajectory
actually ended; use that knowledge to judge which steps moved the agent towards or away from its outcome.

Rules:
- State 0 is the start, before any step; state k is the state right after step k.
- Give values only at key states: the start, the end, and the states right after steps that changed the
  agent's prospects (found the cause, reproduced the bug, wrote the fix, broke something, gave up on a good
  lead). The states in between are interpolated linearly; do not list every step.
- Values are numbers in [0, 1]. The start is usually between 0.3 and 0.5: the task is open.
- If the trajectory failed, the final state is below 0.2. If it succeeded, the final state is high.
- Do not give monotonically increasing values. Where the trajectory went wrong (a wrong lead followed, a passing
  test broken, a fix left unverified), the value rises while the agent makes progress and then falls at the step
  that went wrong: give that step a lower value than the state before it.

Answer with JSON only: {"values": [{"state": 0, "value": 0.4, "why": "..."}, ...]}."""


def value_estimation_messages(
    trajectory: Trajectory | Sequence[Mapping[str, Any]],
    *,
    resolved: bool,
    max_observation_chars: int = 4000,
) -> list[dict[str, str]]:
    """The value-estimation prompt: system rules, then the transcript and its known outcome.

    Args:
        trajectory: the agent's trajectory (a ``Trajectory`` or OpenAI chat messages).
        resolved: whether the trajectory resolved the issue (the verified outcome the teacher is told).
        max_observation_chars: the longest observation shown whole (see :func:`render_transcript`).

    Returns:
        ``[{"role": "system", ...}, {"role": "user", ...}]``; parse the answer with
        :func:`parse_value_estimation` and ``num_steps`` = the trajectory's number of assistant turns.
    """
    if not isinstance(resolved, bool):
        raise ValueError(f"resolved must be a bool, got {resolved!r}")
    transcript, n = render_transcript(trajectory, max_observation_chars=max_observation_chars)
    outcome = "RESOLVED the issue (its fix passed the hidden tests)" if resolved else (
        "did NOT resolve the issue (its fix failed the hidden tests, or it made none)")
    user = (f"The trajectory below has {n} steps (states 0 to {n}). It {outcome}.\n\n{transcript}\n\n"
            f"Give the values of the key states (0 to {n}) as JSON.")
    return [{"role": "system", "content": _VALUE_SYSTEM}, {"role": "user", "content": user}]


@dataclass(frozen=True)
class ValueEstimation:
    """What :func:`parse_value_estimation` made of a teacher's answer.

    ``values`` is ``{state index: value}`` ready for ``interpolate_step_values(values, num_steps)``, or None with
    an ``error`` when the answer could not be read; such a trajectory gets no teacher values (it is not 0).
    """

    values: dict[int, float] | None
    error: str | None = None

    @property
    def parseable(self) -> bool:
        return self.values is not None


_STATE_KEYS = ("state", "step", "index", "s")
_STATE_LINE = re.compile(r"^[\s>*#\-]*(?:state|step|s)?\s*(\d+)[\s*)]*[:=]\s*[\s*]*([-+]?(?:\d+(?:\.\d*)?|\.\d+))",
                         re.IGNORECASE)


def _state_index(key: object) -> int | None:
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key
    if isinstance(key, str):
        m = re.fullmatch(r"\s*(?:state|step|s)?[\s_]*(\d+)\s*", key, re.IGNORECASE)
        return int(m.group(1)) if m else None
    return None


def _value(raw: object) -> float | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, (int, float)):
        return float(raw)
    if isinstance(raw, str):
        try:
            return float(raw)
        except ValueError:
            return None
    return None


def _pairs(obj: object) -> list[tuple[object, object]] | None:
    """``(state, value)`` pairs of parsed JSON: ``{"values": ...}`` around a mapping ``{state: value}``, a list of
    ``{"state": k, "value": v}`` records or a list of ``[k, v]`` pairs."""
    if isinstance(obj, Mapping) and "values" in obj:
        obj = obj["values"]
    if isinstance(obj, Mapping):
        pairs = list(obj.items())
        return pairs if pairs and all(_state_index(k) is not None for k, _ in pairs) else None
    if isinstance(obj, list) and obj:
        out: list[tuple[object, object]] = []
        for rec in obj:
            if isinstance(rec, Mapping):
                key = next((rec[k] for k in _STATE_KEYS if k in rec), None)
                out.append((key, rec.get("value", rec.get("v"))))
            elif isinstance(rec, list) and len(rec) == 2:
                out.append((rec[0], rec[1]))
            else:
                return None
        return out
    return None


def parse_value_estimation(text: str, *, num_steps: int) -> ValueEstimation:
    """Read ``{state index: value}`` from the value teacher's answer; never raises on malformed answers.

    Accepted: JSON (bare, fenced or embedded) as ``{"values": [{"state": k, "value": v}, ...]}`` (``"step"``
    for ``"state"`` too), ``{"values": {"k": v}}``, ``{"k": v}``, or ``[[k, v], ...]``; failing JSON, prose
    lines ``State 3: 0.6``. Unparseable when nothing is found, a state is outside ``0..num_steps`` or not an
    integer, a value is not a number in ``[0, 1]``, or one state gets two different values.

    Args:
        text: the teacher's raw answer.
        num_steps: ``N``, the trajectory's number of decision steps (states ``0..N``).
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
        raise ValueError(f"num_steps must be an int >= 0, got {num_steps!r}")
    pairs = next((p for obj in find_json(text) if (p := _pairs(obj))), None)
    if pairs is None:
        pairs = [(int(m.group(1)), m.group(2)) for line in text.splitlines() if (m := _STATE_LINE.match(line))]
    if not pairs:
        return ValueEstimation(None, "no state values found in the answer")
    values: dict[int, float] = {}
    for key, raw in pairs:
        k, v = _state_index(key), _value(raw)
        if k is None or not 0 <= k <= num_steps:
            return ValueEstimation(None, f"state {key!r} is not an integer in [0, {num_steps}]")
        if v is None or not math.isfinite(v) or not 0.0 <= v <= 1.0:
            return ValueEstimation(None, f"the value of state {k} must be a number in [0, 1], got {raw!r}")
        if values.get(k, v) != v:
            return ValueEstimation(None, f"state {k} has two values, {values[k]} and {v}")
        values[k] = v
    return ValueEstimation(values)


_GRADE_SYSTEM = """You grade the process of a software-engineering agent that tried to resolve an issue in a
repository. Score how well it gathered and used evidence, on seven dimensions, each an integer from 0 to 10:

{dimensions}

Rules:
- Base every score on evidence in the transcript: the commands the agent ran and the outputs it saw. Quote or
  point to that evidence.
- Judge how the agent responded to the evidence: ignoring a failing check, claiming success that no output
  shows, submitting without verification (no run of the changed code or of its tests after the last edit), or
  editing a test to make it pass are faults.
- Do not penalise the agent for not running the hidden tests (it cannot see them), for a fix that differs
  from the reference fix, or for errors and tracebacks it met while exploring.
- Elided observations were long; judge from what is shown and the command that produced them.
{reference_rule}
Answer with JSON only: {{"R1": score, "R2": score, ..., "R7": score, "evidence": "one line per dimension"}}."""

_REFERENCE_RULE = """- The reference block lists the hidden tests that must go from failing to passing and the reference fix.
  Use it only to judge R2 (relevance), R3 (coverage) and R5 (discriminativeness) of the agent's own checks;
  the agent never saw it.
"""


def process_reward_messages(
    trajectory: Trajectory | Sequence[Mapping[str, Any]],
    *,
    fail_to_pass: Sequence[str] | None = None,
    gold_patch: str | None = None,
    max_observation_chars: int = 4000,
    max_patch_chars: int = 12000,
) -> list[dict[str, str]]:
    """The process-reward grading prompt: R1-R7 rules, an optional reference block, then the transcript.

    Args:
        trajectory: the agent's trajectory (a ``Trajectory`` or OpenAI chat messages).
        fail_to_pass: ids of the hidden tests that the fix must turn from failing to passing (reference block).
        gold_patch: the reference fix (reference block); head and tail kept beyond ``max_patch_chars``.
        max_observation_chars: the longest observation shown whole (see :func:`render_transcript`).
        max_patch_chars: the longest reference fix shown whole, ``>= 80``.

    Returns:
        ``[{"role": "system", ...}, {"role": "user", ...}]``; parse the answer with
        :func:`orchard.rewards.parse_rubric_judgement` (scale 0..10, keys ``R1``..``R7``).
    """
    if fail_to_pass is not None and (
        isinstance(fail_to_pass, str) or not all(isinstance(t, str) for t in fail_to_pass)
    ):
        raise ValueError(f"fail_to_pass must be a list of test ids, got {fail_to_pass!r}")
    if gold_patch is not None and not isinstance(gold_patch, str):
        raise ValueError(f"gold_patch must be a str, got {type(gold_patch).__name__}")
    if isinstance(max_patch_chars, bool) or not isinstance(max_patch_chars, int) or max_patch_chars < 80:
        raise ValueError(f"max_patch_chars must be an int >= 80, got {max_patch_chars!r}")
    keys = list(RPR_WEIGHTS)
    dimensions = "\n".join(
        f"{rid} {name} (weight {RPR_WEIGHTS[keys[i]]:.2f}): {meaning}."
        for i, (rid, name, meaning) in enumerate(RUBRIC_DIMENSIONS)
    )
    has_reference = bool(fail_to_pass) or bool(gold_patch)
    system = _GRADE_SYSTEM.format(dimensions=dimensions, reference_rule=_REFERENCE_RULE if has_reference else "")
    transcript, _ = render_transcript(trajectory, max_observation_chars=max_observation_chars)
    blocks = []
    if has_reference:
        ref = ["## Reference (not seen by the agent)"]
        if fail_to_pass:
            ref.append("Tests that must go from failing to passing:\n" + "\n".join(f"- {t}" for t in fail_to_pass))
        if gold_patch:
            ref.append("Reference fix:\n```diff\n" + compress_observation(gold_patch, max_chars=max_patch_chars)
                       + "\n```")
        blocks.append("\n".join(ref))
    blocks.append("## Agent transcript\n\n" + transcript)
    blocks.append("Score R1-R7 as JSON.")
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(blocks)}]
