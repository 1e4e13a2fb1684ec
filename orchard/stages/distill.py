"""On-policy distillation, the teacher's side: a teacher's log-probs on the student's sampled tokens.

The paper's OPD (Orchard-SWE) trains the student on its own rollouts against a separate, stronger teacher served
behind the engine interface. For each rendered sample the teacher scores the student's sequence (`Scorer.score`:
one pass over prompt + completion, no sampling) and `teacher_logprobs` places the log-prob of every action token
at that token's position, which is where the student's own log-probs sit (`orchard.train.action_logprobs`): the
``teacher_logprobs`` batch key of the ``k2_opd`` / ``k3_opd`` / ``js_opd`` objective terms.

The teacher must use the student's tokenizer (the token ids are scored as they are), and it is scored untempered
(``log_softmax(logits)``): the paper's distillation target is the teacher's distribution itself. The student
scoring against itself is refused: every OPD term is then 0 for an on-policy batch, a silent no-op.

`opd_teacher` makes the teacher a recipe's `OPDTeacherConfig` names: a server by URL, a local checkpoint, or at CPU scale a larger tiny
model than the student trained on the resolved trajectories of the domain's scripted teacher.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from orchard.data import RenderedSample, Trajectory
from orchard.rollout.engine import Scorer, ScoreRequest
from orchard.stages.config import SFTConfig
from orchard.stages.sft import sft_samples, sft_stage
from orchard.stages.teacher import TeacherConfig

__all__ = ["OPD_TERMS", "OPDTeacherConfig", "check_teacher", "opd_teacher", "teacher_logprobs"]

OPD_TERMS: tuple[str, ...] = ("k2_opd", "k3_opd", "js_opd")
"""The objective terms (`orchard.train.objective.LOSS_TERMS`) that read ``teacher_logprobs``."""


@dataclass
class OPDTeacherConfig:
    url: str | None = None
    """OpenAI-compatible server that scores prompts (``vllm serve``, ``orchard serve-model``) over a model sharing
    the student's tokenizer: the paper's Qwen3.5-397B-A17B; null: ``path``, or a teacher trained here."""
    model: str = "orchard"
    """Model name sent to the teacher server."""
    tokenizer: str | None = None
    """The served teacher's tokenizer ('tiny', a local HF directory or a named checkpoint); required with url. Before
    any work it is checked to be the student's (vocabulary and special tokens), as is ``path``'s."""
    path: str | None = None
    """Local HF checkpoint of the teacher (scored in process); null with url null: at CPU scale a larger tiny model
    than the student, trained longer on the teacher corpus (the scripted teacher's resolved trajectories)."""
    hidden_size: int = 128
    """Hidden size of the CPU teacher (the student's model.hidden_size must be smaller: never the student itself)."""
    num_layers: int = 4
    """Layers of the CPU teacher."""
    epochs: float = 6.0
    """SFT epochs of the CPU teacher on the resolved teacher trajectories."""

    def __post_init__(self) -> None:
        if self.url is not None and self.tokenizer is None:
            raise ValueError("tokenizer must name the served teacher's tokenizer when url is set: OPD scores the "
                             "student's token ids, so it is checked to be the student's before any work")
        if self.url is not None or self.tokenizer is not None:  # the shared checks of a teacher by URL
            TeacherConfig(url=self.url, model=self.model, tokenizer=self.tokenizer)

    @property
    def trained_here(self) -> bool:
        """Whether the teacher is the CPU one `opd_teacher` trains (neither url nor path)."""
        return self.url is None and self.path is None


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


def opd_teacher(cfg: OPDTeacherConfig, tokenizer: Any, trajectories: Sequence[Trajectory] = (), *,
                sft: SFTConfig | None = None, dtype: str = "float32", student_hidden_size: int | None = None,
                seed: int = 0, output_dir: str | Path | None = None, log: Callable[[str], None] = print) -> Scorer:
    """The OPD teacher ``cfg`` names as a scoring engine (`Scorer`, for ``rl_stage(..., teacher=)``); close it after
    the stage.

    The first that applies: ``cfg.url`` (an OpenAI-compatible server that scores, ``cfg.model`` its model name);
    ``cfg.path`` (a local HF checkpoint, loaded in ``dtype`` and scored in process); else, at CPU scale, a tiny
    Qwen3 of ``cfg.hidden_size`` x ``cfg.num_layers`` trained here by `sft_stage` (``sft`` with ``cfg.epochs``) on
    the resolved ones of ``trajectories`` (the domain's scripted teacher's), its weights and training seeded
    ``seed + 1``, its trainer's logs under ``output_dir``. Any of them must share ``tokenizer``, the student's (OPD
    scores the student's ids; a recipe checks a URL's or a checkpoint's tokenizer with `check_tokenizers` first).

    Args:
        student_hidden_size: the tiny student's width; a CPU teacher must be wider (never the student itself).
            None (a student from a checkpoint): only ``cfg.url`` or ``cfg.path`` will do.
        log: called with one line about the CPU teacher's training.
    """
    from orchard.rollout.hf_engine import HFEngine

    if cfg.url is not None:
        from orchard.rollout.openai_engine import OpenAIEngine

        return OpenAIEngine(cfg.url, model=cfg.model)
    if cfg.path is not None:
        from orchard.train.model import load_causal_lm

        teacher_model = load_causal_lm(cfg.path, dtype=dtype)
    else:
        from orchard.models import tiny_qwen3

        h = cfg.hidden_size
        if student_hidden_size is None:
            raise ValueError("give url or path: a CPU teacher is trained only beside a tiny student")
        if h <= student_hidden_size:
            raise ValueError(f"give url or path, or a CPU teacher larger than the tiny student (hidden_size {h} <= "
                             f"the student's {student_hidden_size})")
        if sft is None or output_dir is None:
            raise ValueError("sft and output_dir must be given for a CPU teacher (it is trained here)")
        samples, _ = sft_samples(trajectories, mode="resolved")
        if not samples:
            raise ValueError("the CPU teacher trains on the scripted teacher's resolved trajectories and there are "
                             "none; give url or path")
        teacher_model = tiny_qwen3(tokenizer, seed=seed + 1, hidden_size=h, intermediate_size=3 * h,
                                   num_hidden_layers=cfg.num_layers, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=h // 4)
        history = sft_stage(teacher_model, samples, replace(sft, epochs=cfg.epochs), pad_id=tokenizer.pad_token_id,
                            seed=seed + 1, output_dir=str(output_dir))
        log(f"opd teacher: hidden {h} x {cfg.num_layers} layers, {len(samples)} samples, {len(history)} steps, "
            f"loss {history[0]['loss/total']:.3f} -> {history[-1]['loss/total']:.3f}")
    return HFEngine(teacher_model.eval(), pad_token_id=tokenizer.pad_token_id, max_batch_size=64, seed=seed)
