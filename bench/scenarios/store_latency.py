"""What one store operation costs on SQLite and on PostgreSQL (a throwaway local server, unix socket): each is one
serialized transaction (BEGIN IMMEDIATE, or the advisory lock on PostgreSQL), so this is also what the lock costs.

    python -m bench store-latency              # both databases, 300 of each operation
    python -m bench store-latency --n 1000

Prints JSON and writes it to ``store-latency.json`` under ``--out``: per database and operation, the median and p95
in milliseconds (wall clock, one thread). The PostgreSQL server runs without fsync (tests/testkit/postgres.py): its
figures are the engine's side of the cost, not a durable server's commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from engine.access import AuditLog, Auth
from engine.db import Database, open_database
from engine.events import EventLog
from engine.revisions import RevisionStore


def timed(n: int, op: Callable[[int], object]) -> dict[str, float]:
    took = []
    for i in range(n):
        t0 = time.perf_counter()
        op(i)
        took.append((time.perf_counter() - t0) * 1000)
    took.sort()
    return {"median_ms": round(statistics.median(took), 3), "p95_ms": round(took[int(0.95 * (n - 1))], 3)}


def measure(db: Database, n: int) -> dict[str, dict[str, float]]:
    revisions, events, audit, auth = RevisionStore(db), EventLog(db), AuditLog(db), Auth(db)
    revisions.ensure_initial({"max_num_seqs": 16})
    token, _ = auth.create_token("bench", "admin")
    return {
        "event add": timed(n, lambda i: events.add("bench", f"event {i}", data={"i": i})),
        "audit record": timed(n, lambda i: audit.record(actor="bench", action="bench.write", target=f"t {i}",
                                                        after={"i": i})),
        "revision compare-and-set": timed(n, lambda i: revisions.create_revision(
            {"max_num_seqs": i % 64 + 1}, base_revision=revisions.desired_revision_id(), author="bench")),
        "desired revision read": timed(n, lambda _: revisions.desired_revision()),
        "token check": timed(n, lambda _: auth.authenticate(token)),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=300)


def run(args: argparse.Namespace) -> None:
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        db = open_database(Path(tmp) / "bench.db")
        out["sqlite"] = measure(db, args.n)
        db.close()
    from tests.testkit.postgres import PostgresServer, find_bindir

    bindir = find_bindir()
    if bindir is None:
        out["postgresql"] = "no PostgreSQL server binaries here (apt-get install postgresql)"
    else:
        server = PostgresServer(bindir)
        try:
            server.start()
            db = open_database(server.create_database("bench"))
            out["postgresql"] = measure(db, args.n)
            db.close()
        finally:
            server.remove()
    print(json.dumps(out, indent=2))
    (args.out / "store-latency.json").write_text(json.dumps(out, indent=1) + "\n")

