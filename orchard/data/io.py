"""Trajectory IO: JSONL (optionally gzipped), parquet, and HF ``datasets``; every format round-trips exactly.

JSONL holds one :meth:`Trajectory.to_dict` per line. Parquet and ``datasets`` share one flat table layout: the
scalar fields are native columns (so a dataset can be filtered on ``reward`` or ``task_id`` without parsing) and
the nested fields are JSON text columns (so arbitrary tool schemas, metadata and ragged token ids survive exactly,
which arrow structs would not guarantee for heterogeneous dicts):

=====================  ========  ==============================================
column                 type      content
=====================  ========  ==============================================
``task_id``            string    ``Trajectory.task_id`` (null allowed)
``group_id``           string    ``Trajectory.group_id`` (null allowed)
``reward``             float64   ``Trajectory.reward`` (null allowed)
``termination_reason`` string    one of ``TERMINATION_REASONS``
``num_steps``          int64     number of assistant turns (derived; ignored on read)
``messages``           string    JSON list of message dicts (with token ids, log-probs)
``tools``              string    JSON list of tool schemas
``reward_components``  string    JSON dict
``metadata``           string    JSON dict
=====================  ========  ==============================================

Floats go through JSON as their shortest round-trip repr and through parquet as float64, so they come back bit
for bit. Exactness holds for JSON-native data (tuples in ``metadata`` come back as lists).
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Iterator
from typing import IO, Any, cast

from orchard._extras import requires_extra

with requires_extra("data"):
    import pyarrow as pa
    import pyarrow.parquet as pq

from orchard.data.schema import Trajectory, trajectory_list

_JSON_COLUMNS = ("messages", "tools", "reward_components", "metadata")
_SCHEMA = pa.schema(
    [
        ("task_id", pa.string()),
        ("group_id", pa.string()),
        ("reward", pa.float64()),
        ("termination_reason", pa.string()),
        ("num_steps", pa.int64()),
        *[(name, pa.string()) for name in _JSON_COLUMNS],
    ]
)


def _check_path(path: Any, name: str = "path") -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{name} must be a str or os.PathLike, got {type(path).__name__}")
    return os.fspath(path)


def _open(path: str, mode: str) -> IO[str]:
    if path.endswith(".gz"):
        return cast(IO[str], gzip.open(path, mode + "t", encoding="utf-8"))
    return open(path, mode, encoding="utf-8")


def write_jsonl(trajs: Iterable[Trajectory], path: str | os.PathLike[str], *, append: bool = False) -> int:
    """Write one trajectory per line (gzip when ``path`` ends with ``.gz``); returns the number written.

    ``append=True`` adds to an existing file (a rollout writer streaming results), else the file is replaced.
    """
    p = _check_path(path)
    items = trajectory_list(trajs)
    with _open(p, "a" if append else "w") as f:
        for t in items:
            f.write(t.to_json())
            f.write("\n")
    return len(items)


def iter_jsonl(path: str | os.PathLike[str]) -> Iterator[Trajectory]:
    """Yield trajectories from a JSONL file lazily; blank lines are skipped; a bad line raises ``ValueError``
    naming its line number."""
    p = _check_path(path)
    with _open(p, "r") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield Trajectory.from_dict(json.loads(line))
            except (json.JSONDecodeError, ValueError) as exc:
                raise ValueError(f"{p}:{lineno}: not a trajectory: {exc}") from exc


def read_jsonl(path: str | os.PathLike[str]) -> list[Trajectory]:
    """All trajectories of a JSONL file (see :func:`iter_jsonl`)."""
    return list(iter_jsonl(path))


def _to_columns(items: list[Trajectory]) -> dict[str, list[Any]]:
    cols: dict[str, list[Any]] = {name: [] for name in _SCHEMA.names}
    for t in items:
        d = t.to_dict()
        cols["task_id"].append(d["task_id"])
        cols["group_id"].append(d["group_id"])
        cols["reward"].append(d["reward"])
        cols["termination_reason"].append(d["termination_reason"])
        cols["num_steps"].append(t.num_steps)
        for name in _JSON_COLUMNS:
            try:
                cols[name].append(json.dumps(d[name], ensure_ascii=False, allow_nan=False))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"trajectory field {name!r} is not JSON-serialisable: {exc}") from exc
    return cols


def _from_row(row: dict[str, Any], where: str) -> Trajectory:
    missing = [c for c in _SCHEMA.names if c != "num_steps" and c not in row]
    if missing:
        raise ValueError(f"{where}: missing trajectory columns {missing}")
    data = {
        "task_id": row["task_id"],
        "group_id": row["group_id"],
        "reward": row["reward"],
        "termination_reason": row["termination_reason"],
    }
    for name in _JSON_COLUMNS:
        if not isinstance(row[name], str):
            raise ValueError(f"{where}: column {name!r} must hold JSON text, got {type(row[name]).__name__}")
        data[name] = json.loads(row[name])
    return Trajectory.from_dict(data)


def trajectories_to_table(trajs: Iterable[Trajectory]) -> pa.Table:
    """The arrow table (layout in the module docstring) of the trajectories."""
    return pa.Table.from_pydict(_to_columns(trajectory_list(trajs)), schema=_SCHEMA)


def table_to_trajectories(table: pa.Table) -> list[Trajectory]:
    """Inverse of :func:`trajectories_to_table`."""
    if not isinstance(table, pa.Table):
        raise ValueError(f"table must be a pyarrow.Table, got {type(table).__name__}")
    return [_from_row(row, f"row {i}") for i, row in enumerate(table.to_pylist())]


def write_parquet(trajs: Iterable[Trajectory], path: str | os.PathLike[str]) -> int:
    """Write trajectories to a parquet file (zstd); returns the number written."""
    p = _check_path(path)
    table = trajectories_to_table(trajs)
    pq.write_table(table, p, compression="zstd")
    return table.num_rows


def read_parquet(path: str | os.PathLike[str]) -> list[Trajectory]:
    """Read a file written by :func:`write_parquet`."""
    return table_to_trajectories(pq.read_table(_check_path(path)))


def to_hf_dataset(trajs: Iterable[Trajectory]) -> Any:
    """A ``datasets.Dataset`` with the table layout of the module docstring (one row per trajectory)."""
    with requires_extra("data"):
        import datasets

    return datasets.Dataset(trajectories_to_table(trajs))


def from_hf_dataset(dataset: Any) -> list[Trajectory]:
    """Trajectories from a ``datasets.Dataset`` with the table layout (e.g. made by :func:`to_hf_dataset`, or
    loaded with ``datasets.load_dataset("parquet", ...)`` from :func:`write_parquet` files)."""
    with requires_extra("data"):
        import datasets

    if not isinstance(dataset, datasets.Dataset):
        raise ValueError(f"dataset must be a datasets.Dataset, got {type(dataset).__name__}")
    return [_from_row(row, f"row {i}") for i, row in enumerate(dataset)]
