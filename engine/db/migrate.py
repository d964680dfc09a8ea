"""Additive schema migration: columns added to a table in a later release are added to an existing database.

The engine's tables only ever gain columns (with defaults), so ``ALTER TABLE ... ADD COLUMN`` is all it takes; a
data dir written by an older engine keeps working with a newer one.
"""

from __future__ import annotations

import logging

from sqlalchemy import Engine, MetaData, inspect
from sqlalchemy.schema import CreateColumn

log = logging.getLogger("llmops.migrate")


def add_missing_columns(engine: Engine, metadata: MetaData) -> list[str]:
    """Create missing tables and add missing columns; return ``table.column`` for each column added."""
    metadata.create_all(engine)
    added: list[str] = []
    existing_tables = set(inspect(engine).get_table_names())
    with engine.begin() as conn:
        for table in metadata.sorted_tables:
            if table.name not in existing_tables:
                continue
            have = {c["name"] for c in inspect(conn).get_columns(table.name)}
            for column in table.columns:
                if column.name in have:
                    continue
                ddl = str(CreateColumn(column).compile(dialect=engine.dialect))
                if not column.nullable and column.server_default is None:
                    ddl = ddl.replace(" NOT NULL", "")  # SQLite cannot add a NOT NULL column without a default
                conn.exec_driver_sql(f'ALTER TABLE "{table.name}" ADD COLUMN {ddl}')
                added.append(f"{table.name}.{column.name}")
    if added:
        log.info("database schema: added columns %s", ", ".join(added))
    return added
