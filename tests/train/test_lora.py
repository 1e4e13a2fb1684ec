"""LoRA through peft as a trainer option: only the adapters learn, the weights that leave the trainer are the merged
``W + (alpha / r) · B A`` under the base names (what a plain model of the adapted policy computes), closing the
trainer leaves the caller's model a plain merged model whose checkpoint loads, the adapters' gradients are the
chain rule through the merged weight for every micro-batch split, and
bad settings are errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_helpers import make_batch, make_model

from orchard.losses import sft_loss
from orchard.train.config import ConfigError, load_config
from orchard.train.lora import LORA_TARGETS, LoraConfig, merged_weights
from orchard.train.model import load_causal_lm, save_causal_lm
from orchard.train.trainer import OptimConfig, TrainConfig, Trainer

RANK, ALPHA = 4, 12.0  # s = alpha / rank = 3


def _cfg(tmp_path: Path, micro: int = 7, **lora) -> TrainConfig:
    return TrainConfig(total_steps=3, global_batch_size=7, micro_batch_size=micro, output_dir=str(tmp_path),
                       optim=OptimConfig(lr=2e-2, min_lr=2e-2, eps=1e-6, grad_clip=None),
                       lora=LoraConfig(enabled=True, rank=RANK, alpha=ALPHA, **lora))


def _logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def _trained(tmp_path: Path, micro: int = 7, steps: int = 2, **lora) -> tuple[torch.nn.Module, Trainer]:
    model = make_model(seed=3)
    trainer = Trainer(model, _cfg(tmp_path, micro, **lora))
    for s in range(steps):
        trainer.train_step(make_batch(7, 15, seed=20 + s))
    return model, trainer


def test_only_the_adapters_get_gradients_and_change(tmp_path: Path) -> None:
    model = make_model(seed=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model, _cfg(tmp_path))
    assert trainer.model is model  # adapted in place: the caller's object is the policy in training
    trainer.accumulate_gradients(make_batch(7, 15, seed=1))
    named = dict(model.named_parameters())
    adapters = {n for n in named if ".lora_A." in n or ".lora_B." in n}
    # q, k, v, o, gate, up, down in each of the tiny model's 2 layers, an A and a B each
    assert len(adapters) == 2 * len(LORA_TARGETS) * 2
    assert {n for n, p in named.items() if p.grad is not None} == adapters
    # B starts at 0, so only B's gradient is non-zero on the first step (dL/dA = s · B^T (...) = 0)
    assert all(named[n].grad.abs().sum() > 0 for n in adapters if ".lora_B." in n)
    trainer.engine.step()
    trainer.train_step(make_batch(7, 15, seed=2))
    for name, param in model.named_parameters():
        if name in adapters:
            continue
        base = name.replace(".base_layer", "")
        assert torch.equal(param.detach(), before[base]), name
    assert all(named[n].detach().abs().sum() > 0 for n in adapters if ".lora_B." in n)
    trainer.close()


def test_full_state_dict_is_the_merged_weights_under_the_base_names(tmp_path: Path) -> None:
    handed = []
    model = make_model(seed=3)
    names = [n for n, _ in model.named_parameters()]
    trainer = Trainer(model, _cfg(tmp_path), on_weights=lambda step, sd: handed.append(sd))
    for s in range(2):
        trainer.train_step(make_batch(7, 15, seed=20 + s))
    merged = trainer.full_state_dict()
    assert list(merged) == names  # the plain model's names, in its order
    params = dict(model.named_parameters())
    for target in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        W = params[target + ".base_layer.weight"]
        A, B = params[target + ".lora_A.default.weight"], params[target + ".lora_B.default.weight"]
        assert B.abs().max() > 1e-3  # trained away from its zero start, so the check below has something to see
        torch.testing.assert_close(merged[target + ".weight"], (W + (ALPHA / RANK) * B @ A).detach())
    assert torch.equal(merged["model.norm.weight"], params["model.norm.weight"])
    assert set(handed[-1]) == set(merged)
    assert all(torch.equal(handed[-1][n], merged[n]) for n in merged)  # the engine gets the same merged weights
    # A plain model holding the merged weights computes the adapted model's logits.
    plain = make_model(seed=99)
    plain.load_state_dict(merged, strict=False)  # the tied lm head is the embedding, listed once
    batch = make_batch(3, 15, seed=7)
    torch.testing.assert_close(_logits(plain, batch), _logits(model, batch), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(_logits(make_model(seed=3), batch), _logits(model, batch), atol=1e-3)
    trainer.close()


def test_close_leaves_a_plain_merged_model_whose_checkpoint_loads(tmp_path: Path) -> None:
    model, trainer = _trained(tmp_path / "run")
    batch = make_batch(3, 15, seed=8)
    adapted = _logits(model, batch)
    merged = trainer.full_state_dict()
    trainer.close()
    state = model.state_dict()
    assert not any("lora" in n or "base_layer" in n for n in state)
    assert set(state) == set(make_model().state_dict())
    assert all(p.requires_grad for p in model.parameters())  # trainable again, as it was handed in
    assert all(torch.equal(state[n], merged[n]) for n in merged)
    torch.testing.assert_close(_logits(model, batch), adapted, rtol=1e-5, atol=1e-5)
    save_causal_lm(model, tmp_path / "policy")
    loaded = load_causal_lm(tmp_path / "policy", attn_implementation="eager")
    torch.testing.assert_close(_logits(loaded, batch), adapted, rtol=1e-5, atol=1e-5)


def test_frozen_parameters_stay_frozen_after_close(tmp_path: Path) -> None:
    model = make_model(seed=3)
    model.model.embed_tokens.weight.requires_grad_(False)
    trainer = Trainer(model, _cfg(tmp_path))
    trainer.close()
    assert not model.model.embed_tokens.weight.requires_grad
    assert model.model.norm.weight.requires_grad


def _sft_reference(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The SFT objective on the whole batch from full logits: mean NLL over the action tokens."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    lp = torch.nn.functional.pad(lp, (1, 0)).float()  # [B, T]: log p(x_t | x_<t)
    return sft_loss(lp, batch["action_mask"])[0]


@pytest.mark.parametrize("micro", [7, 3, 1])
def test_adapter_gradients_are_the_chain_rule_through_the_merged_weight(tmp_path: Path, micro: int) -> None:
    # h = W' x with W' = W + s · B A, so dL/dB = s · G A^T and dL/dA = s · B^T G, where G = dL/dW' is the gradient
    # of a plain model holding the merged weights; the same for every micro-batch split.
    model = make_model(seed=3)
    trainer = Trainer(model, _cfg(tmp_path, micro))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B away from its zero start, so that A gets a gradient too
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))
    batch = make_batch(7, 15, seed=4)
    trainer.accumulate_gradients(batch)
    plain = make_model(seed=99)
    plain.load_state_dict(trainer.full_state_dict(), strict=False)
    _sft_reference(plain, batch).backward()
    G = dict(plain.named_parameters())
    params = dict(model.named_parameters())
    s = ALPHA / RANK
    for target in [n.removesuffix(".lora_A.default.weight") for n in params if n.endswith(".lora_A.default.weight")]:
        A, B = params[target + ".lora_A.default.weight"], params[target + ".lora_B.default.weight"]
        grad_W = G[target + ".weight"].grad  # [out, in]
        torch.testing.assert_close(B.grad, s * grad_W @ A.detach().T, rtol=1e-4, atol=1e-6, msg=target)
        torch.testing.assert_close(A.grad, s * B.detach().T @ grad_W, rtol=1e-4, atol=1e-6, msg=target)
    trainer.close()


def test_merged_weights_names_missing_parts() -> None:
    W, A, B = torch.ones(3, 2), torch.ones(1, 2), torch.full((3, 1), 0.5)
    # W + 2 · B A = 1 + 2 · 0.5 · 1 = 2 everywhere
    out = merged_weights([("m.base_layer.weight", W), ("m.base_layer.bias", torch.zeros(3)),
                          ("m.lora_A.default.weight", A), ("m.lora_B.default.weight", B)], {"m": 2.0})
    assert set(out) == {"m.weight", "m.bias"} and torch.equal(out["m.weight"], torch.full((3, 2), 2.0))
    with pytest.raises(ValueError, match=r"'m': \['B'\]"):
        merged_weights([("m.base_layer.weight", W), ("m.lora_A.default.weight", A)], {"m": 2.0})


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"rank": 0}, "rank must be an int >= 1"),
    ({"rank": 2.0}, "rank must be an int >= 1"),
    ({"alpha": 0}, "alpha must be a finite number > 0"),
    ({"alpha": float("inf")}, "alpha must be a finite number > 0"),
    ({"dropout": 1.0}, r"dropout must be a number in \[0, 1\)"),
    ({"target_modules": []}, "target_modules must be a non-empty list"),
    ({"target_modules": ["q_proj", "q_proj"]}, "target_modules must not repeat"),
    ({"enabled": "yes"}, "enabled must be a bool"),
])
def test_bad_lora_settings_name_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LoraConfig(**kwargs)


def test_bad_lora_settings_from_yaml_name_the_dotted_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^lora\.rank must be an int >= 1"):
        load_config(TrainConfig, None, ["lora.rank=0"])
    with pytest.raises(ConfigError, match=r"^lora\.enabled needs the plain engine or ZeRO-2"):
        load_config(TrainConfig, None, ["lora.enabled=true", "engine=deepspeed", "zero_stage=3"])
    cfg = load_config(TrainConfig, None, ["lora.enabled=true", "lora.target_modules=[q_proj, v_proj]"])
    assert cfg.lora == LoraConfig(enabled=True, target_modules=["q_proj", "v_proj"])


@pytest.mark.parametrize(("targets", "match"), [
    (["q_proj", "qkv"], r"target_modules: \['qkv'\] match no module"),
    (["q_norm"], r"'q_norm' matches 'model.layers.0.self_attn.q_norm', a Qwen3RMSNorm, not a linear layer"),
    (["lm_head"], r"'lm_head' matches 'lm_head', whose weight another module shares"),
])
def test_targets_that_cannot_be_adapted_are_named(tmp_path: Path, targets: list[str], match: str) -> None:
    assert make_model().config.tie_word_embeddings  # the tiny model's lm head is its embedding
    with pytest.raises(ValueError, match=match):
        Trainer(make_model(), _cfg(tmp_path, target_modules=targets))


def test_a_model_that_still_carries_adapters_is_refused(tmp_path: Path) -> None:
    model = make_model()
    Trainer(model, _cfg(tmp_path / "a"))
    with pytest.raises(ValueError, match="model already carries LoRA adapters"):
        Trainer(model, _cfg(tmp_path / "b"))
