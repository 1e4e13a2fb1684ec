"""Rubric process reward (RPR) for software-engineering trajectories, and a forgiving parser for the judge.

The judge (an LLM) reads a trajectory and scores seven process dimensions. The reward is their weighted mean
mapped to ``[0, 1]``::

    R = sum_d w_d * (s_d - lo) / (hi - lo) / sum_d w_d

with the paper's weights ``RPR_WEIGHTS`` (they sum to 1) and a judge scale ``[lo, hi]``. **Assumed scale:** the
judge scores each dimension on ``0..10`` (``scale=(0, 10)``); pass ``scale=`` for a judge prompted otherwise.
An answer that cannot be scored is reported as such (``scorable=False``, ``reward=None``) so the caller drops
the sample; it is never turned into a silent 0.
"""

from __future__ import annotations

import ast
import json
import math
import re
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import torch

RPR_WEIGHTS: Mapping[str, float] = MappingProxyType(
    {
        "fix_quality": 0.15,
        "self_test_relevance": 0.18,
        "coverage": 0.12,
        "rigor": 0.15,
        "discriminativeness": 0.14,
        "regression_guard": 0.12,
        "verification_integrity": 0.14,
    }
)
"""The seven RPR dimensions and their weights (Fix Quality .15, Self-test Relevance .18, Coverage .12, Rigor .15,
Discriminativeness .14, Regression guard .12, Verification integrity .14; sum 1). Read-only."""

DEFAULT_SCALE: tuple[float, float] = (0.0, 10.0)

_ALIASES = {"rigour": "rigor", "selftest": "self_test_relevance", "regression": "regression_guard"}


def _check_scale(scale: object) -> tuple[float, float]:
    if (
        not isinstance(scale, (tuple, list))
        or len(scale) != 2
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in scale)
        or not scale[0] < scale[1]
    ):
        raise ValueError(f"scale must be a pair (lo, hi) of finite numbers with lo < hi, got {scale!r}")
    return float(scale[0]), float(scale[1])


def _check_weights(weights: object) -> dict[str, float]:
    if not isinstance(weights, Mapping) or not weights:
        raise ValueError(f"weights must be a non-empty mapping of dimension -> weight, got {weights!r}")
    out = {}
    for k, v in weights.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"weights must map str -> number, got {k!r}: {v!r}")
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"weights[{k!r}] must be a finite number >= 0, got {v!r}")
        out[k] = float(v)
    if sum(out.values()) <= 0:
        raise ValueError(f"weights must have a positive sum, got {dict(out)}")
    return out


def rubric_reward(
    scores: Mapping[str, float] | np.ndarray | torch.Tensor,
    weights: Mapping[str, float] = RPR_WEIGHTS,
    *,
    scale: tuple[float, float] = DEFAULT_SCALE,
) -> float | np.ndarray | torch.Tensor:
    """Rubric process reward in ``[0, 1]``: ``sum_d w_d (s_d - lo) / (hi - lo) / sum_d w_d``.

    Args:
        scores: one judge score per dimension, either a mapping ``{dimension: score}`` with exactly the keys of
            ``weights``, or an array / tensor whose last axis lists the dimensions in ``weights`` order.
            Shape: ``(..., D)`` with ``D = len(weights)``.
        weights: dimension -> non-negative weight; default :data:`RPR_WEIGHTS`. Normalised by their sum.
        scale: the judge's score range ``(lo, hi)``; default ``(0, 10)`` (an assumption, see the module doc).

    Returns:
        A float for a mapping; an array / tensor of shape ``(...)`` for batched scores (tensors keep their
        floating dtype).
    """
    lo, hi = _check_scale(scale)
    w = _check_weights(weights)
    names = list(w)
    total = sum(w.values())
    if isinstance(scores, Mapping):
        missing = [d for d in names if d not in scores]
        extra = [d for d in scores if d not in w]
        if missing or extra:
            raise ValueError(f"scores must have exactly the dimensions {names}; missing {missing}, unknown {extra}")
        acc = 0.0
        for d in names:
            s = scores[d]
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or not lo <= s <= hi:
                raise ValueError(f"scores[{d!r}] must be a number in [{lo}, {hi}], got {s!r}")
            acc += w[d] * (float(s) - lo) / (hi - lo)
        return acc / total
    shape_error = f"scores must be a mapping or an array of shape (..., {len(names)})"
    if isinstance(scores, torch.Tensor):
        if scores.dim() < 1 or scores.shape[-1] != len(names):
            raise ValueError(f"{shape_error}, got shape {tuple(scores.shape)}")
        s_t = scores if scores.is_floating_point() else scores.float()
        if not (torch.isfinite(s_t).all() and (s_t >= lo).all() and (s_t <= hi).all()):
            raise ValueError(f"scores must be finite and in [{lo}, {hi}]")
        w_D = torch.tensor([w[d] for d in names], dtype=s_t.dtype, device=s_t.device)
        return ((s_t - lo) / (hi - lo) * w_D).sum(dim=-1) / total  # [...]
    s_arr = np.asarray(scores)
    if not np.issubdtype(s_arr.dtype, np.number) or s_arr.ndim < 1 or s_arr.shape[-1] != len(names):
        raise ValueError(f"{shape_error}, got {type(scores).__name__} of shape {s_arr.shape}")
    s_np = s_arr.astype(np.float64)
    if not (np.isfinite(s_np).all() and (s_np >= lo).all() and (s_np <= hi).all()):
        raise ValueError(f"scores must be finite and in [{lo}, {hi}]")
    w_np = np.array([w[d] for d in names])
    return ((s_np - lo) / (hi - lo) * w_np).sum(axis=-1) / total  # [...]


