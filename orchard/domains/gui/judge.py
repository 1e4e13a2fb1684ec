"""SoftwareGym's two-stage judge for GUI runs, behind the OpenAI-compatible interface, and the paper's RL reward.

- :func:`judge_gui_trajectory` asks the **outcome judge** (the final 5 assistant messages with their post-action
  screenshots) and, when it confirms completion (score >= 0.8), the **process judge** (every message, at most 10
  evenly sampled screenshots); the run is complete iff both scores are >= 0.8
  (:func:`orchard.rewards.two_stage_select`). What each sees and the prompts: `orchard.domains.gui.evidence`.
  A judge is an OpenAI-compatible URL (images go as ``data:image/png;base64`` URLs in content parts; a
  vision-language judge behind vLLM reads them) or an ``Engine`` in process (rendered through a text chat
  template, each image as ``[image]``). ``images="placeholder"`` sends a URL judge that text too (a text-only
  server, such as ``orchard serve-model``, refuses image parts).
- :class:`ProgrammaticJudge` is the CPU-scale judge behind the same interface: an ``Engine`` that reads the
  prompt it is sent and scores it with :func:`programmatic_judge_text`, from the reference block (the task's
  checker data, the final site state and the evidence no served page showed) and the steps' structure. It reads
  no pixels: it is a deterministic stand-in for a vision-language judge, not a claim about what one would say.
- :func:`gui_rollout_reward` is the paper's RL reward of a judged run (via :func:`orchard.rewards.gui_reward`):
  +1 when every assistant turn is well formed and the judge confirms completion, -1 when the run ended after
  repeated format failures, 0 otherwise. :func:`turn_format_ok` says which turns are well formed.
- :func:`judge_gui_trajectories` judges RL rollouts in place and sets that reward; :class:`JudgedGUIRollouts`
  wraps a `Rollouts` so every batch is judged before the RL stage groups it. A run of a task that leads through
  the captcha (kind ``captcha``) and met it (``captcha_hits > 0`` in ``metadata["site_state"]``, or
  ``metadata["blocked"]``) is not judged and leaves the loss (``metadata["removed"] = "captcha_blocked"``), as do
  failed judge calls (``"judge_failure"``) and answers without a readable score (``"judge_unparseable"``); each
  is counted (``rl/captcha_blocked``, ``rl/judge_failures``, ``rl/judge_unparseable``). Any other run that met the
  captcha went there on its own: 0 unjudged (``rl/captcha_detours``), so a detour is no way out of the loss.
  Dynamic sampling for this reward is the ``all_zero_or_all_positive`` rule of
  `orchard.sampling.GROUP_FILTER_RULES`.

Our readings: the process judge is asked only after the outcome judge confirms (a run that failed the first stage
is not complete whatever the second says, and the call is saved); a run that ended with ``format_error`` gets -1
without a judge call (rule 2 of `gui_reward` wins over any verdict, the captcha's removal included).

"The judge confirms completion" is the two-stage verdict, both scores >= 0.8 (our reading). The seed says of the
judges "(SoftwareGym's two stages): an outcome judge ...; a process judge ...; keep iff both ≥ 0.8" and of the
reward "+1 when every assistant turn is well-formed and the judge confirms completion": the only decision rule it
gives this judge is the joint one. Reading the reward as the outcome judge alone would also undo the guard
against answers no page showed (a memorised answer at the first step: the outcome judge sees the answer, only the
process judge sees that no served page held it; `tests/domains/gui/test_gui_judge_cheats.py`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchard._extras import requires_extra
from orchard.data import Trajectory
from orchard.data.curation import check_tool_calls
from orchard.domains.gui.evidence import (
    FINAL_HEADER,
    INDENT,
    NO_DONE,
    OUTCOME_END,
    OUTCOME_LAST_TURNS,
    PROCESS_END,
    PROCESS_MAX_SCREENSHOTS,
    REFERENCE_HEADER,
    flatten_images,
    judge_reference,
    outcome_judge_messages,
    parse_judge_score,
    process_judge_messages,
)
from orchard.domains.gui.tasks import GUITask, check_task
from orchard.domains.gui.tools import GUI_TOOLS
from orchard.rewards import GUIReward, gui_reward, two_stage_select
from orchard.rollout.engine import Engine, GenerateRequest, SamplingParams
from orchard.rollout.program import chat_completion, check_engine_or_url
from orchard.rollout.rollouts import JudgedRolloutsBase, Rollouts
from orchard.rollout.scripted import ScriptedEngine

__all__ = [
    "IMAGE_MODES",
    "GUIJudgement",
    "JudgeCallFailed",
    "JudgedGUIRollouts",
    "ProgrammaticJudge",
    "gui_rollout_reward",
    "judge_gui_trajectories",
    "judge_gui_trajectory",
    "programmatic_judge_text",
    "turn_format_ok",
]

IMAGE_MODES = ("data_url", "placeholder")
"""How a URL judge gets the screenshots: as data URLs (a vision-language judge) or as ``[image]`` text."""

_STEP = re.compile(r"^### Step (\d+)$", re.MULTILINE)
_ACTIVE_PROMO = re.compile(r"^Tab \d+ \(active\): .*/promo/", re.MULTILINE)
_SCREENSHOT_LABEL = re.compile(r"^Screenshot (?:after|before) step \d+:$", re.MULTILINE)
# the prompt's close, as `evidence` writes it: the final answer (a JSON string, or why there is none) on one line,
# then the optional reference (one line of JSON), right before the end marker. Whatever the agent wrote sits
# further up, as a JSON string or on indented lines, so it can neither stand in for these nor come after them.
_CLOSE = re.compile(rf"(?:^|\n){re.escape(FINAL_HEADER)}\n(?P<answer>[^\n]*)\n"
                    rf"(?:{re.escape(REFERENCE_HEADER)}\n```json\n(?P<reference>[^\n]*)\n```\n)?\Z")


# ---- the programmatic judge --------------------------------------------------------------------------------------


def _close(text: str, end_at: int) -> tuple[int, str | None, dict[str, Any] | None] | None:
    """Where the close starts, the final answer (None: no done) and the reference, or None when the prompt has no
    close of ours right before its end marker."""
    m = _CLOSE.search(text[:end_at])
    if m is None:
        return None
    response = None
    if not m.group("answer").startswith(NO_DONE):
        try:
            response = json.loads(m.group("answer"))
        except ValueError:
            return None
        if not isinstance(response, str):
            return None
    try:
        ref = json.loads(m.group("reference")) if m.group("reference") is not None else None
    except ValueError:
        return None
    return m.start(), response, ref if isinstance(ref, dict) else None


def _outcome(ref: dict[str, Any], response: str | None, shots: int) -> dict[str, Any]:
    task = GUITask(str(ref.get("task_id", "")), str(ref.get("template", "")), 0, 0, "", "",
                   answer=ref.get("answer"), choices=tuple(ref.get("choices") or ()),
                   expected_state=ref.get("expected_state"))
    check = check_task(task, response, dict(ref["final_state"]))
    return {"score": 1.0 if check.success else 0.0, "reason": check.reason,
            "evidence": {"blocked": check.blocked, "screenshots": shots}}


def _step(block: str) -> tuple[str, str]:
    """A step block's action and its observations' text (the indented lines after an ``Observation:`` label;
    the screenshot labels and placeholders, at the margin, are the prompt's, not the page's)."""
    lines = block.strip("\n").split("\n")
    at = lines.index("Observation:") if "Observation:" in lines else len(lines)
    action = "\n".join(lines[:at])
    observation = "\n".join(line[len(INDENT):] for line in lines[at:] if line.startswith(INDENT))
    return action, observation


def _process(body: str, ref: dict[str, Any] | None, shots: int) -> dict[str, Any]:
    heads = list(_STEP.finditer(body))
    blocks = [body[h.end(): heads[j + 1].start() if j + 1 < len(heads) else len(body)] for j, h in enumerate(heads)]
    malformed = errors = detours = repeats = 0
    previous = None
    for block in blocks:
        action, observation = _step(block)
        malformed += action.startswith("Action: (no tool call)")
        errors += observation.startswith("Error:")
        detours += bool(_ACTIVE_PROMO.search(observation))
        repeats += previous == (action, observation)
        previous = (action, observation)
    lapses = malformed + errors + detours + repeats
    score = max(0, 10 - lapses) / 10
    unseen = ref.get("evidence_unseen") if ref is not None else None
    grounded = None if not isinstance(unseen, list) else not unseen
    if grounded is False:
        score = min(score, 0.5)
    reason = (f"{lapses} wasted steps ({malformed} without a tool call, {errors} errors, {detours} on distractor "
              f"pages, {repeats} repeats)" + ("" if grounded is not False else
                                              f"; no page the site served showed {', '.join(map(str, unseen))}"))
    return {"score": score, "reason": reason,
            "evidence": {"steps": len(blocks), "malformed": malformed, "errors": errors, "detours": detours,
                         "repeats": repeats, "grounded": grounded, "screenshots": shots}}


def programmatic_judge_text(prompt_text: str) -> str:
    """The programmatic judge's answer to an outcome or process grading prompt (any chat rendering), as JSON.

    **Outcome** (the prompt of `outcome_judge_messages`): the reference block's checker data and final site state
    through `check_task` with the final answer: score 1 when it passes, else 0. Without a reference it cannot
    judge and says so in prose (no score: the rollout is removed, not scored).

    **Process** (`process_judge_messages`): ``score = max(0, 10 - lapses) / 10`` where a lapse is a step without
    a tool call, a step answered by an error, a step that left the active tab on a distractor (``/promo/``)
    page, or a step that repeats the previous action with the same observation; when the reference lists
    evidence that no page the site served showed (``evidence_unseen``, `evidence.judge_reference`: found by
    provenance from the run's observations, never from the agent's text), the score is capped at 0.5: the answer
    was not read from the site (recalled, or typed into a page by the agent). So one wasted step scores 0.9,
    two 0.8 (still kept at the 0.8 bar), three 0.7. The rules and weights are ours.

    Only the prompt's own structure is read: the close (final answer and reference) right before the end marker,
    and the steps' labels at the margin; the agent's text, a JSON string or indented lines, cannot stand in for
    either (`orchard.domains.gui.evidence`). A prompt without that close has no reference and no answer.

    The answer is ``{"score": s, "reason": "...", "evidence": {...}}`` (``evidence.screenshots``: how many
    screenshots the prompt held, counted by their labels).

    Raises:
        ValueError: ``prompt_text`` is no GUI grading prompt (neither end marker).
    """
    if not isinstance(prompt_text, str):
        raise ValueError(f"prompt_text must be a str, got {type(prompt_text).__name__}")
    outcome_at, process_at = prompt_text.rfind(OUTCOME_END), prompt_text.rfind(PROCESS_END)
    if max(outcome_at, process_at) < 0:
        raise ValueError("prompt_text holds no GUI grading prompt (no outcome or process end marker)")
    end_at = max(outcome_at, process_at)
    close = _close(prompt_text, end_at)
    start, response, ref = close if close is not None else (end_at, None, None)
    shots = len(_SCREENSHOT_LABEL.findall(prompt_text))
    if outcome_at > process_at:
        if ref is None or not isinstance(ref.get("final_state"), dict):
            return "I cannot judge the outcome: the prompt has no reference with the final site state."
        return json.dumps(_outcome(ref, response, shots))
    return json.dumps(_process(prompt_text[:start], ref, shots))


class ProgrammaticJudge(ScriptedEngine):
    """An ``Engine`` that answers GUI grading prompts with :func:`programmatic_judge_text` (deterministic, every
    token's log-prob 0). Serve it with ``orchard.rollout.server.build_app`` to reach it by URL (text only: call
    the judge with ``images="placeholder"``).

    Args:
        tokenizer: the chat tokenizer prompts are rendered with; must have an eos token.
    """

    def __init__(self, tokenizer: Any) -> None:
        if getattr(tokenizer, "eos_token_id", None) is None:
            raise ValueError("tokenizer must have an eos_token_id (the end of the answer)")
        super().__init__(tokenizer, programmatic_judge_text, logprob=0.0)

    def _answer(self, prompt_ids: Sequence[int]) -> str:
        self.prompts.clear()  # asked once per rollout for a whole run: keep no prompt history
        return super()._answer(prompt_ids)


# ---- asking a judge ----------------------------------------------------------------------------------------------


class JudgeCallFailed(RuntimeError):
    """The judge could not be asked: an HTTP error, an unreachable server, a timeout, an engine's error."""


