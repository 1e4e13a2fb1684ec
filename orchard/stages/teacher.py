"""The teacher phase every recipe repeats: a teacher's trajectories through the policy's own harnesses, failures kept.

The teacher is either the domain's scripted one (the CPU default: a program that knows each task's answer, not a
model) or any OpenAI-compatible endpoint by URL (``vllm serve``, ``orchard serve-model``: a served larger model).
A URL teacher is an `orchard.rollout.openai_engine.OpenAIEngine`: it plays the policy's role in the same harnesses,
so its episodes are rendered, recorded and scored by exactly the code paths the policy's rollouts take, and the
token ids it samples are what SFT trains on. The harness renders prompts with the student's tokenizer and the
teacher answers token ids, so the two must share one tokenizer: ``teacher.tokenizer`` names the served model's,
and `url_teacher` refuses a teacher whose vocabulary or special tokens differ from the student's.

`sample_teacher` plays ``attempts`` episodes per task through each harness and returns every one of them, failed
ones included (the paper's 5 attempts per task, failures kept): what trains is the recipe's curation's choice.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchard.data import Trajectory
from orchard.data.tokenizer import TokenizerMismatch, check_same_tokenizer
from orchard.rollout.rollouts import Rollouts
from orchard.train.config import ConfigError

__all__ = ["TEACHER_API_KEY_ENV", "TeacherConfig", "check_tokenizers", "load_tokenizer", "sample_teacher",
           "teacher_phase", "url_teacher"]

TEACHER_API_KEY_ENV = "TEACHER_API_KEY"
"""The environment variable whose value a URL teacher is sent as its bearer key (unset: none)."""


@dataclass
class TeacherConfig:
    url: str | None = None
    """OpenAI-compatible server (``vllm serve``, ``orchard serve-model``) whose model samples the teacher
    trajectories through the policy's harnesses (key in TEACHER_API_KEY); null: the domain's scripted teacher."""
    model: str = "orchard"
    """Model name sent to the teacher server."""
    tokenizer: str | None = None
    """The served model's tokenizer ('tiny', a local HF directory or a named checkpoint); required with url, and
    refused unless it is the student's (vocabulary and special tokens: the two exchange token ids)."""
    attempts: int = 5
    """Teacher episodes per task and harness, failures kept (the paper: 5)."""
    temperature: float = 1.0
    """Sampling temperature of a URL teacher (the scripted teacher plays its plan whatever the temperature)."""

    def __post_init__(self) -> None:
        if self.url is not None and (not isinstance(self.url, str)
                                     or not self.url.startswith(("http://", "https://"))):
            raise ValueError(f"url must be an http(s) URL or null, got {self.url!r}")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        if self.url is not None and self.tokenizer is None:
            raise ValueError("tokenizer must name the served model's tokenizer when url is set ('tiny', a local HF "
                             "directory or a named checkpoint): it is checked to be the student's")
        if self.tokenizer is not None:
            from orchard.models.pretrained import PRETRAINED

            if self.tokenizer != "tiny" and self.tokenizer not in PRETRAINED and not Path(self.tokenizer).is_dir():
                raise ValueError(f"tokenizer must be 'tiny', a local HF directory or a named checkpoint "
                                 f"({', '.join(sorted(PRETRAINED))}), got {self.tokenizer!r} (no such directory)")
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"attempts must be an int >= 1, got {self.attempts!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")

    def describe(self, scripted: str = "the scripted teacher") -> str:
        """How a run's provenance and log name this teacher: its model and URL, or ``scripted``."""
        return f"the teacher {self.model} at {self.url}" if self.url is not None else scripted


def load_tokenizer(name: str) -> Any:
    """``tiny`` (the offline chat tokenizer of ``orchard serve-model --model tiny``), a local HF directory or a named
    pretrained checkpoint: the tokenizer a server of that name uses."""
    if name == "tiny":
        from orchard.data.tokenizer import build_chat_tokenizer

        return build_chat_tokenizer()
    from orchard.models.pretrained import load_chat_tokenizer

    return load_chat_tokenizer(name)


def url_teacher(cfg: TeacherConfig, student_tokenizer: Any, *, key: str = "teacher",
                student_name: str = "the student") -> Any:
    """The teacher at ``cfg.url`` as an engine (`OpenAIEngine`), once ``cfg.tokenizer`` is checked to be the
    student's (`check_tokenizers`: a `ConfigError` naming ``<key>.tokenizer`` and both tokenizers otherwise).

    Args:
        cfg: a `TeacherConfig` with ``url`` set.
        student_tokenizer: the policy's tokenizer (the harnesses render with it), or its name (`load_tokenizer`).
        key: the config key of the teacher (``teacher``, ``rl.teacher``), for the message.
        student_name: how the message names the student's tokenizer (its config key and path).
    """
    if not isinstance(cfg, TeacherConfig) or cfg.url is None or cfg.tokenizer is None:
        raise ValueError(f"cfg must be a TeacherConfig with url and tokenizer set, got {cfg!r:.200}")
    check_tokenizers(student_tokenizer, cfg.tokenizer, key=f"{key}.tokenizer", student_name=student_name)
    from orchard.rollout.openai_engine import OpenAIEngine

    return OpenAIEngine(cfg.url, model=cfg.model, api_key=os.environ.get(TEACHER_API_KEY_ENV) or None)


