"""The fleet's two replicas start as soon as collection has picked a fleet test, so their model loading
(~10 s of CPU) overlaps the tests that run before them, which mostly keep one core of two busy."""

from __future__ import annotations

import pytest

EARLY_REPLICAS = pytest.StashKey[dict]()


@pytest.hookimpl(trylast=True)  # after -m / -k deselection
def pytest_collection_modifyitems(session, config, items) -> None:
    import os
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # every xdist worker collects every test: the fixture starts them where they run
    if any(item.nodeid.startswith("tests/fleet/test_fleet.py::") for item in items):
        from tests.fleet.test_fleet import SMG, start_replicas

        if SMG is not None:
            config.stash[EARLY_REPLICAS] = start_replicas()


def pytest_unconfigure(config) -> None:
    early = config.stash.get(EARLY_REPLICAS, None)
    if early is not None:
        for proc in early["procs"].values():
            proc.stop()
