"""Batching rendered samples: right-padding to ``[B, T]`` tensors, merging per-call samples of one session, and
cutting a sample to a context length.

Rendering (:mod:`orchard.data.render`) turns one trajectory into ``[T]`` tensors; this module turns many of those
into what a training step reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from orchard.data.render import RenderedSample


def collate(
    samples: Sequence[RenderedSample],
    pad_id: int,
    *,
    advantages: Sequence[float] | torch.Tensor | None = None,
    pad_to_multiple_of: int = 1,
) -> dict[str, torch.Tensor]:
    """Right-pad rendered samples into a batch.

    Args:
        samples: B rendered samples (lengths may differ).
        pad_id: token id written into padding positions of ``input_ids``.
        advantages: optional per-sample advantages, shape ``[B]``; broadcast over each row's action tokens.
        pad_to_multiple_of: round T up to a multiple of this (e.g. 8 for tensor cores); default 1.

    Returns:
        ``input_ids`` [B, T] long (``pad_id`` in padding), ``attention_mask`` [B, T] long (1 on real tokens),
        ``action_mask`` [B, T] bool, ``old_logprobs`` [B, T] float32 (0 where unknown or padding),
        ``logprob_mask`` [B, T] bool, ``turn_index`` [B, T] long (-1 on non-action and padding), and with
        ``advantages`` also ``advantages`` [B, T] float32 (``adv_b`` on row b's action tokens, 0 elsewhere).
        T is the longest sample rounded up to ``pad_to_multiple_of`` (at least 1, so an all-empty batch is
        ``[B, 1]`` of padding).
        When any sample carries images (rendered with a ``processor``), also ``pixel_values`` (every sample's
        rows concatenated in batch order, as Qwen-VL models take them), ``image_grid_thw`` ``[I, 3]`` and
        ``mm_token_type_ids`` ``[B, T]`` long (1 on image tokens, 0 elsewhere and in padding); text-only
        batches have none of the three.
    """
    if isinstance(samples, RenderedSample) or not isinstance(samples, Sequence) or len(samples) == 0:
        raise ValueError(
            f"samples must be a non-empty sequence of RenderedSample, got {type(samples).__name__}"
        )
    for b, s in enumerate(samples):
        if not isinstance(s, RenderedSample):
            raise ValueError(f"samples[{b}] must be a RenderedSample, got {type(s).__name__}")
    if isinstance(pad_id, bool) or not isinstance(pad_id, int) or pad_id < 0:
        raise ValueError(f"pad_id must be a non-negative int, got {pad_id!r}")
    if (
        isinstance(pad_to_multiple_of, bool)
        or not isinstance(pad_to_multiple_of, int)
        or pad_to_multiple_of < 1
    ):
        raise ValueError(f"pad_to_multiple_of must be a positive int, got {pad_to_multiple_of!r}")
    B = len(samples)
    adv_B = None
    if advantages is not None:
        adv_B = torch.as_tensor(advantages, dtype=torch.float32).flatten()
        if adv_B.shape[0] != B:
            raise ValueError(
                f"advantages must have shape [B]=[{B}], got {list(torch.as_tensor(advantages).shape)}"
            )
        if not torch.isfinite(adv_B).all():
            raise ValueError("advantages must be finite")
    T = max(1, max(len(s) for s in samples))
    T = -(-T // pad_to_multiple_of) * pad_to_multiple_of
    batch = {
        "input_ids": torch.full((B, T), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((B, T), dtype=torch.long),
        "action_mask": torch.zeros((B, T), dtype=torch.bool),
        "old_logprobs": torch.zeros((B, T), dtype=torch.float32),
        "logprob_mask": torch.zeros((B, T), dtype=torch.bool),
        "turn_index": torch.full((B, T), -1, dtype=torch.long),
    }
    for b, s in enumerate(samples):
        n = len(s)
        batch["input_ids"][b, :n] = s.input_ids
        batch["attention_mask"][b, :n] = 1
        batch["action_mask"][b, :n] = s.action_mask
        batch["old_logprobs"][b, :n] = s.old_logprobs
        batch["logprob_mask"][b, :n] = s.logprob_mask
        batch["turn_index"][b, :n] = s.turn_index
    if any(s.pixel_values is not None for s in samples):
        with_images = [s for s in samples if s.pixel_values is not None]
        batch["pixel_values"] = torch.cat([s.pixel_values for s in with_images])
        batch["image_grid_thw"] = torch.cat([s.image_grid_thw for s in with_images])
        batch["mm_token_type_ids"] = torch.zeros((B, T), dtype=torch.long)
        for b, s in enumerate(samples):
            if s.mm_token_type_ids is not None:
                batch["mm_token_type_ids"][b, : len(s)] = s.mm_token_type_ids
    if adv_B is not None:
        batch["advantages"] = adv_B[:, None] * batch["action_mask"].float()  # [B, T]
    return batch


def merge_prefix_samples(samples: Sequence[RenderedSample]) -> list[RenderedSample]:
    """Merge consecutive per-call samples of one session whose sequences extend each other.

    A harness that re-sends the whole conversation on every call produces, through a recording proxy, one sample
    per call: call ``k``'s prompt plus its sampled ids. When call ``k+1``'s ``input_ids`` begin with all of call
    ``k``'s (the earlier output came back token for token), the two are one sequence: the merged sample keeps the
    longer ids and carries both calls' action masks, turn indices and log-probs, so each action token is trained
    once and the shared context is computed once. Where the ids diverge (the harness rewrote history, or
    re-tokenizing the earlier output gave other ids), the samples stay separate, which is always exact.

    Args:
        samples: the calls of ONE session, in call order.

    Returns:
        Fewer or equally many samples, in order; the action tokens of the input are each present exactly once.
    """
    if isinstance(samples, RenderedSample) or not isinstance(samples, Sequence):
        raise ValueError(f"samples must be a sequence of RenderedSample, got {type(samples).__name__}")
    merged: list[RenderedSample] = []
    for i, sample in enumerate(samples):
        if not isinstance(sample, RenderedSample):
            raise ValueError(f"samples[{i}] must be a RenderedSample, got {type(sample).__name__}")
        if merged:
            last = merged[-1]
            n = last.input_ids.numel()
            if sample.input_ids.numel() >= n and torch.equal(sample.input_ids[:n], last.input_ids):
                action = sample.action_mask.clone()
                action[:n] |= last.action_mask
                turn = sample.turn_index.clone()
                turn[:n] = torch.where(last.action_mask, last.turn_index, turn[:n])
                logp = sample.old_logprobs.clone()
                logp[:n] = torch.where(last.action_mask, last.old_logprobs, logp[:n])
                known = sample.logprob_mask.clone()
                known[:n] = torch.where(last.action_mask, last.logprob_mask, known[:n])
                # The later call's prompt holds every image of the earlier one: its pixels are the merged ones.
                merged[-1] = replace(sample, action_mask=action, turn_index=turn, old_logprobs=logp,
                                     logprob_mask=known)
                continue
        merged.append(sample)
    return merged


def truncate_sample(sample: RenderedSample, max_len: int) -> RenderedSample:
    """Left truncation of an already rendered sample: its head, then its newest tokens, ``max_len`` in all.

    The head is the context before the first action token (system prompt, tools and task: what the model needs to
    act at all), at most ``max_len // 2`` tokens; the oldest tokens after it are cut. The paper's SFT (64K
    context, left truncation) does not say what stays in view; keeping the prompt is our reading of it, as
    ``render_trajectory(truncation="left")`` keeps the system prompt. This one works on samples a recording proxy
    built (the prompt's boundary is the first action), so it keeps the task too. The cut is one contiguous span:
    every kept position carries exactly its ``input_ids``, ``action_mask``, ``turn_index``, ``old_logprobs`` and
    ``logprob_mask``; an action run the cut crosses keeps its newest tokens.

    Args:
        sample: a rendered sample, tensors ``[T]``.
        max_len: the longest sequence kept, an int >= 1.

    Returns:
        ``sample`` itself when ``T <= max_len``; else a new sample of ``[max_len]`` tensors whose report says
        ``truncated``, ``full_length = T`` and ``cut = (start, stop)``, the positions removed.
    """
    if not isinstance(sample, RenderedSample):
        raise ValueError(f"sample must be a RenderedSample, got {type(sample).__name__}")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be an int >= 1, got {max_len!r}")
    T = len(sample)
    if max_len >= T:
        return sample
    actions = sample.action_mask.nonzero()
    first_action = int(actions[0, 0]) if len(actions) else T
    head = min(first_action, max_len // 2)
    start, stop = head, T - (max_len - head)

    def kept(values: torch.Tensor) -> torch.Tensor:
        return torch.cat([values[:start], values[stop:]])  # [max_len]

    report = replace(sample.report, truncated=True, full_length=T, cut=(start, stop))
    return replace(sample, input_ids=kept(sample.input_ids), action_mask=kept(sample.action_mask),
                   turn_index=kept(sample.turn_index), old_logprobs=kept(sample.old_logprobs),
                   logprob_mask=kept(sample.logprob_mask), report=report)
