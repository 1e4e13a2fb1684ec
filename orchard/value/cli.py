"""Command line of value training: build the historical pool, render, train, save, report reranking.

::

    python -m orchard.value.cli data=pool.jsonl tokenizer=TOK_DIR model=CKPT_DIR output_dir=OUT \
        [eval_data=heldout.jsonl] [steps=200 ...] [--config values.yaml] [--debug]

Every :class:`ValueTrainConfig` field is a ``key=value`` override (``--help`` lists them with their defaults).
A configuration or usage error (an unknown key, a bad value, a missing file) prints one line ``error: ...`` and
exits with status 2; ``--debug`` shows its traceback instead.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from orchard._extras import requires_extra

__all__ = ["ValueTrainConfig", "main", "run"]


@dataclass
class ValueTrainConfig:
    """Settings of ``python -m orchard.value.cli``."""

    data: str = ""
    """JSONL of past trajectories (orchard.data schema) forming the historical pool."""
    tokenizer: str = ""
    """Local tokenizer directory (with a chat template)."""
    model: str = ""
    """Local causal-LM or ValueModel checkpoint directory to start from."""
    output_dir: str = "runs/value"
    """Where the trained ValueModel and metrics.jsonl go."""
    eval_data: str | None = None
    """Held-out JSONL of grouped candidates (same task_id) for the reranking report."""
    max_per_task: int = 8
    """Pool cap per task."""
    balance: bool = True
    """Balance successes and failures in the pool."""
    max_len: int = 4096
    """Longest sequence the value model reads; longer trajectories are read in left-truncated windows."""
    steps: int = 200
    """Optimizer steps."""
    batch_size: int = 8
    """Trajectories per step."""
    lr: float = 1e-5
    """AdamW learning rate."""
    gamma: float = 0.98
    """GAE discount (Orchard: 0.98)."""
    lam: float = 0.95
    """GAE lambda (Orchard: 0.95)."""
    success_threshold: float = 0.5
    """Reward above which a trajectory counts as a success."""
    seed: int = 0
    """Seed of the pool selection, the head initialisation and the batch order."""


class _UsageError(Exception):
    """A configuration or usage error: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    from orchard.train.config import format_help

    return _Parser(
        prog="python -m orchard.value.cli",
        description="Train a value model on past trajectories with GAE targets and report best-of-N reranking.",
        epilog="settings (key=value overrides; key: type = default  # meaning):\n" + format_help(ValueTrainConfig),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _check(cfg: ValueTrainConfig) -> None:
    for name in ("data", "tokenizer", "model"):
        if not getattr(cfg, name):
            raise ValueError(f"config key {name!r} is required")
    for name, want_dir in (("data", False), ("tokenizer", True), ("model", True), ("eval_data", False)):
        value = getattr(cfg, name)
        if value is None:
            continue
        if want_dir:
            from orchard.models.pretrained import resolve_checkpoint

            resolve_checkpoint(value)  # a directory or a fetched named checkpoint
        elif not Path(value).is_file():
            raise ValueError(f"{name}={value} is not a file")
    for name in ("max_per_task", "steps", "batch_size"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.max_len < 2:
        raise ValueError(f"max_len must be >= 2, got {cfg.max_len}")
    if not cfg.lr > 0:
        raise ValueError(f"lr must be > 0, got {cfg.lr}")
    for name in ("gamma", "lam"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {getattr(cfg, name)}")


def _prepare(cfg: ValueTrainConfig) -> dict[str, Any]:
    """Check the settings, load the tokenizer and the pool, render; every failure here is a usage error."""
    with requires_extra("train"):
        pass

    from orchard.data import read_jsonl, render_trajectory
    from orchard.value.pool import build_value_pool

    _check(cfg)
    from orchard.models.pretrained import load_chat_tokenizer

    tok = load_chat_tokenizer(cfg.tokenizer)
    if tok.pad_token_id is None:
        raise ValueError(f"tokenizer={cfg.tokenizer} has no pad token")

    def render(trajs: list) -> list:
        out = [render_trajectory(t, tok) for t in trajs]
        return [s for s in out if s is not None]

    pool = build_value_pool(read_jsonl(cfg.data), max_per_task=cfg.max_per_task, balance=cfg.balance,
                            success_threshold=cfg.success_threshold, seed=cfg.seed)
    samples = render(pool)
    if not samples:
        raise ValueError(f"data={cfg.data} has no verified trajectory to train on")
    held = None
    if cfg.eval_data:
        held = render([t for t in read_jsonl(cfg.eval_data)
                       if t.reward is not None and t.termination_reason != "env_error"])
    return {"pad_id": int(tok.pad_token_id), "samples": samples, "held": held}


def run(cfg: ValueTrainConfig) -> dict[str, float]:
    """Build the pool, render, train, save, and (with ``eval_data``) report reranking; returns the report.

    ``ValueError`` / ``OSError`` for a bad configuration or unreadable inputs, before any training.
    """
    return _train(cfg, _prepare(cfg))


def _train(cfg: ValueTrainConfig, prepared: dict[str, Any]) -> dict[str, float]:
    from orchard.train.metrics import JsonlLogger
    from orchard.value.model import ValueModel
    from orchard.value.train import evaluate_reranking, train_value_model

    pad_id = prepared["pad_id"]
    model = ValueModel.from_pretrained(cfg.model, seed=cfg.seed)
    out = Path(cfg.output_dir)
    logger = JsonlLogger(out / "metrics.jsonl")
    train_value_model(model, prepared["samples"], pad_id=pad_id, max_len=cfg.max_len, steps=cfg.steps,
                      batch_size=cfg.batch_size, lr=cfg.lr, gamma=cfg.gamma, lam=cfg.lam, seed=cfg.seed,
                      log=logger.log)
    model.save_pretrained(out / "model")
    report: dict[str, float] = {}
    if prepared["held"] is not None:
        report = evaluate_reranking(model, prepared["held"], pad_id=pad_id, max_len=cfg.max_len,
                                    success_threshold=cfg.success_threshold)
        logger.log(report, cfg.steps)
        for k, v in report.items():
            print(f"{k}\t{v:.4f}")
    logger.close()
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run, and return the exit status: 0, or 2 on a usage error."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    parser = _parser()
    parser.add_argument("--config", help="YAML file filling the settings below (overrides win)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a configuration error")
    parser.add_argument("overrides", nargs="*", help="key=value settings (listed below)")
    try:
        ns = parser.parse_args(args)
        from orchard.train.config import load_config

        cfg = load_config(ValueTrainConfig, ns.config, ns.overrides)
        prepared = _prepare(cfg)
    except (_UsageError, ValueError, OSError) as exc:
        if debug:
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2
    _train(cfg, prepared)
    return 0


if __name__ == "__main__":
    sys.exit(main())
