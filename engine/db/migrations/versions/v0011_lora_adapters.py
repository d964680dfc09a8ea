"""lora adapters of a deployment, usage per model

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06 00:40:00

Written against the tables in engine/db/tables.py (LoraAdapter): tested by `pytest tests/unit/test_schema.py`
(SQLite) and `make test` (PostgreSQL too).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0011'
down_revision: str | None = '0010'
branch_labels: str | None = None
depends_on: str | None = None

BIG = sa.Integer().with_variant(sa.BigInteger(), 'postgresql')


def upgrade() -> None:
    op.create_table('lora_adapter',
    sa.Column('id', BIG, nullable=False),
    sa.Column('deployment_id', BIG, nullable=False),
    sa.Column('name', sa.String(), nullable=False),
    sa.Column('path', sa.String(), nullable=False),
    sa.Column('rank', BIG, nullable=False),
    sa.Column('alpha', sa.Float(), nullable=False),
    sa.Column('target_modules', sa.JSON(), nullable=False),
    sa.Column('base_model', sa.String(), nullable=False),
    sa.Column('size_bytes', BIG, nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('created_by', sa.String(), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sqlite_autoincrement=True
    )
    with op.batch_alter_table('lora_adapter', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_lora_adapter_deployment_id'), ['deployment_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_lora_adapter_name'), ['name'], unique=True)

    # usage you can bill per model a request named (a deployment's, or one of its LoRA adapters)
    with op.batch_alter_table('usage_day', schema=None) as batch_op:
        batch_op.add_column(sa.Column('model', sa.String(), server_default='', nullable=False))
        batch_op.drop_constraint('uq_usage_day', type_='unique')
        batch_op.create_unique_constraint('uq_usage_day', ['day', 'key_id', 'team_id', 'deployment_id', 'model'])


def downgrade() -> None:
    with op.batch_alter_table('usage_day', schema=None) as batch_op:
        batch_op.drop_constraint('uq_usage_day', type_='unique')
        batch_op.drop_column('model')
        batch_op.create_unique_constraint('uq_usage_day', ['day', 'key_id', 'team_id', 'deployment_id'])
    with op.batch_alter_table('lora_adapter', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_lora_adapter_name'))
        batch_op.drop_index(batch_op.f('ix_lora_adapter_deployment_id'))
    op.drop_table('lora_adapter')
