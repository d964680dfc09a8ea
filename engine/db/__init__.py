"""The database: one SQLite file (WAL), every table in one module, opened (created and migrated) once."""

from __future__ import annotations

from engine.db.database import Database, make_engine, open_database
from engine.db.migrate import add_missing_columns
from engine.db.tables import (
    ACTIVE,
    SERVING_FINISH_REASONS,
    SERVING_METRICS,
    SERVING_MINUTE,
    SERVING_RAW,
    TELEMETRY_METRICS,
    TELEMETRY_MINUTE,
    TELEMETRY_RAW,
    ApiToken,
    AuditRecord,
    AuditTally,
    BenchmarkRun,
    CalibrationRow,
    Event,
    LoginFailure,
    RequestLog,
    Revision,
    RevisionStatus,
    SavedPrompt,
    User,
)

__all__ = [
    "ACTIVE", "SERVING_FINISH_REASONS", "SERVING_METRICS", "SERVING_MINUTE", "SERVING_RAW", "TELEMETRY_METRICS",
    "TELEMETRY_MINUTE", "TELEMETRY_RAW", "ApiToken", "AuditRecord", "AuditTally", "BenchmarkRun", "CalibrationRow",
    "Database", "Event", "LoginFailure", "RequestLog", "Revision", "RevisionStatus", "SavedPrompt", "User",
    "add_missing_columns", "make_engine", "open_database",
]
