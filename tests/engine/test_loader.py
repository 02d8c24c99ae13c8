"""The loader apart from the serving core: load(config) -> Loaded, LLMEngine(config, loaded) serving it, the
scheduler's cost model as a value (measured, or pinned by --scheduler-cost-model), and int8's calibration
sampled on a bare core, with no engine built inside an engine's construction. On a tiny checkpoint."""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest

from engine import loader
from engine.config import EngineConfig
from engine.cost_model import CostModel
from engine.llm_engine import EngineCore, LLMEngine
from engine.quant import cache as quant_cache
from engine.request import GenerationRequest, TokensPrompt
from engine.sampling_params import SamplingParams
from spark_server import settings
from tests.engine.helpers import run_all, tokens_of
from tests.tiny_checkpoints import save_tiny_classifier

PINNED = "step=7.1,decode_key=0.004,attention_key=0.01"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> EngineConfig:
    path = save_tiny_classifier(tmp_path_factory.mktemp("tiny") / "m")
    return EngineConfig(model=str(path), task="generate", device="cpu", dtype="float32", num_kv_blocks=16,
                        kv_cache_prefault=False, max_loras=0)


def _greedy(engine: LLMEngine) -> list[int]:
    request = GenerationRequest("r", TokensPrompt([1, 5, 900, 300, 42]),
                                SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    return tokens_of(run_all(engine, [request])["r"])


def test_an_engine_over_a_load_answers_as_one_that_loads(tiny):
    loaded = loader.load(tiny)
    assert loaded.model_info.max_model_len == loaded.max_model_len and loaded.task == "generate"
    assert not loaded.cost_model.pinned
    over_loaded = LLMEngine(tiny, loaded=loaded)
    assert over_loaded.model is loaded.model and over_loaded.scheduler.cost_model == loaded.cost_model
    assert _greedy(over_loaded) == _greedy(LLMEngine(tiny))


def test_a_pinned_cost_model_reaches_the_scheduler_unchanged(tiny, caplog):
    config = dataclasses.replace(tiny, cost_model=PINNED)
    with caplog.at_level(logging.INFO, logger="engine.llm_engine"):
        engine = LLMEngine(config)
    costs = engine.scheduler.cost_model
    assert costs == CostModel(attention_cost_per_key=0.01, decode_cost_per_key=0.004, decode_step_cost=7.1,
                              measured=True, pinned=True)
    assert (engine.scheduler.decode_step_cost, engine.scheduler.decode_cost_per_key,
            engine.scheduler.attention_cost_per_key) == (7.1, 0.004, 0.01)
    assert "pinned by --scheduler-cost-model" in caplog.text
    assert CostModel.parse(costs.describe()) == costs  # the start-up line's figures pin as they read


def test_a_decode_row_cost_pins_and_reads_back_only_where_it_is_not_one():
    """``decode_row`` is optional (a decoding row's linears, in prompt tokens'): the default form stays the
    three figures, and a model with another row cost describes and pins it."""
    plain = CostModel.parse("step=7.1,decode_key=0.004,attention_key=0.01")
    assert plain.decode_row_cost == 1.0 and "decode_row" not in plain.describe()
    rows = CostModel.parse("step=7.1,decode_key=0.004,attention_key=0.01,decode_row=1.4")
    assert rows.decode_row_cost == 1.4 and CostModel.parse(rows.describe()) == rows


@pytest.mark.parametrize("value", ["step=7.1", "step=1,decode_key=x,attention_key=0", "fast",
                                   "step=1,decode_key=0,attention_key=0,decode_row=-1",
                                   "decode_row=1.4",
                                   "step=-1,decode_key=0,attention_key=0", "step=nan,decode_key=0,attention_key=0",
                                   "step=1,step=2,decode_key=0,attention_key=0"])
def test_a_bad_cost_model_is_refused_naming_the_flag(tiny, value):
    with pytest.raises(ValueError, match="--scheduler-cost-model"):
        settings.resolve({"scheduler_cost_model": value})
    with pytest.raises(ValueError, match="--scheduler-cost-model"):  # before any weight loads
        loader.load(dataclasses.replace(tiny, cost_model=value, model="/nonexistent"))


def test_int8_calibration_builds_no_engine_inside_an_engine(tiny, monkeypatch):
    """The calibration samples on a bare core over a bf16 load, built by the loader: LLMEngine is
    constructed once, never from inside its own construction."""
    monkeypatch.setattr(quant_cache, "load", lambda path: None)  # calibrate, whatever an earlier run cached
    monkeypatch.setattr(quant_cache, "save", lambda path, weights: None)
    built: list[tuple[str, int]] = []
    depth = [0]
    core_init, engine_init = EngineCore.__init__, LLMEngine.__init__

    def counted_engine(self, *args, **kwargs):
        built.append(("LLMEngine", depth[0]))
        depth[0] += 1
        try:
            engine_init(self, *args, **kwargs)
        finally:
            depth[0] -= 1

    def counted_core(self, *args, **kwargs):
        built.append((type(self).__name__ + " core", depth[0]))
        core_init(self, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "__init__", counted_engine)
    monkeypatch.setattr(EngineCore, "__init__", counted_core)
    engine = LLMEngine(dataclasses.replace(tiny, dtype="bfloat16", quantization="int8"))
    assert engine.quantization == "int8"
    # the helper core samples the calibration text (inside the load); then the engine's own core
    assert built == [("LLMEngine", 0), ("EngineCore core", 1), ("LLMEngine core", 1)]


def test_the_kernels_build_while_the_model_resolves(tiny, monkeypatch):
    """The loader resolves the model (on a cold cache: converts it) only once the kernels' build has begun."""
    building = threading.Event()
    real_load, real_resolve = loader.load_cpu_kernels, loader.resolve_served_model

    def load():
        building.set()
        return real_load()

    def resolve(model):
        assert building.wait(timeout=30), "the kernels were not being built while the model resolved"
        return real_resolve(model)

    monkeypatch.setattr(loader, "load_cpu_kernels", load)
    monkeypatch.setattr(loader, "resolve_served_model", resolve)
    loaded = loader.load(dataclasses.replace(tiny, native_kernels=True))
    assert loaded.model.kernels is not None or real_load() is None
