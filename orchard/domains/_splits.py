"""What every seeded task generator's split does: which templates a split draws from, and where its seeds start."""

from __future__ import annotations

from collections.abc import Collection, Sequence

__all__ = ["split_plan"]


def split_plan(split: str, *, known: Collection[str], templates: Sequence[str] | None,
               heldout_templates: Sequence[str], seed: int, heldout_offset: int) -> tuple[tuple[str, ...], int]:
    """``(template names, first seed)`` of one split of a seeded generator.

    Train draws seeds from ``seed x 10,000`` in ``[0, heldout_offset)``, held-out from ``heldout_offset`` on, so the
    splits never share a task; ``heldout_templates`` are left out of "train" (an out-of-template test).
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    names = tuple(templates) if templates is not None else tuple(known)
    for name in (*names, *heldout_templates):
        if name not in known:
            raise ValueError(f"templates must be among {sorted(known)}, got {name!r}")
    if split == "train":
        names = tuple(t for t in names if t not in heldout_templates)
    return names, (heldout_offset if split == "heldout" else 0) + seed * 10_000
