"""The trajectory schema: OpenAI chat messages with tool calls, sampled token ids and log-probs, reward, termination.

A :class:`Trajectory` is what one rollout produces and what training consumes. It is plain data: every field is
JSON-native (str, int, float, bool, None, list, dict), ``to_dict`` / ``from_dict`` round-trip it exactly, and the
dict form of a message is an OpenAI chat message (plus ``token_ids`` / ``logprobs`` on assistant turns), so a
trajectory can be fed to any OpenAI-compatible client or chat template after :meth:`Trajectory.openai_messages`.

Dict form of one trajectory::

    {"messages": [{"role": "system", "content": "..."},
                  {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "...", "tool_calls": [
                      {"id": "call_0", "type": "function",
                       "function": {"name": "exec", "arguments": "{\\"command\\": \\"ls\\"}"}}],
                   "token_ids": [...], "logprobs": [...]},
                  {"role": "tool", "tool_call_id": "call_0", "name": "exec", "content": "..."}],
     "tools": [{"type": "function", "function": {"name": "exec", "parameters": {...}}}],
     "reward": 1.0, "reward_components": {"tests": 1.0}, "task_id": "t1", "group_id": "g1",
     "termination_reason": "done", "metadata": {}}
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = get_args(Role)
"""The chat roles a message may have. ``developer`` (OpenAI's newer name for ``system``) is read as ``system``."""

TerminationReason = Literal["done", "step_budget", "time_budget", "format_error", "env_error"]
TERMINATION_REASONS: tuple[str, ...] = get_args(TerminationReason)
"""Why a rollout ended: the agent finished (``done``), ran out of steps or wall-clock time, produced output that
could not be parsed (``format_error``), or the environment failed (``env_error``: not the policy's fault, so such a
trajectory is dropped, never scored 0)."""

_MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id", "name", "token_ids", "logprobs"})
# Keys of the ``openai`` client's ``ChatCompletionMessage.model_dump()`` that the schema has no field for: null (or
# an empty list) is dropped, anything else is refused, since dropping it would lose what the model returned.
_OPENAI_UNSUPPORTED_KEYS = ("refusal", "annotations", "audio")
_TRAJECTORY_KEYS = frozenset(
    {
        "messages",
        "tools",
        "reward",
        "reward_components",
        "task_id",
        "group_id",
        "termination_reason",
        "metadata",
    }
)


def _check_str_or_none(value: Any, name: str) -> None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name} must be a str or None, got {type(value).__name__}")


def _check_finite_float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a finite float, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite float, got {value!r}")
    return value


def _image_url(part: Mapping[str, Any]) -> str:
    image = part["image_url"]
    return image if isinstance(image, str) else image["url"]


def _check_content_part(part: Any, index: int) -> None:
    """An OpenAI content part: a mapping with a str ``type``; ``text`` parts carry a str ``text``, ``image_url``
    parts an ``image_url`` that is ``{"url": str, ...}`` (or the bare URL string some clients send)."""
    if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
        raise ValueError(f"Message.content[{index}] must be a content part with a str 'type', got {part!r:.200}")
    if part["type"] == "text" and not isinstance(part.get("text"), str):
        raise ValueError(f"Message.content[{index}]: a text part needs a str 'text', got {part!r:.200}")
    if part["type"] == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, Mapping) else image
        if not isinstance(url, str):
            raise ValueError(
                f"Message.content[{index}]: an image_url part needs 'image_url': {{'url': str}}, got {part!r:.200}"
            )


