"""The database: one SQLite file (WAL), its tables and their additive migration."""

from __future__ import annotations

from engine.db.migrate import add_missing_columns
from engine.db.store import ACTIVE, Event, Revision, RevisionStatus, SavedPrompt, Store, make_engine

__all__ = [
    "ACTIVE",
    "Event",
    "Revision",
    "RevisionStatus",
    "SavedPrompt",
    "Store",
    "add_missing_columns",
    "make_engine",
]
