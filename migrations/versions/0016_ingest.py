"""Validation of a batch's lines off the request: a job's ingest_offset (None once its lines are all checked) and
ingest_line

Revision ID: 0016_ingest
Revises: 0015_request_embedding
Create Date: 2026-12-05 21:00:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0016_ingest'
down_revision = '0015_request_embedding'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # existing jobs were checked at submission: NULL, as a job whose lines are all checked
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('ingest_offset', sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column('ingest_line', sa.Integer(), server_default='0', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('ingest_line')
        batch_op.drop_column('ingest_offset')
