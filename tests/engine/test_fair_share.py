"""The running slots are shared fairly between clients: when the batch is full, waiting sequences are
admitted round-robin across clients within a priority (one client's own in arrival order), so a client
that queued many requests before another cannot starve it."""

from __future__ import annotations

from typing import cast

from engine.block_manager import BlockManager
from engine.detokenizer import IncrementalDetokenizer
from engine.request import GenerationRequest, TokensPrompt
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
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
