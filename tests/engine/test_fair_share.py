"""The running slots are shared fairly between clients: when the batch is full, waiting sequences are
admitted round-robin across clients within a priority (one client's own in arrival order), so a client
that queued many requests before another cannot starve it."""

from __future__ import annotations

import random
from typing import cast

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.request import GenerationRequest, TokensPrompt
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler, _Room
from engine.sequence import Sequence

_ids = iter(range(10**6))


def _seq(client: str | None, priority: int = 5) -> Sequence:
    class _Detok:
        pass
    n = next(_ids)
    tokens = [n % 1000, 7, 8, 9]
    request = GenerationRequest(f"r{n}", TokensPrompt(tokens), SamplingParams(max_tokens=4),
                                priority=priority, client=client)
    return Sequence(request, list(tokens), cast(IncrementalDetokenizer, _Detok()), 1000)  # never decodes


def _scheduler(slots: int) -> Scheduler:
    return Scheduler(BlockManager(num_blocks=4096, block_size=4), max_num_seqs=slots, max_num_batched_tokens=512)


def _admitted(scheduler: Scheduler) -> list[Sequence]:
    """One step: the sequences it admitted, in order (their prompts then count as computed)."""
    before = {id(seq) for seq in scheduler.running}
    batch = scheduler.schedule()
    for seq, n in batch.prefills:
        seq.num_computed_tokens += n
    return [seq for seq in scheduler.running if id(seq) not in before]


def _finish(scheduler: Scheduler, seq: Sequence) -> None:
    scheduler.remove(seq)


def test_a_client_arriving_behind_a_long_queue_is_admitted_at_the_next_free_slot():
    scheduler = _scheduler(slots=2)
    running = [_seq("A"), _seq("A")]
    queued = [_seq("A") for _ in range(200)]
    for seq in running + queued:
        scheduler.add(seq)
    assert _admitted(scheduler) == running  # the batch is full
    late = _seq("B")
    scheduler.add(late)
    _finish(scheduler, running[0])
    assert _admitted(scheduler) == [late]  # not after A's 200
    # then, while both wait, each holds its share (one slot): a freed slot goes to the client whose
    # sequence finished, each one's own in arrival order
    more_b = [_seq("B") for _ in range(3)]
    for seq in more_b:
        scheduler.add(seq)
    order, finished = [], []
    for _ in range(6):
        finished.append(scheduler.running[0].client)
        _finish(scheduler, scheduler.running[0])
        order += _admitted(scheduler)
    assert [s.client for s in order] == finished
    assert sorted(s.client for s in scheduler.running) == ["A", "B"]
    assert [s for s in order if s.client == "A"] == queued[:3]
    assert [s for s in order if s.client == "B"] == more_b


def test_a_client_arriving_before_any_admission_is_admitted_second():
    scheduler = _scheduler(slots=1)
    queued = [_seq("A") for _ in range(50)]
    for seq in queued:
        scheduler.add(seq)
    late = _seq("B")
    scheduler.add(late)
    assert _admitted(scheduler) == [queued[0]]
    _finish(scheduler, queued[0])
    assert _admitted(scheduler) == [late]


def test_one_client_is_served_first_come_first_served_and_priority_still_comes_first():
    scheduler = _scheduler(slots=1)
    mine = [_seq(None) for _ in range(5)]
    urgent = _seq("C", priority=1)
    for seq in mine[:3]:
        scheduler.add(seq)
    scheduler.add(urgent)
    for seq in mine[3:]:
        scheduler.add(seq)
    order = []
    for _ in range(6):
        order += _admitted(scheduler)
        _finish(scheduler, order[-1])
    assert order == [urgent] + mine


def test_a_preempted_sequence_goes_back_ahead_of_its_clients_queue():
    scheduler = _scheduler(slots=1)
    first, second = _seq("A"), _seq("A")
    scheduler.add(first)
    scheduler.add(second)
    assert _admitted(scheduler) == [first]
    scheduler._preempt(first)
    other = _seq("B")
    scheduler.add(other)
    assert scheduler.waiting[0] is first


def test_the_bookkeeping_is_one_entry_per_waiting_client_and_goes_when_its_queue_empties():
    scheduler = _scheduler(slots=4)
    seqs = [_seq(c) for c in "ABCABC"]
    for seq in seqs:
        scheduler.add(seq)
    assert len(scheduler._clients) == 3
    _admitted(scheduler)
    scheduler.remove(scheduler.waiting[0])  # an abort while waiting
    scheduler.remove(scheduler.waiting[0])
    assert not scheduler.waiting and not scheduler._clients