@dataclass
class ToolCall:
    """One function call requested by an assistant turn.

    ``arguments`` is kept as the model (or harness) gave it: a dict, or a JSON string that may even be malformed
    (a policy's format error is data too). :meth:`arguments_dict` parses on access; :meth:`arguments_json` gives
    the string form. ``to_dict`` writes the OpenAI shape
    ``{"id", "type": "function", "function": {"name", "arguments"}}`` with ``arguments`` in its original form.
    """

    name: str
    arguments: dict[str, Any] | str = field(default_factory=dict)
    id: str | None = None
    type: str = "function"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"ToolCall.name must be a str, got {type(self.name).__name__}")
        if not isinstance(self.arguments, (dict, str)):
            raise ValueError(
                f"ToolCall.arguments must be a dict or a JSON string, got {type(self.arguments).__name__}"
            )
        _check_str_or_none(self.id, "ToolCall.id")
        if self.type != "function":
            raise ValueError(f"ToolCall.type must be 'function', got {self.type!r}")

    def parse_arguments(self) -> tuple[dict[str, Any] | None, str | None]:
        """``(arguments_dict, None)`` when the arguments are a JSON object, else ``(None, reason)``."""
        if isinstance(self.arguments, dict):
            return self.arguments, None
        try:
            parsed = json.loads(self.arguments)
        except json.JSONDecodeError as exc:
            return None, f"arguments are not valid JSON: {exc.msg} at char {exc.pos}"
        if not isinstance(parsed, dict):
            return None, f"arguments must be a JSON object, got {type(parsed).__name__}"
        return parsed, None

    def arguments_dict(self) -> dict[str, Any]:
        """The arguments as a dict (parsed from JSON if given as a string); ``ValueError`` when unparseable."""
        parsed, reason = self.parse_arguments()
        if parsed is None:
            raise ValueError(f"tool call {self.name!r} (id {self.id!r}): {reason}")
        return parsed

    def arguments_json(self) -> str:
        """The arguments as a JSON string: the original string if one was given, else ``json.dumps`` of the dict."""
        if isinstance(self.arguments, str):
            return self.arguments
        return json.dumps(self.arguments, ensure_ascii=False)

    def to_dict(self) -> dict[str, Any]:
        """OpenAI shape; ``id`` is omitted when None."""
        out: dict[str, Any] = {}
        if self.id is not None:
            out["id"] = self.id
        out["type"] = self.type
        out["function"] = {"name": self.name, "arguments": self.arguments}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ToolCall:
        """Read the OpenAI shape ``{"id", "type", "function": {"name", "arguments"}}`` or the flat
        ``{"id", "name", "arguments"}`` some harnesses emit. Missing ``arguments`` reads as ``{}``."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a tool call must be a mapping, got {type(data).__name__}")
        fn = data.get("function", data)
        if not isinstance(fn, Mapping):
            raise ValueError(f"tool call 'function' must be a mapping, got {type(fn).__name__}")
        if "name" not in fn:
            raise ValueError(f"tool call has no function name: {dict(data)!r}")
        arguments = fn.get("arguments")
        return cls(
            name=fn["name"],
            arguments={} if arguments is None else arguments,
            id=data.get("id"),
            type=data.get("type", "function"),
        )


@dataclass
class Message:
    """One OpenAI chat message, plus the sampled tokens of an assistant turn.

    Fields:
        role: ``system``, ``user``, ``assistant`` or ``tool``; ``developer`` is stored as ``system``.
        content: the text, a list of OpenAI content parts (kept as given; each a mapping with a str ``type``:
            ``{"type": "text", "text": ...}``, ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``
            and others; images only in system, user and tool turns), or None (an assistant turn that only calls
            tools).
        tool_calls: assistant only: the calls this turn made.
        tool_call_id: tool only: the id of the call this message answers.
        name: tool only: the name of the tool that answered (optional).
        token_ids: assistant only: the exact token ids the engine sampled for this turn, including the
            end-of-turn token it emitted (``<|im_end|>``); None when unknown (e.g. SFT data from text).
        logprobs: assistant only: the sampling log-probs, aligned 1:1 with ``token_ids``; None when unknown.
    """

    role: Role
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None

    def __post_init__(self) -> None:
        if self.role == "developer":
            # OpenAI renamed the system role for its reasoning models; chat templates of open models know only
            # ``system``, so the trajectory stores that (a developer message writes back as a system message).
            self.role = "system"
        if self.role not in ROLES:
            raise ValueError(
                f"Message.role must be one of {list(ROLES)} (or 'developer', read as 'system'), got {self.role!r}"
            )
        if self.content is not None and not isinstance(self.content, (str, list)):
            raise ValueError(
                f"Message.content must be a str, a list of parts or None, got {type(self.content).__name__}"
            )
        if isinstance(self.content, list):
            for p, part in enumerate(self.content):
                _check_content_part(part, p)
            if self.role == "assistant" and self.image_urls:
                raise ValueError("Message.content of an assistant message must not hold images (a policy emits text)")
        if not isinstance(self.tool_calls, list):
            raise ValueError(f"Message.tool_calls must be a list, got {type(self.tool_calls).__name__}")
        self.tool_calls = [c if isinstance(c, ToolCall) else ToolCall.from_dict(c) for c in self.tool_calls]
        if self.tool_calls and self.role != "assistant":
            raise ValueError(
                f"Message.tool_calls is only allowed on assistant messages, got role {self.role!r}"
            )
        _check_str_or_none(self.tool_call_id, "Message.tool_call_id")
        _check_str_or_none(self.name, "Message.name")
        if self.role != "assistant" and (self.token_ids is not None or self.logprobs is not None):
            raise ValueError(
                f"Message.token_ids / logprobs are only allowed on assistant messages, got role {self.role!r}"
            )
        if self.token_ids is not None and (
            not isinstance(self.token_ids, list)
            or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.token_ids)
        ):
            raise ValueError(
                f"Message.token_ids must be a list of non-negative ints, got {self.token_ids!r:.200}"
            )
        if self.logprobs is not None:
            if self.token_ids is None:
                raise ValueError("Message.logprobs given without token_ids; they must be aligned 1:1")
            if not isinstance(self.logprobs, list):
                raise ValueError(
                    f"Message.logprobs must be a list of floats, got {type(self.logprobs).__name__}"
                )
            if len(self.logprobs) != len(self.token_ids):
                raise ValueError(
                    f"Message.logprobs must align 1:1 with token_ids: got {len(self.logprobs)} logprobs "
                    f"for {len(self.token_ids)} token ids"
                )
            self.logprobs = [
                _check_finite_float(lp, f"Message.logprobs[{i}]") for i, lp in enumerate(self.logprobs)
            ]

    @property
    def text(self) -> str:
        """The content as one string: '' for None, text parts joined for a list of parts."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.get("text", "") for p in self.content if isinstance(p, Mapping))

    @property
    def image_urls(self) -> list[str]:
        """The URLs of the content's image parts (``{"type": "image_url", "image_url": {"url": ...}}``), in order."""
        if not isinstance(self.content, list):
            return []
        return [_image_url(part) for part in self.content if part["type"] == "image_url"]

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI chat message (no ``token_ids`` / ``logprobs``), as chat templates and clients take it."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def to_dict(self) -> dict[str, Any]:
        """:meth:`to_openai` plus ``token_ids`` / ``logprobs`` when known."""
        out = self.to_openai()
        if self.token_ids is not None:
            out["token_ids"] = list(self.token_ids)
        if self.logprobs is not None:
            out["logprobs"] = list(self.logprobs)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Message:
        """Read :meth:`to_dict` output or any OpenAI chat message (unknown keys are rejected).

        What the ``openai`` client returns (``ChatCompletionMessage.model_dump()``) is read as is: its
        ``refusal`` / ``annotations`` / ``audio`` keys are dropped when null (or an empty list) and refused, naming
        the key, when they hold something the schema cannot keep; a legacy ``function_call`` becomes the turn's one
        tool call (without an id).
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"a message must be a mapping, got {type(data).__name__}")
        data = dict(data)
        for key in _OPENAI_UNSUPPORTED_KEYS:
            value = data.pop(key, None)
            if value is not None and value != []:
                raise ValueError(
                    f"message field {key!r} is not supported by the trajectory schema, got {value!r:.100}"
                )
        function_call = data.pop("function_call", None)
        if function_call is not None:
            if data.get("tool_calls"):
                raise ValueError("message has both 'function_call' and 'tool_calls'; give one of them")
            data["tool_calls"] = [{"type": "function", "function": function_call}]
        unknown = set(data) - _MESSAGE_KEYS
        if unknown:
            raise ValueError(f"message has unknown keys {sorted(unknown)}")
        if "role" not in data:
            raise ValueError(f"message has no role: {dict(data)!r:.200}")
        return cls(
            role=data["role"],
            content=data.get("content"),
            tool_calls=[ToolCall.from_dict(c) for c in (data.get("tool_calls") or [])],
            tool_call_id=data.get("tool_call_id"),
            name=data.get("name"),
            token_ids=None if data.get("token_ids") is None else list(data["token_ids"]),
            logprobs=None if data.get("logprobs") is None else list(data["logprobs"]),
        )


@dataclass
class Trajectory:
    """One rollout: the conversation, the tools offered, the reward and why it ended.

    Fields:
        messages: the chat, in order.
        tools: the OpenAI tool schemas offered to the policy (``{"type": "function", "function": {...}}``); a JSON
            string of that list is parsed.
        reward: the scalar reward, None when not (yet) scored.
        reward_components: named parts of the reward (e.g. ``{"tests": 1.0, "rubric": 0.5}``).
        task_id: the task this rollout attempted.
        group_id: the rollout group (same task, same policy version) advantages are computed within.
        termination_reason: one of :data:`TERMINATION_REASONS`; default ``done``.
        metadata: free JSON-native data (site, model version, timings...).
        samples: the rollout's training samples (`orchard.data.RenderedSample`), as the harness recorded them: one
            rendered sequence for an in-process agent loop, the recording proxy's samples (prefix-merged) for a
            harness program. Derived tensors: not serialized by ``to_dict`` and not compared; empty when the
            rollout failed or nothing was recorded.

    What the sampling functions read (BAR's ``reward`` / ``terminated`` / ``length``, a group's validity and
    evaluation pass) are the properties :attr:`valid`, :attr:`passed`, :attr:`terminated` and :attr:`length`.
    """

    messages: list[Message] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    reward_components: dict[str, float] = field(default_factory=dict)
    task_id: str | None = None
    group_id: str | None = None
    termination_reason: TerminationReason = "done"
    metadata: dict[str, Any] = field(default_factory=dict)
    samples: list[Any] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.messages, list):
            raise ValueError(f"Trajectory.messages must be a list, got {type(self.messages).__name__}")
        self.messages = [_message(m, i) for i, m in enumerate(self.messages)]
        if isinstance(self.tools, str):
            # TRL datasets and OpenAI request logs often carry the tool schemas as one JSON string.
            try:
                self.tools = json.loads(self.tools)
            except json.JSONDecodeError as exc:
                raise ValueError(f"Trajectory.tools is a str but not JSON: {exc}") from exc
        if not isinstance(self.tools, list) or not all(isinstance(t, dict) for t in self.tools):
            raise ValueError(f"Trajectory.tools must be a list of dicts (or its JSON), got {self.tools!r:.200}")
        if self.reward is not None:
            self.reward = _check_finite_float(self.reward, "Trajectory.reward")
        if not isinstance(self.reward_components, dict):
            raise ValueError(
                f"Trajectory.reward_components must be a dict, got {type(self.reward_components).__name__}"
            )
        for k, v in self.reward_components.items():
            if not isinstance(k, str):
                raise ValueError(f"Trajectory.reward_components keys must be str, got {k!r}")
            self.reward_components[k] = _check_finite_float(v, f"Trajectory.reward_components[{k!r}]")
        _check_str_or_none(self.task_id, "Trajectory.task_id")
        _check_str_or_none(self.group_id, "Trajectory.group_id")
        if self.termination_reason not in TERMINATION_REASONS:
            raise ValueError(
                f"Trajectory.termination_reason must be one of {list(TERMINATION_REASONS)}, "
                f"got {self.termination_reason!r}"
            )
        if not isinstance(self.metadata, dict):
            raise ValueError(f"Trajectory.metadata must be a dict, got {type(self.metadata).__name__}")

    @property
    def is_env_error(self) -> bool:
        """True when the environment failed: drop the rollout, do not score it."""
        return self.termination_reason == "env_error"

    @property
    def valid(self) -> bool:
        """Scored and not an environment failure: the only rollouts that may be scored or trained on."""
        return not self.is_env_error and self.reward is not None

    @property
    def passed(self) -> bool:
        """The evaluation's success: ``reward_components["passed"] > 0`` where the verifier reports a pass rule of
        its own (the Claw domain's ``task_score >= 0.75``, which is not its RL reward), else ``reward > 0``.
        False for a rollout that is not :attr:`valid`."""
        if not self.valid:
            return False
        if "passed" in self.reward_components:
            return self.reward_components["passed"] > 0
        return self.reward is not None and self.reward > 0

    @property
    def terminated(self) -> bool:
        """True when the agent ended the rollout itself (``done``), False when a budget or an error cut it."""
        return self.termination_reason == "done"

    @property
    def length(self) -> int:
        """Assistant turns (BAR prefers shorter rollouts among equals)."""
        return self.num_steps

    @property
    def assistant_indices(self) -> list[int]:
        """Indices into ``messages`` of the assistant turns (the policy's steps)."""
        return [i for i, m in enumerate(self.messages) if m.role == "assistant"]

    @property
    def num_steps(self) -> int:
        """Number of assistant turns."""
        return sum(m.role == "assistant" for m in self.messages)

    @property
    def num_tool_calls(self) -> int:
        """Total tool calls over all assistant turns."""
        return sum(len(m.tool_calls) for m in self.messages)

    @property
    def has_token_ids(self) -> bool:
        """True when every assistant turn carries its sampled token ids (and there is at least one)."""
        steps = [m for m in self.messages if m.role == "assistant"]
        return bool(steps) and all(m.token_ids is not None for m in steps)

    @property
    def num_sampled_tokens(self) -> int:
        """Total sampled tokens over assistant turns with known token ids."""
        return sum(len(m.token_ids) for m in self.messages if m.token_ids is not None)

    def openai_messages(self) -> list[dict[str, Any]]:
        """The messages as OpenAI chat dicts (no token ids), as a chat template or client takes them."""
        return [m.to_openai() for m in self.messages]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-native dict; :meth:`from_dict` inverts it exactly."""
        return {
            "messages": [m.to_dict() for m in self.messages],
            "tools": self.tools,
            "reward": self.reward,
            "reward_components": dict(self.reward_components),
            "task_id": self.task_id,
            "group_id": self.group_id,
            "termination_reason": self.termination_reason,
            "metadata": self.metadata,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Trajectory:
        """Read :meth:`to_dict` output; missing optional keys take their defaults, unknown keys are rejected."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a trajectory must be a mapping, got {type(data).__name__}")
        unknown = set(data) - _TRAJECTORY_KEYS
        if unknown:
            raise ValueError(f"trajectory has unknown keys {sorted(unknown)}")
        messages = data.get("messages", [])
        if not isinstance(messages, Sequence) or isinstance(messages, str):
            raise ValueError(f"trajectory 'messages' must be a list, got {type(messages).__name__}")
        tools = data.get("tools") or []
        return cls(
            messages=[_message(m, i) for i, m in enumerate(messages)],
            tools=tools if isinstance(tools, str) else list(tools),
            reward=data.get("reward"),
            reward_components=dict(data.get("reward_components") or {}),
            task_id=data.get("task_id"),
            group_id=data.get("group_id"),
            termination_reason=data.get("termination_reason", "done"),
            metadata=dict(data.get("metadata") or {}),
        )

    def to_json(self) -> str:
        """One line of JSON (no NaN: rewards and log-probs are finite by construction)."""
        try:
            return json.dumps(self.to_dict(), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"trajectory is not JSON-serialisable (tools and metadata must be JSON-native): {exc}"
            ) from exc

    @classmethod
    def from_json(cls, text: str) -> Trajectory:
        """Inverse of :meth:`to_json`."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return cls.from_dict(json.loads(text))


def _message(m: Message | Mapping[str, Any], index: int) -> Message:
    """``m`` as a :class:`Message`; a bad message's error says which one it is."""
    if isinstance(m, Message):
        return m
    try:
        return Message.from_dict(m)
    except ValueError as exc:
        raise ValueError(f"messages[{index}]: {exc}") from exc


def trajectory_list(trajs: Any) -> list[Trajectory]:
    """``trajs`` as a list, checked: ``ValueError`` unless it is an iterable (not a single trajectory) whose
    items are all ``Trajectory`` (the message names the first offending index)."""
    if isinstance(trajs, Trajectory) or not isinstance(trajs, Iterable):
        raise ValueError(f"trajs must be an iterable of Trajectory, got {type(trajs).__name__}")
    out = list(trajs)
    for i, t in enumerate(out):
        if not isinstance(t, Trajectory):
            raise ValueError(f"trajs[{i}] must be a Trajectory, got {type(t).__name__}")
    return out
