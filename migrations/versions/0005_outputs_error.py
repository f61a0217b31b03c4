"""an ended summary job records why its Markdown pages could not be written (the sweep retries them)

Revision ID: 0005_outputs_error
Revises: 0004_worker_maintenance
Create Date: 2026-12-04 10:00:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0005_outputs_error'
down_revision = '0004_worker_maintenance'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('outputs_error', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('outputs_error')
