"""Typed configs filled from YAML and ``key=value`` overrides, with a doc line under every field.

A config is a ``@dataclass`` whose fields each carry a docstring on the line below them (the cleanrl ``Args``
style); ``field_docs`` reads those docstrings from the source, ``format_help`` prints them, and ``load_config``
fills the dataclass::

    cfg = load_config(TrainConfig, "recipes/configs/claw_tiny.yaml", ["optim.lr=3e-4", "loggers=[jsonl,tensorboard]"])

Override values are parsed as YAML scalars / flow collections (``3e-4``, ``true``, ``[a, b]``, ``null``; a
float field also takes a string that spells a number, since YAML 1.1 reads ``1e-5`` as a string); nested
dataclass fields are reached with dots (``optim.lr``). Every value is checked against the field's annotation and a
mismatch raises ``ValueError`` naming the dotted key, the expected type and the value received. Unknown keys are
errors too (with the valid names listed), so a typo never silently falls back to a default.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from orchard._extras import requires_extra

with requires_extra("train"):
    import yaml

T = TypeVar("T")

__all__ = ["config_to_dict", "field_docs", "format_help", "load_config", "parse_overrides"]


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of dataclass ``cls`` (and its dataclass bases), by field name.

    Fields without a docstring are absent from the result.
    """
    if not dataclasses.is_dataclass(cls):
        raise ValueError(f"cls must be a dataclass type, got {cls!r}")
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0]
        if not isinstance(body, ast.ClassDef):
            continue
        stmts = body.body
        for stmt, nxt in zip(stmts, [*stmts[1:], None], strict=True):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def format_help(cls: type, prefix: str = "") -> str:
    """One line per (nested) field: ``key: type = default  # doc``, for a recipe's ``--help``."""
    if not dataclasses.is_dataclass(cls):
        raise ValueError(f"cls must be a dataclass type, got {cls!r}")
    hints = get_type_hints(cls)
    docs = field_docs(cls)
    lines: list[str] = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            lines.append(f"{key}:  # {docs.get(f.name, '')}")
            lines.append(format_help(tp, prefix=f"{key}."))
            continue
        default = _default_of(f)
        shown = "<required>" if default is dataclasses.MISSING else repr(default)
        lines.append(f"{key}: {_type_name(tp)} = {shown}  # {docs.get(f.name, '')}")
    return "\n".join(lines)


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """``["a.b=1", "c=[x, y]"]`` -> ``{"a": {"b": 1}, "c": ["x", "y"]}``; values are parsed as YAML."""
    if isinstance(overrides, str):
        raise ValueError(f"overrides must be a list of 'key=value' strings, got the string {overrides!r}")
    tree: dict[str, Any] = {}
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise ValueError(f"overrides entries must look like 'key=value', got {item!r}")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ValueError(f"overrides entry {item!r} has an empty key")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ValueError(f"overrides entry {item!r}: value is not valid YAML ({exc})") from None
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"overrides key {key!r} conflicts with an earlier override of {part!r}")
            node = child
        node[parts[-1]] = value
    return tree


def load_config(
    cls: type[T], yaml_path: str | Path | None = None, overrides: Iterable[str] = ()
) -> T:
    """Build ``cls`` from its defaults, then the YAML file (if given), then the ``key=value`` overrides.

    Later sources win key by key; nested dataclasses merge field by field. Raises ``ValueError`` naming the dotted
    key for an unknown key, a missing required field, or a value of the wrong type.
    """
    if not dataclasses.is_dataclass(cls) or not isinstance(cls, type):
        raise ValueError(f"cls must be a dataclass type, got {cls!r}")
    data: dict[str, Any] = {}
    if yaml_path is not None:
        path = Path(yaml_path)
        if not path.is_file():
            raise ValueError(f"yaml_path {str(path)!r} is not a file")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"yaml_path {str(path)!r} must hold a mapping at the top, got {type(loaded).__name__}")
        data = loaded
    _deep_merge(data, parse_overrides(overrides))
    return _build(cls, data, prefix="")


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A plain nested dict of a config (for logging and for writing next to a checkpoint)."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise ValueError(f"cfg must be a dataclass instance, got {cfg!r}")
    return dataclasses.asdict(cfg)


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = value


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _build(cls: type[T], data: Mapping[str, Any], prefix: str) -> T:
    if not isinstance(data, Mapping):
        raise ValueError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(
            f"unknown config key {prefix + str(unknown[0])!r}; valid keys here: {', '.join(sorted(fields))}"
        )
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        key = prefix + name
        tp = hints[name]
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            sub = data.get(name, {})
            if sub is None:
                sub = {}
            if isinstance(sub, tp):
                kwargs[name] = sub
                continue
            default = _default_of(f)
            merged = dataclasses.asdict(default) if dataclasses.is_dataclass(default) else {}
            if isinstance(sub, Mapping):
                _deep_merge(merged, sub)
            else:
                merged = sub
            kwargs[name] = _build(tp, merged, prefix=key + ".")
            continue
        if name in data:
            kwargs[name] = _coerce(data[name], tp, key)
        elif _default_of(f) is dataclasses.MISSING:
            raise ValueError(f"config key {key!r} is required ({_type_name(tp)}) but was not given")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config {prefix.rstrip('.') or cls.__name__}: {exc}") from None


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; return it converted where the conversion is lossless."""
    origin = get_origin(tp)
    args = get_args(tp)
    bad = ValueError(f"config key {key!r} expects {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ValueError as exc:
                errors.append(exc)
        raise bad
    if origin is Literal:
        if value in args:
            return value
        raise ValueError(f"config key {key!r} must be one of {list(args)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
        raise bad
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 reads "1e-5" (no dot) as a string; a float field takes it as the number it spells.
            try:
                return float(value)
            except ValueError:
                pass
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        return _build(tp, value, prefix=key + ".")
    if origin in (list, typing.List):  # noqa: UP006 - typing.List may appear in user annotations
        if not isinstance(value, (list, tuple)):
            raise bad
        (item_tp,) = args or (Any,)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise bad
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if args and len(args) != len(value):
            raise ValueError(f"config key {key!r} expects {len(args)} items ({_type_name(tp)}), got {value!r}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise bad
        k_tp, v_tp = args or (Any, Any)
        return {_coerce(k, k_tp, f"{key}.<key>"): _coerce(v, v_tp, f"{key}.{k}") for k, v in value.items()}
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise bad
    return value