@dataclass(frozen=True)
class RubricJudgement:
    """What :func:`parse_rubric_judgement` made of a judge's answer.

    ``scorable`` is False when any dimension is missing, non-numeric or out of range, or when no scores were
    found at all; then ``reward`` is None and the sample must be dropped, not scored 0.
    """

    scores: dict[str, float]
    """Dimension -> score, for every dimension that parsed (in range or not)."""
    scorable: bool
    reward: float | None
    missing: tuple[str, ...] = ()
    out_of_range: tuple[str, ...] = ()
    error: str | None = None
    """Why the answer is unscorable; None when scorable."""
    extra: dict[str, object] = field(default_factory=dict)
    """Keys of the judge's JSON that are not dimensions (rationale, comments), kept for logging."""


_RUBRIC_ID = re.compile(r"^r(\d+)(?!\d)(.*)$")
"""A rubric id opening a key: ``R1``, ``R1 Fix Quality``, ``r3_coverage`` (the paper's prompt labels R1-R7)."""


def _canonical(key: str, dims: tuple[str, ...]) -> str | None:
    """The dimension a key names: its name in any case or spacing, an alias, or its rubric id ``Rk`` (the k-th
    dimension). A key that gives both an id and a name is read only when the two agree."""
    squashed = re.sub(r"[^a-z0-9]", "", key.lower())
    by_id = None
    m = _RUBRIC_ID.match(squashed)
    if m:
        k = int(m.group(1))
        if not 1 <= k <= len(dims):
            return None
        by_id, squashed = dims[k - 1], m.group(2)
        if not squashed:
            return by_id
    by_name = next((d for d in dims if squashed == d.replace("_", "")), None)
    if by_name is None:
        alias = _ALIASES.get(squashed)
        by_name = alias if alias in dims else None
    if by_id is not None and by_name != by_id:
        return None
    return by_name


_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_FRACTION = re.compile(rf"^\s*({_NUMBER})\s*(?:/\s*({_NUMBER}))?\s*$")


def _number(value: object, lo: float, hi: float) -> float | None:
    """A score from a JSON value: a number, "7", "7/10" (rescaled to the scale), or {"score": ...}."""
    if isinstance(value, Mapping):
        for key in ("score", "value", "rating"):
            if key in value:
                return _number(value[key], lo, hi)
        return None
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        m = _FRACTION.match(value)
        if not m:
            return None
        num = float(m.group(1))
        if m.group(2) is None:
            return num
        den = float(m.group(2))
        if den <= 0:
            return None
        return num if den == hi else lo + num / den * (hi - lo)
    return None


_FENCE = re.compile(r"```[A-Za-z0-9_-]*\s*\n?(.*?)```", re.DOTALL)
_OPENER = re.compile(r"[\[{]")
_TRAILING_COMMA = re.compile(r",\s*[}\]]")
_STRING = r'"(?:[^"\\]|\\.)*"'
_STRING_OR_TRAILING_COMMA = re.compile(rf",(?=\s*[}}\]])|{_STRING}", re.DOTALL)
_BRACKET = re.compile(r"[{}\[\]]")
_STRING_OR_BRACKET = re.compile(rf"[{{}}\[\]]|{_STRING}", re.DOTALL)
_DECODER = json.JSONDecoder()


