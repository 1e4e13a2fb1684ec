"""The teacher phase's shared pieces (`orchard.stages.teacher`): the config's checks, `sample_teacher` keeping every
attempt, and `url_teacher` refusing a served model whose tokenizer is not the student's."""

import asyncio
import math
import re

import pytest

from orchard.data import Trajectory
from orchard.data.tokenizer import build_chat_tokenizer
from orchard.rollout.openai_engine import OpenAIEngine
from orchard.stages import TeacherConfig, check_tokenizers, sample_teacher, teacher_phase, url_teacher
from orchard.train.config import ConfigError


class Played:
    """A `Rollouts` that records its calls and answers, per task, rewards +1, -1, -1, ... and one dead sandbox."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    async def __call__(self, engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
        self.calls.append({"engine": engine, "tasks": list(tasks), "group_size": group_size,
                           "temperature": temperature, "max_tokens": max_tokens})
        out = []
        for task in tasks:
            for k in range(group_size):
                if k == group_size - 1:
                    out.append(Trajectory(task_id=task, reward=None, termination_reason="env_error"))
                else:
                    out.append(Trajectory(task_id=task, reward=1.0 if k == 0 else -1.0))
        return out


def test_every_attempt_is_kept_failures_and_sandbox_failures_included():
    bash, tool = Played(), Played()
    teacher = object()
    trajectories, stats = asyncio.run(sample_teacher({"bash": bash, "tool": tool}, teacher, ["a", "b"], attempts=5,
                                                     temperature=0.7, max_tokens=64))
    # 2 harnesses x 2 tasks x 5 attempts, nothing dropped: per task 1 passed, 3 failed, 1 sandbox failure
    assert len(trajectories) == 20
    assert [t.reward for t in trajectories[:5]] == [1.0, -1.0, -1.0, -1.0, None]
    assert stats == {"sft/teacher_bash_episodes": 10.0, "sft/teacher_bash_passed": 2.0,
                     "sft/teacher_bash_env_errors": 2.0, "sft/teacher_tool_episodes": 10.0,
                     "sft/teacher_tool_passed": 2.0, "sft/teacher_tool_env_errors": 2.0}
    # the teacher plays the policy's role in each harness: attempts as the group, its temperature, its budget
    for played in (bash, tool):
        assert played.calls == [{"engine": teacher, "tasks": ["a", "b"], "group_size": 5, "temperature": 0.7,
                                 "max_tokens": 64}]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"harnesses": {}}, "harnesses must map names to Rollouts"),
    ({"tasks": []}, "tasks must be a non-empty sequence"),
    ({"tasks": "ab"}, "tasks must be a non-empty sequence"),
    ({"attempts": 0}, "attempts must be an int >= 1, got 0"),
    ({"attempts": True}, "attempts must be an int >= 1, got True"),
    ({"temperature": -0.5}, "temperature must be a finite number >= 0, got -0.5"),
    ({"temperature": math.nan}, "temperature must be a finite number >= 0, got nan"),
])
def test_sample_teacher_bad_arguments(kwargs, message):
    args = {"harnesses": {"bash": Played()}, "tasks": ["a"], "attempts": 2, "temperature": 1.0, **kwargs}
    harnesses, tasks = args.pop("harnesses"), args.pop("tasks")
    with pytest.raises(ValueError, match=re.escape(message)):
        asyncio.run(sample_teacher(harnesses, object(), tasks, **args))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"url": "ftp://x"}, "url must be an http(s) URL or null, got 'ftp://x'"),
    ({"url": "http://x:8000/v1"}, "tokenizer must name the served model's tokenizer when url is set"),
    ({"tokenizer": "no/such/dir"}, "tokenizer must be 'tiny', a local HF directory or a named checkpoint"),
    ({"model": ""}, "model must be a non-empty string, got ''"),
    ({"attempts": 0}, "attempts must be an int >= 1, got 0"),
    ({"attempts": 2.5}, "attempts must be an int >= 1, got 2.5"),
    ({"temperature": -1}, "temperature must be a finite number >= 0, got -1"),
    ({"temperature": math.inf}, "temperature must be a finite number >= 0, got inf"),
])
def test_config_refuses_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TeacherConfig(**kwargs)


def test_defaults_are_the_scripted_teacher_with_the_papers_five_attempts():
    cfg = TeacherConfig()
    assert (cfg.url, cfg.attempts, cfg.temperature) == (None, 5, 1.0)


def test_url_teacher_checks_the_tokenizer_then_speaks_openai(tmp_path):
    student = build_chat_tokenizer()
    # the served model's tokenizer by name: the offline one orchard serve-model --model tiny uses
    engine = url_teacher(TeacherConfig(url="http://127.0.0.1:9/v1", model="big", tokenizer="tiny"), student)
    assert isinstance(engine, OpenAIEngine) and (engine.base_url, engine.model) == ("http://127.0.0.1:9", "big")
    asyncio.run(engine.close())
    # another tokenizer, saved where the config points: refused before any request, naming both
    other = build_chat_tokenizer(["SELECT name FROM users WHERE id = 1;\n" * 50], vocab_size=1100)
    other.save_pretrained(tmp_path / "other")
    cfg = TeacherConfig(url="http://127.0.0.1:9/v1", tokenizer=str(tmp_path / "other"))
    with pytest.raises(ConfigError, match=r"^rl\.teacher\.tokenizer: model\.path and rl\.teacher\.tokenizer "
                                          rf"\({re.escape(str(tmp_path / 'other'))}\) must share one tokenizer "
                                          r".*vocabularies differ"):
        url_teacher(cfg, student, key="rl.teacher", student_name="model.path")
    with pytest.raises(ValueError, match="cfg must be a TeacherConfig with url and tokenizer set"):
        url_teacher(TeacherConfig(), student)


def test_check_tokenizers_loads_names_and_names_the_key():
    check_tokenizers("tiny", build_chat_tokenizer(), key="teacher.tokenizer")
    with pytest.raises(ConfigError, match=r"^teacher\.tokenizer: the student \(tiny\) and teacher\.tokenizer must "
                                          r"share one tokenizer"):
        check_tokenizers("tiny", build_chat_tokenizer(vision=True), key="teacher.tokenizer")
    with pytest.raises(ValueError, match="key must be a non-empty config key"):
        check_tokenizers("tiny", "tiny", key="")


class Scripted:
    """A scripted teacher's stand-in that knows whether it was closed."""

    closed = False

    async def close(self):
        self.closed = True


