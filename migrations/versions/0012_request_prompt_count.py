"""requests: prompt_count = len(prompt_ids), so a batch's usage sums a column instead of parsing every prompt

Revision ID: 0012_request_prompt_count
Revises: 0011_openai_files
Create Date: 2026-12-05 14:30:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0012_request_prompt_count'
down_revision = '0011_openai_files'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.add_column(sa.Column('prompt_count', sa.Integer(), nullable=False, server_default='0'))
    # the rows that exist: json_array_length is in SQLite and PostgreSQL alike
    op.execute("UPDATE requests SET prompt_count = json_array_length(prompt_ids)")


def downgrade() -> None:
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.drop_column('prompt_count')
