"""SWE task instances in the SWE-bench schema, and their loader.

One `SWEInstance` per task: the repository at a base commit, an issue (``problem_statement``), the gold fix
(``patch``), the hidden tests (``test_patch``) and the tests that decide it (``FAIL_TO_PASS`` must go from failing
to passing, ``PASS_TO_PASS`` must keep passing). The names are SWE-bench's, so a user who has SWE-bench Verified,
SWE-rebench or SWE-Gym on disk loads those files with `load_instances` and runs the same code as on the toy
instances of `orchard.domains.swe.generator`.

Where the repository's files come from (never the network):

- toy instances carry them: ``files`` maps a path to its text at the base commit;
- real instances name a snapshot of the repository at ``base_commit`` on disk: ``repo_dir`` (a directory;
  its ``.git``, if any, is ignored, so the agent never sees the history after the base commit), by default
  ``repo_root / instance_id`` (a local clone or a ``git worktree`` checked out at ``base_commit``).
  `check_snapshots` refuses one that is not at its ``base_commit`` (asked of git), naming the instance.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REQUIRED_FIELDS = ("instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch",
                   "FAIL_TO_PASS", "PASS_TO_PASS")
"""The SWE-bench fields every row must have."""

_OWN_FIELDS = ("files", "repo_dir")


@dataclass
class SWEInstance:
    """One SWE task in the SWE-bench schema (field names as in SWE-bench).

    ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` are pytest node ids (``tests/test_x.py::test_y``); SWE-bench also
    uses other ids for repositories that run other test commands, which the loader keeps as they are.
    """

    instance_id: str
    repo: str
    """``owner/name`` of the repository (toy instances: ``toy/<template>``)."""
    base_commit: str
    """The commit the task starts from (toy instances: a digest of the base files)."""
    problem_statement: str
    """The issue, as a user reported it; the only task text the agent sees."""
    patch: str
    """The gold fix: a unified diff (``git diff`` format) of the non-test files."""
    test_patch: str
    """The hidden tests: a unified diff applied only when scoring; the agent never sees it."""
    FAIL_TO_PASS: list[str]
    """Tests that fail at the base commit and pass after the fix."""
    PASS_TO_PASS: list[str]
    """Tests that pass before and after the fix (regressions)."""
    files: dict[str, str] | None = None
    """The repository at the base commit, path -> text (toy instances); None for a snapshot on disk."""
    repo_dir: str | None = None
    """A directory holding the repository at ``base_commit`` (real instances); None when ``files`` is given."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Every other field of the row (SWE-bench's ``version``, ``hints_text``, ``created_at``, ...; the toy
    generator's ``template``, ``seed``, ``level``, ``mutations``)."""

    @property
    def id(self) -> str:
        """``instance_id``, under the name the rollout layer reads a task's id by (`orchard.rollout.harness.task_id`)."""
        return self.instance_id

    @property
    def tests(self) -> list[str]:
        """``FAIL_TO_PASS`` then ``PASS_TO_PASS``: every test that decides the task."""
        return [*self.FAIL_TO_PASS, *self.PASS_TO_PASS]

    def read(self, path: str) -> str | None:
        """The text of ``path`` (relative to the repository root) at the base commit: from ``files``, or read from
        the snapshot in ``repo_dir``; None when the repository has no such file."""
        if self.files is not None:
            return self.files.get(path)
        file = Path(self.repo_dir or "") / path
        return file.read_text(errors="replace") if file.is_file() else None

    def paths(self) -> list[str]:
        """Every file of the repository at the base commit, sorted: ``files``' paths, or the snapshot's files
        outside its ``.git`` (what the sandbox gets)."""
        if self.files is not None:
            return sorted(self.files)
        root = Path(self.repo_dir or "")
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                      if p.is_file() and p.relative_to(root).parts[0] != ".git")

    def to_row(self) -> dict[str, Any]:
        """The instance as one flat row (extras first, then the schema's fields; the test lists as lists)."""
        return {**self.extras, "instance_id": self.instance_id, "repo": self.repo, "base_commit": self.base_commit,
                "problem_statement": self.problem_statement, "patch": self.patch, "test_patch": self.test_patch,
                "FAIL_TO_PASS": list(self.FAIL_TO_PASS), "PASS_TO_PASS": list(self.PASS_TO_PASS),
                "files": None if self.files is None else dict(self.files), "repo_dir": self.repo_dir}


def _test_list(value: Any, where: str) -> list[str]:
    """A test list given as a list or, as in SWE-bench's files, as a JSON string of one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not a JSON list of test ids: {exc.msg} in {value[:80]!r}") from None
    if (isinstance(value, Sequence) and not isinstance(value, (str, bytes))) or _is_array(value):
        value = list(value)
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        raise ValueError(f"{where} must be a list of non-empty test id strings, got {value!r:.120}")
    return value


def _is_array(value: Any) -> bool:
    # parquet and saved datasets hand list columns back as numpy arrays when read through pandas
    return type(value).__name__ == "ndarray"


def instance_from_row(row: Mapping[str, Any], *, index: int | str = 0,
                      repo_root: str | Path | None = None) -> SWEInstance:
    """Validate one row of an instance file and build its `SWEInstance`.

    Args:
        row: the row's fields (SWE-bench schema; other fields go to ``extras``).
        index: how the row is named in error messages (its position in the file).
        repo_root: where real repositories lie: a row without ``files`` or ``repo_dir`` gets
            ``repo_dir = repo_root / instance_id``.

    Raises:
        ValueError: naming the row (``row <index> (<instance_id>)``) and the field that is missing or malformed.
    """
    if not isinstance(row, Mapping):
        raise ValueError(f"row {index} must be a mapping of fields, got {type(row).__name__}")
    ident = row.get("instance_id")
    where = f"row {index}" + (f" ({ident})" if isinstance(ident, str) and ident else "")
    for name in REQUIRED_FIELDS:
        if name not in row or row[name] is None:
            raise ValueError(f"{where}: field {name!r} is missing")
    for name in ("instance_id", "repo", "base_commit", "problem_statement", "patch"):
        if not isinstance(row[name], str) or not row[name].strip():
            raise ValueError(f"{where}: field {name!r} must be a non-empty string, got {row[name]!r:.80}")
    if not isinstance(row["test_patch"], str):
        raise ValueError(f"{where}: field 'test_patch' must be a string, got {type(row['test_patch']).__name__}")
    fail_to_pass = _test_list(row["FAIL_TO_PASS"], f"{where}: field 'FAIL_TO_PASS'")
    pass_to_pass = _test_list(row["PASS_TO_PASS"], f"{where}: field 'PASS_TO_PASS'")
    if not fail_to_pass:
        raise ValueError(f"{where}: field 'FAIL_TO_PASS' is empty (nothing would decide the task)")
    files = row.get("files")
    if isinstance(files, str):  # a JSON string, as test lists are
        try:
            files = json.loads(files)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: field 'files' is not a JSON object: {exc.msg}") from None
    if isinstance(files, Mapping):
        # a JSONL read by `datasets` turns the dicts of all rows into one struct: a path of another row's
        # repository comes back as None here
        files = {k: v for k, v in files.items() if v is not None}
    if files is not None and (not isinstance(files, Mapping) or not all(
            isinstance(k, str) and k and isinstance(v, str) for k, v in files.items())):
        raise ValueError(f"{where}: field 'files' must map paths to text, got {files!r:.120}")
    repo_dir = row.get("repo_dir")
    if repo_dir is not None and (not isinstance(repo_dir, str) or not repo_dir):
        raise ValueError(f"{where}: field 'repo_dir' must be a directory path, got {repo_dir!r}")
    if files is None and repo_dir is None and repo_root is not None:
        repo_dir = str(Path(repo_root) / row["instance_id"])
    if files is None and repo_dir is None:
        raise ValueError(f"{where}: field 'files' or 'repo_dir' is missing (give repo_root to locate snapshots)")
    if files is not None and repo_dir is not None:
        raise ValueError(f"{where}: fields 'files' and 'repo_dir' are both set; give one source of the repository")
    extras = {k: v for k, v in row.items() if k not in REQUIRED_FIELDS and k not in _OWN_FIELDS}
    return SWEInstance(
        instance_id=row["instance_id"], repo=row["repo"], base_commit=row["base_commit"],
        problem_statement=row["problem_statement"], patch=row["patch"], test_patch=row["test_patch"],
        FAIL_TO_PASS=fail_to_pass, PASS_TO_PASS=pass_to_pass,
        files=None if files is None else dict(files), repo_dir=repo_dir, extras=extras)


def load_instances(source: str | Path | Sequence[Mapping[str, Any]], *, split: str = "train",
                   repo_root: str | Path | None = None) -> list[SWEInstance]:
    """Load SWE instances from a JSONL file, a parquet file, a saved ``datasets`` directory, or rows in memory.

    Reading goes through `datasets` (imported here, not with the module): ``.jsonl`` / ``.json`` files,
    ``.parquet`` files, a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (then
    ``split`` picks the part). ``FAIL_TO_PASS`` / ``PASS_TO_PASS`` may be lists or JSON strings of lists (as in
    SWE-bench's files). Nothing is downloaded.

    Args:
        source: a path, or a sequence of row mappings.
        split: the part of a saved ``DatasetDict`` to read. Default "train".
        repo_root: the directory of repository snapshots for rows without ``files`` or ``repo_dir``
            (``repo_root / instance_id``).

    Raises:
        ValueError: an unreadable source, or a bad row (the message names the row and the field); duplicate
            ``instance_id``s.
    """
    if isinstance(source, (str, Path)):
        rows: Sequence[Mapping[str, Any]] = _read_rows(Path(source), split)
    elif isinstance(source, Sequence) and not isinstance(source, (str, bytes)):
        rows = source
    else:
        raise ValueError(f"source must be a path or a sequence of rows, got {type(source).__name__}")
    instances = [instance_from_row(row, index=i, repo_root=repo_root) for i, row in enumerate(rows)]
    seen: dict[str, int] = {}
    for i, inst in enumerate(instances):
        if inst.instance_id in seen:
            raise ValueError(f"row {i} ({inst.instance_id}): field 'instance_id' repeats row {seen[inst.instance_id]}")
        seen[inst.instance_id] = i
    return instances


_HASH = re.compile(r"[0-9a-fA-F]{4,64}")


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # Nothing of this process's git environment (GIT_DIR, GIT_INDEX_FILE, ...) may point git elsewhere.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(["git", "-C", str(repo), *args], env=env, capture_output=True, text=True)


def check_snapshot(instance: SWEInstance) -> None:
    """Refuse a repository snapshot that is not the repository at ``instance.base_commit``.

    An instance with ``files`` passes (its files are the base). A ``repo_dir`` must be the top of a git repository
    (a clone, or a ``git worktree``) whose ``HEAD`` is ``base_commit`` (full or abbreviated) with nothing changed:
    no tracked file modified, added or deleted, and no untracked file outside its ignore rules (`git status`).
    The sandbox gets the directory's files, so a snapshot at another commit would give the agent another task.

    Raises:
        ValueError: ``<instance_id>: ...``: the directory is missing or is no git repository's top (a plain
            directory cannot be checked), ``base_commit`` is no commit of it, ``HEAD`` is another commit, or files
            changed.
    """
    if not isinstance(instance, SWEInstance):
        raise ValueError(f"instance must be a SWEInstance, got {type(instance).__name__}")
    if instance.files is not None:
        return
    where = f"{instance.instance_id}: the snapshot {instance.repo_dir!r}"
    repo = Path(instance.repo_dir or "")
    if not repo.is_dir():
        raise ValueError(f"{where} does not exist (put a clone or a git worktree at base_commit there)")
    top = _git(repo, "rev-parse", "--show-toplevel")
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != repo.resolve():
        said = f" (git: {top.stderr.strip()[-200:]})" if top.returncode != 0 else ""
        raise ValueError(f"{where} is not a git repository of its own (a clone or a git worktree), so it cannot be "
                         f"checked to be at base_commit {instance.base_commit}{said}")
    if not _HASH.fullmatch(instance.base_commit):
        raise ValueError(f"{instance.instance_id}: base_commit must be a commit hash, got {instance.base_commit!r}")
    base = _git(repo, "rev-parse", "--verify", "--quiet", f"{instance.base_commit}^{{commit}}")
    if base.returncode != 0:
        raise ValueError(f"{where} has no commit {instance.base_commit} (its base_commit)")
    head = _git(repo, "rev-parse", "--verify", "--quiet", "HEAD^{commit}")
    if head.stdout.strip() != base.stdout.strip():
        raise ValueError(f"{where} is at commit {head.stdout.strip() or '(none)'}, not at its base_commit "
                         f"{base.stdout.strip()} (check it out there: git -C <snapshot> checkout "
                         f"{instance.base_commit})")
    status = _git(repo, "status", "--porcelain")
    if status.returncode != 0:
        raise ValueError(f"{where}: git status failed: {status.stderr.strip()[-300:]}")
    changed = status.stdout.splitlines()
    if changed:
        raise ValueError(f"{where} is at base_commit but has {len(changed)} changed or untracked file(s): "
                         f"{', '.join(line[3:] for line in changed[:5])}")


def check_snapshots(instances: Sequence[SWEInstance]) -> None:
    """`check_snapshot` of every instance, in order: the first that is not at its base commit raises."""
    for instance in instances:
        check_snapshot(instance)


def _read_rows(path: Path, split: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - datasets is part of the data extra
        raise ImportError("loading SWE instances from files needs the 'datasets' package (pip install "
                          "orchard-rl[data])") from exc
    if not path.exists():
        raise ValueError(f"source {str(path)!r} does not exist")
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"split must be one of {sorted(loaded)} for {path.name}, got {split!r}")
            loaded = loaded[split]
        return [dict(row) for row in loaded]
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        builder = "json"
    elif suffix == ".parquet":
        builder = "parquet"
    else:
        raise ValueError(f"source must be a .jsonl, .json or .parquet file or a saved dataset directory, got {path.name!r}")
    # One fresh cache directory per read: `datasets` would otherwise cache the converted table under ~/.cache
    # and hand back a stale copy after the file changed at the same size and time.
    import tempfile

    with tempfile.TemporaryDirectory(prefix="orchard-swe-") as cache_dir:
        loaded = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache_dir)
        return [dict(row) for row in loaded]


def save_instances(instances: Sequence[SWEInstance], path: str | Path) -> None:
    """Write instances as JSONL (one `SWEInstance.to_row` per line, ``files`` as a JSON string, dates and times
    as ISO strings), readable by `load_instances`.

    Raises:
        ValueError: ``instances`` is not a sequence of `SWEInstance`, or one holds a value JSON cannot hold.
    """
    if isinstance(instances, (str, bytes)) or not isinstance(instances, Sequence):
        raise ValueError(f"instances must be a sequence of SWEInstance, got {type(instances).__name__}")
    for i, inst in enumerate(instances):
        if not isinstance(inst, SWEInstance):
            raise ValueError(f"instances[{i}] must be a SWEInstance, got {type(inst).__name__}")
    # ``files`` travels as a JSON string: as a JSON object, `datasets` would merge the paths of all rows into
    # one struct column
    lines = []
    for i, inst in enumerate(instances):
        row = inst.to_row()
        row["files"] = None if inst.files is None else json.dumps(inst.files)
        try:
            lines.append(json.dumps(row, default=_iso_date) + "\n")
        except TypeError as exc:
            raise ValueError(f"instances[{i}] ({inst.instance_id}) has a field JSON cannot hold: {exc}") from None
    Path(path).write_text("".join(lines))


def _iso_date(value: Any) -> str:
    """``json.dumps``'s fallback: a date, time or datetime as its ISO string. `datasets` reads a JSONL's ISO
    strings (SWE-bench's ``created_at``) into naive datetimes, and reads the string written here back into the
    same value."""
    if isinstance(value, (datetime.date, datetime.time)):  # a datetime is a date
        return value.isoformat()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
