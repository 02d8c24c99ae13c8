"""A converted GGUF model's tokenizer files say what the GGUF file says, and read the same in any
transformers version (the generic fast class reads tokenizer.json as written)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from engine.gguf_tokenizer import GgufTokenizerMetadata, follow_gguf_metadata

TEXT = "The small bakery on the corner sells warm bread. 你好，世界！"


def test_the_embedded_models_converted_tokenizer_follows_its_gguf(llm_engine):
    """The embedded file says (gguf-dump): byte-level BPE (gpt2), BOS 1 <|im_start|>, EOS 2 <|im_end|>,
    add_bos_token false. transformers 4.x had written a Llama class, EOS <|im_start|> and a BOS on every
    text; transformers 5 read that class SentencePiece-style and dropped every space."""
    directory = Path(llm_engine.model_info.path)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert config["add_bos_token"] is False and config["clean_up_tokenization_spaces"] is False
    tokenizer = llm_engine.tokenizer
    ids = tokenizer.encode(TEXT)  # add_special_tokens defaults to True: the file adds nothing
    assert ids == Tokenizer.from_file(str(directory / "tokenizer.json")).encode(TEXT).ids
    assert ids[0] != tokenizer.bos_token_id
    assert tokenizer.convert_ids_to_tokens(ids[:3]) == ["The", "Ġsmall", "Ġb" + "akery"]
    assert tokenizer.decode(ids) == TEXT
    assert llm_engine.eos_token_ids == [2]


def _directory_as_transformers_wrote_it(tmp_path):
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "h": 3, "i": 4, "Ġ": 5, "hi": 6}
    tokenizer = Tokenizer(models.BPE(vocab, [("h", "i")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    data = json.loads(tokenizer.to_str())
    data["post_processor"] = {"type": "TemplateProcessing",  # a BOS on every text, as transformers 4 wrote
                              "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                       {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1],
                                                                  "tokens": ["<|im_start|>"]}}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "legacy": True, "bos_token": "<|im_start|>", "eos_token": "<|im_start|>",
         "eos_token_id": 1, "add_bos_token": True, "clean_up_tokenization_spaces": True}))
    return tmp_path


def _encode(directory, text: str) -> list[int]:
    return Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text).ids


def test_the_special_tokens_and_the_bos_follow_the_metadata(tmp_path):
    directory = _directory_as_transformers_wrote_it(tmp_path)
    assert _encode(directory, "hi hi") == [1, 6, 5, 6]
    follow_gguf_metadata(directory, GgufTokenizerMetadata("gpt2", {"bos_token": 1, "eos_token": 2, "unk_token": 0},
                                                          add_bos=False, add_eos=False))
    assert _encode(directory, "hi hi") == [6, 5, 6]
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert "legacy" not in config
    assert {k: config[k] for k in ("tokenizer_class", "bos_token", "eos_token", "eos_token_id", "unk_token",
                                   "add_bos_token")} == {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "eos_token_id": 2, "unk_token": "<|endoftext|>", "add_bos_token": False}
    assert json.loads((directory / "special_tokens_map.json").read_text())["eos_token"] == "<|im_end|>"


def test_a_file_that_asks_for_a_bos_and_an_eos_gets_them(tmp_path):
    directory = _directory_as_transformers_wrote_it(tmp_path)
    follow_gguf_metadata(directory, GgufTokenizerMetadata("gpt2", {"bos_token": 1, "eos_token": 2},
                                                          add_bos=True, add_eos=True))
    assert _encode(directory, "hi") == [1, 6, 2]


def test_other_vocabulary_kinds_keep_transformers_files(tmp_path):
    directory = _directory_as_transformers_wrote_it(tmp_path)
    before = {p.name: p.read_text() for p in directory.iterdir()}
    follow_gguf_metadata(directory, GgufTokenizerMetadata("llama", {"eos_token": 2}, add_bos=False, add_eos=False))
    assert {p.name: p.read_text() for p in directory.iterdir()} == before
