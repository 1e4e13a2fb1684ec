"""Images in the data layer: rendering through a Qwen-VL image processor keeps the action masks exact, the tiny
Qwen3-VL trains on the rendered batch, and image parts survive the schema and JSONL."""

import pytest
import torch

from orchard.data import (
    Trajectory,
    collate,
    merge_prefix_samples,
    read_jsonl,
    render_trajectory,
    render_turns,
    write_jsonl,
)
from orchard.data.vision import decode_data_url


@pytest.fixture(scope="module")
def traj(tiny_vl, screenshot):
    _, tok, _ = tiny_vl
    return Trajectory(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "look"}, screenshot(64, 64, 0)]},
        {"role": "assistant", "content": "click", "token_ids": tok.encode("click<|im_end|>"),
         "logprobs": [-0.5] * len(tok.encode("click<|im_end|>"))},
        {"role": "tool", "content": [{"type": "text", "text": "ok"}, screenshot(64, 96, 1)]},
        {"role": "assistant", "content": "done"},
    ], reward=1.0, task_id="t")


def test_masks_with_hand_counted_vision_tokens(tiny_vl, traj):
    _, tok, processor = tiny_vl
    sample = render_trajectory(traj, tok, processor=processor)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")

    def enc(text):
        return tok.encode(text)

    # 16-pixel patches merged 2 x 2: the 64 x 64 screenshot is a 4 x 4 grid = 16 patches = 4 vision tokens, the
    # 64 wide x 96 high one 6 x 4 = 24 patches = 6 tokens.
    click, done = enc("click<|im_end|>"), enc("done<|im_end|>")
    pieces = [
        (enc("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nlook<|vision_start|>"), False),
        ([pad] * 4, False),
        (enc("<|vision_end|><|im_end|>\n<|im_start|>assistant\n"), False),
        (click, True),
        (enc("\n<|im_start|>tool\nok<|vision_start|>"), False),
        ([pad] * 6, False),
        (enc("<|vision_end|><|im_end|>\n<|im_start|>assistant\n"), False),
        (done, True),
        (enc("\n"), False),
    ]
    ids = [t for piece, _ in pieces for t in piece]
    action = [a for piece, a in pieces for _ in piece]
    assert sample.input_ids.tolist() == ids
    assert sample.action_mask.tolist() == action
    assert int(sample.action_mask.sum()) == len(click) + len(done)
    assert sample.image_grid_thw.tolist() == [[1, 4, 4], [1, 6, 4]]
    # Rows of pixel_values: 16 + 24 patches, each 3 channels x 2 frames x 16 x 16 = 1536 values.
    assert sample.pixel_values.shape == (40, 1536)
    assert sample.mm_token_type_ids.tolist() == [int(t == pad) for t in ids]
    assert not (sample.action_mask & (sample.mm_token_type_ids == 1)).any()
    # The sampled turn keeps its log-probs; the SFT turn has none.
    assert sample.logprob_mask.sum() == len(click) and sample.old_logprobs[sample.logprob_mask].eq(-0.5).all()
    assert sample.turn_index[sample.action_mask].tolist() == [0] * len(click) + [1] * len(done)


def test_same_screenshot_twice_gives_equal_vision_tokens_and_pixels(tiny_vl, screenshot):
    _, tok, processor = tiny_vl
    t = Trajectory(messages=[{"role": "user", "content": [screenshot(64, 64, 3), screenshot(64, 64, 3)]},
                             {"role": "assistant", "content": "ok"}])
    sample = render_trajectory(t, tok, processor=processor)
    assert sample.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 4]]
    assert torch.equal(sample.pixel_values[:16], sample.pixel_values[16:])
    assert int(sample.mm_token_type_ids.sum()) == 8  # 4 + 4