@dataclass(frozen=True)
class GUIJudgement:
    """The two-stage verdict on one run.

    Fields:
        completed: both scores >= their bars (True), the outcome or the process below its bar (False), or None
            when a judge's answer held no readable score (``error`` says which).
        outcome: the outcome judge's score in [0, 1] (None when unreadable).
        process: the process judge's score (None when unreadable or not asked: the outcome was below its bar).
        reasons: each judge's one-line reason, by stage.
        error: why the verdict is None.
    """

    completed: bool | None
    outcome: float | None
    process: float | None
    reasons: dict[str, str] = field(default_factory=dict)
    error: str | None = None



_CALL_KEYS = ("model", "api_key", "max_tokens", "timeout_s", "retries", "images", "last_turns", "max_screenshots",
              "max_observation_chars", "outcome_threshold", "process_threshold")


def _check_call(max_tokens: object, timeout_s: object, retries: object, images: object) -> None:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an int >= 0, got {retries!r}")
    if images not in IMAGE_MODES:
        raise ValueError(f"images must be one of {list(IMAGE_MODES)}, got {images!r}")


async def _ask(judge: Engine | str, tokenizer: Any, messages: list[dict[str, Any]], *, images: str, model: str,
               api_key: str | None, max_tokens: int, timeout_s: float, retries: int) -> str:
    try:
        if isinstance(judge, str):
            with requires_extra("rollout"):
                import httpx
            body = {"model": model, "temperature": 0.0, "max_tokens": max_tokens,
                    "messages": messages if images == "data_url" else flatten_images(messages)}
            async with httpx.AsyncClient() as http:
                reply = await chat_completion(http, judge, body, session_id=f"judge-{uuid.uuid4().hex}",
                                              api_key=api_key, deadline=time.monotonic() + timeout_s,
                                              timeout_s=timeout_s, retries=retries)
            return str(reply.get("content") or "")
        text = tokenizer.apply_chat_template(flatten_images(messages), add_generation_prompt=True, tokenize=False)
        eos = tokenizer.eos_token_id
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=() if eos is None else (eos,))
        request = GenerateRequest(list(tokenizer(text, add_special_tokens=False)["input_ids"]), params)
        result = (await judge.generate([request]))[0]
        return tokenizer.decode(result.completions[0].token_ids, skip_special_tokens=True)
    except Exception as exc:  # whatever broke the call (transport, server, engine), the judge did not answer
        raise JudgeCallFailed(f"{type(exc).__name__}: {exc}") from exc


