"""Rendering trajectories to training tensors: token ids, action mask, turn index, sampling log-probs.

The sequence is built turn by turn through the tokenizer's chat template. For assistant turn ``k`` (at message
index ``i``) let ``P_k = template(messages[:i], add_generation_prompt=True)`` (the prompt the engine saw) and
``F_k = template(messages[:i+1])``. Then

* the context ``P_k - F_{k-1}`` (system/user/tool turns, the generation prompt ``<|im_start|>assistant\\n``) is
  tokenized and is never an action;
* the assistant part ``F_k - P_k`` splits at the end-of-turn token into the action text (content, tool-call text,
  ``<|im_end|>``) and the template's tail (the newline after ``<|im_end|>``, not an action);
* the action tokens are the exact ids the engine sampled (``Message.token_ids``), checked against the template's
  tokenization of the action text. A disagreement is a *mismatch* and is handled per ``on_mismatch``.

``X - Y`` means "the text of X after its prefix Y"; this needs a prefix-consistent template (the rendering of
``messages[:k]`` is a prefix of that of ``messages[:k+1]``). A break is detected and reported; :func:`render_turns`
renders such trajectories as one sample per assistant turn instead.

Rendering every prefix is quadratic in the number of turns. The default path takes each turn's deltas from a
window (the leading system messages, then the conversation from the previous assistant turn on), which is linear,
and checks the joined pieces against one full rendering; a template whose output is not local (or not
prefix-consistent) fails that check and is rendered the exact, quadratic way.

A sampled turn that did not end with the end-of-turn token (cut by ``max_tokens``) is compared without it and the
template's end-of-turn token is kept as context, not as an action.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch

from orchard.data.schema import Message, Trajectory

if TYPE_CHECKING:
    from orchard.data.vision import VisionRenderer

MismatchPolicy = Literal["use_sampled", "retokenize", "drop", "raise"]
MISMATCH_POLICIES: tuple[str, ...] = ("use_sampled", "retokenize", "drop", "raise")

Truncation = Literal["right", "left"]
TRUNCATIONS: tuple[str, ...] = ("right", "left")


@dataclass
class TurnMismatch:
    """Where one assistant turn's sampled ids disagree with the template's tokenization of its text.

    Fields:
        turn: the assistant step (0-based among assistant messages).
        message_index: index of the message in ``Trajectory.messages``.
        start: position in the rendered sequence of the turn's first action token.
        offsets: offsets within the turn where the two id lists differ: every ``j < min(len)`` with
            ``sampled[j] != rendered[j]``, then every ``j`` in ``[min(len), max(len))``.
        sampled_len: number of sampled ids compared (without an end-of-turn token the sampler never emitted).
        rendered_len: number of ids the template's tokenization gives for the same span.
        kind: ``tokenization`` when the sampled ids decode to the same text (the engine picked a non-canonical
            split), ``text`` when the message text differs from what was sampled (e.g. a parser rewrote it).
    """

    turn: int
    message_index: int
    start: int
    offsets: list[int]
    sampled_len: int
    rendered_len: int
    kind: Literal["tokenization", "text"]

    @property
    def count(self) -> int:
        """Number of differing positions."""
        return len(self.offsets)

    @property
    def positions(self) -> list[int]:
        """Absolute positions (in a ``use_sampled`` rendering) of the differing sampled tokens."""
        return [self.start + j for j in self.offsets if j < self.sampled_len]


@dataclass
class RenderReport:
    """What rendering found.

    Fields:
        mismatches: one entry per assistant turn whose sampled ids disagree with the template.
        prefix_breaks: message indices at which the template's rendering of the shorter conversation was not a
            prefix of the longer one (the sequence there is an approximation; use :func:`render_turns`).
        truncated: True when ``max_len`` cut the sequence.
        full_length: the length before truncation.
        cut: ``(start, stop)``, the positions of the untruncated rendering that truncation removed (``right``:
            ``(max_len, full_length)``; ``left``: from the end of the system prompt on); None when nothing was
            cut. Positions in ``mismatches`` index the untruncated rendering; one at ``p >= stop`` is at
            ``p - (stop - start)`` in the sample.
    """

    mismatches: list[TurnMismatch] = field(default_factory=list)
    prefix_breaks: list[int] = field(default_factory=list)
    truncated: bool = False
    full_length: int = 0
    cut: tuple[int, int] | None = None

    @property
    def num_mismatched_tokens(self) -> int:
        return sum(m.count for m in self.mismatches)

    @property
    def ok(self) -> bool:
        """No mismatch and no prefix break (truncation is not an error)."""
        return not self.mismatches and not self.prefix_breaks


@dataclass
class RenderedSample:
    """One trajectory as training tensors, all of shape ``[T]``.

    Fields:
        input_ids: token ids (long).
        action_mask: True on tokens the policy generated (assistant content, tool-call text, end-of-turn token);
            False on system, user and tool tokens, the generation prompt and the template's tail.
        turn_index: the assistant step an action token belongs to, -1 on non-action tokens (long).
        old_logprobs: the sampling log-prob of each action token, 0.0 where unknown (float32).
        logprob_mask: True where ``old_logprobs`` holds a sampled log-prob (always within ``action_mask``).
        report: mismatches, prefix breaks, truncation.
        reward, task_id, group_id: copied from the trajectory.
        policy_version: the version of the policy that sampled it (the RL stage's count of weight updates pushed
            to the rollout engine before generation; None where nobody recorded one), so a trainer knows how
            many updates stale it is.
        pixel_values: rendered with a ``processor``: the images' patches, ``[sum of grid_t * grid_h * grid_w,
            D]`` in sequence order; None without images.
        image_grid_thw: ``[I, 3]`` long, each image's ``(grid_t, grid_h, grid_w)``; None without images.
        mm_token_type_ids: rendered with a ``processor``: ``[T]`` long, 1 on image tokens, 0 elsewhere (what
            Qwen3-VL's M-RoPE needs); None otherwise.
    """

    input_ids: torch.Tensor
    action_mask: torch.Tensor
    turn_index: torch.Tensor
    old_logprobs: torch.Tensor
    logprob_mask: torch.Tensor
    report: RenderReport
    reward: float | None = None
    task_id: str | None = None
    group_id: str | None = None
    policy_version: int | None = None
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    mm_token_type_ids: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


class _Builder:
    """Accumulates token segments of a sequence."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.action: list[bool] = []
        self.turn: list[int] = []
        self.logprobs: list[float] = []
        self.lp_known: list[bool] = []

    def context(self, ids: Sequence[int]) -> None:
        n = len(ids)
        self.ids.extend(ids)
        self.action.extend([False] * n)
        self.turn.extend([-1] * n)
        self.logprobs.extend([0.0] * n)
        self.lp_known.extend([False] * n)

    def actions(self, ids: Sequence[int], turn: int, logprobs: Sequence[float] | None, known: int) -> None:
        """Append action ids; the first ``known`` of them carry ``logprobs``."""
        n = len(ids)
        self.ids.extend(ids)
        self.action.extend([True] * n)
        self.turn.extend([turn] * n)
        lps = list(logprobs[:known]) if logprobs is not None else []
        known = len(lps)
        self.logprobs.extend(lps + [0.0] * (n - known))
        self.lp_known.extend([True] * known + [False] * (n - known))

    def build(
        self,
        max_len: int | None,
        report: RenderReport,
        traj: Trajectory,
        *,
        truncation: str = "right",
        head: Callable[[list[int]], int] | None = None,
        spans: Sequence[tuple[int, int]] = (),
    ) -> RenderedSample:
        """The tensors, cut to ``max_len``: the tail (``right``), or the tokens after the first ``head(ids)``
        (``left``: the oldest after the system prompt). Both cuts remove one contiguous span, so every kept
        position carries exactly the values it has in the untruncated rendering. A cut never splits one of
        ``spans`` (an image's vision tokens, which the model reads whole): it widens to the span's edge, so the
        sample may be shorter than ``max_len``."""
        n = len(self.ids)
        report.full_length = n
        start = stop = n
        if max_len is not None and n > max_len:
            if truncation == "left":
                kept_head = head(self.ids) if head is not None else 0
                if kept_head > max_len:
                    raise ValueError(
                        f"max_len={max_len} is shorter than the system prompt ({kept_head} tokens), which "
                        "truncation='left' always keeps; raise max_len or shorten the system prompt"
                    )
                start, stop = kept_head, n - (max_len - kept_head)
            else:
                start = max_len
            for a, b in spans:
                if a < start < b:
                    start = a
                if a < stop < b:
                    stop = b
            report.truncated = True
            report.cut = (start, stop)

        def kept(values: list[Any]) -> list[Any]:
            return values[:start] + values[stop:]

        return RenderedSample(
            input_ids=torch.tensor(kept(self.ids), dtype=torch.long),
            action_mask=torch.tensor(kept(self.action), dtype=torch.bool),
            turn_index=torch.tensor(kept(self.turn), dtype=torch.long),
            old_logprobs=torch.tensor(kept(self.logprobs), dtype=torch.float32),
            logprob_mask=torch.tensor(kept(self.lp_known), dtype=torch.bool),
            report=report,
            reward=traj.reward,
            task_id=traj.task_id,
            group_id=traj.group_id,
        )


def _check_args(traj: Any, tokenizer: Any, max_len: Any, on_mismatch: Any, truncation: Any) -> None:
    if not isinstance(traj, Trajectory):
        raise ValueError(f"traj must be a Trajectory, got {type(traj).__name__}")
    if not hasattr(tokenizer, "apply_chat_template") or getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"tokenizer must be a transformers tokenizer with a chat_template, got {type(tokenizer).__name__}"
        )
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
        raise ValueError(f"max_len must be a positive int or None, got {max_len!r}")
    if on_mismatch not in MISMATCH_POLICIES:
        raise ValueError(f"on_mismatch must be one of {list(MISMATCH_POLICIES)}, got {on_mismatch!r}")
    if truncation not in TRUNCATIONS:
        raise ValueError(f"truncation must be one of {list(TRUNCATIONS)}, got {truncation!r}")


