"""Freezing a vision-language model's vision encoder and projector (the paper's GUI training)."""

import pytest
import torch

from orchard.models.tiny import tiny_qwen3_config
from orchard.train.model import freeze_vision_tower, load_causal_lm
from orchard.train.trainer import OptimConfig, param_groups


@pytest.fixture(scope="module")
def config(tiny_vl):
    return tiny_vl[0].config


def _grid_batch(model):
    # One 32 x 32 image as 2 x 2 patches of 16 (3 x 2 x 16 x 16 = 1536 values each) merged 2 x 2 into 1 token.
    image = model.config.image_token_id
    ids = torch.tensor([[1, 5, model.config.vision_start_token_id, image, model.config.vision_end_token_id, 7, 8]])
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=torch.randn(4, 1536),
                image_grid_thw=torch.tensor([[1, 2, 2]]), mm_token_type_ids=(ids == image).long())


@pytest.mark.parametrize("freeze", [False, True])
def test_frozen_vision_gets_no_gradient_and_the_language_model_does(config, freeze):
    model = load_causal_lm(config, freeze_vision=freeze, seed=1)
    assert model.training
    out = model(**_grid_batch(model))
    out.logits[:, -2].log_softmax(-1)[0, 8].neg().backward()
    vision = {n: p for n, p in model.named_parameters() if n.startswith("model.visual.")}
    language = {n: p for n, p in model.named_parameters() if not n.startswith("model.visual.")}
    # The projector (the 2 x 2 merger and the DeepStack merger) belongs to the frozen part.
    assert "model.visual.merger.linear_fc2.weight" in vision and "model.visual.deepstack_merger_list.0.norm.weight" in vision
    assert all(p.requires_grad != freeze for p in vision.values())
    if freeze:
        assert all(p.grad is None for p in vision.values())
    else:
        assert vision["model.visual.patch_embed.proj.weight"].grad.abs().sum() > 0
    assert all(p.requires_grad for p in language.values())
    assert language["model.language_model.layers.0.mlp.up_proj.weight"].grad.abs().sum() > 0
    # The optimizer gets exactly the trainable parameters.
    trained = {id(p) for group in param_groups(model, OptimConfig()) for p in group["params"]}
    assert trained == {id(p) for p in (language.values() if freeze else model.parameters())}


def test_freeze_counts_and_refuses_a_text_model(config):
    model = load_causal_lm(config)
    expected = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.visual."))
    assert freeze_vision_tower(model) == expected > 0
    assert freeze_vision_tower(model) == 0  # already frozen
    with pytest.raises(ValueError, match="no vision encoder"):
        load_causal_lm(tiny_qwen3_config(97), freeze_vision=True)
    with pytest.raises(ValueError, match="freeze_vision"):
        load_causal_lm(config, freeze_vision="yes")


def test_a_saved_vision_language_checkpoint_loads_as_one(config, tmp_path):
    from orchard.train.model import save_causal_lm

    save_causal_lm(load_causal_lm(config), tmp_path / "vl")
    model = load_causal_lm(tmp_path / "vl", freeze_vision=True)
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.startswith("model.visual."))