def _step(scheduler: Scheduler) -> None:
    """One step in which every scheduled chunk is computed."""
    batch = scheduler.schedule()
    for seq, n in batch.prefills:
        seq.num_computed_tokens += n


def _run(scheduler: Scheduler, lengths: dict[int, int], steps: int) -> None:
    """``steps`` steps as the engine runs them: each scheduled chunk computed, each decode adding a token; a
    sequence finishes once it has ``lengths[id(seq)]`` output tokens."""
    for _ in range(steps):
        batch = scheduler.schedule()
        for seq in batch.out_of_cache:
            scheduler.remove(seq)
        for seq, n in batch.prefills:
            seq.num_computed_tokens += n
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
        for seq in [s for s, _ in batch.prefills if s.num_uncomputed_tokens == 0] + batch.decodes:
            seq.token_ids.append(5)
            if len(seq.token_ids) - seq.num_prompt_tokens >= lengths.get(id(seq), 10**9):
                scheduler.remove(seq)


def _held(scheduler: Scheduler) -> dict[str | None, int]:
    held: dict[str | None, int] = {}
    for seq in scheduler.running:
        held[seq.client] = held.get(seq.client, 0) + 1
    return held


def test_one_client_fills_the_batch_while_no_one_else_waits():
    scheduler = _scheduler(slots=4)
    for seq in [_seq("A") for _ in range(6)]:
        scheduler.add(seq)
    _step(scheduler)
    assert _held(scheduler) == {"A": 4}
    assert scheduler.num_share_preemptions == 0


def test_a_client_holding_every_slot_gives_one_back_to_a_client_that_arrives():
    scheduler = _scheduler(slots=4)
    hog = [_seq("A") for _ in range(4)]
    for seq in hog:
        scheduler.add(seq)
    _step(scheduler)
    late = _seq("B")
    scheduler.add(late)
    _step(scheduler)  # without a finish: the slot is taken back, not waited for
    assert late in scheduler.running
    assert _held(scheduler) == {"A": 3, "B": 1}
    assert scheduler.waiting == [hog[-1]]  # A's latest, waiting with its blocks kept
    assert scheduler.num_share_preemptions == 1 and scheduler.num_preemptions == 0
    for _ in range(5):  # nothing moves back and forth: A still holds its share
        _step(scheduler)
    assert _held(scheduler) == {"A": 3, "B": 1} and scheduler.num_share_preemptions == 1


def test_each_waiting_client_gets_its_share_in_one_step_and_a_client_within_it_keeps_its_own():
    scheduler = _scheduler(slots=6)
    for seq in [_seq("A") for _ in range(5)] + [_seq("C")]:
        scheduler.add(seq)
    _step(scheduler)
    assert _held(scheduler) == {"A": 5, "C": 1}
    for seq in [_seq("B") for _ in range(4)]:  # share: 6 slots / 3 clients
        scheduler.add(seq)
    _step(scheduler)
    assert _held(scheduler) == {"A": 3, "B": 2, "C": 1}
    assert scheduler.num_share_preemptions == 2


def test_a_slot_is_never_taken_from_a_more_important_sequence():
    scheduler = _scheduler(slots=2)
    urgent = [_seq("A", priority=1) for _ in range(2)]
    for seq in urgent:
        scheduler.add(seq)
    _step(scheduler)
    scheduler.add(_seq("B", priority=5))
    _step(scheduler)
    assert scheduler.running == urgent and scheduler.num_share_preemptions == 0
    important = _seq("C", priority=0)
    scheduler.add(important)
    _step(scheduler)
    assert important in scheduler.running and scheduler.num_share_preemptions == 1


def test_a_slot_taken_back_is_held_for_the_client_it_was_taken_for():
    scheduler = _scheduler(slots=3)
    for seq in [_seq("A") for _ in range(3)]:
        scheduler.add(seq)
    _step(scheduler)
    # B waits with a deeper queue than its share: one slot comes back to it, not to B's second or A's
    b = [_seq("B") for _ in range(3)]
    for seq in b:
        scheduler.add(seq)
    _step(scheduler)
    assert _held(scheduler) == {"A": 2, "B": 1}
    assert [s for s in scheduler.running if s.client == "B"] == b[:1]


def _request(request_id: str, client: str, k: int, sampling: dict) -> GenerationRequest:
    prompt = [1] + [300 + (k * 37 + j * 13) % 20000 for j in range(60)]
    return GenerationRequest(request_id, TokensPrompt(prompt), SamplingParams(max_tokens=48, ignore_eos=True,
                                                                                **sampling), client=client)


