"""Action masks are exact with a real checkpoint's tokenizer (SmolLM2-135M-Instruct, issue 31), for every harness of
the three domains, and padding with its pad token, which is its eos, drops no action.

Each harness is driven through its real code path by a scripted policy: the Claw ReAct harness and the SWE
evaluation harness in the in-process agent loop, the Claw text harness and the SWE tool and bash conventions as
separate programs behind the recording proxy (all against the embedded sandbox service), and the GUI harness in
the agent loop with a real Chromium and a short scripted episode (one browser; the module takes about 20 s on two
cores).

"Exact" is checked independently of the renderer's own pieces: the rendered ids equal the tokenizer's ids of the
template's rendering of the whole conversation (so the turn-by-turn splice broke no token), the masked tokens form
one run per assistant message whose ids are those of that message rendered alone (content, tool-call text and the
closing ``<|im_end|>``; the template's newline after it is context), a run follows ``<|im_start|>assistant\\n`` and is
what the policy sampled, and an ``<|im_end|>`` is an action exactly when it closes an assistant turn. The prompts the
policy was given are each a prefix of the trained sequence, ending where that turn's actions start.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil

import pytest
import torch

from orchard.data import Message, Trajectory, collate, merge_prefix_samples, render_trajectory, render_turns
from orchard.models.pretrained import NotFetchedError, load_chat_tokenizer

NAME = "smollm2-135m-instruct"
OPENING = "<|im_start|>assistant\n"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer():
    try:
        tok = load_chat_tokenizer(NAME)
    except NotFetchedError:
        tok = None
    if tok is None:  # a failure, never a skip: these tests are the proof that masks are exact on a real tokenizer
        pytest.fail(f"the tokenizer of {NAME} is not fetched; fetch it with: orchard models fetch {NAME}",
                    pytrace=False)
    # the hazard these tests cover: padding written with the id of the token that ends every sampled turn
    assert tok.pad_token_id == tok.eos_token_id and tok.eos_token == "<|im_end|>"
    return tok


class Recorded:
    """An engine that answers as ``engine`` does and keeps every call's prompt ids and sampled ids."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    async def generate(self, requests):
        results = await self.engine.generate(requests)
        self.calls += [(list(r.prompt_ids), list(c.token_ids)) for r in results for c in r.completions]
        return results

    async def update_weights(self, weights):
        raise NotImplementedError

    async def close(self):
        return None


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def action_runs(mask):
    """The maximal runs of True in a [T] bool mask, as (start, stop) pairs."""
    runs, start = [], None
    for p, on in enumerate([*mask.tolist(), False]):
        if on and start is None:
            start = p
        elif not on and start is not None:
            runs.append((start, p))
            start = None
    return runs


def alone(tokenizer, message):
    """The action text of one assistant message: the template's rendering of that message alone, without the turn's
    opening and the newline after its ``<|im_end|>``."""
    text = tokenizer.apply_chat_template([message.to_openai()], tokenize=False)
    assert text.startswith(OPENING) and text.endswith(tokenizer.eos_token + "\n"), text
    return text[len(OPENING):-1]


def assert_exact(sample, traj, tokenizer, *, whole=True):
    """The sample's action mask covers exactly the assistant turns of ``traj``; ``whole``: the sample is the whole
    conversation (else a prefix that ends with the last assistant turn, as chained proxy calls are)."""
    ids, mask = sample.input_ids.tolist(), sample.action_mask
    assert sample.report.ok, sample.report
    full = encode(tokenizer, tokenizer.apply_chat_template(traj.openai_messages(), tools=traj.tools or None,
                                                           tokenize=False))
    if whole:
        assert ids == full
    else:
        assert full[: len(ids)] == ids and OPENING not in tokenizer.decode(full[len(ids):])
    assistants = [m for m in traj.messages if m.role == "assistant"]
    runs = action_runs(mask)
    assert len(runs) == len(assistants), (len(runs), len(assistants))
    opening, newline, eos = encode(tokenizer, OPENING), encode(tokenizer, "\n"), tokenizer.eos_token_id
    for k, ((a, b), message) in enumerate(zip(runs, assistants, strict=True)):
        expected = alone(tokenizer, message)
        assert tokenizer.decode(ids[a:b]) == expected and ids[a:b] == encode(tokenizer, expected), k
        assert message.token_ids is None or ids[a:b] == message.token_ids, k  # what the policy sampled
        assert ids[a - len(opening):a] == opening and ids[b:b + 1] in ([], newline), k
        assert set(sample.turn_index[a:b].tolist()) == {k}
    # an <|im_end|> is an action exactly when it closes an assistant turn
    assert [p for p, t in enumerate(ids) if t == eos and mask[p]] == [b - 1 for _, b in runs]
    assert sum(t == eos for t in ids) > len(runs)  # the system and user turns' ends are there, as context
    assert bool((sample.turn_index[~mask] == -1).all())
    assert not bool((sample.logprob_mask & ~mask).any())


