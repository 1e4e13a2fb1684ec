"""SWE instances: the loader reads JSONL, parquet and saved datasets in the SWE-bench schema (test lists as lists
or JSON strings), keeps unknown fields, and rejects bad rows naming the row and the field."""

import dataclasses
import datetime
import json

import datasets
import pyarrow
import pyarrow.parquet
import pytest

from orchard.domains.swe.instances import SWEInstance, instance_from_row, load_instances, save_instances
from orchard.domains.swe.testrun import parse_test_results, pytest_argv


def row(**changes):
    """A SWE-bench Verified-like row (test lists as JSON strings, as in its files) with extras."""
    base = {
        "instance_id": "octo__calc-1", "repo": "octo/calc", "base_commit": "ab" * 20,
        "problem_statement": "add() is wrong", "patch": "diff --git a/calc.py b/calc.py\n",
        "test_patch": "diff --git a/test_calc.py b/test_calc.py\n",
        "FAIL_TO_PASS": json.dumps(["test_calc.py::test_add"]),
        "PASS_TO_PASS": json.dumps(["test_calc.py::test_sub", "test_calc.py::test_mul"]),
        "version": "1.0", "hints_text": "", "environment_setup_commit": "cd" * 20,
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v is not ...}


def test_row_becomes_an_instance_with_extras_and_a_snapshot_dir(tmp_path):
    inst = instance_from_row(row(), repo_root=tmp_path)
    assert inst.FAIL_TO_PASS == ["test_calc.py::test_add"]
    assert inst.tests == ["test_calc.py::test_add", "test_calc.py::test_sub", "test_calc.py::test_mul"]
    assert inst.extras == {"version": "1.0", "hints_text": "", "environment_setup_commit": "cd" * 20}
    assert inst.repo_dir == str(tmp_path / "octo__calc-1") and inst.files is None
    # lists are accepted as they are
    assert instance_from_row(row(PASS_TO_PASS=[]), repo_root=tmp_path).PASS_TO_PASS == []


@pytest.mark.parametrize("changes, message", [
    ({"patch": ...}, "row 3 (octo__calc-1): field 'patch' is missing"),
    ({"FAIL_TO_PASS": None}, "row 3 (octo__calc-1): field 'FAIL_TO_PASS' is missing"),
    ({"FAIL_TO_PASS": "[test_add"}, "row 3 (octo__calc-1): field 'FAIL_TO_PASS' is not a JSON list"),
    ({"PASS_TO_PASS": json.dumps([1])}, "row 3 (octo__calc-1): field 'PASS_TO_PASS' must be a list"),
    ({"FAIL_TO_PASS": json.dumps(["test_calc.py::test_add", ""])},
     "row 3 (octo__calc-1): field 'FAIL_TO_PASS' must be a list of non-empty test id strings"),
    ({"FAIL_TO_PASS": "[]"}, "row 3 (octo__calc-1): field 'FAIL_TO_PASS' is empty"),
    ({"problem_statement": "  "}, "row 3 (octo__calc-1): field 'problem_statement' must be a non-empty string"),
    ({"instance_id": 7}, "row 3: field 'instance_id' must be a non-empty string"),
    ({"files": {"a.py": 1}}, "row 3 (octo__calc-1): field 'files' must map paths to text"),
    ({"files": {"a.py": ""}, "repo_dir": "/x"}, "row 3 (octo__calc-1): fields 'files' and 'repo_dir' are both set"),
])
def test_bad_rows_are_rejected_naming_row_and_field(changes, message):
    with pytest.raises(ValueError) as info:
        instance_from_row(row(**changes), index=3, repo_root="/snapshots")
    assert str(info.value).startswith(message), str(info.value)


def test_a_row_without_a_repository_source_is_rejected():
    with pytest.raises(ValueError, match=r"row 0 \(octo__calc-1\): field 'files' or 'repo_dir' is missing"):
        load_instances([row()])


def test_jsonl_parquet_and_saved_dataset_load_alike(tmp_path):
    rows = [row(), row(instance_id="octo__calc-2", FAIL_TO_PASS=["test_calc.py::test_div"])]
    rows[1]["PASS_TO_PASS"] = json.loads(rows[1]["PASS_TO_PASS"])  # a list in one row, a JSON string in the other
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    flat = [{**r, "FAIL_TO_PASS": json.dumps(r["FAIL_TO_PASS"]) if isinstance(r["FAIL_TO_PASS"], list)
             else r["FAIL_TO_PASS"], "PASS_TO_PASS": json.dumps(r["PASS_TO_PASS"])
             if isinstance(r["PASS_TO_PASS"], list) else r["PASS_TO_PASS"]} for r in rows]
    datasets.Dataset.from_list(flat).to_parquet(str(tmp_path / "rows.parquet"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(flat)}).save_to_disk(str(tmp_path / "saved"))
    expected = [instance_from_row(r, repo_root=tmp_path) for r in rows]
    for source, split in (("rows.jsonl", "train"), ("rows.parquet", "train"), ("saved", "test")):
        assert load_instances(tmp_path / source, split=split, repo_root=tmp_path) == expected, source
    with pytest.raises(ValueError, match="split must be one of"):
        load_instances(tmp_path / "saved", split="train", repo_root=tmp_path)


