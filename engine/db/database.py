"""Opening the engine's database by URL: SQLite (one WAL file in the data dir, the default) or PostgreSQL (psycopg
3, ``LLMOPS_DATABASE_URL``), its schema brought to this engine's revision once (engine/db/schema.py).

Only the engine touches it. Every transaction is serialized with every other writer, so that a compare-and-set on
the desired revision (and every read-then-write: lockouts, first-run rows) cannot interleave: on SQLite it takes the
write lock at once (``BEGIN IMMEDIATE``); on PostgreSQL it takes one transaction-scoped advisory lock first, in READ
COMMITTED, so each statement after it sees what the previous holder committed. ``Database.read()`` is the exception:
a read-only snapshot that takes neither, for readers that must not wait behind writers. The audit trail is append-only:
triggers abort an UPDATE or a DELETE of its rows, a REPLACE of one on SQLite (which deletes the row it replaces
without firing DELETE triggers), a TRUNCATE on PostgreSQL (which fires none either).
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import URL, Connection, Engine, create_engine, event, make_url, text
from sqlalchemy.exc import ArgumentError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlmodel import Session

from engine.db import schema
from engine.errors import DatabaseError, DatabaseUnavailableError, UnsupportedDatabaseError

log = logging.getLogger("llmops.db")

APPEND_ONLY = ("audit",)
WRITE_LOCK = 0x6C6C6D6F7073  # "llmops": PostgreSQL's advisory lock that every transaction of the engine takes
READ = "llmops_read"  # the execution option of Database.read()'s connections
WAIT = "llmops_wait_s"  # the execution option of a session(wait_s=…): its own longest wait for the lock
READ_FLUSH_WAIT_S = 0.5  # the longest a read waits for the lock to write first what it reads (buffered counts)
LOCK_TIMEOUT_S = 10  # longest wait for that lock (SQLite: for its write lock), then the write fails with a 503
CONNECT_TIMEOUT_S = 5
UNAVAILABLE = (OperationalError, InterfaceError, PoolTimeoutError)  # the database is down, gone or too busy now
RETRY_AFTER_S = 5  # what the answer to a request the database could not serve asks the client to wait


def database_url(target: Path | str | URL) -> URL:
    """The URL of a database: a Path is a SQLite file; ``postgresql://`` and ``postgres://`` mean psycopg 3."""
    if isinstance(target, Path):
        return URL.create("sqlite", database=str(target))
    try:
        url = make_url(target)
    except (ArgumentError, ValueError) as exc:  # ValueError: a port that is not a number
        raise UnsupportedDatabaseError(f"the database URL cannot be read ({str(exc)[:200]}): give sqlite:///PATH or "
                                       "postgresql://USER:PASSWORD@HOST:PORT/DBNAME") from None
    backend = url.get_backend_name()
    if backend in ("postgresql", "postgres"):
        return url.set(drivername="postgresql+psycopg")
    if backend == "sqlite" and url.database and url.database != ":memory:":
        return url.set(drivername="sqlite")
    raise UnsupportedDatabaseError(
        f"the database URL {safe_url(url)} is not supported: the engine keeps its state in a SQLite file "
        "(sqlite:///PATH) or in PostgreSQL (postgresql://USER:PASSWORD@HOST:PORT/DBNAME)")


def safe_url(url: URL | str) -> str:
    """The URL as logs and messages show it: without its password (in the URL's user part or its query)."""
    url = make_url(url) if isinstance(url, str) else url
    if "password" in url.query:
        url = url.update_query_dict({"password": "***"})
    return url.render_as_string(hide_password=True)


def _compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _sqlite_engine(url: URL) -> Engine:
    assert url.database is not None
    Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url,
        connect_args={"check_same_thread": False, "timeout": LOCK_TIMEOUT_S, "isolation_level": None},
        json_serializer=_compact,
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute(f"PRAGMA busy_timeout={LOCK_TIMEOUT_S * 1000}")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # pysqlite's own transaction handling is off (isolation_level=None): begin explicitly, and take the
        # write lock at once so that a compare-and-set on the desired revision cannot interleave. A read (READ
        # option) takes none: WAL gives it a snapshot, and query_only refuses any write in it.
        options = conn.get_execution_options()
        read = bool(options.get(READ))
        if conn.info.get("query_only", False) != read:
            conn.exec_driver_sql(f"PRAGMA query_only={int(read)}")
            conn.info["query_only"] = read
        wait_ms = round(1000 * float(options.get(WAIT, LOCK_TIMEOUT_S)))
        if conn.info.get("busy_ms", LOCK_TIMEOUT_S * 1000) != wait_ms:  # (set at connect: LOCK_TIMEOUT_S)
            conn.exec_driver_sql(f"PRAGMA busy_timeout={wait_ms}")
            conn.info["busy_ms"] = wait_ms
        conn.exec_driver_sql("BEGIN" if read else "BEGIN IMMEDIATE")

    return engine