def _answers(engine, sampling: dict, newcomer: bool) -> tuple[dict[str, list[int]], list[tuple[str, bool]]]:
    """Client A's two answers, with client B's arriving at the fifth step or none; each answer's tokens,
    and the order of (request, finished) outputs."""
    tokens: dict[str, list[int]] = {"a0": [], "a1": [], "b0": []}
    events: list[tuple[str, bool]] = []
    engine.add_request(_request("a0", "A", 0, sampling))
    engine.add_request(_request("a1", "A", 1, sampling))
    for step in range(500):
        if step == 5 and newcomer:
            engine.add_request(_request("b0", "B", 2, sampling))
        if step > 5 and not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            events.append((out.request_id, out.finished))
    return tokens, events


@pytest.fixture(scope="module")
def two_slots():
    """The weights serving runs (the engine's own kernels, which add a row's products in one order
    whatever shares its step), two running slots."""
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(max_num_seqs=2, max_num_batched_tokens=256, kv_cache_space_gib=0.1,
                                  batch_invariant=True))


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_a_slot_taken_back_changes_no_answer_and_the_newcomer_starts_at_once(two_slots, sampling):
    alone, _ = _answers(two_slots, sampling, newcomer=False)
    before = two_slots.scheduler.num_share_preemptions
    shared, events = _answers(two_slots, sampling, newcomer=True)
    assert two_slots.scheduler.num_share_preemptions == before + 1
    # B's first token came before either of A's answers finished: it did not wait for a slot to free
    assert events.index(("b0", False)) < min(events.index(("a0", True)), events.index(("a1", True)))
    # the paused answer resumed where it stopped: the same tokens as without a newcomer
    assert shared["a0"] == alone["a0"] and shared["a1"] == alone["a1"]
    assert len(shared["b0"]) == 48


def test_slots_freed_while_both_wait_go_to_the_client_below_its_share_and_never_move_back_and_forth():
    scheduler = _scheduler(slots=4)
    hog = [_seq("A") for _ in range(4)]
    for seq in hog:
        scheduler.add(seq)
    _run(scheduler, {}, 2)
    short = [_seq("B") for _ in range(10)]
    for seq in short:
        scheduler.add(seq)
    _run(scheduler, {id(seq): 3 for seq in short}, 60)  # B's answers come and go; A's run on
    assert scheduler.num_share_preemptions == 2  # B's share, taken once
    assert not any(s.client == "B" for s in scheduler.running + scheduler.waiting)
    assert _held(scheduler) == {"A": 4}  # B gone: A's paused ones are back


def test_a_paused_sequence_resumes_where_it_stopped():
    scheduler = _scheduler(slots=2)
    hog = [_seq("A") for _ in range(2)]
    for seq in hog:
        scheduler.add(seq)
    _run(scheduler, {}, 5)
    computed = hog[1].num_computed_tokens
    blocks = list(hog[1].block_table)
    late = _seq("B")
    scheduler.add(late)
    _run(scheduler, {id(late): 4}, 1)
    assert hog[1] in scheduler.waiting and hog[1].block_table[:len(blocks)] == blocks  # its cache kept
    _run(scheduler, {id(late): 4}, 6)
    assert hog[1] in scheduler.running and hog[1].num_computed_tokens > computed
    assert scheduler.num_preemptions == 0  # nothing was recomputed


def test_paused_sequences_give_their_blocks_first_when_the_cache_runs_short():
    scheduler = Scheduler(BlockManager(num_blocks=8, block_size=4), max_num_seqs=2, max_num_batched_tokens=512)
    hog = [_seq("A") for _ in range(2)]
    for seq in hog:
        scheduler.add(seq)
    _run(scheduler, {}, 3)
    late = _seq("B")
    scheduler.add(late)
    _run(scheduler, {}, 1)
    assert hog[1] in scheduler.waiting and hog[1].block_table
    _run(scheduler, {}, 12)  # the two running grow until the free blocks run out
    assert scheduler.num_preemptions >= 1 and not hog[1].block_table  # the paused one's blocks went first
    assert late in scheduler.running and hog[0] in scheduler.running


