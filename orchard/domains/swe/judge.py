"""The rubric process reward (RPR) of SWE trajectories: a judge behind the engine / OpenAI interface, for RL.

- :func:`judge_trajectory` builds the process-reward grading prompt
  (:func:`~orchard.domains.swe.prompts.process_reward_messages`) from a trajectory, asks a judge (an ``Engine`` in
  process, or an OpenAI-compatible chat-completions URL: a real LLM judge drops in by URL), and reads the answer
  with :func:`orchard.rewards.parse_rubric_judgement`, which combines the seven dimensions by
  :func:`orchard.rewards.rubric_reward` (weights :data:`~orchard.rewards.RPR_WEIGHTS`, scale 0..10).
- :class:`ScriptedJudge` is the CPU-scale judge behind the same interface: an ``Engine`` that reads the prompt it
  is sent and scores R1-R7 from the transcript's evidence (:func:`judge_process_text`). It is a deterministic
  stand-in for an LLM judge, not a claim that these rules are what an LLM judge would say.
- :func:`judge_trajectories` applies a judge to RL rollouts (the RL reward below); :class:`JudgedRollouts` wraps a
  domain's `Rollouts` so every rollout batch is judged before the RL stage groups it; :func:`judged_harnesses`
  wraps a recipe's harnesses with the instances' reference, and :func:`judge_step_stats` is its per-step curve.

**The RL reward.** The RPR's dimensions and weights are the paper's; we found no statement of how the rubric enters
the RL reward beside the test outcome, so this is our choice::

    reward = outcome + rubric_weight * rubric          # outcome +1 resolved / -1 not; rubric in [0, 1]

With the default ``rubric_weight = 1`` a resolved rollout never ranks below an unresolved one (unresolved
``<= -1 + 1 = 0``, resolved ``>= 1``), so the rubric orders rollouts of equal outcome: a group whose rollouts
all failed, which GRPO on the outcome alone cannot learn from, gets a process signal (the ``all_equal`` group
filter keeps it now), while BAR's positives (``reward > 0``) stay the resolved rollouts. The outcome is kept in
``reward_components["outcome"]`` (re-judging reads it, so judging twice does not add twice), the rubric in
``reward_components["rubric"]``, and the evaluation's pass rule stays the outcome's
(``reward_components["passed"]``).

**Judge failures are not scores.** A judge call that fails (HTTP error, unreachable server, an engine's error)
sets ``metadata["removed"] = "judge_failure"``; an answer that cannot be scored (garbage, a dimension missing or
out of range) sets ``metadata["removed"] = "judge_unparseable"``. Either takes the rollout out of the loss
(``orchard.data.trainable``: remove_sample), is counted (``rl/judge_failures``, ``rl/judge_unparseable``), and
leaves its reward as the verifier gave it.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchard._extras import requires_extra
from orchard.data import Trajectory
from orchard.domains.swe.instances import SWEInstance
from orchard.domains.swe.prompts import process_reward_messages
from orchard.domains.swe.values import (
    _FAIL,
    _PASS,
    _PATH,
    _RUN,
    _ask_engine,
    _is_edit,
    _issue_names,
    _mentions,
    _Step,
    _steps,
)
from orchard.rewards import RPR_WEIGHTS, RubricJudgement, parse_rubric_judgement
from orchard.rollout.engine import Engine
from orchard.rollout.program import chat_completion, check_engine_or_url
from orchard.rollout.rollouts import JudgedRolloutsBase
from orchard.rollout.scripted import ScriptedEngine

__all__ = [
    "JudgeCallFailed",
    "JudgedRollouts",
    "ScriptedJudge",
    "judge_process_text",
    "judge_step_stats",
    "judge_trajectories",
    "judge_trajectory",
    "judged_harnesses",
]

_TRANSCRIPT = "## Agent transcript"
_END = "Score R1-R7 as JSON."
_REFERENCE = "## Reference (not seen by the agent)"
_DIFF_PATH = re.compile(r"^(?:\+\+\+ b/|--- a/|diff --git a/)(\S+)", re.MULTILINE)
_TEST_PATH = re.compile(r"(?:^|/)tests?/|(?:^|/)test_\w*\.py$|_test\.py$")
_CREATE = re.compile(r"\bcat\s*>|\btee\b|(?<![0-9&])>\s*['\"]?(?:\./)?[A-Za-z_][\w/.-]*\.\w+|\.write(?:_text)?\(")
_CREATE_TOOL = re.compile(r"write|create", re.IGNORECASE)
_SKIP_MARKER = re.compile(r"pytest\.mark\.(?:skip|xfail)|unittest\.skip|@skip\b|pytest\.skip\(")
_OWN_SELECTOR = re.compile(r"\bpython3?\s+-c\b|::|\s-k\s")
_SUITE_RUNNER = re.compile(r"\b(?:pytest|unittest|tox|nox)\b")
# the value teacher's run outcomes (``exit code: N``, pytest's summary), plus the exit codes the SWE harness
# conventions print: the tool convention's "[The command completed with exit code N.]", the bash one's returncode
_FAILED = re.compile(rf"{_FAIL.pattern}|<returncode>\s*[1-9]\d*\s*</returncode>|completed with exit code [1-9]")
_PASSED = re.compile(rf"{_PASS.pattern}|<returncode>\s*0\s*</returncode>|completed with exit code 0\b",
                     re.MULTILINE)


@dataclass(frozen=True)
class _Run:
    step: int
    command: str
    own: bool
    """An own check (``python -c``, a script or test file the agent wrote, a ``::`` / ``-k`` selection); else a
    run of the existing suite."""
    relevant: bool
    failed: bool
    passed: bool
    """Passed, and before any tampering (a pass after a test was weakened is no evidence)."""


@dataclass(frozen=True)
class _Evidence:
    source_edits: tuple[int, ...]
    """Steps that changed a non-test file."""
    edits_on_target: bool
    """Every changed source file is one the issue (or the reference fix) names; True when neither names any."""
    tamper_step: int | None
    """The first step that edited or overwrote an existing test, or added a skip / xfail marker."""
    created_test: bool
    runs: tuple[_Run, ...]


def _arguments(raw: str) -> object:
    """A tool call's arguments as the transcript shows them: JSON, or the Python repr of a recorded dict."""
    try:
        return json.loads(raw)
    except ValueError:
        pass
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return raw


