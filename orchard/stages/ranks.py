"""Ranks and sharding: one recipe, unchanged, under ``torchrun`` / ``deepspeed`` (one node or several).

The launcher starts ``W`` copies of the recipe and names each one in the environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). No scheduler of ours runs on top. What the stages do with it::

    tasks of a step  = the same draw on every rank (same seed)
    rank r plays     tasks shard_range(P, r, W)          # a contiguous block: a group lives on one rank
    where it lives   rewards, group filter, advantages    # the group statistics that need the whole group
    all_gather       (samples, advantages, counts)        # rank order = task order = the single-process order
    train            the trainer shards rows and divides by the token count of the whole batch (Z_k)
    rank 0           logs, checkpoints, plots; pushes weights to shared engines

Gathering the trained samples (token ids, log-probs, advantages: a few MB per step) instead of training each rank
on its own groups keeps the single-process gradient exact for every PPO setting (``ppo_epochs``, ``mini_batches``,
BAR), balances the training rows evenly over ranks however many groups each rank's filter dropped, and keeps
every rank's number of micro-batches equal, which ZeRO's per-micro-batch reduction needs. The global token
normaliser ``Z_k`` is then the one the trainer already computes from the whole batch; `all_reduce_sum` is there
for counts a caller keeps per rank.

A rank that dies ends the job: the launcher (``torchrun``'s agent, the ``deepspeed`` launcher) stops the others
when one exits, gloo / NCCL fail a collective whose peer is gone, and the process group's ``timeout_s`` bounds any
collective that still waits.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Ranks", "all_gather_concat", "all_reduce_sum", "barrier", "init_ranks", "ranks_from_env", "shard_range"]


@dataclass(frozen=True)
class Ranks:
    """Where this process stands among the launcher's ``world_size`` processes."""

    rank: int = 0
    """Global rank, 0 .. world_size - 1 (``RANK``)."""
    world_size: int = 1
    """Number of processes of the job, all nodes (``WORLD_SIZE``)."""
    local_rank: int = 0
    """Rank on this node, the GPU index to use (``LOCAL_RANK``)."""

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "local_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.world_size < 1 or self.rank >= self.world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank {self.rank} of world_size {self.world_size}")

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes logs, checkpoints and plots, and pushes weights to shared engines."""
        return self.rank == 0


def ranks_from_env(env: Mapping[str, str] | None = None) -> Ranks:
    """The `Ranks` a launcher (``torchrun``, ``deepspeed``) wrote into ``env`` (default ``os.environ``); a bare
    process (no ``WORLD_SIZE``) is rank 0 of 1.

    Raises:
        ValueError: naming the variable whose value is not a non-negative int, or a rank outside the world.
    """
    env = os.environ if env is None else env
    values = {}
    for name, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        text = env.get(name, default)
        try:
            values[name] = int(text)
        except ValueError:
            raise ValueError(f"{name} must be a non-negative int, got {text!r}") from None
    return Ranks(rank=values["RANK"], world_size=values["WORLD_SIZE"], local_rank=values["LOCAL_RANK"])


def init_ranks(*, timeout_s: float = 1800.0, backend: str | None = None) -> Ranks:
    """This process's `Ranks`, with the ``torch.distributed`` process group started when the world has several.

    The group (NCCL on CUDA, gloo on CPU unless ``backend`` says) is started once, with ``timeout_s`` on every
    collective, so a rank stuck on a dead peer raises instead of waiting forever; DeepSpeed later adopts the same
    group. On CUDA the process takes GPU ``LOCAL_RANK``. Idempotent.

    Raises:
        ValueError: naming ``timeout_s`` when it is not a positive number.
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    ranks = ranks_from_env()
    if ranks.world_size == 1 or torch.distributed.is_initialized():
        return ranks
    if torch.cuda.is_available():
        torch.cuda.set_device(ranks.local_rank)
    torch.distributed.init_process_group(
        backend=backend or ("nccl" if torch.cuda.is_available() else "gloo"),
        timeout=datetime.timedelta(seconds=float(timeout_s)),
    )
    return ranks


def shard_range(n: int, rank: int, world_size: int) -> range:
    """The contiguous block of ``range(n)`` that ``rank`` of ``world_size`` owns; blocks differ in size by at most
    one, and their concatenation in rank order is ``range(n)`` (so gathered results come back in input order).

    Raises:
        ValueError: naming ``n``, ``rank`` or ``world_size`` when out of range.
    """
    for name, value in (("n", n), ("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if world_size < 1 or rank >= world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank {rank} of world_size {world_size}")
    return range(n * rank // world_size, n * (rank + 1) // world_size)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


def all_gather_concat(local: Sequence[Any]) -> list[Any]:
    """Every rank's ``local`` list, concatenated in rank order, on every rank (``local`` itself on one rank).

    Objects travel pickled (``all_gather_object``); tensors in them come back on the CPU.
    """
    if not _distributed():
        return list(local)
    parts: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, list(local))
    return [item for part in parts for item in part]


def all_reduce_sum(values: Mapping[str, float]) -> dict[str, float]:
    """Each value summed over ranks (in float64), on every rank; every rank must pass the same keys."""
    keys = sorted(values)
    if not _distributed() or not keys:
        return {k: float(values[k]) for k in keys}
    vec = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    if torch.distributed.get_backend() == "nccl":
        vec = vec.cuda()
    torch.distributed.all_reduce(vec)
    return dict(zip(keys, vec.cpu().tolist(), strict=True))


def barrier() -> None:
    """Wait for every rank (nothing on one rank)."""
    if _distributed():
        torch.distributed.barrier()
