import pytest

from orchard.stages.policy import ModelConfig, load_policy, make_engine
from orchard.train.config import ConfigError, load_config


def test_compile_decode_goes_from_the_yaml_to_the_engine(tmp_path):
    config = tmp_path / "model.yaml"
    config.write_text("hidden_size: 32\nnum_layers: 1\ncompile_decode: true\n")
    cfg = load_config(ModelConfig, config)
    model, tokenizer = load_policy(cfg, ["a small corpus for the offline tokenizer"], seed=0)
    # built, not yet compiled: torch.compile traces at the first decode step
    assert make_engine(cfg, model, tokenizer, seed=0)._decoder.compiled
    assert not make_engine(ModelConfig(hidden_size=32, num_layers=1), model, tokenizer, seed=0)._decoder.compiled


def test_compile_decode_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="compile_decode"):
        load_config(ModelConfig, overrides=["compile_decode=maybe"])
    with pytest.raises(ValueError, match="compile_decode"):
        ModelConfig(compile_decode=1)
    with pytest.raises(ValueError, match="compile_decode applies to engine=hf"):
        ModelConfig(path=str(tmp_path), engine="vllm", compile_decode=True)
