"""An HF safetensors directory is read in place (engine/safetensors_weights.py): every tensor equals what
transformers' ``from_pretrained`` loads, for fp32 / bf16 / fp16 checkpoints, sharded, with a tied head, a
bare decoder's names and a classifier's head; the engine serves such a directory without ``from_pretrained``;
a checkpoint the map cannot serve is loaded by transformers with a line saying why; and a load's peak
memory stays near the engine's own weights, where ``from_pretrained`` held a second copy beside them."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models.skeleton import parameter_shapes, read_skeleton
from engine.request import GenerationRequest, TokensPrompt
from engine.safetensors_weights import SafetensorsWeights
from engine.sampling_params import SamplingParams
from tests.engine.helpers import run_all, tokens_of

VOCAB = 1024
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128, vocab_size=VOCAB)
# ~80 MB of fp32 weights (6 layers of 512 x 1536, GQA): large against what a process start makes, small to write
MEMORY_SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                    num_key_value_heads=4, max_position_embeddings=256, vocab_size=VOCAB, tie_word_embeddings=False)
PEAK_BOUND = 1.3  # peak memory a load adds, in the engine's final weight bytes


def save_tokenizer(out: Path) -> None:
    """A word-level tokenizer of VOCAB tokens ("w3", "w4", ...): small, so the weights dominate a start."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)


def save_checkpoint(out: Path, config, dtype: torch.dtype = torch.float32, shard: str | None = None,
                    bare: bool = False) -> Path:
    """A random model of ``config`` saved by transformers in ``dtype`` (sharded at ``shard``; ``bare``: the
    decoder alone, its names without the ``model.`` prefix), with the word-level tokenizer."""
    from transformers import AutoModel, AutoModelForCausalLM

    torch.manual_seed(0)
    model = (AutoModel if bare else AutoModelForCausalLM).from_config(config).to(dtype)
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    save_tokenizer(out)
    return out


def _llama(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY, **overrides})


def test_tensors_read_in_place_equal_from_pretrained(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config

    from tests.tiny_checkpoints import save_tiny_classifier

    cases = {
        "fp32-sharded-tied": save_checkpoint(tmp_path / "a", _llama(tie_word_embeddings=True), shard="40KB"),
        "bf16": save_checkpoint(tmp_path / "b", _llama(tie_word_embeddings=False), torch.bfloat16),
        "fp16-qwen3": save_checkpoint(tmp_path / "c", Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False),
                                      torch.float16),
        "bare-decoder": save_checkpoint(tmp_path / "d", _llama(tie_word_embeddings=True), bare=True),
        "classifier": save_tiny_classifier(tmp_path / "e"),  # score.weight, no lm_head
    }
    assert len(list(cases["fp32-sharded-tied"].glob("*.safetensors"))) > 1
    for case, path in cases.items():
        config = AutoConfig.from_pretrained(path)
        source = SafetensorsWeights(path, config, parameter_shapes(config))
        assert source.unservable is None, (case, source.unservable)
        for dtype in (torch.float32, torch.bfloat16):
            skeleton, read = read_skeleton(source, config, dtype, whole=True)
            if case == "classifier":  # transformers starts the missing head at random: the embedding serves
                assert torch.equal(read("lm_head.weight"), skeleton.get_parameter("model.embed_tokens.weight"))
            reference = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).state_dict()
            ours = skeleton.state_dict()
            assert ours.keys() == reference.keys(), case
            for name, tensor in reference.items():
                if case == "classifier" and name == "lm_head.weight":
                    continue
                assert ours[name].dtype == dtype and torch.equal(ours[name], tensor), (case, dtype, name)
        source.release_all()


