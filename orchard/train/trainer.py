"""The training step and loop: objective over micro-batches, global normaliser, engine, checkpoints, metrics.

One optimizer step on a global batch of ``B`` rendered sequences (``[B, T]`` tensors from ``orchard.data``)::

    Z_k   = Σ over the whole global batch of term k's mask          (global normaliser, one per mask key)
    rank r takes rows [r·B/W, (r+1)·B/W)                            (padded with all-masked rows to a multiple of W)
    for each micro-batch m of ``micro_batch_size`` rows (right padding trimmed):
        logp  = logprob_fn(model, m)                                # [b, t]
        loss  = W · Σ_k w_k · loss_k(logp, m; agg="token-sum-norm", normalizer=Z_k)
        backward(loss)                                              # gradients accumulate
    clip to ``grad_clip`` → AdamW → cosine schedule

Because every micro-batch divides by the same ``Z_k``, the accumulated gradient is the gradient of the whole-batch
token mean, whatever ``micro_batch_size`` and world size ``W`` are (the factor ``W`` undoes DeepSpeed's average
over ranks). Paper defaults (set them in the recipe's YAML): SFT lr 1e-5 → 1e-6, RL lr 1e-6 → 1e-7, global batch
128, policy clip 0.2 / 0.28, gradient clip 1.0.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from orchard.train import checkpoint as ckpt
from orchard.train.engine import DeepSpeedTrainEngine, PlainEngine, TrainEngine, ds_config, load_ds_config
from orchard.train.lora import LoraAdapters, LoraConfig, add_lora, merge_lora, merged_weights
from orchard.train.metrics import MultiLogger, WandbConfig, build_loggers, check_logger_names
from orchard.train.objective import (
    LossTerm,
    check_objective,
    objective_loss_with_sources,
    term_mask_key,
    with_derived_masks,
)
from orchard.train.progress import StepProgress
from orchard.train.schedule import cosine_schedule

__all__ = ["DataCursor", "OptimConfig", "TrainConfig", "Trainer", "forward_logprobs", "split_batch"]

LogprobFn = Callable[[nn.Module, Mapping[str, Tensor]], Tensor]


@dataclass
class OptimConfig:
    """AdamW, cosine schedule with warm-up, gradient clipping."""

    lr: float = 1e-5
    """Peak learning rate (paper: SFT 1e-5, RL 1e-6)."""
    min_lr: float = 1e-6
    """Floor the cosine decays to by the last step (paper: SFT 1e-6, RL 1e-7)."""
    warmup_steps: int = 0
    """Linear warm-up steps before the cosine decay."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay, applied to matrices only (not norms or biases)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value; null disables clipping."""
    lr_multipliers: dict[str, float] = field(default_factory=dict)
    """Per-parameter learning-rate factors: ``{regex: factor}``; a parameter whose name (``named_parameters``)
    matches a regex (``re.search``, first match in order) trains at ``factor x`` the scheduled lr, e.g.
    ``{"^model\\.norm\\.weight$": 30}`` for the final norm, whose scale is the logits' inverse temperature. A YAML
    value or an override replaces the whole mapping (no merge): ``lr_multipliers={}`` clears it."""


