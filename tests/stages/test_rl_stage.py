"""The RL stage's policy versions, its asynchronous option, and its resume after a SIGKILL (one process and 2 gloo
ranks under ``torchrun``).

The kill-and-resume tests launch ``rl_worker.py`` (deterministic rollouts, a checkpoint after every step) three
times each: uninterrupted, SIGKILLed in a rollout of step 3, and resumed; the resumed run's final weights must be
the uninterrupted run's.
"""

from __future__ import annotations

import asyncio
import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_ranks import LAUNCH_TIMEOUT_S, WORKER, _env, _free_port, _run

from orchard.data import RenderedSample, RenderReport, Trajectory
from orchard.stages import RLConfig, RolloutConfig, rl_stage
from orchard.train.action_logprobs import action_logprobs
from orchard.train.lora import LoraConfig
from orchard.train.objective import LossTerm
from orchard.train.trainer import OptimConfig, TrainConfig, Trainer

sys.path.insert(0, str(Path(__file__).parent.parent / "train"))
from train_helpers import VOCAB, make_model


class CountingEngine:
    """Counts weight pushes (its version) and refuses one while a rollout is in flight."""

    def __init__(self) -> None:
        self.version = 0
        self.in_flight = 0

    async def update_weights(self, weights):
        assert self.in_flight == 0, "weights changed under a running rollout"
        self.version += 1