def _forms(paths: set[str]) -> set[str]:
    """A path's spellings in commands and outputs: as given, dotted module, bare stem."""
    out: set[str] = set()
    for path in paths:
        stem = path[:-3] if path.endswith(".py") else path
        out |= {path, stem.strip("/").replace("/", "."), stem.rsplit("/", 1)[-1]}
    return out


def _names_file(text: str, base: str) -> bool:
    """Whether ``text`` names the file ``base`` (not merely a longer name ending in it: ``test_items.py``)."""
    return bool(re.search(rf"(?<![\w.-]){re.escape(base)}(?![\w.])", text))


def _edit_targets(step: _Step) -> list[tuple[str | None, bool]]:
    """``(path or None, creates)`` of each file a step writes; ``creates`` when it writes a whole file (``cat >``,
    a redirect, a create tool) rather than changing one in place (``sed -i``, ``str_replace``, a patch)."""
    targets: list[tuple[str | None, bool]] = []
    for name, raw in step.calls or (("", step.command),):
        args = _arguments(raw)
        command = ""
        if isinstance(args, Mapping):
            path = next((args[k] for k in ("path", "file", "file_path") if isinstance(args.get(k), str)), None)
            command = str(args.get("command", args.get("cmd", "")))
            if path is not None:
                creates = command == "create" or bool(_CREATE_TOOL.search(name) and command != "str_replace")
                targets.append((path, creates))
                continue
        else:
            command = str(args)
        paths = _PATH.findall(command)
        creates = bool(_CREATE.search(command))
        targets += [(p, creates) for p in paths] or [(None, creates)]
    return targets


