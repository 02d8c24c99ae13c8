"""--quantization int8's rounding: GPTQ against calibrated input statistics (engine/quant/gptq.py),
and the calibration that measures them (engine/quant/calibration.py)."""

from __future__ import annotations

import pytest
import torch

from engine.models import weights
from engine.quant import calibration
from engine.quant.calibration import input_second_moments, sample_on_engine, sample_tokens
from engine.quant.formats import quantize_int8
from engine.quant.gptq import quantize_int8_gptq


def _correlated_inputs(cols: int, gen: torch.Generator):
    """A source of inputs with correlated columns of very different sizes, as a layer's inputs are."""
    sizes = 0.2 + 3 * torch.rand(cols, generator=gen)
    mix = (torch.randn(cols, cols, generator=gen) / cols ** 0.5 + torch.eye(cols)) * sizes
    return lambda rows: torch.randn(rows, cols, generator=gen) @ mix


def _output_error(x: torch.Tensor, w: torch.Tensor, q) -> float:
    return float(((x @ (w - q.dequantize()).T) ** 2).mean())


@pytest.mark.parametrize("out_features,in_features", [(48, 200), (7, 300), (64, 64)])  # ragged column blocks
def test_gptq_rounds_to_a_smaller_output_error_than_round_to_nearest(out_features, in_features):
    gen = torch.Generator().manual_seed(out_features + in_features)
    w = torch.randn(out_features, in_features, generator=gen) * 0.05
    inputs = _correlated_inputs(in_features, gen)
    calibration, held_out = inputs(4 * in_features), inputs(1000)  # fitted on one draw, judged on another
    hessian = calibration.T @ calibration / calibration.shape[0]
    gptq, rtn = quantize_int8_gptq(w, hessian), quantize_int8(w)
    # the same format: int8 codes in [-127, 127] against round-to-nearest's per-channel absmax scale
    assert gptq.kind == "i8" and gptq.group == in_features and gptq.codes.dtype == torch.int8
    assert torch.equal(gptq.scales, rtn.scales)
    assert int(gptq.codes.abs().max()) <= 127
    # the codes stay next to the weights (each within a few steps), and the outputs get closer
    assert float(((gptq.dequantize() - w) / gptq.scales).abs().max()) < 3
    assert _output_error(held_out, w, gptq) < 0.8 * _output_error(held_out, w, rtn)