def _tokens(t: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Member j of task t: 10 random tokens (seed 1000 t + j) and its action mask, the last 5."""
    ids = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(1000 * t + j))
    return ids, torch.arange(10) >= 5


def _trajectory(t: int, ids: torch.Tensor, action: torch.Tensor, old: torch.Tensor, reward: float) -> Trajectory:
    sample = RenderedSample(ids, action, torch.where(action, 0, -1), old, action.clone(), RenderReport())
    return Trajectory(reward=reward, task_id=str(t), samples=[sample])


class VersionRollouts:
    """Member j of task t: 10 random tokens from seed 1000 t + j, the last 5 actions with sampling log-probs
    -4.57 + 0.1 j (near the tiny model's log 1/97); reward +1 when (t + j) mod 3 == 0 else -1. Records the
    engine version each call saw, and each sample's sampling log-probs by its token ids."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.sampling: dict[tuple[int, ...], torch.Tensor] = {}

    async def __call__(self, engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
        engine.in_flight += 1
        self.seen.append(engine.version)
        await asyncio.sleep(0)  # a real rollout yields to the event loop
        out = []
        for t in tasks:
            for j in range(group_size):
                ids, action = _tokens(t, j)
                old = torch.where(action, -4.57 + 0.1 * j, 0.0)
                self.sampling[tuple(ids.tolist())] = old
                out.append(_trajectory(t, ids, action, old, reward=1.0 if (t + j) % 3 == 0 else -1.0))
        engine.in_flight -= 1
        return out


def _run_stage(monkeypatch, asynchronous: bool):
    """3 steps (2 tasks x 3 members, 2 mini-batches); returns the rollouts, the history and, per optimizer step,
    (trainer step, batch, the trained policy's log-probs of the batch just before that step)."""
    calls = []
    train_step = Trainer.train_step

    def recording(self, batch):
        with torch.no_grad():
            current = action_logprobs(self.model, batch["input_ids"], batch["action_mask"],
                                      attention_mask=batch["attention_mask"])
        calls.append((self.step, dict(batch), current))
        return train_step(self, batch)

    monkeypatch.setattr(Trainer, "train_step", recording)
    rollouts, engine = VersionRollouts(), CountingEngine()
    cfg = RLConfig(steps=3, tasks_per_step=2, group_size=3, mini_batches=2, async_rollouts=asynchronous,
                   train=TrainConfig(micro_batch_size=3, optim=OptimConfig(lr=1e-2, min_lr=1e-2),
                                     objective=[LossTerm("policy", 1.0, {"tis_threshold": 2.0})]))
    history = asyncio.run(rl_stage(make_model(seed=1), engine, {"a": rollouts}, [0, 1, 2, 4, 5, 6], cfg,
                                   rollout=RolloutConfig(), pad_id=0, seed=5, output_dir=str(Path("unused"))))
    return rollouts, engine, history, calls


def test_synchronous_steps_train_on_the_policy_they_start_from(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    rollouts, engine, history, calls = _run_stage(monkeypatch, asynchronous=False)
    # Step k generates after k - 1 pushes: versions 0, 1, 2; nothing is stale, no IS weight enters the batch.
    assert rollouts.seen == [0, 1, 2] and engine.version == 3
    assert [h["rl/stale_sequences"] for h in history] == [0.0, 0.0, 0.0]
    assert all("rollout_logprobs" not in batch for _, batch, _ in calls)


def test_async_step_k_trains_on_rollouts_one_version_old_with_the_importance_correction(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    rollouts, engine, history, calls = _run_stage(monkeypatch, asynchronous=True)
    # Step 1's rollouts come first (version 0); step 2's are generated while step 1 trains (still version 0);
    # step 3's while step 2 trains, after step 1's push (version 1). Each step pushes once: 3 pushes.
    assert rollouts.seen == [0, 0, 1] and engine.version == 3
    # 2 tasks x 3 members = 6 sequences a step (every group has signal: t + j = 0 mod 3 for one j of 3).
    assert [h["rl/stale_sequences"] for h in history] == [0.0, 6.0, 6.0]
    assert [h["rl/policy_lag"] for h in history] == [0.0, 1.0, 1.0]
    assert "is/weight_mean" not in history[0] and "is/weight_mean" in history[1]
    assert [step for step, _, _ in calls] == [0, 1, 2, 3, 4, 5]  # 3 steps x 2 mini-batches
    for step, batch, current in calls[2:]:
        mask = batch["policy_mask"] if "policy_mask" in batch else batch["action_mask"] & batch["logprob_mask"]
        # The IS weight's denominator: what the engine sampled with, row by row.
        for row in range(batch["input_ids"].shape[0]):
            ids = batch["input_ids"][row, :10]
            sampled = rollouts.sampling[tuple(ids.tolist())]
            torch.testing.assert_close(batch["rollout_logprobs"][row, :10], sampled)
        if step % 2 == 0:
            # First mini-batch of the step: the ratio's anchor is the trained policy right now (pi_version),
            # not the older one that sampled.
            torch.testing.assert_close(batch["old_logprobs"][mask], current[mask], rtol=0, atol=1e-5)


def _kill_and_resume(launch, out: Path, engine: str, die_rank: int, options: list[str]) -> tuple[dict, dict]:
    """``launch()`` is a fresh launcher command line each time (its own port under torchrun)."""
    _run([*launch(), str(WORKER), str(out / "full"), engine, *options])
    proc = subprocess.run([*launch(), str(WORKER), str(out / "kill"), engine, str(die_rank), *options,
                           "--die-call", "3"], env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode != 0, "the run that should have been SIGKILLed finished"
    assert not (out / "kill" / "rank0.pt").exists()
    _run([*launch(), str(WORKER), str(out / "kill"), engine, *options, "--resume"])
    return (torch.load(out / "full" / "rank0.pt", weights_only=False),
            torch.load(out / "kill" / "rank0.pt", weights_only=False))


@pytest.mark.slow
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_process_killed_and_resumed_ends_with_the_uninterrupted_parameters(tmp_path, mode):
    """SIGKILLed in its 3rd rollout call (sync: step 3, after step 2's checkpoint; async: during step 2's training,
    after step 1's checkpoint, which holds step 2's rollouts) and resumed: bitwise the uninterrupted weights."""
    options = ["--steps", "3", *(["--async"] if mode == "async" else [])]
    full, resumed = _kill_and_resume(lambda: [sys.executable], tmp_path, "plain", 0, options)
    for name, value in full["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name
    assert [h["loss/policy"] for h in resumed["history"]] == [h["loss/policy"] for h in full["history"]]


@pytest.mark.slow
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S + 60)
def test_two_ranks_killed_and_resumed_end_with_the_uninterrupted_parameters(tmp_path, deepspeed_cpu_comm_op):
    """2 gloo ranks under torchrun, ZeRO-2; rank 1 SIGKILLs itself in step 3's rollouts and torchrun stops rank 0;
    the relaunched job resumes from step 2's checkpoint and ends with the uninterrupted job's weights."""

    def torchrun() -> list[str]:
        return [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_addr",
                "127.0.0.1", "--master_port", str(_free_port())]

    full, resumed = _kill_and_resume(torchrun, tmp_path, "deepspeed", 1, ["--steps", "3"])
    for name, value in full["weights"].items():
        # The same ranks, seeds and summation order: only the checkpoint round trip differs.
        torch.testing.assert_close(resumed["weights"][name], value, rtol=0, atol=1e-7, msg=name)
    assert [h["loss/policy"] for h in resumed["history"]] == \
        pytest.approx([h["loss/policy"] for h in full["history"]], rel=1e-6)


class TemperedRollouts:
    """Member j of task t: 10 random tokens (seed 1000 t + j), the last 5 actions with the log-probs that an engine
    sampling at ``temperature`` returns: those of ``softmax(logits / temperature)`` under ``policy``; rewards
    alternate so every group has signal."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self.temperatures: list[float] = []

    async def __call__(self, engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
        self.temperatures.append(temperature)
        out = []
        for t in tasks:
            for j in range(group_size):
                ids, action = _tokens(t, j)
                with torch.no_grad():  # greedy (temperature 0) rows carry the untempered log-probs
                    old = action_logprobs(self.policy, ids[None], action[None], temperature=temperature or 1.0)[0]
                out.append(_trajectory(t, ids, action, old, reward=1.0 if j % 2 else -1.0))
        return out


def _run_tempered(monkeypatch, temperature: float, *, steps: int = 1, asynchronous: bool = False):
    """``steps`` RL steps (2 tasks x 4 members, 2 mini-batches, policy + kl) on TemperedRollouts of the start;
    returns the rollouts and, per optimizer step, (batch, stats, the trained policy's log-probs at ``temperature``
    just before that step)."""
    model = make_model(seed=3)
    rollouts = TemperedRollouts(make_model(seed=3).eval())
    calls: list[tuple[dict, dict, torch.Tensor]] = []
    train_step = Trainer.train_step

    def recording(self, batch):
        with torch.no_grad():
            current = action_logprobs(self.model, batch["input_ids"], batch["action_mask"],
                                      attention_mask=batch["attention_mask"], temperature=temperature or 1.0)
        stats = train_step(self, batch)
        calls.append((dict(batch), stats, current))
        return stats

    monkeypatch.setattr(Trainer, "train_step", recording)
    cfg = RLConfig(steps=steps, tasks_per_step=2, group_size=4, mini_batches=2, ppo_epochs=1,
                   async_rollouts=asynchronous,
                   train=TrainConfig(micro_batch_size=4, optim=OptimConfig(lr=1e-2, min_lr=1e-2),
                                     objective=[LossTerm("policy", 1.0), LossTerm("kl", 0.1)]))
    asyncio.run(rl_stage(model, CountingEngine(), {"a": rollouts}, [0, 1, 2], cfg,
                         rollout=RolloutConfig(temperature=temperature), pad_id=0, seed=0, output_dir="out"))
    return rollouts, calls


@pytest.mark.parametrize("temperature", [0.5, 1.7, 0.0])
def test_rollouts_at_a_temperature_are_scored_at_it_so_the_first_ratio_is_one(monkeypatch, tmp_path, temperature):
    # The engine's log-probs are the tempered distribution's; the trained policy and the kl reference must score
    # the same tokens at the same temperature. Scored at 1 (the old stage), log pi_1 - log pi_T is far from 0.
    monkeypatch.chdir(tmp_path)
    rollouts, calls = _run_tempered(monkeypatch, temperature)
    assert rollouts.temperatures == [temperature]
    batch, stats, _ = calls[0]  # the first optimizer step: nothing has moved yet
    mask = batch["action_mask"]
    torch.testing.assert_close(batch["ref_logprobs"][mask], batch["old_logprobs"][mask], rtol=0, atol=1e-5)
    assert stats["ratio/min"] == pytest.approx(1.0, abs=1e-4)
    assert stats["ratio/max"] == pytest.approx(1.0, abs=1e-4)
    assert stats["kl/k1_mean"] == pytest.approx(0.0, abs=1e-5)
    # The scale is what matters: at temperature 1 the same tokens' log-probs differ from the sampler's.
    with torch.no_grad():
        untempered = action_logprobs(rollouts.policy, batch["input_ids"], mask,
                                     attention_mask=batch["attention_mask"])
    if temperature:
        assert (untempered[mask] - batch["old_logprobs"][mask]).abs().max() > 0.1


def test_a_stale_samples_anchor_is_the_current_policy_at_the_rollout_temperature(monkeypatch, tmp_path):
    # Asynchronous, step 2 trains on rollouts of version 0 after one update: its anchor (old_logprobs) is
    # recomputed from the current policy, at the rollouts' temperature like the sampler's log-probs.
    monkeypatch.chdir(tmp_path)
    _, calls = _run_tempered(monkeypatch, 0.5, steps=2, asynchronous=True)
    batch, _, current = calls[2]  # step 2's first mini-batch
    mask = batch["action_mask"]
    torch.testing.assert_close(batch["old_logprobs"][mask], current[mask], rtol=0, atol=1e-5)
    assert (batch["rollout_logprobs"][mask] - current[mask]).abs().max() > 1e-4  # the policy did move


class PlainCopyEngine(CountingEngine):
    """A peft-free copy of the policy that loads every pushed state dict by name and records, after each push, how
    far its logits on a probe are from the trained (adapted) policy's."""

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        self.policy, self.copy = policy, copy.deepcopy(policy).eval()
        self.probe = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
        self.gaps: list[float] = []

    async def update_weights(self, weights):
        await super().update_weights(weights)
        missing, unexpected = self.copy.load_state_dict(weights, strict=False)
        assert unexpected == [] and missing == ["lm_head.weight"]  # the tied lm head is the embedding
        with torch.no_grad():
            gap = self.copy(input_ids=self.probe).logits - self.policy(input_ids=self.probe).logits
        self.gaps.append(float(gap.abs().max()))


def test_with_lora_the_engine_samples_the_merged_policy_after_every_update(tmp_path):
    model = make_model(seed=1)
    start = model(input_ids=torch.arange(12)[None]).logits.detach()
    engine = PlainCopyEngine(model)
    cfg = RLConfig(steps=3, tasks_per_step=2, group_size=3, mini_batches=1,
                   train=TrainConfig(micro_batch_size=3, optim=OptimConfig(lr=1e-2, min_lr=1e-2),
                                     objective=[LossTerm("policy", 1.0)],
                                     lora=LoraConfig(enabled=True, rank=4, alpha=8.0)))
    asyncio.run(rl_stage(model, engine, {"a": VersionRollouts()}, [0, 1, 2, 4, 5, 6], cfg, rollout=RolloutConfig(),
                         pad_id=0, seed=5, output_dir=str(tmp_path / "rl")))
    assert engine.version == 3 and max(engine.gaps) < 1e-5
    # The stage closed its trainer: the model it was given is plain again, holding what the engine last got.
    state = model.state_dict()
    assert not any("lora" in name for name in state)
    assert all(torch.equal(state[n], p) for n, p in engine.copy.state_dict().items())
    assert (model(input_ids=torch.arange(12)[None]).logits - start).abs().max() > 1e-3  # the policy did move
