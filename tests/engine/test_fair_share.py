"""The running slots are shared fairly between clients: when the batch is full, waiting sequences are
admitted round-robin across clients within a priority (one client's own in arrival order), so a client
that queued many requests before another cannot starve it."""

from __future__ import annotations

from typing import cast

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.request import GenerationRequest, TokensPrompt
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from tests.engine.helpers import run_all, tokens_of

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
    # then the two alternate while both wait (B's queue emptied, so it comes back at the virtual time,
    # like any client that was not waiting), each one's own in arrival order
    more_b = [_seq("B") for _ in range(3)]
    for seq in more_b:
        scheduler.add(seq)
    order = []
    for _ in range(6):
        _finish(scheduler, scheduler.running[0])
        order += _admitted(scheduler)
    assert [s.client for s in order] == ["B", "A", "B", "A", "B", "A"]
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
    assert scheduler.waiting == [hog[-1]]  # A's latest, behind B's, recomputed later
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


def _greedy(request_id: str, client: str, seed_token: int) -> GenerationRequest:
    prompt = [1] + [300 + (seed_token * 37 + j * 13) % 20000 for j in range(40)]
    return GenerationRequest(request_id, TokensPrompt(prompt),
                             SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), client=client)


def test_a_slot_taken_back_changes_no_answer_and_the_newcomer_starts_at_once(llm_engine):
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=2, max_num_batched_tokens=256,
                                    kv_cache_space_gib=0.1))
    hog = [_greedy("a0", "A", 0), _greedy("a1", "A", 1)]
    for request in hog:
        engine.add_request(request)
    events: list[tuple[str, bool]] = []
    outputs: dict[str, list] = {"a0": [], "a1": [], "b0": []}
    for step in range(200):
        if step == 3:
            engine.add_request(_greedy("b0", "B", 2))
        if step > 3 and not engine.has_unfinished():
            break
        for out in engine.step():
            outputs[out.request_id].append(out)
            events.append((out.request_id, out.finished))
    assert engine.scheduler.num_share_preemptions == 1
    # its first token came before either of A's finished: it did not wait for a slot to free
    assert events.index(("b0", False)) < min(events.index(("a0", True)), events.index(("a1", True)))
    # the preempted sequence was recomputed: the same greedy tokens as without a newcomer
    alone = run_all(llm_engine, [_greedy("a0", "A", 0), _greedy("a1", "A", 1), _greedy("b0", "B", 2)])
    for rid, outs in outputs.items():
        assert tokens_of(outs) == tokens_of(alone[rid]), rid
