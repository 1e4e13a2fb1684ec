"""Fitting long trajectories into a value model's context without making them look finished.

A value target depends on where the episode ends: the verified outcome is the reward of the *last* decision
step. Cutting a rendered trajectory to its first ``max_len`` tokens would make the last visible step look terminal
and train it on the outcome. ``value_windows`` instead cuts from the left: every window keeps the trajectory's
head (the context before the first assistant step: system prompt and task, at most half of ``max_len``) and the
most recent ``max_len - head`` tokens up to the end of a decision step. Windows are laid from the last step
backwards, so the last step is always seen, and every step is read in exactly one window:

- the window ends at the end of the latest step not yet read;
- it reads that step and every earlier unread step whose tokens all lie inside it (a step longer than the
  window is read at its own window's end, seeing its tail).

Each window keeps the trajectory's step numbering in ``turn_index`` (``-1`` on steps read elsewhere, which stay as
context), so the windows' step values reassemble into the whole trajectory's ``[S]`` steps and GAE runs over all
of them with the outcome on the true last step. (This is our reading of "truncate for the value model": the paper
gives no rule for trajectories longer than the context.)
"""

from __future__ import annotations

import dataclasses

import torch

from orchard.data import RenderedSample

__all__ = ["value_windows"]


def _cut(sample: RenderedSample, head: int, start: int, end: int, read: torch.Tensor) -> RenderedSample:
    """``sample``'s tokens ``[0, head) + [start, end)``, with only the steps in ``read`` numbered."""
    keep = torch.cat([torch.arange(head), torch.arange(start, end)])  # [T']
    turn = sample.turn_index[keep]
    turn = torch.where(torch.isin(turn, read), turn, torch.full_like(turn, -1))
    on_step = turn >= 0
    report = dataclasses.replace(sample.report, truncated=True, full_length=len(sample))
    return dataclasses.replace(
        sample,
        input_ids=sample.input_ids[keep],
        action_mask=sample.action_mask[keep] & on_step,
        turn_index=turn,
        old_logprobs=torch.where(on_step, sample.old_logprobs[keep], torch.zeros(())),
        logprob_mask=sample.logprob_mask[keep] & on_step,
        report=report,
    )


def value_windows(sample: RenderedSample, *, max_len: int) -> list[RenderedSample]:
    """Windows of at most ``max_len`` tokens that together read every decision step once (module docstring).

    Args:
        sample: a whole rendered trajectory (rendered with ``max_len=None``). Shape of its tensors: ``[T]``.
        max_len: the longest window, ``>= 2`` tokens.

    Returns:
        ``[sample]`` itself when ``T <= max_len``; else the windows in step order, each ``[T' <= max_len]``
        with ``report.truncated`` True. A trajectory without a decision step gives one window, head and tail.

    Raises:
        ValueError: ``sample`` was already cut to its first tokens at rendering (``report.truncated``): its last
            visible step would look final.
    """
    if not isinstance(sample, RenderedSample):
        raise ValueError(f"sample must be a RenderedSample, got {type(sample).__name__}")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"max_len must be an int >= 2, got {max_len!r}")
    if sample.report.truncated:
        raise ValueError(
            f"sample was cut to its first {len(sample)} of {sample.report.full_length} tokens at rendering; "
            "render with max_len=None and window it here, so that its last visible step does not look final"
        )
    T = len(sample)
    if max_len >= T:
        return [sample]
    turn = sample.turn_index
    on_step = turn >= 0  # [T]
    first_action = int(on_step.nonzero()[0, 0]) if on_step.any() else T
    head = min(first_action, max_len // 2)
    budget = max_len - head
    if not on_step.any():
        return [_cut(sample, head, T - budget, T, turn.new_zeros(0))]
    steps = turn[on_step].unique()  # sorted step indices
    pos = torch.arange(T)
    starts = torch.stack([pos[turn == k].min() for k in steps])  # [S']
    ends = torch.stack([pos[turn == k].max() for k in steps])  # [S']
    unread = torch.ones(len(steps), dtype=torch.bool)
    windows = []
    while unread.any():
        last = int(unread.nonzero().max())
        end = int(ends[last]) + 1
        start = max(head, end - budget)
        reads = unread & (starts >= start) & (ends < end)
        reads[last] = True
        windows.append(_cut(sample, head, start, end, steps[reads]))
        unread &= ~reads
    return windows[::-1]