def check_tokenizers(student: Any, teacher: Any, *, key: str, student_name: str = "the student") -> None:
    """A `ConfigError` (one ``error:`` line at the command line) whose message starts with ``key`` and names both
    tokenizers unless ``teacher`` is ``student`` (`orchard.data.tokenizer.check_same_tokenizer`: vocabulary and
    special tokens).

    Args:
        student, teacher: tokenizers, or names `load_tokenizer` loads ('tiny', a local HF directory, a named
            checkpoint).
        key: the config key that gave the teacher's tokenizer (``teacher.tokenizer``, ``rl.teacher.path``).
        student_name: how the message names the student's (``model.path``).
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"key must be a non-empty config key, got {key!r}")
    names = {}
    loaded = []
    for role, tok, what in (("student", student, student_name), ("teacher", teacher, key)):
        names[role] = f" ({tok})" if isinstance(tok, str) else ""
        try:
            loaded.append(load_tokenizer(tok) if isinstance(tok, str) else tok)
        except (OSError, ValueError) as exc:  # a path that holds no tokenizer is the user's mistake, one line
            raise ConfigError(f"{key}: cannot load the tokenizer of {what} {tok!r}: {exc}") from exc
    try:
        check_same_tokenizer(*loaded, student_name=f"{student_name}{names['student']}",
                             teacher_name=f"{key}{names['teacher']}")
    except TokenizerMismatch as exc:
        raise ConfigError(f"{key}: {exc}") from exc


async def sample_teacher(harnesses: Mapping[str, Rollouts], teacher: Any, tasks: Sequence[Any], *, attempts: int,
                         temperature: float, max_tokens: int | None = None,
                         ) -> tuple[list[Trajectory], dict[str, float]]:
    """``attempts`` teacher episodes per task through each harness, every one returned: passed, failed and
    environment failures alike (curation decides what trains; `orchard.stages.sft_samples` never trains an
    environment failure).

    Args:
        harnesses: name -> the policy's `Rollouts`.
        teacher: any `orchard.rollout.Engine` (a scripted teacher, a `url_teacher`).
        tasks: the tasks, non-empty.
        attempts: episodes per task and harness, >= 1 (the paper: 5).
        temperature: the teacher's sampling temperature, >= 0.
        max_tokens: per assistant turn (None: each harness's own).

    Returns:
        The trajectories, harness by harness, task-major within each; and ``sft/teacher_<harness>_episodes``,
        ``sft/teacher_<harness>_passed`` (reward > 0) and ``sft/teacher_<harness>_env_errors`` counts.
    """
    if not isinstance(harnesses, Mapping) or not harnesses:
        raise ValueError(f"harnesses must map names to Rollouts, got {harnesses!r:.100}")
    if isinstance(tasks, (str, bytes)) or not isinstance(tasks, Sequence) or not tasks:
        raise ValueError(f"tasks must be a non-empty sequence, got {tasks!r:.100}")
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be an int >= 1, got {attempts!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    trajectories: list[Trajectory] = []
    stats: dict[str, float] = {}
    for name, rollouts in harnesses.items():
        got = await rollouts(teacher, tasks, group_size=attempts, temperature=float(temperature),
                             max_tokens=max_tokens)
        trajectories += got
        stats[f"sft/teacher_{name}_episodes"] = float(len(got))
        stats[f"sft/teacher_{name}_passed"] = float(sum(t.valid and (t.reward or 0) > 0 for t in got))
        stats[f"sft/teacher_{name}_env_errors"] = float(sum(t.is_env_error for t in got))
    return trajectories, stats


async def teacher_phase(cfg: TeacherConfig, harnesses: Mapping[str, Rollouts], tasks: Sequence[Any], *,
                        student_tokenizer: Any, scripted: Callable[[], Any] | None = None,
                        scripted_max_tokens: int | None = None, key: str = "teacher",
                        ) -> tuple[list[Trajectory], dict[str, float]]:
    """A recipe's teacher phase: ``cfg.attempts`` episodes per task through each harness, every one kept
    (`sample_teacher`), from ``cfg.url``'s model (`url_teacher`: its tokenizer checked first) at ``cfg.temperature``,
    or with ``cfg.url`` null from the domain's scripted teacher (``scripted()``, an `Engine`), greedy, its turns up
    to ``scripted_max_tokens``; the teacher is closed afterwards.

    Args:
        cfg: the recipe's `TeacherConfig`.
        harnesses, tasks: as `sample_teacher`.
        student_tokenizer: the policy's tokenizer.
        scripted: builds the domain's scripted teacher; required when ``cfg.url`` is None.
        scripted_max_tokens: the scripted teacher's turn budget (None: each harness's own).
        key: the teacher's config key, for messages.
    """
    if not isinstance(cfg, TeacherConfig):
        raise ValueError(f"cfg must be a TeacherConfig, got {type(cfg).__name__}")
    if cfg.url is not None:
        teacher = url_teacher(cfg, student_tokenizer, key=key, student_name="model.path")
        temperature, max_tokens = cfg.temperature, None
    elif scripted is None or not callable(scripted):
        raise ValueError(f"scripted must build the domain's scripted teacher when {key}.url is null, got {scripted!r}")
    else:
        teacher, temperature, max_tokens = scripted(), 0.0, scripted_max_tokens
    try:
        return await sample_teacher(harnesses, teacher, tasks, attempts=cfg.attempts, temperature=temperature,
                                    max_tokens=max_tokens)
    finally:
        await teacher.close()
