"""Two engines behind one small interface: plain torch (one process) and DeepSpeed ZeRO-2 / ZeRO-3.

Both take the same client optimizer (``torch.optim.AdamW``) and the same ``LambdaLR`` schedule, so a step on the
plain engine and the same step under DeepSpeed apply the same update (up to float summation order); the tests
check it. Using AdamW as DeepSpeed's client optimizer (``zero_allow_untested_optimizer``) instead of
``DeepSpeedCPUAdam`` also avoids JIT-compiling the CPU Adam op on first use; on GPU pass a DeepSpeed optimizer in
the JSON config if you want its fused kernel (the trainer then uses it instead of the client optimizer).

Gradient accumulation: the trainer calls ``backward`` once per micro-batch with a loss that is already divided by
the global normaliser, and ``step`` once per optimizer step. Under DeepSpeed the accumulation boundary is set
explicitly (``set_gradient_accumulation_boundary``) and ``backward`` does not rescale by the accumulation count.
DeepSpeed averages gradients over ranks, so the trainer multiplies each rank's loss by the world size.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR

from orchard._extras import requires_extra

__all__ = [
    "DeepSpeedTrainEngine",
    "PlainEngine",
    "TrainEngine",
    "ds_config",
    "init_distributed",
    "load_ds_config",
]


class TrainEngine(Protocol):
    """What the trainer needs from an engine."""

    module: nn.Module
    rank: int
    world_size: int

    def forward_model(self) -> nn.Module:
        """What a log-prob function should call for a forward pass (the module, or the DeepSpeed engine)."""
        ...

    def begin_micro_batch(self) -> None:
        """Called before each micro-batch's forward."""
        ...

    def backward(self, loss: Tensor, *, is_last_micro_batch: bool) -> None: ...

    def step(self) -> float:
        """Apply the accumulated gradient (clip, optimizer, scheduler); returns the pre-clip gradient norm."""
        ...

    def lr(self) -> float: ...

    def named_full_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """Every parameter, complete (gathered under ZeRO-3), as a CPU tensor, one at a time."""
        ...

    def save(self, directory: Path) -> None: ...

    def load(self, directory: Path) -> None: ...


class PlainEngine:
    """One process, plain torch: ``loss.backward()``, ``clip_grad_norm_``, optimizer and scheduler steps."""

    rank = 0
    world_size = 1

    def __init__(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LambdaLR, *, grad_clip: float | None
    ) -> None:
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0 or None, got {grad_clip!r}")
        self.module = module
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.grad_clip = grad_clip

    def forward_model(self) -> nn.Module:
        return self.module

    def begin_micro_batch(self) -> None:
        pass

    def backward(self, loss: Tensor, *, is_last_micro_batch: bool) -> None:
        loss.backward()

    def step(self) -> float:
        params = [p for p in self.module.parameters() if p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.zeros(())
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def named_full_parameters(self) -> Iterator[tuple[str, Tensor]]:
        for name, param in self.module.named_parameters():
            yield name, param.detach().to("cpu", copy=True)

    def save(self, directory: Path) -> None:
        torch.save(self.module.state_dict(), directory / "model.pt")
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
        torch.save(self.scheduler.state_dict(), directory / "scheduler.pt")

    def load(self, directory: Path) -> None:
        self.module.load_state_dict(torch.load(directory / "model.pt", weights_only=True))
        self.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True))
        self.scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=True))


def load_ds_config(zero_stage: int) -> dict[str, Any]:
    """The shipped DeepSpeed JSON (``orchard/train/ds_configs/zero{2,3}.json``) for ``zero_stage``."""
    if zero_stage not in (2, 3):
        raise ValueError(f"zero_stage must be 2 or 3, got {zero_stage!r}")
    text = resources.files("orchard.train").joinpath(f"ds_configs/zero{zero_stage}.json").read_text()
    return json.loads(text)


def ds_config(
    base: dict[str, Any], *, micro_batch_size: int, world_size: int, grad_clip: float | None, bf16: bool
) -> dict[str, Any]:
    """``base`` with the trainer's settings written in: batch sizes, clipping and bf16 come from the train config
    so the JSON cannot disagree with it. The accumulation count is 1 because the trainer marks the boundary."""
    cfg = json.loads(json.dumps(base))
    cfg["train_micro_batch_size_per_gpu"] = micro_batch_size
    cfg["gradient_accumulation_steps"] = 1
    cfg["train_batch_size"] = micro_batch_size * world_size
    cfg["gradient_clipping"] = 0.0 if grad_clip is None else float(grad_clip)
    cfg["bf16"] = {**cfg.get("bf16", {}), "enabled": bool(bf16)}
    cfg.setdefault("zero_allow_untested_optimizer", True)
    return cfg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed() -> tuple[int, int]:
    """Initialise ``torch.distributed`` for DeepSpeed if needed; returns ``(rank, world_size)``.

    Under ``torchrun`` the environment names the rank and world; a bare single process gets a one-rank group on
    loopback. The backend is NCCL on CUDA and gloo on CPU.
    """
    with requires_extra("train"):
        import deepspeed

    if not torch.distributed.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


class DeepSpeedTrainEngine:
    """DeepSpeed ZeRO-2 / ZeRO-3 over a client optimizer and scheduler (see the module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: LambdaLR,
        config: dict[str, Any],
    ) -> None:
        with requires_extra("train"):
            import deepspeed

        self.rank, self.world_size = init_distributed()
        self.zero_stage = int(config.get("zero_optimization", {}).get("stage", 0))
        engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler, config=config
        )
        self.engine = engine
        self.module = engine.module
        self.optimizer = ds_optimizer
        self.scheduler = ds_scheduler

    def forward_model(self) -> nn.Module:
        # The engine's forward keeps DeepSpeed's bookkeeping (autocast, ZeRO-3 parameter hooks); attribute access
        # falls through to the module.
        return self.engine

    def begin_micro_batch(self) -> None:
        # ZeRO-3 counts micro-steps in the engine's forward; a log-prob function that calls submodules directly
        # (a fused lm-head path) bypasses it, and ZeRO-3 would then overwrite the accumulated gradient instead of
        # adding to it. The call is idempotent, so running it here as well as in forward is safe.
        clear = getattr(self.optimizer, "clear_backward_seen_flag", None)
        if clear is not None:
            clear()

    def backward(self, loss: Tensor, *, is_last_micro_batch: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(is_last_micro_batch)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def named_full_parameters(self) -> Iterator[tuple[str, Tensor]]:
        if self.zero_stage != 3:
            for name, param in self.module.named_parameters():
                yield name, param.detach().to("cpu", copy=True)
            return
        with requires_extra("train"):
            import deepspeed

        # One parameter at a time, so the full model never needs to fit on one device at once.
        for name, param in self.module.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                yield name, param.detach().to("cpu", copy=True)

    def save(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag="engine", save_latest=False)

    def load(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(directory), tag="engine")
        if path is None:
            raise ValueError(f"directory {str(directory)!r} holds no DeepSpeed checkpoint")
