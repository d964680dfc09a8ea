"""each deployment's replicas against its load over time (autoscaling)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05 15:02:11.000000

Written after `llmops db revision -m "..."`'s shape (the tables in engine/db/tables.py, series_tables): test it with
`pytest tests/unit/test_schema.py` (SQLite) and `make test` (PostgreSQL too).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision: str | None = '0007'
branch_labels: str | None = None
depends_on: str | None = None

METRICS = ("replicas_serving", "replicas_wanted", "load")
BIG = sa.Integer().with_variant(sa.BigInteger(), 'postgresql')


def upgrade() -> None:
    op.create_table('scaling_minute',
    sa.Column('ts', sa.Float(), nullable=False),
    sa.Column('deployment', BIG, nullable=True),
    sa.Column('n', BIG, nullable=True),
    *(sa.Column(f'{m}_{agg}', sa.Float(), nullable=True) for m in METRICS for agg in ('min', 'avg', 'max'))
    )
    with op.batch_alter_table('scaling_minute', schema=None) as batch_op:
        batch_op.create_index('ix_scaling_minute_ts', ['ts'], unique=False)

    op.create_table('scaling_raw',
    sa.Column('ts', sa.Float(), nullable=False),
    sa.Column('deployment', BIG, nullable=True),
    *(sa.Column(m, sa.Float(), nullable=True) for m in METRICS)
    )
    with op.batch_alter_table('scaling_raw', schema=None) as batch_op:
        batch_op.create_index('ix_scaling_raw_ts', ['ts'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('scaling_raw', schema=None) as batch_op:
        batch_op.drop_index('ix_scaling_raw_ts')
    op.drop_table('scaling_raw')
    with op.batch_alter_table('scaling_minute', schema=None) as batch_op:
        batch_op.drop_index('ix_scaling_minute_ts')
    op.drop_table('scaling_minute')
