"""Hindsight values of SWE trajectories: the value-estimation prompt answered by a model, for credit-assigned SFT.

- :func:`step_values` builds :func:`~orchard.domains.swe.prompts.value_estimation_messages` from a scored
  ``Trajectory``, asks a model (an ``Engine`` in process, or an OpenAI-compatible chat-completions URL) and
  parses the answer with :func:`~orchard.domains.swe.prompts.parse_value_estimation`: ``{state index: value}``
  for ``orchard.stages.sft_samples(..., mode="credit", step_values=...)``, or None when the answer is unreadable.
- :func:`hindsight_values` asks it for every failed trajectory of a teacher's corpus at once (what credit-assigned
  SFT reads; a resolved trajectory trains whole and needs none).
- :class:`ScriptedValueEstimator` is the CPU-scale teacher behind the same interface: an ``Engine`` that reads
  the prompt it is given (the transcript and the outcome the prompt states) and answers in the prompt's format.
  A real LLM teacher replaces it by URL; nothing else changes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from orchard._extras import requires_extra
from orchard.data import Trajectory
from orchard.domains.swe.prompts import parse_value_estimation, value_estimation_messages
from orchard.rollout.engine import (
    Completion,
    Engine,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    validate_requests,
)

with requires_extra("rollout"):
    import httpx

__all__ = ["ScriptedValueEstimator", "estimate_values_text", "hindsight_values", "step_values", "step_values_async"]

START = 0.4
"""The start state's value: the task is open (the prompt asks for 0.3-0.5)."""
CEILING = 0.85
"""The highest value before the last state: only the outcome itself is worth more."""
FLOOR = 0.05
"""The lowest value before the last state."""
RESOLVED_END = 1.0
FAILED_END = 0.1
"""The last state of a failed trajectory (the prompt asks for below 0.2)."""
GAINS = {"locate": 0.05, "reproduce": 0.10, "edit": 0.10, "verify": 0.15, "regress": -0.15}
"""Value change of a key step, on the 0.05 grid, so a locate step's credit is exactly the paper's eps 0.05."""

_HEADER = re.compile(r"The trajectory below has (\d+) steps \(states 0 to \d+\)\. It (RESOLVED|did NOT resolve)")
_FOOTER = "Give the values of the key states"
_STEP = re.compile(r"^### Step (\d+)$", re.MULTILINE)
_CALL = re.compile(r"^call ([^:\n]*): (.*)$", re.MULTILINE)
_PATH = re.compile(r"[\w./-]*\w\.py\b")
_CALLED = re.compile(r"\b([A-Za-z_]\w*)\s*\(")
_NOT_ISSUE_NAMES = frozenset({"print", "len", "int", "str", "float", "list", "dict", "set", "tuple", "range",
                              "sorted", "sum", "min", "max", "abs", "round", "repr", "type", "isinstance"})
_RUN = re.compile(r"\b(?:pytest|python3?|unittest|tox|nox)\b")
_EDIT_COMMAND = re.compile(
    r"\bsed\s+(?:-\w*\s+)*-i|\bperl\s+-\w*i|\bapply_patch\b|\bgit\s+apply\b|\bpatch\s+-p|\bcat\s*>|\bcat\s*<<"
    r"|\btee\b|(?<![0-9&])>\s*['\"]?(?:\./)?[A-Za-z_][\w/.-]*\.\w+|\.write(?:_text)?\(")
_EDIT_TOOL = re.compile(r"edit|write|str_replace|create|insert|replace|patch", re.IGNORECASE)
# arguments render as JSON or, when a harness recorded a dict, as its Python repr
_VIEW_ARGUMENT = re.compile(r"""["']command["']\s*:\s*["'](?:view|list)["']""")
_READ = re.compile(r"\b(?:cat|sed\s+-n|grep|rg|head|tail|nl|less|more|view|open|read|show)\b", re.IGNORECASE)
_FAIL = re.compile(r"Traceback \(most recent call last\)|\b\w*Error\b|\bFAILED\b|\b\d+ failed\b|\bFAIL:"
                   r"|exit code: [1-9]")
_PASS = re.compile(r"\b\d+ passed\b|exit code: 0\b|^OK\b", re.MULTILINE)


@dataclass(frozen=True)
class _Step:
    index: int
    command: str
    """What the agent did: its tool calls' arguments, or its text when it called no tool."""
    observation: str
    """What came back (observations and feedback)."""
    calls: tuple[tuple[str, str], ...]
    """``(tool name, arguments)`` of its tool calls."""


def _issue_names(task: str) -> tuple[set[str], set[str]]:
    """The module paths (and their dotted and stem forms) and the called names of the issue text."""
    paths: set[str] = set()
    for path in _PATH.findall(task):
        stem = path[:-3]
        paths |= {path, stem.replace("/", "."), stem.rsplit("/", 1)[-1]}
    names = {n for n in _CALLED.findall(task) if n not in _NOT_ISSUE_NAMES and len(n) > 2}
    return paths, names


