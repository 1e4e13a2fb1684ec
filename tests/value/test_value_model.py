"""ValueModel: save / load round trip, loading from a causal-LM checkpoint, step values; the historical pool;
and value training on a synthetic pool whose outcome is written in the trajectory, reranked against random."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from orchard.data import Trajectory, render_trajectory
from orchard.data.tokenizer import build_chat_tokenizer
from orchard.train.tiny import tiny_qwen3, tiny_qwen3_config
from orchard.value import ValueModel, build_value_pool
from orchard.value.train import evaluate_reranking, train_value_model, value_loss, value_targets
from orchard.value.windows import value_windows


def _batch(B: int = 3, T: int = 11, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (B, T), generator=gen)
    att = torch.ones(B, T, dtype=torch.long)
    att[1, 7:] = 0
    return ids, att


def test_save_load_round_trip(tmp_path: Path) -> None:
    vm = ValueModel.from_config(tiny_qwen3_config(97), seed=3)
    ids, att = _batch()
    with torch.no_grad():
        before = vm(ids, att)
    assert before.shape == (3, 11) and torch.isfinite(before).all()
    vm.save_pretrained(tmp_path / "vm")
    loaded = ValueModel.from_pretrained(tmp_path / "vm")
    with torch.no_grad():
        after = loaded(ids, att)
    assert torch.equal(before, after)
    for (n1, p1), (n2, p2) in zip(vm.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_from_causal_lm_checkpoint_keeps_backbone_weights(tmp_path: Path) -> None:
    lm = tiny_qwen3(97, seed=5, tie_word_embeddings=False)
    lm.save_pretrained(tmp_path / "lm")
    vm = ValueModel.from_pretrained(tmp_path / "lm", seed=1)
    for name, p in lm.model.state_dict().items():
        assert torch.equal(vm.backbone.state_dict()[name], p), name
    ids, att = _batch()
    with torch.no_grad():
        hidden = lm.model(input_ids=ids, attention_mask=att).last_hidden_state
        expected = hidden @ vm.value_head.weight[0] + vm.value_head.bias[0]
        torch.testing.assert_close(vm(ids, att), expected)
    # The same from an in-memory model, and the head is seeded.
    assert torch.equal(ValueModel.from_causal_lm(lm, seed=1).value_head.weight, vm.value_head.weight)


def test_step_values_read_last_token_of_each_step() -> None:
    vm = ValueModel.from_config(tiny_qwen3_config(97), seed=0)
    ids, _ = _batch(B=2, T=8)
    ti = torch.tensor([[-1, 0, 0, -1, 1, 1, 1, -1], [-1, -1, 0, 0, 0, -1, -1, -1]])
    with torch.no_grad():
        token_v = vm(ids, torch.ones_like(ids))
        step_v, mask = vm.step_values(ids, torch.ones_like(ids), ti)
    assert mask.tolist() == [[True, True], [True, False]]
    assert step_v.tolist() == [[token_v[0, 2].item(), token_v[0, 6].item()], [token_v[1, 4].item(), 0.0]]


def test_value_loss_hand_computed_and_clipped() -> None:
    v = torch.tensor([[1.0, 2.0, 9.0]], requires_grad=True)
    r = torch.tensor([[0.0, 2.0, 0.0]])
    m = torch.tensor([[True, True, False]])
    loss, met = value_loss(v, r, m)
    # 0.5 * ((1-0)^2 + 0) / 2 = 0.25
    assert float(loss.detach()) == pytest.approx(0.25) and float(met["value/mse"]) == pytest.approx(0.5)
    loss.backward()
    assert v.grad.tolist() == [[0.5, 0.0, 0.0]]
    # Clipped: old 0.5, eps 0.2 -> clip(1.0) = 0.7; max(1, 0.49) = 1 -> same loss.
    loss_c, _ = value_loss(v, r, m, old_values=torch.tensor([[0.5, 2.0, 0.0]]), clip_range=0.2)
    assert float(loss_c.detach()) == pytest.approx(0.25)
    # Where the clip binds: target 2, old 0.5, V 1.0 -> clip(V) = 0.7; max((1-2)^2, (0.7-2)^2) = max(1, 1.69)
    # = 1.69, so the loss is 0.5 * (1.69 + 0) / 2 = 0.4225 and V gets no gradient (the clamp is saturated).
    # A value_loss that ignored old_values would give 0.5 * 1 / 2 = 0.25 and gradient -0.5.
    v_b = torch.tensor([[1.0, 2.0, 9.0]], requires_grad=True)
    loss_b, _ = value_loss(v_b, torch.tensor([[2.0, 2.0, 0.0]]), m, old_values=torch.tensor([[0.5, 2.0, 0.0]]),
                           clip_range=0.2)
    assert float(loss_b.detach()) == pytest.approx(0.4225)
    loss_b.backward()
    assert v_b.grad.tolist() == [[0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="clip_range"):
        value_loss(v, r, m, clip_range=0.2)


def _traj(task: str, reward: float | None, *, word: str, reason: str = "done") -> Trajectory:
    return Trajectory(
        messages=[
            {"role": "user", "content": f"task {task}: fix it"},
            {"role": "assistant", "content": "looking"},
            {"role": "tool", "content": "output of a tool", "tool_call_id": "c"},
            {"role": "assistant", "content": word},
        ],
        reward=reward,
        task_id=task,
        termination_reason=reason,
    )


def test_pool_keeps_verified_caps_and_balances() -> None:
    trajs = [_traj("a", 1.0, word="x") for _ in range(6)] + [_traj("a", 0.0, word="x") for _ in range(2)]
    trajs += [_traj("b", 0.0, word="x") for _ in range(5)]
    trajs += [_traj("c", None, word="x"), _traj("c", 1.0, word="x", reason="env_error")]
    pool = build_value_pool(trajs, max_per_task=4, seed=0)
    assert all(t.reward is not None and t.termination_reason != "env_error" for t in pool)
    assert sum(t.task_id == "a" for t in pool) <= 4 and sum(t.task_id == "b" for t in pool) <= 4
    # Task a keeps 2 wins + 2 losses (alternating), task b 4 losses: 2 wins vs 6 losses -> balanced to 2 + 2.
    wins = [t for t in pool if t.reward > 0.5]
    assert len(wins) == 2 and len(pool) == 4
    assert build_value_pool(trajs, max_per_task=4, seed=0) == pool  # deterministic
    unbalanced = build_value_pool(trajs, max_per_task=4, balance=False, seed=0)
    assert len(unbalanced) == 8
    with pytest.raises(ValueError, match="max_per_task"):
        build_value_pool(trajs, max_per_task=0)


@pytest.mark.slow
def test_value_training_reranks_better_than_random() -> None:
    # The outcome is visible in the last assistant turn ("pass" or "fail"); a trained value head should read it
    # and pick a passing candidate far more often than random choice on held-out groups.
    torch.manual_seed(0)
    tok = build_chat_tokenizer(["pass fail looking task fix it"])
    rng = random.Random(0)

    def sample(task: str) -> Trajectory:
        ok = rng.random() < 0.4
        return _traj(task, 1.0 if ok else 0.0, word="pass" if ok else "fail")

    train = [sample(f"t{i}") for i in range(48)]
    held = [sample(f"h{i}") for i in range(12) for _ in range(4)]
    pool = build_value_pool(train, max_per_task=4, seed=0)
    render = [render_trajectory(t, tok) for t in pool]
    vm = ValueModel.from_causal_lm(tiny_qwen3(tok, seed=0), seed=0)
    hist = train_value_model(vm, render, pad_id=tok.pad_token_id, steps=40, batch_size=8, lr=3e-3, seed=0)
    assert hist[-1]["value/mse"] < hist[0]["value/mse"]
    rep = evaluate_reranking(vm, [render_trajectory(t, tok) for t in held], pad_id=tok.pad_token_id)
    assert rep["rerank/groups"] == 12 and rep["rerank/n"] == 4
    assert rep["rerank/success"] >= rep["rerank/oracle"] - 1e-9 > rep["rerank/random"]


def _steps_traj(n_steps: int, reward: float) -> Trajectory:
    messages = [{"role": "system", "content": "you fix bugs"}, {"role": "user", "content": "task t: fix it"}]
    for k in range(n_steps):
        messages.append({"role": "assistant", "content": f"looking at part {k} of the repository"})
        messages.append({"role": "tool", "content": "output of a tool " * 3, "tool_call_id": "c"})
    return Trajectory(messages=messages, reward=reward, task_id="t", termination_reason="done")


def _zero_value_model(tok) -> ValueModel:
    vm = ValueModel.from_causal_lm(tiny_qwen3(tok, seed=0), seed=0)
    with torch.no_grad():
        vm.value_head.weight.zero_()
        vm.value_head.bias.zero_()
    return vm


def test_truncated_trajectory_never_looks_finished() -> None:
    # Five steps, outcome 1, and a context that ends right after step 3 (index 2). With V = 0 everywhere,
    # δ_t = r_t and A_t = δ_t + γλ A_{t+1}, γλ = .98 * .95 = .931: the returns are .931^(4 - t) =
    # [.7513, .8069, .8668, .931, 1.0]. Cutting the first max_len tokens made step 3 terminal instead:
    # [.8668, .931, 1.0, 0, 0].
    tok = build_chat_tokenizer(["you fix bugs looking at part of the repository output a tool task t fix it"])
    full = render_trajectory(_steps_traj(5, 1.0), tok)
    step_end = [int((full.turn_index == k).nonzero().max()) for k in range(5)]
    max_len = step_end[2] + 3  # ends inside the tool output after step 3
    assert max_len < len(full)
    returns, values, mask = value_targets(_zero_value_model(tok), [full], pad_id=tok.pad_token_id, max_len=max_len)
    assert mask.tolist() == [[True] * 5] and values.abs().max() == 0
    expected = [0.931**4, 0.931**3, 0.931**2, 0.931, 1.0]
    torch.testing.assert_close(returns[0].double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    # A sample cut at rendering is refused: its last visible step would be trained as final.
    cut = render_trajectory(_steps_traj(5, 1.0), tok, max_len=max_len)
    with pytest.raises(ValueError, match="max_len=None"):
        value_targets(_zero_value_model(tok), [cut], pad_id=tok.pad_token_id)


def test_monte_carlo_values_replace_the_gae_targets_they_cover() -> None:
    # Five steps, outcome -1 (an SWE failure), V = 0: the GAE returns are -.931^(4 - t). Monte-Carlo values of
    # states 2 and 4 (0.75 and 0.25) are the targets of steps 1 and 3 (read after the action that leads there), in
    # SWE reward units: -1 + 2 * 0.75 = 0.5 and -1 + 2 * 0.25 = -0.5. The second trajectory has none.
    tok = build_chat_tokenizer(["you fix bugs looking at part of the repository output a tool task t fix it"])
    samples = [render_trajectory(_steps_traj(5, -1.0), tok), render_trajectory(_steps_traj(5, -1.0), tok)]
    vm = _zero_value_model(tok)
    gae_only, _, _ = value_targets(vm, samples, pad_id=tok.pad_token_id)
    returns, _, mask = value_targets(vm, samples, pad_id=tok.pad_token_id, step_targets=[{2: 0.75, 4: 0.25}, None],
                                     reward_range=(-1.0, 1.0))
    gae_row = [-(0.931**4), -(0.931**3), -(0.931**2), -0.931, -1.0]
    expected = torch.tensor([[gae_row[0], 0.5, gae_row[2], -0.5, gae_row[4]], gae_row], dtype=torch.float64)
    torch.testing.assert_close(returns.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gae_only[1], returns[1])
    assert mask.all()
    with pytest.raises(ValueError, match="one entry per sample"):
        value_targets(vm, samples, pad_id=tok.pad_token_id, step_targets=[{2: 0.75}])
    # training regresses on them: one step on the two samples runs and moves the values
    history = train_value_model(vm, samples, pad_id=tok.pad_token_id, steps=2, batch_size=2, lr=1e-2,
                                step_targets=[{2: 0.75, 4: 0.25}, None], reward_range=(-1.0, 1.0))
    assert history[0]["value/mse"] > 0 and history[1]["value/mean"] != history[0]["value/mean"]


@pytest.mark.parametrize("n_steps, max_len", [(5, 40), (5, 61), (7, 90), (3, 300), (6, 25)])
def test_value_windows_read_every_step_once(n_steps: int, max_len: int) -> None:
    tok = build_chat_tokenizer(["you fix bugs looking at part of the repository output a tool task t fix it"])
    full = render_trajectory(_steps_traj(n_steps, 0.0), tok)
    windows = value_windows(full, max_len=max_len)
    head = min(int((full.turn_index >= 0).nonzero()[0, 0]), max_len // 2)
    read = [k for w in windows for k in w.turn_index[w.turn_index >= 0].unique().tolist()]
    assert sorted(read) == list(range(n_steps))  # every step read, and in one window only
    for w in windows:
        assert len(w) <= max_len and torch.equal(w.input_ids[:head], full.input_ids[:head])
        assert torch.equal(w.action_mask, w.turn_index >= 0)
    # A sample that fits is returned as it is; else the last window ends at the last step's last token.
    if len(full) <= max_len:
        assert windows == [full]
    else:
        last_end = int((full.turn_index == n_steps - 1).nonzero().max())
        assert torch.equal(windows[-1].input_ids[-(max_len - head):], full.input_ids[last_end + 1 - (max_len - head) : last_end + 1])
    with pytest.raises(ValueError, match="max_len"):
        value_windows(full, max_len=1)


def test_value_windows_step_longer_than_the_window_is_read_at_its_end() -> None:
    tok = build_chat_tokenizer(["you fix bugs looking at part of the repository output a tool task t fix it"])
    traj = _steps_traj(2, 1.0)
    traj.messages[2].content = "looking " * 60
    full = render_trajectory(traj, tok)
    windows = value_windows(full, max_len=30)
    assert [w.turn_index[w.turn_index >= 0].unique().tolist() for w in windows] == [[0], [1]]
    assert all(len(w) == 30 for w in windows)


def test_value_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from orchard.data import write_jsonl
    from orchard.train.metrics import read_jsonl_metrics
    from orchard.value.cli import main

    tok = build_chat_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    tiny_qwen3(tok, seed=0).save_pretrained(tmp_path / "lm")
    pool = [_traj(f"t{i % 3}", float(i % 2), word="pass" if i % 2 else "fail") for i in range(9)]
    pool.append(_traj("t0", 1.0, word="x", reason="env_error"))
    write_jsonl(pool, tmp_path / "pool.jsonl")
    write_jsonl([_traj(f"h{i // 3}", float(i % 3 == 0), word="w") for i in range(6)], tmp_path / "held.jsonl")
    status = main([f"data={tmp_path / 'pool.jsonl'}", f"tokenizer={tmp_path / 'tok'}", f"model={tmp_path / 'lm'}",
                   f"output_dir={tmp_path / 'out'}", f"eval_data={tmp_path / 'held.jsonl'}", "steps=2",
                   "batch_size=4", "lr=1e-4", "max_len=24"])
    assert status == 0
    report = dict(line.split("\t") for line in capsys.readouterr().out.splitlines())
    # 2 held-out tasks of 3 candidates, one success each: random = 1/3, oracle = 1.
    assert float(report["rerank/groups"]) == 2 and float(report["rerank/n"]) == 3
    assert float(report["rerank/random"]) == pytest.approx(1 / 3, abs=1e-4) and float(report["rerank/oracle"]) == 1
    rows = read_jsonl_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 2] and "value/loss" in rows[0]
    assert isinstance(ValueModel.from_pretrained(tmp_path / "out" / "model"), ValueModel)
