"""requests: drop resumes (never written)

Revision ID: 0003_drop_request_resumes
Revises: 0002_summaries
Create Date: 2026-12-03 15:00:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003_drop_request_resumes'
down_revision = '0002_summaries'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.drop_column('resumes')


def downgrade() -> None:
    # 0 for the rows that exist: the value every row had, since nothing ever wrote the column
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.add_column(sa.Column('resumes', sa.Integer(), nullable=False, server_default='0'))
