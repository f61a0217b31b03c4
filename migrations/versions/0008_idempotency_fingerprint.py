"""API idempotency keys: the fingerprint of the batch first submitted under a key

Revision ID: 0008_idempotency_fingerprint
Revises: 0007_job_kind_and_summary_state
Create Date: 2026-12-04 10:00:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0008_idempotency_fingerprint'
down_revision = '0007_job_kind_and_summary_state'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('idempotency_fingerprint', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('idempotency_fingerprint')
