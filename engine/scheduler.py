"""Continuous batching: which sequences run this step, and how many tokens each computes.

Each step the running sequences go first (a decode costs one token), then waiting ones are
admitted in priority order while the per-step token budget, ``max_num_seqs`` and free KV
blocks allow; within a priority, round-robin across clients (first come, first served for one
client), so a client that queues many requests cannot starve one that arrives after. When the
batch is full and a client holding less than its share of the slots waits, a client holding more gives one
back (its latest sequence paused with its KV blocks kept, resuming where it stopped): one client may fill
the batch while no one else waits, never keep it from another. Prompts
are prefilled in chunks that fit the budget, so a long prompt never freezes the running streams.
When KV blocks run out, paused sequences' blocks go first, then the lowest-priority, latest running
sequence is preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

import math
from bisect import insort
from collections import Counter
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.cost_model import CostModel
from engine.lora import LoraAdapter, LoraManager
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    # one token each, plus the draft tokens in its draft_token_ids (speculation: one row each)
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk length)
    out_of_cache: list[Sequence] = field(default_factory=list)  # alone and still no room: end them
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(1 + len(s.draft_token_ids) for s in self.decodes) + sum(n for _, n in self.prefills)


@dataclass(slots=True)
class _Room:
    """What is left of a step while it is being scheduled."""

    tokens: int  # of the step's token budget
    prefill: float  # of the long-prompt prefill cap (its cost units)
    capped: bool  # whether the cap applies this step (sequences are decoding)


# A long prompt's prefill per step while others decode, as a multiple of what the decoding sequences cost
# (Scheduler.decode_cost: the step's pass over the weights, a row per sequence and its attention over its
# context), times the square of the long prompts pending; each prompt token counted with its attention
# over the keys before it (Scheduler.attention_cost_per_key). At 1.0 a step that carries a long prompt's
# chunk costs about 2-2.5 decode-only steps, which keeps the decoding streams' p99 token gap under
# 3x their median; squaring the pending count lets a queue of long prompts through sooner at the same
# throughput. The measurements behind both: docs/performance.md, "Why the constants are what they are".
LONG_PREFILL_SHARE = 1.0

# waiting prompts whose cached prefix the cap's pending count looks up each step (the queue's head)
PENDING_PROBES = 8

# tokens counted alone: no attention or step costs (a scheduler built without a cost model)
NO_COSTS = CostModel()


def _order(seq: Sequence) -> tuple[int, float]:
    return (seq.priority, seq.arrival_time)


def _wait_order(seq: Sequence) -> tuple[int, int, float]:
    return (seq.priority, seq.fair_tag, seq.arrival_time)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int = 0, lora_manager: LoraManager | None = None,
                 cost_model: CostModel = NO_COSTS) -> None:
        self.block_manager = block_manager
        self.lora_manager = lora_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # While sequences decode, a step prefills long prompts at most max(threshold, LONG_PREFILL_SHARE x
        # the decoding sequences' cost x (long prompts pending)^2) tokens in all (0: no cap), weighed by
        # their attention (below). With one pending, such a step costs about twice a decode-only one, at the
        # prompt's start as at its end and beside short contexts as beside long ones, so a long prompt
        # arriving keeps the running streams' token gaps within the interactivity bar. A short prompt (at
        # most half the step budget) is prefilled whole in one step, as vLLM does: one bounded bump for the
        # running streams, and arrivals ramp up without being trickled through the cap. A short prompt
        # waiting for a free slot brings the cap on as a stream does (_short_prompt_waiting).
        self.long_prefill_token_threshold = long_prefill_token_threshold
        # The cap counts a capped chunk's cost, not only its tokens (engine/cost_model.py: measured at start,
        # or pinned by a flag; the three properties below read it).
        self.cost_model = cost_model
        self.short_prompt_tokens = max_num_batched_tokens // 2
        self.waiting: list[Sequence] = []  # in _wait_order
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # for KV space
        self.num_share_preemptions = 0  # for another client's share of the running slots
        self._paused: list[Sequence] = []  # waiting with their KV blocks kept (_pause), latest last
        # an adapter no new sequence may pin while a sequence waits for a slot every adapter in use holds
        # (_drain_for_waiting_adapters)
        self._draining: str | None = None
        # Fair share of the running slots (start-time fair queuing, one unit per sequence): a sequence's
        # fair_tag is max(the priority's virtual time, its client's previous tag + 1), and the wait queue is
        # ordered by (priority, tag, arrival). Virtual time is the largest tag admitted so far, so a client
        # arriving behind another's long queue is tagged next and the two then alternate; one client's
        # sequences keep their arrival order. Each add and each admission costs O(1) here (plus the queue's
        # ordered insert), whatever the number of clients or waiting sequences.
        self._virtual_time: dict[int, int] = {}  # priority -> largest fair_tag admitted
        self._clients: dict[tuple[int, str | None], list[int]] = {}  # (priority, client) -> [last tag, waiting]

    @property
    def attention_cost_per_key(self) -> float:
        """A prompt token's attention over one key before it, as a fraction of a token's linears (from the
        model's sizes; 0: tokens only). Late chunks of a long prompt attend over more keys, so they get
        fewer tokens and a step costs about the same at the prompt's end as at its start."""
        return self.cost_model.attention_cost_per_key

    @property
    def decode_cost_per_key(self) -> float:
        """A decoding row's attention over one key of its context, in the same units: it reads the key's K
        and V from memory, so this follows the machine's bytes against its arithmetic (0: decode rows
        counted as rows alone)."""
        return self.cost_model.decode_cost_per_key

    @property
    def decode_step_cost(self) -> float:
        """What a decode step costs before any row (it streams every weight once; 0: nothing)."""
        return self.cost_model.decode_step_cost

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        tail = self._clients.get((seq.priority, seq.client))
        now = self._virtual_time.get(seq.priority, 0)
        seq.fair_tag = max(now, tail[0] + 1) if tail is not None else now
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        key = (seq.priority, seq.client)
        tail = self._clients.get(key)
        if tail is None:
            self._clients[key] = [seq.fair_tag, 1]
        else:
            tail[0] = max(tail[0], seq.fair_tag)
            tail[1] += 1
        insort(self.waiting, seq, key=_wait_order)

    def _dequeue(self, seq: Sequence, admitted: bool) -> None:
        self.waiting.remove(seq)
        key = (seq.priority, seq.client)
        tail = self._clients[key]
        tail[1] -= 1
        if not tail[1]:  # nothing of it waits: it comes back at the virtual time, no credit kept
            del self._clients[key]
        if admitted and seq.fair_tag > self._virtual_time.get(seq.priority, 0):
            self._virtual_time[seq.priority] = seq.fair_tag

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self._dequeue(seq, admitted=False)
            self._unpause(seq)
        self.block_manager.free(seq)
        self._release_lora(seq)
        seq.status = SequenceStatus.FINISHED

    def _release_lora(self, seq: Sequence) -> None:
        # the adapter pin is dropped wherever the sequence's blocks are (finish, abort, preemption)
        if self.lora_manager is not None and seq.lora_slot >= 0:
            self.lora_manager.release(seq.lora_slot)
        seq.lora_slot = -1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _lora_of(self, seq: Sequence) -> tuple[LoraManager, LoraAdapter]:
        """A LoRA sequence's slot manager and adapter: the engine loads the adapter before it queues the
        sequence, and has a manager wherever it serves adapters."""
        assert self.lora_manager is not None and seq.lora_adapter is not None
        return self.lora_manager, seq.lora_adapter

    def _adapter_slot_free(self, seq: Sequence) -> bool:
        """Whether a waiting sequence's adapter (if any) can be pinned now (not one being drained)."""
        if seq.lora_name is None:
            return True
        manager, adapter = self._lora_of(seq)
        return seq.lora_key != self._draining and manager.can_acquire(adapter.key)

    def _drain_for_waiting_adapters(self, queue: list[Sequence]) -> None:
        """While a waiting sequence's adapter has no slot (every slot pinned by running sequences of other
        adapters), no new sequence may pin the adapter holding the fewest running sequences, so its slot
        frees as they finish and the waiting adapter is loaded into it. Without this, a client keeping its
        own adapters' sequences running would keep every other adapter waiting for good. The drain ends
        once no waiting sequence needs an adapter that is not loaded."""
        manager = self.lora_manager
        if manager is None:
            return
        needing = [s.lora_key for s in queue if s.lora_key is not None and not s.is_blocked
                   and s.lora_key not in manager.slot_of]
        if not needing:
            self._draining = None
            return
        if self._draining is not None and self._draining in manager.slot_of:
            return
        self._draining = None
        if any(manager.can_acquire(key) for key in needing):
            return  # a slot is free or unpinned: nothing to drain
        pinned = [(manager.pins[slot], key) for key, slot in manager.slot_of.items() if manager.pins[slot] > 0]
        if pinned:
            self._draining = min(pinned)[1]

    def _fit(self, seq: Sequence, wanted: int) -> int:
        """How many of ``wanted`` tokens fit in the blocks the sequence has plus the free ones."""
        bm = self.block_manager
        capacity = (len(seq.block_table) + bm.num_free_blocks) * bm.block_size - seq.num_computed_tokens
        return max(0, min(wanted, capacity))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        self._release_lora(seq)
        seq.reset_for_recompute()
        self._enqueue(seq)  # with its tag: back at the head of its client's queue
        self.num_preemptions += 1

    def _pause(self, seq: Sequence, batch: ScheduledBatch, room: _Room) -> None:
        """Take a running sequence out of the batch for another client's share of the slots, keeping its KV
        blocks: it waits with its place in its client's queue and resumes where it stopped, computing
        nothing again, so its answer is the one it would have given. Paused sequences are the first whose
        blocks go when the cache runs short (``_evict_paused``)."""
        self.running.remove(seq)
        if seq in batch.decodes:  # scheduled this step already: its tokens go back to the step
            batch.decodes.remove(seq)
            room.tokens += 1 + len(seq.draft_token_ids)
        for i, (other, n) in enumerate(batch.prefills):
            if other is seq:
                del batch.prefills[i]
                room.tokens += n
                room.prefill += self._prefill_cost(seq, n, room.capped)
                break
        seq.draft_token_ids = []
        self._release_lora(seq)
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq)
        self._paused.append(seq)
        self.num_share_preemptions += 1
        batch.num_preempted += 1

    def _unpause(self, seq: Sequence) -> bool:
        """Drop ``seq`` from the paused ones (admitted, aborted, or its blocks freed); whether it was one."""
        if seq in self._paused:
            self._paused.remove(seq)
            return True
        return False

    def _evict_paused(self, keep: Sequence) -> bool:
        """Free the latest paused sequence's blocks (it is recomputed when resumed), never those of ``keep``,
        the sequence the room is made for (a paused one resuming); False if no other is paused."""
        seq = next((s for s in reversed(self._paused) if s is not keep), None)
        if seq is None:
            return False
        self._paused.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.num_preemptions += 1
        return True

    def _fit_evicting_paused(self, seq: Sequence, wanted: int) -> int:
        """``_fit``, after freeing paused sequences' blocks where the free ones are too few."""
        n = self._fit(seq, wanted)
        while n == 0 and self._evict_paused(keep=seq):
            n = self._fit(seq, wanted)
        return n

    def _shares(self) -> tuple[Counter[str | None], int, set[str | None]]:
        """The running slots each client holds, the share of them each may hold (``max_num_seqs`` / the
        clients running or waiting for a slot they can get), and the waiting clients below it that can get a
        slot: in a full batch, only those waiting at a priority some sequence over its share does not
        outrank. None below it where nothing contends: no one waits, or the free slots take every waiting
        sequence."""
        free = self.max_num_seqs - len(self.running)
        if len(self.waiting) <= free:
            return Counter(), 0, set()
        held = Counter(seq.client for seq in self.running)
        # a client waiting only at a priority less important than every running sequence's takes no slot
        # from a full batch: it does not divide the slots
        worst = max((seq.priority for seq in self.running), default=None)
        contending = {client for priority, client in self._clients if free > 0 or worst is None or priority <= worst}
        share = max(1, self.max_num_seqs // len(held.keys() | contending))
        # the least important priority a slot can be taken from (larger is less important)
        lowest = max((s.priority for s in self.running if held[s.client] > share), default=None) if free <= 0 else None
        return held, share, {client for priority, client in self._clients if held[client] < share and (
            free > 0 or (lowest is not None and priority <= lowest))}

    def _share_victim(self, held: Counter[str | None], share: int, seq: Sequence) -> Sequence | None:
        """Whose slot a waiting sequence below its client's share takes in a full batch: the least important,
        latest running sequence of the client most over its share; never one more important than ``seq``."""
        over = [s for s in self.running if held[s.client] > share and s.priority >= seq.priority]
        if not over:
            return None
        most = max(held[s.client] for s in over)
        return max((s for s in over if held[s.client] == most), key=_order)

    def _admit_waiting(self, batch: ScheduledBatch, room: _Room) -> None:
        """Admit waiting sequences into the free slots, in two passes over the queue. First, those of
        clients below their share of the slots (``_shares``), each taking a slot from a client over its
        share when the batch is full (``_pause``): a client fills the batch while no one else waits, never
        keeps it from another, and a free slot goes to a client below its share before one at it (in
        priority order), so a slot never moves back and forth. Then everyone in queue order while slots
        remain. A prompt that does not fit the step's budget, the prefill cap or the cache stops the queue
        behind it, as it would alone, except for paused answers: each needs one token and holds its cache
        already, so a prompt waiting for the cap never stalls an answer mid-stream."""
        queue = list(self.waiting)
        self._drain_for_waiting_adapters(queue)
        held, share, short = self._shares()
        head = next((s.priority for s in queue if not s.is_blocked), None)
        for seq in queue:
            if not short:
                break
            if len(self.running) < self.max_num_seqs and head is not None and seq.priority > head:
                break  # a free slot goes in priority order: a more important request waits for it
            if seq.client not in short:
                continue
            if seq.is_blocked or not self._adapter_slot_free(seq):
                short.discard(seq.client)  # its client's others wait their turn below
                continue
            victim = None
            if len(self.running) >= self.max_num_seqs:
                victim = self._share_victim(held, share, seq)
                if victim is None:
                    break  # the queue is in priority order: no one after this one may take a slot either
            if not self._admit(seq, batch, room, victim):
                break  # the queue's own order decides below
            held[seq.client] += 1
            if held[seq.client] >= share:
                short.discard(seq.client)
            if victim is not None:
                held[victim.client] -= 1
        stalled = False  # a prompt could not start: only paused answers (a decode each) still may
        for seq in queue:
            if len(self.running) >= self.max_num_seqs or room.tokens <= 0:
                break
            if seq.status == SequenceStatus.RUNNING or seq.is_blocked:
                continue
            if stalled and not self._is_paused_decode(seq):
                continue
            if not self._adapter_slot_free(seq):
                continue  # every adapter slot is pinned by running sequences: wait for one
            if not self._admit(seq, batch, room):
                stalled = True

    @staticmethod
    def _is_paused_decode(seq: Sequence) -> bool:
        """A waiting sequence paused mid-answer with its blocks: it resumes as a decode (one token)."""
        return bool(seq.block_table) and seq.num_uncomputed_tokens == 1

    def _admit(self, seq: Sequence, batch: ScheduledBatch, room: _Room, victim: Sequence | None = None) -> bool:
        """Admit one waiting sequence with its first chunk (a paused one resumes where it stopped), after
        pausing ``victim`` for its slot; False (nothing changed) where the step's budget, the prefill cap or
        the cache leaves it no token."""
        bm = self.block_manager
        if room.tokens <= 0:
            return False
        if self._is_paused_decode(seq):
            n = self._fit_evicting_paused(seq, 1)
        else:
            # before its blocks are taken: whether a prompt is long depends on what the cache holds of it
            cached = bm.cached_prefix_tokens(seq) if room.capped and self._worth_probing(seq) \
                else seq.num_cached_tokens
            if self._prefill_limit(seq, room.tokens, room.prefill, room.capped, cached) <= 0:
                return False
            if not seq.block_table:
                bm.allocate_cached_prefix(seq)
            n = self._fit_evicting_paused(seq, min(seq.num_uncomputed_tokens, self._prefill_limit(
                seq, room.tokens, room.prefill, room.capped)))
        if n == 0:
            bm.free(seq)  # keep its cached prefix evictable while it waits
            if self._unpause(seq):  # its blocks are gone: recomputed when admitted
                self.num_preemptions += 1
            seq.reset_for_recompute()
            return False
        if victim is not None:
            self._pause(victim, batch, room)
        self._dequeue(seq, admitted=True)
        self._unpause(seq)
        if seq.lora_name is not None:
            manager, adapter = self._lora_of(seq)
            seq.lora_slot = manager.acquire(adapter)
        seq.status = SequenceStatus.RUNNING
        seq.mark_scheduled()
        self.running.append(seq)
        room.prefill -= self._prefill_cost(seq, n, room.capped)
        bm.append_slots(seq, n)
        self._add(batch, seq, n)
        room.tokens -= n
        return True

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        self.running.sort(key=_order)
        num_decoding = sum(1 for s in self.running if s.decodes_next)
        prefill_budget: float = budget
        capped = bool(self.long_prefill_token_threshold and (num_decoding or self._short_prompt_waiting()))
        if capped:
            # The cap grows with the square of the long prompts pending. One arrival among running
            # streams barely widens their token gaps. A queue's waiting grows with the square of its
            # length (each prompt waits for the prefills of all those ahead of it), so a queue gets up to
            # the whole step instead of being trickled while its wait piles up.
            pending = sum(1 for s in self.running if s.num_uncomputed_tokens > 1 and self._is_long(s))
            pending += sum(1 for i, s in enumerate(self.waiting) if self._is_long(s, self._waiting_cached(s, i)))
            prefill_budget = max(self.long_prefill_token_threshold,
                                 LONG_PREFILL_SHARE * self.decode_cost() * max(1, pending) ** 2)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = seq.num_uncomputed_tokens
            decoding = seq.decodes_next  # only such a sequence has a draft (LLMEngine._propose_drafts)
            wanted = min(1 + len(seq.draft_token_ids), budget) if decoding else min(remaining, self._prefill_limit(
                seq, budget, prefill_budget, capped))
            if wanted == 0:  # a prefill with no prefill budget left this step
                i += 1
                continue
            n = self._fit_evicting_paused(seq, wanted)
            while n == 0 and self.running[-1] is not seq:
                victim = self.running[-1]
                self._preempt(victim)
                batch.num_preempted += 1
                n = self._fit(seq, wanted)
            if n == 0:
                if len(self.running) == 1 and not batch.decodes and not batch.prefills:
                    # It holds the whole cache and still cannot grow: recomputing would loop forever.
                    self.running.remove(seq)
                    self._release_lora(seq)
                    batch.out_of_cache.append(seq)
                    continue
                self._preempt(seq)  # nothing else to take from: wait for blocks
                batch.num_preempted += 1
                continue
            if decoding:
                del seq.draft_token_ids[n - 1:]  # what the budget and the free blocks leave of the draft
                batch.decodes.append(seq)
            else:
                prefill_budget -= self._prefill_cost(seq, n, capped)
                self._add(batch, seq, n)
            bm.append_slots(seq, n)
            budget -= n
            i += 1
        self._admit_waiting(batch, _Room(budget, prefill_budget, capped))
        return batch

    def _short_prompt_waiting(self) -> bool:
        """Whether a short prompt (or a paused answer) waits at the head of the queue and could start now: a
        slot, its adapter's slot and the cache's free blocks have room for it, and no long prompt waits
        ahead of it (which the cap would leave waiting, and the queue behind it). The long-prompt cap then
        applies though nothing decodes: a long prompt's chunk leaves the step room to start it, so it does
        not wait for the long prompt's whole prefill (seconds for thousands of tokens) before its first
        token, and once it decodes the cap holds as for any stream. One that could not start leaves the long
        prompt's chunks whole."""
        if len(self.running) >= self.max_num_seqs:
            return False
        stalled = False  # as _admit_waiting's queue-order pass: past a prompt that cannot start, only paused answers
        for i, seq in enumerate(self.waiting[:PENDING_PROBES]):
            if seq.is_blocked or not self._adapter_slot_free(seq):
                continue
            paused = self._is_paused_decode(seq)
            if stalled and not paused:
                continue
            if self._fit(seq, seq.num_uncomputed_tokens) == seq.num_uncomputed_tokens and (
                    paused or not self._is_long(seq, self._waiting_cached(seq, i))):
                return True
            stalled = True  # a long prompt gets no room beside the running one's chunk: it stops those behind it
        return False

    def decode_cost(self) -> float:
        """What this step's decoding sequences cost, in prompt tokens' linears: the step's own (its pass over
        the weights), then a row each and its attention over its context. Their draft rows are left out: a
        draft row costs far less than a sequence's first row at the batch sizes where a long prompt is
        capped, and counting each as one row shrinks the prompt's chunks until greedy streams' token gaps
        grow past the 3x-median limit instead."""
        k, row = self.decode_cost_per_key, self.cost_model.decode_row_cost
        return self.decode_step_cost + sum(row + k * seq.num_computed_tokens for seq in self.running
                                           if seq.decodes_next)

    def _prefill_limit(self, seq: Sequence, budget: int, prefill_budget: float, capped: bool,
                       cached: int | None = None) -> int:
        """Prompt tokens ``seq`` may prefill this step: short prompts are bounded by the step's budget
        only, long ones by the prefill cap too (recomputed sequences count their outputs); under the cap,
        as many as its cost allows after the keys already computed. ``cached``: its tokens the prefix cache
        holds, where its blocks are not yet taken (else its own count)."""
        if not self._is_long(seq, cached):
            return budget
        a = self.attention_cost_per_key if capped else 0.0
        if a <= 0 or prefill_budget <= 0:
            return max(0, min(budget, int(prefill_budget)))
        # the largest n with n * (1 + (computed + n) * a) <= prefill_budget; never under the threshold's
        # tokens, so a prompt deep into a long context still moves while streams decode
        b = 1 + seq.num_computed_tokens * a
        n = int((math.sqrt(b * b + 4 * a * prefill_budget) - b) / (2 * a))
        return min(budget, max(n, min(self.long_prefill_token_threshold, int(prefill_budget))))

    def _prefill_cost(self, seq: Sequence, n: int, capped: bool) -> float:
        """What a chunk of ``n`` tokens of ``seq`` (scheduled, not yet computed) takes from the prefill cap:
        its tokens, and under the cap each one's attention over at most ``computed + n`` keys."""
        if not capped or not self._is_long(seq):
            return n
        return n * (1 + (seq.num_computed_tokens + n) * self.attention_cost_per_key)

    def _worth_probing(self, seq: Sequence) -> bool:
        """Whether the prefix cache could make a waiting prompt short: it has no blocks yet and is long by
        its length alone."""
        return not seq.block_table and len(seq.token_ids) > self.short_prompt_tokens

    def _waiting_cached(self, seq: Sequence, position: int) -> int | None:
        """For the cap's pending count: a waiting prompt's cached tokens, looked up for the first
        PENDING_PROBES of the queue (the ones a step can admit; each lookup walks the prompt's cached
        blocks), else its own count (nothing cached: counted long by its length)."""
        return self.block_manager.cached_prefix_tokens(seq) if (
            position < PENDING_PROBES and self._worth_probing(seq)) else None

    def _is_long(self, seq: Sequence, cached: int | None = None) -> bool:
        """Whether a prompt's prefill is long: what it computes past its cached prefix, attending over the
        whole context, costs more than the longest short prompt (half the step budget, attending over
        itself). So a conversation's next turn over a cached history is short when its new message is, and
        is prefilled whole beside a long prompt's chunks instead of waiting for all of them."""
        if seq.num_uncomputed_tokens == 1:  # a decode (a paused answer resuming)
            return False
        total = len(seq.token_ids)
        uncached = total - (seq.num_cached_tokens if cached is None else cached)
        short = self.short_prompt_tokens
        if uncached > short:
            return True
        a = self.attention_cost_per_key
        return uncached * (1 + total * a) > short * (1 + short * a)

    @staticmethod
    def _add(batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        """A chunk of ``n`` tokens into the step: one row of an answer as a decode, any prompt row (however
        few this step computes) as a prefill (Sequence.decodes_next says why)."""
        if n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
            batch.decodes.append(seq)
        else:
            batch.prefills.append((seq, n))
