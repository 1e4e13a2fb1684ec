"""Typed configs filled from YAML and ``key=value`` overrides, with a doc line under every field.

A config is a ``@dataclass`` whose fields each carry a docstring on the line below them (the cleanrl ``Args``
style); ``field_docs`` reads those docstrings from the source, ``format_help`` prints them, and ``load_config``
fills the dataclass::

    cfg = load_config(TrainConfig, "recipes/configs/claw_tiny.yaml", ["optim.lr=3e-4", "loggers=[jsonl,tensorboard]"])

Override values are parsed as YAML scalars / flow collections (``3e-4``, ``true``, ``[a, b]``, ``null``; a
float field also takes a string that spells a number, since YAML 1.1 reads ``1e-5`` as a string); nested
dataclass fields are reached with dots (``optim.lr``). Every value is checked against the field's annotation and a
mismatch raises ``ConfigError`` (a ``ValueError``) whose message starts with the dotted key, the expected type
and the value received. Unknown keys are errors too (one line, with a did-you-mean), so a typo never silently falls
back to a default. Later sources merge into earlier ones field by field through nested dataclasses only: any other
value, a dict included, replaces the earlier one whole, so ``optim.lr_multipliers={}`` clears the YAML's factors;
a dotted key into a mapping (``model.vllm_kwargs.max_model_len=8192``) sets that one entry and keeps the others.

Validation happens at load time, before any work: after building each (nested) dataclass ``load_config`` calls its
``validate()`` method if it has one; a ``ValueError`` raised there or in ``__post_init__`` whose message starts with
one of the class's field names is re-raised as ``ConfigError`` with the dotted prefix written in front
(``steps must be an int >= 1, got -3`` inside ``rl`` becomes ``rl.steps must be an int >= 1, got -3``). Fields a
recipe computes itself are declared with ``derived={"rl.train.total_steps": "rl.steps"}``: setting one in YAML or
an override is rejected up front. ``format_config(cfg)`` prints the resolved config (what will run), one line per
field with its value and doc line (a derived key with what it is derived from instead of a value)::

    cfg = load_config(ClawConfig, args.config, args.overrides, derived=DERIVED)
    print(format_config(cfg, derived=DERIVED))
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
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

__all__ = [
    "ConfigError",
    "config_to_dict",
    "field_docs",
    "format_config",
    "format_help",
    "load_config",
    "parse_overrides",
]


class ConfigError(ValueError):
    """A config that cannot run: an unknown or derived key, a value of the wrong type, a failed ``validate()``.

    The message is one line and starts with the dotted key the user wrote (``rl.steps must be ...``), so a command
    line runner (``orchard._cli.run_main``) can print it as the whole error.
    """


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


class _Entries(dict):  # type: ignore[type-arg]
    """The entries a dotted override sets inside a mapping-valued field (``model.vllm_kwargs.max_model_len=...``):
    merged into the field's earlier mapping, where a value given for the field itself replaces it."""


def parse_overrides(overrides: Iterable[str], cls: type | None = None) -> dict[str, Any]:
    """``["a.b=1", "c=[x, y]"]`` -> ``{"a": {"b": 1}, "c": ["x", "y"]}``; values are parsed as YAML.

    With the config dataclass ``cls``, a dotted key that reaches past a field into its mapping value (``c.x=1``
    for a ``dict`` field ``c``) yields the entries to set in that mapping, which `load_config` merges into the
    field's earlier value instead of replacing it."""
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of 'key=value' strings, got the string {overrides!r}")
    tree: dict[str, Any] = {}
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise ConfigError(f"overrides entries must look like 'key=value', got {item!r}")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"overrides entry {item!r} has an empty key")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            detail = " ".join(str(exc).split())
            raise ConfigError(f"overrides entry {item!r}: value is not valid YAML ({detail})") from None
        node = tree
        parts = key.split(".")
        tp: Any = cls
        for part in parts[:-1]:
            tp = get_type_hints(tp).get(part) if dataclasses.is_dataclass(tp) and isinstance(tp, type) else None
            nested = tp is None or (dataclasses.is_dataclass(tp) and isinstance(tp, type))
            child = node.setdefault(part, {} if cls is None or nested else _Entries())
            if not isinstance(child, dict):
                raise ConfigError(f"overrides key {key!r} conflicts with an earlier override of {part!r}")
            node = child
        node[parts[-1]] = value
    return tree


