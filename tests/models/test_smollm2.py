"""The real pretrained policy, SmolLM2-135M-Instruct, as `orchard models fetch` left it in the cache (the set-up
fetches it): every file matches its manifest and a corrupted copy is refused, it loads under its name, answers
greedily through the HF engine as the original GGUF model does, and takes one SFT step that lowers its loss.

Slow (a 135 M model on CPU), run in CI, never skipped: without the fetched checkpoint the fixture fails with the
command that fetches it."""

import asyncio
import os
import shutil

import pytest
import torch

from orchard.data import Message, Trajectory, collate, render_trajectory
from orchard.models.pretrained import (
    ChecksumError,
    NotFetchedError,
    load_chat_tokenizer,
    resolve_checkpoint,
    verify_checkpoint,
)
from orchard.rollout.engine import GenerateRequest, SamplingParams
from orchard.rollout.hf_engine import HFEngine
from orchard.train.model import load_causal_lm
from orchard.train.trainer import OptimConfig, TrainConfig, Trainer

NAME = "smollm2-135m-instruct"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint():
    try:
        return resolve_checkpoint(NAME)
    except NotFetchedError as exc:  # a missing model is a failure here, never a skip
        pytest.fail(str(exc))


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return load_chat_tokenizer(NAME)


def test_the_cached_checkpoint_matches_its_manifest_and_a_corrupted_copy_is_refused(checkpoint, tmp_path):
    assert verify_checkpoint(NAME) == checkpoint
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in checkpoint.iterdir():
        if path.suffix == ".safetensors":
            os.link(path, copy / path.name) if path.stat().st_dev == tmp_path.stat().st_dev \
                else os.symlink(path, copy / path.name)
        else:
            shutil.copy(path, copy / path.name)
    config = (copy / "config.json").read_text()
    (copy / "config.json").write_text(config.replace('"num_hidden_layers": 30', '"num_hidden_layers": 29'))
    with pytest.raises(ChecksumError, match=r"config\.json does not match its recorded sha256"):
        verify_checkpoint(copy)


def test_the_tokenizer_has_the_tool_template_and_chatml_tokens(tokenizer):
    tools = [{"type": "function", "function": {"name": "exec", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
    messages = [{"role": "user", "content": "list files"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "exec", "arguments": {"command": "ls"}}}]}]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert "- exec(command: string)" in text and '"arguments": {"command": "ls"}' in text
    # pad is eos on this checkpoint: <|im_end|>, one token, as are the turn starts
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert len(tokenizer("<|im_start|>", add_special_tokens=False)["input_ids"]) == 1


def test_it_loads_by_name_and_answers_greedily_through_the_engine(checkpoint, tokenizer):
    model = load_causal_lm(NAME).eval()
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    engine = HFEngine(model, pad_token_id=tokenizer.pad_token_id, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=(tokenizer.eos_token_id,))
    result = asyncio.run(engine.generate([GenerateRequest(ids, params)]))[0].completions[0]
    assert result.finish_reason == "stop" and result.token_ids[-1] == tokenizer.eos_token_id
    assert "Paris" in tokenizer.decode(result.token_ids, skip_special_tokens=True)
    # the engine's greedy tokens are the model's own argmax continuation
    with torch.no_grad():
        full = torch.tensor([ids + list(result.token_ids)])
        argmax = model(input_ids=full).logits[0, len(ids) - 1 : -1].argmax(-1)
    assert argmax.tolist() == list(result.token_ids)


def test_one_sft_step_lowers_the_loss_of_its_batch(checkpoint, tokenizer, tmp_path):
    model = load_causal_lm(NAME)
    trajs = [Trajectory(messages=[Message("user", f"Say the word {w}."), Message("assistant", f"{w}.")], reward=1.0)
             for w in ("orchard", "sandbox")]
    samples = [render_trajectory(t, tokenizer) for t in trajs]
    batch = collate(samples, tokenizer.pad_token_id)
    # each assistant turn's tokens and its closing <|im_end|> (= the pad id) are action tokens
    assert batch["action_mask"].sum(-1).tolist() == [len(tokenizer("orchard.<|im_end|>")["input_ids"]),
                                                     len(tokenizer("sandbox.<|im_end|>")["input_ids"])]
    cfg = TrainConfig(total_steps=2, global_batch_size=2, micro_batch_size=1, output_dir=str(tmp_path / "t"),
                      optim=OptimConfig(lr=1e-4, min_lr=1e-4, warmup_steps=0))
    trainer = Trainer(model, cfg)
    before = {k: v.detach().clone() for k, v in model.named_parameters() if "layers.29." in k}
    first = trainer.train_step(batch)
    second = trainer.train_step(batch)
    trainer.close()
    assert first["grad_norm"] > 0 and torch.isfinite(torch.tensor(first["loss/total"]))
    assert second["loss/total"] < first["loss/total"]  # the same batch, one Adam step later
    assert any(not torch.equal(before[k], v) for k, v in model.named_parameters() if k in before)
