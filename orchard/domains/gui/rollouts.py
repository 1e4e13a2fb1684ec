"""The GUI policy's rollouts: any `Engine` drives a `BrowserSession` in its own sandbox through the 13 tools.

`gui_rollouts` is the domain's `Rollouts` (what `orchard.stages` evaluates and trains with). It is the agent loop
(`orchard.rollout.AgentLoopRollouts`) with two GUI pieces, so prompting, sampling, token ids, budgets, timeouts,
retries, concurrency and "the sandbox is always closed" are the loop's, tested there:

- `GUIHarness`: the system prompt and first message exactly as the scripted teacher writes them (its SFT data
  and the policy's prompts agree token for token), the 13 tools, one action per tool call, the checker's score.
- `BrowserSandboxes`: what the loop calls its sandbox client. ``create(seed=...)`` opens one `BrowserSession` (one
  Chromium in a fresh sandbox of the synchronous `SandboxClient`, which the session's terminal needs);
  ``delete()`` closes the browser and deletes the sandbox. Session calls run in worker threads.

One episode: the browser opens the task's start page (fresh site state); every assistant turn must make one or
more tool calls of the 13 whose arguments fit their schemas (`turn_format_ok`'s rule); the calls of a turn run in
order; a turn without a call runs nothing and is a format error (the loop's ``require_tool_call``), as is a turn
with a malformed call, and 3 in a row end the run as ``format_error`` (reward -1). ``done(response)`` is the only
end the policy chooses; otherwise the step budget (``max_steps``, the paper's curriculum 15 then 30) ends it. An
invalid action the browser refuses (a point outside the viewport, a missing tab) is an error observation and well
formed. A browser that is gone is ``env_error`` (dropped, never scored). At the end ``metadata["site_state"]``
holds the final site state (what the two-stage judge's reference shows) and ``metadata["response"]`` the done
response; the reward is `gui_rollout_reward` with the task's checker standing in for the judge (+1 / 0 / -1;
``passed`` is the check, the evaluation's success), and a run that met the captcha is unscored
(``metadata["blocked"]``). Wrap the rollouts in `JudgedGUIRollouts` for the judge's reward.

Observations are the text view (``images=False``, the tiny CPU recipe) or, with ``images=True``, content parts
with the screenshot as a PNG data URL, as the teacher's. The loop sends the policy token ids of its chat
template, so with images the template's vision placeholders reach the engine but no pixels: a vision-language
policy needs its image inputs fed by the engine, which no engine here does yet (issue 19). Every screenshot stays
in the trajectory (the judges' evidence); the policy's prompts show only the last ``keep_images`` of them as
images (`GUIHarness.context`, the rule the SFT prefixes follow: `orchard.domains.gui.tools.policy_context`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from orchard.data import Message, ToolCall, Trajectory
from orchard.data.curation import check_tool_calls
from orchard.domains.gui.curation import sft_turn_samples
from orchard.domains.gui.judge import gui_rollout_reward
from orchard.domains.gui.session import BrowserSession
from orchard.domains.gui.tasks import GUITask, check_task
from orchard.domains.gui.teacher import GUI_SYSTEM
from orchard.domains.gui.tools import GUI_TOOLS, policy_context
from orchard.domains.gui.tools import Observation as BrowserObservation
from orchard.env import SandboxClient
from orchard.rollout.harness import EnvironmentFailure, InvalidToolCall, Observation
from orchard.rollout.rollouts import AgentLoopRollouts

__all__ = ["DONE_OBSERVATION", "BrowserSandbox", "BrowserSandboxes", "GUIHarness", "gui_rollouts"]

DONE_OBSERVATION = "The episode is over."
"""What ``done`` is answered with (the loop answers every call; the browser does nothing)."""


class BrowserSandbox:
    """One open `BrowserSession` as the agent loop's sandbox; ``response`` is the done response (None: none)."""

    def __init__(self, browser: BrowserSession) -> None:
        self.browser = browser
        self.sandbox_id = browser.sandbox.sandbox_id
        self.response: str | None = None

    async def delete(self) -> None:
        """Close the browser and delete its sandbox (idempotent)."""
        await asyncio.to_thread(self.browser.close)


