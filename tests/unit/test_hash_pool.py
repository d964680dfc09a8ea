"""The sign-in hashing pool's bounds (engine/access/hashing.py): each source's share, and places given back
whatever happens to a job — a sign-in whose caller went away before its hash ran must not hold its place."""

from __future__ import annotations

import threading

import pytest

from engine.access.hashing import HashBusyError, HashPool
from tests.testkit.wait import wait_until


def test_a_source_holds_its_share_and_a_cancelled_job_gives_its_place_back() -> None:
    pool = HashPool(workers=1, queue=4, per_source=2)
    release = threading.Event()
    running = pool.submit(release.wait, 30, source="a")
    queued = pool.submit(lambda: None, source="a")
    with pytest.raises(HashBusyError):
        pool.submit(lambda: None, source="a")  # its share: 2
    other = pool.submit(lambda: None, source="b")  # another source still has room
    assert queued.cancel()  # its caller went away before the hash ran
    again = pool.submit(lambda: None, source="a")  # the place came back
    release.set()
    for job in (running, other, again):
        job.result(timeout=30)
    wait_until(lambda: pool.admitted == 0 and pool._by_source == {}, 10, what="every place given back")
