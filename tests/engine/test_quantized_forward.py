"""The engine on quantized weights: the GGUF file's own blocks, and --quantization int8 / int4.

The packed kernels must compute what the weights mean: greedy answers on the GGUF blocks equal,
token for token, a forward whose linears dequantize the same blocks to fp32 and multiply in fp32
(ReferenceLinear), batched as the engine batches them.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from engine.config import EngineConfig
from engine.kernels import load_cpu_kernels
from engine.llm_engine import LLMEngine
from engine.models.linear import PackedLinear, ReferenceLinear
from engine.models.weights import attach_two_term_fallbacks, resolve_quantization
from engine.request import GenerationRequest, TokensPrompt
from engine.sampling_params import SamplingParams
from tests.engine.helpers import chat, kernels_for_every_batch, run_all, text_of, tokens_of
from tests.engine.test_greedy_matches_transformers import PROMPTS

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler: the fused CPU kernels are not built")
MAX_TOKENS = 24
NEAR_TIE_NAT = 0.5  # the widest gap at which two paths may part (_assert_greedy_agrees)


def _with_reference_linears(engine: LLMEngine) -> None:
    """Swap the engine's linears for the slow reference built from the very same quantized weights."""
    stored = {}
    model = engine.model
    for i, lw in enumerate(model.layers):
        for group, lin in (("qkv", lw.qkv), ("o", lw.o), ("gate_up", lw.gate_up), ("down", lw.down)):
            assert isinstance(lin, PackedLinear) and lin.quantized is not None
            stored[(i, group)] = lin.quantized
    head = model.lm_head
    assert isinstance(head, PackedLinear) and head.quantized is not None
    int8 = model.layers[0].qkv.int8_activations  # --linear-activations, as the engine resolved it
    for i, lw in enumerate(model.layers):
        lw.qkv = ReferenceLinear(stored[(i, "qkv")], lw.qkv.bias, int8_activations=int8)
        lw.o = ReferenceLinear(stored[(i, "o")], int8_activations=int8)
        lw.gate_up = ReferenceLinear(stored[(i, "gate_up")], int8_activations=int8)
        lw.down = ReferenceLinear(stored[(i, "down")], int8_activations=int8)
    model.lm_head = ReferenceLinear(head.quantized, int8_activations=int8)


def _gguf(activations: str = "bf16") -> LLMEngine:
    """The file's blocks on the packed kernels for every batch size. On a CPU with AMX tiles the start-up
    probe would hand large batches to the two-term oneDNN fallback, which rounds otherwise and has a test
    of its own (below); these tests are about the kernels, on every machine alike."""
    with kernels_for_every_batch():
        return LLMEngine(EngineConfig(device="cpu", dtype="bfloat16", quantization="gguf",
                                      linear_activations=activations, max_num_seqs=16, kv_cache_space_gib=0.5))


@pytest.fixture(scope="module")
def gguf_engine() -> LLMEngine:
    return _gguf()


def test_gguf_blocks_serve_the_files_own_weights(gguf_engine):
    model = gguf_engine.model
    sources = {lin.quantized.source for lw in model.layers for lin in (lw.qkv, lw.o, lw.gate_up, lw.down)}
    assert sources == {"gguf Q4_1"}  # the embedded file's layer type, not a bf16 copy
    assert model.lm_head.quantized.source == "gguf Q8_0"  # tied to the Q8_0 token embedding
    # 4-bit blocks: about a third of the bf16 bytes
    packed = sum(lin.packed.data.numel() for lw in model.layers for lin in (lw.qkv, lw.o, lw.gate_up, lw.down))
    dense = sum(lin.in_features * lin.out_features * 2 for lw in model.layers
                for lin in (lw.qkv, lw.o, lw.gate_up, lw.down))
    assert packed < 0.35 * dense


def _logprobs_of(outs) -> list:
    return [lp for o in outs for lp in (o.logprobs or [])]


def _greedy_requests() -> list:
    return [chat(f"p{i}", p, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=5)
            for i, p in enumerate(PROMPTS)]


