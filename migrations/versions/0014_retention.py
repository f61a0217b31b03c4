"""Retention of the Files API: a file's expires_at (indexed, for the sweep), a job's output_expires_after_s and
outputs_expired_at

Revision ID: 0014_retention
Revises: 0013_swarm_snapshots
Create Date: 2026-12-08 10:00:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0014_retention'
down_revision = '0013_swarm_snapshots'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.add_column(sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True))
    op.create_index('ix_files_expires_at', 'files', ['expires_at'])
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('output_expires_after_s', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('outputs_expired_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('outputs_expired_at')
        batch_op.drop_column('output_expires_after_s')
    op.drop_index('ix_files_expires_at', table_name='files')
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.drop_column('expires_at')