def _postgresql_engine(url: URL) -> Engine:
    options = " ".join(filter(None, [str(url.query.get("options", "")),
                                     f"-c lock_timeout={LOCK_TIMEOUT_S}s",
                                     "-c idle_in_transaction_session_timeout=60s"]))
    engine = create_engine(
        url.difference_update_query(["options"]),
        # a connection the server dropped (a restart) is noticed at checkout and replaced, not handed out
        pool_pre_ping=True, pool_size=5, max_overflow=10, pool_timeout=LOCK_TIMEOUT_S,
        # whatever the server's default: a snapshot taken before the lock is granted would read stale rows
        isolation_level="READ COMMITTED",
        connect_args={"options": options,  # what the URL's own query sets (connect_timeout, …) is kept
                      **{k: v for k, v in (("connect_timeout", CONNECT_TIMEOUT_S),
                                           ("application_name", "llmops-engine")) if k not in url.query}},
        json_serializer=_compact,
    )

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        options = conn.get_execution_options()
        if options.get(READ):  # a read: one snapshot, no lock, no write
            conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            return
        if WAIT in options:  # this transaction's own longest wait for the lock
            # (at least 1 ms: 0 is no limit at all on PostgreSQL, where SQLite's busy_timeout 0 fails at once)
            conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{max(1, round(1000 * float(options[WAIT])))}ms'")
        # in READ COMMITTED each statement after the lock sees what the previous holder committed
        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({WRITE_LOCK})")

    return engine


def make_engine(target: Path | str | URL) -> Engine:
    """A SQLAlchemy engine on the database; every transaction is serialized with every other (see the module)."""
    url = database_url(target)
    return _sqlite_engine(url) if url.get_backend_name() == "sqlite" else _postgresql_engine(url)


class Database:
    """The open database; ``session()`` is the one way in."""

    def __init__(self, target: Path | str | URL) -> None:
        self.url = database_url(target)
        self.dialect = self.url.get_backend_name()
        self.path = Path(self.url.database) if self.dialect == "sqlite" and self.url.database else None
        self.engine = make_engine(self.url)
        self._reader = self.engine.execution_options(**{READ: True})
        self.applied: list[str] = []  # the schema revisions open_database applied

    @property
    def where(self) -> str:
        """The database as messages name it: its file, or its URL without the password."""
        return str(self.path) if self.path is not None else safe_url(self.url)

    def unreachable(self, exc: BaseException) -> DatabaseUnavailableError:
        """The error that says this database could not be reached or used, and what to do (no password)."""
        return DatabaseUnavailableError(f"the database {self.where} cannot be reached or used "
                                        f"({unavailable_reason(exc)}): start it, or correct LLMOPS_DATABASE_URL")

    @contextmanager
    def session(self, wait_s: float | None = None) -> Iterator[Session]:
        """A transaction (committed on leaving, rolled back on an exception); rows stay readable after it.
        ``wait_s``: its longest wait for the lock (default LOCK_TIMEOUT_S), for a write that may as well be done
        later rather than hold up who asked for it (a flush before a read)."""
        bind = self.engine if wait_s is None else self.engine.execution_options(**{WAIT: wait_s})
        with Session(bind, expire_on_commit=False) as session, session.begin():
            yield session

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A transaction that only reads: one snapshot of what is committed, taking no lock, so it waits for no
        writer and no writer waits for it (a session() waits up to LOCK_TIMEOUT_S behind every other). A write in it
        is refused by the database. For what reads and decides nothing it writes (alerts' looks, budgets'
        counts), never for a read-then-write."""
        with Session(self._reader, expire_on_commit=False) as session, session.begin():
            yield session

    @contextmanager
    def read_connection(self) -> Iterator[Connection]:
        """read()'s snapshot as a Core connection, for SQL expressions over tables (engine/metrics/series.py)."""
        with self._reader.connect() as conn, conn.begin():
            yield conn

    def close(self) -> None:
        self.engine.dispose()


def _append_only_sqlite(conn: Connection, table: str) -> None:
    for op in ("UPDATE", "DELETE"):
        conn.execute(text(f"CREATE TRIGGER IF NOT EXISTS {table}_no_{op.lower()} BEFORE {op} ON {table} "
                          f"BEGIN SELECT RAISE(ABORT, 'the {table} trail is append-only'); END"))
    # INSERT OR REPLACE deletes the row it replaces without firing DELETE triggers (unless recursive_triggers is
    # on): refuse any insert that would meet an existing row
    conn.execute(text(f"CREATE TRIGGER IF NOT EXISTS {table}_no_replace BEFORE INSERT ON {table} "
                      f"WHEN EXISTS (SELECT 1 FROM {table} WHERE id = NEW.id) "
                      f"BEGIN SELECT RAISE(ABORT, 'the {table} trail is append-only'); END"))


