"""A registry of named variants (hybrid selection rules)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable[..., object])


class Registry(Generic[F]):
    """Maps variant names to functions; rejects duplicate names and lists the valid ones for unknown names."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str, fn: F) -> F:
        """Add ``fn`` under ``name``; ``ValueError`` if the name is empty or already taken."""
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
