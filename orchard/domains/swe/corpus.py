"""Text for training the tiny model's tokenizer offline: the issues and the code the SWE tasks are about."""

from __future__ import annotations

from collections.abc import Iterable

from orchard.domains.swe.instances import SWEInstance
from orchard.domains.swe.patches import patched_paths

__all__ = ["tokenizer_corpus"]


def tokenizer_corpus(instances: Iterable[SWEInstance]) -> list[str]:
    """Each instance's issue text, then its code: a toy repository whole; of a snapshot on disk, the files its fix
    and its tests touch (those that exist at the base commit), and the fix. An instance in several pools counts
    once (by ``instance_id``, the first kept)."""
    texts = []
    seen: set[str] = set()
    for i in instances:
        if not isinstance(i, SWEInstance):
            raise ValueError(f"instances must hold SWEInstance objects, got {type(i).__name__}")
        if i.instance_id in seen:
            continue
        seen.add(i.instance_id)
        texts.append(i.problem_statement)
        if i.files is not None:
            texts += i.files.values()
        else:
            touched = dict.fromkeys([*patched_paths(i.patch), *patched_paths(i.test_patch)])
            texts += [t for t in map(i.read, touched) if t is not None]
            texts.append(i.patch)
    return texts
