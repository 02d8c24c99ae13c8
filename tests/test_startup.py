"""Start-up: the settings line names only what differs from the defaults, a first-time conversion shows
its progress (a bar on a terminal, log lines elsewhere) without third-party notices, and nothing that
start-up leaves running competes with the first request."""

from __future__ import annotations

import io
import logging
from typing import ClassVar

import pytest

from engine import model_loader
from engine.async_engine import AsyncEngine
from engine.progress import track
from spark_server import settings as settings_mod


def test_the_settings_line_shows_only_what_differs_from_the_defaults():
    settings, sources = settings_mod.resolve_with_sources({"port": 9000, "host": "127.0.0.1", "api_key": "k"},
                                                          environ={"SPARK_MAX_NUM_SEQS": "8"})
    line = settings_mod.describe(settings, sources)
    assert line == "settings: port=9000(flag) max_num_seqs=8(env) api_key='***'(flag)"  # host: set to its default
    everything = settings_mod.describe(settings, sources, everything=True)
    assert "host='127.0.0.1'(flag)" in everything and "block_size=16(default)" in everything
    assert len(everything.split()) > 50
    plain = settings_mod.resolve_with_sources({}, environ={})
    assert settings_mod.describe(*plain) == "settings: all defaults (--log-level debug lists them)"


def test_the_cli_lists_every_setting_with_debug_logging():
    import inspect

    from spark_server import cli

    assert 'everything=settings.log_level == "debug"' in inspect.getsource(cli._serve)


def test_progress_is_log_lines_in_a_log(caplog):
    log = logging.getLogger("test.progress")
    with caplog.at_level(logging.INFO, logger="test.progress"):
        assert list(track(range(8), "converting: de-quantizing tensors", log, unit="tensors",
                          terminal=False)) == list(range(8))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "converting: de-quantizing tensors: 0/8 tensors"
    assert any(line.startswith("converting: de-quantizing tensors: 4/8 tensors (50%") for line in lines)
    assert lines[-1].startswith("converting: de-quantizing tensors: 8/8 tensors done in")
    assert len(lines) <= 6  # a line a quarter, not one a tensor


def test_progress_is_a_bar_on_a_terminal(caplog):
    stream = io.StringIO()
    with caplog.at_level(logging.INFO, logger="test.progress"):
        list(track(range(5), "converting", logging.getLogger("test.progress"), unit="tensors", stream=stream,
                   terminal=True))
    assert "converting: 100%" in stream.getvalue() and "5/5" in stream.getvalue()
    assert not caplog.records  # the bar, not log lines


def test_the_conversion_reports_transformers_dequantization_loop(caplog):
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.tqdm
    with caplog.at_level(logging.INFO, logger="engine.model_loader"), model_loader.reported_dequantization():
        items = list(gguf_utils.tqdm(["a", "b", "c"], desc="Converting and de-quantizing GGUF tensors..."))
    assert items == ["a", "b", "c"] and gguf_utils.tqdm is original
    assert any("de-quantizing tensors: 3/3 tensors done" in r.getMessage() for r in caplog.records)


def test_the_legacy_tokenizer_notice_is_dropped_during_a_conversion(caplog):
    notice = logging.getLogger("transformers.models.llama.tokenization_llama_fast")
    with caplog.at_level(logging.WARNING):
        with model_loader._without_legacy_notice():
            notice.warning("You are using the default legacy behaviour of the <class 'LlamaTokenizerFast'>.")
            notice.warning("another warning")
        notice.warning("You are using the default legacy behaviour, outside a conversion")
    assert [r.getMessage() for r in caplog.records] == [
        "another warning", "You are using the default legacy behaviour, outside a conversion"]


def test_the_grammar_warm_up_is_done_before_the_engine_serves():
    """Built on a thread beside the first request, it made that request ~10x slower than the next."""
    order: list[str] = []

    class Core:
        tokenizer = model_info = None
        requests: ClassVar[dict] = {}

        def warm_grammars(self) -> None:
            order.append("warm")

        def has_unfinished(self) -> bool:
            return False

        def close_grammars(self) -> None: ...

    engine = AsyncEngine(Core())
    try:
        engine.start()
        order.append("started")
    finally:
        engine.shutdown()
    assert order == ["warm", "started"]


@pytest.mark.parametrize("record", ["You are using the default legacy behaviour of X"])
def test_the_filter_only_drops_that_notice(record):
    assert not model_loader._drop_legacy_notice(logging.makeLogRecord({"msg": record}))
    assert model_loader._drop_legacy_notice(logging.makeLogRecord({"msg": "anything else"}))
