"""ids are never reused: SQLite's AUTOINCREMENT on every table whose rows can be deleted

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05 02:10:00

Without AUTOINCREMENT, SQLite gives a new row the largest id in the table plus one: deleting a deployment (its
revisions, events, runs and ledger rows, the newest ids) handed its deployment id, its revision numbers and its log
to the next one made, and the audit's "what happened next" showed the other's (issue 31). With it, SQLite keeps the
largest id ever given (sqlite_sequence) and never gives it again, as PostgreSQL's sequences already do. Each table
is rebuilt on SQLite (batch mode copies its rows, their ids included, and so seeds the sequence); nothing changes on
PostgreSQL. The audit is append-only (its rows are never deleted), so its ids cannot be reused and it is left alone.
"""

from __future__ import annotations

from alembic import op

revision = '0006'
down_revision: str | None = '0005'
branch_labels: str | None = None
depends_on: str | None = None

TABLES = ("deployment", "revision", "event", "saved_prompt", "user", "api_token", "audit_tally", "calibration",
          "request_log", "benchmark_run")


def _rebuild(autoincrement: bool) -> None:
    # each table is dropped and its copy renamed into place while others point at it (a revision's events): the
    # engine runs migrations with SQLite's foreign keys off and checks them before the commit (open_database)
    for table in TABLES:
        with op.batch_alter_table(table, recreate="always", table_kwargs={"sqlite_autoincrement": autoincrement}):
            pass


def upgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    _rebuild(True)


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    _rebuild(False)
