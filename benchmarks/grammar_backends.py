"""Why llguidance: compile time and per-step mask cost of xgrammar against llguidance on this CPU, the
same JSON schema, 32 rows in the same grammar state (the median of 20 fills).

xgrammar is not a dependency (its wheel pulls in triton on Linux x86-64); to run this:
    pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi
    PYTHONPATH=/tmp/xg python -m benchmarks.grammar_backends
"""
import json
import statistics
import time
from typing import Any

from transformers import AutoTokenizer

from engine.model_loader import resolve_model_dir
from engine.structured import Constraint, GrammarCompiler

SCHEMA = {"type": "object", "properties": {"fruits": {"type": "array", "minItems": 60,
                                                      "items": {"type": "string", "maxLength": 12}}},
          "required": ["fruits"]}
ROWS, FILLS = 32, 20


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def xgrammar_times(tok: Any, prefix: list[int]) -> dict[str, float]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    out = {"xgrammar compile ms": _ms_since(start)}
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(ROWS)]
    for matcher in matchers:
        for tid in prefix:
            matcher.accept_token(tid)
    bitmask = xgr.allocate_token_bitmask(ROWS, info.vocab_size)
    fills = []
    for _ in range(FILLS):
        start = time.perf_counter()
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)
        fills.append(_ms_since(start))
    out[f"xgrammar fill {ROWS} rows ms (median)"] = statistics.median_high(fills)
    return out


def llguidance_times(tok: Any, prefix: list[int]) -> dict[str, float]:
    import llguidance
    import llguidance.torch as lt

    compiler = GrammarCompiler(tok, len(tok), [2])
    start = time.perf_counter()
    compiled = compiler.compile(Constraint("json", json.dumps(SCHEMA)))
    first = compiled.new_matcher()
    lt.fill_next_token_bitmask(first, lt.allocate_token_bitmask(1, compiler.tokenizer.vocab_size), 0)
    out = {"llguidance compile + first mask ms": _ms_since(start)}
    matchers = [compiled.new_matcher() for _ in range(ROWS)]
    for matcher in matchers:
        for tid in prefix:
            if not matcher.consume_token(tid):
                raise SystemExit(f"llguidance refused prefix token {tid}")
    bitmask = lt.allocate_token_bitmask(ROWS, compiler.tokenizer.vocab_size)
    fills = []
    for _ in range(FILLS):
        start = time.perf_counter()
        lt.fill_next_token_bitmask_par(llguidance.LLExecutor(2), [(m, i) for i, m in enumerate(matchers)], bitmask)
        fills.append(_ms_since(start))
    out[f"llguidance fill {ROWS} rows ms (median)"] = statistics.median_high(fills)
    return out


def main() -> None:
    tok = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    prefix = tok.encode('{"fruits":["apple","pe', add_special_tokens=False)
    for name, value in {**xgrammar_times(tok, prefix), **llguidance_times(tok, prefix)}.items():
        print(f"{name}: {value:.2f}")


if __name__ == "__main__":
    main()
