"""Training on images: the trainer's forward passes a batch's images to a vision-language model, micro-batching
cuts them by row, and the RL log-probs of an image batch are the model's own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orchard.data import Trajectory, collate, render_trajectory
from orchard.models.tiny import tiny_qwen3
from orchard.train.action_logprobs import action_logprobs, action_token_loss
from orchard.train.model import load_causal_lm
from orchard.train.trainer import OptimConfig, TrainConfig, Trainer, _pad_rows, split_batch


@pytest.fixture(scope="module")
def batch(tiny_vl, screenshot):
    """Two image trajectories: row 0 one 64 x 64 screenshot (16 patches), row 1 that size and a 64 x 96 one
    (16 + 24 patches), so the rows own 16 and 40 of the 56 patch rows."""
    _, tok, processor = tiny_vl
    one = Trajectory(messages=[
        {"role": "user", "content": [{"type": "text", "text": "look"}, screenshot(64, 64, 0)]},
        {"role": "assistant", "content": "click the red one"},
    ])
    two = Trajectory(messages=[
        {"role": "user", "content": [{"type": "text", "text": "where"}, screenshot(64, 64, 1)]},
        {"role": "assistant", "content": "scroll"},
        {"role": "tool", "content": [screenshot(64, 96, 2)]},
        {"role": "assistant", "content": "done now"},
    ])
    samples = [render_trajectory(t, tok, processor=processor) for t in (one, two)]
    out = collate(samples, pad_id=tok.pad_token_id)
    assert out["pixel_values"].shape[0] == 16 + 40 and out["image_grid_thw"].tolist() == [[1, 4, 4]] * 2 + [[1, 6, 4]]
    return out


def _config(tmp_path: Path, micro: int, total_steps: int = 1) -> TrainConfig:
    return TrainConfig(total_steps=total_steps, global_batch_size=2, micro_batch_size=micro, output_dir=str(tmp_path),
                       optim=OptimConfig(lr=1e-2, min_lr=1e-2), loggers=["jsonl"])


def _sft_gradient(tiny_vl, batch, tmp_path: Path, micro: int) -> dict[str, torch.Tensor]:
    model = load_causal_lm(tiny_vl[0].config, seed=3)
    trainer = Trainer(model, _config(tmp_path / f"mb{micro}", micro))
    trainer.accumulate_gradients(batch)
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def test_sft_gradient_is_split_invariant_and_reads_the_images(tiny_vl, batch, tmp_path):
    whole = _sft_gradient(tiny_vl, batch, tmp_path, micro=2)
    split = _sft_gradient(tiny_vl, batch, tmp_path, micro=1)
    assert whole.keys() == split.keys()
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-4, atol=1e-6, msg=name)
    # The images reach the loss: the vision encoder's patch embedding has a gradient, and blank screenshots give
    # the language model another one.
    assert whole["model.visual.patch_embed.proj.weight"].abs().sum() > 0
    blank = _sft_gradient(tiny_vl, {**batch, "pixel_values": torch.zeros_like(batch["pixel_values"])}, tmp_path / "b", 2)
    name = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert (blank[name] - whole[name]).abs().max() > 1e-4


@pytest.mark.parametrize("freeze", [True, False])
def test_a_step_leaves_a_frozen_vision_tower_unchanged(tiny_vl, batch, tmp_path, freeze):
    model = load_causal_lm(tiny_vl[0].config, seed=3, freeze_vision=freeze)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model, _config(tmp_path, micro=1))
    trainer.train_step(batch)
    after = dict(trainer.model.named_parameters())
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    vision = {n for n in before if n.startswith("model.visual.")}
    assert "model.language_model.layers.0.mlp.up_proj.weight" in moved
    if freeze:
        assert not moved & vision
    else:  # the images went through the tower: its first layer trained
        assert "model.visual.patch_embed.proj.weight" in moved


def test_action_logprobs_of_an_image_batch_equal_a_direct_forward(tiny_vl, batch):
    model = tiny_vl[0].eval()
    images = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids")}
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **images).logits
        direct = logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]  # [B, T-1]
        fused = action_logprobs(model, batch["input_ids"], batch["action_mask"],
                                attention_mask=batch["attention_mask"], **images)
        loss = action_token_loss(model, batch["input_ids"], batch["action_mask"], lambda lp, _e, _i: -lp,
                                 attention_mask=batch["attention_mask"], **images)
    action = batch["action_mask"]
    expected = torch.zeros_like(fused)
    expected[:, 1:] = torch.where(action[:, 1:], direct, 0.0)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, -expected.sum(), rtol=1e-5, atol=1e-5)
    # Without the images the same tokens score otherwise: the image tokens were read as pictures.
    text_only = action_logprobs(model, batch["input_ids"], action, attention_mask=batch["attention_mask"],
                                mm_token_type_ids=torch.zeros_like(batch["mm_token_type_ids"]))
    assert (text_only - fused).abs().max() > 1e-4


def _hand_batch() -> dict[str, torch.Tensor]:
    # Row 0: 1 image token, row 1: 3. Grids (1,2,2), (1,2,2), (1,2,4) are 4 + 4 + 8 = 16 patches for 4 tokens:
    # 4 patches a token (the 2 x 2 merge), so row 0 owns patches [0, 4) = image 0, row 1 patches [4, 16) = images
    # 1 and 2. Each patch row holds its index; D = 6 = T, so a column trim of T would cut pixel_values too.
    mm = torch.tensor([[0, 1, 0, 0, 0, 0], [0, 1, 0, 1, 1, 0]])
    return {"input_ids": torch.arange(12).reshape(2, 6), "attention_mask": torch.tensor([[1] * 4 + [0] * 2, [1] * 6]),
            "mm_token_type_ids": mm, "image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 2], [1, 2, 4]]),
            "pixel_values": torch.arange(16.0)[:, None].expand(16, 6).clone()}


def test_split_batch_cuts_images_by_row():
    batch = _hand_batch()
    first, second = split_batch(batch, slice(0, 1)), split_batch(batch, slice(1, 2))
    assert first["input_ids"].shape == (1, 4)  # right padding trimmed ...
    assert first["pixel_values"].shape == (4, 6)  # ... but not the patches' 6 values
    assert first["pixel_values"][:, 0].tolist() == [0, 1, 2, 3] and first["image_grid_thw"].tolist() == [[1, 2, 2]]
    assert second["pixel_values"][:, 0].tolist() == list(range(4, 16))
    assert second["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 4]]
    both = split_batch(batch, slice(0, 2))
    assert torch.equal(both["pixel_values"], batch["pixel_values"])


def test_split_batch_when_the_patch_count_equals_the_batch_size():
    # B = 4 rows, one image of 4 patches in the last row: the old first-dim rule gave row 0 a patch of row 3.
    mm = torch.zeros(4, 3, dtype=torch.long)
    mm[3, 1] = 1
    batch = {"input_ids": torch.zeros(4, 3, dtype=torch.long), "attention_mask": torch.ones(4, 3, dtype=torch.long),
             "mm_token_type_ids": mm, "image_grid_thw": torch.tensor([[1, 2, 2]]), "pixel_values": torch.randn(4, 8)}
    assert "pixel_values" not in split_batch(batch, slice(0, 1)) and "image_grid_thw" not in split_batch(batch, slice(0, 3))
    last = split_batch(batch, slice(3, 4))
    assert torch.equal(last["pixel_values"], batch["pixel_values"]) and last["image_grid_thw"].tolist() == [[1, 2, 2]]


def test_padding_rows_bring_row_zeros_images():
    batch = _hand_batch()
    padded = _pad_rows(batch, 3, {"attention_mask"})
    # One copy of row 0 appended: its image (patches 0..3, grid (1,2,2)) follows all 16 patches.
    assert padded["input_ids"].shape == (3, 6)
    assert padded["pixel_values"][:, 0].tolist() == [*range(16), 0, 1, 2, 3]
    assert padded["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2], [1, 2, 4], [1, 2, 2]]
    assert torch.equal(split_batch(padded, slice(2, 3))["pixel_values"], batch["pixel_values"][:4])


def test_image_errors_name_the_argument(tiny_vl, batch):
    model = tiny_vl[0]
    ids, action, attn = batch["input_ids"], batch["action_mask"], batch["attention_mask"]
    with pytest.raises(ValueError, match="image_grid_thw is None"):
        action_logprobs(model, ids, action, attention_mask=attn, pixel_values=batch["pixel_values"])
    with pytest.raises(ValueError, match=r"pixel_values must be \[56, D\]"):
        action_logprobs(model, ids, action, pixel_values=batch["pixel_values"][:40],
                        image_grid_thw=batch["image_grid_thw"], mm_token_type_ids=batch["mm_token_type_ids"])
    with pytest.raises(ValueError, match="mm_token_type_ids marks image tokens"):
        action_logprobs(model, ids, action, mm_token_type_ids=batch["mm_token_type_ids"])
    with pytest.raises(ValueError, match="mm_token_type_ids must have the shape"):
        action_logprobs(model, ids, action, mm_token_type_ids=batch["mm_token_type_ids"][:, 1:])
    with pytest.raises(ValueError, match="takes no images"):
        action_logprobs(tiny_qwen3(len(tiny_vl[1])), ids, action, pixel_values=batch["pixel_values"],
                        image_grid_thw=batch["image_grid_thw"])
    # Row 0's single token ends inside the one 8-patch image (2 tokens of 4 patches): no row owns it whole.
    odd = {"input_ids": torch.zeros(2, 2, dtype=torch.long), "mm_token_type_ids": torch.tensor([[1, 0], [1, 0]]),
           "image_grid_thw": torch.tensor([[1, 2, 4]]), "pixel_values": torch.zeros(8, 3)}
    with pytest.raises(ValueError, match="end inside"):
        split_batch(odd, slice(0, 1))
