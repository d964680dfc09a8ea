"""The revision store on a real database: SQLite, or PostgreSQL on make test's second pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.db import open_database
from engine.errors import RevisionNotFoundError, StaleRevisionError
from engine.events import EventLog
from engine.revisions import RevisionStore
from tests.testkit.db import dialect, sql

pytestmark = pytest.mark.store


@pytest.fixture
def store(db_target: Path | str) -> RevisionStore:
    s = RevisionStore(open_database(db_target))
    assert s.ensure_initial({"max_num_seqs": 16})
    return s


def test_database_is_a_wal_file(store: RevisionStore) -> None:
    if dialect(store.db) != "sqlite":
        pytest.skip("SQLite's journal mode; PostgreSQL has its own write-ahead log")
    assert sql(store.db, "PRAGMA journal_mode") == [("wal",)]


def test_initial_revision_is_created_once(store: RevisionStore) -> None:
    assert not store.ensure_initial({"max_num_seqs": 99})
    desired = store.desired_revision()
    assert desired is not None and desired.id == 1 and desired.values == {"max_num_seqs": 16}
    assert desired.status == "pending"


def test_new_revision_becomes_desired_and_keeps_author_note_parent(store: RevisionStore) -> None:
    rev = store.create_revision({"max_num_seqs": 4}, base_revision=1, author="ana", note="smaller batch")
    assert rev.id == 2 and rev.parent_id == 1
    again = store.get_revision(2)
    assert (again.author, again.note, again.status, again.values) == ("ana", "smaller batch", "pending",
                                                                      {"max_num_seqs": 4})
    assert store.desired_revision_id() == 2
    assert store.get_revision(1).status == "superseded"  # pending revision 1 never ran


def test_stale_base_is_refused_and_writes_nothing(store: RevisionStore) -> None:
    store.create_revision({"max_num_seqs": 4}, base_revision=1, author="a")
    with pytest.raises(StaleRevisionError) as info:
        store.create_revision({"max_num_seqs": 8}, base_revision=1, author="b")
    assert info.value.current == 2
    assert store.head_revision_id() == 2


def test_applied_revision_supersedes_the_previous_one(store: RevisionStore) -> None:
    store.mark_applied(1)
    store.create_revision({"max_num_seqs": 4}, base_revision=1, author="a")
    assert store.get_revision(1).status == "applied"  # still running until 2 is ready
    store.mark_applied(2)
    assert [store.get_revision(i).status for i in (1, 2)] == ["superseded", "applied"]


def test_rejected_revision_hands_desired_back_to_last_applied(store: RevisionStore) -> None:
    store.mark_applied(1)
    store.create_revision({"max_num_seqs": 4}, base_revision=1, author="a")
    store.mark_rejected(2, "did not start")
    assert store.desired_revision_id() == 1
    assert store.get_revision(2).status_reason == "did not start"


def test_row_inserted_with_plain_sql_becomes_desired(store: RevisionStore) -> None:
    sql(store.db, 'INSERT INTO revision ("values", author) VALUES (:values, :author)',
        {"values": json.dumps({"max_num_seqs": 2}), "author": "dba"})
    rev = store.desired_revision()
    assert rev is not None and rev.id == 2 and rev.status == "pending" and rev.created_at > 1e9


def test_missing_revision(store: RevisionStore) -> None:
    with pytest.raises(RevisionNotFoundError):
        store.get_revision(42)


def test_events_are_ordered_and_filterable(store: RevisionStore) -> None:
    log = EventLog(store.db)
    for kind in ("starting", "ready", "failed"):
        log.add(kind, f"{kind} happened", revision_id=1)
    events = log.events()
    assert [e.kind for e in events] == ["starting", "ready", "failed"]
    assert [e.kind for e in log.events(since=events[0].id or 0)] == ["ready", "failed"]
    assert [e.kind for e in log.events(kinds=["failed"])] == ["failed"]
    assert [e.kind for e in log.events(newest_first=True, limit=1)] == ["failed"]


def test_two_store_objects_see_each_other(db_target: Path | str) -> None:
    a, b = RevisionStore(open_database(db_target)), RevisionStore(open_database(db_target))
    a.ensure_initial({"v": 1})
    b.create_revision({"v": 2}, base_revision=1, author="other process")
    assert a.desired_revision_id() == 2


def test_a_read_waits_for_no_writer_sees_only_what_is_committed_and_writes_nothing(db_target: Path | str) -> None:
    """Every transaction waits for the one that holds the database (SQLite's write lock, PostgreSQL's advisory
    lock), up to 10 s, then fails: an alert's look or a budget's count read behind a burst of writes waited that
    long. A read() takes no lock: it returns while a write is held, sees none of it, and a write in it is refused."""
    import threading

    from sqlalchemy.exc import DBAPIError
    from sqlmodel import select

    from engine.db.tables import Team

    db = open_database(db_target)
    with db.session() as s:
        s.add(Team(name="research"))
    holding, release = threading.Event(), threading.Event()

    def hold_a_write() -> None:
        with db.session() as s:
            s.add(Team(name="held"))
            s.flush()
            holding.set()
            release.wait(60)

    writer = threading.Thread(target=hold_a_write)
    writer.start()
    try:
        assert holding.wait(10)
        with db.read() as s:
            seen = [t.name for t in s.exec(select(Team)).all()]
        assert not release.is_set() and writer.is_alive()  # read while the write was held, not after it
        assert seen == ["research"]
    finally:
        release.set()
        writer.join(30)
    with pytest.raises(DBAPIError), db.read() as s:
        s.add(Team(name="sneaked in"))
        s.flush()
    with db.read() as s:
        assert sorted(t.name for t in s.exec(select(Team)).all()) == ["held", "research"]
    for n in range(3):  # writes after reads are writes again, on each pooled connection in turn (first in, first out)
        with db.session() as s:
            s.add(Team(name=f"after {n}"))
    assert sorted(n for (n,) in sql(db, "SELECT name FROM team")) == ["after 0", "after 1", "after 2", "held",
                                                                      "research"]
    db.close()