def _assert_greedy_agrees(fast: dict, slow: dict) -> None:
    """Token for token, except past a genuine near-tie: there both paths' bf16 activations are equally
    right, and the first divergence must be between top candidates of both, less than NEAR_TIE_NAT apart
    (bf16 activation noise; vLLM's check_logprobs_close, with a margin). That check is the precise one.
    The margin is that noise as measured: where both paths chose the same tokens, a top candidate's
    logprob differed between them by up to 0.37 nat on the AVX512-BF16 path and 0.45 on the AVX2 one
    (mean 0.05 on both; 8 prompts x 16 tokens, AMD EPYC Zen 4), and the AVX2 build's one divergence came
    at a 0.38-nat gap. A broken kernel moves logprobs by whole nats and diverges in nearly every prompt.
    Which prompts diverge moves with any change of summation order (the fp32 reference's own matmul
    blocking follows the thread count and the CPU): 2-4 of the 8 on an AMD EPYC, at gaps of 0.005-0.21 nat,
    three of them at the same tokens on both kernel paths (the reference's own gap there 0.008-0.23 nat);
    5 of 8 through the two-term oneDNN fallback on an Intel Xeon with AMX tiles. So the count is bounded
    loosely, against a path that drifts off at a near-tie in nearly every prompt."""
    identical = 0
    for i, prompt in enumerate(PROMPTS):
        a, b = tokens_of(fast[f"p{i}"]), tokens_of(slow[f"p{i}"])
        if a == b:
            identical += 1
            continue
        at = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        top_a = dict(_logprobs_of(fast[f"p{i}"])[at].top)
        top_b = dict(_logprobs_of(slow[f"p{i}"])[at].top)
        detail = (prompt, at, top_a, top_b)
        assert b[at] in top_a and a[at] in top_b, detail
        assert top_a[a[at]] - top_a[b[at]] < NEAR_TIE_NAT and top_b[b[at]] - top_b[a[at]] < NEAR_TIE_NAT, detail
    assert identical >= len(PROMPTS) // 4, f"only {identical} of {len(PROMPTS)} prompts match token for token"


@pytest.fixture(scope="module")
def reference_answers() -> dict:
    """On one thread: the fp32 reference's matmul blocking, and so which near-ties fall which way,
    follows torch's thread count; the answers compared against must not move with the machine's."""
    reference = _gguf()
    _with_reference_linears(reference)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_all(reference, _greedy_requests())
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("path", ["dot", "fma"])
def test_gguf_greedy_equals_the_reference_forward(gguf_engine, reference_answers, path):
    """On each of the kernels' fast paths (the start-up choice picks one per CPU; both run here)."""
    assert not any(lw.down.int8_activations for lw in gguf_engine.model.layers)  # bf16 activations by default
    if path not in kernels.linear_paths:
        pytest.skip(f"this build has no {path!r} path")
    with kernels.on_linear_path(path):
        _assert_greedy_agrees(run_all(gguf_engine, _greedy_requests()), reference_answers)


def test_gguf_greedy_through_the_two_term_fallback_equals_the_reference_forward(reference_answers):
    """Where the start-up probe hands large batches to oneDNN (AMX), the file's weights still run:
    forced here for every batch of more than one row (prefills and batched decode alike)."""
    engine = _gguf()
    layers = [lin for lw in engine.model.layers for lin in (lw.qkv, lw.o, lw.gate_up, lw.down)]
    attach_two_term_fallbacks(layers, rows=1)
    batches = []
    inner = layers[0].fallback
    layers[0].fallback = lambda x: batches.append(x.shape[0]) or inner(x)
    _assert_greedy_agrees(run_all(engine, _greedy_requests()), reference_answers)
    assert batches and max(batches) > 1


def _references(int8_activations: bool = False):
    """Each packed linear's reference, built once (it dequantizes the weights) on the first call that asks."""
    built: dict[int, ReferenceLinear] = {}

    def reference(linear: PackedLinear) -> ReferenceLinear:
        if id(linear) not in built:
            assert linear.quantized is not None
            built[id(linear)] = ReferenceLinear(linear.quantized, linear.bias, int8_activations=int8_activations)
        return built[id(linear)]
    return reference


