"""The TensorBoard and W&B metric loggers, each read back from what it wrote; a missing package names its extra."""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import wandb
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2

from orchard.train.config import load_config
from orchard.train.metrics import (
    TensorBoardLogger,
    WandbConfig,
    WandbLogger,
    build_loggers,
    read_jsonl_metrics,
)
from orchard.train.trainer import TrainConfig


def test_tensorboard_event_file_reads_back(tmp_path: Path) -> None:
    log = TensorBoardLogger(tmp_path / "tb")
    # Values exact in float32 (TensorBoard's simple_value), so they read back equal.
    log.log({"loss/total": 2.5, "lr": 0.25, "skipped": "text", "flag": True}, 1)
    log.log({"loss/total": 1.5, "lr": 0.125}, 2)
    log.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["loss/total", "lr"]  # strings and bools are not scalars
    assert [(e.step, e.value) for e in acc.Scalars("loss/total")] == [(1, 2.5), (2, 1.5)]
    assert [(e.step, e.value) for e in acc.Scalars("lr")] == [(1, 0.25), (2, 0.125)]


def _wandb_records(path: Path) -> Iterator[wandb_internal_pb2.Record]:
    """The records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then LevelDB-log records
    (crc32, little-endian length u16, type u8: 1 full, 2 first, 3 middle, 4 last) in 32 KiB blocks; a block's
    tail shorter than a record header is padding. wandb no longer ships a Python reader of its own."""
    data, block, pos, chunk = path.read_bytes(), 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero fill: end of what was written
            return
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            yield record
            chunk = b""


def test_wandb_offline_writes_its_run_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = WandbLogger(WandbConfig(project="orchard-test", mode="offline", run_name="tiny"), log_dir=tmp_path,
                      config={"lr": 0.5})
    log.log({"loss/total": 2.5}, 1)
    log.log({"loss/total": 1.5}, 2)
    log.close()
    # finish() returns before wandb's service process has written the run file; teardown waits for that process.
    wandb.teardown()
    # offline: no network; the run lives in out_dir/wandb/offline-run-*/ for `wandb sync`. Read it back.
    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(_wandb_records(path))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("orchard-test", "tiny")
    assert {i.key: json.loads(i.value_json) for i in run.config.update}["lr"] == 0.5
    # A key with "/" may be stored split, as nested_key.
    history = [(r.history.step.num, {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(step, h["loss/total"]) for step, h in history] == [(1, 2.5), (2, 1.5)]


def test_build_loggers_from_the_train_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(TrainConfig, None, ["loggers=[jsonl,tensorboard,wandb]", "wandb.project=p1",
                                          "wandb.mode=offline"])
    assert cfg.wandb == WandbConfig(project="p1", mode="offline", run_name=None)
    multi = build_loggers(cfg.loggers, tmp_path / "run7", total_steps=2, config={"a": 1}, wandb=cfg.wandb)
    assert [type(lg).__name__ for lg in multi.loggers] == ["JsonlLogger", "TensorBoardLogger", "WandbLogger"]
    assert multi.loggers[2]._run.name == "run7"  # no run_name: the output directory's name
    multi.log({"x": 1.0}, 1)
    multi.close()
    assert read_jsonl_metrics(tmp_path / "run7" / "metrics.jsonl") == [{"step": 1, "x": 1.0}]
    assert list((tmp_path / "run7" / "tensorboard").glob("events.out.tfevents.*"))
    with pytest.raises(ValueError, match="unknown logger 'tb'"):
        build_loggers(["tb"], tmp_path, total_steps=1)
    with pytest.raises(ValueError, match="wandb must be a WandbConfig"):
        build_loggers(["wandb"], tmp_path, total_steps=1, wandb={"project": "p"})


@pytest.mark.parametrize(("name", "package"), [("tensorboard", "tensorboard"), ("wandb", "wandb")])
def test_a_missing_logger_package_names_its_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  name: str, package: str) -> None:
    # `import package` (and of its submodules, some already imported) now fails as if it were not installed.
    for module in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(ModuleNotFoundError, match=rf"pip install 'orchard-rl\[{name}\]'") as exc:
        build_loggers(["jsonl", name], tmp_path, total_steps=1)
    assert "\n" not in str(exc.value)  # one line


@pytest.mark.parametrize(("kwargs", "match"), [(dict(project=""), "project"), (dict(mode="cloud"), "mode must be"),
                                               (dict(run_name=3), "run_name")])
def test_wandb_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        WandbConfig(**kwargs)