def load_config(
    cls: type[T],
    yaml_path: str | Path | None = None,
    overrides: Iterable[str] = (),
    *,
    derived: Mapping[str, str] | Iterable[str] = (),
) -> T:
    """Build ``cls`` from its defaults, then the YAML file (if given), then the ``key=value`` overrides.

    Later sources win key by key; nested dataclasses merge field by field, and any other value (a dict included)
    replaces the earlier one whole: ``optim.lr_multipliers={}`` leaves no factor (a dotted override into a mapping,
    ``model.vllm_kwargs.max_model_len=8192``, sets one entry and keeps the rest). Each dataclass is validated as it is
    built (``__post_init__``, then ``validate()`` if defined; see the module docstring), so the whole config is
    checked before a recipe does any work.

    Args:
        cls: the config dataclass.
        yaml_path: a YAML file holding a mapping, or None.
        overrides: ``key=value`` strings, dotted keys for nested fields.
        derived: dotted keys the recipe computes itself, each mapped to what it is derived from (a plain list of
            keys also works); setting one in the YAML or an override raises
            ``ConfigError("rl.train.total_steps is derived from rl.steps; set that instead")``.

    Raises:
        ConfigError: (a ``ValueError``) naming the dotted key, for an unknown key (with a did-you-mean), a derived
            key that was set, a missing required field, a value of the wrong type, or a failed validation; also
            for a ``yaml_path`` that is not a file or does not hold a mapping.
    """
    if not dataclasses.is_dataclass(cls) or not isinstance(cls, type):
        raise ValueError(f"cls must be a dataclass type, got {cls!r}")
    derived_from = _derived_map(derived)
    data: dict[str, Any] = {}
    if yaml_path is not None:
        path = Path(yaml_path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist or is not a file")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {' '.join(str(exc).split())}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top, got {type(loaded).__name__}")
        data = loaded
    _merge_fields(cls, data, parse_overrides(overrides, cls))
    for key, source in derived_from.items():
        if _has_key(data, key):
            hint = f"is derived from {source}; set that instead" if source else "is derived by the recipe; leave it out"
            raise ConfigError(f"{key} {hint}")
    return _build(cls, data, prefix="", root=cls)


def format_config(cfg: Any, *, derived: Mapping[str, str] | Iterable[str] = ()) -> str:
    """The resolved config, one line per (nested) field: ``key: value  # doc line``.

    Shows what will run: the instance's values (defaults, then YAML, then overrides, as ``load_config`` built it),
    not the class defaults that ``format_help`` lists; a nested dataclass field's values come from the instance
    even where a recipe's ``default_factory`` differs from the nested class's own defaults. Values are written as
    YAML flow values, so a line can be pasted back as an override (``rl.train.optim.lr=1.0e-06``). A key in
    ``derived`` has no value of its own until the recipe computes it: its line says ``(derived from ...)`` where
    the value would be, not the field's placeholder default.
    """
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise ValueError(f"cfg must be a dataclass instance, got {cfg!r}")
    derived_from = _derived_map(derived)
    rows: list[tuple[str, str]] = []
    _config_rows(cfg, "", derived_from, rows)
    width = max((len(text) for text, _ in rows), default=0)
    return "\n".join(f"{text:<{width}}  # {doc}" if doc else text for text, doc in rows)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A plain nested dict of a config (for logging and for writing next to a checkpoint)."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise ValueError(f"cfg must be a dataclass instance, got {cfg!r}")
    return dataclasses.asdict(cfg)


def _derived_map(derived: Mapping[str, str] | Iterable[str]) -> dict[str, str]:
    if isinstance(derived, str):
        raise ValueError(f"derived must be a mapping or a list of dotted keys, got the string {derived!r}")
    if isinstance(derived, Mapping):
        return {str(k): str(v) for k, v in derived.items()}
    return {str(k): "" for k in derived}


