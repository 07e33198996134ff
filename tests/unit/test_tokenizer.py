"""models/tokenizer.load_tokenizer: a directory's tokenizer encodes as its tokenizer.json says, even where
transformers 5 lets the model type's tokenizer class rebuild the file's pipeline."""

import logging

from transformers import AutoTokenizer

from nemo_grpo.data.datasets import arithmetic_code_problems
from nemo_grpo.models.tiny import make_tokenizer, tiny_config
from nemo_grpo.models.tokenizer import load_tokenizer


def test_the_builtin_character_tokenizer_keeps_its_spaces(tmp_path, caplog):
    """A qwen2 model directory with the built-in character tokenizer (as builtin:tiny-code is cached): the
    prompts the warm start was trained on, space for space."""
    tiny_config("qwen2", vocab_size=len(make_tokenizer())).save_pretrained(tmp_path)
    made = make_tokenizer()
    made.save_pretrained(tmp_path)
    prompt = arithmetic_code_problems()[0]["problem"]  # "code:0 plus 0="
    assert " " in prompt
    auto = AutoTokenizer.from_pretrained(tmp_path)
    assert auto.encode(prompt) != made.encode(prompt)  # transformers' Qwen2Tokenizer drops the spaces
    with caplog.at_level(logging.INFO, logger="nemo_grpo.models.tokenizer"):
        loaded = load_tokenizer(str(tmp_path))
    assert loaded.encode(prompt) == made.encode(prompt)
    assert loaded.decode(made.encode(prompt)) == prompt
    assert loaded.eos_token_id == made.eos_token_id and loaded.pad_token_id == made.pad_token_id
    assert loaded.chat_template == made.chat_template
    assert "rebuilt the" in caplog.text and "pre_tokenizer" in caplog.text


def test_a_tokenizer_of_the_model_type_is_kept(tmp_path, caplog):
    """Where AutoTokenizer's pipeline is the file's (a directory without a model type), nothing logged."""
    tiny_config("qwen2", vocab_size=len(make_tokenizer())).save_pretrained(tmp_path)
    made = make_tokenizer()
    made.save_pretrained(tmp_path)
    first = load_tokenizer(str(tmp_path))  # the file's own
    first.save_pretrained(tmp_path / "again")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nemo_grpo.models.tokenizer"):
        again = load_tokenizer(str(tmp_path / "again"))  # no config.json: AutoTokenizer reads the file as it is
    assert again.encode("code:1 plus 2=") == made.encode("code:1 plus 2=")
    assert caplog.text == ""