@dataclass
class TrainConfig:
    """Everything the trainer needs; recipes embed it and fill it from YAML plus key=value overrides."""

    total_steps: int = 1
    """Optimizer steps of the run (the cosine schedule spans them)."""
    global_batch_size: int = 128
    """Sequences per optimizer step over all ranks (a generic default; the paper's Claw setting: SFT 16, RL 64)."""
    micro_batch_size: int = 1
    """Sequences per forward/backward on one rank; does not change the gradient."""
    seed: int = 0
    """Seed of python, numpy and torch generators and of the data order."""
    engine: Literal["plain", "deepspeed"] = "plain"
    """plain: one process, plain torch. deepspeed: ZeRO over all ranks of the launcher."""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage (2 or 3) when engine=deepspeed."""
    deepspeed_config: str | None = None
    """Path of a DeepSpeed JSON to use instead of the shipped zero{2,3}.json (batch, clip, bf16 are overwritten)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype: float32 on CPU, bfloat16 on GPU (DeepSpeed bf16 mode)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (peft) instead of full fine-tuning; merged weights go to the engine and into saved models."""
    objective: list[LossTerm] = field(default_factory=lambda: [LossTerm("sft")])
    """Weighted loss terms: list of {name, weight, kwargs}; see orchard.train.objective."""
    output_dir: str = "runs/train"
    """Where metrics.jsonl, checkpoints and logger files go."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0: only when save_checkpoint is called)."""
    keep_checkpoints: int = 2
    """How many step checkpoints to keep on disk."""
    resume: bool = True
    """Continue from output_dir's latest checkpoint when one exists."""
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])
    """Metric sinks: jsonl (always on), tensorboard, wandb, progress."""
    progress_interval_s: float = 30.0
    """Seconds between progress lines (step, loss, tokens/s, ETA) when the output is not a terminal."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """W&B project, mode (online / offline / disabled) and run name, used when loggers has wandb."""

    def __post_init__(self) -> None:
        for name in ("total_steps", "global_batch_size", "micro_batch_size", "keep_checkpoints"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be an int >= 0, got {self.checkpoint_every!r}")
        if self.zero_stage not in (2, 3):
            raise ValueError(f"zero_stage must be 2 or 3, got {self.zero_stage!r}")
        check_objective(self.objective)
        check_logger_names(self.loggers, "loggers")
        if self.lora.enabled and self.engine == "deepspeed" and self.zero_stage == 3:
            raise ValueError("lora.enabled needs the plain engine or ZeRO-2: merging an adapter into a ZeRO-3 "
                             "partitioned base weight is not supported (set zero_stage=2)")
        if isinstance(self.progress_interval_s, bool) or not isinstance(self.progress_interval_s, (int, float)) \
                or not self.progress_interval_s > 0:
            raise ValueError(f"progress_interval_s must be a number > 0, got {self.progress_interval_s!r}")


class DataCursor:
    """A deterministic pass over ``num_samples`` indices, reshuffled each epoch from ``seed + epoch``.

    The state is ``{"epoch", "position"}``; restoring it continues the exact same order.
    """

    def __init__(self, num_samples: int, *, seed: int, shuffle: bool = True) -> None:
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=gen).tolist()

    def next_indices(self, n: int) -> list[int]:
        """The next ``n`` indices, crossing into the next epoch when this one runs out."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        out: list[int] = []
        while len(out) < n:
            order = self._order(self.epoch)
            take = order[self.position : self.position + n - len(out)]
            out.extend(take)
            self.position += len(take)
            if self.position >= self.num_samples:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "num_samples": self.num_samples}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if state.get("num_samples") != self.num_samples:
            raise ValueError(f"state is for {state.get('num_samples')} samples, this cursor has {self.num_samples}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def param_groups(model: nn.Module, optim: OptimConfig) -> list[dict[str, Any]]:
    """AdamW parameter groups: weight decay on matrices only, and ``optim.lr_multipliers`` applied by name.

    Raises:
        ValueError: naming ``lr_multipliers`` for an invalid regex, a non-positive or non-finite factor, or a
            regex that matches no trainable parameter (a typo would otherwise be silently ignored).
    """
    patterns = []
    for pattern, factor in optim.lr_multipliers.items():
        try:
            regex = re.compile(pattern)
        except re.error as err:
            raise ValueError(f"lr_multipliers: invalid regex {pattern!r}: {err}") from None
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) \
                or factor <= 0:
            raise ValueError(f"lr_multipliers[{pattern!r}] must be a positive finite number, got {factor!r}")
        patterns.append((regex, float(factor)))
    groups: dict[tuple[bool, float], list[nn.Parameter]] = {}
    used = set()
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        factor = 1.0
        for regex, f in patterns:
            if regex.search(name):
                factor = f
                used.add(regex.pattern)
                break
        groups.setdefault((param.dim() >= 2, factor), []).append(param)
    unused = [p.pattern for p, _ in patterns if p.pattern not in used]
    if unused:
        raise ValueError(f"lr_multipliers: {unused} match no trainable parameter name")
    return [{"params": params, "weight_decay": optim.weight_decay if decay else 0.0, "lr": optim.lr * factor}
            for (decay, factor), params in groups.items()]


