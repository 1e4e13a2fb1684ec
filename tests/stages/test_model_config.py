import pytest

from orchard.rollout.fast_decode import DecodeForward
from orchard.stages.policy import ModelConfig, load_policy, make_engine
from orchard.train.config import ConfigError, load_config


def test_compile_decode_goes_from_the_yaml_to_the_engine(tmp_path, monkeypatch):
    # the engine compiles when built (warm_up); recorded here instead, the compile itself is tested in
    # tests/rollout/test_fast_decode.py (each structure's compile costs tens of seconds of CI)
    warmed = []
    monkeypatch.setattr(DecodeForward, "warm_up", lambda self: warmed.append(self.compiled))
    config = tmp_path / "model.yaml"
    config.write_text("hidden_size: 32\nnum_layers: 1\ncompile_decode: true\n")
    cfg = load_config(ModelConfig, config)
    model, tokenizer = load_policy(cfg, ["a small corpus for the offline tokenizer"], seed=0)
    assert make_engine(cfg, model, tokenizer, seed=0)._decoder.compiled
    assert not make_engine(ModelConfig(hidden_size=32, num_layers=1), model, tokenizer, seed=0)._decoder.compiled
    assert warmed == [True, False]


def test_compile_decode_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="compile_decode"):
        load_config(ModelConfig, overrides=["compile_decode=maybe"])
    with pytest.raises(ValueError, match="compile_decode"):
        ModelConfig(compile_decode=1)
    with pytest.raises(ValueError, match="compile_decode applies to engine=hf"):
        ModelConfig(path=str(tmp_path), engine="vllm", compile_decode=True)
