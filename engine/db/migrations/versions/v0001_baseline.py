"""Baseline: the schema of the last release before Alembic (commit 1e3340b), frozen here.

Revision ID: 0001
Revises:
Create Date: 2026-12-01

On an empty database it creates every table and index of that release. On a database that release (or an older
one) made, which has no ``alembic_version`` table, it creates only the tables that are missing and adds the
columns an older release lacked (the additive migration engine/db/migrate.py did until then), so such a data dir is
adopted in place with nothing lost; Alembic then stamps it 0001.

On PostgreSQL (new with this revision: no database there predates it) the same tables are made with every integer
column a BIGINT, as wide as SQLite's INTEGER; on SQLite the DDL is exactly that release's.

Never edit this file to change the schema: write a new revision (``llmops db revision -m "..."``). The tables here
are copied, not imported, from engine/db/tables.py so that later changes to that module do not change what the
baseline means.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

_NOW = {"sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
        "postgresql": "(extract(epoch from now())::double precision)"}

_TELEMETRY = ("mem_used", "mem_total", "util_gpu", "util_mem", "power_w", "power_limit_w", "energy_j", "temp_c",
              "mem_temp_c", "sm_clock_mhz", "mem_clock_mhz", "fan_pct", "pcie_tx_kbs", "pcie_rx_kbs", "vllm_mem")
_SERVING = ("requests_running", "requests_waiting", "kv_cache_usage", "preemptions_per_s", "prompt_tokens_per_s",
            "generation_tokens_per_s", "ttft_seconds_p50", "ttft_seconds_p95", "ttft_seconds_p99", "itl_seconds_p50",
            "itl_seconds_p95", "itl_seconds_p99", "e2e_seconds_p50", "e2e_seconds_p95", "e2e_seconds_p99",
            "queue_seconds_p95", "finished_stop_per_s", "finished_length_per_s", "finished_abort_per_s",
            "finished_error_per_s")


_INT = sa.Integer().with_variant(sa.BigInteger(), "postgresql")  # 64 bits, as SQLite's INTEGER


def _str(name: str, **kw: object) -> sa.Column[str]:
    return sa.Column(name, sa.String(), nullable=False, **kw)  # type: ignore[arg-type]


def baseline(dialect: str) -> sa.MetaData:
    """Every table of release 1e3340b, as that release declared it (engine/db/tables.py at that commit)."""
    m = sa.MetaData()
    sa.Table("revision", m,
             sa.Column("id", _INT, primary_key=True),
             sa.Column("values", sa.JSON(), nullable=False),
             _str("author", server_default="unknown"),
             _str("note", server_default=""),
             sa.Column("created_at", sa.Float(), nullable=False, server_default=sa.text(_NOW[dialect])),
             sa.Column("parent_id", _INT, sa.ForeignKey("revision.id"), nullable=True),
             _str("status", server_default="pending", index=True),
             _str("status_reason", server_default=""),
             sa.Column("status_at", sa.Float(), nullable=True),
             sa.Column("forced", sa.Boolean(), nullable=False, server_default="0"),
             sa.Column("warnings", sa.JSON(), nullable=False, server_default="[]"))
    sa.Table("event", m,
             sa.Column("id", _INT, primary_key=True),
             sa.Column("ts", sa.Float(), nullable=False, index=True),
             _str("kind", index=True),
             _str("severity"),
             _str("message"),
             sa.Column("revision_id", _INT, nullable=True),
             sa.Column("data", sa.JSON(), nullable=False, server_default="{}"))
    sa.Table("saved_prompt", m,
             sa.Column("id", _INT, primary_key=True),
             _str("name", index=True),
             _str("mode"),
             _str("system"),
             _str("prompt"),
             sa.Column("params", sa.JSON(), nullable=False, server_default="{}"),
             _str("author"),
             sa.Column("created_at", sa.Float(), nullable=False))
    sa.Table("user", m,
             sa.Column("id", _INT, primary_key=True),
             _str("username", index=True, unique=True),
             _str("password_hash"),
             _str("role"),
             sa.Column("disabled", sa.Boolean(), nullable=False),
             sa.Column("failed_attempts", _INT, nullable=False),
             sa.Column("locked_until", sa.Float(), nullable=True),
             sa.Column("created_at", sa.Float(), nullable=False),
             sa.Column("last_login", sa.Float(), nullable=True))
    sa.Table("api_token", m,
             sa.Column("id", _INT, primary_key=True),
             _str("name"),
             _str("digest", index=True, unique=True),
             _str("prefix"),
             _str("role"),
             _str("kind"),
             sa.Column("user_id", _INT, nullable=True),
             _str("created_by"),
             sa.Column("created_at", sa.Float(), nullable=False),
             sa.Column("expires_at", sa.Float(), nullable=True),
             sa.Column("revoked_at", sa.Float(), nullable=True),
             sa.Column("last_used_at", sa.Float(), nullable=True),
             sa.Column("rate_limit_per_min", _INT, nullable=True))
    sa.Table("audit", m,
             sa.Column("id", _INT, primary_key=True),
             sa.Column("ts", sa.Float(), nullable=False, index=True),
             _str("actor", index=True),
             _str("role"),
             _str("action", index=True),
             _str("target"),
             sa.Column("before", sa.JSON(), nullable=True),
             sa.Column("after", sa.JSON(), nullable=True),
             _str("source"),
             sa.Column("result", _INT, nullable=False),
             _str("detail"))
    sa.Table("calibration", m,
             sa.Column("id", _INT, primary_key=True),
             sa.Column("ts", sa.Float(), nullable=False),
             _str("host", index=True),
             _str("model", index=True),
             sa.Column("revision_id", _INT, nullable=True),
             sa.Column("tensor_parallel_size", _INT, nullable=False),
             _str("dtype"),
             sa.Column("enforce_eager", sa.Boolean(), nullable=False),
             *(sa.Column(n, _INT, nullable=False) for n in ("batched_tokens", "max_num_seqs", "weights",
                                                                     "activation", "activation_estimate",
                                                                     "non_torch")),
             sa.Column("device_total", _INT, nullable=True),
             sa.Column("kv_bytes", _INT, nullable=False),
             sa.Column("kv_tokens", _INT, nullable=True))
    sa.Table("request_log", m,
             sa.Column("id", _INT, primary_key=True),
             sa.Column("ts", sa.Float(), nullable=False, index=True),
             sa.Column("revision_id", _INT, nullable=True, index=True),
             _str("model"),
             _str("endpoint"),
             sa.Column("stream", sa.Boolean(), nullable=False),
             sa.Column("status", _INT, nullable=False),
             sa.Column("input_tokens", _INT, nullable=True),
             sa.Column("output_tokens", _INT, nullable=True),
             sa.Column("ttft_s", sa.Float(), nullable=True),
             sa.Column("latency_s", sa.Float(), nullable=False),
             _str("client"),
             *(sa.Column(n, sa.String(), nullable=True) for n in ("error", "prompt", "instance")))
    sa.Table("benchmark_run", m,
             sa.Column("id", _INT, primary_key=True),
             _str("kind"),
             sa.Column("revision_id", _INT, nullable=True, index=True),
             _str("preset"),
             sa.Column("params", sa.JSON(), nullable=False),
             _str("status"),
             sa.Column("progress", sa.JSON(), nullable=False),
             sa.Column("results", sa.JSON(), nullable=False),
             sa.Column("proposal", sa.JSON(), nullable=True),
             sa.Column("error", sa.String(), nullable=True),
             _str("author"),
             sa.Column("started_at", sa.Float(), nullable=False),
             sa.Column("finished_at", sa.Float(), nullable=True))
    for name, key, metrics in (("telemetry", "device", _TELEMETRY), ("serving", "revision", _SERVING)):
        sa.Table(f"{name}_raw", m, sa.Column("ts", sa.Float(), nullable=False), sa.Column(key, _INT),
                 *(sa.Column(x, sa.Float()) for x in metrics), sa.Index(f"ix_{name}_raw_ts", "ts"))
        sa.Table(f"{name}_minute", m, sa.Column("ts", sa.Float(), nullable=False), sa.Column(key, _INT),
                 sa.Column("n", _INT),
                 *(sa.Column(f"{x}_{agg}", sa.Float()) for x in metrics for agg in ("min", "avg", "max")),
                 sa.Index(f"ix_{name}_minute_ts", "ts"))
    return m


def upgrade() -> None:
    bind = op.get_bind()
    metadata = baseline(bind.dialect.name)
    existing = set(sa.inspect(bind).get_table_names())
    metadata.create_all(bind, checkfirst=True)
    for table in metadata.sorted_tables:
        if table.name not in existing:
            continue
        have = {c["name"] for c in sa.inspect(bind).get_columns(table.name)}
        for column in table.columns:
            if column.name not in have:  # a data dir from before the column was added: the column, with its default
                copy = column._copy()
                if not copy.nullable and copy.server_default is None:
                    copy.nullable = True  # SQLite cannot add a NOT NULL column without a default
                op.add_column(table.name, copy)


def downgrade() -> None:
    raise NotImplementedError("the baseline is the oldest schema there is: nothing to go back to")
