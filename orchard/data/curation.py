"""Curation helpers for trajectory and task sets, as the Orchard paper prepares its SFT and RL data.

All helpers are pure: they return new lists (or new trajectories) and keep the input order of what they keep.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np

from orchard.data.render import render_trajectory
from orchard.data.schema import ToolCall, Trajectory, trajectory_list

T = TypeVar("T")

ToolCallIssueKind = Literal[
    "undefined_tool", "unparseable_arguments", "missing_required", "unexpected_argument", "wrong_type",
    "invalid_value", "unparseable_call",
]

TOOL_CALL_TAGS = ("<tool_call>", "</tool_call>")
"""The tags our chat template (Qwen / Hermes) writes around a tool call. A parser moves every call it can read into
``tool_calls``; one of these left in an assistant message's text is the raw text of a call that did not parse."""


def drop_env_errors(trajs: Iterable[Trajectory]) -> list[Trajectory]:
    """Drop trajectories whose environment failed (``termination_reason == "env_error"``): they say nothing about
    the policy and must not be scored."""
    return [t for t in trajectory_list(trajs) if not t.is_env_error]


def token_count(traj: Trajectory, tokenizer: Any) -> int:
    """Length of the rendered sequence (sampled ids where recorded, as training would see it)."""
    sample = render_trajectory(traj, tokenizer, on_mismatch="use_sampled")
    assert sample is not None  # use_sampled never drops
    return len(sample)


def sequence_length(traj: Trajectory, tokenizer: Any = None) -> int:
    """Tokens of the longest sequence a trajectory trains as: its longest recorded sample (a harness's per-call
    or prefix-chained samples, what SFT and RL train on), else its rendering (`token_count`, which needs the
    tokenizer). This is the context the model needed: the last observation, which no call read, is not counted."""
    if not isinstance(traj, Trajectory):
        raise ValueError(f"traj must be a Trajectory, got {type(traj).__name__}")
    if traj.samples:
        return max(len(s) for s in traj.samples)
    if tokenizer is None:
        raise ValueError("tokenizer must be given for a trajectory without recorded samples (it is rendered)")
    return token_count(traj, tokenizer)