def test_gptq_is_round_to_nearest_when_inputs_are_uncorrelated():
    """No correlation, nothing to compensate with: every code is the nearest one."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(32, 160, generator=gen)
    hessian = torch.diag(torch.rand(160, generator=gen) + 0.1)
    hessian[5, 5] = 0.0  # an input never seen in calibration
    assert torch.equal(quantize_int8_gptq(w, hessian).codes, quantize_int8(w).codes)


def test_parts_reading_one_input_are_rounded_as_one_matrix_with_each_parts_own_codes(monkeypatch, caplog):
    """q/k/v (and gate/up) share their inputs' statistic: the builder rounds them stacked, in one pass,
    and each part's codes and scales are exactly what rounding it alone gives. A part reading another
    input (o) is rounded on its own."""
    gen = torch.Generator().manual_seed(11)
    cols = 64
    inputs = _correlated_inputs(cols, gen)
    x, other = inputs(400), inputs(400)
    shared, own = x.T @ x / 400, other.T @ other / 400
    names = ["q.weight", "k.weight", "v.weight"]
    parts = [torch.randn(rows, cols, generator=gen) * 0.05 for rows in (64, 16, 16)]
    hessians = {name: shared.clone() for name in names} | {"o.weight": own}
    rounded = []
    monkeypatch.setattr(weights, "quantize_int8_gptq", lambda w, h: rounded.append(w.shape) or quantize_int8_gptq(w, h))
    builder = weights.LinearBuilder("int8", torch.bfloat16, torch.device("cpu"), None, hessians=hessians,
                                    reference=True)
    monkeypatch.setattr(weights, "PROGRESS_EVERY_S", 0.0)  # a progress line after every rounding
    with caplog.at_level("INFO", logger=weights.logger.name):
        builder.build(names, parts, None)
        builder.build(["o.weight"], [parts[0]], None)
    assert rounded == [(96, cols), (64, cols)]
    assert [r.getMessage() for r in caplog.records] == ["int8: 3 of 4 weights rounded", "int8: 4 of 4 weights rounded"]
    for name, weight in zip(names, parts):
        alone = quantize_int8_gptq(weight, shared)
        assert torch.equal(builder.made[name].codes, alone.codes), name
        assert torch.equal(builder.made[name].scales, alone.scales), name
    assert torch.equal(builder.made["o.weight"].codes, quantize_int8_gptq(parts[0], own).codes)


def test_gptq_refuses_a_hessian_of_the_wrong_size():
    with pytest.raises(ValueError, match="inputs"):
        quantize_int8_gptq(torch.zeros(4, 8), torch.eye(6))


def test_calibration_samples_the_model_reproducibly_and_measures_every_linear(hf_model, llm_engine, monkeypatch,
                                                                             caplog):
    tokenizer = llm_engine.tokenizer

    def on_engine(starts, length, seed):
        return sample_on_engine(llm_engine, starts, length, seed)

    monkeypatch.setattr(calibration, "PROGRESS_EVERY_S", 0.0)  # a progress line after every step
    with caplog.at_level("INFO", logger=calibration.logger.name):
        tokens, mask = sample_tokens(on_engine, tokenizer, sequences=4, length=10)
    assert [r.getMessage() for r in caplog.records] == [f"int8 calibration: {k} of 10 tokens sampled"
                                                         for k in range(1, 10)]
    again, _ = sample_tokens(on_engine, tokenizer, sequences=4, length=10)
    assert torch.equal(tokens, again)  # seeded
    other, _ = sample_tokens(on_engine, tokenizer, sequences=4, length=10, seed=1)
    assert not torch.equal(tokens, other)  # sampled, not greedy
    assert tokens.shape == mask.shape and (mask[:, -10:] == 1).all()
    assert mask[0].sum() == 11 and mask[1].sum() > 11  # a one-token start; a chat request, left-padded
    chat_start = tokens[1][mask[1].bool()][:-10].tolist()
    assert tokenizer.decode(chat_start).rstrip().endswith("assistant")  # the template's assistant turn
    moments = input_second_moments(hf_model, tokens, mask)
    linears = {f"{name}.weight" for name, m in hf_model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(moments) == linears
    hidden = hf_model.config.hidden_size
    q = moments["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (hidden, hidden) and torch.allclose(q, q.T)
    assert torch.equal(q, moments["model.layers.0.self_attn.v_proj.weight"])  # one input, one statistic
    # the first layer's q projection reads the normed embeddings of exactly the real tokens
    layer = hf_model.model.layers[0]
    x = layer.input_layernorm(hf_model.model.embed_tokens(tokens)).reshape(-1, hidden)[mask.reshape(-1).bool()]
    assert torch.allclose(q, x.T @ x / x.shape[0], rtol=1e-4, atol=1e-5)
    # the head's statistic is of the decoder's output (its final norm included), though no logits are made
    with torch.inference_mode():
        final = hf_model.model(input_ids=tokens, attention_mask=mask,
                               position_ids=(mask.cumsum(1) - 1).clamp(min=0)).last_hidden_state
    h = final.reshape(-1, hidden)[mask.reshape(-1).bool()]
    assert torch.allclose(moments["lm_head.weight"], h.T @ h / h.shape[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n", [1, 5, 128, 129, 300])
def test_the_triangular_inverse_by_halves_inverts(n):
    from engine.quant.gptq import _lower_triangular_inverse

    x = torch.randn(n, 2 * n + 1, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    lower = torch.linalg.cholesky(x @ x.t() / n + torch.eye(n, dtype=torch.float64))
    inverse = _lower_triangular_inverse(lower)
    assert torch.equal(inverse, inverse.tril())
    assert torch.allclose(inverse @ lower, torch.eye(n, dtype=torch.float64), atol=1e-10)