def find_json(text: str) -> list[object]:
    """Every JSON value a judge's free-form answer holds, each once, in the order its readers try them (the first
    that fits wins in :func:`parse_rubric_judgement` and the domain parsers built on this).

    The order: the whole text; then each fenced code block (```` ```json ... ``` ````, any or no language tag);
    then each object or array embedded in prose, left to right (``Scores: {...} -- hope this helps``). A value
    inside one already found is not listed again; one inside a span that does not parse is (``[see {...}]``).
    Each is read as strict JSON, else with trailing commas dropped (``{"a": 1,}``; a ``",}"`` inside a string
    stays), else as a Python literal (``{'a': 1}``, ``True`` / ``None``), kept only when that is an object or
    an array JSON can hold (tuples read as arrays, non-string keys as their JSON text). What does not parse
    (truncated JSON, prose in braces) is left out, so an answer without JSON gives ``[]``; braces and quotes
    inside strings are text. Never raises on text; a span nested past the interpreter's recursion limit is skipped
    and, if never closed, ends the search.
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    found: list[object] = []
    seen: set[str] = set()
    for value in _json_values(text):
        key = json.dumps(value, sort_keys=True)
        if key not in seen:
            seen.add(key)
            found.append(value)
    return found


def _json_values(text: str) -> Iterator[object]:
    """The values :func:`find_json` lists, duplicates included."""
    for candidate in [text, *(m.group(1) for m in _FENCE.finditer(text))]:
        value = _loads(candidate.strip())
        if value is not None:
            yield value
    closers: dict[int, int] | None = None  # computed on the first embedded span that strict JSON rejects
    i = 0
    while (m := _OPENER.search(text, i)) is not None:
        i = m.start()
        try:
            value, i = _DECODER.raw_decode(text, i)
        except (ValueError, RecursionError) as err:
            closers = _closing_brackets(text) if closers is None else closers
            close = closers.get(i)
            if isinstance(err, RecursionError):
                if close is None:
                    return  # each opener after it would recurse as deep again: quadratic time for nothing
                value, i = None, close + 1
            else:
                value = None if close is None else _loads(text[i : close + 1])
                i = i + 1 if close is None or value is None else close + 1
        if value is not None:
            yield value


def _closing_brackets(text: str) -> dict[int, int]:
    """``{index of an opening bracket: index of its closing one}`` for every balanced ``{...}`` / ``[...]`` of
    ``text``; double-quoted strings inside brackets are skipped (a quote in the prose around them opens none), and a
    closer that matches nothing open leaves every open span unclosed."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    i = 0
    while (m := (_STRING_OR_BRACKET if stack else _BRACKET).search(text, i)) is not None:
        token, i = m.group(), m.end()
        if token in ("{", "["):
            stack.append(m.start())
        elif token in ("}", "]"):
            if stack and text[stack[-1]] == ("{" if token == "}" else "["):
                pairs[stack.pop()] = m.start()
            else:
                stack.clear()
    return pairs


def _loads(candidate: str) -> object:
    """The value ``candidate`` holds read as strict JSON, else with trailing commas dropped, else as a Python
    literal; ``None`` when none reads."""
    try:
        return json.loads(candidate)
    except (ValueError, RecursionError):
        pass
    if _TRAILING_COMMA.search(candidate):
        try:
            return json.loads(_drop_trailing_commas(candidate))
        except (ValueError, RecursionError):
            pass
    return _python_literal(candidate) if "'" in candidate else None


def _drop_trailing_commas(candidate: str) -> str:
    """``candidate`` without the commas that directly precede a ``}`` or ``]``, commas inside strings kept."""
    return _STRING_OR_TRAILING_COMMA.sub(lambda m: m.group() if m.group() != "," else "", candidate)


