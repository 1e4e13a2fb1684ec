"""Teachers by URL in every recipe, tested as servers: a tiny model served by the project's OpenAI-compatible app on
loopback (real HTTP, the HF engine behind it, every completion it returned recorded) is each recipe's teacher in its
teacher phase, through the recipe's own harnesses and real sandboxes. The trajectories are the endpoint's (every
teacher turn's token ids are a completion it returned), every attempt is kept, failures included; a teacher whose
tokenizer is not the student's is refused with one line naming both, before the run writes anything."""

import asyncio
import importlib.util
import shutil
from pathlib import Path

import pytest

from orchard.data.tokenizer import build_chat_tokenizer
from orchard.models import tiny_qwen3
from orchard.models.pretrained import load_chat_tokenizer
from orchard.rollout.hf_engine import HFEngine
from orchard.rollout.server import build_app, serve_in_thread
from orchard.stages.policy import save_policy
from orchard.train.config import load_config

ROOT = Path(__file__).resolve().parents[2]


class Recorded:
    """The served engine: the HF engine's completions, each recorded as it goes back to the client."""

    def __init__(self, engine):
        self.engine = engine
        self.returned: list[tuple[int, ...]] = []

    async def generate(self, requests):
        results = await self.engine.generate(requests)
        self.returned += [tuple(c.token_ids) for r in results for c in r.completions]
        return results

    def __getattr__(self, name):
        if name == "generate_stream":  # every completion goes through generate, where it is recorded
            raise AttributeError(name)
        return getattr(self.engine, name)


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    """A student checkpoint (model.path) with the offline tokenizer that ``orchard serve-model --model tiny`` uses."""
    tokenizer = build_chat_tokenizer()
    path = tmp_path_factory.mktemp("student") / "ckpt"
    save_policy(tiny_qwen3(tokenizer, seed=0, hidden_size=32, intermediate_size=96, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8), tokenizer, path)
    return path


@pytest.fixture(scope="module")
def served():
    """A larger-than-the-student random tiny model served on loopback: (url, the recorded engine)."""
    tokenizer = build_chat_tokenizer()
    model = tiny_qwen3(tokenizer, seed=1, hidden_size=48, intermediate_size=144, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=12).eval()
    engine = Recorded(HFEngine(model, pad_token_id=tokenizer.pad_token_id, max_batch_size=16, seed=0))
    with serve_in_thread(build_app(engine, tokenizer, model_name="big-teacher", max_model_len=32768)) as url:
        yield url, engine


def from_the_endpoint(trajectories, engine):
    """Every teacher turn of every trajectory is a completion the endpoint returned; the number of turns."""
    turns = [tuple(m.token_ids) for t in trajectories for m in t.messages if m.role == "assistant" and m.token_ids]
    assert turns and set(turns) <= set(engine.returned)
    return len(turns)


def url_overrides(student, url, attempts=2):
    return [f"model.path={student}", f"teacher.url={url}/v1", "teacher.model=big-teacher", "teacher.tokenizer=tiny",
            f"teacher.attempts={attempts}", "teacher.temperature=1.0"]


def kept_failures(trajectories, tasks, attempts):
    # every attempt comes back, scored; a random model resolves nothing, and its failures are kept
    assert len(trajectories) == len(tasks) * attempts
    assert all(t.valid for t in trajectories), [t.termination_reason for t in trajectories]
    assert all(t.reward <= 0 for t in trajectories)


def test_swe_teacher_phase_samples_the_served_model(student, served, recipe_module):
    from orchard.domains.swe.generator import generate_instances
    from orchard.domains.swe.harnesses import swe_harnesses
    from orchard.domains.swe.sandbox import sandbox_options, shared_folders
    from orchard.stages import pooled_sandboxes, teacher_phase

    swe = recipe_module("swe")
    url, engine = served
    cfg = load_config(swe.SWEConfig, ROOT / "recipes/configs/swe_tiny.yaml", [
        *url_overrides(student, url), "harnesses=[bash]", "rollout.max_steps=2", "rollout.max_tokens=12",
        "rl.enabled=false", "value_model.enabled=false"], derived=swe.DERIVED)
    tokenizer = load_chat_tokenizer(student)
    train = generate_instances("train", 1, levels=(1,), templates=("inventory",))
    before = len(engine.returned)

    async def phase():  # the recipe's own composition: its sandboxes, harnesses and teacher phase
        r = cfg.rollout
        async with pooled_sandboxes(cfg.env_url, shared=shared_folders(), pool_options=sandbox_options()) as sandboxes:
            harnesses = swe_harnesses(sandboxes, tokenizer, max_steps=r.max_steps, max_tokens=r.max_tokens,
                                      max_time_s=r.max_time_s, concurrency=r.concurrency)
            return await teacher_phase(cfg.teacher, {"bash": harnesses["bash"]}, train, student_tokenizer=tokenizer,
                                       scripted=None)

    trajectories, stats = asyncio.run(phase())
    assert from_the_endpoint(trajectories, engine) <= len(engine.returned) - before
    kept_failures(trajectories, train, 2)
    assert stats == {"sft/teacher_bash_episodes": 2.0, "sft/teacher_bash_passed": 0.0,
                     "sft/teacher_bash_env_errors": 0.0}
    assert cfg.teacher.describe() == f"the teacher big-teacher at {url}/v1"  # what the SFT provenance names