def assert_prompts_are_the_context(sample, calls):
    """Every prompt the policy was given for this conversation is a prefix of the sample, and its sampled ids follow
    it there as the turn's actions."""
    ids = sample.input_ids.tolist()
    mine = sorted(len(p) for p, out in calls if ids[: len(p) + len(out)] == p + out)
    assert mine == [a for a, _ in action_runs(sample.action_mask)]


def assert_proxy_episode_exact(traj, tokenizer):
    """A harness program's episode: the proxy's per-call samples, chained, and the trajectory rendered with its
    recorded ids are all exact."""
    assert traj.termination_reason == "done", (traj.task_id, traj.metadata.get("error"))
    text_only = Trajectory([Message.from_dict(m.to_openai()) for m in traj.messages], tools=traj.tools)
    reference = render_turns(text_only, tokenizer)  # the template's ids of every turn's text
    assert len(traj.samples) == len(reference) == traj.num_steps
    for got, want in zip(traj.samples, reference, strict=True):
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.action_mask, want.action_mask)
    # each call's prompt re-sent the earlier turns token for token: the calls chain into one sequence
    [chained] = merge_prefix_samples(traj.samples)
    assert_exact(chained, traj, tokenizer, whole=False)
    rendered = render_trajectory(traj, tokenizer, on_mismatch="raise")
    assert_exact(rendered, traj, tokenizer)
    n = len(chained)
    assert torch.equal(rendered.input_ids[:n], chained.input_ids)
    assert torch.equal(rendered.action_mask[:n], chained.action_mask) and not rendered.action_mask[n:].any()
    return rendered


def sandbox_client(service):
    from orchard.env import AsyncSandboxClient, RetryPolicy

    return AsyncSandboxClient(service.url, service.api_key,
                              retry=RetryPolicy(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.01))


@pytest.fixture(scope="module")
def claw(tokenizer, embedded_service):
    """Two Claw tasks (one and three tool calls) through the ReAct harness and the text-harness program."""
    from orchard.domains.claw.harness import ClawReactHarness
    from orchard.domains.claw.tasks import make_task
    from orchard.domains.claw.teacher import TeacherEngine
    from orchard.domains.claw.text_rollout import run_text_episodes
    from orchard.rollout import AgentLoopRollouts
    from orchard.rollout.proxy import RecordingProxy

    tasks = [make_task("write_note", 3), make_task("order_flow", 3)]
    react_engine = Recorded(TeacherEngine(tokenizer, tasks))
    text_engine = Recorded(TeacherEngine(tokenizer, tasks))

    async def main():
        async with sandbox_client(embedded_service) as client:
            react = await AgentLoopRollouts(client, ClawReactHarness(), tokenizer, progress=False,
                                            start_jitter_s=0.0)(react_engine, tasks, group_size=1, temperature=1.0)
            proxy = RecordingProxy(text_engine, tokenizer)
            try:
                text = await run_text_episodes(tasks, client=client, proxy=proxy, concurrency=2, run_id="masks")
            finally:
                await proxy.aclose()
        return react, text

    react, text = asyncio.run(main())
    return {"react": react, "text": text, "react_calls": react_engine.calls, "tasks": tasks}


@pytest.fixture(scope="module")
def swe(tokenizer, embedded_service):
    """One SWE instance through the tool and bash conventions (the harness program behind the proxy) and the
    in-process evaluation harness."""
    from orchard.domains.swe.generator import make_instance
    from orchard.domains.swe.harness import SWEEvalHarness
    from orchard.domains.swe.teacher import SWETeacherEngine
    from orchard.domains.swe.tool_rollout import run_swe_episodes
    from orchard.rollout import AgentLoopRollouts
    from orchard.rollout.proxy import RecordingProxy

    instance = make_instance("ledger", 5, level=2)
    engine = Recorded(SWETeacherEngine(tokenizer, [instance], failure_rate=0.0))

    async def main():
        out = {}
        async with sandbox_client(embedded_service) as client:
            for convention in ("tool", "bash"):
                proxy = RecordingProxy(engine, tokenizer)
                try:
                    out[convention] = await run_swe_episodes([instance], client=client, proxy=proxy,
                                                             convention=convention, temperature=0.0,
                                                             max_tokens=4096)
                finally:
                    await proxy.aclose()
            calls_before = len(engine.calls)
            out["eval"] = await AgentLoopRollouts(client, SWEEvalHarness(), tokenizer, max_tokens=4096,
                                                  progress=False, start_jitter_s=0.0)(
                engine, [instance], group_size=1, temperature=0.0)
            out["eval_calls"] = engine.calls[calls_before:]
        return out

    return asyncio.run(main())


def gui_call(name, **arguments):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