class BrowserSandboxes:
    """The agent loop's sandbox client for GUI episodes: each ``create(seed=...)`` opens a browser on the sites of
    that seed in a sandbox of its own (`BrowserSession.open`).

    Args:
        client: the synchronous sandbox client (the session's terminal is synchronous).
        screenshots: the browsers take a screenshot for every observation (True: the policy sees images) or
            none (False: a text-only policy, whose steps need only the text view). Default True.
        **session_kwargs: the rest of `BrowserSession.open`'s keywords (``viewport``, ``image``, ...).
    """

    def __init__(self, client: SandboxClient, *, screenshots: bool = True, **session_kwargs: Any) -> None:
        if not isinstance(client, SandboxClient):
            raise ValueError(f"client must be a SandboxClient, got {type(client).__name__}")
        if not isinstance(screenshots, bool):
            raise ValueError(f"screenshots must be a bool, got {screenshots!r}")
        for name in ("seed", "text_view"):
            if name in session_kwargs:
                raise ValueError(f"session_kwargs may not set {name!r}: the task and the harness set it")
        self.client, self.screenshots, self.session_kwargs = client, screenshots, session_kwargs

    async def create(self, *, seed: int) -> BrowserSandbox:
        browser = await asyncio.to_thread(BrowserSession.open, self.client, seed=seed, text_view=True,
                                          screenshots=self.screenshots, **self.session_kwargs)
        return BrowserSandbox(browser)


def _task(task: Any) -> GUITask:
    if not isinstance(task, GUITask):
        raise ValueError(f"task must be a GUITask, got {type(task).__name__}")
    return task


class GUIHarness:
    """The GUI domain's `Harness` over `BrowserSandboxes`.

    Args:
        max_steps: the step budget in assistant turns (the paper's curriculum: 15, then 30). Default 15.
        images: tool observations as content parts with the screenshot (True) or the text view only (False).
        keep_images: the policy is shown only the last ``keep_images`` screenshots as images (`context`); None
            shows every one. The trajectory keeps them all.
    """

    def __init__(self, *, max_steps: int = 15, images: bool = False, keep_images: int | None = None) -> None:
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
        if not isinstance(images, bool):
            raise ValueError(f"images must be a bool, got {images!r}")
        policy_context([], keep_images)  # validates keep_images
        self.max_steps, self.images, self.keep_images = max_steps, images, keep_images

    def context(self, messages: list[Message]) -> list[Message]:
        """What the policy is shown of ``messages`` (the agent loop's hook): `policy_context` with ``keep_images``,
        as `orchard.domains.gui.curation.sft_turn_samples` trims its prefixes."""
        return policy_context(messages, self.keep_images)

    def system_prompt(self, task: Any) -> str | None:
        return GUI_SYSTEM

    def tools(self, task: Any) -> list[dict[str, Any]]:
        return GUI_TOOLS

    def sandbox_spec(self, task: Any) -> dict[str, Any]:
        return {"seed": _task(task).site_seed}

    def _content(self, obs: BrowserObservation) -> Any:
        if obs.env_error:
            raise EnvironmentFailure(f"the browser is gone: {obs.env_error}")
        return obs.to_content() if self.images and obs.screenshot else obs.describe()

    async def setup(self, sandbox: BrowserSandbox, task: Any) -> list[Message]:
        task = _task(task)
        obs = await asyncio.to_thread(sandbox.browser.reset, BrowserSession.url(task.start_path), fresh_state=True)
        content = self._content(obs)
        # the teacher's first message, so SFT data and the policy's prompts agree
        if isinstance(content, str):
            return [Message("user", f"{task.intent}\n\n{content}")]
        return [Message("user", [{"type": "text", "text": task.intent}, *content])]

    async def act(self, sandbox: BrowserSandbox, call: ToolCall, task: Any) -> Observation:
        issues = check_tool_calls(Trajectory([Message("assistant", None, [call])], GUI_TOOLS))
        if issues:
            raise InvalidToolCall("; ".join(f"{i.kind}: {i.detail}" for i in issues))
        arguments = call.arguments_dict()
        if call.name == "done":
            sandbox.response = arguments["response"]
            return Observation(DONE_OBSERVATION, done=True)
        obs = await asyncio.to_thread(sandbox.browser.step, call.name, arguments)
        return Observation(self._content(obs))

    async def evaluate(self, sandbox: BrowserSandbox, task: Any,
                       trajectory: Trajectory) -> float | tuple[float, dict[str, float]] | None:
        task = _task(task)
        state = await asyncio.to_thread(sandbox.browser.site_state)
        check = check_task(task, sandbox.response, state)
        trajectory.metadata.update(site_state=state, response=sandbox.response, blocked=check.blocked,
                                   check=check.reason)
        scored = gui_rollout_reward(trajectory, check.success, blocked=check.blocked)
        trajectory.metadata["reward_reason"] = scored.reason
        if scored.reward is None:
            return None
        return scored.reward, {"passed": float(check.success)}


