"""A run's three instance pools: train (the teacher's tasks, SFT data), RL and held-out.

From disk (SWE-bench schema, `load_instances`), every snapshot checked to be at its base commit before any work
(`check_snapshots`), the RL pool apart from the train one as the paper keeps it, or by default the seeded toy
instances of `orchard.domains.swe.generator`, whose held-out bugs never appear in training.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from orchard.domains.swe.generator import LEVELS, generate_instances
from orchard.domains.swe.instances import SWEInstance, check_snapshots, load_instances

__all__ = ["instance_pools"]


def instance_pools(path: str | Path | None = None, heldout_path: str | Path | None = None,
                   rl_path: str | Path | None = None, repo_root: str | Path | None = None, *,
                   train_per_template: int = 2, heldout_per_template: int = 1, levels: Sequence[int] = LEVELS,
                   templates: Sequence[str] = ()) -> tuple[list[SWEInstance], list[SWEInstance], list[SWEInstance]]:
    """(train, RL, held-out) instances.

    Args:
        path: instances on disk (JSONL, parquet or a saved dataset; split "train"): the train pool, and the RL
            pool unless ``rl_path`` is given. None: seeded toy instances, and RL draws from the train ones.
        heldout_path: held-out instances on disk (split "heldout"); required exactly when ``path`` is given.
        rl_path: RL instances on disk (split "rl"), kept apart from ``path``'s. Needs ``path``.
        repo_root: folder of snapshots, ``<repo_root>/<instance_id>``, for rows with neither files nor repo_dir.
            Needs ``path``.
        train_per_template, heldout_per_template: toy instances per repository template.
        levels: toy difficulty levels (among ``LEVELS``).
        templates: toy repository templates (empty: all).

    A row that does not load or a snapshot that is not at its base commit is a one-line ``ValueError`` that starts
    with the argument's name (``path: <instance>: ...``), so a caller can put its own config key in front.
    """
    if (path is None) != (heldout_path is None):
        raise ValueError("heldout_path must be given exactly when path is")
    if path is None:
        for name, value in (("rl_path", rl_path), ("repo_root", repo_root)):
            if value is not None:
                raise ValueError(f"{name} needs path (toy instances carry their files and draw RL from the train "
                                 f"pool)")
        kw = {"levels": tuple(levels), "templates": tuple(templates) or None}
        train = generate_instances("train", train_per_template, **kw)
        return train, train, generate_instances("heldout", heldout_per_template, **kw)
    pools: dict[str, list[SWEInstance]] = {}
    for key, source, split in (("path", path, "train"), ("rl_path", rl_path, "rl"),
                               ("heldout_path", heldout_path, "heldout")):
        if source is None:
            continue
        try:
            pools[key] = load_instances(source, split=split, repo_root=repo_root)
            check_snapshots(pools[key])
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from exc
    return pools["path"], pools.get("rl_path", pools["path"]), pools["heldout_path"]