def _has_key(data: Mapping[str, Any], dotted: str) -> bool:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def _config_rows(obj: Any, prefix: str, derived: Mapping[str, str], rows: list[tuple[str, str]]) -> None:
    docs = field_docs(type(obj))
    for f in dataclasses.fields(obj):
        key = prefix + f.name
        value = getattr(obj, f.name)
        doc = docs.get(f.name, "").split("\n")[0]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            rows.append((f"{key}:", doc))
            _config_rows(value, key + ".", derived, rows)
            continue
        if key in derived:
            source = derived[key]
            rows.append((f"{key}: (derived {'from ' + source if source else 'by the recipe'})", doc))
            continue
        rows.append((f"{key}: {_flow_yaml(value)}", doc))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _flow_yaml(value: Any) -> str:
    text = yaml.safe_dump(_plain(value), default_flow_style=True, width=float("inf"), sort_keys=False)
    # A scalar is dumped as a one-item document ("x\n...\n"); keep only the value.
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _merge_fields(cls: type | None, base: dict[str, Any], extra: Mapping[str, Any]) -> None:
    """Merge ``extra`` into ``base`` (raw values of dataclass ``cls``; None: inside a mapping-valued field),
    recursing into nested dataclass fields and into the `_Entries` of dotted overrides only: any other value, a
    mapping included, replaces the earlier one whole, so a later ``{}`` clears a field."""
    hints = get_type_hints(cls) if cls is not None else {}
    for key, value in extra.items():
        tp = hints.get(key) if isinstance(key, str) else None
        nested = dataclasses.is_dataclass(tp) and isinstance(tp, type)
        if (nested or isinstance(value, _Entries)) and isinstance(value, dict) and isinstance(base.get(key), dict):
            if isinstance(value, _Entries):
                base[key] = dict(base[key])  # the earlier mapping may be a default's: change a copy
            _merge_fields(tp if nested else None, base[key], value)
        else:
            base[key] = value


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _leaf_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of dataclass ``cls``, nested fields included."""
    hints = get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        keys.append(prefix + f.name)
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            keys += _leaf_keys(tp, prefix + f.name + ".")
    return keys


def _unknown_key_error(key: str, valid: Iterable[str], root: type) -> ConfigError:
    prefix, _, name = key.rpartition(".")
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    if close:
        hint = f"did you mean {(prefix + '.' if prefix else '') + close[0]!r}?"
    else:
        # A right name at the wrong level (``lr=...`` for ``sft.train.optim.lr``) is the next most likely slip.
        elsewhere = [k for k in _leaf_keys(root) if k.rpartition(".")[2] == name]
        hint = (f"did you mean {' or '.join(repr(k) for k in elsewhere[:3])}?" if elsewhere
                else f"valid keys here: {', '.join(sorted(valid))}")
    return ConfigError(f"{key} is not a config key; {hint}")


def _prefixed(exc: ValueError, cls: type, prefix: str) -> ConfigError:
    """A validation error of a dataclass at ``prefix``, its message starting with the dotted key."""
    message = " ".join(str(exc).split())
    if isinstance(exc, ConfigError) and message.startswith(prefix):
        return exc
    first = message.split(" ", 1)[0].split("[", 1)[0].rstrip(":,")
    names = {f.name for f in dataclasses.fields(cls)}
    # "rl.steps must ...": a check of an outer class may name a nested field by its dotted key
    if first in names or first.split(".", 1)[0] in names:
        return ConfigError(prefix + message)
    return ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {message}")


def _build(cls: type[T], data: Mapping[str, Any], prefix: str, root: type) -> T:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise _unknown_key_error(prefix + str(unknown[0]), fields, root)
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
                _merge_fields(tp, merged, sub)
            else:
                merged = sub
            kwargs[name] = _build(tp, merged, prefix=key + ".", root=root)
            continue
        if name in data:
            value = data[name]
            if isinstance(value, _Entries) and isinstance(_default_of(f), Mapping):
                # entries set by dotted overrides, over the field's default mapping
                value, entries = dict(_default_of(f)), value
                _merge_fields(None, value, entries)
            kwargs[name] = _coerce(value, tp, key, root)
        elif _default_of(f) is dataclasses.MISSING:
            raise ConfigError(f"{key} is required ({_type_name(tp)}) but was not given")
    try:
        obj = cls(**kwargs)
        validate = getattr(obj, "validate", None)
        if callable(validate):
            validate()
    except (TypeError, ValueError) as exc:
        if isinstance(exc, TypeError):
            raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {exc}") from None
        raise _prefixed(exc, cls, prefix) from None
    return obj


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, root: type) -> Any:
    """Check ``value`` against annotation ``tp``; return it converted where the conversion is lossless."""
    origin = get_origin(tp)
    args = get_args(tp)
    bad = ConfigError(f"{key} expects {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, root)
            except ValueError:
                continue
        raise bad
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{key} must be one of {list(args)}, got {value!r}")
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
        return _build(tp, value, prefix=key + ".", root=root)
    if origin in (list, typing.List):  # noqa: UP006 - typing.List may appear in user annotations
        if not isinstance(value, (list, tuple)):
            raise bad
        (item_tp,) = args or (Any,)
        return [_coerce(v, item_tp, f"{key}[{i}]", root) for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise bad
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{key}[{i}]", root) for i, v in enumerate(value))
        if args and len(args) != len(value):
            raise ConfigError(f"{key} expects {len(args)} items ({_type_name(tp)}), got {value!r}")
        return tuple(_coerce(v, a, f"{key}[{i}]", root) for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise bad
        k_tp, v_tp = args or (Any, Any)
        return {_coerce(k, k_tp, f"{key}.<key>", root): _coerce(v, v_tp, f"{key}.{k}", root)
                for k, v in value.items()}
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise bad
    return value