async def judge_gui_trajectory(
    trajectory: Trajectory,
    *,
    judge: Engine | str,
    task: GUITask | None = None,
    state: Mapping[str, Any] | None = None,
    tokenizer: Any = None,
    images: str = "data_url",
    model: str = "orchard",
    api_key: str | None = None,
    max_tokens: int = 512,
    timeout_s: float = 120.0,
    retries: int = 2,
    last_turns: int = OUTCOME_LAST_TURNS,
    max_screenshots: int = PROCESS_MAX_SCREENSHOTS,
    max_observation_chars: int = 4000,
    outcome_threshold: float = 0.8,
    process_threshold: float = 0.8,
) -> GUIJudgement:
    """The two-stage verdict on one run: the outcome judge, then (when it confirms) the process judge.

    Args:
        trajectory: the run.
        judge: an OpenAI-compatible URL (``http://host:port``, with or without ``/v1``) or an ``Engine``.
        task: the run's task: its intent heads the prompts and, with ``state``, its checker data fills the
            reference block (`evidence.judge_reference`); None: no reference.
        state: the site state the run ended in (`BrowserSession.site_state()`); default ``metadata["site_state"]``.
        tokenizer: the judge engine's chat tokenizer; default ``judge.tokenizer``. Unused with a URL.
        images: ``data_url`` (screenshots as data URLs) or ``placeholder`` (``[image]`` text); URL only.
        model, api_key: the request's ``model`` and bearer token (URL only).
        max_tokens: the longest answer, in tokens.
        timeout_s, retries: each HTTP attempt's timeout (and the deadline of all), further attempts after a
            transport failure or a 5xx (URL only).
        last_turns, max_screenshots: the evidence (5 and 10, SoftwareGym's).
        max_observation_chars: the longest observation text shown whole.
        outcome_threshold, process_threshold: the two bars, 0.8 each (SoftwareGym's).

    Raises:
        JudgeCallFailed: a judge could not be asked or did not answer (the cause chained).
    """
    if not isinstance(trajectory, Trajectory):
        raise ValueError(f"trajectory must be a Trajectory, got {type(trajectory).__name__}")
    if task is not None and not isinstance(task, GUITask):
        raise ValueError(f"task must be a GUITask or None, got {type(task).__name__}")
    _check_call(max_tokens, timeout_s, retries, images)
    two_stage_select(0.0, 0.0, outcome_threshold=outcome_threshold, process_threshold=process_threshold)
    tokenizer = check_engine_or_url(judge, tokenizer)
    if state is None:
        state = trajectory.metadata.get("site_state")
    reference = judge_reference(task, state, trajectory) if task is not None and state is not None else None
    intent = task.intent if task is not None else None
    ask = {"images": images, "model": model, "api_key": api_key, "max_tokens": max_tokens,
           "timeout_s": float(timeout_s), "retries": retries}
    outcome_messages = outcome_judge_messages(trajectory, intent=intent, reference=reference, last_turns=last_turns,
                                              max_observation_chars=max_observation_chars)
    outcome, why = parse_judge_score(await _ask(judge, tokenizer, outcome_messages, **ask))
    if outcome is None:
        return GUIJudgement(None, None, None, error=f"outcome judge: {why}")
    if outcome < outcome_threshold:
        return GUIJudgement(False, outcome, None, {"outcome": why})
    process_messages = process_judge_messages(trajectory, intent=intent, reference=reference,
                                              max_screenshots=max_screenshots,
                                              max_observation_chars=max_observation_chars)
    process, process_why = parse_judge_score(await _ask(judge, tokenizer, process_messages, **ask))
    if process is None:
        return GUIJudgement(None, outcome, None, {"outcome": why}, error=f"process judge: {process_why}")
    completed = bool(two_stage_select(outcome, process, outcome_threshold=outcome_threshold,
                                      process_threshold=process_threshold))
    return GUIJudgement(completed, outcome, process, {"outcome": why, "process": process_why})