def test_truncation_never_splits_an_image(tiny_vl, traj):
    _, tok, processor = tiny_vl
    full = render_trajectory(traj, tok, processor=processor)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    second = [t for t, token in enumerate(full.input_ids.tolist()) if token == pad][4]  # first token of image 2
    # Cutting 2 tokens into the second image's 6 moves the cut back to where the image starts: it goes whole.
    cut = render_trajectory(traj, tok, processor=processor, max_len=second + 2)
    assert len(cut) == second and cut.report.cut == (second, len(full))
    assert torch.equal(cut.input_ids, full.input_ids[:second])
    assert cut.image_grid_thw.tolist() == [[1, 4, 4]] and torch.equal(cut.pixel_values, full.pixel_values[:16])
    # A cut after the image keeps both.
    kept = render_trajectory(traj, tok, processor=processor, max_len=second + 6)
    assert len(kept) == second + 6 and kept.image_grid_thw.tolist() == [[1, 4, 4], [1, 6, 4]]
    # Left truncation keeps the system prompt; a cut ending inside the first image moves past its end.
    system = len(tok.encode("<|im_start|>system\nBe brief.<|im_end|>\n"))
    first = next(t for t, token in enumerate(full.input_ids.tolist()) if token == pad)
    left = render_trajectory(traj, tok, processor=processor, max_len=len(full) - (first + 1 - system),
                             truncation="left")
    assert left.report.cut == (system, first + 4)
    assert left.image_grid_thw.tolist() == [[1, 6, 4]] and torch.equal(left.pixel_values, full.pixel_values[16:])
    assert torch.equal(left.input_ids, torch.cat([full.input_ids[:system], full.input_ids[first + 4:]]))


def test_render_turns_carry_the_images_of_their_prompt_and_merge_back(tiny_vl, traj):
    _, tok, processor = tiny_vl
    full = render_trajectory(traj, tok, processor=processor)
    turns = render_turns(traj, tok, processor=processor)
    assert [s.image_grid_thw.tolist() for s in turns] == [[[1, 4, 4]], [[1, 4, 4], [1, 6, 4]]]
    merged = merge_prefix_samples(turns)
    assert len(merged) == 1
    # The per-turn samples lack the template's newline after the last turn; everything else is the full rendering.
    n = len(merged[0])
    assert torch.equal(merged[0].input_ids, full.input_ids[:n]) and len(full) == n + 1
    assert torch.equal(merged[0].action_mask, full.action_mask[:n])
    assert torch.equal(merged[0].pixel_values, full.pixel_values)
    assert torch.equal(merged[0].mm_token_type_ids, full.mm_token_type_ids[:n])


def test_collate_and_forward_backward_of_the_tiny_vlm(tiny_vl, traj):
    model, tok, processor = tiny_vl
    text_only = Trajectory(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    samples = [render_trajectory(traj, tok, processor=processor), render_trajectory(text_only, tok)]
    batch = collate(samples, pad_id=tok.pad_token_id)
    assert batch["pixel_values"].shape == (40, 1536) and batch["image_grid_thw"].shape == (2, 3)
    assert batch["mm_token_type_ids"].shape == batch["input_ids"].shape
    assert batch["mm_token_type_ids"][1].sum() == 0 and batch["mm_token_type_ids"][0].sum() == 10  # 4 + 6
    assert "pixel_values" not in collate(samples[1:], pad_id=tok.pad_token_id)

    model = model.train()
    model.zero_grad()
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                mm_token_type_ids=batch["mm_token_type_ids"])
    logp = out.logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]  # [B, T-1]
    mask = batch["action_mask"][:, 1:]
    loss = -(logp * mask).sum() / mask.sum()
    loss.backward()
    assert torch.isfinite(loss)
    grads = {name: p.grad for name, p in model.named_parameters()}
    # The images reach the loss: the vision encoder's first layer gets a gradient, as does the language model.
    assert grads["model.visual.patch_embed.proj.weight"].abs().sum() > 0
    assert grads["model.language_model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0
    model.zero_grad()


def test_images_without_a_processor_or_in_assistant_turns_are_refused(tiny_vl, traj, screenshot):
    _, tok, processor = tiny_vl
    with pytest.raises(ValueError, match="processor"):
        render_trajectory(traj, tok)
    with pytest.raises(ValueError, match="assistant"):
        Trajectory(messages=[{"role": "assistant", "content": [screenshot(8, 8, 0)]}])
    remote = Trajectory(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]},
                                  {"role": "assistant", "content": "ok"}])
    with pytest.raises(ValueError, match="url must be a base64 data URL"):
        render_trajectory(remote, tok, processor=processor)
    with pytest.raises(ValueError, match="processor"):
        render_trajectory(traj, tok, processor=object())
    with pytest.raises(ValueError, match="content\\[0\\]"):
        Trajectory(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_image_parts_round_trip_through_jsonl(tmp_path, traj):
    path = tmp_path / "trajs.jsonl.gz"
    write_jsonl([traj], path)
    back = read_jsonl(path)
    assert back == [traj]
    assert back[0].messages[1].image_urls == traj.messages[1].image_urls
    assert decode_data_url(back[0].messages[3].image_urls[0]).size == (64, 96)
