"""`check_same_tokenizer`: a student and a teacher that exchange token ids must share vocabulary and special tokens."""

import copy

import pytest

from orchard.data.tokenizer import TokenizerMismatch, build_chat_tokenizer, check_same_tokenizer


@pytest.fixture(scope="module")
def base():
    return build_chat_tokenizer()


def test_the_same_tokenizer_built_twice_or_saved_and_loaded_passes(base, tmp_path):
    from transformers import AutoTokenizer

    check_same_tokenizer(base, build_chat_tokenizer())  # deterministic: same inputs, same tokenizer
    base.save_pretrained(tmp_path)
    check_same_tokenizer(base, AutoTokenizer.from_pretrained(tmp_path))
    check_same_tokenizer(base, base)


def test_another_vocabulary_is_refused_naming_both(base):
    other = build_chat_tokenizer(["def cheapest(items): return min(items, key=price)\n" * 40], vocab_size=1100)
    with pytest.raises(TokenizerMismatch, match=r"^Qwen3-30B-A3B and Qwen3\.5-397B-A17B must share one tokenizer "
                                                r"\(their token ids are exchanged as they are\): vocabularies differ "
                                                rf"\({len(base)} vs {len(other)} tokens"):
        check_same_tokenizer(base, other, student_name="Qwen3-30B-A3B", teacher_name="Qwen3.5-397B-A17B")


def test_added_vision_tokens_are_refused_naming_them(base):
    # vision=True adds the four vision tokens: the token ids a VL teacher could answer mean nothing to the student
    vision = build_chat_tokenizer(vision=True)
    with pytest.raises(TokenizerMismatch, match=rf"vocabularies differ \({len(base)} vs {len(vision)} tokens, 4 tokens "
                                                r"with another id or missing, e\.g\. \['<\|image_pad\|>'"):
        check_same_tokenizer(base, vision)


def test_the_same_vocabulary_with_other_special_tokens_is_refused(base):
    other = copy.deepcopy(base)
    other.pad_token = "<|im_start|>"  # a token of the vocabulary: the vocabularies are still equal
    assert other.get_vocab() == base.get_vocab()
    with pytest.raises(TokenizerMismatch, match=r"special tokens differ: pad_token_id \d+ vs \d+"):
        check_same_tokenizer(base, other, student_name="student", teacher_name="teacher")


def test_bad_arguments(base):
    with pytest.raises(ValueError, match="student must be a transformers tokenizer with get_vocab"):
        check_same_tokenizer("Qwen3", base)
    with pytest.raises(ValueError, match="teacher must be a transformers tokenizer with get_vocab"):
        check_same_tokenizer(base, None)