def _steps(transcript: str) -> list[_Step]:
    heads = []
    for head in _STEP.finditer(transcript):
        # a heading inside an observation (a markdown file the agent read) is out of sequence; skip it
        if int(head.group(1)) == len(heads) + 1:
            heads.append(head)
    steps = []
    for i, head in enumerate(heads):
        body = transcript[head.end(): heads[i + 1].start() if i + 1 < len(heads) else len(transcript)]
        parts = re.split(r"^(?:Observation|Feedback):$", body, flags=re.MULTILINE)
        action, observation = parts[0], "\n".join(parts[1:])
        calls = _CALL.findall(action)
        # with tool calls, what the agent did is in their arguments; its prose may only talk about running things
        command = "\n".join(arguments for _, arguments in calls) if calls else action
        steps.append(_Step(int(head.group(1)), command, observation, tuple((n.strip(), a) for n, a in calls)))
    return steps


def _is_edit(step: _Step) -> bool:
    # an editor tool (SWE-agent's str_replace_editor) also views files: its "view" command changes nothing
    by_tool = any(_EDIT_TOOL.search(name) and not _VIEW_ARGUMENT.search(arguments) for name, arguments in step.calls)
    return by_tool or bool(_EDIT_COMMAND.search(step.command))


def _mentions(text: str, words: set[str]) -> bool:
    return any(re.search(rf"(?<![\w.]){re.escape(w)}(?![\w])", text) for w in words)


def estimate_values_text(prompt_text: str) -> str:
    """The scripted teacher's answer to a value-estimation prompt (any chat rendering of it), as JSON.

    A stand-in for an LLM teacher that reads evidence from the transcript the way the prompt's rules ask. Each
    step is read once, in order, and at most one event is credited per step (the first that applies):

    - **edit** (a file change: an edit/write tool, or ``sed -i``, a redirect into a file, ``git apply``, ...):
      +0.10, in a resolved trajectory only; in a failed one the outcome says the fix was wrong (our hindsight
      reading), so the value holds. Every edit opens a new round of verification.
    - **regress** (a failing run, after an edit, when the last run passed): -0.15.
    - **verify** (the first passing run, ``N passed`` or exit code 0, after the latest edit): +0.15 in a resolved
      trajectory; holds in a failed one.
    - **reproduce** (the first failing run before any edit, a traceback or test failure, whose command or output
      names the issue's module or a function the issue calls): +0.10.
    - **locate** (the first read of the issue's module: ``cat``/``grep``/a view tool naming it, or an output
      holding ``def`` of a function the issue calls): +0.05.

    Values stay in ``[0.05, 0.85]`` before the end. State 0 is 0.4; the last state ``N`` is 1.0 when the prompt
    says the trajectory resolved the issue and ``min(0.1, the value before)`` when it did not; a zero-step
    trajectory gets only its end value. A key step ``k`` lists state ``k - 1`` too (the value before it), so the
    caller's linear interpolation gives the whole change to step ``k``; the states after the last key step move
    linearly to the end.

    Raises:
        ValueError: ``prompt_text`` holds no value-estimation prompt (no "The trajectory below has N steps" line).
    """
    if not isinstance(prompt_text, str):
        raise ValueError(f"prompt_text must be a str, got {type(prompt_text).__name__}")
    header = _HEADER.search(prompt_text)
    if header is None:
        raise ValueError("prompt_text holds no value-estimation prompt (no 'The trajectory below has N steps' line)")
    num_steps, resolved = int(header.group(1)), header.group(2) == "RESOLVED"
    end = prompt_text.rfind(_FOOTER)
    transcript = prompt_text[header.end(): end if end > header.end() else len(prompt_text)]
    first = _STEP.search(transcript)
    task = transcript[: first.start() if first else len(transcript)]
    paths, names = _issue_names(task)
    steps = [s for s in _steps(transcript) if s.index <= num_steps]

    keyed: dict[int, tuple[float, str]] = {0: (START, "start: the task is open")}
    value = START
    edited = last_run_passed = verified = reproduced = located = False
    for step in steps:
        ran = bool(_RUN.search(step.command))
        failed = ran and bool(_FAIL.search(step.observation))
        passed = ran and not failed and bool(_PASS.search(step.observation))
        event, why = None, ""
        if _is_edit(step):
            event, why = "edit", "changed a file" + ("" if resolved else " (the fix turned out wrong)")
            edited, verified = True, False
        elif failed and edited and last_run_passed:
            event, why = "regress", "a run that passed before fails now"
        elif passed and edited and not verified:
            event, why = "verify", "the checks pass after the change" + ("" if resolved else
                                                                          " (not enough, by the outcome)")
            verified = True
        elif failed and not edited and not reproduced and _mentions(step.command + step.observation, paths | names):
            event, why, reproduced = "reproduce", "reproduced the bug: a failing run on the issue's code", True
        elif not located and not ran and (
            (_READ.search(step.command) and _mentions(step.command, paths))
            or any(f"def {n}(" in step.observation for n in names)
        ):
            event, why, located = "locate", "opened the module the issue is about", True
        if ran:
            last_run_passed = passed
        if event is None:
            continue
        gain = GAINS[event] if resolved or event not in ("edit", "verify") else 0.0
        if gain == 0.0:
            continue
        if step.index - 1 not in keyed:
            keyed[step.index - 1] = (value, "no change before the next key step")
        value = min(CEILING, max(FLOOR, round(value + gain, 2)))
        keyed[step.index] = (value, why)
    if resolved:
        keyed[num_steps] = (RESOLVED_END, "the fix resolved the issue")
    else:
        keyed[num_steps] = (min(FAILED_END, value), "the trajectory failed to resolve the issue")
    answer = [{"state": k, "value": v, "why": why} for k, (v, why) in sorted(keyed.items())]
    return json.dumps({"values": answer})


