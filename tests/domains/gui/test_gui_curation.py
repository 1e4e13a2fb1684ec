"""SFT curation of the teacher's GUI rollouts: the shortest success per task, at most K tasks per website, and one
target assistant turn per serialized prefix (exact masks, images trimmed per prefix)."""

import base64

import pytest

from orchard.data import Message, ToolCall, Trajectory
from orchard.data.tokenizer import build_chat_tokenizer
from orchard.domains.gui.curation import curate_sft, sft_turn_samples, site_of, turn_prefixes
from orchard.domains.gui.tasks import make_task
from orchard.domains.gui.tools import GUI_TOOLS, IMAGE_PLACEHOLDER

# shop_price and multi_price start on the shop, form_booking on the forms site, info_fact on the information site
TASKS = [make_task("shop_price", 0), make_task("multi_price", 0), make_task("form_booking", 0),
         make_task("info_fact", 0)]


def attempt(task, steps, reward, *, removed=None, images=False):
    """A teacher attempt: `steps` scrolls then done; screenshot k after scroll k when images."""
    def page(k):
        text = {"type": "text", "text": f"page {k}"}
        data = base64.b64encode(f"shot-{k}".encode()).decode()
        return [text, {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}] if images \
            else f"page {k}"

    messages = [Message("system", "You operate a browser."), Message("user", page(0))]
    for k in range(1, steps + 1):
        messages.append(Message("assistant", None, tool_calls=[ToolCall("scroll", {"direction": "down",
                                                                                    "amount": 0.5}, id=f"c{k}")]))
        messages.append(Message("tool", page(k), tool_call_id=f"c{k}", name="scroll"))
    messages.append(Message("assistant", None, tool_calls=[ToolCall("done", {"response": "42"}, id="end")]))
    metadata = {"removed": removed} if removed else {}
    return Trajectory(messages, GUI_TOOLS, reward, task_id=task.id, metadata=metadata)


def test_site_of():
    assert [site_of(t) for t in TASKS] == ["shop", "shop", "forms", "info"]
    with pytest.raises(ValueError, match="task must be a GUITask"):
        site_of("shop")


def test_the_shortest_success_per_task_then_k_per_site():
    shop_a = [attempt(TASKS[0], 6, 1.0), attempt(TASKS[0], 2, 0.0), attempt(TASKS[0], 4, 1.0),
              attempt(TASKS[0], 3, None, removed="captcha_blocked")]
    shop_b = [attempt(TASKS[1], 5, 1.0), attempt(TASKS[1], 5, 1.0), attempt(TASKS[1], 1, 0.0),
              attempt(TASKS[1], 1, 1.0, removed="judge_failure")]
    forms = [attempt(TASKS[2], 2, 0.0)] * 4  # never solved: absent
    info = [attempt(TASKS[3], 3, 1.0), attempt(TASKS[3], 9, 1.0), attempt(TASKS[3], 3, 1.0), attempt(TASKS[3], 1, 0.0)]
    trajs = shop_a + shop_b + forms + info
    kept = curate_sft(trajs, TASKS)
    # shop_a: successes of 7 and 5 turns (steps + done) -> the 5-turn one (index 2); the 2-turn one failed and the
    # 4-turn one was removed. shop_b: two 6-turn successes tie -> the first; the removed 2-turn "success" does not
    # count. info: 4, 10, 4 turns -> the first 4-turn one.
    assert [trajs.index(t) for t in kept] == [2, 4, 12]
    assert all(t is trajs[i] for t, i in zip(kept, [2, 4, 12], strict=True))
    # K = 1 per website: one of the two shop tasks, the info task; K = 0 keeps nothing
    one = curate_sft(trajs, TASKS, max_tasks_per_site=1, seed=3)
    assert len(one) == 2 and {site_of(next(t for t in TASKS if t.id == x.task_id)) for x in one} == {"shop", "info"}
    assert one == curate_sft(trajs, TASKS, max_tasks_per_site=1, seed=3)  # seeded
    assert curate_sft(trajs, TASKS, max_tasks_per_site=0) == []
    assert curate_sft([], TASKS) == []
    with pytest.raises(ValueError, match="tasks has no task for"):
        curate_sft(trajs, TASKS[:1])
    with pytest.raises(ValueError, match="max_tasks_per_site must be an int >= 0"):
        curate_sft(trajs, TASKS, max_tasks_per_site=-1)


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


def test_one_target_turn_per_prefix(tokenizer):
    traj = attempt(TASKS[0], 2, 1.0)  # scroll, scroll, done: 3 assistant turns
    samples = sft_turn_samples([traj], tokenizer)
    assert len(samples) == 3
    for k, (sample, i) in enumerate(zip(samples, traj.assistant_indices, strict=True)):
        prompt = tokenizer.apply_chat_template(traj.openai_messages()[:i], tools=GUI_TOOLS,
                                               add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        # the prefix is context only; every supervised token is turn k's, and they follow the prefix
        assert sample.input_ids[:len(prompt_ids)].tolist() == prompt_ids
        assert not sample.action_mask[:len(prompt_ids)].any() and sample.action_mask[len(prompt_ids):].all()
        assert set(sample.turn_index[sample.action_mask].tolist()) == {k}
        target = tokenizer.decode(sample.input_ids[sample.action_mask].tolist())
        assert ("done" in target) == (k == 2) and ("scroll" in target) == (k < 2)


def test_images_are_trimmed_per_prefix(tokenizer):
    traj = attempt(TASKS[0], 4, 1.0, images=True)  # screenshots 0..4; turns 0..4 (4 scrolls + done)
    turns = turn_prefixes(traj, 2)
    assert len(turns) == 5
    # the prompt of turn k (its prefix: screenshots 0..k) keeps images k-1 and k; earlier ones are placeholders
    for k, turn in enumerate(turns):
        assert len(turn.messages) == 3 + 2 * k and turn.messages[-1] == traj.messages[len(turn.messages) - 1]
        parts = [part for m in turn.messages if isinstance(m.content, list) for part in m.content]
        kept = [base64.b64decode(p["image_url"]["url"].split(",", 1)[1]).decode() for p in parts
                if p["type"] == "image_url"]
        assert kept == [f"shot-{j}" for j in range(max(0, k - 1), k + 1)]
        assert sum(p.get("text") == IMAGE_PLACEHOLDER for p in parts) == max(0, k - 1)
    # rendered without a processor, screenshots are refused rather than dropped silently
    with pytest.raises(ValueError, match="no processor was given"):
        sft_turn_samples([traj], tokenizer, keep_images=2)
    with pytest.raises(ValueError, match="keep_images must be an int >= 0"):
        sft_turn_samples([traj], tokenizer, keep_images=-1)