def _vision(traj: Trajectory, tokenizer: Any, processor: Any) -> VisionRenderer | None:
    """The trajectory's images with ``processor``; None for the text path (no processor)."""
    if processor is None:
        if any(m.image_urls for m in traj.messages):
            raise ValueError(
                "traj has images (image_url content parts) but no processor was given; pass processor= (a Qwen-VL "
                "processor or image processor) or replace the images with text"
            )
        return None
    from orchard.data.vision import VisionRenderer

    return VisionRenderer(traj.messages, tokenizer, processor)


def _check_images_used(used: int, expected: int) -> None:
    if used != expected:
        raise ValueError(
            f"the chat template wrote {used} image tokens for {expected} images; the tokenizer's template must "
            "write one <|image_pad|> per image part (a Qwen-VL family template)"
        )


def _template(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], gen: bool) -> str:
    if not messages:  # chat templates refuse an empty conversation
        if gen:
            raise ValueError("traj.messages must not start with an assistant message: it has no prompt to render")
        return ""
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=gen
    )
    if not isinstance(text, str):
        raise ValueError(
            f"tokenizer.apply_chat_template(tokenize=False) must return a str, got {type(text).__name__}"
        )
    return text


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _suffix(prev: str, new: str, message_index: int, report: RenderReport) -> str:
    """``new - prev``; on a prefix break, record it and continue after the longest common prefix."""
    if new.startswith(prev):
        return new[len(prev) :]
    report.prefix_breaks.append(message_index)
    common = 0
    for a, b in zip(prev, new, strict=False):
        if a != b:
            break
        common += 1
    return new[common:]


