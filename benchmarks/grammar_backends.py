"""Why llguidance: compile time and per-step mask cost of xgrammar against llguidance on this CPU, the
same JSON schema, 32 rows in the same grammar state (the median of 20 fills).

xgrammar is not a dependency (its wheel pulls in triton on Linux x86-64); to run this:
    pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi
    PYTHONPATH=/tmp/xg python -m benchmarks.grammar_backends
"""
import json
import time

from transformers import AutoTokenizer

from engine.model_loader import resolve_model_dir

tok = AutoTokenizer.from_pretrained(resolve_model_dir(None))
SCHEMA = {"type": "object", "properties": {"fruits": {"type": "array", "minItems": 60, "items": {"type": "string", "maxLength": 12}}}, "required": ["fruits"]}
prefix = tok.encode('{"fruits":["apple","pe', add_special_tokens=False)
out = {}
import xgrammar as xgr

t = time.perf_counter(); info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)); tinfo = time.perf_counter() - t
comp = xgr.GrammarCompiler(info, max_threads=2)
t = time.perf_counter(); cg = comp.compile_json_schema(json.dumps(SCHEMA)); out["xgrammar compile ms"] = (time.perf_counter() - t) * 1000
ms = [xgr.GrammarMatcher(cg) for _ in range(32)]
for m in ms:
    for tid in prefix: m.accept_token(tid)
bm = xgr.allocate_token_bitmask(32, info.vocab_size)
ts = []
for _ in range(20):
    t = time.perf_counter()
    for i, m in enumerate(ms): m.fill_next_token_bitmask(bm, i)
    ts.append(time.perf_counter() - t)
out["xgrammar fill 32 rows ms (median)"] = sorted(ts)[10] * 1000
from engine.structured import Constraint, GrammarCompiler, MaskApplier

gc = GrammarCompiler(tok, len(tok), [2]); ma = MaskApplier(gc, 2)
t = time.perf_counter(); c = gc.compile(Constraint("json", json.dumps(SCHEMA))); m0 = c.new_matcher()
import llguidance
import llguidance.torch as lt

b1 = lt.allocate_token_bitmask(1, gc.tokenizer.vocab_size); lt.fill_next_token_bitmask(m0, b1, 0)
out["llguidance compile + first mask ms"] = (time.perf_counter() - t) * 1000
mls = [c.new_matcher() for _ in range(32)]
for m in mls:
    for tid in prefix: assert m.consume_token(tid)
b = lt.allocate_token_bitmask(32, gc.tokenizer.vocab_size)
ts = []
for _ in range(20):
    t = time.perf_counter(); lt.fill_next_token_bitmask_par(llguidance.LLExecutor(2), [(m, i) for i, m in enumerate(mls)], b); ts.append(time.perf_counter() - t)
out["llguidance fill 32 rows ms (median)"] = sorted(ts)[10] * 1000
for k, v in out.items(): print(f"{k}: {v:.2f}")