def test_duplicate_ids_and_unknown_sources_are_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"row 1 \(octo__calc-1\): field 'instance_id' repeats row 0"):
        load_instances([row(), row()], repo_root=tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        load_instances(tmp_path / "nope.jsonl")
    (tmp_path / "rows.csv").write_text("a\n")
    with pytest.raises(ValueError, match=r"source must be a \.jsonl"):
        load_instances(tmp_path / "rows.csv")


def test_toy_files_round_trip_through_jsonl(tmp_path):
    # Two rows whose repositories have different paths: as JSON objects `datasets` would merge them into one
    # struct; saved as JSON strings each row keeps exactly its own files.
    a = SWEInstance("t-1", "toy/a", "0" * 40, "bug", "p", "", ["t.py::a"], [], files={"a.py": "x = 1\n"},
                    extras={"level": 1})
    b = SWEInstance("t-2", "toy/b", "1" * 40, "bug", "p", "", ["t.py::b"], ["t.py::c"], files={"b/c.py": ""},
                    extras={"level": 2})
    save_instances([a, b], tmp_path / "toy.jsonl")
    assert load_instances(tmp_path / "toy.jsonl") == [a, b]


def test_jsonl_rows_with_files_as_objects_keep_their_own_files(tmp_path):
    # Written by hand (or by another tool) as JSON objects, not strings. Each instance keeps exactly its own files,
    # an empty one ("pkg/__init__.py": "") included. A struct column (older `datasets` reading this JSONL, or the
    # parquet below) merges the rows' paths into {"calc.py", "pkg/__init__.py", "pkg/core.py"}: each row reads
    # the other's paths as None.
    rows = [row(instance_id="octo__calc-1", files={"calc.py": "x = 1\n"}),
            row(instance_id="octo__calc-2", files={"pkg/__init__.py": "", "pkg/core.py": "y = 2\n"})]
    (tmp_path / "objects.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    one, two = load_instances(tmp_path / "objects.jsonl")
    assert one.files == {"calc.py": "x = 1\n"} and one.repo_dir is None
    assert two.files == {"pkg/__init__.py": "", "pkg/core.py": "y = 2\n"}
    # a parquet file another tool wrote from such rows holds a struct column: the same None paths, dropped
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "objects.parquet")
    assert pyarrow.parquet.read_table(tmp_path / "objects.parquet").to_pylist()[0]["files"]["pkg/core.py"] is None
    assert load_instances(tmp_path / "objects.parquet") == [one, two]


def test_dates_that_datasets_reads_round_trip_through_save(tmp_path):
    # SWE-bench's created_at is an ISO string; `datasets` hands it back as a naive datetime, which json.dumps
    # refused ("Object of type datetime is not JSON serializable")
    rows = [row(instance_id=f"octo__calc-{k}", created_at=f"2023-05-0{k}T12:34:56Z",
                files=json.dumps({"calc.py": f"x = {k}\n"})) for k in (1, 2)]
    (tmp_path / "swe.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_instances(tmp_path / "swe.jsonl")
    assert loaded[1].extras["created_at"] == datetime.datetime(2023, 5, 2, 12, 34, 56)
    save_instances(loaded, tmp_path / "saved.jsonl")
    saved = [json.loads(line) for line in (tmp_path / "saved.jsonl").read_text().splitlines()]
    assert [r["created_at"] for r in saved] == ["2023-05-01T12:34:56", "2023-05-02T12:34:56"]
    assert load_instances(tmp_path / "saved.jsonl") == loaded
    # a date and a time in memory are written as ISO strings too; a value JSON cannot hold names its instance
    dated = dataclasses.replace(loaded[0], extras={"day": datetime.date(2023, 5, 1), "at": datetime.time(12, 30)})
    save_instances([dated], tmp_path / "dated.jsonl")
    assert json.loads((tmp_path / "dated.jsonl").read_text())["day"] == "2023-05-01"
    assert json.loads((tmp_path / "dated.jsonl").read_text())["at"] == "12:30:00"
    with pytest.raises(ValueError, match=r"instances\[1\] \(octo__calc-2\) has a field JSON cannot hold"):
        save_instances([dated, dataclasses.replace(loaded[1], extras={"blob": object()})], tmp_path / "bad.jsonl")


def test_pytest_summary_is_read_per_test():
    output = "\n".join([
        "..F", "=== short test summary info ===",
        "PASSED tests/test_a.py::test_one",
        "PASSED tests/test_a.py::test_p[1-2]",
        "FAILED tests/test_a.py::test_two - assert 7 == 6",
        "ERROR tests/test_b.py::test_three - NameError",
        "XPASS tests/test_b.py::test_four",
    ])
    ids = ["tests/test_a.py::test_one", "tests/test_a.py::test_p[1-2]", "tests/test_a.py::test_two",
           "tests/test_b.py::test_three", "tests/test_b.py::test_four", "tests/test_b.py::test_never_ran"]
    assert parse_test_results(output, ids) == dict(zip(ids, [True, True, False, False, False, False], strict=True))
    assert pytest_argv("python3", ["t.py::a"])[-2:] == ["--", "t.py::a"]
    with pytest.raises(ValueError, match="test_ids"):
        parse_test_results(output, "tests/test_a.py::test_one")