def _system_head(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    vision: VisionRenderer | None = None,
) -> Callable[[list[int]], int]:
    """For left truncation: a function of the rendered ids giving how many leading tokens are the system prompt.

    The system prompt is the template's rendering of the first message when that is a system message (with
    ``tools``, so a template that lists the tools in the system turn keeps them too); without one nothing is kept.
    Its tokens must begin the rendered ids: a template whose system turn does not end on a token boundary (its
    last token merges with what follows) cannot keep it exactly, and that is a ``ValueError``.
    """

    def head(ids: list[int]) -> int:
        if not messages or messages[0]["role"] != "system":
            return 0
        text = _template(tokenizer, messages[:1], tools, gen=False)
        # A fresh encoder per call: an image in the system prompt is the trajectory's first image.
        system = vision.encoder()[0](text) if vision is not None else _encode(tokenizer, text)
        if ids[: len(system)] != system:
            raise ValueError(
                "truncation='left' keeps the system prompt, but the tokens of the template's rendering of the "
                "first system message do not begin the rendered sequence (its last token merges with the next "
                "turn); use truncation='right'"
            )
        return len(system)

    return head


def _eot_token(tokenizer: Any, eot_token: str | None) -> tuple[str, int]:
    text = eot_token if eot_token is not None else getattr(tokenizer, "eos_token", None)
    if not isinstance(text, str) or not text:
        raise ValueError(f"eot_token must be given when the tokenizer has no eos_token, got {eot_token!r}")
    ids = _encode(tokenizer, text)
    if len(ids) != 1:
        raise ValueError(f"eot_token {text!r} must be a single token, it encodes to {ids}")
    return text, ids[0]


