"""Multi-turn prefix reuse: a 6-turn conversation over a ~1,500-token history, as a Spark client
resends it every turn; TTFT of each turn with the prefix cache on and off (same run).

Bar (issue "Engine"): TTFT of a turn whose 1,500-token history is cached is <= 25% of the same turn cold.

    python -m benchmarks.bench_multiturn
"""

from __future__ import annotations

import asyncio
import sys

from benchmarks.common import print_table, save, start_engine, timed_request, verdict
from engine.request import ChatMessage, ChatPrompt, GenerationRequest
from engine.sampling_params import SamplingParams

TURNS = 6
HISTORY_TOKENS = 1500


def _history(tokenizer) -> list[ChatMessage]:
    sentence = "The committee reviewed the quarterly figures and agreed on the next steps for the project. "
    per = len(tokenizer.encode(sentence, add_special_tokens=False))
    turns = []
    for i in range(6):
        turns.append(ChatMessage("user", f"Part {i}: " + sentence * (HISTORY_TOKENS // per // 12)))
        turns.append(ChatMessage("assistant", "Noted. " + sentence * (HISTORY_TOKENS // per // 12)))
    return turns


async def conversation(enable_prefix_caching: bool) -> list[float]:
    engine = start_engine(enable_prefix_caching=enable_prefix_caching)
    try:
        messages = _history(engine.tokenizer)
        ttfts = []
        for turn in range(TURNS):
            messages.append(ChatMessage("user", f"Question {turn}: summarize part {turn % 6} in one sentence."))
            req = GenerationRequest(f"turn-{turn}-{enable_prefix_caching}", ChatPrompt(list(messages)),
                                    SamplingParams(max_tokens=24, temperature=0))
            timing = await timed_request(engine, req)
            ttfts.append(timing.ttft)
            # the client resends the whole history plus the answer next turn
            messages.append(ChatMessage("assistant", timing.text))
        prompt_tokens = len(await engine.encode_prompt(ChatPrompt(messages)))
        return ttfts + [prompt_tokens]
    finally:
        engine.shutdown()


def main() -> int:
    warm = asyncio.run(conversation(True))
    cold = asyncio.run(conversation(False))
    final_len = warm.pop()
    cold.pop()
    rows = [[i + 1, cold[i] * 1e3, warm[i] * 1e3, f"{warm[i] / cold[i]:.2f}"] for i in range(TURNS)]
    print_table(f"Multi-turn: {TURNS} turns over a ~{HISTORY_TOKENS}-token history (final prompt {final_len} tokens)",
                ["turn", "TTFT cold ms (prefix cache off)", "TTFT cached ms (prefix cache on)", "ratio"], rows)
    # turn 1 has nothing cached yet; turns 2.. reuse the resent history
    ratios = [warm[i] / cold[i] for i in range(1, TURNS)]
    worst = max(ratios)
    save("multiturn", {"cold_ttft_s": cold, "cached_ttft_s": warm, "worst_ratio_turns_2_plus": worst})
    return verdict({"cached-history TTFT <= 25% of cold (turns 2-6)": worst <= 0.25})


if __name__ == "__main__":
    sys.exit(main())
