"""The suite's collection order (tests/conftest.py): a test marked ``last_in_module`` runs after its file's
other tests however the tests were named, and each file's tests stay together."""

from __future__ import annotations

from tests.conftest import LONG_FILES, pytest_collection_modifyitems


class _Item:
    def __init__(self, nodeid: str, last: bool = False) -> None:
        self.nodeid = nodeid
        self.last = last

    def get_closest_marker(self, name: str) -> object | None:
        return object() if self.last and name == "last_in_module" else None


def test_a_last_in_module_test_runs_after_its_files_others_and_files_stay_together():
    named = [  # as a sorted list of ids names them: the killing test first
        _Item("tests/fleet/test_fleet.py::test_a_replica_killed_mid_stream", last=True),
        _Item("tests/fleet/test_fleet.py::test_a_stopped_router_means_a_coded_refusal_then_recovery"),
        _Item("tests/test_auth.py::test_one"),
        _Item("tests/fleet/test_fleet.py::test_every_protocol_through_the_front_end_equals_a_single_server"),
        _Item(f"{LONG_FILES[0]}::test_long"),
    ]
    items = list(named)
    pytest_collection_modifyitems(items)
    assert [i.nodeid for i in items] == [named[4].nodeid, named[1].nodeid, named[3].nodeid, named[0].nodeid,
                                         named[2].nodeid]
