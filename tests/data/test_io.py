import gzip
import json

import datasets
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchard.data import (
    Trajectory,
    from_hf_dataset,
    iter_jsonl,
    read_jsonl,
    read_parquet,
    table_to_trajectories,
    to_hf_dataset,
    trajectories_to_table,
    write_jsonl,
    write_parquet,
)

from .strategies import trajectories
from .test_schema import _example


def _batch() -> list[Trajectory]:
    malformed = _example()
    malformed.messages[2].tool_calls[1].arguments = '{"command": "pw'  # a format error is kept verbatim
    malformed.termination_reason = "format_error"
    return [
        _example(),
        malformed,
        Trajectory(
            messages=[{"role": "user", "content": 'só 中文 🙂\n\t"q"'}],
            reward=None,
            termination_reason="env_error",
        ),
        Trajectory(),
    ]


def _same(a: list[Trajectory], b: list[Trajectory]) -> None:
    assert a == b
    assert [t.to_json() for t in a] == [t.to_json() for t in b]  # also float bits, -0.0, key order


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_jsonl_round_trip(tmp_path, name):
    path = tmp_path / name
    trajs = _batch()
    assert write_jsonl(trajs[:2], path) == 2
    assert write_jsonl(trajs[2:], path, append=True) == 2
    _same(read_jsonl(path), trajs)
    _same(list(iter_jsonl(str(path))), trajs)
    if name.endswith(".gz"):
        with gzip.open(path, "rt") as f:
            assert len(f.read().splitlines()) == 4


def test_jsonl_bad_line_names_line(tmp_path):
    path = tmp_path / "t.jsonl"
    write_jsonl(_batch()[:1], path)
    with open(path, "a") as f:
        f.write("\n")  # blank lines are skipped
        f.write(json.dumps({"messages": [{"role": "robot"}]}) + "\n")
    with pytest.raises(ValueError, match=r"t.jsonl:3: not a trajectory.*Message.role"):
        read_jsonl(path)


def test_parquet_round_trip_and_columns(tmp_path):
    path = tmp_path / "t.parquet"
    trajs = _batch()
    assert write_parquet(trajs, path) == 4
    _same(read_parquet(path), trajs)
    table = pq.read_table(path)
    # Scalar columns are native, so a dataset can be filtered without parsing JSON.
    assert table.column("reward").to_pylist() == [0.1 + 0.2, 0.1 + 0.2, None, None]
    assert table.column("termination_reason").to_pylist() == [
        "step_budget",
        "format_error",
        "env_error",
        "done",
    ]
    assert table.column("num_steps").to_pylist() == [2, 2, 0, 0]
    empty = tmp_path / "empty.parquet"
    assert write_parquet([], empty) == 0
    assert read_parquet(empty) == []


def test_hf_datasets_round_trip(tmp_path):
    trajs = _batch()
    ds = to_hf_dataset(trajs)
    assert isinstance(ds, datasets.Dataset) and len(ds) == 4
    _same(from_hf_dataset(ds), trajs)
    # Filtering on native columns keeps rows intact.
    kept = ds.filter(lambda r: r["termination_reason"] != "env_error")
    _same(from_hf_dataset(kept), [t for t in trajs if not t.is_env_error])
    # A parquet file written by write_parquet loads as a dataset too.
    write_parquet(trajs, tmp_path / "t.parquet")
    loaded = datasets.Dataset.from_parquet(str(tmp_path / "t.parquet"), cache_dir=str(tmp_path / "cache"))
    _same(from_hf_dataset(loaded), trajs)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(trajectories(), max_size=3))
def test_round_trip_property_all_formats(tmp_path, trajs):
    write_jsonl(trajs, tmp_path / "p.jsonl")
    _same(read_jsonl(tmp_path / "p.jsonl"), trajs)
    _same(table_to_trajectories(trajectories_to_table(trajs)), trajs)
    write_parquet(trajs, tmp_path / "p.parquet")
    _same(read_parquet(tmp_path / "p.parquet"), trajs)
    _same(from_hf_dataset(to_hf_dataset(trajs)), trajs)


def test_io_validation(tmp_path):
    with pytest.raises(ValueError, match="trajs must be an iterable of Trajectory"):
        write_jsonl(_example(), tmp_path / "x.jsonl")
    with pytest.raises(ValueError, match=r"trajs\[1\] must be a Trajectory"):
        write_parquet([_example(), {"messages": []}], tmp_path / "x.parquet")
    with pytest.raises(ValueError, match="path must be a str"):
        read_jsonl(3)
    with pytest.raises(ValueError, match=r"datasets\.Dataset"):
        from_hf_dataset([{"messages": "[]"}])
    with pytest.raises(ValueError, match="'metadata' is not JSON-serialisable"):
        write_parquet([Trajectory(metadata={"s": {1, 2}})], tmp_path / "x.parquet")
    bad = datasets.Dataset.from_dict({"messages": ["[]"]})
    with pytest.raises(ValueError, match="missing trajectory columns"):
        from_hf_dataset(bad)