class LogprobModel(nn.Module):
    """The module an engine trains: wraps a causal LM ``lm`` so that one forward returns action log-probs.

    ``forward(input_ids, scored_mask, attention_mask, **images, temperature=1.0)`` runs ``action_logprobs`` (fused
    lm-head log-probs of ``softmax(logits / temperature)`` at the scored positions, 0 elsewhere; ``[B, T]``);
    ``images`` are a vision-language batch's ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids``.
    Running it inside the engine's forward is what lets ZeRO-3 gather the lm-head weight, which the fused path reads
    outside ``lm_head.forward`` (see ``action_logprobs``).
    Parameter names are the LM's with an ``lm.`` prefix; ``Trainer.full_state_dict`` strips it.
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(
        self,
        input_ids: Tensor,
        scored_mask: Tensor,
        attention_mask: Tensor | None = None,
        pixel_values: Tensor | None = None,
        image_grid_thw: Tensor | None = None,
        mm_token_type_ids: Tensor | None = None,
        temperature: float = 1.0,
    ) -> Tensor:
        from orchard.train.action_logprobs import action_logprobs

        out = action_logprobs(self.lm, input_ids, scored_mask, attention_mask=attention_mask,
                              pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                              mm_token_type_ids=mm_token_type_ids, temperature=temperature)
        assert isinstance(out, Tensor)
        return out


def forward_logprobs(model: nn.Module, batch: Mapping[str, Tensor], temperature: float = 1.0) -> Tensor:
    """The default log-prob function: ``model`` is the engine's ``LogprobModel`` (or the engine around it);
    scores every token that ``batch["scored_mask"]`` marks (the union of the objective's masks), with the batch's
    images (``VISION_KEYS``) when it has any, under ``softmax(logits / temperature)``.

    ``temperature`` (> 0) is the one the scored tokens were sampled at, so that the trained policy's log-probs
    are on the scale of the sampler's (the engines return the tempered distribution's log-probs): an RL stage
    whose rollouts run at T != 1 passes ``functools.partial(forward_logprobs, temperature=T)`` as the
    trainer's ``logprob_fn``, as verl and TRL divide the logits by the rollout temperature."""
    from orchard.train.action_logprobs import VISION_KEYS

    check_logprob_temperature(temperature)
    images = {k: batch[k] for k in VISION_KEYS if k in batch}
    return model(input_ids=batch["input_ids"], scored_mask=batch["scored_mask"],
                 attention_mask=batch["attention_mask"], **images, temperature=float(temperature))


def check_logprob_temperature(temperature: object, name: str = "temperature") -> None:
    """ValueError naming ``name`` unless ``temperature`` is a finite number > 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or not temperature > 0:
        raise ValueError(f"{name} must be a finite number > 0, got {temperature!r}")


IMAGE_KEYS = ("pixel_values", "image_grid_thw")
"""Batch tensors indexed by patch or by image, not by row: all rows' images concatenated in row order."""


def _image_offsets(batch: Mapping[str, Tensor]) -> tuple[list[int], list[int]]:
    """Where each row's images start: ``patch_at[b]`` in ``pixel_values`` and ``image_at[b]`` in
    ``image_grid_thw``, for ``b`` in ``0..B`` (``B`` past the end).

    Rows own their images in order. Row b holds ``n_b`` image tokens (``mm_token_type_ids == 1``) and image i has
    ``t·h·w / m²`` tokens for the merge size ``m``, so row b's patches are ``n_b · m²``, with
    ``m² = Σ patches / Σ image tokens``; each row's patch span must end on an image's last patch.
    """
    grid = batch["image_grid_thw"]
    patches_I = grid.prod(dim=-1).tolist()  # [I], t·h·w of each image
    B = batch["input_ids"].shape[0]
    if "mm_token_type_ids" not in batch:
        if B == 1:
            return [0, sum(patches_I)], [0, len(patches_I)]
        raise ValueError("mm_token_type_ids is missing: a batch of images needs it to tell which row owns which")
    tokens_B = (batch["mm_token_type_ids"] == 1).sum(dim=-1).tolist()  # [B]
    total_patches, total_tokens = sum(patches_I), sum(tokens_B)
    if total_tokens == 0 or total_patches % total_tokens:
        raise ValueError(
            f"image_grid_thw's {total_patches} patches do not fit the {total_tokens} image tokens of "
            "mm_token_type_ids (a whole number of patches per token)"
        )
    per_token = total_patches // total_tokens  # m², 4 for Qwen-VL's 2 x 2 merge
    image_ends = np.cumsum([0, *patches_I]).tolist()  # [I + 1]
    patch_at = np.cumsum([0, *tokens_B]).tolist()
    patch_at = [n * per_token for n in patch_at]  # [B + 1]
    ends = set(image_ends)
    if any(p not in ends for p in patch_at):
        raise ValueError("image_grid_thw does not split into the rows' images: a row's image tokens end inside "
                         "an image's patches")
    image_at = [image_ends.index(p) for p in patch_at]
    return patch_at, image_at