@pytest.fixture(scope="module")
def gui(tokenizer, embedded_service):
    """One GUI episode in a real Chromium: a call with text before it, prose with no call (a format error, answered
    with an error observation), a call, then done."""
    if shutil.which("/usr/bin/chromium") is None or importlib.util.find_spec("playwright") is None:
        pytest.fail("the GUI harness needs chromium (apt) and playwright (the [gui] extra): run scripts/setup",
                    pytrace=False)
    from orchard.domains.gui.rollouts import gui_rollouts
    from orchard.domains.gui.tasks import make_task
    from orchard.env import SandboxClient
    from orchard.rollout.scripted import ScriptedEngine

    script = ["Let me look further down.\n" + gui_call("scroll", direction="down", amount=0.5),
              "I think the answer is on this page.",
              gui_call("scroll", direction="up", amount=0.5),
              gui_call("done", response="42")]
    engine = Recorded(ScriptedEngine(tokenizer, script, logprob=-0.25))
    with SandboxClient(embedded_service.url, embedded_service.api_key) as client:
        rollouts = gui_rollouts(client, tokenizer, max_steps=6, concurrency=1, start_jitter_s=0.0, progress=False,
                                seed=0)
        [traj] = asyncio.run(rollouts(engine, [make_task("info_fact", 5)], group_size=1, temperature=1.0))
    return {"traj": traj, "calls": engine.calls}


def test_claw_react_harness_masks_are_exact(claw, tokenizer):
    for traj, task in zip(claw["react"], claw["tasks"], strict=True):
        assert traj.termination_reason == "done" and traj.num_tool_calls == len(task.plan), traj.metadata
        [sample] = traj.samples
        assert_exact(sample, traj, tokenizer)
        assert_prompts_are_the_context(sample, claw["react_calls"])
        # the sampling log-probs (the teacher's 0.0) sit on every action token and nowhere else
        assert bool(sample.logprob_mask.eq(sample.action_mask).all())


def test_claw_text_harness_masks_are_exact(claw, tokenizer):
    for traj, task in zip(claw["text"], claw["tasks"], strict=True):
        assert traj.tools == [] and traj.num_steps == len(task.plan) + 1
        assert_proxy_episode_exact(traj, tokenizer)


@pytest.mark.parametrize("convention", ["tool", "bash"])
def test_swe_harness_program_masks_are_exact(swe, tokenizer, convention):
    [traj] = swe[convention]
    assert traj.reward == 1.0 and traj.metadata["harness"] == convention
    assert bool(traj.tools) == (convention == "tool")
    assert_proxy_episode_exact(traj, tokenizer)


def test_swe_eval_harness_masks_are_exact(swe, tokenizer):
    [traj] = swe["eval"]
    assert traj.termination_reason == "done" and traj.reward == 1.0, traj.metadata
    [sample] = traj.samples
    assert_exact(sample, traj, tokenizer)
    assert_prompts_are_the_context(sample, swe["eval_calls"])


def test_gui_harness_masks_are_exact(gui, tokenizer):
    traj = gui["traj"]
    assert traj.termination_reason == "done" and traj.metadata["format_errors"] == 1, traj.metadata
    turns = [m for m in traj.messages if m.role == "assistant"]
    assert turns[0].content and turns[0].tool_calls and not turns[1].tool_calls  # text + call, then prose only
    [sample] = traj.samples
    assert_exact(sample, traj, tokenizer)
    assert_prompts_are_the_context(sample, gui["calls"])
    assert torch.allclose(sample.old_logprobs[sample.action_mask], torch.tensor(-0.25))


def test_padding_with_the_eos_id_keeps_every_sampled_eos_an_action(claw, swe, gui, tokenizer):
    trajs = [*claw["react"], *claw["text"], swe["tool"][0], swe["bash"][0], swe["eval"][0], gui["traj"]]
    samples = [render_trajectory(t, tokenizer) for t in trajs]
    lengths = [len(s) for s in samples]
    assert len(set(lengths)) == len(lengths)  # lengths differ: every row but the longest is padded
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    advantages = [0.5 + b for b in range(len(samples))]
    batch = collate(samples, pad, advantages=advantages, pad_to_multiple_of=8)
    T = batch["input_ids"].shape[1]
    assert T % 8 == 0 and T - 8 < max(lengths) <= T
    for b, (sample, traj) in enumerate(zip(samples, trajs, strict=True)):
        n = len(sample)
        assert batch["attention_mask"][b].tolist() == [1] * n + [0] * (T - n)
        assert batch["input_ids"][b, :n].tolist() == sample.input_ids.tolist()
        assert set(batch["input_ids"][b, n:].tolist()) == {pad}  # the padding is eos ids...
        assert not batch["action_mask"][b, n:].any() and bool((batch["turn_index"][b, n:] == -1).all())
        # ...yet every eos the policy sampled (the last token of each action run) stays an attended action with
        # its row's advantage
        ends = [stop - 1 for _, stop in action_runs(batch["action_mask"][b])]
        assert len(ends) == traj.num_steps and bool((batch["input_ids"][b, ends] == eos).all())
        assert bool(batch["attention_mask"][b, ends].eq(1).all())
        assert torch.allclose(batch["advantages"][b, ends], torch.tensor(advantages[b]))
        assert torch.equal(batch["action_mask"][b, :n], sample.action_mask)
    # telling padding by its id would have dropped them: the attended eos actions are pad ids
    sampled_eos = (batch["input_ids"] == pad) & batch["action_mask"]
    assert int(sampled_eos.sum()) == sum(t.num_steps for t in trajs)
    assert bool(batch["attention_mask"].bool()[sampled_eos].all())
