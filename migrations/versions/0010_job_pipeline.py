"""The pipeline each worker chose for a job (claim size and lanes), shown by `status` and in the job object

Revision ID: 0010_job_pipeline
Revises: 0009_verification_counts
Create Date: 2026-12-11 10:00:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0010_job_pipeline'
down_revision = '0009_verification_counts'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('pipeline', sa.JSON(), nullable=False, server_default='{}'))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('pipeline')