def _diff_offsets(sampled: Sequence[int], rendered: Sequence[int]) -> list[int]:
    n = min(len(sampled), len(rendered))
    offsets = [j for j in range(n) if sampled[j] != rendered[j]]
    offsets.extend(range(n, max(len(sampled), len(rendered))))
    return offsets


def _split_action_text(delta: str, eot_text: str) -> tuple[str, str]:
    """Split an assistant delta into (action text ending with the end-of-turn token, template tail)."""
    j = delta.rfind(eot_text)
    if j < 0:
        return delta, ""
    return delta[: j + len(eot_text)], delta[j + len(eot_text) :]


def _splice_turn(
    out: _Builder,
    tokenizer: Any,
    message: Message,
    turn: int,
    message_index: int,
    action_text: str,
    eot_id: int,
    on_mismatch: str,
    report: RenderReport,
    *,
    close: bool,
) -> None:
    """Append one assistant turn's action tokens, checking its sampled ids against the template's.

    With ``close``, a turn cut before its end-of-turn token gets the template's one appended as context.
    """
    rendered = _encode(tokenizer, action_text)
    sampled = message.token_ids
    if sampled is None:
        out.actions(rendered, turn, None, 0)
        return
    # A turn cut by max_tokens has no end-of-turn token: compare without the template's one.
    cut = not (sampled and sampled[-1] == eot_id) and bool(rendered) and rendered[-1] == eot_id
    compare = rendered[:-1] if cut else rendered
    offsets = _diff_offsets(sampled, compare)
    if offsets:
        same_text = tokenizer.decode(sampled) == tokenizer.decode(compare)
        report.mismatches.append(
            TurnMismatch(
                turn=turn,
                message_index=message_index,
                start=len(out.ids),
                offsets=offsets,
                sampled_len=len(sampled),
                rendered_len=len(compare),
                kind="tokenization" if same_text else "text",
            )
        )
    if on_mismatch == "retokenize" and offsets:
        out.actions(compare, turn, message.logprobs, offsets[0])
    else:
        out.actions(sampled, turn, message.logprobs, len(sampled))
    if cut and close:
        out.context(rendered[-1:])


_Segment = tuple[Literal["context", "action"], int, str]
"""A piece of the rendered text: its kind, the index of the message it belongs to, the text."""


def _segments_exact(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    eot_text: str,
    report: RenderReport,
) -> list[_Segment]:
    """Cut ``template(messages)`` into context and action text by rendering every prefix (quadratic, exact)."""
    segments: list[_Segment] = []
    prev = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _template(tokenizer, messages[:i], tools, gen=True)
        segments.append(("context", i, _suffix(prev, prompt, i, report)))
        full = _template(tokenizer, messages[: i + 1], tools, gen=False)
        action, tail = _split_action_text(_suffix(prompt, full, i, report), eot_text)
        segments += [("action", i, action), ("context", i, tail)]
        prev = full
    if messages:
        final = _template(tokenizer, messages, tools, gen=False)
        segments.append(("context", len(messages), _suffix(prev, final, len(messages), report)))
    return segments