def _evidence(steps: list[_Step], issue_words: set[str], reference_paths: set[str]) -> _Evidence:
    source_edits: list[int] = []
    source_paths: set[str] = set()
    created: dict[str, bool] = {}  # basename of a file the agent wrote whole -> its content names the issue
    created_test = False
    tamper_step = None
    seen = ""
    for step in steps:
        if _is_edit(step):
            for path, creates in _edit_targets(step):
                base = os.path.basename(path) if path else ""
                if path is None or not _TEST_PATH.search(path):
                    if path is not None and creates and not _names_file(seen, base):
                        created[base] = _mentions(step.command, issue_words)
                    else:
                        if step.index not in source_edits:
                            source_edits.append(step.index)
                        if path is not None:
                            source_paths.add(path)
                elif creates and not _names_file(seen, base):
                    created[base] = _mentions(step.command, issue_words)
                    created_test = True
                elif base not in created and tamper_step is None:
                    # an existing test changed in place, or overwritten: the test no longer judges the fix
                    tamper_step = step.index
            if _SKIP_MARKER.search(step.command) and tamper_step is None:
                tamper_step = step.index
        seen += step.command + step.observation
    named = reference_paths | {w for w in issue_words if w.endswith(".py")}
    on_target = not named or all(any(p.endswith(n) or n.endswith(p) for n in named) for p in source_paths)
    words = issue_words | _forms(source_paths) | _forms(reference_paths)
    runs = []
    for step in steps:
        if not _RUN.search(step.command):
            continue
        own_files = [b for b in created if _names_file(step.command, b)]
        own = bool(own_files) or bool(_OWN_SELECTOR.search(step.command)) or not _SUITE_RUNNER.search(step.command)
        relevant = any(created[b] for b in own_files) or _mentions(step.command + step.observation, words)
        failed = bool(_FAILED.search(step.observation))
        passed = not failed and bool(_PASSED.search(step.observation))
        trusted = tamper_step is None or step.index < tamper_step
        runs.append(_Run(step.index, step.command.strip(), own, relevant, failed, passed and trusted))
    return _Evidence(tuple(source_edits), on_target, tamper_step, created_test, tuple(runs))


def _scores(ev: _Evidence) -> tuple[dict[str, int], dict[str, str]]:
    first = ev.source_edits[0] if ev.source_edits else None
    last = ev.source_edits[-1] if ev.source_edits else None
    before = [r for r in ev.runs if first is None or r.step < first]
    after = [r for r in ev.runs if last is not None and r.step > last]
    own = [r for r in ev.runs if r.own]
    own_relevant = [r for r in own if r.relevant]
    reproduced = any(r.failed and r.relevant for r in before)
    confirmed = any(r.passed and r.relevant for r in after)
    suite_after = [r for r in after if not r.own]
    suite_passes = bool(suite_after) and suite_after[-1].passed

    fix = 0 if last is None else 4 + 2 * ev.edits_on_target + 2 * confirmed + 2 * suite_passes
    relevance = round(10 * len(own_relevant) / len(own)) if own else 0
    coverage = min(10, 4 * len({r.command for r in own_relevant}) + 2 * ev.created_test)
    rigor = 5 * reproduced + 5 * confirmed
    failing_before = {r.command for r in before if r.own and r.relevant and r.failed}
    passing_after = {r.command for r in after if r.own and r.relevant and r.passed}
    if failing_before & passing_after:
        discriminative = 10
    elif failing_before and passing_after:
        discriminative = 6
    else:
        discriminative = 3 if failing_before or passing_after else 0
    if suite_passes:
        regression = 10
    elif suite_after:
        regression = 3
    else:
        regression = 2 if any(not r.own for r in ev.runs) else 0
    if ev.tamper_step is not None:
        integrity = 0
    elif after and after[-1].failed:
        integrity = 2
    elif last is not None and not after:
        integrity = 4
    else:
        integrity = 10
    scores = {"R1": fix, "R2": relevance, "R3": coverage, "R4": rigor, "R5": discriminative, "R6": regression,
              "R7": integrity}
    why = {
        "R1": "no change to a source file" if last is None else
        f"changed source at steps {list(ev.source_edits)}; on the issue's files: {ev.edits_on_target}; "
        f"confirmed by a relevant check: {confirmed}; suite passes after: {suite_passes}",
        "R2": f"{len(own_relevant)} of {len(own)} own checks touch the issue or the changed code",
        "R3": f"{len({r.command for r in own_relevant})} distinct relevant checks; wrote a test file: "
        f"{ev.created_test}",
        "R4": f"reproduced before the change: {reproduced}; confirmed after: {confirmed}",
        "R5": f"a relevant check failing before the change: {bool(failing_before)}; passing after: "
        f"{bool(passing_after)}; the same check: {bool(failing_before & passing_after)}",
        "R6": f"existing suite after the change: {'passes' if suite_passes else 'ran' if suite_after else 'not run'}",
        "R7": f"test tampered at step {ev.tamper_step}" if ev.tamper_step is not None else
        "the last check after the change failed and was left" if integrity == 2 else
        "submitted with no check after the change" if integrity == 4 else "claims match the outputs",
    }
    return scores, why


