"""Stop strings: the matcher gives what a ``find`` of every stop string over the text not yet released
gives (earliest match, first in the list on a tie, partial stops held back, the rest flushed), with work
linear in the text whatever the number and length of the stop strings; --max-stop-strings and
--max-stop-chars bound a request's stop strings before admission."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import StopAutomaton, StopStringMatcher
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from tests.engine.helpers import chat, run_all, text_of


class NaiveStopMatcher:
    """The reference: every stop string searched in all the held text at each feed, the hold found by
    trying every prefix of every stop string (the matcher's behaviour, at stops x held-text^2 a feed)."""

    def __init__(self, stops: list[str], include_stop: bool) -> None:
        self.stops = stops
        self.include_stop = include_stop
        self.buffer = ""

    def feed(self, delta: str) -> tuple[str, str | None]:
        if not self.stops:
            return delta, None
        self.buffer += delta
        best = None
        for stop in self.stops:
            idx = self.buffer.find(stop)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is not None:
            idx, stop = best
            emit = self.buffer[: idx + len(stop)] if self.include_stop else self.buffer[:idx]
            self.buffer = ""
            return emit, stop
        hold = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.buffer)), hold, -1):
                if self.buffer.endswith(stop[:n]):
                    hold = n
                    break
        emit = self.buffer[: len(self.buffer) - hold]
        self.buffer = self.buffer[len(self.buffer) - hold:]
        return emit, None

    def flush(self) -> str:
        rest, self.buffer = self.buffer, ""
        return rest


def _same_as_reference(stops: list[str], include: bool, deltas: list[str]) -> None:
    ref, fast = NaiveStopMatcher(stops, include), StopStringMatcher(stops, include)
    for delta in deltas:
        expected = ref.feed(delta)
        assert fast.feed(delta) == expected, (stops, include, deltas)
        if expected[1] is not None:
            return
    assert fast.flush() == ref.flush()


_ALPHABET = "ab\n"  # few letters: stop strings overlap, share prefixes and repeat in the text
_stop = st.text(alphabet=_ALPHABET, min_size=1, max_size=6)


@settings(max_examples=400, deadline=None)
@given(stops=st.lists(_stop, min_size=0, max_size=6), include=st.booleans(),
       deltas=st.lists(st.text(alphabet=_ALPHABET + "c", max_size=7), max_size=10))
def test_the_matcher_gives_what_the_reference_gives(stops, include, deltas):
    _same_as_reference(stops, include, deltas)


def test_the_matcher_gives_what_the_reference_gives_on_seeded_random_inputs():
    rng = random.Random(1234)
    for _ in range(3000):
        alphabet = rng.choice(["a", "ab", "abc", "aé🌏"])
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 6))]
        deltas = ["".join(rng.choice(alphabet + "d") for _ in range(rng.randint(0, 6)))
                  for _ in range(rng.randint(1, 10))]
        _same_as_reference(stops, rng.random() < 0.5, deltas)


def test_in_one_feed_a_tie_goes_to_the_first_stop_in_the_list_even_when_it_ends_later():
    assert StopStringMatcher(["abc", "ab"], include_stop=True).feed("xab") == ("xab", "ab")  # all there is yet
    assert StopStringMatcher(["abc", "ab"], include_stop=True).feed("xabc") == ("xabc", "abc")
    assert StopStringMatcher(["ab", "abc"], include_stop=True).feed("xabc") == ("xab", "ab")


@pytest.mark.parametrize("num_stops", [1, 200])
def test_the_work_is_linear_in_the_text_whatever_the_stop_strings(num_stops):
    """Stop strings built to cost the most: long, sharing a long prefix the text keeps almost spelling.
    Each character fed moves the automaton once, plus fail links that never outnumber the characters (the
    state carried between feeds), so the moves stay under twice the characters; the text held back is at
    most the longest stop string less one character."""
    stops = ["ab" * 100 + f"#{i}" for i in range(num_stops)]  # 202-204 characters each
    m = StopStringMatcher(stops, include_stop=False)
    fed = 0
    rng = random.Random(7)
    for _ in range(2000):
        delta = rng.choice(["ab", "a", "b", "abab", "ba", "#"])
        assert m.feed(delta)[1] is None
        fed += len(delta)
        assert len(m.buffer) <= max(map(len, stops)) - 1
        assert m.steps <= 2 * fed
    # the tables grow with the stop strings' characters, not with anything the text does
    assert len(m.automaton.depth) <= 1 + sum(map(len, stops))


def test_the_samples_of_a_request_share_one_automaton_built_at_their_first_feed():
    automaton = StopAutomaton(["STOP", "END"])
    a = StopStringMatcher(automaton.stops, False, automaton)
    b = StopStringMatcher(automaton.stops, False, automaton)
    assert automaton.edges is None  # a request waiting for a slot holds only its strings
    assert a.feed("x ST") == ("x ", None) and b.feed("E") == ("", None)
    assert automaton.edges is not None
    assert a.feed("OP") == ("", "STOP") and b.feed("ND") == ("", "END")


def test_stop_strings_over_the_budget_are_refused_naming_stop(llm_engine):
    limit_strings, limit_chars = llm_engine.config.max_stop_strings, llm_engine.config.max_stop_chars
    llm_engine.check_params(SamplingParams(stop=[f"s{i}" for i in range(limit_strings)]))
    with pytest.raises(InvalidRequestError, match="--max-stop-strings") as err:
        llm_engine.check_params(SamplingParams(stop=[f"s{i}" for i in range(limit_strings + 1)]))
    assert err.value.parameter == "stop"
    llm_engine.check_params(SamplingParams(stop=["x" * limit_chars]))
    with pytest.raises(InvalidRequestError, match="--max-stop-chars") as err:
        llm_engine.check_params(SamplingParams(stop=["x" * (limit_chars // 2), "y" * (limit_chars // 2 + 1)]))
    assert err.value.parameter == "stop"


def test_an_answer_stops_at_its_stop_string_among_many(llm_engine):
    """End to end through the engine: a stop string taken from the greedy answer, among 63 that never
    match and share its start, ends both samples of the request right before it."""
    ask = "Count from one to twenty in words, separated by commas."
    free = text_of(run_all(llm_engine, [chat("free", ask, max_tokens=40, temperature=0)])["free"])
    assert len(free) > 12, free
    stop = free[6:12]
    decoys = [stop[:3] + f"\x00{i}" for i in range(63)]
    req = chat("stopped", ask, max_tokens=40, temperature=0, n=2, stop=decoys + [stop])
    outs = run_all(llm_engine, [req])["stopped"]
    for index in (0, 1):
        mine = [o for o in outs if o.index == index]
        assert text_of(mine) == free[:free.index(stop)]
        assert mine[-1].finish_reason == "stop" and mine[-1].stop_reason == stop
