"""`fold_temperature`: the folded model's logits are the original's / T (so its log-softmax at 1.0 is the
original's at T), for tied and untied embeddings; models where the fold is not exact are refused."""

import math

import pytest
import torch
from transformers import GemmaConfig, GemmaForCausalLM

from orchard.models import fold_temperature, tiny_qwen3

IDS = torch.tensor([[5, 17, 3, 88, 41, 2, 60], [9, 9, 100, 7, 1, 33, 12]])


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits  # [B, T, V]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("temperature", [0.3, 0.75, 2.0])
def test_folded_logits_are_the_originals_over_the_temperature(tied, temperature):
    model = tiny_qwen3(128, seed=3, tie_word_embeddings=tied).eval()
    before, norm = logits(model), model.model.norm.weight.detach().clone()
    fold_temperature(model, temperature)
    after = logits(model)
    torch.testing.assert_close(after, before / temperature, rtol=1e-5, atol=1e-5)
    # Sampling the folded model at 1.0 is sampling the original at T: the same log-softmax.
    torch.testing.assert_close(after.log_softmax(-1), (before / temperature).log_softmax(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.model.norm.weight, norm / temperature)
    # Only the norm moved: with tied embeddings the head is the embedding, untouched.
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_folding_twice_multiplies_the_temperatures():
    # 0.5 then 0.8: the logits are divided by 0.5 x 0.8 = 0.4 (a fold composes; it does not reset the weight)
    model = tiny_qwen3(128, seed=0).eval()
    before = logits(model)
    fold_temperature(model, 0.5)
    fold_temperature(model, 0.8)
    torch.testing.assert_close(logits(model), before / 0.4, rtol=1e-5, atol=1e-5)


def test_bfloat16_weights_are_rounded_once():
    # A weight of 1.0 divided by 0.3 is 3.333...; bfloat16 keeps 8 significant bits, a step of 2 / 128 = 1 / 64 in
    # [2, 4): 3.333... x 64 = 213.3 rounds to 213, and 213 / 64 = 3.328125.
    model = tiny_qwen3(128, seed=0).to(torch.bfloat16)
    fold_temperature(model, 0.3)
    assert model.model.norm.weight.dtype == torch.bfloat16
    assert model.model.norm.weight.float().unique().tolist() == [213 / 64]


@pytest.mark.parametrize("temperature", [0, -1.0, math.inf, math.nan, True, "0.5", None])
def test_a_temperature_that_is_not_finite_and_positive_is_refused(temperature):
    model = tiny_qwen3(128, seed=0)
    norm = model.model.norm.weight.detach().clone()
    with pytest.raises(ValueError, match=r"^temperature must be a finite number > 0, got "):
        fold_temperature(model, temperature)
    assert torch.equal(model.model.norm.weight, norm)  # nothing changed


def test_a_head_with_a_bias_is_refused():
    model = tiny_qwen3(128, seed=0, tie_word_embeddings=False)
    model.lm_head = torch.nn.Linear(model.config.hidden_size, 128, bias=True)
    with pytest.raises(ValueError, match=r"^model\.lm_head has a bias"):
        fold_temperature(model, 0.5)


def test_a_model_without_a_final_norm_weight_is_refused():
    model = tiny_qwen3(128, seed=0)
    model.model.norm = torch.nn.Identity()
    with pytest.raises(ValueError, match=r"^model.model.norm must have a weight tensor .*got Identity"):
        fold_temperature(model, 0.5)


def test_a_final_norm_with_a_bias_is_refused():
    model = tiny_qwen3(128, seed=0)
    model.model.norm = torch.nn.LayerNorm(model.config.hidden_size)
    with pytest.raises(ValueError, match=r"^model\.model\.norm has a bias"):
        fold_temperature(model, 0.5)


def test_a_partitioned_norm_weight_is_refused():
    # ZeRO-3 leaves an empty placeholder where the weight was: dividing it would fold nothing.
    model = tiny_qwen3(128, seed=0)
    model.model.norm.weight = torch.nn.Parameter(torch.empty(0))
    with pytest.raises(ValueError, match=r"^model.model.norm.weight must have shape \(64,\) .* got \(0,\)"):
        fold_temperature(model, 0.5)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("final_logit_softcapping", 30.0, "model soft-caps its logits"),
    ("logit_scale", 0.0625, "model scales its logits"),
    ("logits_scaling", 8.0, "model scales its logits"),
])
def test_logit_capping_or_scaling_in_the_config_is_refused(key, value, message):
    model = tiny_qwen3(128, seed=0)
    setattr(model.config, key, value)
    with pytest.raises(ValueError, match=f"^{message} \\(config.{key}={value}\\)"):
        fold_temperature(model, 0.5)


def test_a_scale_of_one_folds():
    # logit_scale 1.0 multiplies nothing: the fold stays exact.
    model = tiny_qwen3(128, seed=0).eval()
    model.config.logit_scale = 1.0
    before = logits(model)
    fold_temperature(model, 0.5)
    torch.testing.assert_close(logits(model), before * 2, rtol=1e-5, atol=1e-5)


def test_other_architectures_are_refused():
    # Gemma's norm is (1 + weight) * h / rms(h) and it scales embeddings: dividing the weight is not 1 / T.
    gemma = GemmaForCausalLM(GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    with pytest.raises(ValueError, match=r"^model must be a transformers causal LM .* got "
                                         r"transformers.models.gemma.modeling_gemma.GemmaForCausalLM"):
        fold_temperature(gemma, 0.5)

    class Wrapped(torch.nn.Module):  # a wrapper (DeepSpeed engine, PEFT) around a foldable model
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    with pytest.raises(ValueError, match=r"^model must be a transformers causal LM .*Wrapped"):
        fold_temperature(Wrapped(tiny_qwen3(128, seed=0)), 0.5)
