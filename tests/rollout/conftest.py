import pytest
import torch

from orchard.data.tokenizer import build_chat_tokenizer
from orchard.train.tiny import tiny_qwen3


@pytest.fixture(scope="session")
def tokenizer():
    return build_chat_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    torch.set_num_threads(1)
    return tiny_qwen3(tokenizer, seed=0)