def judge_process_text(prompt_text: str) -> str:
    """The programmatic judge's answer to a process-reward grading prompt (any chat rendering of it), as JSON.

    A deterministic stand-in for an LLM judge: it reads the transcript of
    :func:`~orchard.domains.swe.prompts.process_reward_messages` step by step and scores each dimension from what
    the agent did and saw. Vocabulary: a **source edit** changes a non-test file (an edit / write tool, ``sed -i``,
    a redirect, a patch); a **run** is a step that runs Python or a test runner, **failed** when its output shows
    a traceback, an error, ``FAILED`` or a non-zero exit code, **passed** when it shows ``N passed`` or exit code 0
    and no failure; a file the agent writes whole that no earlier step named is its own (a script or a test),
    not a source edit; an **own check** is a run of ``python -c``, of a file the agent wrote, or a ``::`` / ``-k``
    selection, every other test-runner run is the **existing suite**; a run is **relevant** when its command or
    output names the issue's module or a function the issue calls, a changed source file, a file of the reference
    fix, or runs a file the agent wrote that names them; **tampering** is an in-place edit of an existing test, an
    overwrite of a test file seen before, or a skip / xfail marker, and no run after it counts as passed.
    "Before" and "after" are before the first and after the last source edit.

    ====  =======================  =====================================================================
    id    dimension                score (0..10)
    ====  =======================  =====================================================================
    R1    Fix Quality              0 without a source edit; else 4, +2 when every changed source file is
                                   one the issue or reference names, +2 when a relevant run passes after,
                                   +2 when the last existing-suite run after passes
    R2    Self-test Relevance      10 x (relevant own checks / own checks), rounded; 0 without own checks
    R3    Coverage                 4 per distinct relevant own-check command, +2 for a test file written,
                                   at most 10
    R4    Rigor                    5 for a failing relevant run before (reproduced), +5 for a passing
                                   relevant run after (confirmed)
    R5    Discriminativeness       10 when one own check fails before and passes after; 6 when a relevant
                                   own check fails before and another passes after; 3 for either; else 0
    R6    Regression guard         10 when the last existing-suite run after passes; 3 when it ran after
                                   but did not pass; 2 when it ran only before; 0 never
    R7    Verification integrity   0 after tampering; 2 when the last run after failed and was left
                                   (a failure ignored); 4 when nothing ran after the last source edit
                                   (submitted blindly); else 10
    ====  =======================  =====================================================================

    The answer is ``{"R1": s1, ..., "R7": s7, "evidence": {...}}`` (the evidence: one line per dimension).

    Raises:
        ValueError: ``prompt_text`` holds no grading prompt (no "## Agent transcript" block).
    """
    if not isinstance(prompt_text, str):
        raise ValueError(f"prompt_text must be a str, got {type(prompt_text).__name__}")
    start = prompt_text.rfind(_TRANSCRIPT)
    if start < 0:
        raise ValueError("prompt_text holds no process-reward grading prompt (no '## Agent transcript' block)")
    end = prompt_text.rfind(_END)
    transcript = prompt_text[start + len(_TRANSCRIPT): end if end > start else len(prompt_text)]
    first = re.search(r"^### Step 1$", transcript, re.MULTILINE)
    paths, names = _issue_names(transcript[: first.start() if first else len(transcript)])
    ref_start = prompt_text.rfind(_REFERENCE, 0, start)
    reference = set(_DIFF_PATH.findall(prompt_text[ref_start:start])) if ref_start >= 0 else set()
    reference.discard("/dev/null")
    scores, why = _scores(_evidence(_steps(transcript), paths | names, reference))
    return json.dumps({**scores, "evidence": why})