# ---- the RL reward -----------------------------------------------------------------------------------------------


def turn_format_ok(trajectory: Trajectory, tools: Sequence[dict[str, Any]] | None = None) -> list[bool]:
    """Per assistant turn, whether it is well formed: one or more tool calls, each of a tool in ``tools`` (default
    `GUI_TOOLS`) whose arguments parse and fit its schema (`check_tool_calls`). A turn without a call is not. An
    action the browser answers with an error (a point outside the viewport) is well formed: the format held.

    The seed gives "+1 when every assistant turn is well-formed" without defining the word; "one or more tool
    calls" is issue 33's reading of the paper, which we follow (a turn may act several times; the step budget
    counts turns)."""
    if not isinstance(trajectory, Trajectory):
        raise ValueError(f"trajectory must be a Trajectory, got {type(trajectory).__name__}")
    bad = {issue.message_index for issue in check_tool_calls(trajectory, GUI_TOOLS if tools is None else tools)}
    return [len(trajectory.messages[i].tool_calls) >= 1 and i not in bad for i in trajectory.assistant_indices]


def gui_rollout_reward(trajectory: Trajectory, completed: bool | None, *, blocked: bool = False,
                       tools: Sequence[dict[str, Any]] | None = None) -> GUIReward:
    """The paper's GUI RL reward of a judged run: `orchard.rewards.gui_reward` over `turn_format_ok`, with
    "ended after repeated format failures" read as ``termination_reason == "format_error"`` (the agent loop's
    ``max_format_errors`` consecutive malformed turns, 3 by default).

    +1 every turn well formed (`turn_format_ok`: one or more valid tool calls) and ``completed``; -1 ended by
    format failures; 0 otherwise; dropped (reward None) when ``blocked`` (the captcha) or ``completed is None``
    (the judge failed) and the run did not end by format failures. ``completed`` is what the caller's judge
    confirmed: `judge_gui_trajectories` passes the two-stage verdict (both scores >= 0.8; our reading of "the
    judge confirms completion", see the module docstring), the rollouts pass the task's checker.
    """
    return gui_reward(turn_format_ok(trajectory, tools), completed,
                      ended_by_format_failure=trajectory.termination_reason == "format_error", page_blocked=blocked)


