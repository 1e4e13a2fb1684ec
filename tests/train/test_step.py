"""The training step: its gradient equals the whole-batch objective written out by hand, for every micro-batch
split; the full step (clip, AdamW, schedule) is split-invariant; model loading; objective validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_helpers import VOCAB, make_batch, make_model

from orchard.losses import js_opd_loss, kl_penalty, policy_loss, sft_loss
from orchard.train.model import best_attn_implementation, load_causal_lm
from orchard.train.objective import LOSS_TERMS, LossTerm, objective_loss
from orchard.train.tiny import tiny_qwen3_config
from orchard.train.trainer import DataCursor, OptimConfig, TrainConfig, Trainer, split_batch

OBJECTIVE = [
    LossTerm("policy", 1.0, {"eps_low": 0.2, "eps_high": 0.28}),
    LossTerm("sft", 0.5),
    LossTerm("credit_sft", 0.25),
    LossTerm("js_opd", 0.1, {"lam": 0.5}),
    LossTerm("kl", 0.05),
]


def _cfg(tmp_path: Path, micro: int, **kw) -> TrainConfig:
    return TrainConfig(total_steps=3, global_batch_size=7, micro_batch_size=micro, output_dir=str(tmp_path),
                       objective=OBJECTIVE, optim=OptimConfig(lr=1e-3, min_lr=1e-4, eps=1e-6, grad_clip=0.5), **kw)


def _reference_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The objective on the whole batch, from full logits, every loss with its own token mean."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    lp = torch.nn.functional.pad(lp, (1, 0)).float()  # [B, T]: log p(x_t | x_<t)
    a = batch["action_mask"]
    pg, _ = policy_loss(lp, batch["old_logprobs"], batch["advantages"], a, eps_low=0.2, eps_high=0.28)
    sft, _ = sft_loss(lp, a)
    credit, _ = sft_loss(lp, batch["sft_mask"])
    js, _ = js_opd_loss(lp, batch["teacher_logprobs"], a, lam=0.5)
    kl, _ = kl_penalty(lp, batch["ref_logprobs"], a, kind="k3+")
    return pg + 0.5 * sft + 0.25 * credit + 0.1 * js + 0.05 * kl


@pytest.mark.parametrize("micro", [7, 3, 2, 1])
def test_gradient_equals_whole_batch_objective(tmp_path: Path, micro: int) -> None:
    batch = make_batch(7, 19, seed=4)
    ref_model = make_model(seed=2)
    _reference_loss(ref_model, batch).backward()
    trainer = Trainer(make_model(seed=2), _cfg(tmp_path, micro))
    metrics = trainer.accumulate_gradients(batch)
    for (name, p), (_, q) in zip(ref_model.named_parameters(), trainer.model.named_parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        assert metrics["loss/total"] == pytest.approx(float(_reference_loss(ref_model, batch)), rel=1e-5)


def test_full_step_is_split_invariant(tmp_path: Path) -> None:
    results = []
    for micro in (7, 2):
        trainer = Trainer(make_model(seed=2), _cfg(tmp_path / str(micro), micro))
        rows = [trainer.train_step(make_batch(7, 19, seed=10 + s)) for s in range(2)]
        results.append((rows, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}))
        trainer.close()
    (rows0, state0) = results[0]
    for rows, state in results[1:]:
        for r0, r in zip(rows0, rows, strict=True):
            for key in ("loss/total", "loss/policy", "grad_norm", "lr", "clip/low_frac", "sft/nll", "tokens/action"):
                assert r[key] == pytest.approx(r0[key], rel=1e-5, abs=1e-7), key
        for name in state0:
            torch.testing.assert_close(state[name], state0[name], rtol=0, atol=1e-5, msg=name)


def test_step_logs_and_hands_weights(tmp_path: Path) -> None:
    handed = []
    trainer = Trainer(make_model(seed=0), _cfg(tmp_path, 4),
                      on_weights=lambda step, sd: handed.append((step, sd)))
    out = trainer.train_step(make_batch(7, 13, seed=0))
    assert out["lr"] == pytest.approx(1e-3) and out["batch/sequences"] == 7
    assert {"grad_norm", "loss/total", "perf/tokens_per_s", "tokens/total", "opd/js"} <= set(out)
    step, sd = handed[0]
    assert step == 1 and set(sd) == {n for n, _ in trainer.model.named_parameters()}
    assert all(torch.equal(sd[n], p.detach()) for n, p in trainer.model.named_parameters())
    trainer.close()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_objective_errors_name_what_is_missing(tmp_path: Path) -> None:
    batch = make_batch(3, 9, seed=0)
    del batch["teacher_logprobs"]
    trainer = Trainer(make_model(), _cfg(tmp_path, 2))
    with pytest.raises(ValueError, match="needs batch key 'teacher_logprobs'"):
        trainer.train_step(batch)
    with pytest.raises(ValueError, match=r"objective\[0\]\.name must be one of \['sft', 'credit_sft', 'policy', "):
        objective_loss([LossTerm("grpo")], torch.zeros(1, 2), batch, {})
    assert {"sft", "policy", "js_opd"} <= set(LOSS_TERMS.names())


def test_split_batch_trims_right_padding() -> None:
    batch = make_batch(4, 12, seed=1)
    batch["attention_mask"][1:3, 8:] = 0
    part = split_batch(batch, slice(1, 3))
    assert part["input_ids"].shape == (2, int(batch["attention_mask"][1:3].sum(1).max()))
    assert part["advantages"].shape == part["input_ids"].shape


def test_data_cursor_resumes_the_same_order() -> None:
    a = DataCursor(5, seed=1)
    first = a.next_indices(3) + a.next_indices(3)  # crosses into epoch 1
    assert sorted(first[:5]) == [0, 1, 2, 3, 4]
    b = DataCursor(5, seed=1)
    b.next_indices(3)
    c = DataCursor(5, seed=1)
    c.load_state_dict(b.state_dict())
    assert c.next_indices(3) == first[3:]
    with pytest.raises(ValueError, match="num_samples"):
        DataCursor(0, seed=0)


def test_fit_trains_until_total_steps(tmp_path: Path) -> None:
    samples = [make_batch(1, 11, seed=s) for s in range(5)]

    def collate(items: list[dict]) -> dict:
        return {k: torch.cat([it[k] for it in items]) for k in items[0]}

    cfg = _cfg(tmp_path, 2)
    cfg.global_batch_size = 2
    trainer = Trainer(make_model(), cfg)
    rows = trainer.fit(samples, collate)
    assert len(rows) == 3 and trainer.step == 3 and trainer.cursor is not None
    assert trainer.cursor.state_dict()["position"] == 1 and trainer.cursor.state_dict()["epoch"] == 1


def test_load_causal_lm_from_config_and_path(tmp_path: Path) -> None:
    cfg = tiny_qwen3_config(VOCAB)
    m = load_causal_lm(cfg, seed=4, attn_implementation="eager")
    assert m.training and next(m.parameters()).dtype == torch.float32
    m.save_pretrained(tmp_path / "ckpt")
    again = load_causal_lm(tmp_path / "ckpt", dtype="bfloat16")
    assert next(again.parameters()).dtype == torch.bfloat16
    assert best_attn_implementation() in ("sdpa", "flash_attention_2")
    with pytest.raises(ValueError, match="dtype"):
        load_causal_lm(cfg, dtype="float16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="source"):
        load_causal_lm(tmp_path / "missing")


def test_gradient_checkpointing_keeps_the_gradient() -> None:
    batch = make_batch(2, 9, seed=0)
    grads = []
    for ckpt in (False, True):
        m = load_causal_lm(tiny_qwen3_config(VOCAB), seed=1, attn_implementation="eager", gradient_checkpointing=ckpt)
        assert m.is_gradient_checkpointing == ckpt
        out = m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.sum()
        out.backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    torch.testing.assert_close(grads[0], grads[1])


def test_policy_term_skips_tokens_without_sampling_logprob(tmp_path: Path) -> None:
    # Rendering marks action tokens whose sampling log-prob is unknown (logprob_mask False); the policy term must
    # neither count them nor read their old_logprobs, which may hold anything.
    batch = make_batch(5, 17, seed=8)
    known = batch["action_mask"].clone()
    known[:, ::3] = False
    batch["logprob_mask"] = known
    batch["old_logprobs"] = torch.where(known, batch["old_logprobs"], torch.full_like(batch["old_logprobs"], 1e4))
    model = make_model(seed=1)
    cfg = _cfg(tmp_path, 2)
    cfg.objective = [LossTerm("policy")]
    metrics = Trainer(model, cfg).accumulate_gradients(batch)
    with torch.no_grad():
        ref = make_model(seed=1)
        logits = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        lp = torch.nn.functional.pad(
            torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0], (1, 0))
        expected, _ = policy_loss(lp, batch["old_logprobs"], batch["advantages"], known & batch["action_mask"])
    assert metrics["loss/policy"] == pytest.approx(float(expected), rel=1e-5)
    assert abs(metrics["loss/policy"]) < 100  # the 1e4 placeholders never entered


def test_max_min_metrics_ignore_micro_batches_without_tokens(tmp_path: Path) -> None:
    # Rows 0-1 have no action token, so with micro=2 the first micro-batch reports placeholder ratios (1.0);
    # the combined ratio/max and ratio/min must still be the whole batch's.
    batch = make_batch(7, 15, seed=3)
    for key in ("action_mask", "sft_mask"):
        batch[key][:2] = False
    got = {}
    for micro in (7, 2):
        cfg = _cfg(tmp_path / str(micro), micro)
        cfg.objective = [LossTerm("policy")]
        got[micro] = Trainer(make_model(seed=1), cfg).accumulate_gradients(batch)
    for key in ("ratio/max", "ratio/min", "ratio/mean", "loss/policy"):
        assert got[2][key] == pytest.approx(got[7][key], rel=1e-5), key
    assert got[7]["ratio/max"] != pytest.approx(1.0)


def test_fit_resumes_with_the_data_cursor(tmp_path: Path) -> None:
    # 5 steps in one go vs 3 steps, then a fresh Trainer on the same output_dir asked for 5: the resumed run
    # must draw the same batches (cursor restored mid-epoch) and land on the same weights and metrics.
    samples = [make_batch(1, 9 + s % 4, seed=s) for s in range(7)]

    def collate(items: list[dict]) -> dict:
        T = max(it["input_ids"].shape[1] for it in items)
        return {k: torch.cat([torch.nn.functional.pad(it[k], (0, T - it[k].shape[1])) for it in items])
                for k in items[0]}

    def run(out: Path, steps: int) -> tuple[list[dict], dict]:
        cfg = _cfg(out, 2, checkpoint_every=1)
        cfg.global_batch_size, cfg.total_steps = 3, 5
        trainer = Trainer(make_model(seed=4), cfg)
        rows = []
        while trainer.step < steps:
            # One step per fit() call (fit stops at cfg.total_steps; the schedule was built for 5), so the
            # cursor is also carried from call to call within a run.
            cfg.total_steps = trainer.step + 1
            rows += trainer.fit(samples, collate)
        trainer.close()
        return rows, {k: v.clone() for k, v in trainer.model.state_dict().items()}

    full_rows, full_state = run(tmp_path / "full", 5)
    run(tmp_path / "split", 3)
    resumed_rows, resumed_state = run(tmp_path / "split", 5)
    assert len(resumed_rows) == 2
    for a, b in zip(full_rows[3:], resumed_rows, strict=True):
        assert a["loss/total"] == b["loss/total"] and a["tokens/total"] == b["tokens/total"]
    for name, value in full_state.items():
        assert torch.equal(value, resumed_state[name]), name


def test_lr_multipliers_scale_the_named_parameters_only(tmp_path: Path) -> None:
    from orchard.train.trainer import param_groups

    model = make_model()
    optim = OptimConfig(lr=1e-3, min_lr=1e-3, weight_decay=0.1, lr_multipliers={r"^model\.norm\.weight$": 30.0})
    groups = param_groups(model, optim)
    final_norm = dict(model.named_parameters())["model.norm.weight"]
    by_param = {id(p): g for g in groups for p in g["params"]}
    assert by_param[id(final_norm)]["lr"] == pytest.approx(3e-2)
    assert by_param[id(final_norm)]["weight_decay"] == 0.0
    others = [p for n, p in model.named_parameters() if n != "model.norm.weight"]
    assert all(by_param[id(p)]["lr"] == pytest.approx(1e-3) for p in others)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    # Through the trainer: after one step the scheduled lr of that group is the factor times the others'.
    trainer = Trainer(model, TrainConfig(total_steps=2, global_batch_size=2, micro_batch_size=2, optim=optim,
                                         output_dir=str(tmp_path), objective=[LossTerm("sft")]))
    trainer.train_step(make_batch(2, 12, seed=0))
    lrs = sorted({round(g["lr"], 12) for g in trainer.engine.optimizer.param_groups})
    assert lrs == pytest.approx([1e-3, 3e-2])
    trainer.close()


@pytest.mark.parametrize("multipliers, match", [({"(": 2.0}, "invalid regex"), ({"norm": 0.0}, "positive"),
                                                ({"no_such_param": 2.0}, "match no trainable")])
def test_lr_multipliers_errors_name_the_setting(multipliers: dict[str, float], match: str) -> None:
    from orchard.train.trainer import param_groups

    with pytest.raises(ValueError, match=match) as err:
        param_groups(make_model(), OptimConfig(lr_multipliers=multipliers))
    assert "lr_multipliers" in str(err.value)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_forward_logprobs_names_a_bad_temperature(bad):
    from orchard.train.trainer import LogprobModel, forward_logprobs

    batch = make_batch(2, 8, seed=0)
    batch["scored_mask"] = batch["action_mask"]
    with pytest.raises(ValueError, match="temperature"):
        forward_logprobs(LogprobModel(make_model()), batch, temperature=bad)


def test_forward_logprobs_at_a_temperature_divides_the_logits():
    from orchard.train.trainer import LogprobModel, forward_logprobs

    model = make_model(seed=2).eval()
    batch = make_batch(2, 8, seed=1)
    batch["scored_mask"] = batch["action_mask"]
    with torch.no_grad():
        got = forward_logprobs(LogprobModel(model), batch, temperature=0.6)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        want = torch.log_softmax(logits[:, :-1] / 0.6, dim=-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["action_mask"][:, 1:]
    torch.testing.assert_close(got[:, 1:][mask], want[mask], rtol=1e-4, atol=1e-4)