def test_an_hf_directory_is_served_without_from_pretrained(tmp_path, monkeypatch, caplog):
    """A sharded bf16 checkpoint with a tied head, served in fp32: transformers' greedy tokens, and
    ``from_pretrained`` never called."""
    from transformers import AutoModelForCausalLM

    path = save_checkpoint(tmp_path / "m", _llama(tie_word_embeddings=True), torch.bfloat16, shard="40KB")
    prompt = [1, 5, 900, 300, 42]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(prompt):]

    def refused(*args, **kwargs):
        raise AssertionError("from_pretrained was called for a directory served in place")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refused)
    with caplog.at_level(logging.WARNING):
        engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16, max_loras=0))
    assert "not read in place" not in caplog.text
    request = GenerationRequest("r", TokensPrompt(prompt), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert tokens_of(run_all(engine, [request])["r"]) == ref.tolist()


def test_a_checkpoint_the_map_cannot_serve_loads_through_transformers_with_the_reason(tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    path = save_checkpoint(tmp_path / "m", _llama(tie_word_embeddings=False))
    tensors = load_file(path / "model.safetensors")
    tensors["model.extra.weight"] = torch.zeros(4)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING):
        engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16, max_loras=0))
    assert "m is not read in place (tensors model.extra.weight are not parameters of this model)" in caplog.text
    assert engine.model_info.model_type == "llama"


def test_what_is_not_served_in_place_says_why(tmp_path):
    from transformers import AutoConfig

    path = save_checkpoint(tmp_path / "m", _llama(tie_word_embeddings=False))

    def reason(**changes) -> str | None:
        config = AutoConfig.from_pretrained(path)
        for key, value in changes.items():
            setattr(config, key, value)
        return SafetensorsWeights(path, config, parameter_shapes(config)).unservable

    assert reason() is None
    assert reason(quantization_config={"quant_method": "gptq"}) == "a quantized checkpoint (gptq)"
    assert reason(num_hidden_layers=3) == "the checkpoint has no model.layers.2.self_attn.q_proj.weight, " \
        "model.layers.2.self_attn.k_proj.weight, model.layers.2.self_attn.v_proj.weight"
    assert reason(intermediate_size=96) == ("model.layers.0.mlp.down_proj.weight has shape [64, 128]; the config "
                                            "makes [64, 96]")
    (path / "model.safetensors").rename(path / "other.safetensors")
    assert reason() == "no model.safetensors or model.safetensors.index.json (other weight files are read by " \
        "transformers)"


def _peak(path: Path, warm: Path, *flags: str) -> dict[str, int]:
    """The load's peak memory in a process of its own (tests/engine/load_memory.py)."""
    done = subprocess.run([sys.executable, "-m", "tests.engine.load_memory", str(path), "--warm", str(warm), *flags],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def memory_checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(a bf16 checkpoint of ~80 MB of fp32 weights, sharded; a tiny one that warms a process up)."""
    from transformers import LlamaConfig

    root = tmp_path_factory.mktemp("memory")
    big = save_checkpoint(root / "big", LlamaConfig(**MEMORY_SHAPE), torch.bfloat16, shard="10MB")
    warm = save_checkpoint(root / "warm", _llama(tie_word_embeddings=False))
    return big, warm


def test_a_load_peaks_near_the_engine_s_own_weights(memory_checkpoints):
    """A bf16 checkpoint served in fp32 (as on a CPU without bf16 arithmetic): the load adds at most
    PEAK_BOUND x the weights the engine keeps. ``from_pretrained`` made the whole fp32 model first and the
    engine its fused projections beside it: 1.6x (test below)."""
    measured = _peak(*memory_checkpoints, "--dtype", "float32")
    assert measured["weight_bytes"] > 70e6
    assert measured["peak_added"] <= PEAK_BOUND * measured["weight_bytes"], measured


@pytest.mark.slow
def test_from_pretrained_held_more_than_the_bound(memory_checkpoints):
    """The bound above is one the fallback path does not meet: the test can fail."""
    measured = _peak(*memory_checkpoints, "--dtype", "float32", "--from-pretrained")
    assert measured["peak_added"] > PEAK_BOUND * measured["weight_bytes"], measured