def _captcha(trajectory: Trajectory, task: GUITask | None) -> str | None:
    """``"blocked"`` when the run met the captcha on its task's way (a ``captcha`` task; with the task unknown,
    the checker's ``metadata["blocked"]``, which knew it), ``"detour"`` when it went there on its own, else None."""
    state = trajectory.metadata.get("site_state")
    hits = state.get("captcha_hits", 0) if isinstance(state, Mapping) else 0
    blocked = trajectory.metadata.get("blocked") is True
    if not (blocked or (isinstance(hits, int) and hits > 0)):
        return None
    if task is not None:
        return "blocked" if task.kind == "captcha" else "detour"
    return "blocked" if blocked else "detour"


async def judge_gui_trajectories(
    judge: Engine | str,
    trajectories: Sequence[Trajectory],
    *,
    tasks: Sequence[GUITask] | Mapping[str, GUITask] = (),
    concurrency: int = 8,
    tokenizer: Any = None,
    **judge_kwargs: Any,
) -> dict[str, float]:
    """Judge rollouts in place and set their RL reward (`gui_rollout_reward`), or remove them from the loss.

    For each rollout that is neither an environment failure nor already removed: a run that ended with
    ``format_error`` gets -1 unjudged; a run that met the captcha is removed (``"captcha_blocked"``) and not
    judged when its task leads through the captcha (kind ``captcha``; for a task not given, when the checker
    marked it ``metadata["blocked"]``), and gets 0 unjudged otherwise (the agent's own detour is a failure, never
    a way out of the loss); every other run is judged (`judge_gui_trajectory`, at most ``concurrency`` at a time) and gets ``reward`` +1 / 0,
    ``reward_components`` ``outcome_judge`` / ``process_judge`` (when asked) and ``passed`` (the verdict), and
    ``metadata["judge"]`` (the scores and reasons). A failed call is removed as ``"judge_failure"``, an answer
    without a readable score as ``"judge_unparseable"`` (``metadata["judge_error"]`` says why); removed rollouts
    keep the reward they had.

    Args:
        judge: a URL or an ``Engine`` (`judge_gui_trajectory`).
        trajectories: the rollouts, with ``task_id`` and ``metadata["site_state"]`` (the final site state).
        tasks: the rollouts' tasks (a list, or a mapping by id): a known task gives the prompts its intent and
            the reference block; the programmatic outcome judge needs it.
        concurrency: rollouts judged at once, >= 1.
        tokenizer: the judge engine's chat tokenizer (in process only).
        **judge_kwargs: the rest of `judge_gui_trajectory`'s keywords (``images``, ``model``, ``max_tokens``...).

    Returns:
        ``rl/judged`` (verdicts given), ``rl/judge_completed`` (of them, complete), ``rl/judge_failures``,
        ``rl/judge_unparseable``, ``rl/captcha_blocked``, ``rl/captcha_detours`` (0 without a judge call) and
        ``rl/format_failures`` (-1 without a judge call).
    """
    if isinstance(trajectories, (str, bytes)) or not isinstance(trajectories, Sequence):
        raise ValueError(f"trajectories must be a sequence of Trajectory, got {type(trajectories).__name__}")
    for i, t in enumerate(trajectories):
        if not isinstance(t, Trajectory):
            raise ValueError(f"trajectories[{i}] must be a Trajectory, got {type(t).__name__}")
    by_id = dict(tasks) if isinstance(tasks, Mapping) else {getattr(t, "id", None): t for t in tasks}
    for key, task in by_id.items():
        if not isinstance(task, GUITask):
            raise ValueError(f"tasks must hold GUITask values, got {type(task).__name__} for {key!r}")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
    unknown = set(judge_kwargs) - set(_CALL_KEYS)
    if unknown:
        raise ValueError(f"judge_kwargs has unknown keys {sorted(unknown)}")
    _check_call(judge_kwargs.get("max_tokens", 1), judge_kwargs.get("timeout_s", 1.0),
                judge_kwargs.get("retries", 0), judge_kwargs.get("images", "data_url"))
    tokenizer = check_engine_or_url(judge, tokenizer)
    gate = asyncio.Semaphore(concurrency)

    async def one(traj: Trajectory) -> str:
        task = by_id.get(traj.task_id)
        if traj.termination_reason == "format_error":
            traj.reward = gui_rollout_reward(traj, None).reward
            traj.reward_components["passed"] = 0.0
            return "format"
        captcha = _captcha(traj, task)
        if captcha == "blocked":
            traj.metadata["removed"] = "captcha_blocked"
            return "blocked"
        if captcha == "detour":
            traj.reward = gui_rollout_reward(traj, False).reward
            traj.reward_components["passed"] = 0.0
            return "detour"
        async with gate:
            try:
                verdict = await judge_gui_trajectory(traj, judge=judge, task=task, tokenizer=tokenizer,
                                                     **judge_kwargs)
            except JudgeCallFailed as exc:
                traj.metadata.update(removed="judge_failure", judge_error=str(exc))
                return "failure"
        if verdict.completed is None:
            traj.metadata.update(removed="judge_unparseable", judge_error=verdict.error)
            return "unparseable"
        assert verdict.outcome is not None  # a verdict is given only on a readable outcome score
        scored = gui_rollout_reward(traj, verdict.completed)
        traj.reward = scored.reward
        traj.reward_components["outcome_judge"] = verdict.outcome
        if verdict.process is not None:
            traj.reward_components["process_judge"] = verdict.process
        traj.reward_components["passed"] = float(verdict.completed)
        traj.metadata["judge"] = {"outcome": verdict.outcome, "process": verdict.process,
                                  "reasons": verdict.reasons, "reward_reason": scored.reason}
        return "completed" if verdict.completed else "judged"

    todo = [t for t in trajectories if not t.is_env_error and not t.metadata.get("removed")]
    results = await asyncio.gather(*(one(t) for t in todo))
    return {"rl/judged": float(results.count("completed") + results.count("judged")),
            "rl/judge_completed": float(results.count("completed")),
            "rl/judge_failures": float(results.count("failure")),
            "rl/judge_unparseable": float(results.count("unparseable")),
            "rl/captcha_blocked": float(results.count("blocked")),
            "rl/captcha_detours": float(results.count("detour")),
            "rl/format_failures": float(results.count("format"))}


