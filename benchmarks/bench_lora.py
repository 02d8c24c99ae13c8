"""Multi-LoRA: aggregate decode tokens/s of 16 concurrent streams, each with a different rank-16
adapter on every projection, against the same load on the base model alone, in one run.

Bar (issue "LoRA"): >= 0.7x the base model's aggregate decode rate, measured while all 16 streams
decode (prefill excluded); the sum of each stream's 1/TPOT, which lets the others' prefill steps in,
is printed beside it.

    python -m benchmarks.bench_lora
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.common import print_table, run_load, save, start_engine, steady_decode_rate, token_requests, verdict
from engine.lora import module_shapes
from engine.request import LoraRef

STREAMS = 16
RANK = 16
PROMPT_LEN = 64
OUTPUT_LEN = 256


def write_adapters(root: Path, config, count: int) -> list[Path]:
    """Random rank-16 PEFT adapters on all seven projections (written directly, no training)."""
    shapes = module_shapes(config)
    paths = []
    for n in range(count):
        g = torch.Generator().manual_seed(n)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for module, (out_f, in_f) in shapes.items():
                group = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
                prefix = f"base_model.model.model.layers.{layer}.{group}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, in_f, generator=g) * 0.01
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, RANK, generator=g) * 0.01
        path = root / f"adapter{n}"
        path.mkdir()
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": RANK,
                                                              "target_modules": list(shapes)}))
        paths.append(path)
    return paths


def decode_rate(timings) -> float:
    return sum(1.0 / t.tpot for t in timings if t.tpot)


async def run() -> dict:
    engine = start_engine(max_loras=STREAMS, max_lora_rank=RANK, max_num_seqs=64)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            adapters = write_adapters(Path(tmp), engine.engine.lora_manager.config, STREAMS)
            await run_load(engine, token_requests("warm", 2, 32, 4), 2)
            base_reqs = token_requests("base", STREAMS, PROMPT_LEN, OUTPUT_LEN)
            _, base = await run_load(engine, base_reqs, STREAMS)
            lora_reqs = token_requests("lora", STREAMS, PROMPT_LEN, OUTPUT_LEN)
            for r, path in zip(lora_reqs, adapters):
                r.lora = LoraRef(name=path.name, path=str(path))
            _, lora = await run_load(engine, lora_reqs, STREAMS)
            # and once more on the base, to bracket machine noise
            _, base2 = await run_load(engine, token_requests("base2", STREAMS, PROMPT_LEN, OUTPUT_LEN), STREAMS)
        return {"base": steady_decode_rate(base), "lora": steady_decode_rate(lora),
                "base_again": steady_decode_rate(base2), "base_tpot_sum": decode_rate(base),
                "lora_tpot_sum": decode_rate(lora), "base_again_tpot_sum": decode_rate(base2),
                "dtype": engine.model_info.dtype, "loads": engine.engine.lora_manager.num_loads}
    finally:
        engine.shutdown()


def main() -> int:
    r = asyncio.run(run())
    base = (r["base"] + r["base_again"]) / 2
    ratio = r["lora"] / base
    base_sum = (r["base_tpot_sum"] + r["base_again_tpot_sum"]) / 2
    print_table(f"Multi-LoRA: {STREAMS} concurrent streams, rank {RANK} on all projections, {r['dtype']}",
                ["load", "decode tok/s, all streams decoding", "vs base", "sum of 1/TPOT", "vs base"],
                [["base model (mean of two runs)", base, "1.00x", base_sum, "1.00x"],
                 [f"{STREAMS} streams, {STREAMS} different adapters", r["lora"], f"{ratio:.2f}x",
                  r["lora_tpot_sum"], f"{r['lora_tpot_sum'] / base_sum:.2f}x"]])
    save("lora", r | {"ratio": ratio})
    return verdict({"16 adapters decode at >= 0.7x the base model": ratio >= 0.7})


if __name__ == "__main__":
    sys.exit(main())
