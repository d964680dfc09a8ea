"""The database: one SQLite file (WAL), every table in one module, opened (created and migrated) once."""

from __future__ import annotations

from engine.db.database import Database, make_engine, open_database
from engine.db.migrate import add_missing_columns
from engine.db.tables import (
    ACTIVE,
    DEFAULT_DEPLOYMENT,
    SERVING_FINISH_REASONS,
    SERVING_METRICS,
    SERVING_MINUTE,
    SERVING_RAW,
    TELEMETRY_METRICS,
    TELEMETRY_MINUTE,
    TELEMETRY_RAW,
    ApiToken,
    AuditRecord,
    BenchmarkRun,
    CalibrationRow,
    Deployment,
    Event,
    RequestLog,
    Revision,
    RevisionStatus,
    SavedPrompt,
    User,
)

__all__ = [
    "ACTIVE", "DEFAULT_DEPLOYMENT", "SERVING_FINISH_REASONS", "SERVING_METRICS", "SERVING_MINUTE", "SERVING_RAW",
    "TELEMETRY_METRICS", "TELEMETRY_MINUTE", "TELEMETRY_RAW", "ApiToken", "AuditRecord", "BenchmarkRun",
    "CalibrationRow", "Database", "Deployment", "Event", "RequestLog", "Revision", "RevisionStatus", "SavedPrompt",
    "User", "add_missing_columns", "make_engine", "open_database",
]
