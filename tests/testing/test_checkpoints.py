"""tiercache.testing.checkpoints: the tokenizer of the tiny checkpoints round-trips exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tiercache.testing.checkpoints import token_text, write_tokenizer

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

VOCAB = 512


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(directory, VOCAB)
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def test_every_id_decodes_to_its_word_and_encodes_back_to_itself(tokenizer: Any) -> None:
    ids = list(range(VOCAB))
    text = tokenizer.decode(ids)
    assert text.split() == [token_text([i]) for i in ids]
    assert tokenizer(text)["input_ids"] == ids


def test_a_prompt_is_encoded_as_its_words_with_nothing_added(tokenizer: Any) -> None:
    prompt = [5, 300, 7, 511, 3]
    assert token_text(prompt) == "t5 t300 t7 t511 t3"
    assert tokenizer(token_text(prompt))["input_ids"] == prompt


def test_the_special_tokens_are_pad_0_bos_1_eos_2_and_skipped_in_decoding(tokenizer: Any) -> None:
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.decode([5, 2, 6, 1, 0], skip_special_tokens=True) == "t5 t6"


def test_a_chat_renders_as_bos_then_the_messages_words(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "t5 t6"}, {"role": "user", "content": "t7"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s> t5 t6 t7"
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == [1, 5, 6, 7]


def test_a_vocabulary_of_special_tokens_only_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no ordinary words"):
        write_tokenizer(tmp_path, 3)