class ScriptedJudge(ScriptedEngine):
    """An ``Engine`` that answers process-reward grading prompts with :func:`judge_process_text` (deterministic;
    every token's log-prob is 0). Serve it with ``orchard.rollout.server.build_app`` and it is reached by URL
    exactly as an LLM judge is.

    Args:
        tokenizer: the chat tokenizer prompts are rendered with; must have an eos token (the end of its answer).
    """

    def __init__(self, tokenizer: Any) -> None:
        if getattr(tokenizer, "eos_token_id", None) is None:
            raise ValueError("tokenizer must have an eos_token_id (the end of the answer)")
        super().__init__(tokenizer, judge_process_text, logprob=0.0)

    def _answer(self, prompt_ids: Sequence[int]) -> str:
        # a judge is asked once per rollout for a whole RL run: keep no prompt history
        self.prompts.clear()
        return super()._answer(prompt_ids)


class JudgeCallFailed(RuntimeError):
    """The judge could not be asked: an HTTP error, an unreachable server, a timeout, an engine's error."""


def _check_call_args(max_tokens: object, timeout_s: object, retries: object) -> None:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an int >= 0, got {retries!r}")



async def _ask(judge: Engine | str, tokenizer: Any, messages: list[dict[str, str]], *, model: str,
               api_key: str | None, max_tokens: int, timeout_s: float, retries: int) -> str:
    if isinstance(judge, str):
        with requires_extra("rollout"):
            import httpx
        body = {"model": model, "messages": messages, "temperature": 0.0, "max_tokens": max_tokens}
        async with httpx.AsyncClient() as http:
            reply = await chat_completion(http, judge, body, session_id=f"judge-{uuid.uuid4().hex}",
                                          api_key=api_key, deadline=time.monotonic() + timeout_s,
                                          timeout_s=timeout_s, retries=retries)
        return str(reply.get("content") or "")
    return await _ask_engine(judge, tokenizer, messages, max_tokens)


async def judge_trajectory(
    trajectory: Trajectory,
    *,
    judge: Engine | str,
    tokenizer: Any = None,
    fail_to_pass: Sequence[str] | None = None,
    gold_patch: str | None = None,
    model: str = "orchard",
    api_key: str | None = None,
    max_tokens: int = 1024,
    max_observation_chars: int = 4000,
    timeout_s: float = 120.0,
    retries: int = 2,
) -> RubricJudgement:
    """Ask ``judge`` to grade one trajectory's process; its answer parsed into R1-R7 and the rubric reward.

    Args:
        trajectory: the agent's trajectory.
        judge: an OpenAI-compatible server's URL (``http://host:port``, with or without ``/v1``: ``orchard
            serve-model``, ``build_app`` over :class:`ScriptedJudge`, or a hosted LLM), or an ``Engine`` in process
            (the prompt rendered with the chat template, generated greedily).
        tokenizer: the judge engine's chat tokenizer; default ``judge.tokenizer``. Unused with a URL.
        fail_to_pass, gold_patch: the optional reference block of the prompt (the hidden tests and the gold fix).
        model: the ``model`` field of the request (URL only).
        api_key: sent as ``Authorization: Bearer`` (URL only).
        max_tokens: the longest answer, in tokens.
        max_observation_chars: the longest observation shown whole in the transcript.
        timeout_s: each HTTP attempt's timeout, and the deadline of all of them (URL only).
        retries: further attempts after a transport failure or a 5xx answer (URL only; a 4xx is not retried).

    Returns:
        The :class:`~orchard.rewards.RubricJudgement` (``scorable=False`` with an ``error`` for an answer that
        cannot be scored).

    Raises:
        JudgeCallFailed: the judge could not be asked or did not answer (the cause chained).
    """
    if not isinstance(trajectory, Trajectory):
        raise ValueError(f"trajectory must be a Trajectory, got {type(trajectory).__name__}")
    _check_call_args(max_tokens, timeout_s, retries)
    tokenizer = check_engine_or_url(judge, tokenizer)
    messages = process_reward_messages(trajectory, fail_to_pass=fail_to_pass, gold_patch=gold_patch,
                                       max_observation_chars=max_observation_chars)
    try:
        answer = await _ask(judge, tokenizer, messages, model=model, api_key=api_key, max_tokens=max_tokens,
                            timeout_s=float(timeout_s), retries=retries)
    except Exception as exc:  # whatever broke the call (transport, server, engine), the judge did not answer
        raise JudgeCallFailed(f"{type(exc).__name__}: {exc}") from exc
    return parse_rubric_judgement(answer)


