"""On-policy distillation through the engine interface: the teacher's log-probs on the student's tokens, aligned
to ``action_mask``, and the RL stage feeding them to the OPD objective terms."""

import asyncio
import copy

import pytest
import torch

from orchard.data import RenderedSample, RenderReport, Trajectory, collate
from orchard.losses import js_opd_loss
from orchard.rollout.engine import ScoreRequest
from orchard.rollout.hf_engine import HFEngine
from orchard.stages import RLConfig, RolloutConfig, rl_stage
from orchard.stages import rl as rl_module
from orchard.stages.distill import check_teacher, teacher_logprobs
from orchard.train.action_logprobs import action_logprobs
from orchard.train.objective import LossTerm
from orchard.train.tiny import tiny_qwen3
from orchard.train.trainer import OptimConfig, TrainConfig, Trainer

VOCAB = 97


def _model(seed: int) -> torch.nn.Module:
    return tiny_qwen3(VOCAB, seed=seed, attn_implementation="eager")


def _sample(ids, action) -> RenderedSample:
    ids, action = torch.tensor(ids), torch.tensor(action, dtype=torch.bool)
    return RenderedSample(ids, action, torch.where(action, 0, -1), torch.zeros(len(ids)), action.clone(),
                          RenderReport())


class ByIdScorer:
    """A teacher whose log-prob of token ``c`` is ``-c / 10``, whatever precedes it; records its requests."""

    def __init__(self) -> None:
        self.requests: list[ScoreRequest] = []

    async def score(self, requests):
        self.requests += requests
        return [[-c / 10 for c in r.completion_ids] for r in requests]


def test_teacher_logprobs_placed_on_action_tokens_hand_computed():
    # two turns with an observation (14) between them; a sample without actions; padding to T = 6
    samples = [_sample([10, 11, 12, 13, 14, 15], [0, 0, 1, 1, 0, 1]),
               _sample([20, 21, 22], [0, 0, 0]),
               _sample([30, 31], [0, 1])]
    teacher = ByIdScorer()
    out = asyncio.run(teacher_logprobs(teacher, samples))
    # row 0 asks prompt [10, 11], completion [12, 13, 14, 15] -> [-1.2, -1.3, -1.4, -1.5], 14 masked to 0
    # row 1 asks nothing; row 2 asks prompt [30], completion [31] -> -3.1
    assert [(r.prompt_ids, r.completion_ids) for r in teacher.requests] == [((10, 11), (12, 13, 14, 15)),
                                                                             ((30,), (31,))]
    want = torch.tensor([[0, 0, -1.2, -1.3, 0, -1.5], [0] * 6, [0, -3.1, 0, 0, 0, 0]])
    torch.testing.assert_close(out, want)
    assert out.shape == collate(samples, 0)["action_mask"].shape
    assert asyncio.run(teacher_logprobs(teacher, samples, length=8)).shape == (3, 8)


def _random_samples(seed: int, count: int) -> list[RenderedSample]:
    """Random sequences of 9-15 tokens: a prompt of 3, a first turn, an observation of 2, a second turn."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(count):
        n = int(torch.randint(9, 16, (1,), generator=gen))
        ids = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        cut = 3 + (n - 3) // 2
        action = [0, 0, 0] + [1] * (cut - 3) + [0, 0] + [1] * (n - cut - 2)
        samples.append(_sample(ids, action))
    return samples


def _forward_reference(model, samples) -> torch.Tensor:
    """The teacher's log-probs by a plain forward of the collated batch: position t scores token t from t - 1."""
    batch = collate(samples, 0)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logp_BT = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    out = torch.zeros(batch["input_ids"].shape)
    out[:, 1:] = logp_BT
    return out * batch["action_mask"]


def test_teacher_logprobs_equal_a_forward_pass_and_a_shift_does_not():
    teacher_model = _model(seed=3)
    samples = _random_samples(seed=0, count=5)
    got = asyncio.run(teacher_logprobs(HFEngine(teacher_model, max_batch_size=2), samples))
    want = _forward_reference(teacher_model, samples)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # the comparison can see an off-by-one: each token scored one position late differs by far more than 1e-5
    mask = collate(samples, 0)["action_mask"]
    late = torch.zeros_like(want)
    late[:, 1:] = want[:, :-1]
    assert ((late - want).abs() * mask).max() > 1e-2