def _segments_windowed(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], eot_text: str
) -> list[_Segment] | None:
    """The segments of :func:`_segments_exact` in linear time, or None when this shortcut does not apply.

    Each turn's deltas are taken from a window: the leading system messages, then the conversation from the
    previous assistant turn on. For templates whose rendering of a turn depends only on nearby messages (ours,
    and most) the deltas are the same; the joined segments are checked against one full rendering, and any
    difference (or a prefix break inside a window) sends the caller to the exact path.
    """
    n_head = 0
    while n_head < len(messages) and messages[n_head]["role"] == "system":
        n_head += 1
    head = messages[:n_head]
    segments: list[_Segment] = []
    base, prev = "", None
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        context = head + messages[prev:i] if prev is not None else messages[:i]
        prompt = _template(tokenizer, context, tools, gen=True)
        full = _template(tokenizer, [*context, message], tools, gen=False)
        if not (prompt.startswith(base) and full.startswith(prompt)):
            return None
        action, tail = _split_action_text(full[len(prompt) :], eot_text)
        segments += [("context", i, prompt[len(base) :]), ("action", i, action), ("context", i, tail)]
        base, prev = _template(tokenizer, [*head, message], tools, gen=False), i
    if messages:
        rest = _template(
            tokenizer, head + messages[prev:] if prev is not None else messages, tools, gen=False
        )
        if not rest.startswith(base):
            return None
        segments.append(("context", len(messages), rest[len(base) :]))
    if "".join(text for _, _, text in segments) != _template(tokenizer, messages, tools, gen=False):
        return None
    return segments


def render_trajectory(
    traj: Trajectory,
    tokenizer: Any,
    *,
    max_len: int | None = None,
    truncation: Truncation = "right",
    on_mismatch: MismatchPolicy = "use_sampled",
    eot_token: str | None = None,
    processor: Any = None,
) -> RenderedSample | None:
    """Render one trajectory to a :class:`RenderedSample` (tensors of shape ``[T]``).

    Args:
        traj: the trajectory; assistant turns with ``token_ids`` are spliced in exactly, turns without them are
            tokenized from their text (the SFT path; their log-probs are unknown).
        tokenizer: a transformers tokenizer with a chat template (``apply_chat_template``) whose end-of-turn token
            is a single token.
        max_len: cut the sequence to ``max_len`` tokens (``report.truncated`` and ``report.cut`` say what was
            cut); None keeps all.
        truncation: which tokens ``max_len`` cuts. ``right`` (default) keeps the first ``max_len`` tokens.
            ``left`` keeps the system prompt (the tokens of the template's rendering of the first message when
            it is a system message, tool list included) and then the last ``max_len - len(system)`` tokens,
            cutting the oldest turns after the system prompt. The paper's SFT (Claw and SWE, 64K context) uses
            left truncation; keeping the system prompt is our reading of it (the task and tools stay in view).
            The cut is at token granularity: the kept tail may begin inside a turn, even inside an assistant
            turn, whose remaining tokens stay actions (one of them is then trained on the system prompt as its
            left context). Every kept token carries exactly its ``input_ids``, ``action_mask``, ``turn_index``
            (turns keep their untruncated numbers), ``old_logprobs`` and ``logprob_mask`` of the untruncated
            rendering. A system prompt longer than ``max_len`` is a ``ValueError`` (nothing sensible fits).
        on_mismatch: what to do when a turn's sampled ids disagree with the template's tokenization of its text
            (or the template is not prefix-consistent):
            ``use_sampled`` (default) keeps the sampled ids and their log-probs and reports;
            ``retokenize`` uses the template's ids, keeps the sampled log-probs on the common leading ids only
            (``logprob_mask`` False after the first difference) and reports;
            ``drop`` returns None; ``raise`` raises ``ValueError`` with the report.
        eot_token: the end-of-turn token text; default ``tokenizer.eos_token``.
        processor: for trajectories with images (OpenAI ``image_url`` parts with data URLs, in system, user or
            tool turns): an HF processor of the Qwen-VL family (``AutoProcessor`` of Qwen2-VL, Qwen2.5-VL or
            Qwen3-VL) or its image processor. Each ``<|image_pad|>`` the chat template writes becomes the image's
            ``grid_t * grid_h * grid_w / merge_size**2`` vision tokens, never actions, and the sample carries
            ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids``. Truncation never splits an image: the
            cut widens to its edge, and a cut-off image's pixels go with it. A trajectory with images and no
            processor is a ``ValueError`` (the images would be lost).

    Returns:
        The sample, or None when ``on_mismatch="drop"`` and the trajectory has a mismatch or prefix break.
    """
    _check_args(traj, tokenizer, max_len, on_mismatch, truncation)
    eot_text, eot_id = _eot_token(tokenizer, eot_token)
    vision = _vision(traj, tokenizer, processor)
    messages = traj.openai_messages()
    report = RenderReport()
    encode, used = vision.encoder() if vision is not None else (partial(_encode, tokenizer), None)
    segments = _segments_windowed(tokenizer, messages, traj.tools, eot_text)
    if segments is None:
        segments = _segments_exact(tokenizer, messages, traj.tools, eot_text, report)
    out = _Builder()
    turn = -1
    for kind, i, text in segments:
        if kind == "context":
            out.context(encode(text))
        else:
            turn += 1
            _splice_turn(
                out, tokenizer, traj.messages[i], turn, i, text, eot_id, on_mismatch, report, close=True
            )
    if not report.ok:
        if on_mismatch == "drop":
            return None
        if on_mismatch == "raise":
            raise ValueError(
                f"trajectory (task {traj.task_id!r}) does not render consistently: "
                f"{len(report.mismatches)} mismatched turns "
                f"({[(m.turn, m.kind, m.positions[:8]) for m in report.mismatches]}), "
                f"prefix breaks at messages {report.prefix_breaks}"
            )
    if vision is None:
        head = _system_head(tokenizer, messages, traj.tools)
        return out.build(max_len, report, traj, truncation=truncation, head=head)
    assert used is not None
    _check_images_used(used(), len(vision.urls))
    head = _system_head(tokenizer, messages, traj.tools, vision)
    spans = vision.spans(out.ids, used())
    sample = out.build(max_len, report, traj, truncation=truncation, head=head, spans=spans)
    return vision.attach(sample, spans)