def test_int8_activations_compute_their_reference_in_the_model(monkeypatch):
    """--linear-activations int8, on the model's own activations (massive ones included: this model's
    down projections see inputs in the thousands): every 4-bit linear of a prefill equals the int8
    reference within fp32 rounding, and the answer is still right. Whole greedy sequences are not
    compared: a one-ulp difference upstream flips an int8 code, and the two paths drift apart far
    more than with bf16 activations (the README's accuracy table measures what the mode costs)."""
    engine = _gguf("int8")
    engine.model.layers_in_one_call = False  # each projection through PackedLinear.__call__, to be watched
    seen = []
    kernel_call = PackedLinear.__call__
    references = _references(int8_activations=True)

    def checked(self, x, fp32_out=False):
        y = kernel_call(self, x, fp32_out=True)
        if self.int8_activations:
            want = references(self)(x, fp32_out=True)
            scale = want.abs().amax(dim=1, keepdim=True) + 1.0
            seen.append(float(((y - want).abs() / scale).max()))
        return y if fp32_out else y.to(x.dtype)

    monkeypatch.setattr(PackedLinear, "__call__", checked)
    out = run_all(engine, [chat("f", "What is the capital of France?", max_tokens=12, temperature=0)])["f"]
    assert len(seen) >= 4 * len(engine.model.layers)  # every layer's four projections, at least once
    assert max(seen) < 1e-5, max(seen)
    assert "Paris" in text_of(out)


@pytest.mark.parametrize("per_row", [True, False], ids=["one-call-per-row", "runs-and-gathered"])
def test_int8_prompt_activations_split_each_prompt_step_by_row(monkeypatch, per_row):
    """--linear-activations int8-prompt: in a step that prefills a prompt, each 4-bit projection takes its
    prompt rows on int8 activations and the row that gives the logits on exact ones, each equal to its
    reference; decode steps run exact alone; the answer is still right. Where the kernels take a mode per
    row, in one call; elsewhere the prompt rows in one call and the logits row in another."""
    engine = _gguf("int8-prompt")
    assert not any(lw.down.int8_activations for lw in engine.model.layers)  # nothing int8 by default
    if per_row and not engine.model.layers[0].down.takes_int8_rows:
        pytest.skip("no mode per row on this build's path (it needs the VNNI int8 and AVX512-BF16 dot tiles)")
    if not per_row:
        monkeypatch.setattr(PackedLinear, "takes_int8_rows", False)
    engine.model.layers_in_one_call = False  # decode steps through PackedLinear.__call__ too, to be watched
    calls: list[tuple[bool | None, int, tuple[int, ...] | None]] = []
    errors = []
    kernel_call = PackedLinear.__call__
    references = _references()

    def checked(self, x, fp32_out=False, int8=None, out=None, int8_rows=None):
        y = kernel_call(self, x, fp32_out=True, int8=int8, int8_rows=int8_rows)
        if self.takes_int8_activations:
            calls.append((int8, x.shape[0], tuple(int8_rows.tolist()) if int8_rows is not None else None))
            reference = references(self)
            want = (reference(x, fp32_out=True, int8_rows=int8_rows) if int8_rows is not None
                    else reference(x, fp32_out=True, int8=bool(int8)))
            errors.append(float(((y - want).abs() / (want.abs().amax(dim=1, keepdim=True) + 1.0)).max()))
        y = y if fp32_out else y.to(x.dtype)
        return y if out is None else out.copy_(y)

    monkeypatch.setattr(PackedLinear, "__call__", checked)
    request = chat("f", "What is the capital of France?", max_tokens=6, temperature=0)
    prompt_len = len(engine.encode_prompt(request.prompt))
    out = run_all(engine, [request])["f"]
    per_step = 4 * len(engine.model.layers)  # the 4-bit projections of one step, each called once
    if per_row:  # each projection once, its prompt rows flagged and its logits row not
        prefill, decodes = calls[:per_step], calls[per_step:]
        assert set(prefill) == {(None, prompt_len, (1,) * (prompt_len - 1) + (0,))}
    else:  # each projection twice: its prompt rows, then its logits row
        prefill, decodes = calls[:2 * per_step], calls[2 * per_step:]
        assert set(prefill[0::2]) == {(True, prompt_len - 1, None)}
        assert set(prefill[1::2]) == {(False, 1, None)}
    assert {(int8, rows) for int8, _, rows in decodes} == {(None, None)}  # decode steps: exact, the usual call
    assert max(errors) < 1e-5, max(errors)
    assert "Paris" in text_of(out)
    # the scheduler's unit is a prompt row on int8: a decoding row, exact, costs the measured ratio of the rates
    rates, costs = engine.model.builder.rates, engine.scheduler.cost_model
    assert rates is not None and rates.exact_batch_macs_per_s
    assert costs.decode_row_cost == pytest.approx(rates.batch_macs_per_s / rates.exact_batch_macs_per_s)