class ScriptedValueEstimator:
    """An ``Engine`` that answers value-estimation prompts with :func:`estimate_values_text` (deterministic;
    every token's log-prob is 0).

    It decodes the prompt ids, so it serves behind ``orchard.rollout.server.build_app`` as any model does, and
    :func:`step_values` reaches it in process or by URL exactly as it would reach an LLM teacher.

    Args:
        tokenizer: the chat tokenizer prompts are rendered with; must have an eos token (the end of its answer).
    """

    def __init__(self, tokenizer: Any) -> None:
        if getattr(tokenizer, "eos_token_id", None) is None:
            raise ValueError("tokenizer must have an eos_token_id (the end of the answer)")
        self.tokenizer = tokenizer
        self.weight_version = 0

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        results = []
        for request in validate_requests(requests):
            prompt = self.tokenizer.decode(list(request.prompt_ids), skip_special_tokens=False)
            ids = list(self.tokenizer(estimate_values_text(prompt), add_special_tokens=False)["input_ids"])
            ids.append(self.tokenizer.eos_token_id)
            finish: FinishReason = "stop"
            if len(ids) > request.params.max_tokens:
                ids, finish = ids[: request.params.max_tokens], "length"
            completions = [Completion(list(ids), [0.0] * len(ids), finish) for _ in range(request.params.n)]
            results.append(GenerateResult(tuple(request.prompt_ids), completions, self.weight_version))
        return results

    async def update_weights(self, weights: Any) -> None:
        raise NotImplementedError("the scripted value estimator has no weights")

    async def close(self) -> None:
        return None


def _chat_url(url: str) -> str:
    base = url.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


async def _ask_engine(engine: Engine, tokenizer: Any, messages: list[dict[str, str]], max_tokens: int) -> str:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    eos = tokenizer.eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=() if eos is None else (eos,))
    result = (await engine.generate([GenerateRequest(prompt_ids, params)]))[0]
    return tokenizer.decode(result.completions[0].token_ids, skip_special_tokens=True)


async def _ask_url(url: str, messages: list[dict[str, str]], *, model: str, max_tokens: int,
                   api_key: str | None, timeout_s: float) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "messages": messages, "temperature": 0.0, "max_tokens": max_tokens}
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        response = await client.post(_chat_url(url), json=body, headers=headers)
        response.raise_for_status()
    choices = response.json().get("choices") or [{}]
    return (choices[0].get("message") or {}).get("content") or ""


async def step_values_async(
    trajectory: Trajectory,
    *,
    client_or_engine: Engine | str,
    tokenizer: Any = None,
    resolved: bool | None = None,
    model: str = "orchard",
    api_key: str | None = None,
    max_tokens: int = 2048,
    max_observation_chars: int = 4000,
    timeout_s: float = 120.0,
) -> dict[int, float] | None:
    """:func:`step_values` on the caller's event loop."""
    if not isinstance(trajectory, Trajectory):
        raise ValueError(f"trajectory must be a Trajectory, got {type(trajectory).__name__}")
    if resolved is None:
        if trajectory.reward is None:
            raise ValueError("trajectory has no reward: score it first or pass resolved= (hindsight needs the outcome)")
        resolved = trajectory.reward > 0
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
    messages = value_estimation_messages(trajectory, resolved=resolved, max_observation_chars=max_observation_chars)
    if isinstance(client_or_engine, str):
        if not client_or_engine.startswith(("http://", "https://")):
            raise ValueError(f"client_or_engine must be an http(s) URL or an Engine, got {client_or_engine!r}")
        answer = await _ask_url(client_or_engine, messages, model=model, max_tokens=max_tokens, api_key=api_key,
                                timeout_s=float(timeout_s))
    elif isinstance(client_or_engine, Engine):
        tokenizer = tokenizer if tokenizer is not None else getattr(client_or_engine, "tokenizer", None)
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("tokenizer must be given (a tokenizer with a chat_template) when the engine has none")
        answer = await _ask_engine(client_or_engine, tokenizer, messages, max_tokens)
    else:
        raise ValueError(f"client_or_engine must be an http(s) URL or an Engine, got {type(client_or_engine).__name__}")
    return parse_value_estimation(answer, num_steps=trajectory.num_steps).values