def render_turns(
    traj: Trajectory,
    tokenizer: Any,
    *,
    max_len: int | None = None,
    truncation: Truncation = "right",
    on_mismatch: MismatchPolicy = "use_sampled",
    eot_token: str | None = None,
    processor: Any = None,
) -> list[RenderedSample]:
    """Render each assistant turn as its own sample: the prompt the engine saw, then the turn's action tokens.

    Sample ``k`` is ``tokenize(template(messages[:i], add_generation_prompt=True))`` (no action) followed by turn
    ``k``'s sampled ids (or the template's ids of its text when none were recorded), all with
    ``turn_index == k``. This is what a recording proxy sees call by call, and it is exact for templates that are
    not prefix-consistent (e.g. ones that drop earlier reasoning). Mismatches are found and handled as in
    :func:`render_trajectory` (``drop`` drops only the offending turns' samples); ``max_len``, ``truncation`` and
    ``processor`` apply to each sample as there (``left`` keeps the system prompt and the turn's newest tokens;
    sample ``k`` carries the images of its prompt, each processed once for all samples).
    """
    _check_args(traj, tokenizer, max_len, on_mismatch, truncation)
    eot_text, eot_id = _eot_token(tokenizer, eot_token)
    vision = _vision(traj, tokenizer, processor)
    messages = traj.openai_messages()
    head = _system_head(tokenizer, messages, traj.tools, vision)
    samples: list[RenderedSample] = []
    turn = -1
    for i, message in enumerate(traj.messages):
        if message.role != "assistant":
            continue
        turn += 1
        prompt = _template(tokenizer, messages[:i], traj.tools, gen=True)
        report = RenderReport()
        out = _Builder()
        if vision is None:
            out.context(_encode(tokenizer, prompt))
        else:
            encode, used = vision.encoder()
            out.context(encode(prompt))
            _check_images_used(used(), sum(len(m.image_urls) for m in traj.messages[:i]))
        full = _template(tokenizer, messages[: i + 1], traj.tools, gen=False)
        action_text, _ = _split_action_text(_suffix(prompt, full, i, report), eot_text)
        _splice_turn(out, tokenizer, message, turn, i, action_text, eot_id, on_mismatch, report, close=False)
        if not report.ok:
            if on_mismatch == "drop":
                continue
            if on_mismatch == "raise":
                raise ValueError(f"turn {turn} (message {i}) does not render consistently: {report}")
        if vision is None:
            samples.append(out.build(max_len, report, traj, truncation=truncation, head=head))
            continue
        spans = vision.spans(out.ids, used())
        sample = out.build(max_len, report, traj, truncation=truncation, head=head, spans=spans)
        samples.append(vision.attach(sample, spans))
    return samples