def _logprob_bits(outs) -> list[tuple[int, float]]:
    return [(lp.token_id, lp.logprob) for lp in _logprobs_of(outs)]


@pytest.fixture(scope="module")
def int8_prompt_engine() -> LLMEngine:
    return _gguf("int8-prompt")


def _record_row_modes(monkeypatch) -> list[list[int]]:
    """Each forward's int8 flags per row ([] where every row is exact), as the model derives them."""
    from engine.models.llama import LlamaForCausalLM

    flags: list[list[int]] = []
    prompt_rows = LlamaForCausalLM._prompt_rows

    def recorded(self, *args, **kwargs):
        rows = prompt_rows(self, *args, **kwargs)
        flags.append(rows.flags.tolist() if rows is not None else [])
        return rows

    monkeypatch.setattr(LlamaForCausalLM, "_prompt_rows", recorded)
    return flags


@pytest.mark.parametrize("whole_blocks", [False, True], ids=["prompt-ends-mid-block", "prompt-fills-its-blocks"])
def test_int8_prompt_a_next_turn_over_a_cached_answer_equals_a_cold_start(int8_prompt_engine, whole_blocks):
    """Under int8-prompt an answer's rows, and a prompt's last row, are computed exact, and a later prompt
    holding them computes them on int8, so their KV is not what a next turn computes cold. The cache keys
    such blocks by their rows' roles: the next turn reads only the first turn's blocks of prompt rows, and
    answers bit for bit as it would on a server that never saw the first turn (with the answer's blocks
    shared, its logprobs moved by ~0.1 nat). A prompt that fills its last block puts its last row, exact,
    in a block of its own prompt: that block is not shared either."""
    warm = int8_prompt_engine
    warm.block_manager.hash_to_block.clear()  # an empty prefix cache, as on a fresh server
    prompt = warm.encode_prompt(chat("x", "Tell me a short story about a lighthouse keeper.").prompt)
    bs = warm.block_manager.block_size
    if whole_blocks:
        prompt = prompt[:len(prompt) // bs * bs]
    assert (len(prompt) % bs == 0) == whole_blocks
    first = GenerationRequest("first", TokensPrompt(prompt), SamplingParams(max_tokens=40, temperature=0))
    answer = tokens_of(run_all(warm, [first])["first"])
    ids = prompt + answer + warm.encode_prompt(chat("x", "And then?").prompt)

    def next_turn() -> GenerationRequest:
        return GenerationRequest("next", TokensPrompt(ids), SamplingParams(max_tokens=8, temperature=0, logprobs=True))

    over_cache = run_all(warm, [next_turn()])["next"]
    assert over_cache[-1].num_cached_tokens == (len(prompt) - 1) // bs * bs  # the first turn's prompt rows
    warm.block_manager.hash_to_block.clear()  # the same server, its cache emptied: a cold start
    cold = run_all(warm, [next_turn()])["next"]
    assert cold[-1].num_cached_tokens == 0
    assert _logprob_bits(over_cache) == _logprob_bits(cold)


def test_int8_prompt_rows_of_a_prompt_whose_logprobs_are_read_are_all_exact(int8_prompt_engine, monkeypatch):
    """Every prompt row of a request that reads its prompt's logprobs is exact, in each of its samples: the
    second sample reuses the first's blocks or computes them itself (when they were evicted), the same way."""
    flags = _record_row_modes(monkeypatch)
    out = run_all(int8_prompt_engine, [chat("pl", "Name three rivers of Europe.", max_tokens=2, temperature=0.7, n=2,
                                            prompt_logprobs=1)])["pl"]
    assert out and flags and all(not f for f in flags)


def test_int8_prompt_a_recomputed_sequence_keeps_its_outputs_exact(int8_prompt_engine, monkeypatch):
    """After a preemption whose blocks were then evicted, a sequence's prompt and outputs are prefilled again:
    its prompt's leading rows on int8 as before, its outputs (decoded exact) exact again, so the preemption
    another request caused does not change its rows' activation modes."""
    engine = int8_prompt_engine
    flags = _record_row_modes(monkeypatch)
    engine.add_request(chat("p", "Name three rivers of Europe.", max_tokens=16, temperature=0))
    seq = engine.requests["p"][0]
    while seq.num_output_tokens < 5:
        engine.step()
    engine.scheduler._preempt(seq)
    engine.block_manager.hash_to_block.clear()  # its blocks reused by others meanwhile
    flags.clear()
    total = len(seq.token_ids)
    engine.step()  # the recompute, whole in one step
    prompt = seq.num_prompt_tokens
    assert seq.num_cached_tokens == 0
    assert flags[0] == [1] * (prompt - 1) + [0] * (total - prompt + 1)
    while engine.has_unfinished():
        engine.step()
    assert seq.num_output_tokens == 16


@pytest.mark.parametrize("path", ["chosen", "fma"])
def test_a_seeded_answer_is_the_same_alone_and_beside_other_requests(gguf_engine, path):
    """On the GGUF blocks a seeded sampled answer is the same, to the last bit of each logprob, alone and with
    one to three other requests in its steps, on the path start-up chose (the `dot` path on CPUs with
    AVX512-BF16) and on the fp32 FMA path (chosen where `vdpbf16ps` issues slowly): every kernel pass adds a
    row's products in one order, whatever rows share its call. Before, rows in passes of one to three split
    their sums over more chains (and 16-row FMA passes multiplied dequantized weights), and this answer
    changed by its third token."""
    if path == "fma" and "fma" not in kernels.linear_paths:
        pytest.skip(f"this build has no fma path (it has: {kernels.linear_paths})")

    def seeded(rid: str) -> GenerationRequest:
        return chat(rid, "Write a short poem about the sea.", max_tokens=24, temperature=0.7, seed=7, logprobs=True)

    others = [chat(f"o{i}", q, max_tokens=24, temperature=0.7, seed=i)
              for i, q in enumerate(["Name a fruit.", "Tell me about Paris.", "What is 2+2?"])]
    with kernels.on_linear_path(path) if path != "chosen" else nullcontext():
        gguf_engine.block_manager.hash_to_block.clear()
        alone = _logprob_bits(run_all(gguf_engine, [seeded("alone")])["alone"])
        for k in range(1, 4):
            gguf_engine.block_manager.hash_to_block.clear()  # each run computes its prompt, as the first did
            together = run_all(gguf_engine, [seeded(f"with{k}")] + others[:k])[f"with{k}"]
            assert _logprob_bits(together) == alone, k


def test_a_greedy_answer_through_the_greedy_head_is_the_same_alone_and_beside_other_requests(gguf_engine,
                                                                                           monkeypatch):
    """Greedy requests without logprobs take their tokens from the greedy head (an int8 pass with a bound,
    then the candidates' exact logits): its picks are the exact argmax, so they cannot follow the batch
    either. Checked with requests whose picks go through it (no logprobs asked)."""
    kern = gguf_engine.model.kernels
    if kern is None or not kern.greedy_head_fast:
        pytest.skip("no greedy head on this build (the head runs as a plain linear)")
    bounds = kern.greedy_head_bounds
    passes = []
    monkeypatch.setattr(kern, "greedy_head_bounds", lambda *a, **k: passes.append(1) or bounds(*a, **k))

    def greedy(rid: str) -> GenerationRequest:
        return chat(rid, "Write a short poem about the sea.", max_tokens=32, temperature=0)

    others = [chat(f"g{i}", q, max_tokens=32, temperature=0.7, seed=i)
              for i, q in enumerate(["Name a fruit.", "Tell me about Paris.", "What is 2+2?"])]
    gguf_engine.block_manager.hash_to_block.clear()
    alone = tokens_of(run_all(gguf_engine, [greedy("alone")])["alone"])
    for k in range(1, 4):
        gguf_engine.block_manager.hash_to_block.clear()
        assert tokens_of(run_all(gguf_engine, [greedy(f"with{k}")] + others[:k])[f"with{k}"]) == alone, k
    assert passes  # the picks went through the greedy head


@pytest.mark.parametrize("tail", [1, 5])
def test_an_answer_is_the_same_whatever_the_prefix_cache_held_of_its_prompt(gguf_engine, tail):
    """A prompt's rows go through the prefill path however few of them a step computes: a repeated request
    whose cached prefix leaves one token to compute answers bit for bit as it did cold. Before, that last
    prompt row ran through the decode attention kernel, which rounds otherwise, and moved the first token's
    logprob by 0.07 nat."""
    engine = gguf_engine
    bs = engine.block_manager.block_size
    ids = engine.encode_prompt(chat("x", "Describe a tower and the town around it in a few words, please.").prompt)
    ids = ids[:(len(ids) - tail) // bs * bs + tail]  # whole blocks, then ``tail`` tokens

    def answer(rid: str) -> tuple[list[tuple[int, float]], int]:
        request = GenerationRequest(rid, TokensPrompt(ids), SamplingParams(max_tokens=4, temperature=0, logprobs=True))
        out = run_all(engine, [request])[rid]
        return _logprob_bits(out), out[-1].num_cached_tokens

    engine.block_manager.hash_to_block.clear()
    cold, cached_cold = answer("cold")
    warm, cached_warm = answer("warm")
    assert (cached_cold, cached_warm) == (0, len(ids) - tail)
    assert warm == cold


def test_under_batch_invariant_a_next_turn_over_a_cached_answer_answers_as_on_a_fresh_server():
    """An answer's rows run through the decode attention kernel, which rounds otherwise than the prefill a
    later prompt holding those tokens takes. Under --batch-invariant an answer's blocks serve only its own
    sequence: a continuation holding the answer computes it again, and its seeded answer is bit for bit the
    one a fresh server gives (without the flag it reads the answer's cached KV: faster, not identical)."""
    with kernels_for_every_batch():
        engine = LLMEngine(EngineConfig(device="cpu", dtype="bfloat16", quantization="gguf", batch_invariant=True,
                                        kv_cache_space_gib=0.25))
    ids = engine.encode_prompt(chat("x", "Once upon a time in a small village there lived a curious fox").prompt)
    answer = tokens_of(run_all(engine, [GenerationRequest("first", TokensPrompt(ids), SamplingParams(
        max_tokens=40, temperature=0))])["first"])

    def continuation(rid: str) -> tuple[list[tuple[int, float]], int]:
        out = run_all(engine, [GenerationRequest(rid, TokensPrompt(ids + answer), SamplingParams(
            max_tokens=12, temperature=1.0, seed=7, logprobs=True))])[rid]
        return _logprob_bits(out), out[-1].num_cached_tokens

    warm, cached = continuation("warm")
    engine.block_manager.hash_to_block.clear()  # the same server, its cache emptied: a fresh start
    cold, _ = continuation("cold")
    bs = engine.block_manager.block_size
    assert cached == (len(ids) - 1) // bs * bs  # the first turn's prompt rows, none of its answer's
    assert warm == cold


def test_gguf_answers_a_factual_question(gguf_engine):
    out = run_all(gguf_engine, [chat("f", "What is the capital of France?", max_tokens=12, temperature=0)])["f"]
    assert "Paris" in text_of(out)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_modes_answer_and_cache_their_weights(mode, tmp_path, monkeypatch):
    from engine.quant import cache, calibration

    monkeypatch.setattr(cache, "default_cache_dir", lambda: tmp_path)  # a fresh quantization cache
    # int8's calibration, tiny: the path (two plain starts, two chat answers), not the accuracy (bench_kernels
    # measures that); GPTQ's damping keeps a Hessian of fewer tokens than inputs invertible
    monkeypatch.setattr(calibration, "DEFAULT_SEQUENCES", 4)
    monkeypatch.setattr(calibration, "DEFAULT_LENGTH", 16)
    # a context limit shorter than a calibration sequence (1 + 16 and ~40 + 16 tokens) binds serving, not
    # int8's calibration
    first = LLMEngine(EngineConfig(device="cpu", dtype="bfloat16", quantization=mode, num_kv_blocks=64,
                                   max_model_len=16))
    kind, source = ("i8", "int8 gptq") if mode == "int8" else ("u4", "int4")
    assert {(lw.gate_up.quantized.kind, lw.gate_up.quantized.source) for lw in first.model.layers} == {(kind, source)}
    cached = list((tmp_path / "quantized").glob(f"{mode}-*.safetensors"))
    assert len(cached) == 1
    second = LLMEngine(EngineConfig(device="cpu", dtype="bfloat16", quantization=mode, num_kv_blocks=64))
    assert not second.model.builder.made  # read back, not quantized again
    a = first.model.layers[3].down.quantized
    b = second.model.layers[3].down.quantized
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    # The answer's own start is given: the open question's first token is a near-tie ("The" -1.83 / "L"
    # -1.96 nat with this small calibration, AMD EPYC), which an AMX machine's calibration tipped into
    # "L'Étoile"; after "The capital of France is", " Paris" leads by ~4.3-4.6 nat in bf16, int8 and int4.
    question = second.encode_prompt(chat("f", "What is the capital of France?").prompt)
    answer_start = second.tokenizer.encode("The capital of France is", add_special_tokens=False)
    out = run_all(second, [GenerationRequest("f", TokensPrompt(question + answer_start),
                                             SamplingParams(max_tokens=3, temperature=0))])["f"]
    assert text_of(out).startswith(" Paris"), text_of(out)


def test_quantization_needs_what_it_names():
    with pytest.raises(ValueError, match="bfloat16"):
        LLMEngine(EngineConfig(device="cpu", dtype="float32", quantization="int8", kv_cache_space_gib=0.5))
    with pytest.raises(ValueError, match="must be one of"):
        LLMEngine(EngineConfig(quantization="int3"))
    with pytest.raises(ValueError, match="--linear-activations int8 applies to 4-bit weights"):
        LLMEngine(EngineConfig(device="cpu", dtype="bfloat16", quantization="int8", linear_activations="int8"))


@pytest.mark.parametrize("mode", ["int8", "int4", "gguf"])
def test_quantization_on_an_accelerator_says_it_is_a_cpu_mode(mode):
    """The quantized kernels are CPU code: on an accelerator the refusal names the device and the way out
    rather than a C compiler (whose kernels are never built there)."""
    for device in ("cuda", "xpu"):  # (torch names "npu" only once torch_npu is imported)
        with pytest.raises(ValueError, match=f"--quantization {mode} runs on the fused CPU kernels, not on {device}"):
            resolve_quantization(mode, True, None, torch.bfloat16, torch.device(device))
    assert resolve_quantization("auto", True, None, torch.bfloat16, torch.device("cuda")) == "none"
