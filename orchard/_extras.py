"""Optional dependencies: a missing one fails with the extra that installs it.

The core install (``pip install orchard-rl``) is the algorithms on torch and numpy; every other third-party package
belongs to an extra (``setup.cfg``). Import sites of optional packages wrap their imports::

    with requires_extra("env"):
        from fastapi import FastAPI

so that ``import orchard.env.server`` without fastapi says ``pip install 'orchard-rl[env]'`` instead of a bare
``No module named 'fastapi'``. The imports stay ordinary import statements (type checkers and linters see them).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

EXTRAS = ("data", "env", "redis", "k8s", "rollout", "train", "plot", "tensorboard", "wandb", "gui", "swe", "pretrained", "gpu", "all")


@contextmanager
def requires_extra(extra: str) -> Iterator[None]:
    """Re-raise a ``ModuleNotFoundError`` of a third-party package inside the block with the extra to install.

    The error keeps its ``name`` (callers that test ``exc.name`` still work) and chains the original. A missing
    module of orchard itself is a bug, not a missing extra, and passes through unchanged.

    Args:
        extra: the extra of ``setup.cfg`` that installs what the block imports; one of ``EXTRAS``.
    """
    if extra not in EXTRAS:
        raise ValueError(f"extra must be one of {', '.join(EXTRAS)}, got {extra!r}")
    try:
        yield
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if not missing or missing == "orchard":
            raise
        raise ModuleNotFoundError(
            f"this part of orchard needs the package {missing!r}, which is not installed; "
            f"install it with: pip install 'orchard-rl[{extra}]'",
            name=exc.name,
        ) from exc
