"""Opening the engine's database: one SQLite file in WAL mode, every table created and migrated once.

Only the engine touches it. Every transaction takes SQLite's write lock at once (``BEGIN IMMEDIATE``), so that a
compare-and-set on the desired revision cannot interleave with another writer. The audit trail is append-only:
triggers abort an UPDATE or a DELETE of its rows, and a REPLACE of one (which deletes the row it replaces without
firing DELETE triggers).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, event, text
from sqlmodel import Session, SQLModel, create_engine

from engine.db import tables  # noqa: F401 - every table registers on SQLModel.metadata before create_all
from engine.db.migrate import add_missing_columns

APPEND_ONLY = ("audit",)


def make_engine(path: Path) -> Engine:
    """A SQLAlchemy engine on a WAL-mode SQLite file; transactions take the write lock up front."""
    path.parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        f"sqlite:///{path}",
        connect_args={"check_same_thread": False, "timeout": 10, "isolation_level": None},
        json_serializer=lambda obj: json.dumps(obj, separators=(",", ":")),
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=10000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # pysqlite's own transaction handling is off (isolation_level=None): begin explicitly, and take the
        # write lock at once so that a compare-and-set on the desired revision cannot interleave.
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine



class Database:
    """The open database; ``session()`` is the one way in."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.engine = make_engine(path)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A transaction (committed on leaving, rolled back on an exception); rows stay readable after it."""
        with Session(self.engine, expire_on_commit=False) as session, session.begin():
            yield session

    def close(self) -> None:
        self.engine.dispose()


def open_database(path: Path) -> Database:
    """Open (or create) the database at ``path``: every table, every column a later release added, the triggers."""
    db = Database(path)
    add_missing_columns(db.engine, SQLModel.metadata)
    with db.engine.begin() as conn:
        for table in APPEND_ONLY:
            for op in ("UPDATE", "DELETE"):
                conn.execute(text(f"CREATE TRIGGER IF NOT EXISTS {table}_no_{op.lower()} BEFORE {op} ON {table} "
                                  f"BEGIN SELECT RAISE(ABORT, 'the {table} trail is append-only'); END"))
            # INSERT OR REPLACE deletes the row it replaces without firing DELETE triggers (unless
            # recursive_triggers is on): refuse any insert that would meet an existing row
            conn.execute(text(f"CREATE TRIGGER IF NOT EXISTS {table}_no_replace BEFORE INSERT ON {table} "
                              f"WHEN EXISTS (SELECT 1 FROM {table} WHERE id = NEW.id) "
                              f"BEGIN SELECT RAISE(ABORT, 'the {table} trail is append-only'); END"))
    return db