def test_claw_teacher_phase_samples_the_served_model(student, served, recipe_module):
    from orchard.domains.claw.tasks import split_tasks
    from orchard.env import AsyncSandboxClient
    from orchard.stages.sandboxes import sandbox_service

    claw = recipe_module("claw")
    url, engine = served
    cfg = load_config(claw.ClawConfig, ROOT / "recipes/configs/claw_tiny.yaml", [
        *url_overrides(student, url), "rollout.max_steps=2", "rollout.max_tokens=12"], derived=claw.DERIVED)
    tokenizer = load_chat_tokenizer(student)
    tasks = split_tasks("train", 1)[:2]
    before = len(engine.returned)

    async def phase():
        with sandbox_service(None) as env:
            async with AsyncSandboxClient(*env) as client:
                harnesses = claw.claw_harnesses(cfg, tokenizer, client)
                return await claw.teacher_phase(cfg, harnesses, tokenizer, tasks)

    trajectories, stats = asyncio.run(phase())
    assert from_the_endpoint(trajectories, engine) <= len(engine.returned) - before
    kept_failures(trajectories, tasks * 2, 2)  # both harnesses, 2 attempts each
    assert stats["sft/teacher_react_episodes"] == stats["sft/teacher_text_episodes"] == 4.0


def test_gui_teacher_phase_samples_the_served_model(student, served, recipe_module):
    if shutil.which("/usr/bin/chromium") is None or importlib.util.find_spec("playwright") is None:
        pytest.fail("the GUI tests need chromium (apt) and playwright (the [gui] extra): run scripts/setup",
                    pytrace=False)
    from orchard.env import SandboxClient
    from orchard.env.embedded import serve

    gui = recipe_module("gui")
    url, engine = served
    cfg = load_config(gui.GUIConfig, ROOT / "recipes/configs/gui_tiny.yaml", [
        *url_overrides(student, url), "tasks.templates=[shop_price]", "tasks.train_per_template=1",
        "step_budgets=[2]", "rollout.max_tokens=12", "rl.enabled=false"], derived=gui.DERIVED)
    train, _ = gui.task_pools(cfg)
    before = len(engine.returned)
    with serve() as (service_url, key), SandboxClient(service_url, key) as client:
        trajectories, _model, tokenizer = asyncio.run(gui.teacher_phase(cfg, client, train))
    assert from_the_endpoint(trajectories, engine) <= len(engine.returned) - before
    assert tokenizer.get_vocab() == build_chat_tokenizer().get_vocab()  # the student's, loaded from model.path
    assert len(trajectories) == 2 and all(t.task_id == str(train[0].id) for t in trajectories)
    assert all(not t.passed for t in trajectories)  # failures kept (the judge scores them later)


@pytest.mark.parametrize("name", ["swe", "claw", "gui"])
def test_a_teacher_with_another_tokenizer_is_refused_before_any_work(name, student, tmp_path, recipe_main):
    other = build_chat_tokenizer(["SELECT name FROM users WHERE id = 1;\n" * 50], vocab_size=1100)
    other.save_pretrained(tmp_path / "other")
    out = tmp_path / "run"
    status, _, err = recipe_main(name, "--config", str(ROOT / f"recipes/configs/{name}_tiny.yaml"),
                                 f"output_dir={out}", f"model.path={student}", "teacher.url=http://127.0.0.1:9/v1",
                                 f"teacher.tokenizer={tmp_path / 'other'}")
    assert status == 2
    assert err.startswith(f"error: teacher.tokenizer: model.path ({student}) and teacher.tokenizer "
                          f"({tmp_path / 'other'}) must share one tokenizer (their token ids are exchanged as they "
                          f"are): vocabularies differ ("), err
    assert err.count("\n") == 1 and not out.exists()


def test_the_opd_teacher_checkpoint_with_another_tokenizer_is_refused_before_any_work(student, tmp_path,
                                                                                       recipe_main):
    # the case: a Qwen3 student beside a teacher of another vocabulary (here two offline tokenizers)
    other = build_chat_tokenizer(vision=True)
    teacher = tmp_path / "teacher"
    save_policy(tiny_qwen3(other, seed=2, hidden_size=32, intermediate_size=96, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8), other, teacher)
    out = tmp_path / "run"
    status, _, err = recipe_main("swe", "--config", str(ROOT / "recipes/configs/swe_tiny.yaml"), f"output_dir={out}",
                                 f"model.path={student}", "rl.variant=opd_js_grpo", f"rl.teacher.path={teacher}")
    assert status == 2
    assert err.startswith(f"error: rl.teacher.path: model.path ({student}) and rl.teacher.path ({teacher}) must "
                          f"share one tokenizer"), err
    assert err.count("\n") == 1 and not out.exists()


def test_a_value_backbone_with_another_tokenizer_is_refused_before_any_work(student, tmp_path, recipe_main):
    other = build_chat_tokenizer(vision=True)
    backbone = tmp_path / "value-4B"
    save_policy(tiny_qwen3(other, seed=3, hidden_size=32, intermediate_size=96, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8), other, backbone)
    out = tmp_path / "run"
    status, _, err = recipe_main("swe", "--config", str(ROOT / "recipes/configs/swe_tiny.yaml"), f"output_dir={out}",
                                 f"model.path={student}", f"value_model.backbone={backbone}")
    assert status == 2
    assert err.startswith(f"error: value_model.backbone: model.path ({student}) and value_model.backbone "
                          f"({backbone}) must share one tokenizer"), err
    assert not out.exists()


@pytest.mark.parametrize("name", ["swe", "claw", "gui"])
def test_a_url_teacher_needs_a_checkpoint_student(name, recipe_main):
    status, _, err = recipe_main(name, "--config", str(ROOT / f"recipes/configs/{name}_tiny.yaml"),
                                 "teacher.url=http://127.0.0.1:9/v1", "teacher.tokenizer=tiny")
    assert status == 2
    assert err.startswith("error: teacher.url needs model.path: a tiny student's tokenizer is trained"), err