async def judge_trajectories(
    judge: Engine | str,
    trajectories: Sequence[Trajectory],
    *,
    rubric_weight: float = 1.0,
    reference: Callable[[Trajectory], Mapping[str, Any]] | None = None,
    concurrency: int = 8,
    tokenizer: Any = None,
    **judge_kwargs: Any,
) -> dict[str, float]:
    """Judge scored rollouts in place and set their RL reward ``outcome + rubric_weight * rubric`` (module doc).

    Each valid rollout that is not already removed is graded once (:func:`judge_trajectory`, at most
    ``concurrency`` calls at a time): its ``reward_components["rubric"]`` (in [0, 1]) and ``["outcome"]`` are set,
    ``["passed"]`` keeps the outcome's pass rule, ``metadata["rubric_scores"]`` holds R1-R7 by dimension name, and
    ``reward`` becomes the RL reward. Environment errors and unscored rollouts are left alone. A failed call sets
    ``metadata["removed"] = "judge_failure"``, an answer that cannot be scored ``"judge_unparseable"`` (with
    ``metadata["judge_error"]``); their reward stays the outcome and they leave the loss.

    Args:
        judge: a URL or an ``Engine`` (see :func:`judge_trajectory`).
        trajectories: the rollouts, scored by the verifier (``reward`` +1 / -1).
        rubric_weight: the rubric's weight beside the outcome, in ``[0, 1]``; default 1 (our choice, see the module
            doc). Up to 1 the RL reward stays positive exactly for resolved rollouts, which BAR counts as positives.
        reference: ``trajectory -> {"fail_to_pass": [...], "gold_patch": "..."}``, the prompt's reference block
            per rollout (e.g. from its task); default none.
        concurrency: judge calls in flight at once, >= 1.
        tokenizer: the judge engine's chat tokenizer (in process only).
        **judge_kwargs: :func:`judge_trajectory`'s ``model``, ``api_key``, ``max_tokens``,
            ``max_observation_chars``, ``timeout_s``, ``retries``.

    Returns:
        ``rl/judged`` (rollouts graded), ``rl/judge_failures``, ``rl/judge_unparseable`` and ``rl/rubric_mean``
        (the mean rubric over the graded; 0 when none).
    """
    if isinstance(trajectories, (str, bytes)) or not isinstance(trajectories, Sequence):
        raise ValueError(f"trajectories must be a sequence of Trajectory, got {type(trajectories).__name__}")
    for i, t in enumerate(trajectories):
        if not isinstance(t, Trajectory):
            raise ValueError(f"trajectories[{i}] must be a Trajectory, got {type(t).__name__}")
    if isinstance(rubric_weight, bool) or not isinstance(rubric_weight, (int, float)) or not 0 <= rubric_weight <= 1:
        raise ValueError(f"rubric_weight must be a number in [0, 1] (above 1 an unresolved rollout could outrank a "
                         f"resolved one and count as a positive for BAR), got {rubric_weight!r}")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
    if reference is not None and not callable(reference):
        raise ValueError(f"reference must be a callable trajectory -> mapping, got {type(reference).__name__}")
    unknown = set(judge_kwargs) - {"model", "api_key", "max_tokens", "max_observation_chars", "timeout_s", "retries"}
    if unknown:
        raise ValueError(f"judge_kwargs has unknown keys {sorted(unknown)}")
    _check_call_args(judge_kwargs.get("max_tokens", 1), judge_kwargs.get("timeout_s", 1.0),
                     judge_kwargs.get("retries", 0))
    tokenizer = check_engine_or_url(judge, tokenizer)
    todo = [t for t in trajectories if t.valid and not t.metadata.get("removed")]
    gate = asyncio.Semaphore(concurrency)
    dims = list(RPR_WEIGHTS)

    async def one(traj: Trajectory) -> str:
        ref = dict(reference(traj)) if reference is not None else {}
        async with gate:
            try:
                judgement = await judge_trajectory(traj, judge=judge, tokenizer=tokenizer,
                                                   fail_to_pass=ref.get("fail_to_pass"),
                                                   gold_patch=ref.get("gold_patch"), **judge_kwargs)
            except JudgeCallFailed as exc:
                traj.metadata.update(removed="judge_failure", judge_error=str(exc))
                return "failure"
        if not judgement.scorable or judgement.reward is None:
            traj.metadata.update(removed="judge_unparseable", judge_error=judgement.error)
            return "unparseable"
        outcome = traj.reward_components.get("outcome", traj.reward)
        assert outcome is not None  # todo holds valid rollouts only
        traj.reward_components.setdefault("passed", float(traj.passed))
        traj.reward_components["outcome"] = outcome
        traj.reward_components["rubric"] = judgement.reward
        traj.metadata["rubric_scores"] = {d: judgement.scores[d] for d in dims}
        traj.reward = outcome + rubric_weight * judgement.reward
        return "judged"

    results = await asyncio.gather(*(one(t) for t in todo))
    rubrics = [t.reward_components["rubric"] for t, r in zip(todo, results, strict=True) if r == "judged"]
    return {"rl/judged": float(len(rubrics)), "rl/judge_failures": float(results.count("failure")),
            "rl/judge_unparseable": float(results.count("unparseable")),
            "rl/rubric_mean": sum(rubrics) / len(rubrics) if rubrics else 0.0}