def drop_over_token_limit(
    trajs: Iterable[Trajectory], tokenizer: Any, limit: int = 65536
) -> list[Trajectory]:
    """Keep trajectories whose rendered length is at most ``limit`` tokens (64K by default, as in the paper)."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive int, got {limit!r}")
    return [t for t in trajectory_list(trajs) if token_count(t, tokenizer) <= limit]


@dataclass(frozen=True)
class ToolCallIssue:
    """One problem with one tool call.

    Fields:
        message_index: index of the assistant message in ``Trajectory.messages``.
        call_index: index of the call within that message's ``tool_calls``; -1 for ``unparseable_call``.
        name: the called tool's name ("" for ``unparseable_call``: none could be read).
        kind: ``undefined_tool`` (no schema with that name), ``unparseable_arguments`` (not JSON, or not an
            object), ``missing_required`` (a ``required`` parameter absent), ``unexpected_argument`` (a parameter
            the schema does not declare while it sets ``additionalProperties: false``), ``wrong_type`` (a value
            whose JSON type is not the declared ``type``), ``invalid_value`` (outside the declared ``enum`` or
            ``minimum`` / ``maximum``), ``unparseable_call`` (a call tag left in the message's text: a call was
            attempted and did not parse). Nested arrays (``items``) and objects (``properties``) are checked
            the same way, the parameter named by its path (``view_range[1]``, ``options.depth``).
        detail: a human-readable explanation.
    """

    message_index: int
    call_index: int
    name: str
    kind: ToolCallIssueKind
    detail: str


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def _json_type_ok(value: Any, declared: Any) -> bool:
    types = declared if isinstance(declared, list) else [declared]
    for t in types:
        if t not in _JSON_TYPES:
            return True  # a type we do not check (or a malformed schema) is not the policy's error
        if isinstance(value, bool) and t in ("integer", "number"):
            continue
        if isinstance(value, _JSON_TYPES[t]):
            return True
        if t == "integer" and isinstance(value, float) and value.is_integer():
            return True
    return False


def _schemas_by_name(tools: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ValueError(f"tools[{i}] must be a dict, got {type(tool).__name__}")
        fn = tool.get("function", tool)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{i}] has no function name: {tool!r:.200}")
        params = fn.get("parameters") or {}
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}] parameters must be a dict, got {type(params).__name__}")
        out[fn["name"]] = params
    return out


def _value_issues(value: Any, schema: Any, path: str) -> list[tuple[ToolCallIssueKind, str]]:
    """One value against its schema: type first (a value of the wrong type is not checked further), then enum,
    bounds, and the items of an array or the properties of an object."""
    if not isinstance(schema, dict):
        return []  # a malformed schema is not the policy's error
    declared = schema.get("type")
    if declared is not None and not _json_type_ok(value, declared):
        return [("wrong_type", f"parameter {path!r} should be {declared}, got {type(value).__name__}")]
    found: list[tuple[ToolCallIssueKind, str]] = []
    enum = schema.get("enum")
    # JSON equality: 1 and 1.0 are the same number, true is not 1
    if isinstance(enum, list) and not any(isinstance(value, bool) == isinstance(e, bool) and value == e
                                          for e in enum):
        found.append(("invalid_value", f"parameter {path!r} must be one of {enum}, got {value!r:.80}"))
    if _json_type_ok(value, "number"):
        low, high = schema.get("minimum"), schema.get("maximum")
        if (_json_type_ok(low, "number") and value < low) or (_json_type_ok(high, "number") and value > high):
            found.append(("invalid_value", f"parameter {path!r} must be in [{low}, {high}], got {value!r}"))
    if isinstance(value, list):
        for i, item in enumerate(value):
            found += _value_issues(item, schema.get("items"), f"{path}[{i}]")
    if isinstance(value, dict):
        found += _object_issues(value, schema, f"{path}.")
    return found


def _object_issues(args: dict[str, Any], params: dict[str, Any], prefix: str) -> list[tuple[ToolCallIssueKind, str]]:
    props = params.get("properties") or {}
    found: list[tuple[ToolCallIssueKind, str]] = []
    for req in params.get("required") or []:
        if req not in args:
            found.append(("missing_required", f"required parameter {prefix + req!r} is missing"))
    for key, value in args.items():
        if key not in props:
            if params.get("additionalProperties") is False:
                found.append(("unexpected_argument", f"parameter {prefix + key!r} is not declared"))
            continue
        found += _value_issues(value, props[key], prefix + key)
    return found


def _call_issues(call: ToolCall, schemas: dict[str, dict[str, Any]]) -> list[tuple[ToolCallIssueKind, str]]:
    if call.name not in schemas:
        return [("undefined_tool", f"no tool named {call.name!r}; defined: {sorted(schemas)}")]
    args, reason = call.parse_arguments()
    if args is None:
        return [("unparseable_arguments", str(reason))]
    return _object_issues(args, schemas[call.name], "")


def _unparsed_tag(message: Any, tags: Sequence[str]) -> str | None:
    if message.role != "assistant":
        return None
    text = message.text
    return next((tag for tag in tags if tag in text), None)


def check_tool_calls(
    traj: Trajectory, tools: Sequence[dict[str, Any]] | None = None, *, tags: Sequence[str] = TOOL_CALL_TAGS
) -> list[ToolCallIssue]:
    """Check every tool call of a trajectory against the tool schemas, and its assistant text for calls that did
    not parse.

    Args:
        traj: the trajectory.
        tools: OpenAI tool schemas (``{"type": "function", "function": {"name", "parameters"}}`` or the bare
            function dict); default ``traj.tools``.
        tags: strings whose presence in an assistant message's text marks an attempted call that did not parse
            (one ``unparseable_call`` per such message); default `TOOL_CALL_TAGS`, our template's; ``()`` checks
            the parsed calls only.

    Returns:
        The issues, in message then call order; empty when every call names a defined tool and its arguments
        parse to a JSON object that validates against the schema (``required``, ``additionalProperties: false``,
        ``type``, ``enum``, ``minimum`` / ``maximum``, nested ``items`` and ``properties``; other keywords are
        not checked), and no assistant text holds a tag.
    """
    if not isinstance(traj, Trajectory):
        raise ValueError(f"traj must be a Trajectory, got {type(traj).__name__}")
    if tools is None:
        tools = traj.tools
    if isinstance(tools, dict) or not isinstance(tools, Sequence):
        raise ValueError(f"tools must be a list of tool schemas or None, got {type(tools).__name__}")
    if isinstance(tags, str) or not all(isinstance(t, str) and t for t in tags):
        raise ValueError(f"tags must be a sequence of non-empty strings, got {tags!r:.100}")
    schemas = _schemas_by_name(tools)
    issues = []
    for mi, message in enumerate(traj.messages):
        tag = _unparsed_tag(message, tags)
        if tag is not None:
            issues.append(ToolCallIssue(mi, -1, "", "unparseable_call", f"{tag!r} left in the text: a call that "
                                        "did not parse"))
        issues += [ToolCallIssue(mi, ci, call.name, kind, detail) for ci, call in enumerate(message.tool_calls)
                   for kind, detail in _call_issues(call, schemas)]
    return issues


def drop_invalid_tool_calls(
    trajs: Iterable[Trajectory], tools: Sequence[dict[str, Any]] | None = None, *, tags: Sequence[str] = TOOL_CALL_TAGS
) -> list[Trajectory]:
    """Keep the trajectories in which :func:`check_tool_calls` finds no issue (``tools`` default: each own)."""
    return [t for t in trajectory_list(trajs) if not check_tool_calls(t, tools, tags=tags)]


def flag_invalid_tool_calls(
    trajs: Iterable[Trajectory],
    tools: Sequence[dict[str, Any]] | None = None,
    *,
    key: str = "tool_call_issues",
) -> list[Trajectory]:
    """Copies of the trajectories with ``metadata[key]`` set to the list of issue dicts (empty when clean)."""
    out = []
    for t in trajectory_list(trajs):
        flagged = copy.deepcopy(t)
        flagged.metadata[key] = [vars(i).copy() for i in check_tool_calls(t, tools)]
        out.append(flagged)
    return out


def shortest_successful_per_task(
    trajs: Iterable[Trajectory],
    *,
    success_threshold: float = 1.0,
    length_fn: Callable[[Trajectory], float] | None = None,
) -> list[Trajectory]:
    """For each task, the shortest trajectory whose reward is at least ``success_threshold``.

    Args:
        trajs: trajectories with ``task_id`` set; env-error and unscored (``reward is None``) ones never count.
        success_threshold: minimum reward of a success; default 1.0 (a binary verifier's pass).
        length_fn: the length to minimise; default the number of steps (assistant turns). Ties go to the
            earliest trajectory in input order.

    Returns:
        At most one trajectory per task, in the order the tasks first appear; tasks without a success are absent.
    """
    items = trajectory_list(trajs)
    if isinstance(success_threshold, bool) or not isinstance(success_threshold, (int, float)):
        raise ValueError(f"success_threshold must be a float, got {success_threshold!r}")
    if length_fn is None:
        length_fn = _num_steps
    best: dict[str, tuple[float, int]] = {}
    for i, t in enumerate(items):
        if t.task_id is None:
            raise ValueError(f"trajs[{i}].task_id is None; every trajectory needs a task_id")
        if t.is_env_error or t.reward is None or t.reward < success_threshold:
            continue
        length = float(length_fn(t))
        if t.task_id not in best or length < best[t.task_id][0]:
            best[t.task_id] = (length, i)
    keep = sorted(i for _, i in best.values())
    return [items[i] for i in keep]


def _num_steps(t: Trajectory) -> float:
    return t.num_steps


def cap_per_key(items: Iterable[T], key_fn: Callable[[T], Hashable], cap: int, *, seed: int = 0) -> list[T]:
    """Keep at most ``cap`` items per key (e.g. per website or per rollout group), chosen uniformly at random.

    The choice is deterministic for a given ``seed`` and input order; kept items stay in input order. Keys with
    at most ``cap`` items keep all of them.
    """
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        raise ValueError(f"cap must be a non-negative int, got {cap!r}")
    if not callable(key_fn):
        raise ValueError(f"key_fn must be callable, got {type(key_fn).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    seq = list(items)
    by_key: dict[Hashable, list[int]] = {}
    for i, item in enumerate(seq):
        by_key.setdefault(key_fn(item), []).append(i)
    rng = random.Random(seed)
    keep: list[int] = []
    for indices in by_key.values():
        keep.extend(indices if len(indices) <= cap else rng.sample(indices, cap))
    return [seq[i] for i in sorted(keep)]


def dedup_by_embedding(
    items: Sequence[T],
    embed_fn: Callable[[list[T]], Any],
    threshold: float,
    *,
    return_indices: bool = False,
) -> list[T] | list[int]:
    """Greedy near-duplicate removal by cosine similarity of embeddings.

    Items are visited in order; an item is kept unless its cosine similarity to an already kept item is
    ``>= threshold`` (up to 1e-9, so ``threshold=1.0`` removes exact duplicates despite rounding).
    ``cos(a, b) = a.b / (|a| |b|)``; a zero embedding has similarity 0 to everything.

    Args:
        items: the items (e.g. task descriptions).
        embed_fn: called once with the list of items; returns an array-like of shape ``[N, D]``.
        threshold: similarity at or above which an item is a duplicate, in ``[-1, 1]``.
        return_indices: return the kept indices instead of the items.

    Returns:
        The kept items (or their indices), in input order.
    """
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise ValueError(f"items must be a sequence, got {type(items).__name__}")
    if not callable(embed_fn):
        raise ValueError(f"embed_fn must be callable, got {type(embed_fn).__name__}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not -1.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be a float in [-1, 1], got {threshold!r}")
    seq = list(items)
    if not seq:
        return []
    emb_ND = np.asarray(embed_fn(seq), dtype=np.float64)
    if emb_ND.ndim != 2 or emb_ND.shape[0] != len(seq):
        raise ValueError(f"embed_fn must return shape [N, D] = [{len(seq)}, D], got {list(emb_ND.shape)}")
    if not np.isfinite(emb_ND).all():
        raise ValueError("embed_fn returned non-finite embeddings")
    norms_N = np.linalg.norm(emb_ND, axis=1, keepdims=True)  # [N, 1]
    unit_ND = np.divide(emb_ND, norms_N, out=np.zeros_like(emb_ND), where=norms_N > 0)
    kept: list[int] = []
    for i in range(len(seq)):
        if kept and float((unit_ND[kept] @ unit_ND[i]).max()) >= threshold - 1e-9:
            continue
        kept.append(i)
    return kept if return_indices else [seq[i] for i in kept]