def split_batch(batch: Mapping[str, Tensor], rows: slice, *, trim: bool = True) -> dict[str, Tensor]:
    """The ``rows`` of every tensor whose first dim is the batch, right padding trimmed to the longest row.

    ``pixel_values`` and ``image_grid_thw`` (``IMAGE_KEYS``) hold all rows' images in row order; they are cut to
    the rows' own images (see ``_image_offsets``) and left out when those rows have none.
    """
    B, T = batch["input_ids"].shape
    out = {k: v[rows] if v.dim() >= 1 and v.shape[0] == B else v for k, v in batch.items() if k not in IMAGE_KEYS}
    if "pixel_values" in batch:
        lo, hi, step = rows.indices(B)
        if step != 1:
            raise ValueError(f"rows must be a contiguous slice for a batch with images, got {rows!r}")
        hi = max(lo, hi)
        patch_at, image_at = _image_offsets(batch)
        if image_at[hi] > image_at[lo]:
            out["pixel_values"] = batch["pixel_values"][patch_at[lo]:patch_at[hi]]
            out["image_grid_thw"] = batch["image_grid_thw"][image_at[lo]:image_at[hi]]
    if trim and "attention_mask" in out and out["attention_mask"].numel():
        length = int(out["attention_mask"].sum(dim=-1).max().clamp(min=1))
        out = {k: v[:, :length] if k not in IMAGE_KEYS and v.dim() >= 2 and v.shape[1] == T else v
               for k, v in out.items()}
    return out


def _pad_rows(batch: Mapping[str, Tensor], multiple: int, mask_keys: set[str]) -> dict[str, Tensor]:
    """Append copies of row 0 with every mask zeroed, so the row count is a multiple of ``multiple``; the copies
    bring row 0's images along (appended after all others', as the rows are)."""
    B = batch["input_ids"].shape[0]
    extra = (-B) % multiple
    if extra == 0:
        return dict(batch)
    out = {}
    if "pixel_values" in batch:
        patch_at, image_at = _image_offsets(batch)
        out["pixel_values"] = torch.cat([batch["pixel_values"], *[batch["pixel_values"][:patch_at[1]]] * extra])
        out["image_grid_thw"] = torch.cat([batch["image_grid_thw"],
                                           *[batch["image_grid_thw"][:image_at[1]]] * extra])
    for key, value in batch.items():
        if key in IMAGE_KEYS:
            continue
        if value.dim() >= 1 and value.shape[0] == B:
            filler = value[:1].expand(extra, *value.shape[1:]).clone()
            if key in mask_keys:
                filler.zero_()
            out[key] = torch.cat([value, filler])
        else:
            out[key] = value
    return out


