"""The paper's GUI configuration (`recipes/configs/gui.yaml`) as it runs (issue 33), without a browser: SFT on
screenshots through the recipe's own sample builder and one trainer step on a tiny Qwen3-VL checkpoint with exact
masks and a frozen vision tower; one `keep_last_images` setting for the agent loop's prompts and the SFT prefixes;
K = 20 tasks per website; the browsers' resources on Kubernetes; a turn with several tool calls well formed."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from orchard.data import Message, ToolCall, Trajectory
from orchard.data.tokenizer import IMAGE_TOKEN, build_chat_tokenizer
from orchard.domains.gui.curation import MAX_TASKS_PER_SITE, curate_sft, turn_prefixes
from orchard.domains.gui.evidence import site_text
from orchard.domains.gui.judge import gui_rollout_reward, turn_format_ok
from orchard.domains.gui.rollouts import BrowserSandbox, GUIHarness
from orchard.domains.gui.session import BROWSER_MEMORY, BrowserSession
from orchard.domains.gui.tasks import make_task
from orchard.domains.gui.tools import GUI_TOOLS, IMAGE_PLACEHOLDER, Observation, policy_context
from orchard.env import SandboxClient
from orchard.rollout.agent_loop import AgentLoop
from orchard.rollout.scripted import ScriptedEngine
from orchard.stages import SFTConfig, sft_stage
from orchard.stages.policy import load_image_processor, load_policy
from orchard.train.config import load_config
from orchard.train.trainer import OptimConfig, TrainConfig

ROOT = Path(__file__).resolve().parents[3]
URL = "http://127.0.0.1:8000"
STATE = {"cart": [], "orders": [], "bookings": [], "settings": {}, "captcha_hits": 0}
FACT = make_task("info_fact", 4)  # its answer is a number; the checker reads the done response
VISION_TOKENS_PER_SHOT = 4  # a 64 x 64 screenshot: 16 patches of 16 px, merged 2 x 2


def gui_recipe():
    """`recipes/gui.py` as a module (the name tests/recipes/conftest.py gives it, so both share one copy)."""
    if "gui_recipe" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gui_recipe", ROOT / "recipes" / "gui.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["gui_recipe"] = module  # dataclasses resolve the recipe's annotations there
        spec.loader.exec_module(module)
    return sys.modules["gui_recipe"]


def call(name, **arguments):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    """A tiny random Qwen3-VL saved as a checkpoint with its tokenizer and image processor, as `model.path`."""
    from orchard.models.tiny import tiny_vl_chat_model

    model, tokenizer, processor = tiny_vl_chat_model(seed=0)
    path = tmp_path_factory.mktemp("tiny_vl")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def paper_config(checkpoint, *overrides):
    """`gui.yaml` as a user runs it, the checkpoint given on the command line."""
    return load_config(gui_recipe().GUIConfig, ROOT / "recipes/configs/gui.yaml",
                       [f"model.path={checkpoint}", *overrides])


def gui_run(screenshot, shots):
    """A GUI run as the agent loop records it with images: the intent and the first page (screenshot 0), then
    ``shots - 1`` clicks each answered by the next screenshot, then done."""
    def page(k):
        text = f"Viewport: 64x64\nTab 0 (active): 'page {k}' {URL}/info/"
        return [{"type": "text", "text": text}, screenshot(64, 64, k)]

    messages = [Message("system", "You operate a browser."),
                Message("user", [{"type": "text", "text": FACT.intent}, *page(0)])]
    for k in range(1, shots):
        messages.append(Message("assistant", None, [ToolCall("click", {"x": 10 * k, "y": 5}, id=f"c{k}")]))
        messages.append(Message("tool", page(k), tool_call_id=f"c{k}", name="click"))
    messages.append(Message("assistant", None, [ToolCall("done", {"response": FACT.answer}, id="end")]))
    return Trajectory(messages, GUI_TOOLS, 1.0, task_id=FACT.id)


# ---- the paper's config ------------------------------------------------------------------------------------------


def test_the_paper_config_freezes_the_vision_tower_keeps_3_screenshots_and_20_tasks_per_site(vl_checkpoint):
    cfg = paper_config(vl_checkpoint)
    assert cfg.images and cfg.model.freeze_vision and cfg.keep_last_images == 3
    assert cfg.tasks.max_tasks_per_site == MAX_TASKS_PER_SITE == 20
    model, _ = load_policy(cfg.model, [], seed=0)
    vision = {n: p.requires_grad for n, p in model.named_parameters() if n.startswith("model.visual.")}
    language = [p.requires_grad for n, p in model.named_parameters() if n.startswith("model.language_model.")]
    assert vision and not any(vision.values()) and language and all(language)
    # the recipe's own defaults are the paper's too
    defaults = gui_recipe().GUIConfig()
    assert defaults.tasks.max_tasks_per_site == 20 and defaults.keep_last_images == 3


@pytest.mark.parametrize(("override", "message"), [
    ("keep_last_images=-1", "keep_last_images must be an int >= 0 or null"),
    ("tasks.max_tasks_per_site=0", "tasks.max_tasks_per_site must be an int >= 1 or null"),
])
def test_config_mistakes_name_the_field(vl_checkpoint, override, message):
    with pytest.raises(ValueError, match=message):
        paper_config(vl_checkpoint, override)


def test_images_without_a_checkpoint_or_its_processor_are_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"images: true needs model\.path"):
        load_config(gui_recipe().GUIConfig, None, ["images=true"])
    with pytest.raises(ValueError, match="freeze_vision needs path"):
        load_config(gui_recipe().GUIConfig, None, ["model.freeze_vision=true"])
    from orchard.stages.policy import ModelConfig

    with pytest.raises(ValueError, match="has no image processor"):
        load_image_processor(ModelConfig(path=str(tmp_path)))


# ---- SFT on screenshots ------------------------------------------------------------------------------------------


def test_sft_on_screenshots_renders_exact_masks_and_trains_with_a_frozen_tower(vl_checkpoint, screenshot, tmp_path):
    cfg = paper_config(vl_checkpoint, "keep_last_images=2", "model.dtype=float32")
    model, tokenizer = load_policy(cfg.model, [], seed=0)
    processor = load_image_processor(cfg.model)
    traj = gui_run(screenshot, 4)  # screenshots 0..3; turns: 3 clicks, done
    samples = gui_recipe().sft_samples(cfg, [traj], tokenizer, processor)
    assert len(samples) == 4
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    for k, (sample, i) in enumerate(zip(samples, traj.assistant_indices, strict=True)):
        # the context: the template over the prefix the policy saw (screenshots k-1 and k as images, earlier ones
        # the placeholder), each image token expanded into the screenshot's 4 vision tokens
        shown = policy_context(traj.messages[:i], 2)
        prompt = tokenizer.apply_chat_template([m.to_openai() for m in shown], tools=GUI_TOOLS,
                                               add_generation_prompt=True, tokenize=False)
        ids = []
        for token in tokenizer(prompt, add_special_tokens=False)["input_ids"]:
            ids += [token] * (VISION_TOKENS_PER_SHOT if token == image_id else 1)
        assert sample.input_ids[:len(ids)].tolist() == ids
        assert prompt.count(IMAGE_PLACEHOLDER) == max(0, k - 1)
        # the target: that turn's tokens only, up to its end-of-turn token
        assert not sample.action_mask[:len(ids)].any() and sample.action_mask[len(ids):].all()
        full = tokenizer.apply_chat_template([m.to_openai() for m in [*shown, traj.messages[i]]], tools=GUI_TOOLS,
                                             tokenize=False)
        target = full[len(prompt):]
        target = target[:target.index(tokenizer.eos_token) + len(tokenizer.eos_token)]
        assert tokenizer.decode(sample.input_ids[sample.action_mask].tolist()) == target
        # the pixels of the kept screenshots go with the sample: min(k + 1, 2) of them
        shots = min(k + 1, 2)
        assert int(sample.mm_token_type_ids.sum()) == VISION_TOKENS_PER_SHOT * shots
        assert sample.image_grid_thw.tolist() == [[1, 4, 4]] * shots and sample.pixel_values.shape[0] == 16 * shots
    # one optimizer step of the SFT stage: the language model moves, the frozen vision tower does not
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sft = SFTConfig(epochs=1.0, train=TrainConfig(global_batch_size=4, micro_batch_size=2,
                                                  optim=OptimConfig(lr=1e-2, min_lr=1e-2), loggers=["jsonl"]))
    history = sft_stage(model, samples, sft, pad_id=tokenizer.pad_token_id, seed=0, output_dir=str(tmp_path))
    assert len(history) == 1 and torch.isfinite(torch.tensor(history[0]["loss/total"]))
    moved = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert "model.language_model.layers.0.mlp.up_proj.weight" in moved
    assert not {n for n in moved if n.startswith("model.visual.")}


# ---- one keep_last_images for the agent loop and the SFT prefixes ------------------------------------------------


class FakeBrowser:
    """A browser whose every page is a 64 x 64 screenshot (seeded by the step), for the loop without Chromium."""

    def __init__(self, screenshot_part):
        self.sandbox = SimpleNamespace(sandbox_id="fake")
        self.step_count, self.actions, self.part = 0, [], screenshot_part

    def _obs(self):
        import base64

        png = base64.b64decode(self.part(64, 64, self.step_count)["image_url"]["url"].split(",", 1)[1])
        return Observation(png, (64, 64), ((f"{URL}/info/", f"page {self.step_count}"),), 0)

    def reset(self, url, fresh_state=True):
        return self._obs()

    def step(self, name, arguments):
        self.actions.append(name)
        self.step_count += 1
        return self._obs()

    def site_state(self):
        return dict(STATE)

    def close(self):
        pass


class FakeBrowsers:
    def __init__(self, screenshot_part):
        self.part, self.browsers = screenshot_part, []

    async def create(self, **spec):
        self.browsers.append(FakeBrowser(self.part))
        return BrowserSandbox(self.browsers[-1])


def play(screenshot, script, **harness_kwargs):
    tokenizer = build_chat_tokenizer(vision=True)
    engine = ScriptedEngine(tokenizer, script)
    browsers = FakeBrowsers(screenshot)
    loop = AgentLoop(engine, browsers, GUIHarness(images=True, **harness_kwargs), tokenizer, require_tool_call=True,
                     progress=False, start_jitter_s=0.0, seed=0)
    return asyncio.run(loop.run(FACT)), engine, tokenizer, browsers


def test_the_loop_shows_the_policy_the_context_sft_trains_on(screenshot):
    script = [call("click", x=1, y=2), call("scroll", direction="down", amount=0.5), call("click", x=3, y=4),
              call("done", response=FACT.answer)]
    traj, engine, tokenizer, _ = play(screenshot, script, keep_images=2)
    assert traj.termination_reason == "done" and traj.reward == 1.0
    # the trajectory keeps every screenshot (the judges' evidence): the first page and one after each action
    assert sum(len(m.image_urls) for m in traj.messages) == 4
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    for k, (prompt_ids, turn) in enumerate(zip(engine.prompts, turn_prefixes(traj, 2), strict=True)):
        # turn k's prompt held screenshots 0..k; the policy was shown the last 2, as the SFT prefix of turn k
        assert prompt_ids.count(image_id) == min(k + 1, 2)
        prompt = tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        assert prompt.count(IMAGE_PLACEHOLDER) == max(0, k - 1)
        sft_prompt = tokenizer.apply_chat_template(turn.openai_messages()[:-1], tools=GUI_TOOLS,
                                                   add_generation_prompt=True, tokenize=False)
        assert prompt == sft_prompt
    # without a limit every screenshot reaches the prompt
    _, engine, _, _ = play(screenshot, script)
    assert [p.count(image_id) for p in engine.prompts] == [1, 2, 3, 4]
    # the rule keeps every message that lost no image as it was (an assistant turn keeps its sampled ids)
    shown = policy_context(traj.messages, 2)
    assert all(a is b for a, b in zip(shown, traj.messages, strict=True) if not a.image_urls and not b.image_urls)
    with pytest.raises(ValueError, match="keep_images must be an int >= 0 or None"):
        GUIHarness(keep_images=-1)
    with pytest.raises(ValueError, match=r"messages\[0\] must be a Message"):
        policy_context([{"role": "user", "content": "hi"}], 1)


def test_the_recipes_rollouts_take_the_same_field_and_render_per_turn(vl_checkpoint, screenshot):
    recipe = gui_recipe()
    cfg = paper_config(vl_checkpoint, "keep_last_images=1")
    processor = load_image_processor(cfg.model)
    with SandboxClient("http://127.0.0.1:9", "unused") as client:  # nothing is asked of it here
        rollouts = recipe.policy_rollouts(cfg, client, build_chat_tokenizer(vision=True), processor, 15)
    assert rollouts.harness.keep_images == 1 and rollouts.harness.images
    assert rollouts.loop_kwargs["require_tool_call"] and rollouts.harness.max_steps == 15
    # RL trains on what the policy was shown: one sample per turn, each prefix with only its last screenshot
    samples = rollouts.render(gui_run(screenshot, 3))
    assert len(samples) == 3 and [s.image_grid_thw.tolist() for s in samples] == [[[1, 4, 4]]] * 3
    assert [int(s.mm_token_type_ids.sum()) for s in samples] == [VISION_TOKENS_PER_SHOT] * 3


# ---- K tasks per website -----------------------------------------------------------------------------------------


def test_curation_keeps_at_most_20_tasks_per_website_by_default():
    shop = [make_task("shop_price", s) for s in range(25)]
    info = [make_task("info_fact", s) for s in range(3)]
    runs = [Trajectory([Message("user", "go"), Message("assistant", None, [ToolCall("done", {"response": "1"})])],
                       GUI_TOOLS, 1.0, task_id=t.id) for t in shop + info]
    kept = curate_sft(runs, shop + info)
    assert sum(t.task_id.startswith("gui-shop_price-") for t in kept) == 20 and len(kept) == 23
    assert len(curate_sft(runs, shop + info, max_tasks_per_site=None)) == 28


# ---- the browsers' resources -------------------------------------------------------------------------------------


class RecordingClient:
    def __init__(self, backend):
        self.backend, self.created = backend, []

    def health(self):
        return {"status": "healthy", "backend": self.backend}

    def create(self, image, **kwargs):
        self.created.append(kwargs)
        raise RuntimeError("recorded")


@pytest.mark.parametrize(("backend", "cpu", "memory"), [("kubernetes", "1", "8Gi"), ("local", None, BROWSER_MEMORY)])
def test_browser_sandboxes_ask_kubernetes_for_the_papers_1_vcpu_and_8_gib(backend, cpu, memory):
    client = RecordingClient(backend)
    with pytest.raises(RuntimeError, match="recorded"):
        BrowserSession.open(client, seed=0)
    assert client.created[0]["cpu"] == cpu and client.created[0]["memory"] == memory
    with pytest.raises(RuntimeError, match="recorded"):
        BrowserSession.open(client, seed=0, cpu="2", memory="4Gi")  # a caller's own values win
    assert client.created[1]["cpu"] == "2" and client.created[1]["memory"] == "4Gi"


# ---- a turn is well formed with one or more tool calls -----------------------------------------------------------


def test_a_turn_with_several_valid_calls_is_well_formed_and_runs_them_all(screenshot):
    two = call("click", x=1, y=2) + "\n" + call("scroll", direction="down", amount=0.5)
    traj, _, _, browsers = play(screenshot, ["I will look first.", two, call("done", response=FACT.answer)])
    # the call-less turn is a format error (not the end: done is); the two calls of the next turn both ran
    assert traj.termination_reason == "done" and traj.metadata["format_errors"] == 1
    assert browsers.browsers[0].actions == ["click", "scroll"]
    assert turn_format_ok(traj) == [False, True, True]
    assert gui_rollout_reward(traj, True).reward == 0.0  # one malformed turn: not +1
    clean = Trajectory([m for m in traj.messages if not (m.role == "assistant" and not m.tool_calls)
                        and not (m.role == "tool" and m.tool_call_id is None)], GUI_TOOLS, task_id=FACT.id)
    assert turn_format_ok(clean) == [True, True] and gui_rollout_reward(clean, True).reward == 1.0


def test_every_page_a_several_call_turn_brought_is_the_sites_text():
    # the judge's grounding reads the browser's answers to well-formed turns: both answers of a two-call turn count
    def page(name):
        return Observation(b"", (64, 64), ((f"{URL}/info/", "City guide"),), 0, text=f'[cell] "{name}" @(1,1)')

    calls = [ToolCall("click", {"x": 1, "y": 1}, id="a"), ToolCall("scroll", {"direction": "down", "amount": 0.5},
                                                                  id="b")]
    traj = Trajectory([Message("user", page("start").describe()), Message("assistant", None, calls),
                       Message("tool", page("first").describe(), tool_call_id="a", name="click"),
                       Message("tool", page("second").describe(), tool_call_id="b", name="scroll")], GUI_TOOLS)
    assert site_text(traj) == ["start", "first", "second"]
