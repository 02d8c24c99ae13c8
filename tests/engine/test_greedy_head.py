"""The greedy head (engine/models/greedy_head.py, csrc/greedy_head.c): its bound holds, and its picks are the
full head's argmax, on random heads and through the real model's greedy generation."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.kernels import load_cpu_kernels
from engine.llm_engine import LLMEngine
from engine.models.greedy_head import GreedyHead
from engine.quant.formats import QuantizedWeight
from engine.request import GenerationRequest, TokensPrompt
from engine.sampling_params import SamplingParams

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.greedy_head_fast,
                                reason="no AVX512-VNNI build of the fused kernels here")


def _random_head(n: int, k: int, group: int, gen: torch.Generator) -> QuantizedWeight:
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.01 + 1e-4
    return QuantizedWeight("i8", codes, scales, None, group, "test")


@pytest.mark.parametrize("n, group, rows", [(1037, 32, 5), (2048, 32, 17), (515, 96, 8), (300, 576, 3)])
def test_bound_holds_and_picks_equal_the_fp32_argmax(n: int, group: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(n + rows)
    k = 576
    quantized = _random_head(n, k, group, gen)
    assert kernels is not None  # the module is skipped without them
    head = GreedyHead(quantized, kernels)
    h = torch.randn(rows, k, generator=gen)
    h[0, 7] = 60.0  # a massive activation: its block's other inputs round coarsely
    h[-1, 100:132] = 0.0  # an all-zero block
    h = h.to(torch.bfloat16)
    exact = h.float() @ quantized.dequantize().float().T
    hi, best = torch.empty(rows, n), torch.empty(rows)
    assert kernels.greedy_head_bounds(h, head.codes, head.meta, n, hi, best, [[] for _ in range(rows)])
    assert bool((exact <= hi).all())  # an upper bound on every token
    assert bool((best <= exact.max(-1).values).all())  # a lower bound on the row's best
    assert float((hi - exact).max()) < float(exact.abs().max()) / 4  # a bound, not a blanket
    assert bool((best >= exact.max(-1).values - exact.abs().max() / 4).all())

    # each odd row bans its two best tokens: -inf in hi, and the lower bound is the third's
    banned = [exact[r].topk(2).indices.tolist() if r % 2 else [] for r in range(rows)]
    want = exact.clone()
    for r, ids in enumerate(banned):
        want[r, ids] = float("-inf")
    assert kernels.greedy_head_bounds(h, head.codes, head.meta, n, hi, best, banned)
    for r, ids in enumerate(banned):
        assert hi[r, ids].tolist() == [float("-inf")] * len(ids)
    assert bool((best <= want.max(-1).values).all())
    assert head.pick(h, banned).token_ids.tolist() == want.argmax(-1).tolist()


def test_exact_picks_follow_torch_argmax_rules() -> None:
    """The candidates' exact logits (spark_greedy_exact): the dequantize-then-multiply reference's pick, the
    first of equal maxima, and a NaN logit over any number, as torch.argmax does."""
    gen = torch.Generator().manual_seed(11)
    n, k = 70, 576
    quantized = _random_head(n, k, 32, gen)
    quantized.codes[40] = quantized.codes[3]  # tokens 3 and 40: the same weights, the same logit
    quantized.scales[40] = quantized.scales[3]
    quantized.scales[60, 5] = float("nan")  # token 60's logit is NaN in every row
    assert kernels is not None  # the module is skipped without them
    head = GreedyHead(quantized, kernels)
    h = torch.randn(3, k, generator=gen).to(torch.bfloat16)
    exact = h.float() @ quantized.dequantize().T
    top = exact[0].nan_to_num(float("-inf")).topk(3).indices.sort().values
    idx = torch.zeros(3, 8, dtype=torch.int64)
    idx[0, :3] = top
    idx[1, :2] = torch.tensor([3, 40])
    idx[2, :4] = torch.tensor([5, 59, 60, 61])
    count = torch.tensor([3, 2, 4])
    picks = kernels.greedy_exact(h, head.codes, head.meta, idx, count).tolist()
    assert picks == [int(top[exact[0, top].argmax()]), 3, 60]


def _generate(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(f"g{i}", TokensPrompt(prompt),
                                             SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)))
    out: dict[str, list[int]] = {f"g{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[f"g{i}"] for i in range(len(prompts))]


def test_greedy_generation_equals_the_full_head() -> None:
    # The second run must compute every step exactly as the first did: no prefix cache (it would skip the
    # prompts), and no speculation, whose draft lengths follow the server's acceptance so far (the first
    # run's drafts change the second run's rows, and rows of another batch round their logits otherwise).
    engine = LLMEngine(EngineConfig(enable_prefix_caching=False, num_speculative_tokens=0))
    model = engine.runner.model
    if model.greedy_head is None:
        pytest.skip("the model's head is not int8 here")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist()
               for n in (12, 40, 75, 9, 130, 33, 60, 21, 48, 90, 15, 27, 66, 52, 38, 44, 81, 19, 25, 57)]
    picked = []
    pick = model.greedy_head.pick

    def counting(h, banned):
        out = pick(h, banned)
        picked.append(out is not None)
        return out

    model.greedy_head.pick = counting
    fast = _generate(engine, prompts, 24)
    assert sum(picked) >= 20  # the head took the decode steps (20 rows a step: a 16-row block and 4 more)
    model.greedy_head = None
    full = _generate(engine, prompts, 24)
    assert fast == full


@pytest.mark.parametrize("n, group", [(1037, 32), (300, 96), (64, 576)])
def test_the_head_built_from_the_packed_layout_equals_the_reference(n: int, group: int) -> None:
    """GreedyHead.build (the kernel library, one pass over the packed head) against GreedyHead(quantized),
    padding rows included."""
    from engine.models.linear import PackedLinear
    from engine.quant.packing import pack_quantized

    assert kernels is not None
    quantized = _random_head(n, 576, group, torch.Generator().manual_seed(n))
    built = GreedyHead.build(PackedLinear(pack_quantized(quantized), None, kernels, source="test"), kernels)
    reference = GreedyHead(quantized, kernels)
    assert built is not None
    assert torch.equal(built.codes, reference.codes) and torch.equal(built.meta, reference.meta)
