"""Turns a scheduled batch into the flat tensors of one forward pass and runs it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention import AttentionMetadata, PagedKVCache, PrefillSpan
from engine.lora import LoraManager
from engine.models.greedy_head import GreedyPicks
from engine.models.llama import LlamaForCausalLM
from engine.sampler import banned_ids, takes_plain_argmax
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence


@dataclass(slots=True)
class PromptLogits:
    """Logits of prompt positions start .. start + len(logits) - 1 (each predicts the next prompt token)."""

    seq: Sequence
    start: int
    logits: torch.Tensor


@dataclass(slots=True)
class StepOutput:
    """One forward pass's answer for the sequences that sample a token now (``samplers``, in row order):
    their logits [S, vocab], or, where the model's greedy head took the step, their tokens already picked.
    A sequence with draft tokens samples 1 + len(draft) consecutive rows: its pick after each prefix of
    the draft."""

    samplers: list[Sequence]
    logits: torch.Tensor | None = None
    picked: list[int] | None = None
    prompt_logits: list[PromptLogits] = field(default_factory=list)
    # pooling sequences' final-normed hidden states: (sequence, first position, rows [count, hidden])
    hidden: list[tuple[Sequence, int, torch.Tensor]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache, lora_manager: LoraManager | None = None) -> None:
        self.model = model
        self.lora_manager = lora_manager
        self.cache = cache
        self.block_size = cache.block_size
        self.device = model.device
        # the EOS ids greedy rows may not pick under ignore_eos / min_tokens; None: never pick in the model
        self.greedy_eos_token_ids: list[int] | None = None

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def run(self, batch: ScheduledBatch) -> StepOutput:
        """Runs one step; returns the logits of the sequences that sample a token now, and those of prompt
        positions whose logprobs were asked for (prompt_logprobs). Once the engine has set
        greedy_eos_token_ids, a step whose every sampling row is a plain argmax (sampler.takes_plain_argmax)
        may come back with its tokens picked instead (the model's greedy head)."""
        eos_token_ids = self.greedy_eos_token_ids
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_rows: list[int] = []
        samplers: list[Sequence] = []
        token_slots: list[int] = []  # LoRA slot of each token (-1: base model)
        wanted: list[tuple[Sequence, int, int, int]] = []  # prompt_logprobs: (seq, first position, count, row)
        # pooling sequences sample nothing: the rows their pooling reads come back as hidden states
        hidden_rows: list[int] = []
        pooled: list[tuple[Sequence, int, int]] = []  # (seq, first position, count)

        # decode: one token per sequence, attention over its whole context; a sequence with a draft
        # (speculation) has a row for each draft token too, each attending over the context up to itself
        # (every row's K and V are in the cache before any row attends), so each row computes what a
        # plain decode step at its position would
        decode_gather = decode_mask = block_tables = context_lens = None
        max_len = 0
        ctx_lens: list[int] = []  # one per decode row
        if batch.decodes:
            row_seqs: list[Sequence] = []
            for seq in batch.decodes:
                start = seq.num_computed_tokens
                samples = start + 1 == len(seq.token_ids) and seq.pooling is None
                if seq.pooling is not None and seq.pooling.span(start, 1, len(seq.token_ids))[1]:
                    hidden_rows.append(len(input_ids))
                    pooled.append((seq, start, 1))
                for pos, token in enumerate([seq.token_ids[start]] + seq.draft_token_ids, start):
                    if samples:
                        logits_rows.append(len(input_ids))
                        samplers.append(seq)
                    input_ids.append(token)
                    token_slots.append(seq.lora_slot)
                    positions.append(pos)
                    slot_mapping.append(seq.block_table[pos // bs] * bs + pos % bs)
                    ctx_lens.append(pos + 1)
                    row_seqs.append(seq)
            max_len = max(ctx_lens)
            max_blocks = -(-max_len // bs)
            tables = torch.tensor([s.block_table[:max_blocks] + [0] * (max_blocks - len(s.block_table[:max_blocks]))
                                   for s in row_seqs], dtype=torch.long)
            if self.model.kernels is not None:  # the fused kernel walks the block tables itself
                block_tables, context_lens = tables.to(self.device), torch.tensor(ctx_lens, device=self.device)
            else:
                pos_range = torch.arange(max_len)
                decode_gather = tables[:, pos_range // bs] * bs + pos_range % bs  # [B, max_len]
                decode_mask = pos_range[None, :] < torch.tensor(ctx_lens)[:, None]
                if min(ctx_lens) == max_len:
                    decode_gather, decode_mask = decode_gather.flatten().to(self.device), None
                else:
                    decode_gather = decode_gather.masked_fill(~decode_mask, 0).flatten().to(self.device)
                    decode_mask = decode_mask.to(self.device)

        # prefill: a chunk of consecutive tokens per sequence, causal over cache + chunk
        spans: list[PrefillSpan] = []
        fused = self.model.kernels is not None  # the fused prefill kernel walks block tables, as decode's does
        prefill_tables: list[list[int]] = []
        for seq, n in batch.prefills:
            start = seq.num_computed_tokens
            q_start = len(input_ids)
            input_ids.extend(seq.token_ids[start:start + n])
            token_slots.extend([seq.lora_slot] * n)
            positions.extend(range(start, start + n))
            slot_mapping.extend(self._slots(seq.block_table, start, start + n))
            ctx = start + n
            gather = mask = None
            if fused:
                prefill_tables.append(seq.block_table[:-(-ctx // bs)])
            elif start > 0:
                gather = torch.tensor(self._slots(seq.block_table, 0, ctx), dtype=torch.long, device=self.device)
                q_pos = torch.arange(start, ctx, device=self.device)
                mask = torch.arange(ctx, device=self.device)[None, :] <= q_pos[:, None]
            spans.append(PrefillSpan(q_start, n, ctx, gather, mask,
                                     kv_only_rows=max(0, min(n, seq.kv_only_prefix - start))))
            if seq.pooling is not None:
                first, count = seq.pooling.span(start, n, len(seq.token_ids))
                if count:
                    hidden_rows.extend(range(q_start + first - start, q_start + first - start + count))
                    pooled.append((seq, first, count))
            elif ctx == len(seq.token_ids):
                logits_rows.append(q_start + n - 1)
                samplers.append(seq)
            if seq.prompt_logprobs is not None:
                # position p predicts prompt token p + 1: every position of the chunk but the prompt's last
                last = min(start + n, seq.num_prompt_tokens - 1)
                if last > start:
                    wanted.append((seq, start, last - start, q_start))
        prompt_rows: list[int] = []
        for _, _, count, q_start in wanted:
            prompt_rows.extend(range(q_start, q_start + count))

        prefill_spans = prefill_block_tables = None
        if fused and spans:
            width = max(len(t) for t in prefill_tables)
            prefill_spans = torch.tensor([[sp.q_start, sp.q_len, sp.context_len] for sp in spans], dtype=torch.long)
            prefill_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in prefill_tables], dtype=torch.long)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=self.device),
            num_decodes=len(ctx_lens),
            decode_gather=decode_gather,
            decode_mask=decode_mask,
            decode_max_len=max_len,
            prefills=spans,
            decode_block_tables=block_tables,
            decode_context_lens=context_lens,
            prefill_spans=prefill_spans,
            prefill_block_tables=prefill_block_tables,
        )
        greedy_bans = None
        if (eos_token_ids is not None and not wanted and samplers and self.model.greedy_head is not None
                and all(takes_plain_argmax(seq) for seq in samplers)):
            greedy_bans = [banned_ids(seq, eos_token_ids) for seq in samplers]
        out = self.model.forward(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            meta,
            self.cache,
            torch.tensor(logits_rows + prompt_rows, dtype=torch.long, device=self.device),
            self.lora_manager.batch(token_slots) if self.lora_manager is not None else None,
            greedy_bans=greedy_bans,
            # only for a step with pooled rows: the forward's answer is then a pair
            **({"hidden_indices": torch.tensor(hidden_rows, dtype=torch.long, device=self.device)}
               if hidden_rows else {}),
        )
        hidden: list[tuple[Sequence, int, torch.Tensor]] = []
        if hidden_rows:
            out, states = out
            states, at = states.cpu(), 0
            for seq, first, count in pooled:
                hidden.append((seq, first, states[at:at + count]))
                at += count
        if isinstance(out, GreedyPicks):
            return StepOutput(samplers, picked=out.token_ids.tolist(), hidden=hidden)
        logits = out.cpu()
        extra, offset = [], len(logits_rows)
        for seq, start, count, _ in wanted:
            extra.append(PromptLogits(seq, start, logits[offset:offset + count]))
            offset += count
        return StepOutput(samplers, logits=logits[:len(logits_rows)], prompt_logits=extra, hidden=hidden)