def step_values(
    trajectory: Trajectory,
    *,
    client_or_engine: Engine | str,
    tokenizer: Any = None,
    resolved: bool | None = None,
    model: str = "orchard",
    api_key: str | None = None,
    max_tokens: int = 2048,
    max_observation_chars: int = 4000,
    timeout_s: float = 120.0,
) -> dict[int, float] | None:
    """Hindsight values of a trajectory's key states, from a value teacher that is told the outcome.

    Builds the value-estimation prompt, asks the teacher greedily (temperature 0) and parses its answer with
    :func:`~orchard.domains.swe.prompts.parse_value_estimation`: ``{state index: value}`` with indices in
    ``[0, trajectory.num_steps]``, which ``orchard.stages.sft_samples(..., mode="credit", step_values=...)``
    interpolates into per-step credit (``functools.partial(step_values, client_or_engine=url)``). Runs its own
    event loop, on a worker thread when called from a coroutine (an in-process engine must then serve a second
    loop, as ``HFEngine`` and the scripted engines do); a coroutine may instead await :func:`step_values_async`.

    Args:
        trajectory: a scored trajectory (its messages and reward).
        client_or_engine: an OpenAI-compatible server's URL (``http://host:port``, with or without ``/v1``:
            ``orchard serve-model``, ``build_app`` over :class:`ScriptedValueEstimator`, or a hosted LLM), or an
            ``Engine`` in process (the prompt rendered with the chat template, generated greedily).
        tokenizer: the engine's chat tokenizer; default ``client_or_engine.tokenizer``. Unused with a URL.
        resolved: the outcome the teacher is told; default ``trajectory.reward > 0`` (the SWE reward is +1 / -1).
        model: the ``model`` field of the request (URL only).
        api_key: sent as ``Authorization: Bearer`` (URL only).
        max_tokens: the longest answer, in tokens.
        max_observation_chars: the longest observation shown whole in the transcript.
        timeout_s: the HTTP request's timeout (URL only).

    Returns:
        ``{state index: value}``, or None when the answer could not be read (the caller counts these; such a
        trajectory gets no credit, not zero credit). A transport failure (HTTP error, unreachable server) raises.
    """
    ask = step_values_async(
        trajectory, client_or_engine=client_or_engine, tokenizer=tokenizer, resolved=resolved, model=model,
        api_key=api_key, max_tokens=max_tokens, max_observation_chars=max_observation_chars, timeout_s=timeout_s)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(ask)
    # called (e.g. by sft_samples) from a coroutine: this loop is blocked, so the request gets a loop of its own
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, ask).result()


async def hindsight_values(trajectories: Sequence[Trajectory], tokenizer: Any, *,
                           estimator: Engine | str | None = None, model: str = "orchard",
                           ) -> dict[int, dict[int, float] | None]:
    """The value teacher's ``{state: value}`` of every failed trajectory, keyed by ``id(trajectory)``.

    Failed: valid (scored, not an environment failure), with samples, and not resolved (reward <= 0); the others
    get no entry (a resolved trajectory trains whole in credit-assigned SFT, and one without samples trains on
    nothing). The questions go out concurrently (:func:`step_values_async`).

    Args:
        trajectories: the teacher's scored trajectories.
        tokenizer: the chat tokenizer (the scripted estimator renders and reads prompts with it).
        estimator: the value teacher: an OpenAI-compatible URL, an ``Engine``, or None for a
            :class:`ScriptedValueEstimator` over ``tokenizer`` in process.
        model: the ``model`` field sent to a URL.

    Returns:
        ``{id(trajectory): values}``, values None where the teacher's answer could not be read. Use as
        ``sft_samples(..., step_values=lambda t: values.get(id(t)))`` while ``trajectories`` are alive.
    """
    teacher = ScriptedValueEstimator(tokenizer) if estimator is None else estimator
    failed = [t for t in trajectories if t.valid and t.samples and not (t.reward or 0) > 0]
    values = await asyncio.gather(*(step_values_async(t, client_or_engine=teacher, tokenizer=tokenizer, model=model)
                                    for t in failed))
    return {id(t): v for t, v in zip(failed, values, strict=True)}