def test_check_teacher_names_the_argument():
    policy, js = [LossTerm("policy")], [LossTerm("policy"), LossTerm("js_opd", 1.0, {"lam": 0.5})]
    student, teacher = HFEngine(_model(0)), HFEngine(_model(1))
    check_teacher(teacher, student, js)
    check_teacher(None, student, policy)
    for bad, objective, match in [(None, js, "js_opd"), (student, js, "separate model"),
                                  (object(), js, "score"), (teacher, policy, "no OPD|has none")]:
        with pytest.raises(ValueError, match=f"teacher.*({match})"):
            check_teacher(bad, student, objective)
    with pytest.raises(ValueError, match="teacher"):
        asyncio.run(teacher_logprobs(object(), _random_samples(0, 1)))
    with pytest.raises(ValueError, match=r"samples\[0\].action_mask"):
        asyncio.run(teacher_logprobs(teacher, [_sample([1, 2], [1, 1])]))
    with pytest.raises(ValueError, match="length"):
        asyncio.run(teacher_logprobs(teacher, [_sample([1, 2, 3], [0, 1, 1])], length=2))


class FixedRollouts:
    """Every member of every task: the samples of `_random_samples` (seeded by task and member); rewards alternate
    +1 / -1 so every group trains."""

    async def __call__(self, engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
        return [Trajectory(reward=1.0 if j % 2 else -1.0, task_id=str(t),
                           samples=_random_samples(seed=100 * t + j, count=1))
                for t in tasks for j in range(group_size)]


class WeightsEngine:
    async def update_weights(self, weights):
        pass


def _one_opd_step(student, teacher, tmp_path) -> dict[str, float]:
    cfg = RLConfig(steps=1, tasks_per_step=2, group_size=2, mini_batches=1, train=TrainConfig(
        micro_batch_size=8, optim=OptimConfig(lr=1e-3, min_lr=1e-4),
        objective=[LossTerm("policy", 1.0, {"eps_low": 0.2, "eps_high": 0.28}),
                   LossTerm("js_opd", 1.0, {"lam": 0.5})]))
    [stats] = asyncio.run(rl_stage(student, WeightsEngine(), {"a": FixedRollouts()}, [0, 1], cfg,
                                   rollout=RolloutConfig(), pad_id=0, seed=0, output_dir=str(tmp_path),
                                   teacher=teacher))
    return stats


def test_rl_step_with_js_opd_reads_the_teachers_logprobs(tmp_path):
    torch.manual_seed(0)
    # the batch of the one step: tasks 0 and 1, two members each (the loss is a token mean: order is moot)
    samples = [s for t in (0, 1) for j in range(2) for s in _random_samples(seed=100 * t + j, count=1)]
    batch = collate(samples, 0)
    student = _model(seed=1)
    with torch.no_grad():
        student_lp = action_logprobs(student, batch["input_ids"], batch["action_mask"],
                                     attention_mask=batch["attention_mask"])

    same = _one_opd_step(copy.deepcopy(student), HFEngine(copy.deepcopy(student)), tmp_path / "same")
    # the student scored by its own weights: log(pi / M) = 0 at every token, so the JS surrogate is 0
    assert abs(same["loss/js_opd"]) < 1e-6

    teacher_model = _model(seed=7)
    other = _one_opd_step(copy.deepcopy(student), HFEngine(teacher_model), tmp_path / "other")
    want, _ = js_opd_loss(student_lp, _forward_reference(teacher_model, samples), batch["action_mask"])
    assert other["loss/js_opd"] == pytest.approx(float(want), abs=1e-6)
    assert abs(other["loss/js_opd"]) > 1e-3


def test_rl_stage_refuses_an_opd_objective_without_a_separate_teacher(tmp_path):
    engine = WeightsEngine()
    cfg = RLConfig(steps=1, tasks_per_step=1, group_size=2, train=TrainConfig(
        objective=[LossTerm("policy"), LossTerm("k3_opd")]))
    with pytest.raises(ValueError, match=r"teacher.*k3_opd"):
        asyncio.run(rl_stage(_model(1), engine, {"a": FixedRollouts()}, [0], cfg, rollout=RolloutConfig(),
                             pad_id=0, seed=0, output_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="teacher must be a separate model"):
        asyncio.run(rl_stage(_model(1), engine, {"a": FixedRollouts()}, [0], cfg, rollout=RolloutConfig(),
                             pad_id=0, seed=0, output_dir=str(tmp_path), teacher=engine))


def test_teacher_rows_follow_the_shuffled_mini_batches(tmp_path, monkeypatch):
    # 3 tasks x 2 members = 6 samples in 3 mini-batches of 2, over 2 PPO epochs: seed 1 shuffles them (checked
    # below), so a teacher row taken by position instead of by sample lands on another sample's tokens.
    batches, given = [], []
    real_step, real_train_batch = Trainer.train_step, rl_module._train_batch

    def spy_step(self, batch):
        batches.append({k: batch[k].clone() for k in ("input_ids", "attention_mask", "action_mask",
                                                      "teacher_logprobs")})
        return real_step(self, batch)

    def spy_train_batch(trainer, reference, samples, *args):
        given.extend(tuple(s.input_ids.tolist()) for s in samples)
        return real_train_batch(trainer, reference, samples, *args)

    monkeypatch.setattr(Trainer, "train_step", spy_step)
    monkeypatch.setattr(rl_module, "_train_batch", spy_train_batch)
    cfg = RLConfig(steps=1, tasks_per_step=3, group_size=2, mini_batches=3, ppo_epochs=2, train=TrainConfig(
        micro_batch_size=8, optim=OptimConfig(lr=1e-3, min_lr=1e-4),
        objective=[LossTerm("policy"), LossTerm("k3_opd", 1.0)]))
    asyncio.run(rl_stage(_model(1), WeightsEngine(), {"a": FixedRollouts()}, [0, 1, 2], cfg,
                         rollout=RolloutConfig(), pad_id=0, seed=1, output_dir=str(tmp_path), teacher=ByIdScorer()))
    assert len(given) == 6 and len(batches) == 6 and all(len(b["input_ids"]) == 2 for b in batches)
    # ByIdScorer gives token c the log-prob -c / 10: a row [.., 42 (action), 17 (observation)] must read
    # [.., -4.2, 0] whatever rows the shuffle put beside it
    for b in batches:
        torch.testing.assert_close(b["teacher_logprobs"], -b["input_ids"] / 10 * b["action_mask"])
    # the shuffle is not the identity: each epoch's rows, in order, are a permutation of the batch but not its order
    rows = [tuple(r[m.bool()].tolist())
            for b in batches for r, m in zip(b["input_ids"], b["attention_mask"], strict=True)]
    for epoch in (rows[:6], rows[6:]):
        assert sorted(epoch) == sorted(given) and epoch != given


def test_opd_teacher_by_url_and_the_cpu_teachers_refusals():
    from orchard.data.tokenizer import build_chat_tokenizer
    from orchard.rollout.openai_engine import OpenAIEngine
    from orchard.stages import OPDTeacherConfig, SFTConfig, opd_teacher

    tokenizer = build_chat_tokenizer()
    served = opd_teacher(OPDTeacherConfig(url="http://teacher:8000/v1", model="big", tokenizer="tiny"), tokenizer)
    assert isinstance(served, OpenAIEngine) and not OPDTeacherConfig(path="/m").trained_here
    cpu = OPDTeacherConfig(hidden_size=48)
    assert cpu.trained_here
    with pytest.raises(ValueError, match="a CPU teacher is trained only beside a tiny student"):
        opd_teacher(cpu, tokenizer, student_hidden_size=None)
    with pytest.raises(ValueError, match=r"larger than the tiny student \(hidden_size 48 <= the student's 48\)"):
        opd_teacher(cpu, tokenizer, student_hidden_size=48)
    # no resolved trajectory to learn from: refused before any model is made
    failed = [Trajectory(task_id="a", reward=-1.0)]
    with pytest.raises(ValueError, match="resolved trajectories and there are none"):
        opd_teacher(cpu, tokenizer, failed, sft=SFTConfig(), student_hidden_size=32, output_dir="unused")
    with pytest.raises(ValueError, match="tokenizer must name the served teacher's tokenizer when url is set"):
        OPDTeacherConfig(url="http://teacher:8000/v1")