def _python_literal(candidate: str) -> object:
    """A Python ``dict`` / ``list`` / ``tuple`` literal as the JSON value it spells, else ``None``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an invalid escape such as "\d" in a string warns
            value = ast.literal_eval(candidate)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if not isinstance(value, (dict, list, tuple)):
        return None
    try:
        return json.loads(json.dumps(value))
    except (ValueError, TypeError, RecursionError):
        return None


_NAME_KEYS = ("dimension", "name", "criterion", "aspect")


def _dimension_items(obj: object, dims: tuple[str, ...], depth: int = 0) -> dict[str, object] | None:
    """The {dimension: raw value} items of parsed JSON: ``{dim: score}``, a list of ``{"dimension": d, "score": s}``
    records, or either of those one level down (``{"scores": {...}}``)."""
    found: dict[str, object] = {}
    if isinstance(obj, Mapping):
        found = {c: v for k, v in obj.items() if isinstance(k, str) and (c := _canonical(k, dims))}
    elif isinstance(obj, list):
        for rec in obj:
            if isinstance(rec, Mapping):
                name = next((rec[k] for k in _NAME_KEYS if isinstance(rec.get(k), str)), None)
                if name is not None and (c := _canonical(name, dims)) and c not in found:
                    found[c] = rec
    if found or depth > 0:
        return found or None
    children = obj.values() if isinstance(obj, Mapping) else []
    for child in children:
        nested = _dimension_items(child, dims, depth + 1)
        if nested:
            return nested
    return None


def _line_items(text: str, dims: tuple[str, ...]) -> dict[str, object]:
    """Fallback for prose answers: lines like ``- **Fix Quality**: 7/10`` or ``R1 Fix Quality: 8``."""
    found: dict[str, object] = {}
    pattern = re.compile(
        rf"^[\s>*#\-\d.)]*([A-Za-z][A-Za-z0-9 _\-()]*?)[\s*_`]*[:=]\s*[\s*`]*({_NUMBER}(?:\s*/\s*{_NUMBER})?)"
    )
    for line in text.splitlines():
        m = pattern.match(line)
        if m and (c := _canonical(m.group(1), dims)) and c not in found:
            found[c] = m.group(2)
    return found


def parse_rubric_judgement(
    text: str,
    *,
    weights: Mapping[str, float] = RPR_WEIGHTS,
    scale: tuple[float, float] = DEFAULT_SCALE,
) -> RubricJudgement:
    """Read per-dimension scores from a judge's free-form answer; never raises on malformed answers.

    Accepted: JSON as :func:`find_json` reads it (bare, fenced or in prose; trailing commas and single quotes
    tolerated), keys in any case or spacing (``"Self-test Relevance"``, ``"self_test_relevance"``) or as the rubric ids of the paper's grading
    prompt, ``"R1"`` ... ``"R7"`` (``Rk`` is the k-th dimension of ``weights``: R1 Fix Quality ... R7
    Verification integrity for :data:`RPR_WEIGHTS`), alone or with the name (``"R1 Fix Quality"``; an id and a
    name that disagree name nothing), values as numbers, numeric strings,
    fractions ``"7/10"`` (a denominator other than ``hi`` is rescaled onto ``scale``) or ``{"score": 7}``;
    a list of records ``[{"dimension": "Rigor", "score": 7}, ...]``; either nested one level
    (``{"scores": {...}}``); or, failing JSON, prose lines ``Fix Quality: 7`` or ``R1 Fix Quality: 8``.
    The first candidate that names at least one dimension is used.

    Args:
        text: the judge's raw answer.
        weights: the dimensions expected and their weights; default :data:`RPR_WEIGHTS`.
        scale: the judge's score range; default ``(0, 10)``.

    Returns:
        :class:`RubricJudgement`; ``scorable=False`` with an ``error`` when a dimension is missing, non-numeric
        or outside ``scale``, or nothing was found.
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    lo, hi = _check_scale(scale)
    w = _check_weights(weights)
    dims = tuple(w)
    items: dict[str, object] | None = None
    extra: dict[str, object] = {}
    for obj in find_json(text):
        items = _dimension_items(obj, dims)
        if items:
            if isinstance(obj, Mapping):
                extra = {k: v for k, v in obj.items() if not (isinstance(k, str) and _canonical(k, dims))}
            break
    if not items:
        items = _line_items(text, dims)
    if not items:
        return RubricJudgement({}, False, None, missing=dims, error="no rubric scores found in the judge's answer")
    scores: dict[str, float] = {}
    bad: list[str] = []
    for d, raw in items.items():
        v = _number(raw, lo, hi)
        if v is None or not math.isfinite(v):
            bad.append(d)
        else:
            scores[d] = v
    missing = tuple(d for d in dims if d not in items)
    out_of_range = tuple(d for d, v in scores.items() if not lo <= v <= hi)
    problems = []
    if missing:
        problems.append(f"missing {list(missing)}")
    if bad:
        problems.append(f"non-numeric {bad}")
    if out_of_range:
        problems.append(f"outside [{lo:g}, {hi:g}]: {list(out_of_range)}")
    if problems:
        return RubricJudgement(scores, False, None, missing, out_of_range, "; ".join(problems), extra)
    reward = rubric_reward(scores, w, scale=(lo, hi))
    assert isinstance(reward, float)
    return RubricJudgement(scores, True, reward, (), (), None, extra)