def test_a_paused_answer_resuming_into_a_full_cache_frees_another_paused_answers_blocks_not_its_own():
    # two answers paused with their blocks exactly full, every other block taken: the later one resumes
    # first (it heads its client's queue) and needs a block for its next token
    scheduler = Scheduler(BlockManager(num_blocks=6, block_size=4), max_num_seqs=4, max_num_batched_tokens=512)
    bm = scheduler.block_manager
    earlier, later, other = _seq("A"), _seq("A"), _seq("B")
    for seq in (earlier, later, other):
        scheduler.add(seq)
    _step(scheduler)  # each prompt (one block) computed
    for seq in (earlier, later):
        seq.token_ids.append(5)  # the token its prompt gave: one to compute on resuming
        scheduler._pause(seq, ScheduledBatch(), _Room(tokens=0, prefill=0.0, capped=False))
    bm.append_slots(other, bm.num_free_blocks * bm.block_size)  # every free block to the running one
    assert bm.num_free_blocks == 0 and len(later.block_table) == 1 and later.num_computed_tokens == 4
    kept = list(later.block_table)
    assert scheduler._fit_evicting_paused(later, 1) == 1
    assert later.block_table == kept and later.num_computed_tokens == 4  # resumes where it stopped
    assert not earlier.block_table and earlier.num_computed_tokens == 0  # recomputed when it resumes
    assert scheduler._paused == [later] and scheduler.num_preemptions == 1


def test_no_slot_is_taken_where_the_newcomer_cannot_start_this_step():
    # every token of the step goes to the running decodes: a newcomer could not start, so nothing pauses
    scheduler = Scheduler(BlockManager(num_blocks=4096, block_size=4), max_num_seqs=4, max_num_batched_tokens=4)
    for seq in [_seq("A") for _ in range(4)]:
        scheduler.add(seq)
    _run(scheduler, {}, 6)  # one prompt a step, then four decodes a step
    assert _held(scheduler) == {"A": 4}
    scheduler.add(_seq("B"))
    _run(scheduler, {}, 3)
    assert scheduler.num_share_preemptions == 0 and _held(scheduler) == {"A": 4}


def _random_seq(rng: random.Random, n: int) -> Sequence:
    class _Detok:
        pass
    tokens = [rng.randrange(10, 40) for _ in range(rng.choice([3, 8, 20]))]
    request = GenerationRequest(f"q{n}", TokensPrompt(tokens), SamplingParams(max_tokens=64),
                                priority=rng.choice([0, 0, 0, 1]), client=rng.choice("ABBC"))
    return Sequence(request, list(tokens), cast(IncrementalDetokenizer, _Detok()), 1000)


@pytest.mark.parametrize("seed", range(12))
def test_random_traffic_keeps_the_books_and_drains(seed):
    """Clients, priorities, aborts and a small cache at random: each step no sequence is both running and
    waiting, every paused one waits holding blocks, the blocks in use are exactly those the sequences hold;
    afterwards everything finishes and every block is free."""
    rng = random.Random(seed)
    scheduler = Scheduler(BlockManager(num_blocks=rng.choice([24, 60, 400]), block_size=4),
                          max_num_seqs=rng.choice([2, 3, 4, 6]), max_num_batched_tokens=rng.choice([16, 32, 128]))
    lengths: dict[int, int] = {}
    live: list[Sequence] = []
    for step in range(3000):
        if step < 300 and rng.random() < 0.35:
            seq = _random_seq(rng, step)
            lengths[id(seq)] = rng.choice([2, 10, 30])
            live.append(seq)
            scheduler.add(seq)
        if live and rng.random() < 0.02:
            scheduler.remove(live.pop(rng.randrange(len(live))))  # an abort, wherever it is
        _run(scheduler, lengths, 1)
        running, waiting = set(map(id, scheduler.running)), set(map(id, scheduler.waiting))
        assert not running & waiting and len(running) <= scheduler.max_num_seqs
        assert all(id(s) in waiting and s.block_table for s in scheduler._paused)
        held = {b for s in scheduler.running + scheduler.waiting for b in s.block_table}
        assert scheduler.block_manager.num_used_blocks == len(held)
        if step >= 300 and not scheduler.has_work():
            break
    assert not scheduler.has_work() and scheduler.block_manager.num_used_blocks == 0


def _prompt_seq(client: str, length: int, priority: int = 5) -> Sequence:
    class _Detok:
        pass
    n = next(_ids)
    tokens = [(n * 31 + j) % 30000 + 5 for j in range(length)]
    request = GenerationRequest(f"p{n}", TokensPrompt(tokens), SamplingParams(max_tokens=64), priority=priority,
                                client=client)
    return Sequence(request, list(tokens), cast(IncrementalDetokenizer, _Detok()), 100_000)


def test_a_free_slot_still_goes_in_priority_order():
    scheduler = _scheduler(slots=3)
    for seq in [_seq("A", priority=0) for _ in range(3)]:
        scheduler.add(seq)
    _run(scheduler, {}, 2)
    urgent, batch_job = _seq("A", priority=0), _seq("B", priority=9)
    scheduler.add(urgent)
    scheduler.add(batch_job)
    _run(scheduler, {}, 1)
    scheduler.remove(scheduler.running[0])
    _run(scheduler, {}, 1)
    assert urgent in scheduler.running and batch_job in scheduler.waiting  # B is below its share, yet waits


