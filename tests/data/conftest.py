import pytest

from orchard.data.tokenizer import build_chat_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return build_chat_tokenizer()
