"""A converted GGUF model's tokenizer files, made to say what the GGUF file itself says.

transformers (4.x) converts a GGUF tokenizer into a Llama-class fast tokenizer whatever its kind, names
the BOS token as the EOS, and adds a BOS to every text. For a byte-level BPE vocabulary (``gpt2``, as the
embedded SmolLM2's) those are three departures from the file, and from llama.cpp serving the same file:

- transformers 5 builds a ``LlamaTokenizer`` SentencePiece-style, which drops every space of a byte-level
  vocabulary: a program loading the converted directory with it (vLLM does) reads ~30% more tokens than
  the text has, and other words than the model was given;
- the EOS it names is ``<|im_start|>``, where the file's is ``<|im_end|>``, the end of a turn;
- a completion prompt gets a BOS the file says not to add (``tokenizer.ggml.add_bos_token``).

So the class becomes the generic fast tokenizer, which reads ``tokenizer.json`` as written in every
transformers version, and the special tokens and the BOS/EOS template follow the file's metadata.
Vocabularies of other kinds keep transformers' files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.gguf_parse import metadata_value

_ROLES = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token", "padding": "pad_token"}


@dataclass(frozen=True)
class GgufTokenizerMetadata:
    kind: str | None  # tokenizer.ggml.model: "gpt2" for byte-level BPE
    special_ids: dict[str, int]  # "bos_token", "eos_token", "unk_token", "pad_token" -> token id
    add_bos: bool
    add_eos: bool


def read_metadata(gguf_path: Path) -> GgufTokenizerMetadata:
    """The tokenizer metadata of a GGUF file (read inside ``shared_gguf_readers`` to reuse its parse)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))

    def field(name: str) -> Any:
        return metadata_value(reader, f"tokenizer.ggml.{name}")

    special_ids = {key: int(token_id) for role, key in _ROLES.items()
                   if (token_id := field(f"{role}_token_id")) is not None}
    return GgufTokenizerMetadata(field("model"), special_ids, bool(field("add_bos_token")),
                                 bool(field("add_eos_token")))


def follow_gguf_metadata(directory: Path, metadata: GgufTokenizerMetadata) -> None:
    """Rewrite ``directory``'s saved tokenizer files after the GGUF file's tokenizer metadata."""
    if metadata.kind != "gpt2":
        return
    tokenizer_path, config_path = directory / "tokenizer.json", directory / "tokenizer_config.json"
    tokenizer = json.loads(tokenizer_path.read_text())
    config = json.loads(config_path.read_text())
    by_id = ({i: t for t, i in tokenizer["model"]["vocab"].items()}
             | {a["id"]: a["content"] for a in tokenizer["added_tokens"]})
    special_ids = {key: token_id for key, token_id in metadata.special_ids.items() if token_id in by_id}
    special = {key: by_id[token_id] for key, token_id in special_ids.items()}
    add_bos = metadata.add_bos and "bos_token" in special
    add_eos = metadata.add_eos and "eos_token" in special

    tokenizer["post_processor"] = _template(special, special_ids, add_bos, add_eos)
    tokenizer_path.write_text(json.dumps(tokenizer, ensure_ascii=False, indent=2))

    config.pop("legacy", None)  # a SentencePiece Llama setting
    config |= special | {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos,
                         "add_eos_token": add_eos, "clean_up_tokenization_spaces": False}
    config |= {f"{key}_id": token_id for key, token_id in special_ids.items()}
    config_path.write_text(json.dumps(config, ensure_ascii=False, indent=2))
    map_path = directory / "special_tokens_map.json"
    tokens_map = json.loads(map_path.read_text()) if map_path.exists() else {}
    map_path.write_text(json.dumps(tokens_map | special, ensure_ascii=False, indent=2))


def _template(special: dict[str, str], special_ids: dict[str, int], add_bos: bool, add_eos: bool) -> dict | None:
    """The post-processor that adds the file's BOS and EOS around a text (None: adds nothing)."""
    before = [special["bos_token"]] if add_bos else []
    after = [special["eos_token"]] if add_eos else []
    if not (before or after):
        return None
    ids = {special[key]: token_id for key, token_id in special_ids.items()}

    def around(sequence: str, type_id: int) -> list[dict]:
        def mark(token: str) -> dict:
            return {"SpecialToken": {"id": token, "type_id": type_id}}
        return [*map(mark, before), {"Sequence": {"id": sequence, "type_id": type_id}}, *map(mark, after)]

    return {"type": "TemplateProcessing", "single": around("A", 0), "pair": around("A", 0) + around("B", 1),
            "special_tokens": {token: {"id": token, "ids": [ids[token]], "tokens": [token]}
                               for token in before + after}}