class JudgedGUIRollouts(JudgedRolloutsBase):
    """`JudgedRolloutsBase` with `judge_gui_trajectories`: every batch played by ``rollouts`` gets its RL reward (or
    is removed from the loss) before it returns. :attr:`totals` sums every stat over calls (all are counts).

    Args:
        rollouts: the domain's `Rollouts` (its trajectories carry ``metadata["site_state"]``).
        judge: a URL or an ``Engine``.
        **kwargs: the rest of `judge_gui_trajectories`' keywords; the batch's own tasks are passed as ``tasks``.
    """

    counted = ("rl/judged", "rl/judge_completed", "rl/judge_failures", "rl/judge_unparseable", "rl/captcha_blocked",
               "rl/captcha_detours", "rl/format_failures")

    def __init__(self, rollouts: Rollouts, judge: Engine | str, **kwargs: Any) -> None:
        if "tasks" in kwargs:
            raise ValueError("kwargs must not hold tasks: each batch's tasks are the ones it plays")
        super().__init__(rollouts, judge, **kwargs)

    async def judge_batch(self, trajectories: list[Trajectory], tasks: Sequence[Any]) -> dict[str, float]:
        known = [t for t in tasks if isinstance(t, GUITask)]
        return await judge_gui_trajectories(self.judge, trajectories, tasks=known, **self.kwargs)
