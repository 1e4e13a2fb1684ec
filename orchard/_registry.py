"""A registry of named variants: aggregation modes, KL estimators, advantage estimators, hybrid rules.

Pure Python with no orchard imports (layer 0), shared by the algorithm packages so that every named variant
is looked up, rejected and reported the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable[..., object])


class Registry(Generic[F]):
    """Maps variant names to functions; rejects duplicate names and lists the valid ones for unknown names.

    Args:
        kind: what the variants are, used in error messages (``"KL estimator"``).
    """

    def __init__(self, kind: str) -> None:
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"kind must be a non-empty string, got {kind!r}")
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str, fn: F) -> F:
        """Add ``fn`` under ``name`` and return it; ``ValueError`` if the name is empty or already taken,
        or ``fn`` is not callable."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered; registered: {self.names()}")
        if not callable(fn):
            raise ValueError(f"{self.kind} {name!r} must be callable, got {type(fn).__name__}")
        self._entries[name] = fn
        return fn

    def get(self, name: object, arg: str) -> F:
        """Look ``name`` up; ``ValueError`` naming the argument ``arg`` and the valid names if unknown."""
        if not isinstance(name, str) or name not in self._entries:
            raise ValueError(f"{arg} must be one of {self.names()}, got {name!r}")
        return self._entries[name]

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
