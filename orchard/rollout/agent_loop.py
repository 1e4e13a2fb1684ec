"""The agent loop: ReAct rollouts of a policy `Engine` in sandboxes, through a `Harness`, into `Trajectory`s.

One rollout::

    sandbox = client.create(**harness.sandbox_spec(task))          # retried; failure -> env_error; kept alive
    messages = [system] + harness.setup(sandbox, task)             # failure -> env_error
    repeat up to max_steps:
        context = harness.context(messages) if it has one, else messages   # what the policy is shown
        prompt ids = previous ids + tokens of the new context       # render prefix (no re-tokenization)
        sampled ids, log-probs = engine.generate(prompt ids)        # retried; per-call timeout
        prompt ids += sampled ids (+ template tail)                 # splice
        parse tool calls; a malformed one -> no call of the turn runs, an error observation, counted in
            metadata["format_errors"] (as are unknown tools and unusable arguments, and, with
            one_call_per_turn, a turn without exactly one call, with require_tool_call a turn without any)
        no call and no error -> done (a harness with a ``no_call_reply`` text: that user message, and a format
            error: its convention ends an episode only by a tool); K consecutive erroring turns -> format_error
        each call -> harness.act -> tool message                    # env failure -> env_error
    reward = harness.evaluate(sandbox, task, trajectory)            # unless env_error
    sandbox deleted (always)

`AgentLoop.continue_from` plays the same loop from a state of an earlier episode: a forked sandbox and the messages
up to that state instead of creation and set-up (Monte-Carlo turn values, `orchard.rollout.turn_values`).

No drift: the prompt of every turn is built exactly as `orchard.data.render_trajectory` renders the finished
trajectory (the chat template's text after the previous turn is tokenized and appended; every assistant turn is its
sampled ids, followed by the template's tail after the end-of-turn token, which is added as context when the sample
was cut by ``max_tokens``). So the trainer's input ids equal, token for token, what the engine saw.

A harness may show the policy less than the trajectory keeps: its optional ``context(messages)`` gives the
messages a turn's prompt is built from (the GUI keeps only the last k screenshots as images), while the trajectory
keeps every message (a judge's evidence). When the context drops what an earlier prompt held, that turn's prompt
is tokenized whole (``metadata["prefix_breaks"]`` counts it).

Budgets and layered timeouts: ``max_steps`` assistant turns (``step_budget``), ``max_time_s`` of wall clock per
rollout (``time_budget``; checked before each turn and bounding every call), ``model_timeout_s`` per model call
(retried ``model_retries`` times), ``env_timeout_s`` per sandbox call (sandbox creation retried ``env_retries``
times; execs are not retried here, the client retries transport failures with idempotency keys). A model that
keeps failing is an infrastructure failure and is marked ``env_error`` too (``metadata["error"]`` says which).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

from orchard._extras import requires_extra
from orchard._retry import backoff_s

with requires_extra("rollout"):
    import httpx

from orchard.data import Message, Trajectory
from orchard.env.errors import SandboxError
from orchard.rollout.engine import Completion, Engine, GenerateRequest, SamplingParams, derive_seed
from orchard.rollout.harness import (
    EnvironmentFailure,
    Harness,
    InvalidToolCall,
    Observation,
    keep_alive,
    task_id,
)
from orchard.rollout.tool_calls import parse_tool_calls

ENV_ERRORS: tuple[type[BaseException], ...] = (
    SandboxError,
    EnvironmentFailure,
    ConnectionError,
    asyncio.TimeoutError,  # on Python 3.10 not the builtin TimeoutError, which OSError covers
    OSError,
    httpx.HTTPError,
)
"""Exceptions that mean the environment failed (the rollout is marked ``env_error``, never scored)."""


class _EnvFailed(Exception):
    pass


class _OutOfTime(Exception):
    pass


class PromptBuilder:
    """Token ids of a growing conversation, built the way `orchard.data.render_trajectory` renders it.

    Args:
        tokenizer: a transformers tokenizer with a prefix-consistent chat template; its eos is the end-of-turn.
        tools: the tool schemas rendered into the system turn.
    """

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> None:
        if getattr(tokenizer, "chat_template", None) is None or tokenizer.eos_token_id is None:
            raise ValueError("tokenizer must have a chat_template and an eos token (the end-of-turn token)")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.eot_id: int = tokenizer.eos_token_id
        self.eot_text: str = tokenizer.eos_token
        self.ids: list[int] = []
        self.prefix_breaks = 0
        """Turns at which the template was not prefix-consistent (the prompt was re-tokenized whole)."""
        self._rendered = ""
        self._prompt_text = ""

    def _template(self, messages: Sequence[Message], gen: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [m.to_openai() for m in messages], tools=self.tools, tokenize=False, add_generation_prompt=gen
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def prompt(self, messages: Sequence[Message]) -> list[int]:
        """The ids to sample the next assistant turn from: everything so far plus the new context and the
        generation prompt."""
        text = self._template(messages, gen=True)
        if text.startswith(self._rendered):
            self.ids.extend(self._encode(text[len(self._rendered) :]))
        else:
            self.prefix_breaks += 1
            self.ids = self._encode(text)
        self._prompt_text = text
        return list(self.ids)

    def add_assistant(self, messages: Sequence[Message], sampled: Sequence[int]) -> None:
        """Splice the sampled ids of the assistant turn that ends ``messages`` into the running ids."""
        full = self._template(messages, gen=False)
        delta = full[len(self._prompt_text) :] if full.startswith(self._prompt_text) else ""
        cut = delta.rfind(self.eot_text)
        tail = delta[cut + len(self.eot_text) :] if cut >= 0 else ""
        self.ids.extend(sampled)
        if not sampled or sampled[-1] != self.eot_id:
            self.ids.append(
                self.eot_id
            )  # a turn cut by max_tokens: the template closes it (context, not action)
        self.ids.extend(self._encode(tail))
        self._rendered = full


class AgentLoop:
    """Runs rollouts of ``engine`` in sandboxes of ``client`` through ``harness``.

    Args:
        engine: the policy (`HFEngine`, `VLLMEngine`, `OpenAIEngine`, ...).
        client: an ``orchard.env.AsyncSandboxClient`` (anything with ``await create(**spec)`` returning a sandbox
            with ``await delete()``).
        harness: the domain's `Harness`.
        tokenizer: the policy's tokenizer (chat template with tool calls; eos = end-of-turn token).
        sampling: sampling parameters of every turn; the end-of-turn token is always a stop token and ``n`` must
            be 1. Default: temperature 1, top_p 1, 512 tokens.
        max_steps: assistant turns per rollout; default ``harness.max_steps``.
        max_time_s: wall-clock budget of one rollout (sandbox creation to the last step). Default 600.
        model_timeout_s: per model call. Default 300.
        model_retries: extra attempts of a failed or timed-out model call. Default 2.
        env_timeout_s: per sandbox call (create, set-up, each tool call, evaluation). Default 300.
        env_retries: extra attempts of sandbox creation. Default 2.
        max_format_errors: consecutive turns with a malformed or unknown tool call that end the rollout with
            ``format_error``. Default 3.
        one_call_per_turn: every turn must make exactly one tool call: a turn with none or with several runs
            none, keeps its raw text and counts as a format error, instead of a call-less turn ending the rollout
            (for harnesses whose only termination is a tool, one action a step). Default False.
        require_tool_call: every turn must make at least one tool call: a turn with none counts as a format
            error instead of ending the rollout; several calls run in order (for harnesses whose only termination
            is a tool: the GUI's ``done``). Default False.
        max_prompt_tokens: a prompt longer than this ends the rollout before sampling, as ``step_budget`` with
            ``metadata["context_exhausted"] = True`` (the context is a budget too). Default None: no limit.
        concurrency: rollouts in flight at once in `run_many`. Default 8.
        start_jitter_s: each rollout of `run_many` first sleeps uniform(0, start_jitter_s), so a large batch does
            not hit the sandbox service and the engine in one burst. Default 1.0.
        retry_backoff_s: base of the backoff between retries (`orchard._retry.backoff_s`: retry k waits
            uniform(c/2, c), c = min(10, retry_backoff_s * 2**k) seconds). Default 0.5.
        progress: show a progress bar in `run_many`. Default True.
        seed: seeds the start jitter and the retry backoff (not the sampling: see `run` and `run_many`).
    """

    def __init__(
        self,
        engine: Engine,
        client: Any,
        harness: Harness,
        tokenizer: Any,
        *,
        sampling: SamplingParams | None = None,
        max_steps: int | None = None,
        max_time_s: float = 600.0,
        model_timeout_s: float = 300.0,
        model_retries: int = 2,
        env_timeout_s: float = 300.0,
        env_retries: int = 2,
        max_format_errors: int = 3,
        one_call_per_turn: bool = False,
        require_tool_call: bool = False,
        max_prompt_tokens: int | None = None,
        concurrency: int = 8,
        start_jitter_s: float = 1.0,
        retry_backoff_s: float = 0.5,
        progress: bool = True,
        seed: int | None = None,
    ) -> None:
        if not hasattr(engine, "generate"):
            raise ValueError(f"engine must implement Engine.generate, got {type(engine).__name__}")
        if not hasattr(client, "create"):
            raise ValueError(
                f"client must be an AsyncSandboxClient (with create), got {type(client).__name__}"
            )
        for name in ("system_prompt", "tools", "sandbox_spec", "setup", "act", "evaluate"):
            if not callable(getattr(harness, name, None)):
                raise ValueError(f"harness must implement Harness.{name}, got {type(harness).__name__}")
        if getattr(harness, "context", None) is not None and not callable(harness.context):
            raise ValueError(f"harness.context must be callable (messages -> messages), got {harness.context!r}")
        for name, flag in (("one_call_per_turn", one_call_per_turn), ("require_tool_call", require_tool_call)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool, got {flag!r}")
        sampling = sampling or SamplingParams(max_tokens=512)
        if not isinstance(sampling, SamplingParams) or sampling.n != 1:
            raise ValueError(
                f"sampling must be SamplingParams with n=1 (one rollout per sample), got {sampling!r}"
            )
        steps = harness.max_steps if max_steps is None else max_steps
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"max_steps must be an int >= 1, got {steps!r}")
        for name, value in (
            ("max_time_s", max_time_s),
            ("model_timeout_s", model_timeout_s),
            ("env_timeout_s", env_timeout_s),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        for name, value in (("model_retries", model_retries), ("env_retries", env_retries)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not isinstance(max_format_errors, int) or max_format_errors < 1:
            raise ValueError(f"max_format_errors must be an int >= 1, got {max_format_errors!r}")
        if max_prompt_tokens is not None and (
            not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1
        ):
            raise ValueError(f"max_prompt_tokens must be an int >= 1 or None, got {max_prompt_tokens!r}")
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
        if not start_jitter_s >= 0 or not retry_backoff_s >= 0:
            raise ValueError(
                f"start_jitter_s and retry_backoff_s must be >= 0, got {start_jitter_s}, {retry_backoff_s}"
            )
        eot = tokenizer.eos_token_id
        stops = sampling.stop_token_ids if eot in sampling.stop_token_ids else (*sampling.stop_token_ids, eot)
        self.engine = engine
        self.client = client
        self.harness = harness
        self.tokenizer = tokenizer
        self.sampling = SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            stop_token_ids=stops,
            seed=sampling.seed,
            n=1,
        )
        self.max_steps = steps
        self.max_time_s = float(max_time_s)
        self.model_timeout_s = float(model_timeout_s)
        self.model_retries = model_retries
        self.env_timeout_s = float(env_timeout_s)
        self.env_retries = env_retries
        self.max_format_errors = max_format_errors
        self.one_call_per_turn = one_call_per_turn
        self.require_tool_call = require_tool_call
        self._context: Callable[[list[Message]], list[Message]] = getattr(harness, "context", None) or list
        self.max_prompt_tokens = max_prompt_tokens
        self.concurrency = concurrency
        self.start_jitter_s = float(start_jitter_s)
        self.retry_backoff_s = float(retry_backoff_s)
        self.progress = progress
        self._rng = random.Random(seed)

    # ---- calls with timeouts and retries ------------------------------------------------------------------------

    def _backoff(self, attempt: int) -> float:
        return backoff_s(attempt, base_s=self.retry_backoff_s, rng=self._rng)

    async def _env_call(
        self, what: str, make: Callable[[], Awaitable[Any]], deadline: float | None, retries: int = 0
    ) -> Any:
        """One sandbox call under min(env_timeout_s, time left); env failures -> _EnvFailed after retries."""
        for attempt in range(retries + 1):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise _OutOfTime(what)
            budget_binds = left is not None and left < self.env_timeout_s
            try:
                return await asyncio.wait_for(make(), self.env_timeout_s if not budget_binds else left)
            except asyncio.TimeoutError as exc:
                if budget_binds:
                    raise _OutOfTime(what) from exc
                error: BaseException = exc
            except ENV_ERRORS as exc:
                error = exc
            if attempt < retries:
                await asyncio.sleep(self._backoff(attempt))
        raise _EnvFailed(f"{what}: {type(error).__name__}: {error}") from error

    async def _model_call(self, prompt_ids: list[int], deadline: float, seed: int | None
                          ) -> tuple[Completion, int]:
        request = GenerateRequest(prompt_ids, replace(self.sampling, seed=seed))
        for attempt in range(self.model_retries + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                raise _OutOfTime("model")
            budget_binds = left < self.model_timeout_s
            try:
                result = (
                    await asyncio.wait_for(self.engine.generate([request]), min(left, self.model_timeout_s))
                )[0]
                return result.completions[0], result.weight_version
            except asyncio.TimeoutError as exc:
                if budget_binds:
                    raise _OutOfTime("model") from exc
                error: BaseException = exc
            except Exception as exc:  # an engine that keeps failing is an infrastructure failure
                error = exc
            if attempt < self.model_retries:
                await asyncio.sleep(self._backoff(attempt))
        raise _EnvFailed(f"model: {type(error).__name__}: {error}") from error

    # ---- one rollout --------------------------------------------------------------------------------------------

    def _assistant_message(self, completion: Completion, step: int) -> tuple[Message, list[str]]:
        """The assistant message of a completion (content, every parsed call, sampled ids) and its parse errors."""
        ids = completion.token_ids
        ended = completion.finish_reason == "stop" and ids and ids[-1] in self.sampling.stop_token_ids
        text = self.tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
        parsed = parse_tool_calls(text)
        errors = list(parsed.errors)
        if self.one_call_per_turn and not errors and len(parsed.tool_calls) != 1:
            errors.append(f"exactly one tool call a turn is required, got {len(parsed.tool_calls)}")
        if self.require_tool_call and not errors and not parsed.tool_calls:
            errors.append("a tool call a turn is required, got none")
        if errors:
            # A turn with a malformed call runs none of its calls and keeps its raw text, so the trajectory
            # re-renders to exactly the sampled text.
            message = Message("assistant", text, token_ids=list(ids), logprobs=list(completion.logprobs))
            return message, [*errors, "no tool was run this turn"]
        for j, call in enumerate(parsed.tool_calls):
            call.id = f"call_{step}_{j}"  # unique within the trajectory (the template does not render ids)
        content = parsed.content if parsed.content or not parsed.tool_calls else None
        message = Message(
            "assistant", content, parsed.tool_calls, token_ids=list(ids), logprobs=list(completion.logprobs)
        )
        return message, []

    async def run(self, task: Any, *, group_id: str | None = None, index: int = 0,
                  seed: int | None = None) -> Trajectory:
        """One rollout of ``task``; never raises for environment or model failures (``env_error``).

        ``seed`` (default ``sampling.seed``) seeds the episode: turn ``k`` samples with ``derive_seed(seed, k)``, so
        the episode is the same wherever and beside whatever it is played. None leaves sampling to the engine.
        """
        system = self.harness.system_prompt(task)
        return await self._play(task, lambda: self.client.create(**self.harness.sandbox_spec(task)),
                                [Message("system", system)] if system else [], setup=True, group_id=group_id,
                                index=index, seed=seed, max_steps=self.max_steps)

    async def continue_from(self, task: Any, fork: Callable[[], Awaitable[Any]], messages: Sequence[Message], *,
                            max_steps: int | None = None, group_id: str | None = None, index: int = 0,
                            seed: int | None = None) -> Trajectory:
        """A rollout of ``task`` that starts from a state of an earlier episode instead of from set-up.

        ``await fork()`` gives the sandbox (retried ``env_retries`` times, like creation), whose workspace holds
        the state (``AsyncSnapshot.fork``); ``messages`` is the conversation up to that state (system and task
        messages included), which the policy continues. No set-up runs. The trajectory holds ``messages`` followed
        by the continuation; ``metadata["steps"]`` and the other counts are the continuation's own, and
        ``metadata["prefix_steps"]`` the assistant turns of ``messages``. ``max_steps`` (default the loop's) may be
        0: the state is scored as it is. Scored by ``harness.evaluate``; never raises for environment or model
        failures (``env_error``).
        """
        steps = self.max_steps if max_steps is None else max_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"max_steps must be an int >= 0, got {steps!r}")
        prefix = list(messages)
        if not all(isinstance(m, Message) for m in prefix):
            raise ValueError("messages must be a sequence of orchard.data.Message")
        if not callable(fork):
            raise ValueError(f"fork must be a callable that returns an awaitable sandbox, got {fork!r}")

        traj = await self._play(task, fork, prefix, setup=False, group_id=group_id, index=index, seed=seed,
                                max_steps=steps)
        traj.metadata["prefix_steps"] = sum(m.role == "assistant" for m in prefix)
        return traj

    async def _play(self, task: Any, make_sandbox: Callable[[], Awaitable[Any]], opening: list[Message], *,
                    setup: bool, group_id: str | None, index: int, seed: int | None, max_steps: int) -> Trajectory:
        """The rollout in the sandbox ``await make_sandbox()`` gives (retried), from the ``opening`` messages (and,
        with ``setup``, the harness's set-up and its messages) to the verdict."""
        seed = self.sampling.seed if seed is None else seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        t0 = time.monotonic()
        deadline = t0 + self.max_time_s
        tid = task_id(task, default=f"task-{index}")
        tools = self.harness.tools(task)
        names = {t.get("function", t).get("name") for t in tools}
        messages = list(opening)
        # tool-call ids go on from the opening's turns, so they stay unique in a continued trajectory
        offset = sum(m.role == "assistant" for m in messages)
        meta: dict[str, Any] = {
            "format_errors": 0,
            "steps": 0,
            "model_calls": 0,
            "tool_calls": 0,
            "weight_versions": [],
            "model_s": 0.0,
            "env_s": 0.0,
            "cut_turns": 0,
            "prompt_tokens": 0,
            "sampled_tokens": 0,
        }
        termination = "step_budget"
        reward: Any = None
        sandbox = None
        builder = PromptBuilder(self.tokenizer, tools)
        no_call_reply = getattr(self.harness, "no_call_reply", None)
        try:
            e0 = time.monotonic()
            sandbox = await self._env_call("create" if setup else "fork", make_sandbox, deadline, self.env_retries)
            keep_alive(sandbox)
            meta["sandbox_id"] = getattr(sandbox, "sandbox_id", None)
            if setup:
                messages += await self._env_call("setup", lambda: self.harness.setup(sandbox, task), deadline)
            meta["env_s"] += time.monotonic() - e0
            consecutive = 0
            for _ in range(max_steps):
                if time.monotonic() >= deadline:
                    termination = "time_budget"
                    break
                prompt_ids = builder.prompt(self._context(messages))
                if self.max_prompt_tokens is not None and len(prompt_ids) > self.max_prompt_tokens:
                    meta["context_exhausted"] = True
                    break
                m0 = time.monotonic()
                turn_seed = None if seed is None else derive_seed(seed, meta["steps"])
                completion, version = await self._model_call(prompt_ids, deadline, turn_seed)
                meta["model_s"] += time.monotonic() - m0
                meta["model_calls"] += 1
                meta["prompt_tokens"] += len(prompt_ids)
                meta["sampled_tokens"] += len(completion.token_ids)
                meta["steps"] += 1
                meta["weight_versions"].append(version)
                meta["cut_turns"] += completion.finish_reason == "length"
                assistant, parse_errors = self._assistant_message(completion, offset + meta["steps"] - 1)
                messages.append(assistant)
                builder.add_assistant(self._context(messages), completion.token_ids)
                no_call = not assistant.tool_calls and not parse_errors
                if no_call and no_call_reply is None:
                    termination = "done"
                    break
                if no_call:  # a convention where only a tool ends the episode: a format error, answered
                    messages.append(Message("user", no_call_reply))
                turn_error = bool(parse_errors) or no_call
                done = False
                e0 = time.monotonic()
                for call in assistant.tool_calls:
                    if call.name not in names:
                        obs = Observation(f"Error: unknown tool {call.name!r}; available: {sorted(names)}")
                        turn_error = True
                    else:
                        try:
                            obs = await self._env_call(
                                f"tool {call.name}",
                                lambda c=call: self.harness.act(sandbox, c, task),
                                deadline,
                            )
                        except InvalidToolCall as exc:
                            obs = Observation(f"Error: {exc}")
                            turn_error = True
                        meta["tool_calls"] += 1
                    messages.append(Message("tool", obs.content, tool_call_id=call.id, name=call.name))
                    done = done or obs.done
                meta["env_s"] += time.monotonic() - e0
                if parse_errors:  # calls that could not be parsed have no id to answer: one error message
                    messages.append(Message("tool", "Error: " + "; ".join(parse_errors)))
                if turn_error:
                    meta["format_errors"] += 1
                    consecutive += 1
                else:
                    consecutive = 0
                if done:
                    termination = "done"
                    break
                if consecutive >= self.max_format_errors:
                    termination = "format_error"
                    break
        except _OutOfTime:
            termination = "time_budget"
        except _EnvFailed as exc:
            termination = "env_error"
            meta["error"] = str(exc)
        traj = Trajectory(
            messages=messages,
            tools=tools,
            task_id=tid,
            group_id=group_id,
            termination_reason=termination,
            metadata=meta,
        )  # type: ignore[arg-type]
        try:
            if sandbox is not None and termination != "env_error":
                reward = await self._env_call(
                    "evaluate", lambda: self.harness.evaluate(sandbox, task, traj), None
                )
        except _EnvFailed as exc:
            traj.termination_reason = "env_error"
            meta["error"] = str(exc)
        finally:
            if sandbox is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(sandbox.delete()), self.env_timeout_s)
        if traj.termination_reason != "env_error" and reward is not None:
            value, components = reward if isinstance(reward, tuple) else (reward, {})
            traj.reward = float(value)
            traj.reward_components = {k: float(v) for k, v in components.items()}
        meta["prefix_breaks"] = builder.prefix_breaks
        meta["wall_s"] = time.monotonic() - t0
        return traj

    async def run_many(self, tasks: Sequence[Any], *, group_size: int = 1,
                       seed: int | None = None) -> list[Trajectory]:
        """``group_size`` rollouts of every task, at most ``concurrency`` at once; results in task order (a task's
        group together), each with ``group_id`` = its task id.

        ``seed`` (default ``sampling.seed``) seeds rollout ``j`` of the task with id ``t`` with
        ``derive_seed(seed, t, j)``: a task's episodes do not depend on which other tasks share the call, so a run
        split into blocks (ranks) samples exactly the episodes of one call over every task. None leaves sampling to
        the engine.
        """
        if isinstance(tasks, (str, bytes)) or not isinstance(tasks, Sequence):
            raise ValueError(f"tasks must be a sequence, got {type(tasks).__name__}")
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        with requires_extra("rollout"):
            from tqdm.auto import tqdm

        semaphore = asyncio.Semaphore(self.concurrency)
        seed = self.sampling.seed if seed is None else seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        jobs = [(i, task, j) for i, task in enumerate(tasks) for j in range(group_size)]
        counts: dict[str, int] = {}
        bar = tqdm(total=len(jobs), desc="rollouts", disable=not self.progress, dynamic_ncols=True)

        async def one(i: int, task: Any, j: int) -> Trajectory:
            await asyncio.sleep(self._rng.uniform(0, self.start_jitter_s))
            tid = task_id(task, default=f"task-{i}")
            async with semaphore:
                traj = await self.run(task, group_id=tid, index=i,
                                      seed=None if seed is None else derive_seed(seed, tid, j))
            counts[traj.termination_reason] = counts.get(traj.termination_reason, 0) + 1
            bar.set_postfix(counts, refresh=False)
            bar.update(1)
            return traj

        try:
            return list(await asyncio.gather(*(one(i, task, j) for i, task, j in jobs)))
        finally:
            bar.close()
