"""A data dir written by an older engine keeps working: missing columns are added, rows kept."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from engine.capacity import CalibrationStore
from engine.db import open_database
from engine.revisions import RevisionStore


def test_old_tables_gain_new_columns_and_keep_their_rows(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    conn = sqlite3.connect(db)
    conn.executescript("""
        CREATE TABLE revision (id INTEGER PRIMARY KEY, "values" JSON NOT NULL, author VARCHAR DEFAULT 'unknown',
            note VARCHAR DEFAULT '', created_at FLOAT, parent_id INTEGER, status VARCHAR DEFAULT 'pending',
            status_reason VARCHAR DEFAULT '', status_at FLOAT, forced BOOLEAN DEFAULT 0);
        INSERT INTO revision ("values", author, created_at) VALUES ('{"max_num_seqs": 4}', 'old', 1.0);
        CREATE TABLE calibration (id INTEGER PRIMARY KEY, ts FLOAT, host VARCHAR, model VARCHAR, revision_id INTEGER,
            tensor_parallel_size INTEGER, dtype VARCHAR, enforce_eager BOOLEAN, batched_tokens INTEGER,
            max_num_seqs INTEGER, weights INTEGER, activation INTEGER, non_torch INTEGER, device_total INTEGER,
            kv_bytes INTEGER, kv_tokens INTEGER);
    """)
    conn.commit()
    conn.close()
    opened = open_database(db)
    rev = RevisionStore(opened).desired_revision()
    assert rev is not None and rev.values == {"max_num_seqs": 4} and rev.warnings == []
    calibrations = CalibrationStore(opened)
    assert calibrations.latest("m", 1, "auto") is None
    columns = {r[1] for r in sqlite3.connect(db).execute("PRAGMA table_info(calibration)")}
    assert "activation_estimate" in columns