def test_teacher_phase_plays_the_scripted_teacher_greedily_and_closes_it():
    played, built = Played(), []

    def scripted():
        built.append(Scripted())
        return built[-1]

    trajectories, stats = asyncio.run(teacher_phase(TeacherConfig(attempts=3), {"bash": played}, ["a"],
                                                    student_tokenizer=None, scripted=scripted,
                                                    scripted_max_tokens=4096))
    assert len(built) == 1 and built[0].closed
    assert played.calls == [{"engine": built[0], "tasks": ["a"], "group_size": 3, "temperature": 0.0,
                             "max_tokens": 4096}]
    assert len(trajectories) == 3 and stats["sft/teacher_bash_episodes"] == 3.0
    with pytest.raises(ValueError, match=r"scripted must build the domain.s scripted teacher when teacher\.url is null"):
        asyncio.run(teacher_phase(TeacherConfig(), {"bash": played}, ["a"], student_tokenizer=None))
    with pytest.raises(ValueError, match="cfg must be a TeacherConfig"):
        asyncio.run(teacher_phase({"url": None}, {"bash": played}, ["a"], student_tokenizer=None))


def test_a_tokenizer_that_cannot_be_loaded_is_one_config_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^value_model\.backbone: cannot load the tokenizer of value_model\.backbone"):
        check_tokenizers(build_chat_tokenizer(), str(tmp_path / "empty"), key="value_model.backbone")
