"""A small local image registry: image names to root file systems.

The local backend does not pull container images. An "image" is a directory holding an unpacked root file
system (for instance `docker export $(docker create python:3.11) | tar -x -C images/python:3.11`), bound
read-only as the sandbox's `/`. Names resolve in this order:

1. `"host"`: the host's own `/` (read-only inside the sandbox). Always present.
2. names given explicitly: `ImageRegistry({"py311": "/srv/rootfs/py311"})`.
3. a directory of images: `ImageRegistry(images_dir=...)` serves every subdirectory by its name, with "/" in an
   image name written as "_" ("ghcr.io/acme/py:3.11" -> `ghcr.io_acme_py:3.11`).
4. anything else: `ImageNotFoundError` (the API answers 400), unless the registry was built with
   `fallback="host"`, in which case unknown names (e.g. "python:3.11" sent by an Orchard Env client) run on
   the host's file system, which has whatever Python the host has. The fallback is opt-in because it
   silently changes what a task runs on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from orchard.env.backends.base import ImageNotFoundError

HOST_IMAGE = "host"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Image:
    name: str
    """The name the sandbox was created with."""
    rootfs: str
    """Host directory used as the sandbox's `/`."""


def _image_dir_name(name: str) -> str:
    return name.replace("/", "_")


class ImageRegistry:
    """Maps image names to root file systems (see the module docstring for the resolution order).

    Args:
        images: name -> rootfs directory.
        images_dir: a directory whose subdirectories are images, named as the subdirectory.
        fallback: an image name that unknown names resolve to (e.g. "host"), or None to refuse them.
    """

    def __init__(
        self,
        images: Mapping[str, str | os.PathLike[str]] | None = None,
        *,
        images_dir: str | os.PathLike[str] | None = None,
        fallback: str | None = None,
    ) -> None:
        self._images: dict[str, str] = {HOST_IMAGE: "/"}
        for name, path in (images or {}).items():
            self.register(name, path)
        if images_dir is not None and not os.path.isdir(images_dir):
            raise ValueError(f"images_dir must be an existing directory, got {os.fspath(images_dir)!r}")
        self.images_dir = os.path.abspath(images_dir) if images_dir is not None else None
        if fallback is not None and fallback not in self._images and not self._in_dir(fallback):
            raise ValueError(f"fallback must name a known image, got {fallback!r}")
        self.fallback = fallback
        self._warned: set[str] = set()

    def register(self, name: str, rootfs: str | os.PathLike[str]) -> None:
        """Make `name` resolve to the root file system at `rootfs` (an existing directory)."""
        if not isinstance(name, str) or not name or "\x00" in name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        path = os.path.abspath(os.fspath(rootfs))
        if not os.path.isdir(path):
            raise ValueError(f"rootfs for image {name!r} must be an existing directory, got {path!r}")
        self._images[name] = path

    def _in_dir(self, name: str) -> str | None:
        if self.images_dir is None or name in ("", ".", "..") or "\x00" in name:
            return None
        path = os.path.join(self.images_dir, _image_dir_name(name))
        return path if os.path.isdir(path) else None

    def resolve(self, name: str) -> Image:
        """The image called `name`.

        Raises:
            ImageNotFoundError: unknown name and no fallback (its message lists the known names).
        """
        if not isinstance(name, str) or not name:
            raise ImageNotFoundError(f"image must be a non-empty string, got {name!r}")
        if name in self._images:
            return Image(name, self._images[name])
        path = self._in_dir(name)
        if path is not None:
            return Image(name, path)
        if self.fallback is not None:
            if name not in self._warned:
                self._warned.add(name)
                logger.warning("image %r is not registered; using %r instead", name, self.fallback)
            return Image(name, self.resolve(self.fallback).rootfs)
        raise ImageNotFoundError(f"unknown image {name!r}; known images: {', '.join(self.names())}")

    def names(self) -> list[str]:
        """Every name that resolves without the fallback, sorted."""
        names = set(self._images)
        if self.images_dir is not None:
            names.update(e.name for e in os.scandir(self.images_dir) if e.is_dir())
        return sorted(names)