def test_a_prompt_waiting_for_the_prefill_cap_never_stalls_a_paused_answer():
    scheduler = Scheduler(BlockManager(num_blocks=100_000, block_size=4), max_num_seqs=3, max_num_batched_tokens=64,
                          long_prefill_token_threshold=8)
    answers = [_prompt_seq("A", 8) for _ in range(3)]
    for seq in answers:
        scheduler.add(seq)
    _run(scheduler, {}, 3)
    scheduler.add(_prompt_seq("B", 400))  # takes a slot from A: A's latest answer is paused
    _run(scheduler, {}, 1)
    paused = answers[2]
    assert paused in scheduler.waiting
    scheduler.add(_prompt_seq("C", 400))  # another long prompt: it waits for the cap while B's is prefilled
    _run(scheduler, {}, 1)
    scheduler.remove(answers[0])  # a slot frees
    _run(scheduler, {}, 1)
    assert paused in scheduler.running  # resumed at once, not after B's whole prefill


class _Slots:
    """The LoRA manager's slot bookkeeping alone (engine/lora.py LoraManager): pins per slot, least
    recently used eviction; no weights."""

    def __init__(self, n: int) -> None:
        self.pins = [0] * n
        self.free_slots = list(range(n))
        self.slot_of: dict[str, int] = {}

    def can_acquire(self, key: str) -> bool:
        return key in self.slot_of or bool(self.free_slots) or any(self.pins[s] == 0 for s in self.slot_of.values())

    def acquire(self, adapter) -> int:
        if adapter.key not in self.slot_of:
            if self.free_slots:
                slot = self.free_slots.pop(0)
            else:
                victim = next(k for k, s in self.slot_of.items() if self.pins[s] == 0)
                slot = self.slot_of.pop(victim)
            self.slot_of[adapter.key] = slot
        self.pins[self.slot_of[adapter.key]] += 1
        return self.slot_of[adapter.key]

    def release(self, slot: int) -> None:
        self.pins[slot] -= 1


def _adapter_seq(client: str, adapter: str) -> Sequence:
    from engine.lora import LoraAdapter
    from engine.request import LoraRef

    class _Detok:
        pass
    n = next(_ids)
    request = GenerationRequest(f"l{n}", TokensPrompt([n % 1000, 7, 8, 9]), SamplingParams(max_tokens=64),
                                client=client, lora=LoraRef(name=adapter))
    return Sequence(request, [n % 1000, 7, 8, 9], cast(IncrementalDetokenizer, _Detok()), 1000,
                    lora_adapter=LoraAdapter(adapter, 8, 1.0, {}, key=f"md5:{adapter}"))


def test_a_client_keeping_every_adapter_slot_pinned_cannot_keep_another_adapter_waiting():
    from engine.lora import LoraManager

    slots = _Slots(2)
    scheduler = Scheduler(BlockManager(num_blocks=4096, block_size=4), max_num_seqs=16, max_num_batched_tokens=512,
                          lora_manager=cast(LoraManager, slots))
    lengths: dict[int, int] = {}

    def submit(seq: Sequence, length: int) -> Sequence:
        lengths[id(seq)] = length
        scheduler.add(seq)
        return seq

    for adapter in ("x", "x", "y", "y", "y"):
        submit(_adapter_seq("A", adapter), 6)
    _run(scheduler, lengths, 2)
    other = submit(_adapter_seq("B", "z"), 6)
    waited = 0
    while other in scheduler.waiting and waited < 40:  # A keeps both adapters busy: a new request on each
        submit(_adapter_seq("A", "x"), 6)
        submit(_adapter_seq("A", "y"), 6)
        _run(scheduler, lengths, 1)
        waited += 1
    assert waited <= 8  # as soon as the lighter adapter's running sequences finished (before: never)


def test_a_client_that_cannot_take_a_slot_does_not_shrink_the_others_share():
    scheduler = _scheduler(slots=4)
    for seq in [_seq("A") for _ in range(4)]:
        scheduler.add(seq)
    _run(scheduler, {}, 2)
    for seq in [_seq("B") for _ in range(3)] + [_seq("C", priority=9)]:  # C is less important than all
        scheduler.add(seq)
    _run(scheduler, {}, 2)
    assert _held(scheduler) == {"A": 2, "B": 2}  # 4 slots between the two that contend, not 4 / 3