def gui_rollouts(client: SandboxClient, tokenizer: Any, *, max_steps: int = 15, images: bool = False,
                 keep_images: int | None = None, processor: Any = None, max_tokens: int = 256,
                 seed: int | None = None,
                 session_kwargs: Mapping[str, Any] | None = None, **loop_kwargs: Any) -> AgentLoopRollouts:
    """The GUI domain's `Rollouts`: ``await rollouts(engine, tasks, group_size=..., temperature=...)`` plays each
    `GUITask` ``group_size`` times, one browser (sandbox) per episode, and returns scored trajectories with their
    training samples, task-major.

    Args:
        client: the synchronous `SandboxClient` the browsers' sandboxes are made with.
        tokenizer: the policy's chat tokenizer.
        max_steps: the step budget (15, then 30 in the paper's curriculum).
        images: screenshots in the tool observations (True) or the text view only (False, the tiny recipe).
        keep_images: the policy's prompts keep only the last ``keep_images`` screenshots as images (None: all);
            give the SFT samples the same (`sft_turn_samples`' ``keep_images``).
        processor: with ``images``, the policy's image processor (Qwen-VL family): each rollout is rendered one
            sample per assistant turn, its prefix trimmed to ``keep_images`` screenshots as the prompt was
            (`sft_turn_samples`), each with the trajectory's reward. None: one text sample per rollout (a
            trajectory with screenshots then cannot be rendered: pass it).
        max_tokens: per assistant turn when a call gives none.
        seed: seeds the loop's start jitter.
        session_kwargs: `BrowserSession.open` keywords (``viewport``, ``image``, ...).
        **loop_kwargs: the rest of `AgentLoop`'s (``concurrency``, ``max_time_s``, ``max_format_errors`` (3) ...).
    """
    for name in ("one_call_per_turn", "require_tool_call"):
        if name in loop_kwargs:
            raise ValueError(f"loop_kwargs may not set {name!r}: a GUI turn is one or more actions")
    if "screenshots" in (session_kwargs or {}):
        raise ValueError("session_kwargs may not set 'screenshots': images sets it")
    if processor is not None and not images:
        raise ValueError("processor is given but images=False: the text view has no screenshots to render")
    render = None if processor is None else (
        lambda traj: sft_turn_samples([traj], tokenizer, keep_images=keep_images, processor=processor))
    # a text-only policy never sees a screenshot, and taking one costs more than the rest of a step
    return AgentLoopRollouts(BrowserSandboxes(client, screenshots=images, **dict(session_kwargs or {})),
                             GUIHarness(max_steps=max_steps, images=images, keep_images=keep_images), tokenizer,
                             max_tokens=max_tokens, seed=seed, render=render, require_tool_call=True,
                             **loop_kwargs)
