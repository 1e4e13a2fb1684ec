"""On-policy distillation, the teacher's side: a teacher's log-probs on the student's sampled tokens.

The paper's OPD (Orchard-SWE) trains the student on its own rollouts against a separate, stronger teacher served
behind the engine interface. For each rendered sample the teacher scores the student's sequence (`Scorer.score`:
one pass over prompt + completion, no sampling) and `teacher_logprobs` places the log-prob of every action token
at that token's position, which is where the student's own log-probs sit (`orchard.train.action_logprobs`): the
``teacher_logprobs`` batch key of the ``k2_opd`` / ``k3_opd`` / ``js_opd`` objective terms.

The teacher must use the student's tokenizer (the token ids are scored as they are), and it is scored untempered
(``log_softmax(logits)``): the paper's distillation target is the teacher's distribution itself. The student
scoring against itself is refused: every OPD term is then 0 for an on-policy batch, a silent no-op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from orchard.data import RenderedSample
from orchard.rollout.engine import Scorer, ScoreRequest

__all__ = ["OPD_TERMS", "check_teacher", "teacher_logprobs"]

OPD_TERMS: tuple[str, ...] = ("k2_opd", "k3_opd", "js_opd")
"""The objective terms (`orchard.train.objective.LOSS_TERMS`) that read ``teacher_logprobs``."""


def check_teacher(teacher: Any, engine: Any, objective: Sequence[Any]) -> None:
    """``ValueError`` naming ``teacher`` unless it fits ``objective`` (a list of ``LossTerm``): a `Scorer` other
    than the student's ``engine`` when the objective has an OPD term (`OPD_TERMS`), None when it has none."""
    opd = [term.name for term in objective if term.name in OPD_TERMS]
    if not opd:
        if teacher is not None:
            raise ValueError(f"teacher is only read by the OPD terms {list(OPD_TERMS)}; the objective has none "
                             f"(got a {type(teacher).__name__}): add a term or drop the teacher")
        return
    if teacher is None:
        raise ValueError(f"teacher must be a scoring engine (Scorer) for the objective's OPD terms {opd}, got None")
    if teacher is engine:
        raise ValueError("teacher must be a separate model, not the student's own engine: the student scoring "
                         "its own samples makes every OPD term 0")
    if not isinstance(teacher, Scorer):
        raise ValueError(f"teacher must have an async score(requests) (orchard.rollout.engine.Scorer), "
                         f"got {type(teacher).__name__}")


async def teacher_logprobs(teacher: Scorer, samples: Sequence[RenderedSample], *,
                           length: int | None = None) -> torch.Tensor:
    """The teacher's log-prob of each action token of each sample, aligned to ``action_mask``.

    For every ``(b, t)`` with ``samples[b].action_mask[t]``::

        out[b, t] = log softmax(teacher(input_ids[b, :t]))[input_ids[b, t]]

    and 0 elsewhere (non-action tokens, padding). One `ScoreRequest` per sample with an action token: prompt =
    the tokens before its first action token, completion = the tokens from there to its last action token (the
    observations between two turns are scored too, then masked out); a sample without action tokens asks nothing.

    Args:
        teacher: a `orchard.rollout.engine.Scorer` (`HFEngine`, `OpenAIEngine` over vLLM or ``orchard
            serve-model``) with the student's tokenizer.
        samples: ``B`` rendered samples (`orchard.data.RenderedSample`); no action at ``t = 0`` (nothing
            precedes it).
        length: ``T``, at least the longest sample; default the longest sample (at least 1), as
            `orchard.data.collate` pads.

    Returns:
        Shape: ``(B, T)`` float32, right-padded as `orchard.data.collate` pads the same samples.
    """
    if not isinstance(teacher, Scorer):
        raise ValueError(f"teacher must have an async score(requests) (orchard.rollout.engine.Scorer), "
                         f"got {type(teacher).__name__}")
    if isinstance(samples, RenderedSample) or not isinstance(samples, Sequence) or not samples:
        raise ValueError(f"samples must be a non-empty sequence of RenderedSample, got {type(samples).__name__}")
    for b, s in enumerate(samples):
        if not isinstance(s, RenderedSample):
            raise ValueError(f"samples[{b}] must be a RenderedSample, got {type(s).__name__}")
        if len(s) and bool(s.action_mask[0]):
            raise ValueError(f"samples[{b}].action_mask is true at t = 0, where no token precedes the action")
    longest = max(1, max(len(s) for s in samples))
    if length is None:
        length = longest
    if isinstance(length, bool) or not isinstance(length, int) or length < longest:
        raise ValueError(f"length must be an int >= the longest sample ({longest}), got {length!r}")
    spans: list[tuple[int, int, int]] = []  # (b, first action, last action + 1)
    requests = []
    for b, s in enumerate(samples):
        positions = s.action_mask.nonzero()[:, 0]
        if positions.numel() == 0:
            continue
        first, end = int(positions[0]), int(positions[-1]) + 1
        ids = s.input_ids.tolist()
        spans.append((b, first, end))
        requests.append(ScoreRequest(ids[:first], ids[first:end]))
    out_BT = torch.zeros((len(samples), length), dtype=torch.float32)
    scores = await teacher.score(requests) if requests else []
    if len(scores) != len(requests):
        raise RuntimeError(f"teacher answered {len(scores)} of {len(requests)} score requests")
    for (b, first, end), lps in zip(spans, scores, strict=True):
        if len(lps) != end - first:
            raise RuntimeError(f"teacher returned {len(lps)} log-probs for the {end - first} tokens of sample {b}")
        out_BT[b, first:end] = torch.tensor(lps, dtype=torch.float32)
        out_BT[b, first:end] *= samples[b].action_mask[first:end]
    return out_BT