class Trainer:
    """Runs optimizer steps on a model with the configured engine, objective, checkpoints and loggers.

    Args:
        model: a causal LM (e.g. from ``load_causal_lm``), already in the configured dtype. With
            ``cfg.lora.enabled`` it gets peft's adapters in place (its forward is the policy in training) and is a
            plain model with the merged weights again after ``close``.
        cfg: the train config.
        logprob_fn: ``fn(module, micro_batch) -> [B, T]`` log-probs, where ``module`` is the engine's forward
            callable around a ``LogprobModel`` (its ``.lm`` is the causal LM) and ``micro_batch`` holds
            ``scored_mask``, the union of the objective's masks; default ``forward_logprobs`` (fused lm-head
            log-probs at the scored positions).
        on_weights: called after every optimizer step with ``(step, state_dict)`` — the complete weights on CPU
            (gathered under ZeRO-3), e.g. to load them into a rollout engine. Called on rank 0 only.
        log_config: written to W&B as the run config.

    Construction seeds python, numpy and torch with ``cfg.seed`` (then, with ``cfg.resume`` and a checkpoint
    in ``output_dir``, restores the saved generator states), so a run is reproducible from its config.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        *,
        logprob_fn: LogprobFn | None = None,
        on_weights: Callable[[int, dict[str, Tensor]], None] | None = None,
        log_config: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(cfg, TrainConfig):
            raise ValueError(f"cfg must be a TrainConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.logprob_fn = logprob_fn or forward_logprobs
        self.on_weights = on_weights
        self.out_dir = Path(cfg.output_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.step = 0
        self.cursor: DataCursor | None = None
        self.extra_state: dict[str, Any] = {}
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.lora: LoraAdapters | None = add_lora(model, cfg.lora) if cfg.lora.enabled else None
        o = cfg.optim
        optimizer = torch.optim.AdamW(param_groups(model, o), lr=o.lr, betas=o.betas, eps=o.eps)
        scheduler = cosine_schedule(
            optimizer, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps, total_steps=cfg.total_steps
        )
        model.train()
        wrapped = LogprobModel(model)
        self.engine: TrainEngine
        if cfg.engine == "plain":
            self.engine = PlainEngine(wrapped, optimizer, scheduler, grad_clip=o.grad_clip)
        else:
            from orchard.train.engine import init_distributed

            _, world = init_distributed()
            if cfg.deepspeed_config is not None:
                import json

                base = json.loads(Path(cfg.deepspeed_config).read_text())
            else:
                base = load_ds_config(cfg.zero_stage)
            config = ds_config(base, micro_batch_size=cfg.micro_batch_size, world_size=world,
                               grad_clip=o.grad_clip, bf16=cfg.dtype == "bfloat16")
            self.engine = DeepSpeedTrainEngine(wrapped, optimizer, scheduler, config)
        self.is_main = self.engine.rank == 0
        resumed = cfg.resume and ckpt.latest_checkpoint(self.ckpt_dir) is not None
        if resumed:
            self._load(ckpt.latest_checkpoint(self.ckpt_dir))  # type: ignore[arg-type]
        self.logger = (
            build_loggers(cfg.loggers, self.out_dir, total_steps=cfg.total_steps,
                          resume_step=self.step if resumed else None, config=log_config, wandb=cfg.wandb)
            if self.is_main
            else MultiLogger([])
        )

    @property
    def model(self) -> nn.Module:
        """The trained causal LM (under ZeRO-3 its parameters are partitioned; use ``full_state_dict``)."""
        return self.engine.module.lm  # type: ignore[return-value]

    def full_state_dict(self) -> dict[str, Tensor]:
        """Complete weights on CPU under the causal LM's parameter names (gathered under ZeRO-3; every rank
        must call it). Tied weights appear once, under their first name, as ``named_parameters`` lists them.
        With LoRA they are the merged weights ``W + s · B A`` under the base model's names
        (`orchard.train.lora.merged_weights`): what a plain model of the trained policy holds."""
        named = ((name.removeprefix("lm."), p) for name, p in self.engine.named_full_parameters())
        if self.lora is not None:
            return merged_weights(named, self.lora.scalings)
        return dict(named)

    def train_step(self, batch: Mapping[str, Tensor]) -> dict[str, float]:
        """One optimizer step on a global batch (identical on every rank); returns and logs its metrics."""
        metrics = self._step(batch)
        self.step += 1
        self.logger.log(metrics, self.step)
        if self.on_weights is not None:
            weights = self.full_state_dict()
            if self.is_main:
                self.on_weights(self.step, weights)
        if self.cfg.checkpoint_every and self.step % self.cfg.checkpoint_every == 0:
            self.save_checkpoint()
        return metrics

    def fit(
        self,
        samples: Sequence[Any],
        collate: Callable[[list[Any]], Mapping[str, Tensor]],
        *,
        shuffle: bool = True,
    ) -> list[dict[str, float]]:
        """Train until ``cfg.total_steps`` on batches of ``global_batch_size`` samples drawn by a ``DataCursor``.

        ``collate(list_of_samples)`` must return the batch dict (``orchard.data.collate``). The cursor is part
        of every checkpoint, so a resumed run continues with the next unseen batch. Progress (steps done / total,
        loss, tokens/s, ETA) is redrawn on a terminal (stderr) and written as a line every
        ``cfg.progress_interval_s`` seconds to stdout otherwise.
        """
        cursor = DataCursor(len(samples), seed=self.cfg.seed, shuffle=shuffle)
        if self.cursor is not None:
            cursor.load_state_dict(self.cursor.state_dict())
        self.cursor = cursor
        history = []
        progress = self._progress()
        try:
            while self.step < self.cfg.total_steps:
                indices = cursor.next_indices(self.cfg.global_batch_size)
                history.append(self.train_step(collate([samples[i] for i in indices])))
                progress.update(self.step, history[-1])
        finally:
            progress.close()
        return history

    def _progress(self) -> StepProgress:
        """Steps done / total, loss, tokens/s and ETA on rank 0 (`orchard.train.progress.StepProgress`): redrawn on a
        terminal, a line every ``progress_interval_s`` in a log; not while the rich ``progress`` logger draws."""
        show = self.is_main and "progress" not in self.cfg.loggers
        return StepProgress(Path(self.cfg.output_dir).name or "train", self.cfg.total_steps, start=self.step,
                            interval_s=self.cfg.progress_interval_s, enabled=show)

    def save_checkpoint(self) -> Path:
        """Save engine, RNG, cursor and ``extra_state`` for the current step; returns the directory."""
        directory = ckpt.step_dir(self.ckpt_dir, self.step)
        directory.mkdir(parents=True, exist_ok=True)
        self.engine.save(directory)
        torch.save(ckpt.get_rng_state(), directory / f"rng_rank{self.engine.rank}.pt")
        self._barrier()
        if self.is_main:
            state = {"step": self.step, "cursor": self.cursor.state_dict() if self.cursor else None,
                     "extra": self.extra_state}
            ckpt.write_trainer_state(directory, state)
            ckpt.mark_latest(self.ckpt_dir, self.step)
            ckpt.prune_checkpoints(self.ckpt_dir, self.cfg.keep_checkpoints)
        self._barrier()
        return directory

    def close(self) -> None:
        """Close the loggers; with LoRA, fold the adapters into the model (`orchard.train.lora.merge_lora`), so
        the model the caller passed in is a plain model of the trained policy again (its parameter names as
        before, ready for ``save_causal_lm`` or ``load_state_dict`` into an engine). Train no further after it."""
        self.logger.close()
        if self.lora is not None:
            merge_lora(self.lora)
            self.lora = None

    def _barrier(self) -> None:
        if self.engine.world_size > 1:
            torch.distributed.barrier()

    def _load(self, directory: Path) -> None:
        self.engine.load(directory)
        ckpt.set_rng_state(torch.load(directory / f"rng_rank{self.engine.rank}.pt", weights_only=False))
        state = ckpt.read_trainer_state(directory)
        self.step = int(state["step"])
        self.extra_state = dict(state.get("extra") or {})
        if state.get("cursor"):
            self.cursor = DataCursor(int(state["cursor"]["num_samples"]), seed=self.cfg.seed)
            self.cursor.load_state_dict(state["cursor"])

    def accumulate_gradients(self, batch: Mapping[str, Tensor]) -> dict[str, float]:
        """Forward and backward every micro-batch of this rank's shard of ``batch``; no optimizer step.

        Returns the batch's loss metrics combined over micro-batches and ranks: ``loss/*`` add up (each
        micro-batch's share is already divided by the global normaliser); keys ending in ``max`` / ``min`` take
        the max / min; ``*tokens`` counts add up; every other metric is a mean weighted by the tokens of the
        mask its term reads.
        """
        objective = self.cfg.objective
        batch = with_derived_masks(batch)
        check_objective(objective, set(batch))
        if "attention_mask" not in batch:
            raise ValueError(f"batch must hold 'attention_mask'; keys: {sorted(batch)}")
        mask_keys = {term_mask_key(t.name) for t in objective} | {"action_mask"}
        normalizers = {k: max(1.0, float(batch[k].sum())) for k in mask_keys}
        scored = torch.zeros_like(batch["action_mask"], dtype=torch.bool)
        for k in mask_keys:
            scored |= batch[k].bool()
        batch = {**batch, "scored_mask": scored}
        mask_keys = mask_keys | {"scored_mask"}
        world, rank = self.engine.world_size, self.engine.rank
        padded = _pad_rows(batch, world, mask_keys)
        per_rank = padded["input_ids"].shape[0] // world
        shard = split_batch(padded, slice(rank * per_rank, (rank + 1) * per_rank), trim=False)
        mb = self.cfg.micro_batch_size
        bounds = [(i, min(i + mb, per_rank)) for i in range(0, per_rank, mb)]
        sums: dict[str, Tensor] = {}
        weights: dict[str, Tensor] = {}
        seen: dict[str, Tensor] = {}  # max / min keys: whether a micro-batch with counted tokens reported yet
        device = next(self.engine.module.parameters()).device
        one = torch.ones((), dtype=torch.float64, device=device)
        for j, (lo, hi) in enumerate(bounds):
            micro = {k: v.to(device, non_blocking=True) for k, v in split_batch(shard, slice(lo, hi)).items()}
            self.engine.begin_micro_batch()
            logprobs = self.logprob_fn(self.engine.forward_model(), micro)
            loss, metrics, sources = objective_loss_with_sources(objective, logprobs, micro, normalizers)
            self.engine.backward(loss * world, is_last_micro_batch=j == len(bounds) - 1)
            metrics["loss/total"] = loss.detach()
            for key, value in metrics.items():
                value = value.detach().to(device, torch.float64).reshape(())
                if key.startswith("loss/"):
                    # Already divided by the global normaliser: micro-batch and rank values add up to the
                    # whole-batch loss (the 1/world weight per rank sums to 1 over ranks).
                    sums[key] = sums.get(key, 0) + value
                    weights[key] = one / world
                elif key.endswith(("max", "min")):
                    # A micro-batch without a counted token reports a placeholder; it must not win.
                    op = torch.maximum if key.endswith("max") else torch.minimum
                    has = micro[sources[key]].any() if key in sources else torch.ones((), dtype=torch.bool)
                    has = has.to(device)
                    if key in sums:
                        merged = torch.where(seen[key], op(sums[key], value), value)
                        sums[key] = torch.where(has, merged, sums[key])
                        seen[key] = seen[key] | has
                    else:
                        sums[key], seen[key] = value, has
                    weights[key] = one
                elif key.endswith("tokens"):
                    sums[key] = sums.get(key, 0) + value
                    weights[key] = one / world
                else:
                    n = micro[sources[key]].sum().to(torch.float64)
                    sums[key] = sums.get(key, 0) + value * n
                    weights[key] = weights.get(key, 0) + n
        return self._reduce(sums, weights)

    def _step(self, batch: Mapping[str, Tensor]) -> dict[str, float]:
        start = time.perf_counter()
        lr = self.engine.lr()
        out = self.accumulate_gradients(batch)
        out["grad_norm"] = self.engine.step()
        out["lr"] = lr
        out["tokens/action"] = float(batch["action_mask"].sum())
        out["tokens/total"] = float(batch["attention_mask"].sum())
        out["batch/sequences"] = float(batch["input_ids"].shape[0])
        elapsed = time.perf_counter() - start
        out["perf/step_time_s"] = elapsed
        out["perf/tokens_per_s"] = out["tokens/total"] / max(elapsed, 1e-9)
        return out

    def _reduce(self, sums: dict[str, Tensor], weights: dict[str, Tensor]) -> dict[str, float]:
        """Combine over ranks and divide; one host transfer for all metrics."""
        keys = sorted(sums)
        if not keys:
            return {}
        if self.engine.world_size > 1:
            add = [k for k in keys if not k.endswith(("max", "min"))]
            if add:
                vec = torch.stack([sums[k] for k in add] + [weights[k] for k in add])
                torch.distributed.all_reduce(vec)
                for i, k in enumerate(add):
                    sums[k], weights[k] = vec[i], vec[len(add) + i]
            for k in keys:
                if k.endswith(("max", "min")):
                    op = torch.distributed.ReduceOp.MAX if k.endswith("max") else torch.distributed.ReduceOp.MIN
                    t = sums[k].clone()
                    torch.distributed.all_reduce(t, op=op)
                    sums[k] = t
        num = torch.stack([sums[k] for k in keys]).tolist()
        den = torch.stack([torch.as_tensor(weights[k], dtype=torch.float64, device=sums[k].device)
                           for k in keys]).tolist()
        return {k: n / d if d > 0 else 0.0 for k, n, d in zip(keys, num, den, strict=True)}