class JudgedRollouts(JudgedRolloutsBase):
    """`~orchard.rollout.rollouts.JudgedRolloutsBase` with :func:`judge_trajectories`: every batch played by
    ``rollouts`` gets its RL reward (or is removed from the loss) before it returns. :attr:`totals` sums the counts
    (``rl/judged``, ``rl/judge_failures``, ``rl/judge_unparseable``; not ``rl/rubric_mean``) over calls.

    Args:
        rollouts: the domain's `Rollouts` (its trajectories scored by the verifier).
        judge: a URL or an ``Engine`` (see :func:`judge_trajectory`).
        **kwargs: the rest of :func:`judge_trajectories`'s keywords (``rubric_weight``, ``reference``, ...).
    """

    counted = ("rl/judged", "rl/judge_failures", "rl/judge_unparseable")

    async def judge_batch(self, trajectories: list[Trajectory], tasks: Sequence[Any]) -> dict[str, float]:
        return await judge_trajectories(self.judge, trajectories, **self.kwargs)


def judged_harnesses(harnesses: Mapping[str, Any], tokenizer: Any, instances: Sequence[SWEInstance], *,
                     judge: Engine | str | None = None, model: str = "orchard", rubric_weight: float = 1.0,
                     ) -> dict[str, JudgedRollouts]:
    """Each of ``harnesses`` (name -> ``Rollouts``) wrapped in a `JudgedRollouts`: every rollout graded on the
    rubric, its RL reward ``outcome + rubric_weight x rubric``, a judge failure removed from the loss and counted.

    Args:
        harnesses: the domain's rollouts by harness name.
        tokenizer: the chat tokenizer (an in-process judge renders its prompts with it).
        instances: every instance the rollouts may play: the judge's reference block is the instance's hidden
            FAIL_TO_PASS tests and gold patch, looked up by the trajectory's task id.
        judge: an OpenAI-compatible URL or an ``Engine``; None: the programmatic `ScriptedJudge` in process.
        model: the ``model`` field sent to a URL.
        rubric_weight: in [0, 1], so a resolved rollout always ranks first.
    """
    by_id = {inst.instance_id: inst for inst in instances}

    def reference(traj: Trajectory) -> dict[str, Any]:
        inst = by_id[traj.task_id]
        return {"fail_to_pass": inst.FAIL_TO_PASS, "gold_patch": inst.patch}

    grader = ScriptedJudge(tokenizer) if judge is None else judge
    return {h: JudgedRollouts(r, grader, rubric_weight=rubric_weight, reference=reference, model=model,
                              tokenizer=tokenizer) for h, r in harnesses.items()}


def judge_step_stats(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """The rubric judge's view of one RL step's generated rollouts (the RPR variant's curves): over those it graded
    (valid, not removed, with a ``rubric`` component), ``rl/judge_graded``, ``rl/judge_rubric_mean`` (in [0, 1])
    and ``rl/judge_reward_mean`` (outcome + rubric_weight x rubric); the means 0 when none was graded."""
    graded = [t for t in trajectories if t.valid and not t.metadata.get("removed") and "rubric" in t.reward_components]
    n = len(graded)
    return {"rl/judge_graded": float(n),
            "rl/judge_rubric_mean": sum(t.reward_components["rubric"] for t in graded) / n if n else 0.0,
            "rl/judge_reward_mean": sum(t.reward for t in graded) / n if n else 0.0}