def _append_only_postgresql(conn: Connection, table: str) -> None:
    # an UPDATE, a DELETE, an INSERT ... ON CONFLICT DO UPDATE (which fires UPDATE triggers) and a TRUNCATE (which
    # fires no row trigger) all meet the same refusal; an INSERT of an existing id already fails on the key
    have = set(conn.execute(text("SELECT tgname FROM pg_trigger WHERE tgrelid = CAST(:t AS regclass)"),
                            {"t": f'"{table}"'}).scalars())
    wanted = {f"{table}_no_change": "BEFORE UPDATE OR DELETE ON {t} FOR EACH ROW",
              f"{table}_no_truncate": "BEFORE TRUNCATE ON {t} FOR EACH STATEMENT"}
    if set(wanted) <= have:
        return
    conn.execute(text(
        "CREATE OR REPLACE FUNCTION llmops_append_only() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "RAISE EXCEPTION 'the % trail is append-only', TG_TABLE_NAME USING ERRCODE = 'restrict_violation'; "
        "END $$"))
    for name, when in wanted.items():
        if name not in have:
            conn.execute(text(f'CREATE TRIGGER {name} {when.format(t=chr(34) + table + chr(34))} '
                              "EXECUTE FUNCTION llmops_append_only()"))


def ensure_append_only(conn: Connection) -> None:
    """The audit's triggers, made if missing (idempotent: every open checks, so a migration that rebuilds the table
    on SQLite, which drops its triggers, gets them back)."""
    for table in APPEND_ONLY:
        if conn.dialect.name == "sqlite":
            _append_only_sqlite(conn, table)
        else:
            _append_only_postgresql(conn, table)


def open_database(target: Path | str | URL) -> Database:
    """Open (or create) the database: a SQLite file (a Path, or a sqlite:/// URL) or a PostgreSQL URL. Its schema is
    brought to this engine's revision (SchemaTooNewError, nothing changed, when a newer engine wrote it), and the
    audit's triggers are made."""
    db = Database(target)
    try:
        with db.engine.connect() as conn:
            sqlite = conn.dialect.name == "sqlite"
            if sqlite:  # SQLite's way to rebuild a table that others point at: foreign keys off, outside the
                # transaction (inside one the pragma does nothing), checked before the commit, then on again
                conn.connection.dbapi_connection.execute("PRAGMA foreign_keys=OFF")  # type: ignore[union-attr]
            try:
                with conn.begin():
                    db.applied = schema.migrate(conn, db.where)
                    ensure_append_only(conn)
                    if sqlite and db.applied and (broken := conn.exec_driver_sql(
                            "PRAGMA foreign_key_check").fetchall()):
                        raise DatabaseError(f"the schema upgrade of {db.where} would leave rows pointing at "
                                            f"nothing ({broken[:3]}): nothing was changed")
            finally:
                if sqlite:
                    conn.connection.dbapi_connection.execute("PRAGMA foreign_keys=ON")  # type: ignore[union-attr]
    except UNAVAILABLE as exc:
        db.close()
        raise db.unreachable(exc) from None
    except BaseException:
        db.close()
        raise
    if db.applied:
        log.info("database %s: schema upgraded through revision(s) %s", db.where, ", ".join(db.applied))
    return db


def unavailable_message(exc: BaseException, reading: bool = False) -> str:
    """What an API answer says of a request the database could not serve (with a 503 and Retry-After); ``reading``:
    the request only reads (a GET, a token's check), so nothing was to be recorded."""
    reason = unavailable_reason(exc)
    if isinstance(getattr(exc, "orig", None), sqlite3.Error) and reading:  # an I/O error, a damaged file
        return (f"the engine's database could not be read ({reason}); nothing was changed: try again in a few "
                "seconds, and if it persists check the disk and the database file under the data dir")
    if isinstance(getattr(exc, "orig", None), sqlite3.Error):  # a full disk, a read-only file, a lock held too long
        return (f"the engine's database could not be written ({reason}); the change was not recorded: free disk "
                "space under the data dir, or try again")
    if isinstance(exc, PoolTimeoutError):
        reason = "every connection to it is busy"
    return (f"the engine's database is unavailable ({reason}); the request was not carried out and nothing was "
            "recorded: try again in a few seconds (the engine reconnects by itself once the database is back)")


def unavailable_reason(exc: BaseException) -> str:
    """What the driver said of a database that could not be used, on one short line (no URL, no password)."""
    orig = getattr(exc, "orig", None)
    reason = str(orig if orig is not None else exc).strip().splitlines()
    return (reason[0] if reason else type(exc).__name__)[:200]
